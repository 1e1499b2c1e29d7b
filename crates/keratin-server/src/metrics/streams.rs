//! The streams' series (`docs/streams.md`, "Visibility"): per stream its messages, bytes and
//! disk bytes held, what retention removed by bound, the readers it moved to a partition's
//! start; per stream and cursor the cursor's lag.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::{gauge_family, set};
use keratin_broker::Broker;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StreamLabels {
    stream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StreamBoundLabels {
    stream: String,
    bound: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CursorLabels {
    stream: String,
    cursor: String,
}

pub(super) fn register_streams(registry: &mut Registry, broker: &Broker) {
    let messages = gauge_family::<StreamLabels>(
        registry,
        "stream_messages",
        "Messages a stream holds over its partitions",
    );
    let bytes = gauge_family::<StreamLabels>(
        registry,
        "stream_bytes",
        "Payload bytes of the messages a stream holds",
    );
    let disk = gauge_family::<StreamLabels>(
        registry,
        "stream_disk_bytes",
        "Bytes of a stream's partition logs on disk",
    );
    let removed_segments = Family::<StreamBoundLabels, Counter>::default();
    registry.register(
        "stream_retention_removed_segments",
        "Segments retention removed from a stream since the node started, by bound (size, \
         age, count)",
        removed_segments.clone(),
    );
    let removed_bytes = Family::<StreamBoundLabels, Counter>::default();
    registry.register(
        "stream_retention_removed_bytes",
        "Bytes of the segments retention removed from a stream since the node started, by \
         bound",
        removed_bytes.clone(),
    );
    let moved = Family::<StreamLabels, Counter>::default();
    registry.register(
        "stream_cursor_moved",
        "Reads of a named cursor moved to a partition's start because retention removed its \
         position, since the node started",
        moved.clone(),
    );
    let lag = gauge_family::<CursorLabels>(
        registry,
        "stream_cursor_lag_messages",
        "Offsets between a cursor's committed position and the end, summed over partitions \
         (a partition it has no position in counts from its start)",
    );
    for info in broker.list_streams() {
        let labels = StreamLabels {
            stream: info.name.clone(),
        };
        set(&messages.get_or_create(&labels), info.messages());
        set(
            &bytes.get_or_create(&labels),
            info.partitions.iter().map(|p| p.bytes).sum(),
        );
        set(&disk.get_or_create(&labels), info.disk_bytes());
        moved.get_or_create(&labels).inc_by(info.cursors_moved);
        for (bound, removed) in &info.removed {
            let labels = StreamBoundLabels {
                stream: info.name.clone(),
                bound: (*bound).to_string(),
            };
            removed_segments
                .get_or_create(&labels)
                .inc_by(removed.segments);
            removed_bytes.get_or_create(&labels).inc_by(removed.bytes);
        }
        let Ok(stream) = broker.stream(&info.name) else {
            continue;
        };
        for (cursor, state) in stream.cursor_list() {
            let behind = crate::http::streams::cursor_lag(&state, &info.partitions);
            let labels = CursorLabels {
                stream: info.name.clone(),
                cursor,
            };
            set(&lag.get_or_create(&labels), behind);
        }
    }
}
