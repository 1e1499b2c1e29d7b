//! Heartbeat coalescing: callers leave `(group, payload)` heartbeats for a peer
//! ([`crate::Transport::heartbeat`]); one ticker task per transport sends, every
//! `TransportOptions::heartbeat_tick`, one `HeartbeatBatch` frame per peer carrying all of them
//! (more than one only if they exceed the frame size limit), and routes the per-group replies of
//! the answering `HeartbeatReplies` frame back to each caller.
//!
//! A group's newer heartbeat replaces an older one still waiting for the tick (its caller gets
//! `NetError::Superseded`): a heartbeat only says "I am still leader as of now", so only the
//! newest matters.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use crate::connection::{lock, Connection, Waiter};
use crate::context::{wait_shutdown, Context};
use crate::frame::{Frame, HEADER_SIZE};
use crate::peer::{Peer, PendingHeartbeats, Standing};
use crate::stats::add;
use crate::{GroupId, NetError};

/// Bytes a `HeartbeatBatch` needs besides its entries: header, batch_id u64, count u32.
const BATCH_FIXED_SIZE: usize = HEADER_SIZE + 8 + 4;
/// Bytes an entry needs besides its payload: group u64, payload length u32.
pub(crate) const ENTRY_FIXED_SIZE: usize = 8 + 4;
/// Heartbeats waiting for one peer's next tick. One per group at most, so this bounds the groups
/// a node may lead towards one peer at once: 100,000 is 50 times the 2,000 partitions a node is
/// expected to hold, at about 100 bytes each (10 MB) when all are waiting.
pub(crate) const PENDING_HEARTBEATS_MAX: usize = 100_000;

/// Runs the ticker until the transport shuts down.
pub(crate) async fn run_heartbeats(context: Arc<Context>) {
    let mut shutdown = context.shutdown_signal();
    let mut tick = tokio::time::interval(context.options.heartbeat_tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = wait_shutdown(&mut shutdown) => return,
            _ = tick.tick() => {}
        }
        // A snapshot, so that no lock on the map is held while flushing; a peer removed since
        // is retired, and `flush` finds nothing pending for it (its connection is closed).
        for peer in context.peers() {
            flush(&context, &peer);
        }
    }
}

/// Leaves a heartbeat for the next tick; the returned receiver gets the group's reply.
pub(crate) fn enqueue(
    peer: &Peer,
    group: GroupId,
    payload: Bytes,
    waiter: Waiter,
) -> Result<(), NetError> {
    let mut pending = lock(&peer.heartbeats);
    // Checked under the lock `Peer::retire` drains, so no heartbeat is left behind a retirement.
    if peer.standing() != Standing::Active {
        return Err(peer.unreachable());
    }
    if pending.len() >= PENDING_HEARTBEATS_MAX && !pending.contains_key(&group) {
        return Err(NetError::Backlogged { to: peer.id });
    }
    if let Some((_, older)) = pending.insert(group, (payload, waiter)) {
        let _ = older.send(Err(NetError::Superseded { to: peer.id, group }));
    }
    Ok(())
}

/// Sends everything pending for `peer` in as few frames as the frame size limit allows.
fn flush(context: &Context, peer: &Peer) {
    let pending: PendingHeartbeats = std::mem::take(&mut *lock(&peer.heartbeats));
    if pending.is_empty() {
        return;
    }
    let Some(connection) = peer.current() else {
        for (_, (_, waiter)) in pending {
            let _ = waiter.send(Err(peer.unreachable()));
        }
        return;
    };
    let frame_size_max = context.options.frame_size_bytes_max as usize;
    let mut entries = Vec::new();
    let mut waiters = HashMap::new();
    let mut size = BATCH_FIXED_SIZE;
    for (group, (payload, waiter)) in pending {
        let entry_size = ENTRY_FIXED_SIZE + payload.len();
        if !entries.is_empty() && size + entry_size > frame_size_max {
            send_batch(
                context,
                &connection,
                std::mem::take(&mut entries),
                std::mem::take(&mut waiters),
            );
            size = BATCH_FIXED_SIZE;
        }
        size += entry_size;
        entries.push((group, payload));
        waiters.insert(group, waiter);
    }
    send_batch(context, &connection, entries, waiters);
}

fn send_batch(
    context: &Context,
    connection: &Connection,
    entries: Vec<(GroupId, Bytes)>,
    waiters: HashMap<GroupId, Waiter>,
) {
    let count = entries.len() as u64;
    let batch_id = match connection.register_batch(waiters) {
        Ok(batch_id) => batch_id,
        Err(_) => return, // closed: the waiters were dropped and their callers see Closed
    };
    let frame = Frame::HeartbeatBatch { batch_id, entries };
    // Never wait here: one slow peer must not delay the others' heartbeats.
    match connection.try_send(&frame) {
        Ok(()) => {
            add(&context.stats.heartbeat_frames_sent, 1);
            add(&context.stats.heartbeats_sent, count);
        }
        Err(error) => {
            for (_, waiter) in connection.unregister_batch(batch_id) {
                let _ = waiter.send(Err(error.clone()));
            }
        }
    }
}
