//! A partition: its durable state machine (`state`) and the task that owns it (`owner`).

pub(crate) mod owner;
pub mod producers;
pub mod state;
