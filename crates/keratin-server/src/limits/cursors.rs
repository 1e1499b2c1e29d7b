//! The `cursor_behind_retention` attention item (`docs/streams.md`, "Reading"): a stream's
//! named cursor whose committed position in some partition lies below the partition's start,
//! because retention removed messages the cursor had not read. The reader is moved to the start
//! when it reads (and told with `moved_from`); the item tells the operator that messages were
//! skipped, so that retention or the reader's pace can be changed.

use std::collections::BTreeSet;

use crate::attention::{AttentionKind, Raise, Severity};

use super::*;

impl NodeLimits {
    /// Raise an item for each cursor that fell behind a partition's start since the last
    /// sample; clear the items of cursors that caught up (or went).
    pub(super) fn check_cursors_behind(&self) {
        let Some(broker) = self.broker.get() else {
            return;
        };
        let mut now: BTreeSet<String> = BTreeSet::new();
        let mut messages: Vec<(String, String)> = Vec::new();
        for info in broker.list_streams() {
            let Ok(stream) = broker.stream(&info.name) else {
                continue;
            };
            for (cursor, state) in stream.cursor_list() {
                let behind: Vec<(u32, u64, u64)> = state
                    .positions
                    .iter()
                    .filter_map(|(&p, &offset)| {
                        let start = info.partitions.get(p as usize)?.start;
                        (offset < start).then_some((p, offset, start))
                    })
                    .collect();
                if behind.is_empty() {
                    continue;
                }
                let subject = format!("{}/{cursor}", info.name);
                let skipped: Vec<String> = behind
                    .iter()
                    .map(|(p, offset, start)| {
                        format!("partition {p}: at {offset}, start now {start}")
                    })
                    .collect();
                messages.push((
                    subject.clone(),
                    format!(
                        "stream {} cursor {cursor} is behind retention ({}): retention removed \
                         messages it had not read, and its reader resumes at the start; raise \
                         the stream's retention (keratin stream set) or read faster",
                        info.name,
                        skipped.join("; ")
                    ),
                ));
                now.insert(subject);
            }
        }
        let mut before = lock(&self.cursors_behind);
        for (subject, message) in messages {
            if before.contains(&subject) {
                continue;
            }
            tracing::warn!("{message}");
            self.attention.raise(Raise {
                kind: AttentionKind::CursorBehindRetention,
                subject,
                severity: Severity::Warning,
                level: None,
                message,
            });
        }
        for subject in before.difference(&now) {
            tracing::info!("stream cursor {subject} is within retention again");
            self.attention
                .clear(AttentionKind::CursorBehindRetention, subject);
        }
        *before = now;
    }
}
