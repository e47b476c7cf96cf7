"""An episode's record between nodes (node/transfer.py): what the old owner encodes is what
the new one installs, and a record the receiver cannot install is refused with its reason,
before anything is allocated or installed."""

from __future__ import annotations

import re
from typing import Any

import fakeredis
import msgpack
import numpy as np
import pytest

from affinity import Keys, wire
from node.chunks import ActionBuffer
from node.contract import load_contract
from node.episodes import Episode, StepResult
from node.errors import ModelNotServed, TransferError
from node.forward import MOVE_PATH, SECRET_HEADER
from node.models import DEMO_MODEL
from node.transfer import Install, decode_install, encode_install, record_bytes
from tests.inproc import cluster, config

CONTRACT = load_contract(DEMO_MODEL)
SERVED = {"demo_policy@v1": CONTRACT}
HIDDEN = np.arange(16, dtype=np.float32).reshape(1, 16)


def install(**record: Any) -> Install:
    fields: dict[str, Any] = {
        "device": "b/0", "token": 7, "claim": "c-1", "state": {"state_in.hidden": HIDDEN},
        "last_used": 100.0, "seq": 3, "buffer": None, "model": "demo_policy@v1",
    }  # fmt: skip
    fields.update(record)
    return Install("ep", "b/0", 7, "c-1", "a", Episode(**fields))


def reply_doc(rtc: list[int] | None = None, **outputs: Any) -> dict[str, Any]:
    """A stored reply as the message carries it."""
    return {"outputs": outputs, "state_reset": False, "seq": 3, "source": "model", "rtc": rtc}


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
    got = decode_install(encode_install(sent, now=50.0), SERVED, now=1000.0)
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
        # issue 41 item 5: the state check alone let these through (a wrong shape then
        # failed the episode's next step with a bare 500)
        (message(model=""), "must be name@version"),
        (message(model="demo_policy"), "must be name@version"),
        (message(buffer={"t": 1, "chunks": [[0, np.ones((11, 7), np.float32)]]}), "[11, 7]"),
        (message(buffer={"t": 1, "chunks": [[0, np.ones((4, 2), np.float64)]]}), "float64"),
        (message(buffer={"t": 1, "chunks": [[2, np.ones((4, 2), np.float32)]]}), "after 1"),
        (
            message(
                buffer={"t": 9, "chunks": [[i, np.ones((4, 2), np.float32)] for i in range(5)]}
            ),
            "at most 4",
        ),
        (message(sent=[np.zeros((11, 7), np.float32), 1.0]), "the sent chunk is float32[11, 7]"),
        (message(reply=reply_doc(actions=np.zeros((1, 3), np.float32))), "reply's 'actions'"),
        (message(reply=reply_doc(actions=np.zeros((1, 4, 3), np.float32))), "[1, 4, 3]"),
        (message(reply=reply_doc(other=np.zeros((1, 2), np.float32))), "not an output"),
        (message(reply=reply_doc(rtc=[9, 0, 0])), "rtc values"),
        (message(asked={"image": np.zeros((1, 8), np.float32)}), "not an input of this model"),
        (message(asked={"obs": np.zeros((1, 9), np.float32)}), "held input 'obs'"),
    ],
)
def test_a_record_that_cannot_be_installed_is_refused_with_its_reason(
    body: bytes, reason: str | None
) -> None:
    with pytest.raises(TransferError, match=None if reason is None else re.escape(reason)):
        decode_install(body, SERVED, now=0.0)


def test_a_record_missing_a_field_names_it() -> None:
    doc = wire.decode(encode_install(install(), now=0.0))
    for key in ("episode_id", "device", "token", "claim", "from", "model", "seq", "latency"):
        body = wire.encode({k: v for k, v in doc.items() if k != key})
        with pytest.raises(TransferError, match=f"needs {key}"):
            decode_install(body, SERVED, now=0.0)


def test_a_state_whose_declared_shape_is_larger_than_its_bytes_is_refused() -> None:
    """The shape is checked against the bytes present before anything is allocated."""
    doc = msgpack.unpackb(message(), raw=False, strict_map_key=False)
    hidden = doc["state"]["state_in.hidden"]
    key = b"shape" if b"shape" in hidden else "shape"
    for shape, reason in (([1, 1024], r"needs 4096 bytes"), ([1 << 30, 16], r"the limit is")):
        hidden[key] = shape
        with pytest.raises(TransferError, match=reason):
            decode_install(msgpack.packb(doc), SERVED, now=0.0)


def test_a_record_of_a_model_or_version_not_served_here_is_refused() -> None:
    """Issue 41 item 5: the receiver looked the contract up by the model's name only, so a
    record of another version (or, with an empty name, of any model) was installed."""
    for model in ("demo_policy@v2", "vla_demo@v1"):
        with pytest.raises(ModelNotServed, match=f"{model} is not served here"):
            decode_install(message(model=model), SERVED, now=0.0)
    ok = decode_install(message(reply=reply_doc(actions=np.zeros((1, 4, 2), np.float32))),
                        SERVED, now=0.0)  # fmt: skip
    assert ok.record.model == "demo_policy@v1" and ok.record.reply is not None


@pytest.mark.anyio
async def test_a_node_installs_nothing_it_could_not_serve() -> None:
    """Issue 41 item 5 through ``POST /internal/move`` (with the right secret): a record of
    another version of the node's model, or whose sent chunk is ``[11, 7]`` for a ``[4, 2]``
    chunk, is refused with its reason (421, 422) and nothing is installed; the same record
    that fits is installed, unconfirmed."""
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("b", cluster_secret="k")]) as ([b], _):
        served = str(b.service.models["demo_policy"][0])  # demo_policy@<digest>
        headers = {SECRET_HEADER: "k", "content-type": "application/msgpack"}

        async def post(body: bytes) -> Any:
            return await b.client.post(MOVE_PATH, content=body, headers=headers)

        r = await post(message(model="demo_policy@other"))
        assert r.status_code == 421, r.text
        assert "demo_policy@other is not served here" in r.json()["error"]["message"]
        r = await post(message(model=served, sent=[np.zeros((11, 7), np.float32), 1.0]))
        assert r.status_code == 422 and r.json()["error"]["code"] == "bad_record", r.text
        assert "the sent chunk is float32[11, 7]" in r.json()["error"]["message"]
        assert b.service.table.get("ep") is None and b.service.table.copy_of("ep") is None
        fits = message(model=served, sent=[np.zeros((4, 2), np.float32), 1.0])
        r = await post(fits)  # (no move reserved it in Redis: refused, nothing kept)
        assert r.status_code == 409 and r.json()["error"]["code"] == "stale_token", r.text
        assert b.service.table.copy_of("ep") is None
        await redis.set(Keys().transfer("ep"), "b/0 7 c-1", px=10_000)  # the move's place
        r = await post(fits)
        assert r.status_code == 204, r.text
        record = b.service.table.copy_of("ep")  # a copy, held apart until the commit
        assert record is not None and record.model == served and not record.confirmed
        assert await redis.get(Keys().transfer("ep")) == "b/0 7 c-1 installed"
