"""An episode's record between nodes (node/transfer.py): what the old owner encodes is what
the new one installs, and a record the receiver cannot install is refused with its reason,
before anything is allocated or installed."""

from __future__ import annotations

import re
from typing import Any

import msgpack
import numpy as np
import pytest

from affinity import wire
from node.chunks import ActionBuffer
from node.contract import load_contract
from node.episodes import Episode, StepResult
from node.errors import TransferError
from node.models import DEMO_MODEL
from node.transfer import Install, decode_install, encode_install, record_bytes

CONTRACT = load_contract(DEMO_MODEL)
HIDDEN = np.arange(16, dtype=np.float32).reshape(1, 16)


def install(**record: Any) -> Install:
    fields: dict[str, Any] = {
        "device": "b/0", "token": 7, "claim": "c-1", "state": {"state_in.hidden": HIDDEN},
        "last_used": 100.0, "seq": 3, "buffer": None, "model": "demo_policy@v1",
    }  # fmt: skip
    fields.update(record)
    return Install("ep", "b/0", 7, "c-1", "a", Episode(**fields))


def message(**changes: Any) -> bytes:
    doc = wire.decode(encode_install(install(), now=50.0))
    doc.update(changes)
    return wire.encode(doc)


def test_a_record_arrives_as_it_left_with_its_times_on_the_receivers_clock() -> None:
    chunk = np.ones((4, 2), np.float32)
    reply = StepResult({"actions": np.zeros((1, 2), np.float32)}, False, 3)
    sent = install(
        buffer=ActionBuffer(2, ((0, chunk),)), reply=reply, origin="f-1", pinned=True,
        sent=(chunk, 40.0), latency=(0.01, 0.02), asked={"obs": np.zeros((1, 8), np.float32)},
    )  # fmt: skip
    got = decode_install(encode_install(sent, now=50.0), CONTRACT, now=1000.0)
    assert (got.episode, got.device, got.token, got.claim, got.origin_node) == (
        "ep",
        "b/0",
        7,
        "c-1",
        "a",
    )
    r = got.record
    np.testing.assert_array_equal(r.state["state_in.hidden"], HIDDEN)
    assert (r.seq, r.origin, r.pinned, r.model, r.latency) == (
        3,
        "f-1",
        True,
        "demo_policy@v1",
        (0.01, 0.02),
    )
    assert r.buffer is not None and r.buffer.t == 2
    np.testing.assert_array_equal(r.buffer.chunks[0][1], chunk)
    assert r.reply is not None
    np.testing.assert_array_equal(r.reply.outputs["actions"], reply.outputs["actions"])
    assert r.sent is not None and r.sent[1] == pytest.approx(990.0)  # sent 10 s before
    assert r.asked is not None and set(r.asked) == {"obs"}
    assert r.confirmed is False  # never served until Redis moved the claim here
    assert record_bytes(sent.record) == HIDDEN.nbytes + 2 * chunk.nbytes + 2 * 4 + 8 * 4


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"\xc1not msgpack", None),
        (wire.encode([1, 2]), "a hand-over is a map"),
        (message(token="7"), "wrong types"),
        (message(seq=None), "wrong types"),
        (message(state={"state_in.other": HIDDEN}), "is not this model's"),
        (message(state={"state_in.hidden": HIDDEN.astype(np.float64)}), "float64"),
        (message(state={"state_in.hidden": np.zeros((1, 17), np.float32)}), "[1, 17]"),
        (message(state=[1, 2]), "map of names to arrays"),
        (message(buffer={"t": 1}), "buffer is malformed"),
        (message(sent=[np.zeros(2, np.float32), -1.0]), "age must be a number >= 0"),
        (message(latency=["soon"]), "latency must be a list of seconds"),
        (message(asked={"obs": [0.0]}), "held inputs"),
    ],
)
def test_a_record_that_cannot_be_installed_is_refused_with_its_reason(
    body: bytes, reason: str | None
) -> None:
    with pytest.raises(TransferError, match=None if reason is None else re.escape(reason)):
        decode_install(body, CONTRACT, now=0.0)


def test_a_record_missing_a_field_names_it() -> None:
    doc = wire.decode(encode_install(install(), now=0.0))
    for key in ("episode_id", "device", "token", "claim", "from", "model", "seq", "latency"):
        body = wire.encode({k: v for k, v in doc.items() if k != key})
        with pytest.raises(TransferError, match=f"needs {key}"):
            decode_install(body, CONTRACT, now=0.0)


def test_a_state_whose_declared_shape_is_larger_than_its_bytes_is_refused() -> None:
    """The shape is checked against the bytes present before anything is allocated."""
    doc = msgpack.unpackb(message(), raw=False, strict_map_key=False)
    hidden = doc["state"]["state_in.hidden"]
    key = b"shape" if b"shape" in hidden else "shape"
    for shape, reason in (([1, 1024], r"needs 4096 bytes"), ([1 << 30, 16], r"the limit is")):
        hidden[key] = shape
        with pytest.raises(TransferError, match=reason):
            decode_install(msgpack.packb(doc), CONTRACT, now=0.0)
