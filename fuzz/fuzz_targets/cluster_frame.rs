//! Cluster frame and handshake decoding from arbitrary bytes (`keratin-net`).
//!
//! Properties, for any input:
//! - `Frame::check`, `Frame::decode`, `Hello::read` and `HelloReply::read` never panic;
//! - when `check` finds a whole frame, every shorter prefix is "read more" (`Ok(None)`), never
//!   an error;
//! - a frame that decodes encodes back to exactly the bytes it came from, with the size
//!   `size_bytes` predicts, and decodes back equal;
//! - a hello or reply that reads re-encodes to exactly the bytes it took.
#![no_main]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use keratin_net::frame::{Frame, FRAME_SIZE_BYTES_MAX};
use keratin_net::handshake::{Hello, HelloReply};
use libfuzzer_sys::fuzz_target;

/// Runs a future that reads from a byte slice: such a reader never waits, so one poll finishes.
fn ready<F: Future>(future: F) -> F::Output {
    let mut context = Context::from_waker(Waker::noop());
    match pin!(future).poll(&mut context) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("a read from a byte slice waited"),
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(size)) = Frame::check(data, FRAME_SIZE_BYTES_MAX) {
        for prefix in [0, size / 2, size - 1] {
            assert_eq!(
                Frame::check(&data[..prefix], FRAME_SIZE_BYTES_MAX),
                Ok(None)
            );
        }
        let bytes = Bytes::copy_from_slice(&data[..size]);
        if let Ok(frame) = Frame::decode(bytes.clone()) {
            let encoded = frame.encode();
            let mut wire = encoded.head.to_vec();
            wire.extend_from_slice(&encoded.tail);
            assert_eq!(wire, bytes, "re-encoding {frame:?} changed its bytes");
            assert_eq!(frame.size_bytes(), size);
            let again = Frame::decode(Bytes::from(wire)).expect("an encoded frame decodes");
            assert_eq!(again, frame);
        }
    }
    let _ = Frame::decode(Bytes::copy_from_slice(data));

    let mut reader = data;
    if let Ok(hello) = ready(Hello::read(&mut reader)) {
        let taken = data.len() - reader.len();
        assert_eq!(&hello.encode()[..], &data[..taken]);
    }
    let mut reader = data;
    if let Ok(reply) = ready(HelloReply::read(&mut reader)) {
        let taken = data.len() - reader.len();
        assert_eq!(&reply.encode()[..], &data[..taken]);
    }
});
