"""The codec never fails on bad input except with ProtocolError (or Incomplete for a hello
still arriving): random bytes for every frame type, every vector truncated and with a byte
flipped, and the encoder's own refusals. Seeded: set KERATIN_SEED to replay a failure (the
seed is in the failure message)."""

from __future__ import annotations

import json
import os
import random

import pytest

from keratin import ProtocolError
from keratin import _wire as w

from .test_vectors import VECTORS

SEED = int(os.environ.get("KERATIN_SEED", random.randrange(1 << 32)))
VECTOR_BYTES = [bytes.fromhex(v["hex"]) for v in json.load(open(VECTORS))["vectors"] if v["kind"] == "frame"]


def decode_or_protocol_error(frame_type: int, body: bytes) -> None:
    try:
        w.decode_frame(frame_type, body)
    except ProtocolError:
        pass


def test_random_bodies_only_ever_raise_protocol_error() -> None:
    rng = random.Random(SEED)
    for _ in range(3000):
        frame_type = rng.choice(list(w.FRAME_TYPES) + [0x00, 0x7F, 0xFF])
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        try:
            decode_or_protocol_error(frame_type, body)
        except Exception as e:  # pragma: no cover - the failure path
            pytest.fail("seed %d: type 0x%02x body %s raised %r" % (SEED, frame_type, body.hex(), e))


def test_truncated_and_flipped_vectors_only_ever_raise_protocol_error() -> None:
    rng = random.Random(SEED)
    for raw in VECTOR_BYTES:
        frame_type, body = raw[4], raw[5:]
        for cut in range(len(body)):
            with pytest.raises(ProtocolError):
                w.decode_frame(frame_type, body[:cut])
        for _ in range(20):
            flipped = bytearray(body)
            if flipped:
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            try:
                decode_or_protocol_error(frame_type, bytes(flipped))
            except Exception as e:  # pragma: no cover - the failure path
                pytest.fail("seed %d: %s flipped to %s raised %r" % (SEED, raw.hex(), flipped.hex(), e))


def test_random_server_hellos_only_ever_raise_protocol_error_or_incomplete() -> None:
    rng = random.Random(SEED)
    for _ in range(2000):
        data = b"KRTN" + bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        try:
            w.decode_server_hello(data, partial=True)
        except (ProtocolError, w.Incomplete):
            pass
        except Exception as e:  # pragma: no cover - the failure path
            pytest.fail("seed %d: hello %s raised %r" % (SEED, data.hex(), e))


def test_a_huge_count_is_refused_before_anything_is_built() -> None:
    # Ack announcing 2^32-1 ids in a 4-byte body.
    with pytest.raises(ProtocolError, match="cannot fit"):
        w.decode_frame(w.Ack.TYPE, b"\xff\xff\xff\xff")


def test_the_encoder_refuses_what_the_protocol_forbids() -> None:
    with pytest.raises(ValueError, match="429"):
        w.encode_frame(w.Error(1, False, w.ErrorBody(429, "no hint")))
    with pytest.raises(ValueError, match="first > last"):
        w.encode_frame(w.Confirm([(5, 4)]))
    with pytest.raises(ValueError, match="password"):
        w.encode_client_hello(w.ClientHello(6, "c", w.MECHANISM_PLAIN, "bob", ""))
    with pytest.raises(ValueError, match="version 6"):
        w.encode_client_hello(w.ClientHello(5, "c", w.MECHANISM_TOKEN, token="kt_x"))
    with pytest.raises(ValueError, match="16 MiB"):
        w.encode_frame(w.Publish("q", 0, [w.WireMessage(1, b"x" * w.FRAME_SIZE_BYTES_MAX)]))
    with pytest.raises(ValueError, match="version 5"):
        w.encode_frame(w.Declare(1, "q", w.QueueSettings(), [1]), version=4)
    with pytest.raises(ValueError, match="overflow"):
        w.encode_frame(w.Declare(1, "q", w.QueueSettings(overflow="sideways")))


def test_partitions_are_computed_as_the_broker_computes_them() -> None:
    """The same vectors as the broker's ``queue.rs`` and the Rust client's
    ``partitioning.rs``: keys by CRC32C, an idempotent producer's keyless sequences in blocks
    of 64 per partition, the broker's choice otherwise."""
    from keratin._partitions import PRODUCER_SEQUENCE_BLOCK, partition_of

    assert PRODUCER_SEQUENCE_BLOCK == 64
    # CRC32C("123456789") is the standard check value 0xE3069283.
    assert partition_of("123456789", None, None, 7) == 0xE3069283 % 7
    assert partition_of("123456789", 1, 5, 7) == 0xE3069283 % 7
    assert [partition_of(None, 9, s, 3) for s in (0, 63, 64, 127, 128, 130)] == [0, 0, 1, 1, 2, 2]
    assert partition_of(None, (1 << 64) - 1, 64, 3) == 0  # wraps: (2**64 - 1 + 1) mod 2**64 = 0
    assert partition_of(None, None, 5, 3) is None
    assert partition_of(None, 9, None, 3) is None
    assert partition_of("", 1, 64, 3) == 2  # an empty key is none
    assert partition_of(None, 9, 5, 0) == 0  # a count of 0 is 1
