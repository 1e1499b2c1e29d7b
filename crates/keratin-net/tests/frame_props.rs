//! Properties of the frame codec: any frame roundtrips through encode, check and decode; any
//! bytes at all make `check` and `decode` return (a frame or an error), never panic, and never
//! claim a frame larger than the limit. Would fail on a panic in a decoder or an encoder and a
//! decoder that disagree about a layout.

use bytes::{Bytes, BytesMut};
use keratin_net::frame::{Frame, FRAME_SIZE_BYTES_MAX};
use keratin_net::{GroupId, RemoteError};
use proptest::prelude::*;

fn payload() -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..64).prop_map(Bytes::from)
}

fn remote_error() -> impl Strategy<Value = RemoteError> {
    (any::<u16>(), ".{0,20}").prop_map(|(code, message)| RemoteError { code, message })
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (any::<u64>(), any::<u64>(), any::<u8>(), payload()).prop_map(
            |(request_id, group, kind, body)| {
                Frame::Request {
                    request_id,
                    group: GroupId(group),
                    kind,
                    body,
                }
            }
        ),
        (any::<u64>(), payload())
            .prop_map(|(request_id, body)| Frame::Response { request_id, body }),
        (any::<u64>(), remote_error())
            .prop_map(|(request_id, error)| Frame::Refusal { request_id, error }),
        (
            any::<u64>(),
            proptest::collection::vec((any::<u64>(), payload()), 0..8)
        )
            .prop_map(|(batch_id, entries)| Frame::HeartbeatBatch {
                batch_id,
                entries: entries.into_iter().map(|(g, p)| (GroupId(g), p)).collect(),
            }),
        (
            any::<u64>(),
            proptest::collection::vec(
                (
                    any::<u64>(),
                    prop_oneof![payload().prop_map(Ok), remote_error().prop_map(Err)]
                ),
                0..8
            )
        )
            .prop_map(|(batch_id, replies)| Frame::HeartbeatReplies {
                batch_id,
                replies: replies.into_iter().map(|(g, r)| (GroupId(g), r)).collect(),
            }),
        any::<u64>().prop_map(|nonce| Frame::Ping { nonce }),
        any::<u64>().prop_map(|nonce| Frame::Pong { nonce }),
        remote_error().prop_map(Frame::Error),
    ]
}

proptest! {
    #[test]
    fn every_frame_roundtrips(frame in frame()) {
        let encoded = frame.encode();
        let mut wire = BytesMut::new();
        wire.extend_from_slice(&encoded.head);
        wire.extend_from_slice(&encoded.tail);
        prop_assert_eq!(wire.len(), frame.size_bytes());
        prop_assert_eq!(Frame::check(&wire, FRAME_SIZE_BYTES_MAX), Ok(Some(wire.len())));
        prop_assert_eq!(Frame::decode(wire.freeze()), Ok(frame));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256), limit in 1u32..512) {
        if let Ok(Some(size)) = Frame::check(&bytes, limit) {
            prop_assert!(size <= bytes.len() && size <= limit as usize + 4);
            let _ = Frame::decode(Bytes::copy_from_slice(&bytes[..size]));
        }
        let _ = Frame::decode(Bytes::from(bytes));
    }

    #[test]
    fn bytes_behind_a_valid_header_never_panic(
        frame_type in prop_oneof![Just(0x01u8), Just(0x02), Just(0x03), Just(0x10), Just(0x11), Just(0x20), Just(0x21), Just(0x30)],
        body in proptest::collection::vec(any::<u8>(), 0..128),
    ) {
        let mut wire = Vec::new();
        wire.extend_from_slice(&(body.len() as u32 + 1).to_le_bytes());
        wire.push(frame_type);
        wire.extend_from_slice(&body);
        prop_assert_eq!(Frame::check(&wire, FRAME_SIZE_BYTES_MAX), Ok(Some(wire.len())));
        let _ = Frame::decode(Bytes::from(wire));
    }
}
