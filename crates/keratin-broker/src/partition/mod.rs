//! A partition: its durable state machine (`state`), the pure step from commands to records
//! (`prepare`), its log as the owner sees it (`log`, with the single-node `local_log`), the
//! leader-only delivery state (`delivery_state`), where dead-lettered messages go
//! (`dead_letter`), and the task that owns it all (`owner`).

pub mod dead_letter;
pub(crate) mod delivery_state;
pub mod local_log;
pub mod log;
pub(crate) mod owner;
pub(crate) mod prepare;
pub mod state;
