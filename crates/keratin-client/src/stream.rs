//! The stream requests of protocol version 7 (issue 18, `docs/streams.md`) on [`Client`]:
//! declare, change retention, info, list, delete and cursor commits.
//!
//! Owns the version check that refuses a stream request on a connection that agreed on an
//! older version (before anything is sent), and the shape of each request and its answer.
//! Reading a stream belongs to `stream_consumer.rs`; publishing to one is [`Client::publish`]
//! with the stream's name (a message's routing key picks its partition).

use keratin_proto::{
    CursorCommit, CursorEntry, Frame, StreamDeclare, StreamInfoReply, StreamList, StreamRequest,
    StreamRetentionUpdate, StreamSet, StreamSettings, StreamSummary, PROTOCOL_VERSION_STREAMS,
    STREAM_PARTITIONS_MAX,
};

use crate::client::{unexpected, Client};
use crate::connection::RequestKind;
use crate::error::ClientError;

impl Client {
    /// Fails with [`ClientError::StreamsUnsupported`] unless this connection agreed on a
    /// protocol version that has streams.
    pub(crate) fn check_streams(&self) -> Result<(), ClientError> {
        let server_version = self.protocol_version();
        if server_version < PROTOCOL_VERSION_STREAMS {
            return Err(ClientError::StreamsUnsupported {
                server_version,
                needed: PROTOCOL_VERSION_STREAMS,
            });
        }
        Ok(())
    }

    /// Creates `stream`, or succeeds if it exists with the same settings (409 if they differ,
    /// or if a queue has the name). Needs protocol version 7, like every stream request.
    pub async fn declare_stream(
        &self,
        stream: &str,
        settings: StreamSettings,
    ) -> Result<(), ClientError> {
        self.declare_stream_on(stream, settings, &[]).await
    }

    /// [`Client::declare_stream`] with the stream's replicas pinned to `nodes` (a cluster's
    /// node ids, as [`Client::declare_on`]; empty lets the cluster place them).
    pub async fn declare_stream_on(
        &self,
        stream: &str,
        settings: StreamSettings,
        nodes: &[u64],
    ) -> Result<(), ClientError> {
        self.stream_request_ok(format!("declare stream {stream}"), |request_id| {
            Frame::StreamDeclare(StreamDeclare {
                request_id,
                stream: stream.to_owned(),
                settings: settings.clone(),
                nodes: nodes.to_vec(),
            })
        })
        .await
    }

    /// Changes a live stream's retention bounds (each kept, cleared or set). Partitions and
    /// replicas cannot change.
    pub async fn set_stream(
        &self,
        stream: &str,
        update: StreamRetentionUpdate,
    ) -> Result<(), ClientError> {
        self.stream_request_ok(format!("set retention of stream {stream}"), |request_id| {
            Frame::StreamSet(StreamSet {
                request_id,
                stream: stream.to_owned(),
                update: update.clone(),
            })
        })
        .await
    }

    /// Deletes `stream`, its messages and its cursors.
    pub async fn delete_stream(&self, stream: &str) -> Result<(), ClientError> {
        self.stream_request_ok(format!("delete stream {stream}"), |request_id| {
            Frame::StreamDelete(StreamRequest {
                request_id,
                stream: stream.to_owned(),
            })
        })
        .await
    }

    /// A stream's settings and, per partition, its offsets, counts, bytes and leader (the
    /// figures of the answering node's copy).
    pub async fn stream_info(&self, stream: &str) -> Result<StreamInfoReply, ClientError> {
        self.stream_info_at(stream).await.map(|(info, _)| info)
    }

    /// [`Client::stream_info`] and the connection that answered it.
    pub(crate) async fn stream_info_at(
        &self,
        stream: &str,
    ) -> Result<(StreamInfoReply, Client), ClientError> {
        let operation = format!("info of stream {stream}");
        let timeout = self.options().request_timeout;
        let (reply, node) = self
            .routed(&operation, timeout, |node| {
                let operation = operation.clone();
                async move {
                    node.check_streams()?;
                    let reply = node
                        .request(operation, RequestKind::Plain, |request_id| {
                            Frame::StreamInfo(StreamRequest {
                                request_id,
                                stream: stream.to_owned(),
                            })
                        })
                        .await?;
                    Ok((reply, node))
                }
            })
            .await?;
        match reply {
            Frame::StreamInfoReply(info) => Ok((info, node)),
            other => Err(unexpected(operation, "StreamInfoReply", &other)),
        }
    }

    /// Every stream, sorted by name.
    pub async fn list_streams(&self) -> Result<Vec<StreamSummary>, ClientError> {
        self.check_streams()?;
        let operation = "list streams".to_owned();
        let reply = self
            .request(operation.clone(), RequestKind::Plain, |request_id| {
                Frame::StreamList(StreamList { request_id })
            })
            .await?;
        match reply {
            Frame::StreamListReply(list) => Ok(list.streams),
            other => Err(unexpected(operation, "StreamListReply", &other)),
        }
    }

    /// Sets the positions of `cursor` on `stream`: for each entry, the offset of the next
    /// message the cursor reads in that partition (other partitions keep theirs). Resolves
    /// once the broker wrote the commit durably. `entries` must be 1 to 64, partitions
    /// ascending and each once.
    pub async fn commit_cursor(
        &self,
        stream: &str,
        cursor: &str,
        entries: &[CursorEntry],
    ) -> Result<(), ClientError> {
        check_entries(entries)?;
        self.stream_request_ok(
            format!("commit cursor {cursor} of stream {stream}"),
            |request_id| {
                Frame::CursorCommit(CursorCommit {
                    request_id,
                    stream: stream.to_owned(),
                    cursor: cursor.to_owned(),
                    entries: entries.to_vec(),
                })
            },
        )
        .await
    }

    /// A stream request answered by `Ok`, following 421s to the leader; each node it goes to
    /// must speak streams.
    async fn stream_request_ok(
        &self,
        operation: String,
        build: impl Fn(u64) -> Frame,
    ) -> Result<(), ClientError> {
        let timeout = self.options().request_timeout;
        let build = &build;
        self.routed(&operation, timeout, |node| {
            let operation = operation.clone();
            async move {
                node.check_streams()?;
                node.request_ok(operation, build).await
            }
        })
        .await
    }
}

/// Refuses, before sending, a commit the broker would refuse with 400: no entries, more than a
/// stream's partitions, or partitions not strictly ascending.
pub(crate) fn check_entries(entries: &[CursorEntry]) -> Result<(), ClientError> {
    if entries.is_empty() || entries.len() > STREAM_PARTITIONS_MAX {
        return Err(ClientError::InvalidArgument(format!(
            "a cursor commit names 1 to {STREAM_PARTITIONS_MAX} partitions, not {}",
            entries.len()
        )));
    }
    if let Some(pair) = entries
        .windows(2)
        .find(|pair| pair[0].partition >= pair[1].partition)
    {
        return Err(ClientError::InvalidArgument(format!(
            "a cursor commit names its partitions ascending and each once (partition {} before {})",
            pair[0].partition, pair[1].partition
        )));
    }
    Ok(())
}
