//! The admin API's read-only view of streams (issue 18, `docs/streams.md`):
//! `GET /api/v1/streams` and `GET /api/v1/streams/{name}`, and their JSON. Declaring, changing
//! and deleting streams go through the protocol and the CLI, not here; who may read which
//! stream is `auth.rs`'s (the same rule as for queues: one name space).

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keratin_broker::stream::{CursorState, StreamInfo, StreamPartitionFigures};
use keratin_broker::Broker;
use serde_json::{json, Value};

use super::error_response;

/// `GET /api/v1/streams`: the streams the user has a permission on, without their cursors.
pub(crate) async fn streams(
    State(broker): State<Broker>,
    axum::Extension(grant): axum::Extension<crate::access::Grant>,
) -> Json<Value> {
    let list: Vec<Value> = broker
        .list_streams()
        .iter()
        .filter(|s| grant.sees(&s.name))
        .map(stream_json)
        .collect();
    Json(json!({ "streams": list }))
}

/// `GET /api/v1/streams/{name}`: one stream with its cursors, each with its positions and lag.
pub(crate) async fn stream(State(broker): State<Broker>, Path(name): Path<String>) -> Response {
    let stream = match broker.stream(&name) {
        Ok(stream) => stream,
        Err(error) => return error_response(&error),
    };
    // Figures first, cursors second: a commit between the two can only make a lag read too
    // high by what was committed meanwhile, never negative (the lag saturates at 0).
    let info = stream.info();
    let cursors: Vec<Value> = stream
        .cursor_list()
        .iter()
        .map(|(cursor, state)| cursor_json(cursor, state, &info.partitions))
        .collect();
    let groups: Vec<Value> = info
        .groups
        .iter()
        .map(|group| {
            json!({
                "cursor": group.cursor,
                "members": group.members.iter().map(|(id, partitions)| json!({
                    "id": id,
                    "partitions": partitions,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let mut document = stream_json(&info);
    let cursor_log = stream.cursor_log_figures();
    // Who serves the stream's readers: the node leading its cursor log (this one on a single
    // node).
    document["cursor_log"] = json!({
        "leading": cursor_log.role.leading,
        "leader": if cursor_log.role.leading { None } else { cursor_log.role.leader },
        "disk_bytes": cursor_log.disk_bytes,
    });
    document["cursors"] = json!(cursors);
    document["groups"] = json!(groups);
    Json(document).into_response()
}

/// A stream as JSON: settings, totals, retention's removals and per-partition figures.
pub(crate) fn stream_json(info: &StreamInfo) -> Value {
    let removed: serde_json::Map<String, Value> = info
        .removed
        .iter()
        .map(|(bound, removed)| {
            (
                (*bound).to_string(),
                json!({ "segments": removed.segments, "bytes": removed.bytes }),
            )
        })
        .collect();
    json!({
        "name": info.name,
        "settings": {
            "partitions": info.settings.partitions,
            "max_bytes": info.settings.max_bytes,
            "max_age_ms": info.settings.max_age_ms,
            "max_messages": info.settings.max_messages,
        },
        "messages": info.partitions.iter().map(|p| p.messages).sum::<u64>(),
        "bytes": info.partitions.iter().map(|p| p.bytes).sum::<u64>(),
        "disk_bytes": info.disk_bytes(),
        "oldest_timestamp_ms": info.partitions.iter().filter_map(|p| p.oldest_timestamp_ms).min(),
        "stopped": info.partitions.iter().any(|p| p.stopped),
        "removed": removed,
        "cursors_moved": info.cursors_moved,
        "cursor_count": info.cursors,
        "partitions": info.partitions.iter().enumerate().map(|(index, p)| json!({
            "index": index,
            "start": p.start,
            "end": p.end,
            "messages": p.messages,
            "bytes": p.bytes,
            "disk_bytes": p.disk_bytes,
            "oldest_timestamp_ms": p.oldest_timestamp_ms,
            "removed_segments": p.removed_segments,
            "removed_bytes": p.removed_bytes,
            "stopped": p.stopped,
            "leading": p.leading,
            "leader": p.leader,
            "stops": p.stops,
            "heals": p.heals,
        })).collect::<Vec<_>>(),
    })
}

/// A cursor as JSON: its positions by partition, its last commit and its lag.
fn cursor_json(name: &str, state: &CursorState, partitions: &[StreamPartitionFigures]) -> Value {
    let positions: serde_json::Map<String, Value> = state
        .positions
        .iter()
        .map(|(partition, offset)| (partition.to_string(), json!(offset)))
        .collect();
    json!({
        "name": name,
        "positions": positions,
        "last_used_ms": state.last_used_ms,
        "lag": cursor_lag(state, partitions),
    })
}

/// Offsets between a cursor's position and each partition's end, summed: `end - max(position,
/// start)`, a partition without a position counting from its start (where a reader of the
/// cursor would begin). The same figure as the `stream_cursor_lag_messages` metric.
pub(crate) fn cursor_lag(state: &CursorState, partitions: &[StreamPartitionFigures]) -> u64 {
    partitions
        .iter()
        .enumerate()
        .map(|(index, figures)| {
            let position = u32::try_from(index)
                .ok()
                .and_then(|index| state.positions.get(&index).copied())
                .unwrap_or(figures.start)
                .max(figures.start);
            figures.end.saturating_sub(position)
        })
        .fold(0, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(start: u64, end: u64) -> StreamPartitionFigures {
        StreamPartitionFigures {
            start,
            end,
            ..StreamPartitionFigures::default()
        }
    }

    #[test]
    fn lag_counts_from_the_start_below_it_and_where_no_position_is() {
        let mut state = CursorState::default();
        state.positions.insert(0, 2); // below partition 0's start 5: counts from 5
        state.positions.insert(1, 7); // 3 behind partition 1's end
        let partitions = [figures(5, 10), figures(0, 10), figures(4, 6)];
        assert_eq!(cursor_lag(&state, &partitions), 5 + 3 + 2);
    }

    #[tokio::test]
    async fn a_missing_stream_is_404() {
        let error = keratin_broker::BrokerError::StreamNotFound("clicks".into());
        assert_eq!(error_response(&error).status().as_u16(), 404);
    }
}
