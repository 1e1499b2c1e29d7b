//! A partition: its durable state machine (`state`), the pure step from commands to records
//! (`prepare`), and the task that owns it (`owner`).

pub(crate) mod delivery_state;
pub(crate) mod owner;
pub(crate) mod prepare;
pub mod state;
