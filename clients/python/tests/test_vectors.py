"""The shared protocol test vectors (docs/protocol-vectors.json, written by the reference
encoder): for every vector the Python encoder writes exactly its hex, and the decoder reads
the hex back to the vector's fields. Also checks the ``<!-- example -->`` blocks of
docs/protocol.md byte for byte. A codec that drifts from the Rust one fails here, naming the
vector. The client speaks versions up to ``w.PROTOCOL_VERSION`` (7, with the stream frames), so
every vector is checked; a vector of a later version would be skipped, not failed (the Rust
tests check it), and the file's top-level ``protocol_version`` must be the client's."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import pytest

from keratin import _wire as w

from ._examples import doc_examples

VECTORS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "protocol-vectors.json")

MECHANISMS = {"none": 0, "plain": 1, "external": 2, "token": 3}
MECHANISM_NAMES = {v: k for k, v in MECHANISMS.items()}
UPDATE_OPS = {"keep": w.UPDATE_KEEP, "clear": w.UPDATE_CLEAR, "set": w.UPDATE_SET}
UPDATE_NAMES = {v: k for k, v in UPDATE_OPS.items()}
SET_FIELDS = ("dead_letter", "max_deliveries", "max_messages", "max_bytes", "overflow")
STREAM_SET_FIELDS = ("max_bytes", "max_age_ms", "max_messages")
START_KINDS = {name: kind for kind, name in w.START_NAMES.items()}


def headers(j: List[Dict[str, str]]) -> List[Any]:
    return [(h["name"], h["value"]) for h in j]


def load() -> List[Dict[str, Any]]:
    with open(VECTORS, encoding="utf-8") as f:
        data = json.load(f)
    assert data["protocol_version"] == w.PROTOCOL_VERSION
    return data["vectors"]


# ---- JSON fields -> codec values ----------------------------------------------------------


def error_body(j: Dict[str, Any]) -> w.ErrorBody:
    return w.ErrorBody(j["code"], j["message"], j["reason"], j["retry_after_ms"], j["leader_addr"])


def settings(j: Dict[str, Any]) -> w.QueueSettings:
    return w.QueueSettings(**j)


def frame_from(j: Dict[str, Any]) -> w.Frame:
    j = dict(j)
    kind = j.pop("type")
    cls = getattr(w, kind)
    if kind == "Publish":
        mode = (w.MODE_CONFIRMED if j["mode"] == "confirmed" else w.MODE_BUFFERED) | (
            w.MODE_JOINABLE if j["joinable"] else 0
        )
        messages = [
            w.WireMessage(
                m["publish_id"],
                bytes.fromhex(m["body"]),
                m["routing_key"],
                [(h["name"], h["value"]) for h in m["headers"]],
                m["sequence"],
            )
            for m in j["messages"]
        ]
        return w.Publish(j["queue"], mode, messages, j["producer_id"])
    if kind == "SetQueueSettings":
        updates = {
            name: w.Update(UPDATE_OPS[j[name]["op"]], j[name].get("value")) for name in SET_FIELDS
        }
        return w.SetQueueSettings(j["request_id"], j["queue"], **updates)
    if kind == "StreamSet":
        updates = {
            name: w.Update(UPDATE_OPS[j[name]["op"]], j[name].get("value")) for name in STREAM_SET_FIELDS
        }
        return w.StreamSet(j["request_id"], j["stream"], **updates)
    if kind == "StreamSubscribe":
        j["start"] = w.StreamStart(START_KINDS[j["start"]["kind"]], j["start"]["value"])
    if kind == "CursorCommit":
        j["entries"] = [w.CursorEntry(**e) for e in j["entries"]]
    if kind == "StreamInfoReply":
        j["partitions"] = [w.StreamPartitionInfo(**p) for p in j["partitions"]]
    if kind == "StreamListReply":
        j["streams"] = [w.StreamSummary(**s) for s in j["streams"]]
    if kind == "StreamDeliver":
        j["messages"] = [
            w.StreamMessage(m["offset"], m["timestamp_ms"], m["routing_key"], headers(m["headers"]), bytes.fromhex(m["body"]))
            for m in j["messages"]
        ]
    if "settings" in j:
        if kind.startswith("Stream"):
            j["settings"] = w.StreamSettings(**j["settings"])
        else:
            j["settings"] = settings(j["settings"])
    if "error" in j:
        j["error"] = error_body(j["error"])
    if "ranges" in j:
        j["ranges"] = [(r["first"], r["last"]) for r in j["ranges"]]
    if kind == "QueueInfoReply":
        j["partitions"] = [w.PartitionInfo(**p) for p in j["partitions"]]
    if kind == "QueueListReply":
        j["queues"] = [w.QueueSummary(**q) for q in j["queues"]]
    if kind == "Deliver":
        j["headers"] = [(h["name"], h["value"]) for h in j["headers"]]
        j["body"] = bytes.fromhex(j["body"])
    return cls(**j)  # type: ignore[no-any-return]


def client_hello_from(j: Dict[str, Any]) -> w.ClientHello:
    return w.ClientHello(
        j["version"], j["client_name"], MECHANISMS[j["mechanism"]], j["user"], j["password"], j["token"]
    )


def server_hello_from(j: Dict[str, Any]) -> w.ServerHello:
    if j["status"] == "refused":
        return w.ServerHello(j["version"], error=error_body(j["error"]))
    info = j["info"]
    nodes = [w.NodeAddress(n["node_id"], n["server"], n["admin"]) for n in info["nodes"]]
    return w.ServerHello(j["version"], j["node_id"], w.ServerInfo(info["admin"], nodes), j["user"])


# ---- the tests -----------------------------------------------------------------------------

ALL = load()
# The vectors of the versions this client speaks; the others are skipped.
SPOKEN = [v for v in ALL if v["version"] <= w.PROTOCOL_VERSION]


def skip_if_newer(vector: Dict[str, Any]) -> None:
    if vector["version"] > w.PROTOCOL_VERSION:
        pytest.skip(
            "protocol version %d; this client speaks up to %d" % (vector["version"], w.PROTOCOL_VERSION)
        )


@pytest.mark.parametrize("vector", ALL, ids=[v["name"] for v in ALL])
def test_vector_encodes_to_its_bytes_and_decodes_to_its_fields(vector: Dict[str, Any]) -> None:
    skip_if_newer(vector)
    raw = bytes.fromhex(vector["hex"])
    version = vector["version"]
    fields = vector["fields"]
    if vector["kind"] == "frame":
        value = frame_from(fields)
        assert w.encode_frame(value, version) == raw
        assert raw[:4] == (len(raw) - 4).to_bytes(4, "little")
        assert w.decode_frame(raw[4], raw[5:], version) == value
    elif vector["kind"] == "client_hello":
        hello = client_hello_from(fields)
        assert w.encode_client_hello(hello) == raw
        assert w.decode_client_hello(raw) == hello
    elif vector["kind"] == "server_hello":
        server_hello = server_hello_from(fields)
        assert w.encode_server_hello(server_hello) == raw
        assert w.decode_server_hello(raw, offered=w.PROTOCOL_VERSION) == (server_hello, len(raw))
        # Read as it arrives: every proper prefix asks for more bytes.
        for cut in range(len(raw)):
            with pytest.raises(w.Incomplete):
                w.decode_server_hello(raw[:cut], w.PROTOCOL_VERSION, partial=True)
    else:
        pytest.fail("unknown vector kind %r" % vector["kind"])


def test_vectors_cover_every_frame_type_and_both_hellos() -> None:
    kinds = {v["kind"] for v in SPOKEN}
    assert kinds == {"frame", "client_hello", "server_hello"}
    named = {v["fields"]["type"] for v in SPOKEN if v["kind"] == "frame"}
    assert named == {cls.__name__ for cls in w.FRAME_TYPES.values()}


def test_doc_examples_round_trip() -> None:
    examples = doc_examples()
    assert len(examples) >= 11, sorted(examples)
    by_name = {v["name"]: v for v in ALL}
    for name, raw in examples.items():
        # The doc's example and the vector of the same name are the same bytes.
        assert by_name[name]["hex"] == raw.hex(), name
        if by_name[name]["version"] > w.PROTOCOL_VERSION:
            continue  # A version this client does not speak (the Rust tests check it).
        if name.startswith("client_hello"):
            assert w.encode_client_hello(w.decode_client_hello(raw)) == raw
        elif name.startswith("server_hello"):
            hello, size = w.decode_server_hello(raw)
            assert size == len(raw) and w.encode_server_hello(hello) == raw
        else:
            frame = w.decode_frame(raw[4], raw[5:])
            assert w.encode_frame(frame) == raw, name
