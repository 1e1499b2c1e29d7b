//! A connection's incoming frames: `keratin_proto`'s length-prefixed frames read into one
//! buffer, with memory claimed for each large frame before its body is read.
//!
//! A frame's bytes arrive as fast as the client sends them, so a frame announced at 16 MiB and
//! sent slowly holds what has arrived for as long as that takes; a thousand such connections
//! would hold 16 GiB. A frame longer than [`FRAME_CLAIM_BYTES_MIN`] is therefore claimed whole
//! from the node's [`MemoryClaims`] as soon as its length prefix is read, and nothing more of it
//! is read until the claim is granted: while memory is short, TCP flow control holds the client
//! back. A claim still refused after [`FRAME_CLAIM_WAIT`] ends the read with
//! [`Incoming::NoMemory`] (the connection answers 429 reason `memory` and closes). The claim
//! comes out with the frame, and is held for as long as the frame's bytes are: a publish holds
//! it until it is answered.
//!
//! Frames up to [`FRAME_CLAIM_BYTES_MIN`] are not claimed: 1,024 connections each midway through
//! one hold 64 MiB at most.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use keratin_limits::{ClaimRefused, MemoryClaim, MemoryClaims};
use keratin_proto::codec::{LENGTH_OFFSET, LENGTH_SIZE, TYPE_OFFSET};
use keratin_proto::frame::Frame;
use keratin_proto::{FrameCodec, ProtoError};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::time::Instant;
use tokio_util::codec::Decoder;

/// Frames longer than this (length prefix included) are claimed before their body is read.
pub(crate) const FRAME_CLAIM_BYTES_MIN: usize = 64 << 10;

/// How long a large frame waits for its claim before the connection is refused.
pub(crate) const FRAME_CLAIM_WAIT: Duration = Duration::from_secs(5);

/// How often a waiting claim is tried again (claims are decided from each memory sample and
/// freed as other frames finish).
const FRAME_CLAIM_RETRY: Duration = Duration::from_millis(50);

/// Bytes asked of the socket at a time when the buffer has no room left.
const READ_CHUNK_BYTES: usize = 8 << 10;

/// What [`FrameReader::next`] read.
#[derive(Debug)]
pub(crate) enum Incoming {
    /// A whole frame, and the claim of its bytes if it is a large one.
    Frame(Frame, Option<MemoryClaim>),
    /// The client closed the connection between frames.
    Closed,
    /// A frame that breaks the protocol, a connection closed midway through one, or a failed
    /// read.
    Bad(ProtoError),
    /// A large frame whose memory claim stayed refused for [`FRAME_CLAIM_WAIT`].
    NoMemory {
        /// The frame's size, length prefix included.
        size_bytes: usize,
        /// The last refusal.
        refused: ClaimRefused,
    },
}

/// See the module docs.
pub(crate) struct FrameReader<R> {
    read: R,
    buf: BytesMut,
    codec: FrameCodec,
    claims: Arc<MemoryClaims>,
    /// The claim of the frame being read, if it is a large one.
    claim: Option<MemoryClaim>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader of `read` that starts with the bytes already read (`leftover`).
    pub(crate) fn new(
        read: R,
        codec: FrameCodec,
        leftover: BytesMut,
        claims: Arc<MemoryClaims>,
    ) -> Self {
        FrameReader {
            read,
            buf: leftover,
            codec,
            claims,
            claim: None,
        }
    }

    /// The next frame. Cancel-safe: a frame half read stays buffered (with its claim) for the
    /// next call.
    pub(crate) async fn next(&mut self) -> Incoming {
        loop {
            match self.codec.decode(&mut self.buf) {
                Ok(Some(frame)) => {
                    super::connection::shrink_retained(&mut self.buf);
                    return Incoming::Frame(frame, self.claim.take());
                }
                Ok(None) => {}
                Err(error) => return Incoming::Bad(error),
            }
            if self.claim.is_none() {
                if let Some(size_bytes) = announced_size(&self.buf) {
                    if size_bytes > FRAME_CLAIM_BYTES_MIN {
                        match self.claim_frame(size_bytes).await {
                            Ok(claim) => {
                                self.claim = Some(claim);
                                self.buf.reserve(size_bytes.saturating_sub(self.buf.len()));
                            }
                            Err(refused) => {
                                return Incoming::NoMemory {
                                    size_bytes,
                                    refused,
                                }
                            }
                        }
                    }
                }
            }
            if self.buf.capacity() == self.buf.len() {
                self.buf.reserve(READ_CHUNK_BYTES);
            }
            match self.read.read_buf(&mut self.buf).await {
                Ok(0) if self.buf.is_empty() => return Incoming::Closed,
                Ok(0) => {
                    return Incoming::Bad(ProtoError::UnexpectedEof {
                        buffered_bytes: self.buf.len(),
                    })
                }
                Ok(_) => {}
                Err(error) => return Incoming::Bad(ProtoError::Io(error)),
            }
        }
    }

    /// Claims a frame of `size_bytes`, trying again until [`FRAME_CLAIM_WAIT`] has passed (a
    /// frame held back is counted once among the refusals).
    async fn claim_frame(&self, size_bytes: usize) -> Result<MemoryClaim, ClaimRefused> {
        let deadline = Instant::now() + FRAME_CLAIM_WAIT;
        let bytes = size_bytes as u64;
        let mut refused = match self.claims.claim(bytes) {
            Ok(claim) => return Ok(claim),
            Err(refused) => refused,
        };
        loop {
            if Instant::now() >= deadline {
                return Err(refused);
            }
            tokio::time::sleep(FRAME_CLAIM_RETRY).await;
            match self.claims.claim_again(bytes) {
                Ok(claim) => return Ok(claim),
                Err(again) => refused = again,
            }
        }
    }
}

/// The whole size of the frame at the front of `buf` (length prefix included), once its
/// length prefix is there. The codec has already refused a prefix above the frame size limit.
fn announced_size(buf: &[u8]) -> Option<usize> {
    let prefix: [u8; LENGTH_SIZE] = buf.get(LENGTH_OFFSET..TYPE_OFFSET)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(prefix))
        .ok()?
        .checked_add(LENGTH_SIZE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keratin_proto::frame::{Close, Message, Publish, PublishMode};
    use tokio::io::AsyncWriteExt;

    fn encoded(frame: &Frame) -> Vec<u8> {
        let mut out = BytesMut::new();
        tokio_util::codec::Encoder::encode(&mut FrameCodec::default(), frame, &mut out)
            .expect("encode");
        out.to_vec()
    }

    /// A publish of one message just over the claim threshold.
    fn large_publish() -> Frame {
        Frame::Publish(Publish {
            queue: "q".into(),
            mode: PublishMode::Confirmed,
            messages: vec![Message {
                publish_id: 1,
                routing_key: None,
                headers: Vec::new(),
                body: vec![7u8; FRAME_CLAIM_BYTES_MIN].into(),
                sequence: None,
            }],
            joinable: false,
            producer_id: None,
        })
    }

    #[tokio::test]
    async fn a_large_frame_is_claimed_while_it_is_read_and_the_claim_comes_out_with_it() {
        let claims = MemoryClaims::new();
        let (mut client, server) = tokio::io::duplex(1 << 10);
        let mut reader = FrameReader::new(
            server,
            FrameCodec::default(),
            BytesMut::new(),
            claims.clone(),
        );
        let bytes = encoded(&large_publish());
        let size = bytes.len() as u64;
        let read = tokio::spawn(async move { (reader.next().await, reader) });
        client.write_all(&bytes[..1000]).await.expect("write");
        // Midway through the frame: the reader holds its claim and waits for the rest.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(claims.claimed_bytes(), size);
        client.write_all(&bytes[1000..]).await.expect("write");
        let (incoming, _reader) = read.await.expect("reader");
        let Incoming::Frame(Frame::Publish(_), Some(claim)) = incoming else {
            panic!("expected a publish and its claim, got {incoming:?}");
        };
        assert_eq!(claim.bytes(), size);
        drop(claim);
        assert_eq!(claims.claimed_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_large_frame_refused_memory_reads_no_body_and_gives_up_after_the_wait() {
        let claims = MemoryClaims::new();
        claims.observe(990, 1000, 2000);
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let mut reader = FrameReader::new(
            server,
            FrameCodec::default(),
            BytesMut::new(),
            claims.clone(),
        );
        client
            .write_all(&encoded(&large_publish()))
            .await
            .expect("write");
        let started = tokio::time::Instant::now();
        let incoming = reader.next().await;
        assert!(started.elapsed() >= FRAME_CLAIM_WAIT);
        match incoming {
            Incoming::NoMemory {
                size_bytes,
                refused,
            } => {
                assert!(size_bytes > FRAME_CLAIM_BYTES_MIN);
                assert_eq!(refused.retry_after_ms, 2000);
            }
            other => panic!("expected NoMemory, got {other:?}"),
        }
        assert!(
            reader.buf.len() < READ_CHUNK_BYTES + 64,
            "the body was not read: {} bytes buffered",
            reader.buf.len()
        );
        assert_eq!(claims.claimed_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_frame_goes_on_once_memory_frees() {
        let claims = MemoryClaims::new();
        claims.observe(990, 1000, 2000);
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let mut reader = FrameReader::new(
            server,
            FrameCodec::default(),
            BytesMut::new(),
            claims.clone(),
        );
        client
            .write_all(&encoded(&large_publish()))
            .await
            .expect("write");
        let freer = {
            let claims = claims.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                claims.observe(100, u64::MAX, 2000);
            })
        };
        assert!(matches!(reader.next().await, Incoming::Frame(_, Some(_))));
        freer.await.expect("freer");
    }

    #[tokio::test]
    async fn small_frames_take_no_claim_and_a_clean_close_between_frames_is_closed() {
        let claims = MemoryClaims::new();
        claims.observe(990, 1000, 2000);
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let mut reader = FrameReader::new(
            server,
            FrameCodec::default(),
            BytesMut::new(),
            claims.clone(),
        );
        let small = Frame::Close(Close {
            message: "bye".into(),
        });
        client.write_all(&encoded(&small)).await.expect("write");
        drop(client);
        assert!(matches!(reader.next().await, Incoming::Frame(_, None)));
        assert!(matches!(reader.next().await, Incoming::Closed));
    }

    #[tokio::test]
    async fn a_connection_closed_midway_through_a_frame_is_bad() {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let mut reader = FrameReader::new(
            server,
            FrameCodec::default(),
            BytesMut::new(),
            MemoryClaims::new(),
        );
        let bytes = encoded(&Frame::Close(Close {
            message: "bye".into(),
        }));
        client.write_all(&bytes[..3]).await.expect("write");
        drop(client);
        assert!(matches!(
            reader.next().await,
            Incoming::Bad(ProtoError::UnexpectedEof { buffered_bytes: 3 })
        ));
    }
}
