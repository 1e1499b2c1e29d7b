//! Frame and body decoding from arbitrary bytes (`keratin-proto`).
//!
//! Properties, for any input:
//! - `Frame::check` and `Frame::decode` never panic;
//! - a frame that decodes encodes back to exactly the bytes it came from (the encoding is
//!   canonical), so `decode(encode(f)) == f` too;
//! - `FrameCodec` fed the same bytes in two pieces, split at any point, yields the same frames
//!   and the same error as when fed them at once: `Incomplete` only ever means "read more".
#![no_main]

use bytes::{Bytes, BytesMut};
use keratin_proto::{Frame, FrameCodec, FrameStatus, FRAME_SIZE_BYTES_MAX};
use libfuzzer_sys::fuzz_target;
use tokio_util::codec::Decoder;

/// Frames decoded (at most this many, so a stream of tiny heartbeats stays cheap) and how the
/// stream ended: `Ok(true)` cleanly at the end of the bytes, `Ok(false)` with an incomplete
/// frame buffered, or the error's text.
fn decode_stream(pieces: &[&[u8]]) -> (Vec<Frame>, Result<bool, String>) {
    let mut codec = FrameCodec::new();
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    for piece in pieces {
        buf.extend_from_slice(piece);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(error) => return (frames, Err(error.to_string())),
            }
        }
    }
    (frames, Ok(buf.is_empty()))
}

fuzz_target!(|data: &[u8]| {
    // One frame at the front: check, decode, and re-encode it.
    if let Ok(FrameStatus::Complete { size_bytes }) = Frame::check(data, FRAME_SIZE_BYTES_MAX) {
        let bytes = Bytes::copy_from_slice(&data[..size_bytes]);
        if let Ok(frame) = Frame::decode(bytes.clone()) {
            let mut encoded = BytesMut::new();
            frame
                .encode(&mut encoded, FRAME_SIZE_BYTES_MAX)
                .expect("a decoded frame encodes");
            assert_eq!(
                encoded.as_ref(),
                bytes.as_ref(),
                "re-encoding {frame:?} changed its bytes"
            );
            let again = Frame::decode(encoded.freeze()).expect("an encoded frame decodes");
            assert_eq!(again, frame);
        }
    }
    // The same bytes as a stream, whole and split in two.
    let whole = decode_stream(&[data]);
    let split_at = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let (head, tail) = data.split_at(split_at);
    let split = decode_stream(&[head, tail]);
    assert_eq!(
        whole, split,
        "splitting the input at {split_at} changed the outcome"
    );
});
