//! Serving a peer's requests and heartbeat batches with the [`crate::Handler`]: at most
//! `served_in_flight_max` at once per connection (beyond it a `codes::BUSY` refusal, so the
//! reader never waits for a handler), each in its own task, its reply queued on the connection.

use std::sync::Arc;

use bytes::Bytes;

use crate::codes;
use crate::connection::Connection;
use crate::context::Context;
use crate::error::RemoteError;
use crate::frame::Frame;
use crate::stats::add;
use crate::{GroupId, NodeId};

pub(crate) fn serve_request(
    context: &Context,
    from: NodeId,
    connection: &Arc<Connection>,
    request_id: u64,
    group: GroupId,
    kind: u8,
    body: Bytes,
) {
    let Ok(permit) = Arc::clone(&connection.served).try_acquire_owned() else {
        add(&context.stats.requests_refused_busy, 1);
        let error = busy(context);
        let _ = connection.try_send(&Frame::Refusal { request_id, error });
        return;
    };
    let reply = context.handler.call(from, group, kind, body);
    let connection = Arc::clone(connection);
    tokio::spawn(async move {
        let frame = match reply.await {
            Ok(body) => Frame::Response { request_id, body },
            Err(error) => Frame::Refusal { request_id, error },
        };
        let frame = if connection.fits(frame.size_bytes()) {
            frame
        } else {
            let error = RemoteError::new(
                codes::REPLY_TOO_LARGE,
                format!(
                    "reply of {} bytes exceeds the frame size limit",
                    frame.size_bytes()
                ),
            );
            Frame::Refusal { request_id, error }
        };
        let _ = connection.send(&frame).await;
        drop(permit);
    });
}

pub(crate) fn serve_heartbeats(
    context: &Context,
    from: NodeId,
    connection: &Arc<Connection>,
    batch_id: u64,
    entries: Vec<(GroupId, Bytes)>,
) {
    add(&context.stats.heartbeat_frames_received, 1);
    let Ok(permit) = Arc::clone(&connection.served).try_acquire_owned() else {
        add(&context.stats.requests_refused_busy, 1);
        let error = busy(context);
        let replies = entries
            .into_iter()
            .map(|(group, _)| (group, Err(error.clone())))
            .collect();
        let _ = connection.try_send(&Frame::HeartbeatReplies { batch_id, replies });
        return;
    };
    let replies = context.handler.heartbeats(from, entries);
    let connection = Arc::clone(connection);
    tokio::spawn(async move {
        let replies = replies.await;
        let mut frame = Frame::HeartbeatReplies { batch_id, replies };
        if !connection.fits(frame.size_bytes()) {
            let size_bytes = frame.size_bytes();
            if let Frame::HeartbeatReplies { replies, .. } = &mut frame {
                let error = RemoteError::new(
                    codes::REPLY_TOO_LARGE,
                    format!("heartbeat replies of {size_bytes} bytes exceed the frame size limit"),
                );
                for (_, reply) in replies.iter_mut() {
                    *reply = Err(error.clone());
                }
            }
        }
        let _ = connection.send(&frame).await;
        drop(permit);
    });
}

fn busy(context: &Context) -> RemoteError {
    RemoteError::new(
        codes::BUSY,
        format!(
            "node {} is serving {} requests from this connection already; retry later",
            context.node_id, context.options.served_in_flight_max
        ),
    )
}
