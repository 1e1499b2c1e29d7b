//! Primitive field readers and writers for frame bodies and hellos: little-endian integers,
//! `string` (u16 length + UTF-8) and `bytes` (u32 length), as `docs/cluster-protocol.md`
//! ("Primitive types") defines them. Every read checks the bytes left first and never panics.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::FrameError;

/// Reads fields off the front of one frame body. Slices share the frame's buffer (no copy).
pub(crate) struct Reader {
    bytes: Bytes,
    frame: &'static str,
}

impl Reader {
    pub(crate) fn new(bytes: Bytes, frame: &'static str) -> Reader {
        Reader { bytes, frame }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len()
    }

    pub(crate) fn malformed(&self, reason: &'static str) -> FrameError {
        FrameError::Malformed {
            frame: self.frame,
            reason,
        }
    }

    fn take(&mut self, size: usize, what: &'static str) -> Result<Bytes, FrameError> {
        if self.bytes.len() < size {
            return Err(self.malformed(what));
        }
        Ok(self.bytes.split_to(size))
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], FrameError> {
        let taken = self.take(N, what)?;
        let mut array = [0u8; N];
        array.copy_from_slice(&taken);
        Ok(array)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.array::<1>("truncated u8")?[0])
    }

    pub(crate) fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.array("truncated u16")?))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.array("truncated u32")?))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.array("truncated u64")?))
    }

    pub(crate) fn string(&mut self) -> Result<String, FrameError> {
        let size = usize::from(self.u16()?);
        let taken = self.take(size, "string longer than the frame")?;
        String::from_utf8(taken.to_vec()).map_err(|_| self.malformed("string is not UTF-8"))
    }

    pub(crate) fn bytes(&mut self) -> Result<Bytes, FrameError> {
        let size = usize::try_from(self.u32()?).map_err(|_| self.malformed("bytes too long"))?;
        self.take(size, "bytes longer than the frame")
    }

    /// Everything left: the tail body of `Request` and `Response`.
    pub(crate) fn rest(&mut self) -> Bytes {
        std::mem::take(&mut self.bytes)
    }

    pub(crate) fn finish(&self) -> Result<(), FrameError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(self.malformed("trailing bytes after the last field"))
        }
    }
}

/// Encoded size of a `string` field holding `text` (truncated to `u16::MAX` bytes).
pub(crate) fn string_size(text: &str) -> usize {
    2 + truncated(text).len()
}

/// `text` cut to at most `u16::MAX` bytes on a character boundary, so it always encodes.
fn truncated(text: &str) -> &str {
    let mut end = text.len().min(usize::from(u16::MAX));
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

pub(crate) fn put_string(buf: &mut BytesMut, text: &str) {
    let text = truncated(text);
    let size = u16::try_from(text.len()).unwrap_or(u16::MAX);
    buf.put_u16_le(size);
    buf.put_slice(text.as_bytes());
}

pub(crate) fn put_bytes(buf: &mut BytesMut, bytes: &[u8]) {
    // Callers check the frame size limit (at most 16 MiB), so the length fits a u32.
    let size = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    buf.put_u32_le(size);
    buf.put_slice(bytes);
}
