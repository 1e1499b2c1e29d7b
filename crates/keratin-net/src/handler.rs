//! [`Handler`]: what the application (the Raft adapter) plugs in to serve requests and heartbeat
//! batches from peers. The transport calls it concurrently, at most
//! `TransportOptions::served_in_flight_max` calls per connection at a time.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

use crate::error::RemoteError;
use crate::{codes, GroupId, NodeId};

/// A boxed, sendable future: what [`Handler`] methods return.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Serves peers' requests. Implementations are cheap to call: they hand the work to the group's
/// task and return a future of its reply. The transport runs each returned future in its own
/// task.
///
/// The connection's reader never waits for a handler (beyond `served_in_flight_max` it refuses
/// with `codes::BUSY`), so a handler may itself call any peer, the sender included.
pub trait Handler: Send + Sync + 'static {
    /// Serves one request from node `from` for `group`. `Err` reaches the caller as
    /// [`crate::NetError::Refused`] with the same code and message.
    fn call(
        &self,
        from: NodeId,
        group: GroupId,
        kind: u8,
        body: Bytes,
    ) -> BoxFuture<Result<Bytes, RemoteError>>;

    /// Serves one coalesced heartbeat batch from node `from`: one payload per group. Returns a
    /// reply per group, in one frame; groups left out get `codes::NO_REPLY`. The default
    /// refuses every group with `codes::NOT_SUPPORTED`.
    fn heartbeats(
        &self,
        from: NodeId,
        batch: Vec<(GroupId, Bytes)>,
    ) -> BoxFuture<Vec<(GroupId, Result<Bytes, RemoteError>)>> {
        let _ = from;
        let replies = batch
            .into_iter()
            .map(|(group, _)| {
                let error =
                    RemoteError::new(codes::NOT_SUPPORTED, "this node serves no heartbeats");
                (group, Err(error))
            })
            .collect();
        Box::pin(std::future::ready(replies))
    }

    /// Node `from` told its label ([`crate::Transport::set_label`]): the newest replaces any
    /// earlier one. Called on the connection's reader, so it must not block. The default
    /// ignores it.
    fn label(&self, from: NodeId, label: Bytes) {
        let _ = (from, label);
    }
}
