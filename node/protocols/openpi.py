"""openpi's websocket policy protocol, as the unmodified ``openpi-client`` speaks it.

On every path of the node's port (``ws://node:8000``, ``ws://node:8000/?episode_id=ep-42``):

1. The client connects (``Authorization: Api-Key <key>`` when the node has ``--api-key``).
   Without the right key the handshake is answered 401 with the project's JSON error,
   ``unauthorized``, and an access line, as ``POST /act`` is.
2. The node sends one binary msgpack map, the metadata: the model sidecar's ``metadata``
   (e.g. ``reset_pose``) plus ``affinity``: ``policy`` (the contract of ``GET /model``),
   ``node`` and ``episode_id`` (when the connection names one).
3. Lockstep: the client sends an observation (msgpack map, nested or flat keys, numpy
   arrays in openpi's encoding, unbatched). The node answers a msgpack map. It holds
   every model output without its batch axis (``actions`` ``[H, D]``) and the step's
   facts as scalars (``episode_id``, ``device``, ``node``, ``token``, ``routing``,
   ``state_reset``, ``source``). It also holds ``policy_timing``/``server_timing`` maps.
   So openpi's ``ActionChunkBroker``, which slices every array along its first axis,
   works unchanged.

The episode of a step is ``?episode_id=`` of the connection. Else it is an ``episode_id``
key in the observation; a robot reusing one connection across episodes switches with it.
Else it is one fresh id per connection, released when the connection closes. The connection
remembers each episode's last token and echoes it, so a lost assignment is reported as
``state_reset: true``. ``execute_steps`` and ``ensemble`` keys override action-chunk
execution (openpi clients usually keep their own ``ActionChunkBroker`` and leave it off). A
``seq`` key makes a retry after a reconnect safe. It is the step number the robot expects to
be applied: its last reply's ``seq`` + 1. ``executed``, ``inference_delay`` and
``control_hz`` keys are a real-time-chunking model's step values (``node/rtc.py``). The
reply then has ``rtc``: ``{"executed", "delay", "prefix_len"}``. ``control_hz`` is any
model's step's control rate. ``timing: true`` adds the map ``timing``, the split of the
step's time. All these keys are taken out before the model.

**Many environments in one frame** (issue 44): an observation with an ``episode_ids`` key
(a list of K episode ids) holds K rows: each array (and each list of K values, such as K
prompts) has a leading environment axis, row i takes element i; anything else (a scalar,
one prompt) is every row's. ``seq`` may be a list of K step numbers. The reply holds each
output stacked along that axis (``actions`` ``[K, H, D]``; zeros in a failed row) and
``rows``: a list of each row's facts, or ``{"error": {"status", "code", "message"}}``. A
row's error never closes the connection; an id in two rows, or more rows than
``--max-rows`` (counted once the frame is parsed, its arrays still views of it, before any
row is), is the frame's error.

A reply whose send fails (the link dropped) has its step undone. So has a step whose
connection closes while it runs (the robot gave up on it and reconnects to retry). The
connection is watched during a step, as ``/act``'s is, so the retry never finds the lost
step applied. A step that named its ``seq`` is held for that retry instead.

The client cannot retry: transient conditions (owner unreachable, a Redis blip, ``full``)
are retried inside the node until ``--act-deadline``. Anything that still fails, and any
bad observation, gets openpi's error. That is a text frame with the message, then close
code 1011 (the client raises ``RuntimeError`` with the text). Nothing changes for a bad
observation. A connection whose query has a key other than ``episode_id`` gets that error
in reply to its first observation.

Every step writes one access-log line, in either log format, like a request's. It holds
``"WS /"`` and the HTTP status the same outcome gets on ``/act`` (200, 400, 422, 503...).
It also holds the latency, and the step's episode, device and routing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qs

import numpy as np

from affinity import InvalidArgument, check_episode, wire
from node import inputs
from node.accesslog import AccessLog
from node.asgi import Receive, Scope, Send, header, io_seen
from node.contract import Array, PolicyContract
from node.errors import (
    ClientGone,
    HopError,
    InvalidInput,
    Outcome,
    Refused,
    Unavailable,
    outcome,
)
from node.inputs import ObservationInputs, outputs_unbatched
from node.protocols.openpiframe import (
    CLOSE_ERROR,
    FIELDS,
    denied,
    fail,
    finished,
    log_line,
    observation,
    refusal,
    unauthorized,
    watching,
)
from node.rtc import control_rate
from node.service import NodeService
from node.step import Reply, Step

__all__ = ["CLOSE_ERROR", "Connection", "Served", "handle", "opening"]

log = logging.getLogger("affinity.node")

T = TypeVar("T")

QUERY_KEYS = frozenset({"episode_id", "model"})
"""The query keys a connection may carry; any other is refused (a typo must not silently
make the connection's episode anonymous)."""
REFUSALS = (InvalidInput, InvalidArgument, wire.WireError, Unavailable, Refused)
"""What a step may fail with: openpi's error, then the connection closes."""


def metadata(
    service: NodeService,
    episode: str | None,
    contract: PolicyContract | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """The sidecar's metadata of the connection's model (what openpi clients read, e.g.
    ``reset_pose``) with the node's own facts under ``affinity``: the policy contract, the
    model's name, the node, the episode."""
    contract = contract or service.contract
    return {
        **dict(contract.metadata),
        "affinity": {
            "policy": contract.to_json(),
            "model": model or next(iter(service.models)),
            "node": service.node_id,
            "episode_id": episode,
        },
    }


@dataclass
class FrontChecked:
    """One observation's inputs as a front door checked and converted them against the
    connection's input check (``node/front.py``): the check's key, the model's inputs
    (batch axis added) and the observation keys the model does not take."""

    key: str
    inputs: dict[str, Array]
    ignored: tuple[str, ...]


class Watch(Protocol):
    """How a step's work is awaited: watched for the connection's close (the node's own
    door: :func:`~node.protocols.openpiframe.watching`), or as it is (behind a front
    door, which watches the connection itself and says when a reply was not delivered)."""

    def __call__(self, work: Awaitable[T]) -> Awaitable[T]: ...


async def unwatched(work: Awaitable[T]) -> T:
    return await work


@dataclass
class Served:
    """What one frame's steps gave: the reply (a frame of rows: whole; one step: its
    outputs and facts, without openpi's timings, added by
    :func:`~node.protocols.openpiframe.finished` once the step's time is known), the
    replies to undo when it is not delivered, and the access line's device and routing."""

    doc: dict[str, Any]
    replies: list[Reply]
    rows: bool
    served: tuple[str, str] | None = None
    device_ms: float | None = None
    split: dict[str, Any] | None = None


class Connection:
    """One connection's state and the semantics of its steps (the module doc): the
    episode of a step, the tokens and claims it echoes per episode, its own episode, ended
    with it. The node's own door (:func:`handle`) and the core behind the front doors
    (``node/fronts.py``, each frame decoded by a front) both serve a frame through it: one
    implementation of the rules."""

    def __init__(
        self, service: NodeService, fixed: str | None, model: str, contract: PolicyContract
    ) -> None:
        self.service = service
        self.fixed = fixed
        self.model = model
        self.contract = contract
        self.own = f"ws-{uuid.uuid4().hex}"  # this connection's episode, when nothing names one
        self.tokens: dict[str, int] = {}  # last token per episode, echoed as the client's
        self.claims: dict[str, str] = {}  # last claim id per episode, echoed likewise
        self.episode: str | None = None
        """The episode of the frame being served (its access line's), once decoded."""
        self.serving = asyncio.Lock()
        """Held by a step: the close waits for it. Behind a front, a client that leaves
        mid-step has its close told to the core while the step still runs there; its own
        episode must not end under it."""

    async def step(
        self,
        observation: dict[Any, Any],
        now: float,
        watch: Watch,
        checked: FrontChecked | None = None,
    ) -> Served:
        """Serve one observation (decoded, received at ``now``; ``checked``: its inputs as
        a front checked them, :func:`decode_observation`). Raises what :data:`REFUSALS`
        names (nothing applied), :class:`ClientGone` from ``watch`` (the rows served so far
        undone; a step cancelled is undone by the router)."""
        async with self.serving:
            return await self._step(observation, now, watch, checked)

    async def _step(
        self,
        observation: dict[Any, Any],
        now: float,
        watch: Watch,
        checked: FrontChecked | None,
    ) -> Served:
        service = self.service
        self.episode = None
        if "episode_ids" in observation:
            if checked is not None:  # (a front checks one environment's frames alone)
                raise HopError("a frame of rows checked by a front")
            rows = decode_rows(service, observation, self.tokens, now, self.model, self.contract)
            served: list[Reply | Exception | None] = []  # the rows' replies so far
            try:
                await watch(_serve_rows(service, rows, served))
            except ClientGone:
                for r in served:
                    if isinstance(r, Reply):
                        await service.router.undelivered(r)
                raise
            doc = _rows_reply(self.contract, rows, served, self.tokens, self.claims)
            return Served(doc, [r for r in served if isinstance(r, Reply)], rows=True)
        step = decode_observation(service, observation, self.fixed, self.own, self.tokens, now,
                                  self.model, self.contract, checked)  # fmt: skip
        self.episode = step.episode
        assert step.episode is not None
        step.client_claim = self.claims.get(step.episode)
        reply = await watch(service.router.act(step, patient=True))
        self.tokens[step.episode] = reply.token
        if reply.claim:
            self.claims[step.episode] = reply.claim
        doc = {**outputs_unbatched(self.contract, reply.outputs), **reply.facts()}
        split = reply.split() if step.timing else None
        return Served(
            doc, [reply], False, (reply.device, reply.routing), reply.timing.get("device_ms"), split
        )

    async def close(self) -> None:
        """The connection closed: its own episode ends with it (once a step still
        running has finished)."""
        async with self.serving:
            token = self.tokens.pop(self.own, None)
            if token is not None:
                await self.service.router.end_here(self.own, token)


async def handle(
    service: NodeService, scope: Scope, receive: Receive, send: Send, access: AccessLog
) -> None:
    """The ASGI handler of a websocket connection; ``access`` gets one line per step."""
    conn = await connect(service, scope, receive, send, access)
    if conn is None:
        return
    prev_total_ms: float | None = None
    early: list[asyncio.Future[MutableMapping[str, Any]]] = []  # a receive begun mid-step

    def watch(work: Awaitable[T]) -> Awaitable[T]:
        return watching(receive, work, early)

    try:
        while True:
            message = await early.pop() if early else await receive()
            if message["type"] == "websocket.disconnect":
                return
            started = time.monotonic()
            try:
                frame = observation(message, service.config.max_rows)
                served = await conn.step(frame, started, watch)
            except ClientGone:  # closed mid-step: cancelled there, so undone (or held)
                log_line(access, scope, started, 499, conn.episode)
                return
            except REFUSALS as exc:
                o = outcome(exc)
                log_line(access, scope, started, o.status, conn.episode)
                await refuse(service, send, o)
                return
            log_line(access, scope, started, 200, conn.episode, served.served)
            doc = served.doc
            if not served.rows:
                total_ms = (time.monotonic() - started) * 1000
                doc = finished(doc, served.device_ms, total_ms, prev_total_ms, served.split)
            try:
                await io_seen()  # a close that came with the frame fails the send: undone
                await send({"type": "websocket.send", "bytes": wire.encode(doc)})
            except OSError:  # uvicorn's ClientDisconnected: the robot never gets this step
                for r in served.replies:
                    await service.router.undelivered(r)
                return
            if not served.rows:
                prev_total_ms = (time.monotonic() - started) * 1000
    finally:
        await conn.close()


async def opening(
    service: NodeService, query_string: bytes
) -> tuple[Connection | None, bytes | None, str | None]:
    """What a connection's query opens: (its connection, its metadata frame, None); for a
    bad query (an unknown key or model) (None, the metadata frame, the error its first
    observation gets); for a malformed ``?episode_id=`` (None, None, None): closed before
    the handshake (counted ``bad_input``)."""
    query = parse_qs(query_string.decode("latin-1"), keep_blank_values=True)
    unknown = sorted(set(query) - QUERY_KEYS)
    try:
        fixed = check_episode(query["episode_id"][0]) if "episode_id" in query else None
    except InvalidArgument:
        service.metrics.rejected.labels("bad_input").inc()
        return None, None, None
    try:
        name, contract = await service.model_for(query["model"][0] if "model" in query else None)
        problem = None
    except (Refused, InvalidArgument) as exc:  # no such model, or none named among several
        name, contract, problem = None, service.contract, f"bad query: {exc}"
    frame = wire.encode(metadata(service, fixed, contract, name))
    if unknown and problem is None:
        names = ", ".join(repr(key) for key in unknown)
        problem = f"bad query: unknown key {names}; the keys are episode_id and model"
    if problem is not None:
        return None, frame, problem
    assert name is not None
    return Connection(service, fixed, name, contract), frame, None


def open_failed(exc: Exception) -> Outcome:
    """What a handshake whose :func:`opening` raised answers before the upgrade: the
    error's own status (503 ``redis`` with its ``Retry-After`` when the fleet's store did
    not answer), as the HTTP doors answer it; an unforeseen one is logged, 500."""
    refused = outcome(exc)
    if refused.code == "internal":
        log.error("opening an openpi connection failed", exc_info=exc)
    return refused


async def connect(
    service: NodeService, scope: Scope, receive: Receive, send: Send, access: AccessLog
) -> Connection | None:
    """Accept a connection and send its metadata; its :class:`Connection`, or None once
    it was refused (401, a bad query: closed or answered)."""
    if (await receive())["type"] != "websocket.connect":
        return None
    if not service.client_allowed(header(scope, b"authorization")):
        service.metrics.rejected.labels("unauthorized").inc()
        await unauthorized(scope, send, access, time.monotonic())
        return None
    started = time.monotonic()
    try:
        conn, frame, problem = await opening(service, scope.get("query_string", b""))
    except Exception as exc:  # Redis gone while it picks the model, say: refused
        await denied(scope, send, access, started, open_failed(exc))
        return None
    if frame is None:
        await send({"type": "websocket.close", "code": 1008})
        return None
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "bytes": frame})
    if conn is None:
        # openpi's client reads the metadata on connect and an error only as a step's reply
        if (await receive())["type"] == "websocket.receive":
            service.metrics.rejected.labels("bad_input").inc()
            await fail(send, problem or "bad query")
        return None
    return conn


def _row_of(value: object, i: int, count: int) -> object:
    """Row ``i`` of an observation value: element i of an array or list of ``count``
    rows (maps: of each of their values), else the value itself (every row's)."""
    if isinstance(value, dict):
        return {k: _row_of(v, i, count) for k, v in value.items()}
    if (
        isinstance(value, np.ndarray | list)
        and len(value) == count
        and (not isinstance(value, np.ndarray) or value.ndim > 0)
    ):
        return value[i]
    return value


def decode_rows(
    service: NodeService,
    observation: dict[Any, Any],
    tokens: dict[str, int],
    now: float,
    model: str | None,
    contract: PolicyContract | None,
) -> list[Step | Exception]:
    """The rows of an observation with ``episode_ids`` (see the module doc): each row's
    step, or the exception that is its error. Raises ``InvalidArgument`` and
    :class:`Refused` (an id in two rows) for the frame as a whole."""
    ids = observation.pop("episode_ids")
    if not isinstance(ids, list | np.ndarray) or not ids:
        raise InvalidArgument("episode_ids", ids, "must be a list of episode ids")
    episodes = [check_episode(_scalar(e)) for e in ids]
    if len(set(episodes)) != len(episodes):
        twice = next(e for e in episodes if episodes.count(e) > 1)
        raise Refused(400, "duplicate_episode",
                      f"episode {twice[:64]!r} is in two rows of one observation")  # fmt: skip
    count = len(episodes)
    rows: list[Step | Exception] = []
    for i, episode in enumerate(episodes):
        row = {k: _row_of(v, i, count) for k, v in observation.items()}
        row["episode_id"] = episode
        try:
            rows.append(
                decode_observation(service, row, None, episode, tokens, now, model, contract)
            )
        except (InvalidInput, InvalidArgument, wire.WireError, Unavailable, Refused) as exc:
            rows.append(exc)
    return rows


async def _serve_rows(
    service: NodeService, rows: list[Step | Exception], served: list[Reply | Exception | None]
) -> None:
    steps = [r for r in rows if isinstance(r, Step)]
    served.extend([None] * len(steps))
    await service.router.act_rows(steps, served, patient=True)  # as one-row openpi steps


def _rows_reply(
    contract: PolicyContract,
    rows: list[Step | Exception],
    served: list[Reply | Exception | None],
    tokens: dict[str, int],
    claims: dict[str, str],
) -> dict[str, Any]:
    """The reply of a frame of rows: outputs stacked, ``rows`` each row's facts or error."""
    it = iter(served)
    results: list[Reply | Exception] = []
    for row in rows:
        got = row if isinstance(row, Exception) else next(it)
        results.append(got if got is not None else Unavailable("deadline", "not served"))
    facts: list[dict[str, Any]] = []
    outputs: list[dict[str, Any] | None] = []
    for r in results:
        if isinstance(r, Reply):
            assert r.episode is not None
            tokens[r.episode] = r.token
            if r.claim:
                claims[r.episode] = r.claim
            facts.append(r.facts())
            outputs.append(outputs_unbatched(contract, r.outputs))
        else:
            o = outcome(r)
            facts.append({"error": {"status": o.status, "code": o.code, "message": o.message}})
            outputs.append(None)
    like = next((o for o in outputs if o is not None), None)
    doc: dict[str, Any] = {"rows": facts}
    for name, array in (like or {}).items():
        doc[name] = np.stack([np.zeros_like(array) if o is None else o[name] for o in outputs])
    return doc


def decode(
    service: NodeService,
    message: Mapping[str, Any],
    fixed: str | None,
    own: str,
    tokens: dict[str, int],
    now: float,
    model: str | None = None,
    contract: PolicyContract | None = None,
) -> Step:
    """One observation frame as a step: the episode is ``fixed`` (the connection's
    ``?episode_id=``), else the observation's ``episode_id``, else ``own``. Raises
    ``wire.WireError``, :class:`InvalidInput` and ``InvalidArgument``; nothing has changed
    anywhere."""
    frame = observation(message, service.config.max_rows)
    return decode_observation(service, frame, fixed, own, tokens, now, model, contract)


def decode_observation(
    service: NodeService,
    observation: dict[Any, Any],
    fixed: str | None,
    own: str,
    tokens: dict[str, int],
    now: float,
    model: str | None = None,
    contract: PolicyContract | None = None,
    checked: FrontChecked | None = None,
) -> Step:
    """:func:`decode` of a decoded observation map (its step's fields, :data:`FIELDS`,
    taken out of it). ``checked``: its inputs as a front checked and converted them
    against the connection's contract (``node/front.py``), the observation then holding
    the fields alone."""
    fields = {key: observation.pop(key, None) for key in FIELDS if key != "timing"}
    named, steps, ensemble = fields["episode_id"], fields["execute_steps"], fields["ensemble"]
    seq, executed, delay = fields["seq"], fields["executed"], fields["inference_delay"]
    control_hz, pending = fields["control_hz"], fields["pending"]
    timing = _scalar(observation.pop("timing", False))
    if not isinstance(timing, bool):
        raise InvalidArgument("timing", timing, "must be true or false")
    if seq is not None and (type(seq) is not int or seq < 1):
        raise InvalidArgument("seq", seq, "must be a step number >= 1 (the last reply's seq + 1)")
    episode = fixed or (own if named is None else check_episode(named))
    _, rtc = service.options_for(  # InvalidArgument names the field
        model, steps, ensemble, _scalar(executed), _scalar(delay), _scalar(control_hz), pending
    )
    contract = contract or service.contract
    if checked is None:
        converted = inputs.from_observation(contract, observation)
    elif contract.input_check is not None and checked.key == contract.input_check.key:
        converted = ObservationInputs(checked.inputs, checked.ignored)
    else:  # (the front has the check this connection's open gave it: a bug)
        raise HopError("an observation checked against another contract")
    if converted.ignored:
        service.warn_once(
            f"openpi-ignored:{converted.ignored}",
            "openpi observations carry keys the model does not take (ignored): %s",
            ", ".join(converted.ignored),
        )
    return Step(
        episode=episode,
        inputs=converted.inputs,
        deadline=now + service.config.act_deadline_s,
        client_token=tokens.get(episode),
        execute_steps=steps,
        ensemble=ensemble,
        seq=seq,
        model=model,
        rtc=rtc,
        door="openpi",
        received=now,
        control_hz=control_rate(_scalar(control_hz)),
        timing=timing,
    )


def _scalar(value: object) -> object:
    """A numpy scalar (as openpi clients may send a count) as the Python number."""
    return value.item() if isinstance(value, np.generic) else value


def log_step(
    access: AccessLog,
    scope: Scope,
    started: float,
    status: int,
    step: Step | None,
    served: tuple[str, str] | None = None,
) -> None:
    """The access line of one websocket step (:func:`~node.protocols.openpiframe.log_line`)
    of ``step`` (its episode; none for a frame refused before it was decoded)."""
    log_line(access, scope, started, status, None if step is None else step.episode, served)


async def refuse(service: NodeService, send: Send, o: Outcome) -> None:
    """openpi's error for a step's :class:`~node.errors.Outcome`, counted: a bad
    observation says so, a refused step names its code."""
    if o.reject_reason is not None:
        service.metrics.rejected.labels(o.reject_reason).inc()
    await fail(send, refusal(o))
