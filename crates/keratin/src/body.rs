//! The self-checking body that `keratin publish` writes and `keratin consume --verify` checks,
//! so a test can prove that every delivered message is one that was published, intact.
//!
//! ```text
//! +----------------+---------------------+------------------+
//! | seq: u64 (8)   | filler (size - 12)  | crc32c: u32 (4)  |
//! +----------------+---------------------+------------------+
//! ```
//! All integers little-endian. The CRC32C covers every byte before it. The filler is a fixed
//! pattern; it carries no meaning beyond making the body `size` bytes long.

/// Bytes of the sequence number at the start of a body.
pub const SEQ_SIZE_BYTES: usize = 8;
/// Bytes of the CRC32C at the end of a body.
pub const CRC_SIZE_BYTES: usize = 4;
/// The smallest body: a sequence number and a checksum, no filler.
pub const BODY_SIZE_BYTES_MIN: usize = SEQ_SIZE_BYTES + CRC_SIZE_BYTES;

/// What [`check`] found in a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// The checksum matches: the sequence number can be trusted.
    Intact { seq: u64 },
    /// Too short or the checksum does not match; `seq` is whatever the first 8 bytes say, if
    /// there are 8.
    Corrupt { seq: Option<u64> },
}

/// A body of `size_bytes` (at least [`BODY_SIZE_BYTES_MIN`]) carrying `seq`.
pub fn encode(seq: u64, size_bytes: usize) -> Vec<u8> {
    assert!(
        size_bytes >= BODY_SIZE_BYTES_MIN,
        "the caller checks --size"
    );
    let mut body = Vec::with_capacity(size_bytes);
    body.extend_from_slice(&seq.to_le_bytes());
    let filler_size_bytes = size_bytes - BODY_SIZE_BYTES_MIN;
    body.extend((0..filler_size_bytes).map(|index| b'a' + (index % 26) as u8));
    let crc = crc32c::crc32c(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(body.len(), size_bytes);
    body
}

/// The sequence number in `body`, whether the checksum matches or not.
pub fn seq(body: &[u8]) -> Option<u64> {
    let bytes: [u8; SEQ_SIZE_BYTES] = body.get(..SEQ_SIZE_BYTES)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// Checks `body`'s length and checksum.
pub fn check(body: &[u8]) -> Checked {
    let seq = seq(body);
    if body.len() < BODY_SIZE_BYTES_MIN {
        return Checked::Corrupt { seq };
    }
    let (covered, stored) = body.split_at(body.len() - CRC_SIZE_BYTES);
    let stored = stored
        .try_into()
        .map(u32::from_le_bytes)
        .unwrap_or_default();
    match seq {
        Some(seq) if crc32c::crc32c(covered) == stored => Checked::Intact { seq },
        _ => Checked::Corrupt { seq },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_roundtrip_at_every_small_size() {
        for size in BODY_SIZE_BYTES_MIN..100 {
            let body = encode(42 + size as u64, size);
            assert_eq!(body.len(), size);
            assert_eq!(
                check(&body),
                Checked::Intact {
                    seq: 42 + size as u64
                }
            );
        }
    }

    #[test]
    fn any_flipped_bit_is_caught() {
        let body = encode(7, 40);
        for index in 0..body.len() {
            let mut bad = body.clone();
            bad[index] ^= 0x10;
            assert!(
                matches!(check(&bad), Checked::Corrupt { .. }),
                "byte {index}"
            );
        }
        assert_eq!(check(&body[..11]), Checked::Corrupt { seq: Some(7) });
        assert_eq!(check(b"hi"), Checked::Corrupt { seq: None });
    }
}
