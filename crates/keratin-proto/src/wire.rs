//! Primitive encodings shared by frames and the handshake: little-endian integers, tags,
//! u16-prefixed UTF-8 strings, u32-prefixed byte strings, options and counted lists.
//!
//! Owns the rule that nothing is allocated from an untrusted count before the bytes that count
//! promises are known to be present. The layouts are in `docs/protocol.md` ("Primitive types").

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::{Problem, ProtoError};

/// Most list items allocated up front. A count that fits the frame is still untrusted: a 16 MiB
/// frame can claim about a million 15-byte messages and be garbage after the first. Beyond this
/// many, the vector grows only with items that actually parsed. 4,096 items of the largest item
/// type (`Message`, under 128 bytes) is under 512 KiB.
const LIST_PREALLOCATE_ITEMS_MAX: usize = 4096;

/// Value of an absent option's tag byte.
pub(crate) const OPTION_NONE: u8 = 0;
/// Value of a present option's tag byte.
pub(crate) const OPTION_SOME: u8 = 1;

/// Reads fields from one frame (or handshake message) held in memory.
///
/// Every read checks the remaining length first, so a lying length or count becomes
/// [`Problem::Truncated`] at the right offset instead of a panic or a large allocation.
pub(crate) struct Reader {
    buf: Bytes,
    position: usize,
    context: &'static str,
}

impl Reader {
    /// A reader over `buf`, whose byte 0 is the first byte of the frame's length prefix (or the
    /// handshake's magic), so that error offsets match the spec's diagrams.
    pub(crate) fn new(buf: Bytes, position: usize, context: &'static str) -> Reader {
        Reader {
            buf,
            position,
            context,
        }
    }

    /// Offset of the next byte to read.
    pub(crate) fn position(&self) -> usize {
        self.position
    }

    pub(crate) fn error(&self, field: &'static str, problem: Problem) -> ProtoError {
        ProtoError::Malformed {
            context: self.context,
            offset: self.position,
            field,
            problem,
        }
    }

    /// The error for `field`, which started at `offset` (already read past).
    pub(crate) fn error_at(
        &self,
        offset: usize,
        field: &'static str,
        problem: Problem,
    ) -> ProtoError {
        ProtoError::Malformed {
            context: self.context,
            offset,
            field,
            problem,
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.position)
    }

    /// Takes `size` bytes without copying them.
    pub(crate) fn take(&mut self, size: usize, field: &'static str) -> Result<Bytes, ProtoError> {
        if size > self.remaining() {
            return Err(self.error(field, Problem::Truncated));
        }
        let end = self.position + size; // Cannot overflow: size <= remaining.
        let taken = self.buf.slice(self.position..end);
        self.position = end;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], ProtoError> {
        let bytes = self.take(N, field)?;
        let mut array = [0u8; N];
        array.copy_from_slice(&bytes);
        Ok(array)
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, ProtoError> {
        Ok(self.array::<1>(field)?[0])
    }

    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16, ProtoError> {
        self.array(field).map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, ProtoError> {
        self.array(field).map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, ProtoError> {
        self.array(field).map(u64::from_le_bytes)
    }

    pub(crate) fn magic(&mut self, field: &'static str) -> Result<[u8; 4], ProtoError> {
        self.array(field)
    }

    /// A tag byte that must be below `tag_count`.
    pub(crate) fn tag(&mut self, field: &'static str, tag_count: u8) -> Result<u8, ProtoError> {
        let start = self.position;
        let tag = self.u8(field)?;
        if tag >= tag_count {
            self.position = start;
            return Err(self.error(field, Problem::InvalidTag(tag)));
        }
        Ok(tag)
    }

    /// The error for a tag byte `tag` of `field` that was already read (the position goes
    /// back to it, so the error points at the byte).
    pub(crate) fn invalid_tag(&mut self, field: &'static str, tag: u8) -> ProtoError {
        self.position -= 1;
        self.error(field, Problem::InvalidTag(tag))
    }

    pub(crate) fn bool(&mut self, field: &'static str) -> Result<bool, ProtoError> {
        Ok(self.tag(field, 2)? == 1)
    }

    /// A u16-length-prefixed UTF-8 string.
    pub(crate) fn string(&mut self, field: &'static str) -> Result<String, ProtoError> {
        let size = usize::from(self.u16(field)?);
        let start = self.position;
        let bytes = self.take(size, field)?;
        match std::str::from_utf8(&bytes) {
            Ok(text) => Ok(text.to_owned()),
            Err(_) => {
                self.position = start;
                Err(self.error(field, Problem::InvalidUtf8))
            }
        }
    }

    /// A u16-length-prefixed UTF-8 string of `size_min` to `size_max` bytes. A length out of
    /// bounds is refused at the length prefix, before its bytes are awaited or copied.
    pub(crate) fn string_sized(
        &mut self,
        field: &'static str,
        size_min: usize,
        size_max: usize,
    ) -> Result<String, ProtoError> {
        let start = self.position;
        let size = usize::from(self.u16(field)?);
        if !(size_min..=size_max).contains(&size) {
            self.position = start;
            return Err(self.error(
                field,
                Problem::SizeOutOfBounds {
                    size,
                    size_min,
                    size_max,
                },
            ));
        }
        self.position = start;
        self.string(field)
    }

    /// A u32-length-prefixed byte string, sliced from the frame without copying.
    pub(crate) fn bytes(&mut self, field: &'static str) -> Result<Bytes, ProtoError> {
        let size = self.u32(field)?;
        let size = usize::try_from(size).map_err(|_| self.error(field, Problem::Truncated))?;
        self.take(size, field)
    }

    /// An option: a tag byte (0 absent, 1 present) then the value.
    pub(crate) fn option<T>(
        &mut self,
        field: &'static str,
        read: impl FnOnce(&mut Reader) -> Result<T, ProtoError>,
    ) -> Result<Option<T>, ProtoError> {
        match self.tag(field, 2)? {
            OPTION_NONE => Ok(None),
            _ => read(self).map(Some),
        }
    }

    /// `count` items, each at least `item_size_min` bytes on the wire. The count is checked
    /// against the remaining bytes before the vector is allocated.
    pub(crate) fn list<T>(
        &mut self,
        field: &'static str,
        count: usize,
        item_size_min: usize,
        mut read: impl FnMut(&mut Reader) -> Result<T, ProtoError>,
    ) -> Result<Vec<T>, ProtoError> {
        debug_assert!(
            item_size_min > 0,
            "a zero-size item would let any count through"
        );
        let fits = count
            .checked_mul(item_size_min)
            .is_some_and(|size| size <= self.remaining());
        if !fits {
            return Err(self.error(field, Problem::Truncated));
        }
        let mut items = Vec::with_capacity(count.min(LIST_PREALLOCATE_ITEMS_MAX));
        for _ in 0..count {
            items.push(read(self)?);
        }
        Ok(items)
    }

    /// A list with a u32 count.
    pub(crate) fn list_u32<T>(
        &mut self,
        field: &'static str,
        item_size_min: usize,
        read: impl FnMut(&mut Reader) -> Result<T, ProtoError>,
    ) -> Result<Vec<T>, ProtoError> {
        let count = self.u32(field)?;
        let count = usize::try_from(count).map_err(|_| self.error(field, Problem::Truncated))?;
        self.list(field, count, item_size_min, read)
    }

    /// A list with a u16 count.
    pub(crate) fn list_u16<T>(
        &mut self,
        field: &'static str,
        item_size_min: usize,
        read: impl FnMut(&mut Reader) -> Result<T, ProtoError>,
    ) -> Result<Vec<T>, ProtoError> {
        let count = usize::from(self.u16(field)?);
        self.list(field, count, item_size_min, read)
    }

    /// Fails if bytes remain: a frame has exactly the fields its type defines.
    pub(crate) fn finish(self) -> Result<(), ProtoError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(self.error("end of frame", Problem::TrailingBytes(count))),
        }
    }
}

/// Writes a u16-length-prefixed string.
pub(crate) fn put_string(
    dst: &mut BytesMut,
    field: &'static str,
    text: &str,
) -> Result<(), ProtoError> {
    put_count_u16(dst, field, text.len())?;
    dst.put_slice(text.as_bytes());
    Ok(())
}

/// Writes a u32-length-prefixed byte string.
pub(crate) fn put_bytes(
    dst: &mut BytesMut,
    field: &'static str,
    bytes: &[u8],
) -> Result<(), ProtoError> {
    put_count_u32(dst, field, bytes.len())?;
    dst.put_slice(bytes);
    Ok(())
}

/// Writes a u16 length or count, failing if it does not fit.
pub(crate) fn put_count_u16(
    dst: &mut BytesMut,
    field: &'static str,
    count: usize,
) -> Result<(), ProtoError> {
    let count = u16::try_from(count).map_err(|_| ProtoError::FieldTooLong {
        field,
        size: count,
        limit: usize::from(u16::MAX),
    })?;
    dst.put_u16_le(count);
    Ok(())
}

/// Writes a u32 length or count, failing if it does not fit.
pub(crate) fn put_count_u32(
    dst: &mut BytesMut,
    field: &'static str,
    count: usize,
) -> Result<(), ProtoError> {
    let count = u32::try_from(count).map_err(|_| ProtoError::FieldTooLong {
        field,
        size: count,
        limit: usize::try_from(u32::MAX).unwrap_or(usize::MAX),
    })?;
    dst.put_u32_le(count);
    Ok(())
}

/// Writes an option's tag byte and, when present, its value.
pub(crate) fn put_option<T>(
    dst: &mut BytesMut,
    value: Option<&T>,
    write: impl FnOnce(&mut BytesMut, &T) -> Result<(), ProtoError>,
) -> Result<(), ProtoError> {
    match value {
        None => {
            dst.put_u8(OPTION_NONE);
            Ok(())
        }
        Some(value) => {
            dst.put_u8(OPTION_SOME);
            write(dst, value)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(bytes: &[u8]) -> Reader {
        Reader::new(Bytes::copy_from_slice(bytes), 0, "test")
    }

    #[test]
    fn preallocation_bound_holds_for_the_largest_list_item() {
        let largest = std::mem::size_of::<crate::frame::Message>()
            .max(std::mem::size_of::<crate::frame::QueueSummary>())
            .max(std::mem::size_of::<crate::frame::Header>());
        assert!(
            largest <= 128,
            "update LIST_PREALLOCATE_ITEMS_MAX's comment"
        );
    }

    #[test]
    fn huge_count_is_refused_before_allocating() {
        let mut r = reader(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]);
        let result = r.list_u32("ids", 8, |r| r.u64("id"));
        assert!(matches!(
            result,
            Err(ProtoError::Malformed {
                problem: Problem::Truncated,
                offset: 4,
                ..
            })
        ));
    }

    #[test]
    fn invalid_utf8_is_reported_at_the_string() {
        let mut r = reader(&[2, 0, 0xc3, 0x28]);
        let error = r.string("queue").err();
        assert!(matches!(
            error,
            Some(ProtoError::Malformed {
                problem: Problem::InvalidUtf8,
                offset: 2,
                ..
            })
        ));
    }

    #[test]
    fn bad_tags_and_trailing_bytes_are_errors() {
        assert!(reader(&[2]).bool("flag").is_err());
        assert!(reader(&[7]).option("x", |r| r.u8("x")).is_err());
        let mut r = reader(&[1, 9]);
        assert_eq!(r.u8("x").ok(), Some(1));
        assert!(matches!(
            r.finish(),
            Err(ProtoError::Malformed {
                problem: Problem::TrailingBytes(1),
                ..
            })
        ));
    }

    #[test]
    fn strings_roundtrip_and_refuse_overlong() {
        let mut dst = BytesMut::new();
        put_string(&mut dst, "s", "héllo").unwrap();
        assert_eq!(reader(&dst).string("s").unwrap(), "héllo");
        let long = "x".repeat(usize::from(u16::MAX) + 1);
        assert!(matches!(
            put_string(&mut dst, "s", &long),
            Err(ProtoError::FieldTooLong { .. })
        ));
    }
}
