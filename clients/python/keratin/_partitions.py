"""Which partition of a queue a message goes to, computed as the broker computes it (the Rust
client's ``partitioning.rs``): by the CRC32C of its routing key; without one, by its idempotent
producer's id plus its sequence's block of :data:`PRODUCER_SEQUENCE_BLOCK`; without either the
broker chooses (``None``). The client uses it to send each message to its partition's leader."""

from __future__ import annotations

from typing import List, Optional

__all__ = ["crc32c", "partition_of", "PRODUCER_SEQUENCE_BLOCK"]

#: Consecutive sequences of an idempotent producer that go to one partition when they have no
#: routing key: partition ``(producer id + sequence // 64) mod partitions``, so that each
#: partition's window of the producer (64 runs) holds whole blocks, its last 4,096 sequences
#: there (the broker's ``PRODUCER_SEQUENCE_BLOCK``, ``docs/protocol.md`` "Publish").
PRODUCER_SEQUENCE_BLOCK = 64


def _table() -> List[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_TABLE = _table()


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli), as the broker hashes routing keys."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def partition_of(
    key: Optional[str], producer_id: Optional[int], sequence: Optional[int], partitions: int
) -> Optional[int]:
    """The partition of ``partitions`` a message goes to, or ``None`` when the broker chooses
    (no routing key, no producer mark). An empty key counts as none."""
    n = max(partitions, 1)
    if key:
        return crc32c(key.encode("utf-8")) % n
    if producer_id is not None and sequence is not None:
        return ((producer_id + sequence // PRODUCER_SEQUENCE_BLOCK) & 0xFFFFFFFFFFFFFFFF) % n
    return None
