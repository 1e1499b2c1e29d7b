//! The on-disk layout of segment headers and records, byte by byte.
//!
//! The layout is specified in `docs/storage-format.md`; the offsets below are derived from the
//! tables there, field after field, so that the code and the spec cannot drift apart silently.
//! This module only encodes and decodes bytes: it does no I/O and knows nothing of logs.
//! All integers are little-endian.

/// Version of the segment and record layout written by this code (`docs/storage-format.md`,
/// "Version changes").
pub const LAYOUT_VERSION: u16 = 1;

/// The first eight bytes of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"KRTNSEG\0";

// Segment header fields (docs/storage-format.md, "Segment header").
const MAGIC_OFFSET: usize = 0;
const VERSION_OFFSET: usize = MAGIC_OFFSET + 8;
const CLASS_OFFSET: usize = VERSION_OFFSET + 2;
const KIND_OFFSET: usize = CLASS_OFFSET + 1;
const GENERATION_OFFSET: usize = KIND_OFFSET + 1;
const HEADER_RESERVED_OFFSET: usize = GENERATION_OFFSET + 2;
const BASE_OFFSET_OFFSET: usize = HEADER_RESERVED_OFFSET + 2;
const SIZE_OFFSET: usize = BASE_OFFSET_OFFSET + 8;
const CUT_MARK_OFFSET: usize = SIZE_OFFSET + 8;
const CUT_OFFSET_OFFSET: usize = CUT_MARK_OFFSET + 8;
const PADDING_OFFSET: usize = CUT_OFFSET_OFFSET + 8;
const HEADER_CRC_OFFSET: usize = 60;

/// Size of the segment header; the first record starts right after it.
pub const SEGMENT_HEADER_SIZE: usize = HEADER_CRC_OFFSET + 4;
const _: () = assert!(PADDING_OFFSET <= HEADER_CRC_OFFSET);
const _: () = assert!(SEGMENT_HEADER_SIZE == 64);

/// The base offset written into a spare's header: a spare belongs to no log.
pub const SPARE_BASE: u64 = u64::MAX;

// Record header fields (docs/storage-format.md, "Record").
const CRC_OFFSET: usize = 0;
const LENGTH_OFFSET: usize = CRC_OFFSET + 4;
const OFFSET_OFFSET: usize = LENGTH_OFFSET + 4;
pub(crate) const RECORD_GENERATION_OFFSET: usize = OFFSET_OFFSET + 8;
const TYPE_OFFSET: usize = RECORD_GENERATION_OFFSET + 2;
const FLAGS_OFFSET: usize = TYPE_OFFSET + 1;
const TIMESTAMP_OFFSET: usize = FLAGS_OFFSET + 1;
const DURABLE_DISTANCE_OFFSET: usize = TIMESTAMP_OFFSET + 8;

/// Size of a record header; the payload follows it.
pub const RECORD_HEADER_SIZE: usize = DURABLE_DISTANCE_OFFSET + 4;
const _: () = assert!(RECORD_HEADER_SIZE == 32);

/// `durable_distance` value meaning "this record claims nothing about durability".
pub const NO_DURABILITY_CLAIM: u32 = u32::MAX;

/// Record flag: a seal marks the end of the log at a clean close or an idle moment. It takes no
/// offset (its `offset` is the next offset to be written) and the next append overwrites it.
pub const FLAG_SEAL: u8 = 0x80;

/// Flags a caller may set; the others are reserved for the log.
pub const FLAGS_USER_MASK: u8 = 0x7f;

/// Which of the two segment sizes a file has: queue logs use `Full`, small metadata logs use
/// `Small` (one eighth of the full size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SizeClass {
    /// The configured segment size.
    Full,
    /// One eighth of the configured segment size.
    Small,
}

impl SizeClass {
    fn to_byte(self) -> u8 {
        match self {
            SizeClass::Full => 0,
            SizeClass::Small => 1,
        }
    }

    fn from_byte(byte: u8) -> Option<SizeClass> {
        match byte {
            0 => Some(SizeClass::Full),
            1 => Some(SizeClass::Small),
            _ => None,
        }
    }

    /// The size of a segment of this class, given the configured (full) segment size.
    pub fn segment_size_bytes(self, full_segment_size_bytes: u64) -> u64 {
        match self {
            SizeClass::Full => full_segment_size_bytes,
            SizeClass::Small => full_segment_size_bytes / 8,
        }
    }

    /// The stable name used in metrics and file names: `full` or `small`.
    pub fn as_str(self) -> &'static str {
        match self {
            SizeClass::Full => "full",
            SizeClass::Small => "small",
        }
    }
}

/// Whether a segment file belongs to a log or waits in a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderKind {
    /// A log's segment: `base_offset` names the first offset it holds.
    Segment,
    /// A spare in a segment pool: `base_offset` is [`SPARE_BASE`].
    Spare,
}

/// A decoded segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// Size class of the file.
    pub size_class: SizeClass,
    /// Segment or spare.
    pub kind: HeaderKind,
    /// How many times this file has been used; records carry it and must match it.
    pub generation: u16,
    /// First offset of the segment ([`SPARE_BASE`] for a spare).
    pub base_offset: u64,
    /// The segment's size in bytes: records never pass it. The file itself may be shorter (it
    /// grows by preallocation steps up to this size; bytes past its end read as zeros).
    pub segment_size_bytes: u64,
}

/// Why a segment header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderError {
    /// The magic bytes are wrong: not a Keratin segment, or never written.
    Magic,
    /// The header checksum does not hold.
    Checksum,
    /// A layout version this code does not read.
    Version(u16),
    /// An unknown size class or kind byte.
    Field,
}

impl std::fmt::Display for HeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeaderError::Magic => write!(f, "bad magic"),
            HeaderError::Checksum => write!(f, "header checksum mismatch"),
            HeaderError::Version(v) => {
                write!(f, "layout version {v} (this build reads {LAYOUT_VERSION})")
            }
            HeaderError::Field => write!(f, "unknown size class or kind"),
        }
    }
}

impl SegmentHeader {
    /// Encode the header into its fixed-size byte form.
    pub fn encode(&self) -> [u8; SEGMENT_HEADER_SIZE] {
        let mut buf = [0u8; SEGMENT_HEADER_SIZE];
        buf[MAGIC_OFFSET..VERSION_OFFSET].copy_from_slice(&SEGMENT_MAGIC);
        buf[VERSION_OFFSET..CLASS_OFFSET].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
        buf[CLASS_OFFSET] = self.size_class.to_byte();
        buf[KIND_OFFSET] = match self.kind {
            HeaderKind::Segment => 1,
            HeaderKind::Spare => 2,
        };
        buf[GENERATION_OFFSET..HEADER_RESERVED_OFFSET]
            .copy_from_slice(&self.generation.to_le_bytes());
        buf[BASE_OFFSET_OFFSET..SIZE_OFFSET].copy_from_slice(&self.base_offset.to_le_bytes());
        buf[SIZE_OFFSET..CUT_MARK_OFFSET].copy_from_slice(&self.segment_size_bytes.to_le_bytes());
        let crc = crc32c::crc32c(&buf[..HEADER_CRC_OFFSET]);
        buf[HEADER_CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    /// Encode the header with a truncation mark: the log is cutting this segment at
    /// `cut_offset`, so records at or past it may be half destroyed and their durability claims
    /// no longer count ([`SegmentHeader::cut_mark`], `docs/storage-format.md`, "Ordering").
    pub fn encode_cutting(&self, cut_offset: u64) -> [u8; SEGMENT_HEADER_SIZE] {
        let mut buf = self.encode();
        buf[CUT_MARK_OFFSET] = 1;
        buf[CUT_OFFSET_OFFSET..PADDING_OFFSET].copy_from_slice(&cut_offset.to_le_bytes());
        let crc = crc32c::crc32c(&buf[..HEADER_CRC_OFFSET]);
        buf[HEADER_CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    /// The offset a truncation in progress cuts at, from a header that [`SegmentHeader::decode`]
    /// accepted; `None` when no truncation was in progress.
    pub fn cut_mark(buf: &[u8; SEGMENT_HEADER_SIZE]) -> Option<u64> {
        (buf[CUT_MARK_OFFSET] == 1).then(|| u64::from_le_bytes(le8(buf, CUT_OFFSET_OFFSET)))
    }

    /// Decode and verify a header.
    pub fn decode(buf: &[u8; SEGMENT_HEADER_SIZE]) -> Result<SegmentHeader, HeaderError> {
        if buf[MAGIC_OFFSET..VERSION_OFFSET] != SEGMENT_MAGIC {
            return Err(HeaderError::Magic);
        }
        let crc = u32::from_le_bytes(le4(buf, HEADER_CRC_OFFSET));
        if crc != crc32c::crc32c(&buf[..HEADER_CRC_OFFSET]) {
            return Err(HeaderError::Checksum);
        }
        let version = u16::from_le_bytes(le2(buf, VERSION_OFFSET));
        if version != LAYOUT_VERSION {
            return Err(HeaderError::Version(version));
        }
        let size_class = SizeClass::from_byte(buf[CLASS_OFFSET]).ok_or(HeaderError::Field)?;
        let kind = match buf[KIND_OFFSET] {
            1 => HeaderKind::Segment,
            2 => HeaderKind::Spare,
            _ => return Err(HeaderError::Field),
        };
        Ok(SegmentHeader {
            size_class,
            kind,
            generation: u16::from_le_bytes(le2(buf, GENERATION_OFFSET)),
            base_offset: u64::from_le_bytes(le8(buf, BASE_OFFSET_OFFSET)),
            segment_size_bytes: u64::from_le_bytes(le8(buf, SIZE_OFFSET)),
        })
    }
}

/// The header of one record, as decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// CRC32C over header bytes 4..32 and the payload.
    pub crc: u32,
    /// Payload length in bytes.
    pub length: u32,
    /// The record's offset in its log.
    pub offset: u64,
    /// The generation of the segment file the record was written into.
    pub generation: u16,
    /// Caller-defined record type.
    pub record_type: u8,
    /// Flags: bits in [`FLAGS_USER_MASK`] belong to the caller, [`FLAG_SEAL`] to the log.
    pub flags: u8,
    /// Caller-supplied timestamp, milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// Every offset below `offset - durable_distance` was durable when this record was written;
    /// [`NO_DURABILITY_CLAIM`] claims nothing.
    pub durable_distance: u32,
}

impl RecordHeader {
    /// Parse the fixed fields; does not check the checksum (see [`record_checksum`]).
    pub fn parse(buf: &[u8; RECORD_HEADER_SIZE]) -> RecordHeader {
        RecordHeader {
            crc: u32::from_le_bytes(le4(buf, CRC_OFFSET)),
            length: u32::from_le_bytes(le4(buf, LENGTH_OFFSET)),
            offset: u64::from_le_bytes(le8(buf, OFFSET_OFFSET)),
            generation: u16::from_le_bytes(le2(buf, RECORD_GENERATION_OFFSET)),
            record_type: buf[TYPE_OFFSET],
            flags: buf[FLAGS_OFFSET],
            timestamp_ms: u64::from_le_bytes(le8(buf, TIMESTAMP_OFFSET)),
            durable_distance: u32::from_le_bytes(le4(buf, DURABLE_DISTANCE_OFFSET)),
        }
    }

    /// The generation field alone, read without parsing the rest (the cheap first filter of
    /// recovery's look-ahead scan).
    pub fn peek_generation(buf: &[u8]) -> Option<u16> {
        let bytes = buf.get(RECORD_GENERATION_OFFSET..RECORD_GENERATION_OFFSET + 2)?;
        Some(u16::from_le_bytes([bytes[0], bytes[1]]))
    }

    /// The first offset this record claims durable (`offset - durable_distance`), if any.
    pub fn durable_before(&self) -> Option<u64> {
        if self.durable_distance == NO_DURABILITY_CLAIM {
            return None;
        }
        self.offset.checked_sub(u64::from(self.durable_distance))
    }

    /// Total encoded size: header plus payload.
    pub fn encoded_size(&self) -> u64 {
        RECORD_HEADER_SIZE as u64 + u64::from(self.length)
    }
}

/// The checksum a record with this header (bytes 4..32) and payload must carry.
pub fn record_checksum(header: &[u8; RECORD_HEADER_SIZE], payload: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&header[LENGTH_OFFSET..]);
    crc32c::crc32c_append(crc, payload)
}

/// The fields of a record to encode.
#[derive(Debug, Clone, Copy)]
pub struct RecordFields {
    /// Offset in the log.
    pub offset: u64,
    /// Generation of the segment file.
    pub generation: u16,
    /// Caller-defined type.
    pub record_type: u8,
    /// Flags.
    pub flags: u8,
    /// Milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// See [`RecordHeader::durable_distance`].
    pub durable_distance: u32,
}

/// Append one encoded record to `out`. The payload length must fit in a `u32` (the log checks
/// it against the segment size first).
pub fn encode_record(out: &mut Vec<u8>, fields: &RecordFields, payload: &[u8]) {
    let length = u32::try_from(payload.len()).expect("payload length checked by the caller");
    let mut header = [0u8; RECORD_HEADER_SIZE];
    header[LENGTH_OFFSET..OFFSET_OFFSET].copy_from_slice(&length.to_le_bytes());
    header[OFFSET_OFFSET..RECORD_GENERATION_OFFSET].copy_from_slice(&fields.offset.to_le_bytes());
    header[RECORD_GENERATION_OFFSET..TYPE_OFFSET].copy_from_slice(&fields.generation.to_le_bytes());
    header[TYPE_OFFSET] = fields.record_type;
    header[FLAGS_OFFSET] = fields.flags;
    header[TIMESTAMP_OFFSET..DURABLE_DISTANCE_OFFSET]
        .copy_from_slice(&fields.timestamp_ms.to_le_bytes());
    header[DURABLE_DISTANCE_OFFSET..].copy_from_slice(&fields.durable_distance.to_le_bytes());
    let crc = record_checksum(&header, payload);
    header[CRC_OFFSET..LENGTH_OFFSET].copy_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
}

/// Rewrite the `durable_distance` of an encoded record in place and fix its checksum. Used by
/// the commit thread, which knows what is durable only when it writes a batch.
pub fn restamp_durable_distance(record: &mut [u8], durable_distance: u32) {
    let (header, payload) = record.split_at_mut(RECORD_HEADER_SIZE);
    let header: &mut [u8; RECORD_HEADER_SIZE] =
        header.try_into().expect("split at RECORD_HEADER_SIZE");
    header[DURABLE_DISTANCE_OFFSET..].copy_from_slice(&durable_distance.to_le_bytes());
    let crc = record_checksum(header, payload);
    header[CRC_OFFSET..LENGTH_OFFSET].copy_from_slice(&crc.to_le_bytes());
}

/// How a candidate record at some position of a segment fails, if it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordFault {
    /// Fewer than a header's bytes remain in the segment, or the length runs past its end.
    TornLength,
    /// The checksum does not hold.
    Checksum,
    /// The record was written into an earlier use of this file.
    Generation {
        /// Generation in the record.
        found: u16,
    },
    /// A valid record, but not the offset expected at this place in the log.
    Offset {
        /// Offset in the record.
        found: u64,
    },
}

impl std::fmt::Display for RecordFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordFault::TornLength => write!(f, "torn length"),
            RecordFault::Checksum => write!(f, "checksum mismatch"),
            RecordFault::Generation { found } => write!(f, "generation mismatch (found {found})"),
            RecordFault::Offset { found } => write!(f, "unexpected offset {found}"),
        }
    }
}

/// Check the record whose header starts at `buf[0]`. `buf` must hold the whole rest of the
/// segment that is available in memory; returns the header if the record is complete, its
/// checksum holds and its generation matches. The offset is left for the caller to compare.
pub fn check_record(buf: &[u8], generation: u16) -> Result<RecordHeader, RecordFault> {
    let Some(header_bytes) = buf.get(..RECORD_HEADER_SIZE) else {
        return Err(RecordFault::TornLength);
    };
    let header_bytes: &[u8; RECORD_HEADER_SIZE] = header_bytes
        .try_into()
        .map_err(|_| RecordFault::TornLength)?;
    let header = RecordHeader::parse(header_bytes);
    let end = RECORD_HEADER_SIZE
        .checked_add(usize::try_from(header.length).map_err(|_| RecordFault::TornLength)?)
        .ok_or(RecordFault::TornLength)?;
    let Some(payload) = buf.get(RECORD_HEADER_SIZE..end) else {
        return Err(RecordFault::TornLength);
    };
    if record_checksum(header_bytes, payload) != header.crc {
        return Err(RecordFault::Checksum);
    }
    if header.generation != generation {
        return Err(RecordFault::Generation {
            found: header.generation,
        });
    }
    Ok(header)
}

/// The first eight bytes of an anchor file.
pub const ANCHOR_MAGIC: [u8; 8] = *b"KRTNANC\0";

/// Version of the anchor layout written by this code (`docs/storage-format.md`, "Anchor").
pub const ANCHOR_VERSION: u16 = 1;

// Anchor fields (docs/storage-format.md, "Anchor").
const ANCHOR_MAGIC_OFFSET: usize = 0;
const ANCHOR_VERSION_OFFSET: usize = ANCHOR_MAGIC_OFFSET + 8;
const ANCHOR_RESERVED_OFFSET: usize = ANCHOR_VERSION_OFFSET + 2;
const ANCHOR_NEXT_OFFSET_OFFSET: usize = ANCHOR_RESERVED_OFFSET + 6;
const ANCHOR_CRC_OFFSET: usize = ANCHOR_NEXT_OFFSET_OFFSET + 8;

/// Size of an anchor file: the whole file is this one structure.
pub const ANCHOR_SIZE: usize = ANCHOR_CRC_OFFSET + 4;
const _: () = assert!(ANCHOR_SIZE == 28);

/// Why an anchor file was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnchorError {
    /// The file is not exactly [`ANCHOR_SIZE`] bytes long.
    Length(usize),
    /// The magic bytes are wrong.
    Magic,
    /// The checksum does not hold.
    Checksum,
    /// An anchor version this code does not read.
    Version(u16),
    /// A reserved byte is not zero.
    Reserved,
}

impl std::fmt::Display for AnchorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AnchorError::Length(len) => write!(f, "anchor of {len} bytes (expected {ANCHOR_SIZE})"),
            AnchorError::Magic => write!(f, "bad anchor magic"),
            AnchorError::Checksum => write!(f, "anchor checksum mismatch"),
            AnchorError::Version(v) => {
                write!(f, "anchor version {v} (this build reads {ANCHOR_VERSION})")
            }
            AnchorError::Reserved => write!(f, "anchor reserved bytes are not zero"),
        }
    }
}

/// Encode an anchor: the next offset of a log that holds no segment.
pub fn encode_anchor(next_offset: u64) -> [u8; ANCHOR_SIZE] {
    let mut buf = [0u8; ANCHOR_SIZE];
    buf[ANCHOR_MAGIC_OFFSET..ANCHOR_VERSION_OFFSET].copy_from_slice(&ANCHOR_MAGIC);
    buf[ANCHOR_VERSION_OFFSET..ANCHOR_RESERVED_OFFSET]
        .copy_from_slice(&ANCHOR_VERSION.to_le_bytes());
    buf[ANCHOR_NEXT_OFFSET_OFFSET..ANCHOR_CRC_OFFSET].copy_from_slice(&next_offset.to_le_bytes());
    let crc = crc32c::crc32c(&buf[..ANCHOR_CRC_OFFSET]);
    buf[ANCHOR_CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
    buf
}

/// Decode and verify an anchor file's bytes (the whole file); returns its next offset.
pub fn decode_anchor(bytes: &[u8]) -> Result<u64, AnchorError> {
    let buf: &[u8; ANCHOR_SIZE] = bytes
        .try_into()
        .map_err(|_| AnchorError::Length(bytes.len()))?;
    if buf[ANCHOR_MAGIC_OFFSET..ANCHOR_VERSION_OFFSET] != ANCHOR_MAGIC {
        return Err(AnchorError::Magic);
    }
    let crc = u32::from_le_bytes(le4(buf, ANCHOR_CRC_OFFSET));
    if crc != crc32c::crc32c(&buf[..ANCHOR_CRC_OFFSET]) {
        return Err(AnchorError::Checksum);
    }
    let version = u16::from_le_bytes(le2(buf, ANCHOR_VERSION_OFFSET));
    if version != ANCHOR_VERSION {
        return Err(AnchorError::Version(version));
    }
    if buf[ANCHOR_RESERVED_OFFSET..ANCHOR_NEXT_OFFSET_OFFSET]
        .iter()
        .any(|b| *b != 0)
    {
        return Err(AnchorError::Reserved);
    }
    Ok(u64::from_le_bytes(le8(buf, ANCHOR_NEXT_OFFSET_OFFSET)))
}

fn le2(buf: &[u8], at: usize) -> [u8; 2] {
    [buf[at], buf[at + 1]]
}

fn le4(buf: &[u8], at: usize) -> [u8; 4] {
    [buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]
}

fn le8(buf: &[u8], at: usize) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&buf[at..at + 8]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(offset: u64, generation: u16) -> RecordFields {
        RecordFields {
            offset,
            generation,
            record_type: 7,
            flags: 1,
            timestamp_ms: 1_700_000_000_000,
            durable_distance: 3,
        }
    }

    #[test]
    fn header_roundtrip_and_checksum() {
        let header = SegmentHeader {
            size_class: SizeClass::Small,
            kind: HeaderKind::Segment,
            generation: 513,
            base_offset: 1 << 40,
            segment_size_bytes: 8 << 20,
        };
        let mut bytes = header.encode();
        assert_eq!(SegmentHeader::decode(&bytes), Ok(header));
        bytes[BASE_OFFSET_OFFSET] ^= 1;
        assert_eq!(SegmentHeader::decode(&bytes), Err(HeaderError::Checksum));
        assert_eq!(SegmentHeader::decode(&[0u8; 64]), Err(HeaderError::Magic));
    }

    #[test]
    fn cut_mark_roundtrip() {
        let header = SegmentHeader {
            size_class: SizeClass::Full,
            kind: HeaderKind::Segment,
            generation: 3,
            base_offset: 100,
            segment_size_bytes: 1 << 20,
        };
        assert_eq!(SegmentHeader::cut_mark(&header.encode()), None);
        let cutting = header.encode_cutting(150);
        assert_eq!(SegmentHeader::decode(&cutting), Ok(header));
        assert_eq!(SegmentHeader::cut_mark(&cutting), Some(150));
    }

    #[test]
    fn record_is_checked_for_generation_and_checksum() {
        let mut buf = Vec::new();
        encode_record(&mut buf, &fields(42, 5), b"hello");
        let header = check_record(&buf, 5).expect("valid");
        assert_eq!(
            (header.offset, header.length, header.record_type),
            (42, 5, 7)
        );
        assert_eq!(header.durable_before(), Some(39));
        assert_eq!(
            check_record(&buf, 6),
            Err(RecordFault::Generation { found: 5 })
        );
        assert_eq!(
            check_record(&buf[..buf.len() - 1], 5),
            Err(RecordFault::TornLength)
        );
        let mut flipped = buf.clone();
        flipped[RECORD_HEADER_SIZE + 2] ^= 0x10;
        assert_eq!(check_record(&flipped, 5), Err(RecordFault::Checksum));
        // Zeroed space (a preallocated, never written region) is never a record.
        assert_eq!(check_record(&[0u8; 64], 0), Err(RecordFault::Checksum));
    }

    #[test]
    fn anchor_roundtrip_and_damage() {
        let bytes = encode_anchor(1 << 40);
        assert_eq!(decode_anchor(&bytes), Ok(1 << 40));
        assert_eq!(decode_anchor(&bytes[..20]), Err(AnchorError::Length(20)));
        assert_eq!(decode_anchor(&[0u8; ANCHOR_SIZE]), Err(AnchorError::Magic));
        for at in ANCHOR_VERSION_OFFSET..ANCHOR_SIZE {
            let mut flipped = bytes;
            flipped[at] ^= 0x04;
            assert_eq!(
                decode_anchor(&flipped),
                Err(AnchorError::Checksum),
                "byte {at}"
            );
        }
    }

    #[test]
    fn restamp_keeps_record_valid() {
        let mut buf = Vec::new();
        encode_record(&mut buf, &fields(10, 2), b"payload");
        restamp_durable_distance(&mut buf, 0);
        let header = check_record(&buf, 2).expect("valid after restamp");
        assert_eq!(header.durable_before(), Some(10));
    }
}
