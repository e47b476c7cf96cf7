"""An episode's record between nodes: what a live hand-over sends, binary, size-checked.

Everything the owner remembers about the episode moves. That is the recurrent state, the
action buffer and its position, and the latency window. It is the chunk real-time chunking
last sent, with its age (clocks differ between hosts). It is ``seq``, the stored reply, the
inputs of a step held for its retry, and the claim's model. The record before the last step
does not move. So an undo of the last step that reaches the new owner leaves the episode in
doubt: the next step says ``state_reset``. Tensors travel as msgpack arrays
(``affinity/wire.py``: shapes checked against the message before anything is allocated).
The receiver checks the whole record against the contract of the model it names before
it installs anything: the model must be a ``name@version`` served there, and its state,
action buffer, real-time-chunking chunk, stored reply and held inputs must have the names,
dtypes and shapes that model's steps make (a record that does not fit would answer its
next step with a bare 500). The episode's ghost (``node/shadow.py``) may travel with it,
optional: a receiver that does not run its candidate, or cannot read it, drops the ghost
and takes the live record all the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from affinity import wire
from node.chunks import ActionBuffer
from node.contract import PolicyContract, TensorSpec
from node.episodes import Episode, StepResult
from node.errors import ModelNotServed, TransferError
from node.record import is_hosted
from node.rtc import Used

__all__ = [
    "GhostCarry",
    "Install",
    "Settle",
    "check_record",
    "decode_install",
    "decode_move",
    "encode_install",
    "encode_settle",
    "hosted",
    "on_host",
    "record_bytes",
]

Array = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class GhostCarry:
    """A ghost episode that moves with its live one (``node/shadow.py``): the candidate and
    live versions, whether it ran from its episode's start without a restart, the live
    ``seq`` it ran last, its figures so far, and its record (state, buffer, RTC chunk)."""

    candidate: str
    live: str
    continuous: bool
    last_seq: int
    compared: int
    max_abs: float
    record: Episode


@dataclass(frozen=True, slots=True)
class Install:
    """What the old owner sends the new one: the episode, the new claim (device, token,
    claim id) Redis reserved, the old owner's node, and the record. ``ghost``: its ghost
    episode's, if it has one in step with it (optional: a receiver without the candidate,
    or one that cannot read it, drops it and the ghost restarts there)."""

    episode: str
    device: str
    token: int
    claim: str
    origin_node: str
    record: Episode
    ghost: GhostCarry | None = None


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


def _buffer_doc(buffer: ActionBuffer | None) -> dict[str, Any] | None:
    return None if buffer is None else {"t": buffer.t, "chunks": [list(c) for c in buffer.chunks]}


def _ghost_doc(g: GhostCarry, now: float) -> dict[str, Any]:
    r = g.record
    return {
        "candidate": g.candidate,
        "live": g.live,
        "continuous": g.continuous,
        "last_seq": g.last_seq,
        "compared": g.compared,
        "max_abs": g.max_abs,
        "state": on_host(r.state),
        "seq": r.seq,
        "buffer": _buffer_doc(r.buffer),
        "reply": _reply(r.reply),
        "sent": None if r.sent is None else [r.sent[0], max(0.0, now - r.sent[1])],
        "latency": list(r.latency),
    }


def _ghost(
    doc: object, ghosts: Mapping[str, PolicyContract], device: str, now: float
) -> GhostCarry | None:
    """The ghost a hand-over carries, or None: none, a candidate not run here, or one that
    does not fit the candidate (it restarts here; the live record moves all the same)."""
    if not isinstance(doc, dict) or doc.get("candidate") not in ghosts:
        return None
    try:
        candidate, live = str(doc["candidate"]), str(doc["live"])
        seq, last_seq, compared = doc["seq"], doc["last_seq"], doc["compared"]
        if not all(type(v) is int for v in (seq, last_seq, compared)):
            raise TransferError("a ghost's seq and counts must be integers")
        record = Episode(
            device, 0, "", _arrays(doc["state"], "a ghost's state"), now, seq,
            _buffer(doc["buffer"]), _result(doc["reply"]), sent=_sent(doc["sent"], now),
            latency=_latency(doc["latency"]), model=candidate,
        )  # fmt: skip
        check_record(record, ghosts[candidate])
        return GhostCarry(candidate, live, doc["continuous"] is True, last_seq, compared,
                          float(doc["max_abs"]), record)  # fmt: skip
    except (TransferError, KeyError, TypeError, ValueError):
        return None


def encode_install(install: Install, now: float) -> bytes:
    """The message, with the record's clock times as ages (``now``: this node's clock)."""
    r = install.record
    buffer = _buffer_doc(r.buffer)
    return wire.encode(
        {
            "episode_id": install.episode,
            "device": install.device,
            "token": install.token,
            "claim": install.claim,
            "from": install.origin_node,
            "model": r.model,
            "state": on_host(r.state),
            "seq": r.seq,
            "buffer": buffer,
            "reply": _reply(r.reply),
            "origin": r.origin,
            "doubt": r.doubt,
            "pinned": r.pinned,
            "sent": None if r.sent is None else [r.sent[0], max(0.0, now - r.sent[1])],
            "latency": list(r.latency),
            "asked": None if r.asked is None else dict(r.asked),
            "ghost": None if install.ghost is None else _ghost_doc(install.ghost, now),
        }
    )


@dataclass(frozen=True, slots=True)
class Settle:
    """The old owner's word on a copy it sent: ``confirm`` (its move committed) or ``drop``
    (the move will never commit)."""

    op: Literal["confirm", "drop"]
    episode: str
    claim: str


def encode_settle(settle: Settle) -> bytes:
    """``settle`` as a message of ``POST /internal/move``."""
    return wire.encode({"op": settle.op, "episode_id": settle.episode, "claim": settle.claim})


def decode_move(
    body: bytes,
    served: Mapping[str, PolicyContract],
    now: float,
    ghosts: Mapping[str, PolicyContract] | None = None,
) -> Install | Settle:
    """A message of ``POST /internal/move``: a :class:`Settle`, or an :class:`Install` as
    :func:`decode_install` reads it. Raises ``wire.WireError`` for a body that is not
    msgpack; else as :func:`decode_install`."""
    doc = wire.decode(body)
    op = doc.get("op", "install") if isinstance(doc, dict) else None
    if op in ("confirm", "drop"):
        return Settle(op, str(doc.get("episode_id", "")), str(doc.get("claim", "")))
    return _install_of(doc, served, now, ghosts)


def decode_install(
    body: bytes,
    served: Mapping[str, PolicyContract],
    now: float,
    ghosts: Mapping[str, PolicyContract] | None = None,
) -> Install:
    """The message back, the record's times on this node's clock. ``served`` maps each
    ``name@version`` served here to its contract; ``ghosts`` each candidate this node runs
    as ghosts (a carried ghost of another one is dropped: :func:`_ghost`). Raises
    :class:`ModelNotServed` when the record's model is not one of them,
    :class:`TransferError` when the record is malformed or does not fit its model's
    contract (:func:`check_record`)."""
    try:
        doc = wire.decode(body)
    except wire.WireError as exc:
        raise TransferError(str(exc)) from None
    return _install_of(doc, served, now, ghosts)


def _install_of(
    doc: object,
    served: Mapping[str, PolicyContract],
    now: float,
    ghosts: Mapping[str, PolicyContract] | None,
) -> Install:
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
    contract = _contract_of(model, served)
    install = Install(
        episode,
        device,
        token,
        claim,
        origin_node,
        Episode(
            device,
            token,
            claim,
            _arrays(doc["state"], "a record's state"),
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
        _ghost(doc.get("ghost"), ghosts or {}, device, now),
    )
    check_record(install.record, contract)
    return install


def _contract_of(model: str, served: Mapping[str, PolicyContract]) -> PolicyContract:
    """The contract of the record's ``name@version``, served here."""
    name, at, version = model.partition("@")
    if not (name and at and version):
        raise TransferError(f"a record's model must be name@version, not {model!r}")
    contract = served.get(model)
    if contract is None:
        here = ", ".join(sorted(served)) or "none"
        raise ModelNotServed(f"the record's model {model} is not served here (served: {here})")
    return contract


def check_record(record: Episode, contract: PolicyContract) -> None:
    """Raise :class:`TransferError` naming the first part of ``record`` that does not fit
    ``contract`` as this node's own steps would have made it: its state (every state
    input, one step's shape), its action buffer (``[H, D]`` chunks of the chunk output's
    dtype, at most H of them, never ahead of ``t``), the chunk real-time chunking last sent
    (``[H, D]``), its stored reply (returned outputs, the chunk output as a chunk or as one
    action; its RTC values 0..H) and its held inputs (the model's inputs)."""
    inputs = {spec.name: contract.step_spec(spec) for spec in contract.inputs}
    outputs = {spec.name: contract.step_spec(spec) for spec in contract.returned_outputs}
    if set(record.state) != set(contract.state):
        raise TransferError(
            f"the record's state {sorted(record.state)} is not this model's "
            f"{sorted(contract.state)}"
        )
    for name, value in record.state.items():
        _check_array(f"state {name!r}", value, inputs[name])
    chunk = None if contract.chunk is None else outputs.get(contract.chunk)
    if record.buffer is not None:
        _check_buffer(record.buffer, chunk, contract)
    if record.sent is not None:
        if chunk is None:
            raise TransferError("the record's sent chunk: this model has no action chunk")
        _check_array("the sent chunk", record.sent[0], _chunk_rows(chunk, contract))
    if record.reply is not None:
        _check_reply(record.reply, outputs, chunk, contract)
    for name, value in (record.asked or {}).items():
        if name not in inputs:
            raise TransferError(f"held input {name!r} is not an input of this model")
        _check_array(f"held input {name!r}", value, inputs[name])


def _check_buffer(buffer: ActionBuffer, chunk: TensorSpec | None, contract: PolicyContract) -> None:
    if chunk is None:
        raise TransferError("the record's buffer: this model has no action chunk")
    rows = _chunk_rows(chunk, contract)
    horizon = rows.shape[0]
    assert isinstance(horizon, int)  # checked at load
    if buffer.t < 0 or len(buffer.chunks) > horizon:
        raise TransferError(
            f"the record's buffer holds {len(buffer.chunks)} chunk(s) at step {buffer.t}; "
            f"this model's holds at most {horizon} at a step >= 0"
        )
    for start, value in buffer.chunks:
        if not 0 <= start <= buffer.t:
            raise TransferError(f"a buffered chunk starts at step {start}, after {buffer.t}")
        _check_array("a buffered chunk", value, rows)


def _check_reply(
    reply: StepResult,
    outputs: Mapping[str, TensorSpec],
    chunk: TensorSpec | None,
    contract: PolicyContract,
) -> None:
    for name, value in reply.outputs.items():
        spec = outputs.get(name)
        if spec is None:
            raise TransferError(
                f"the stored reply's {name!r} is not an output of this model ({', '.join(outputs)})"
            )
        if spec is chunk and chunk is not None and value.ndim == len(chunk.shape) - 1:
            # a chunk model's step may answer one action: the chunk without its time axis
            spec = TensorSpec(name, (*chunk.shape[:-2], chunk.shape[-1]), chunk.dtype)
        _check_array(f"the stored reply's {name!r}", value, spec)
    used, horizon = reply.rtc, (contract.chunk_shape or (-1, 0))[0]
    if used is not None and not all(
        0 <= v <= horizon for v in (used.executed, used.delay, used.prefix_len)
    ):
        raise TransferError(
            f"the stored reply's rtc values {used.to_json()} do not fit this model's chunk "
            f"(0 to its horizon {horizon})"
        )


def _chunk_rows(chunk: TensorSpec, contract: PolicyContract) -> TensorSpec:
    """The ``[H, D]`` chunk a step's chunk output holds (its batch axis dropped)."""
    shape = chunk.shape[1:] if contract.batch_axis else chunk.shape
    return TensorSpec(chunk.name, shape, chunk.dtype)


def _check_array(what: str, value: Array, spec: TensorSpec) -> None:
    """Raise :class:`TransferError` unless ``value`` has ``spec``'s dtype and shape
    (a symbolic or unknown dimension takes any size)."""
    want = tuple(d if isinstance(d, int) else None for d in spec.shape)
    fits = len(want) == value.ndim and all(
        w in (None, v) for w, v in zip(want, value.shape, strict=True)
    )
    if not fits or value.dtype != np.dtype(spec.dtype):
        raise TransferError(
            f"{what} is {value.dtype}{list(value.shape)}; this model's is "
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


def on_host(state: Mapping[str, Any]) -> dict[str, Array]:
    """``state`` as host arrays, which a message needs: a state kept on the device
    (``node.binding.DeviceTensor``, ``--cuda-graph``) is copied to the host, one held by a
    device's worker process (``node.deviceprocs.RemoteState``) is read back from it (a
    round trip: call :func:`hosted` off the event loop). The episode is idle meanwhile: no
    run writes it."""
    return {k: v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in state.items()}


def hosted(record: Episode) -> Episode:
    """``record`` with its state as host arrays (:func:`on_host`); itself when it is."""
    return record if is_hosted(record) else replace(record, state=on_host(record.state))


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
