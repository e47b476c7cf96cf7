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
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, TypeVar
from urllib.parse import parse_qs

import numpy as np

from affinity import InvalidArgument, check_episode, wire
from node import inputs
from node.accesslog import STEP_KEY, AccessLog
from node.asgi import Receive, Scope, Send, cancel_when_gone, error_body, header, io_seen
from node.contract import PolicyContract
from node.errors import ClientGone, InvalidInput, Outcome, Refused, Unavailable, outcome
from node.inputs import outputs_unbatched
from node.rtc import control_rate
from node.service import NodeService
from node.step import Reply, Step

__all__ = ["handle"]

log = logging.getLogger("affinity.node")

T = TypeVar("T")

CLOSE_ERROR = 1011
QUERY_KEYS = frozenset({"episode_id", "model"})
"""The query keys a connection may carry; any other is refused (a typo must not silently
make the connection's episode anonymous)."""


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


async def handle(
    service: NodeService, scope: Scope, receive: Receive, send: Send, access: AccessLog
) -> None:
    """The ASGI handler of a websocket connection; ``access`` gets one line per step."""
    opened = await connect(service, scope, receive, send, access)
    if opened is None:
        return
    fixed, name, contract = opened
    own = f"ws-{uuid.uuid4().hex}"  # this connection's episode, when nothing names one
    tokens: dict[str, int] = {}  # last token per episode, echoed as the client's
    claims: dict[str, str] = {}  # last claim id per episode, echoed likewise
    prev_total_ms: float | None = None
    early: list[asyncio.Future[MutableMapping[str, Any]]] = []  # a receive begun mid-step
    try:
        while True:
            message = await early.pop() if early else await receive()
            if message["type"] == "websocket.disconnect":
                return
            started = time.monotonic()
            step: Step | None = None
            served: list[Reply | Exception | None] = []  # a frame of rows' replies so far
            try:
                observation = _observation(message, service.config.max_rows)
                if "episode_ids" in observation:
                    rows = decode_rows(service, observation, tokens, started, name, contract)
                    await watching(receive, _serve_rows(service, rows, served), early)
                    answer = _rows_reply(contract or service.contract, rows, served, tokens, claims)
                    log_step(access, scope, started, 200, None)
                    if not await _send(service, send, answer, served):
                        return
                    continue
                step = decode_observation(
                    service, observation, fixed, own, tokens, started, name, contract
                )
                step.client_claim = claims.get(step.episode or "")
                reply = await watching(receive, service.router.act(step, patient=True), early)
            except ClientGone:  # closed mid-step: cancelled there, so undone (or held)
                for r in served:
                    if isinstance(r, Reply):
                        await service.router.undelivered(r)
                log_step(access, scope, started, 499, step)
                return
            except (InvalidInput, InvalidArgument, wire.WireError, Unavailable, Refused) as exc:
                refusal = outcome(exc)
                log_step(access, scope, started, refusal.status, step)
                await refuse(service, send, refusal)
                return
            assert step.episode is not None
            tokens[step.episode] = reply.token
            if reply.claim:
                claims[step.episode] = reply.claim
            log_step(access, scope, started, 200, step, (reply.device, reply.routing))
            total_ms = (time.monotonic() - started) * 1000
            doc: dict[str, Any] = {
                **outputs_unbatched(contract, reply.outputs),
                **reply.facts(),
                "policy_timing": {"infer_ms": reply.timing.get("device_ms", total_ms)},
                "server_timing": {"infer_ms": total_ms},
            }
            if prev_total_ms is not None:
                doc["server_timing"]["prev_total_ms"] = prev_total_ms
            if step.timing:
                doc["timing"] = reply.split()
            try:
                await io_seen()  # a close that came with the frame fails the send: undone
                await send({"type": "websocket.send", "bytes": wire.encode(doc)})
            except OSError:  # uvicorn's ClientDisconnected: the robot never gets this step
                await service.router.undelivered(reply)
                return
            prev_total_ms = (time.monotonic() - started) * 1000
    finally:
        if own in tokens:  # the connection's own episode ends with it
            await service.router.end_here(own, tokens[own])


async def connect(
    service: NodeService, scope: Scope, receive: Receive, send: Send, access: AccessLog
) -> tuple[str | None, str, PolicyContract] | None:
    """Accept a connection and send its metadata: its fixed episode (``?episode_id=``),
    model and contract; None once it was refused (401, a bad query: closed or answered)."""
    if (await receive())["type"] != "websocket.connect":
        return None
    if not service.client_allowed(header(scope, b"authorization")):
        service.metrics.rejected.labels("unauthorized").inc()
        await unauthorized(scope, send, access, time.monotonic())
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    unknown = sorted(set(query) - QUERY_KEYS)
    try:
        fixed = check_episode(query["episode_id"][0]) if "episode_id" in query else None
    except InvalidArgument:
        service.metrics.rejected.labels("bad_input").inc()
        await send({"type": "websocket.close", "code": 1008})
        return None
    try:
        name, contract = await service.model_for(query["model"][0] if "model" in query else None)
        problem = None
    except (Refused, InvalidArgument) as exc:  # no such model, or none named among several
        name, contract, problem = None, service.contract, f"bad query: {exc}"
    await send({"type": "websocket.accept"})
    meta = metadata(service, fixed, contract, name)
    await send({"type": "websocket.send", "bytes": wire.encode(meta)})
    if unknown or problem:
        # openpi's client reads the metadata on connect and an error only as a step's reply
        if (await receive())["type"] == "websocket.receive":
            service.metrics.rejected.labels("bad_input").inc()
            names = ", ".join(repr(key) for key in unknown)
            await fail(send, problem or f"bad query: unknown key {names}; the keys are "
                       "episode_id and model")  # fmt: skip
        return None
    assert name is not None
    return fixed, name, contract


async def watching(
    receive: Receive,
    work: Awaitable[T],
    early: list[asyncio.Future[MutableMapping[str, Any]]],
) -> T:
    """Await ``work`` (in this task) while watching the websocket: a close seen while it
    runs cancels it and raises :class:`ClientGone`. Work that ends within
    :data:`~node.asgi.WATCH_AFTER_S` is not watched (no task per step). A receive begun to
    watch longer work is left in ``early``, because what it brings is the connection's
    next message. That is the next observation of a robot that did not wait."""

    def watch(gone: Callable[[], None]) -> None:
        def seen(future: asyncio.Future[MutableMapping[str, Any]]) -> None:
            if future.cancelled() or future.exception() is not None:
                return
            if future.result()["type"] == "websocket.disconnect":
                gone()

        future = asyncio.ensure_future(receive())
        future.add_done_callback(seen)
        early.append(future)

    return await cancel_when_gone(work, watch)


def _observation(message: Mapping[str, Any], max_rows: int) -> dict[Any, Any]:
    """The observation map of one frame; one of rows past ``max_rows`` is refused
    (413) before the frame is decoded. Raises ``wire.WireError``, :class:`InvalidInput`,
    :class:`Refused`."""
    data = message.get("bytes")
    if data is None:
        raise InvalidInput(
            "", "observations are binary msgpack frames, got text", root="observation"
        )
    observation = wire.decode(data)  # arrays are views of the frame: nothing allocated
    if not isinstance(observation, dict):
        raise InvalidInput("", "must be a msgpack map", root="observation")
    ids = observation.get("episode_ids")
    if isinstance(ids, list | np.ndarray) and len(ids) > max_rows:
        raise Refused(413, "too_many_rows", f"{len(ids)} rows in one observation; the limit "
                      f"is {max_rows} (--max-rows)")  # fmt: skip
    return observation


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


async def _send(
    service: NodeService, send: Send, doc: dict[str, Any], served: list[Reply | Exception | None]
) -> bool:
    """Send a frame of rows' reply; False (the rows undone) when the link dropped."""
    try:
        await io_seen()
        await send({"type": "websocket.send", "bytes": wire.encode(doc)})
    except OSError:
        for r in served:
            if isinstance(r, Reply):
                await service.router.undelivered(r)
        return False
    return True


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
    observation = _observation(message, service.config.max_rows)
    return decode_observation(service, observation, fixed, own, tokens, now, model, contract)


def decode_observation(
    service: NodeService,
    observation: dict[Any, Any],
    fixed: str | None,
    own: str,
    tokens: dict[str, int],
    now: float,
    model: str | None = None,
    contract: PolicyContract | None = None,
) -> Step:
    """:func:`decode` of a decoded observation map."""
    named, steps = observation.pop("episode_id", None), observation.pop("execute_steps", None)
    ensemble, seq = observation.pop("ensemble", None), observation.pop("seq", None)
    executed, delay = observation.pop("executed", None), observation.pop("inference_delay", None)
    control_hz, pending = observation.pop("control_hz", None), observation.pop("pending", None)
    timing = _scalar(observation.pop("timing", False))
    if not isinstance(timing, bool):
        raise InvalidArgument("timing", timing, "must be true or false")
    if seq is not None and (type(seq) is not int or seq < 1):
        raise InvalidArgument("seq", seq, "must be a step number >= 1 (the last reply's seq + 1)")
    episode = fixed or (own if named is None else check_episode(named))
    _, rtc = service.options_for(  # InvalidArgument names the field
        model, steps, ensemble, _scalar(executed), _scalar(delay), _scalar(control_hz), pending
    )
    converted = inputs.from_observation(contract or service.contract, observation)
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
    """The access line of one websocket step, as ``WS <path>``.

    It holds the HTTP status the same failure gets on ``/act`` (200, 400, 422, 503...). It
    holds the episode, device and routing of a served step (the episode alone of a refused
    one)."""
    if not access.enabled:
        return
    episode = "-" if step is None or step.episode is None else step.episode
    device, routing = served or ("-", "-")
    line = {**scope, "method": "WS", STEP_KEY: (episode, device, routing)}
    access.write(line, status, time.monotonic() - started)


async def unauthorized(scope: Scope, send: Send, access: AccessLog, started: float) -> None:
    """Refuse the handshake before the upgrade: 401 with the project's JSON error body (a
    server without ASGI's denial-response extension can only close: 403), and its line."""
    if "websocket.http.response" in scope.get("extensions", {}):
        body = error_body(
            "unauthorized", "this node wants Authorization: Api-Key <key> (openpi-client's api_key)"
        )
        await send({
            "type": "websocket.http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Api-Key")],
        })  # fmt: skip
        await send({"type": "websocket.http.response.body", "body": body})
        status = 401
    else:
        await send({"type": "websocket.close", "code": 1008})
        status = 403
    log_step(access, scope, started, status, None)


async def refuse(service: NodeService, send: Send, o: Outcome) -> None:
    """openpi's error for a step's :class:`~node.errors.Outcome`, counted: a bad
    observation says so, a refused step names its code."""
    if o.reject_reason is not None:
        service.metrics.rejected.labels(o.reject_reason).inc()
    await fail(send, f"bad observation: {o.message}" if o.invalid else f"{o.code}: {o.message}")


async def fail(send: Send, text: str) -> None:
    """openpi's error: the message as a text frame, then close 1011."""
    await send({"type": "websocket.send", "text": text})
    await send({"type": "websocket.close", "code": CLOSE_ERROR, "reason": "policy error"})
