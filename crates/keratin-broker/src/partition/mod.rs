//! A partition: its durable state machine (`state`), the pure step from commands to records
//! (`prepare`), its log as the owner sees it (`log`, with the single-node `local_log`), what
//! every owner of a partition log keeps about driving it (`driver`: proposals in order, role
//! and step-down grace, following, stop and heal), the
//! leader-only delivery state (`delivery_state`), where dead-lettered messages go
//! (`dead_letter`), the task that owns it all (`owner`), and the idempotent producers'
//! sequence windows (`producers`, applied with the state, carried past a removed prefix by
//! `PRODUCERS` records), and
//! how a replicated partition's copies keep up (`replication`: replicas, lag, the in-sync set).

pub mod dead_letter;
pub(crate) mod delivery_state;
pub(crate) mod driver;
pub mod local_log;
pub mod log;
#[cfg(test)]
pub(crate) mod mem_log;
pub(crate) mod owner;
pub(crate) mod prepare;
pub mod producers;
pub mod replication;
pub mod state;
