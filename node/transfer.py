"""An episode's record between nodes: what a live hand-over sends, binary, size-checked.

Everything the owner remembers about the episode moves. That is the recurrent state, the
action buffer and its position, and the latency window. It is the chunk real-time chunking
last sent, with its age (clocks differ between hosts). It is ``seq``, the stored reply, the
inputs of a step held for its retry, and the claim's model. The record before the last step
does not move. So an undo of the last step that reaches the new owner leaves the episode in
doubt: the next step says ``state_reset``. Tensors travel as msgpack arrays
(``affinity/wire.py``: shapes checked against the message before anything is allocated).
The receiver checks the state against its own model's contract before it installs
anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from affinity import wire
from node.chunks import ActionBuffer
from node.contract import PolicyContract
from node.episodes import Episode, StepResult
from node.errors import TransferError
from node.rtc import Used

__all__ = ["Install", "decode_install", "encode_install", "record_bytes"]

Array = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class Install:
    """What the old owner sends the new one: the episode, the new claim (device, token,
    claim id) Redis reserved, the old owner's node, and the record."""

    episode: str
    device: str
    token: int
    claim: str
    origin_node: str
    record: Episode


def _arrays(value: object, what: str) -> dict[str, Array]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, np.ndarray) for k, v in value.items()
    ):
        raise TransferError(f"{what} must be a map of names to arrays")
    return dict(value)


def _reply(result: StepResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    rtc = result.rtc
    return {
        "outputs": result.outputs,
        "state_reset": result.state_reset,
        "seq": result.seq,
        "source": result.source,
        "rtc": None if rtc is None else [rtc.executed, rtc.delay, rtc.prefix_len],
    }


def _result(doc: object) -> StepResult | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise TransferError("a record's reply must be a map")
    try:
        rtc = doc["rtc"]
        source = doc["source"]
        if source not in ("model", "buffer"):
            raise TransferError(f"a reply's source must be model or buffer, not {source!r}")
        return StepResult(
            _arrays(doc["outputs"], "a reply's outputs"),
            bool(doc["state_reset"]),
            int(doc["seq"]),
            source,
            rtc=None if rtc is None else Used(int(rtc[0]), int(rtc[1]), int(rtc[2])),
        )
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise TransferError(f"a record's reply is malformed: {exc}") from None


def encode_install(install: Install, now: float) -> bytes:
    """The message, with the record's clock times as ages (``now``: this node's clock)."""
    r = install.record
    buffer = (
        None
        if r.buffer is None
        else {"t": r.buffer.t, "chunks": [list(c) for c in r.buffer.chunks]}
    )
    return wire.encode(
        {
            "episode_id": install.episode,
            "device": install.device,
            "token": install.token,
            "claim": install.claim,
            "from": install.origin_node,
            "model": r.model,
            "state": r.state,
            "seq": r.seq,
            "buffer": buffer,
            "reply": _reply(r.reply),
            "origin": r.origin,
            "doubt": r.doubt,
            "pinned": r.pinned,
            "sent": None if r.sent is None else [r.sent[0], max(0.0, now - r.sent[1])],
            "latency": list(r.latency),
            "asked": None if r.asked is None else dict(r.asked),
        }
    )


def decode_install(body: bytes, contract: PolicyContract, now: float) -> Install:
    """The message back, the record's times on this node's clock; raises
    :class:`TransferError` when it is malformed or its state does not fit ``contract``."""
    try:
        doc = wire.decode(body)
    except wire.WireError as exc:
        raise TransferError(str(exc)) from None
    if not isinstance(doc, dict):
        raise TransferError("a hand-over is a map")
    try:
        episode, device, token = doc["episode_id"], doc["device"], doc["token"]
        claim, origin_node, model = doc["claim"], doc["from"], doc["model"]
        seq, buffer, sent = doc["seq"], doc["buffer"], doc["sent"]
        latency, asked = doc["latency"], doc["asked"]
    except KeyError as exc:
        raise TransferError(f"a hand-over needs {exc.args[0]}") from None
    strings = (episode, device, claim, origin_node, model, doc.get("origin", ""))
    if (
        not all(isinstance(v, str) for v in strings)
        or type(token) is not int
        or type(seq) is not int
    ):
        raise TransferError("a hand-over's ids, token and seq have the wrong types")
    state = _arrays(doc["state"], "a record's state")
    _check_state(state, contract)
    return Install(
        episode,
        device,
        token,
        claim,
        origin_node,
        Episode(
            device,
            token,
            claim,
            state,
            now,
            seq,
            _buffer(buffer),
            _result(doc["reply"]),
            None,
            str(doc.get("origin", "")),
            doubt=doc.get("doubt") is True,
            sent=_sent(sent, now),
            latency=_latency(latency),
            pinned=doc.get("pinned") is True,
            model=model,
            asked=None if asked is None else _arrays(asked, "a record's held inputs"),
            confirmed=False,
        ),
    )


def _check_state(state: Mapping[str, Array], contract: PolicyContract) -> None:
    specs = {spec.name: spec for spec in contract.inputs}
    if set(state) != set(contract.state):
        raise TransferError(
            f"the record's state {sorted(state)} is not this model's {sorted(contract.state)}"
        )
    for name, value in state.items():
        spec = contract.step_spec(specs[name])
        want = tuple(d if isinstance(d, int) else None for d in spec.shape)
        fits = len(want) == value.ndim and all(
            w in (None, v) for w, v in zip(want, value.shape, strict=True)
        )
        if not fits or value.dtype != np.dtype(spec.dtype):
            raise TransferError(
                f"state {name!r} is {value.dtype}{list(value.shape)}; this model's is "
                f"{spec.dtype}{list(spec.shape)}"
            )


def _buffer(doc: object) -> ActionBuffer | None:
    if doc is None:
        return None
    try:
        assert isinstance(doc, dict)
        chunks = tuple((int(start), chunk) for start, chunk in doc["chunks"])
        if not all(isinstance(c, np.ndarray) for _, c in chunks):
            raise TransferError("a buffer's chunks must be arrays")
        return ActionBuffer(int(doc["t"]), chunks)
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise TransferError(f"a record's buffer is malformed: {exc}") from None


def _sent(doc: object, now: float) -> tuple[Array, float] | None:
    if doc is None:
        return None
    if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[0], np.ndarray)):
        raise TransferError("a record's sent chunk must be [chunk, age]")
    age = doc[1]
    if not isinstance(age, int | float) or isinstance(age, bool) or age < 0:
        raise TransferError("a record's sent chunk's age must be a number >= 0")
    return doc[0], now - float(age)


def _latency(doc: object) -> tuple[float, ...]:
    if not isinstance(doc, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in doc
    ):
        raise TransferError("a record's latency must be a list of seconds")
    return tuple(float(v) for v in doc)


def record_bytes(record: Episode) -> int:
    """The tensor bytes a record carries (its state, buffer, reply, sent chunk, held inputs)."""
    arrays: list[Array] = list(record.state.values())
    if record.buffer is not None:
        arrays += [c for _, c in record.buffer.chunks]
    if record.reply is not None:
        arrays += list(record.reply.outputs.values())
    if record.sent is not None:
        arrays.append(record.sent[0])
    if record.asked is not None:
        arrays += list(record.asked.values())
    return sum(a.nbytes for a in arrays)
