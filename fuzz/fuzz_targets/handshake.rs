//! The handshake from arbitrary bytes (`keratin-proto`): `ClientHello::decode` as the server
//! runs it and `ServerHello::decode` as the client runs it.
//!
//! Properties, for any input and each hello:
//! - decoding never panics, and takes nothing from the buffer unless it returns a hello;
//! - a hello that decodes took exactly its own bytes, and encodes back to them, and those bytes
//!   decode again to an equal hello (the version 6 login and user included: every mechanism,
//!   and the bounds of its fields, are reached from the seeds);
//! - every shorter prefix of those bytes is "read more" (`Ok(None)`), never an error: a hello
//!   split across TCP reads is accepted.
#![no_main]

use bytes::BytesMut;
use keratin_proto::{ClientHello, ProtoError, ServerHello};
use libfuzzer_sys::fuzz_target;

/// Checks the properties for one hello type, given its decoder and encoder.
fn check<T: std::fmt::Debug + PartialEq>(
    data: &[u8],
    decode: impl Fn(&mut BytesMut) -> Result<Option<T>, ProtoError>,
    encode: impl Fn(&T, &mut BytesMut) -> Result<(), ProtoError>,
) {
    let mut buf = BytesMut::from(data);
    let hello = match decode(&mut buf) {
        Ok(Some(hello)) => hello,
        Ok(None) | Err(_) => {
            assert_eq!(
                buf.as_ref(),
                data,
                "a failed or incomplete decode took bytes"
            );
            return;
        }
    };
    let taken = data.len() - buf.len();
    assert_eq!(
        buf.as_ref(),
        &data[taken..],
        "decode took bytes from the middle"
    );
    let mut encoded = BytesMut::new();
    encode(&hello, &mut encoded).expect("a decoded hello encodes");
    assert_eq!(
        encoded.as_ref(),
        &data[..taken],
        "re-encoding {hello:?} changed its bytes"
    );
    let again = decode(&mut encoded);
    assert!(
        matches!(&again, Ok(Some(again)) if *again == hello),
        "{hello:?} decoded again as {again:?}"
    );
    assert!(encoded.is_empty(), "decoding again left bytes");
    for end in 0..taken {
        let mut prefix = BytesMut::from(&data[..end]);
        match decode(&mut prefix) {
            Ok(None) => assert_eq!(prefix.len(), end, "an incomplete decode took bytes"),
            other => panic!("the first {end} of {taken} bytes of {hello:?} gave {other:?}"),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check(data, ClientHello::decode, ClientHello::encode);
    check(data, ServerHello::decode, ServerHello::encode);
});
