"""``POST /act``: the project's own front door, JSON for humans and ``curl``, msgpack for
binary tensors.

Request body (a map): ``episode_id``?, ``session_id``?, ``inputs`` (input name → array),
``end``?, ``token``? and ``claim``? (the token and claim id of the client's previous
reply: a lost assignment then says ``state_reset``), ``seq``? (the step
number it expects to be applied: its last reply's ``seq`` + 1), ``execute_steps``? and
``ensemble``? (action-chunk execution overrides), ``executed``?, ``inference_delay``? and
``pending``? (real-time chunking, ``node/rtc.py``; ``pending``: the robot's unexecuted
actions, a prefix for a step that starts from clean state), ``control_hz``? (the robot's
control rate: the step's period, ``node/timing.py``, and real-time chunking's). JSON
arrays are nested lists; with
``Content-Type: application/msgpack`` every input is an array in openpi's msgpack
encoding (``affinity/wire.py``). Any other top-level field is refused with 422 naming it (a
typo such as ``episodeId`` must not silently make every step stateless).

Reply: ``{"outputs": {name: array}, "episode_id", "device", "node", "token", "claim",
"routing", "state_reset", "degraded", "source", "seq", "replayed"}``. A real-time-chunking
model adds ``rtc``: ``{"executed", "delay", "prefix_len"}``. ``timing``, the split of the
step's time, is added when the request says ``X-Affinity-Timing: 1``. The reply is JSON, or
msgpack when ``Accept`` asks for ``application/msgpack``. The same facts are in
``X-Affinity-*`` headers. ``X-Affinity-URL`` is the owner's address, where the episode's
next steps can go directly.
A client that closes its connection before the reply is sent gets its step undone.

Many episodes in one message (issue 44): ``{"steps": [body, ...]}``, each row a one-row
body, at most ``--max-rows`` (413 ``too_many_rows``, counted before any row is decoded);
an episode in two rows is 400 ``duplicate_episode``. The reply is ``{"steps": [...]}`` in
order, each row a one-row reply's body or ``{"error": {"status", "code", "message",
"field"?, "retry_after"?}}`` (routing: ``node.router.Router.act_rows``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any, cast

import numpy as np
import orjson

from affinity import InvalidArgument, UnknownField, check_episode, wire
from node import inputs
from node.accesslog import STEP_KEY
from node.asgi import (
    CONNECTION,
    Receive,
    Scope,
    Send,
    error_body,
    header,
    header_values,
    read_body,
    respond,
    respond_error,
    respond_gone,
    while_connected,
)
from node.contract import Array
from node.errors import (
    BodyError,
    ClientGone,
    InvalidInput,
    Refused,
    Unavailable,
    outcome,
)
from node.inputs import Checked, trusted
from node.protocols.body import MSGPACK, count_rows, is_msgpack, parse, plain
from node.rtc import control_rate
from node.service import NodeService
from node.step import Reply, Step
from node.timing import TIMING_HEADER, asks_timing

__all__ = [
    "MSGPACK", "count_rows", "decode", "decode_doc", "decode_rows",
    "encode", "encode_row", "handle", "joined_rows", "split_rows",
]  # fmt: skip

log = logging.getLogger("affinity.node")

FIELDS = (
    "episode_id", "session_id", "inputs", "end", "token", "claim", "seq", "execute_steps",
    "ensemble", "model", "executed", "inference_delay", "control_hz", "pending",
)  # fmt: skip
_KNOWN = frozenset(FIELDS)
_HEADERS = (b"content-type", b"accept", b"authorization", TIMING_HEADER)  # read by handle()


def decode(
    service: NodeService, body: bytes, binary: bool, deadline: float
) -> Awaitable[Step | list[Step | Exception]]:
    """The step in one ``/act`` body, to await; or, for a message of rows (``steps``), each
    row's step or the exception that is that row's error (:func:`decode_rows`). The body
    is parsed by the call; the rest by the await (one coroutine, not two nested, a step).

    Raises :class:`BodyError` (400, not a map) and :class:`InvalidInput` /
    ``InvalidArgument`` (422). Raises :class:`Refused` for ``model`` missing in a fleet of
    several models (422), or a model no node serves (404); for a message of rows past
    ``--max-rows`` (413) or naming an episode twice (400). Nothing has changed anywhere
    then."""
    doc = parse(body, binary, service.config.max_rows)
    if "steps" in doc:
        return decode_rows(service, doc, binary, deadline)
    return decode_doc(service, doc, binary, deadline)


def _lists(raw: object) -> object:
    """``raw`` inputs with each array as the JSON lists it was made of."""
    if not isinstance(raw, dict):
        return raw
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in raw.items()}


async def decode_rows(
    service: NodeService,
    doc: dict[Any, Any],
    binary: bool,
    deadline: float,
    *,
    listed: bool = False,
    checks: Sequence[Checked | None] = (),
) -> list[Step | Exception]:
    """The rows of ``{"steps": [...]}``: each row a one-row body, decoded as one; a row
    that does not decode is that row's error. Refuses (400) a message naming an episode
    in two rows (which would apply in no defined order), before any row is decoded.
    ``listed``, and ``checks`` (row by row): as :func:`decode_doc`; a :class:`StaleCheck`
    of any row is the whole message's, nothing counted."""
    if len(doc) != 1:
        other = next(str(k) for k in doc if k != "steps")
        raise UnknownField(other[:64], ("steps",))
    rows = doc["steps"]
    if not isinstance(rows, list):
        raise BodyError(400, "malformed", "steps must be a list of steps (maps)")
    seen: set[object] = set()
    for row in rows:
        if isinstance(row, dict):
            episode = row.get("episode_id", row.get("session_id"))
            if episode is not None and isinstance(episode, str | int):
                if episode in seen:
                    raise Refused(400, "duplicate_episode",
                                  f"episode {str(episode)[:64]!r} is in two rows of one message;"
                                  " send its steps in separate messages")  # fmt: skip
                seen.add(episode)
    steps: list[Step | Exception] = []
    degraded: list[bool] = []
    for at, row in enumerate(rows):
        try:
            if not isinstance(row, dict):
                raise BodyError(400, "malformed", "a row must be a map (a JSON object)")
            checked = checks[at] if at < len(checks) else None
            steps.append(await decode_doc(service, row, binary, deadline, listed=listed,
                                          checked=checked, degraded=degraded))  # fmt: skip
        except (BodyError, InvalidInput, InvalidArgument, Refused, Unavailable) as exc:
            steps.append(exc)
    for _ in degraded:  # (once every row decoded: a StaleCheck of a later one counts none)
        _degraded(service)
    return steps


def _degraded(service: NodeService) -> None:
    service.metrics.degraded.inc()
    service.warn_once("degraded", "steps without episode_id are routed by session_id (degraded)")


async def decode_doc(
    service: NodeService,
    doc: dict[Any, Any],
    binary: bool,
    deadline: float,
    *,
    listed: bool = False,
    checked: Checked | None = None,
    degraded: list[bool] | None = None,
) -> Step:
    """One body's step. ``listed``: its inputs' tensors are JSON lists a front door made
    arrays of (``node/front.py``); inputs the model refuses are then said as for the lists,
    as a node of one process says them. ``checked``: a front's word on the inputs
    (``node.inputs.Checked``): trusted, they are taken as they are; checked against another
    contract, :class:`StaleCheck`. A step routed by ``session_id`` is counted here, or
    noted in ``degraded`` for the caller to count."""
    for key in doc:
        if key not in _KNOWN:
            raise UnknownField(str(key)[:64], FIELDS)
    model = doc.get("model")  # "name" or "name@version"
    if model is not None and not isinstance(model, str):
        raise InvalidArgument("model", model, "must be a model name, or name@version")
    name, _, version = (None, "", None) if model is None else model.partition("@")
    name, contract = await service.model_for(name, version or None)
    raw = doc.get("inputs")
    feed: dict[str, Array]
    if checked is not None and trusted(checked, model, contract, raw):
        feed = cast(dict[str, Array], raw)  # checked and converted by the front, as here
    else:
        try:
            feed = inputs.from_arrays(contract, raw) if binary else inputs.from_json(contract, raw)
        except InvalidInput:
            if not listed:
                raise
            # (the error's path alone) said as for the JSON lists they came as
            feed = inputs.from_json(contract, _lists(raw))
    end, token = doc.get("end", False), doc.get("token")
    steps, ensemble = doc.get("execute_steps"), doc.get("ensemble")
    if not isinstance(end, bool):
        raise InvalidArgument("end", end, "must be true or false")
    if token is not None and (type(token) is not int or not 0 <= token < 2**63):
        raise InvalidArgument("token", token, "must be the token of an earlier reply")
    claim = doc.get("claim")
    if claim is not None and not (isinstance(claim, str) and 0 < len(claim) <= 64):
        raise InvalidArgument("claim", claim, "must be the claim of an earlier reply")
    seq = doc.get("seq")
    if seq is not None and (type(seq) is not int or not 1 <= seq < 2**63):
        raise InvalidArgument("seq", seq, "must be a step number >= 1 (the last reply's seq + 1)")
    _, rtc = service.options_for(  # InvalidArgument names the field
        name,
        steps,
        ensemble,
        doc.get("executed"),
        doc.get("inference_delay"),
        doc.get("control_hz"),
        doc.get("pending"),
    )
    episode, by_session = doc.get("episode_id"), False
    if episode is None and doc.get("session_id") is not None:
        episode, by_session = doc["session_id"], True
        if degraded is None:
            _degraded(service)
        else:
            degraded.append(True)
    return Step(
        episode=None if episode is None else check_episode(episode),
        inputs=feed,
        deadline=deadline,
        end=end,
        client_token=token,
        client_claim=claim,
        degraded=by_session,
        execute_steps=steps,
        ensemble=ensemble,
        seq=seq,
        model=name,
        version=version or None,
        rtc=rtc,
        control_hz=control_rate(doc.get("control_hz")),
    )


def encode(
    reply: Reply, binary: bool, timing: bool = False
) -> tuple[bytes, bytes, list[tuple[bytes, bytes]]]:
    """(body, content type, headers) of a reply; ``timing``: with the split of the step's
    time (``Reply.split``), which the client asked for."""
    doc = {"outputs": reply.outputs, **reply.facts()}
    if timing:
        doc["timing"] = reply.split()
    if binary:
        body, kind = wire.encode(doc), MSGPACK.encode()
    else:
        body = orjson.dumps(doc, default=plain, option=orjson.OPT_SERIALIZE_NUMPY)
        kind = b"application/json"
    headers = [
        (b"x-affinity-device", reply.device.encode()),
        (b"x-affinity-node", reply.node.encode()),
        (b"x-affinity-token", str(reply.token).encode()),
        (b"x-affinity-routing", reply.routing.encode()),
        (b"x-affinity-state-reset", b"true" if reply.state_reset else b"false"),
        (b"x-affinity-degraded", b"true" if reply.degraded else b"false"),
        (b"x-affinity-source", reply.source.encode()),
        (b"x-affinity-seq", str(reply.seq).encode()),
    ]
    if reply.url:
        headers.append((b"x-affinity-url", reply.url.encode()))
    return body, kind, headers


async def handle(service: NodeService, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI handler of ``POST /act``."""
    received = time.monotonic()
    deadline = received + service.config.act_deadline_s
    metrics = service.metrics
    content_type, accept, authorization, timing = header_values(scope, _HEADERS)
    binary_in = is_msgpack(content_type)
    binary_out = MSGPACK in (accept or "")
    if not service.client_allowed(authorization):
        metrics.rejected.labels("unauthorized").inc()
        body = error_body("unauthorized", "this node wants Authorization: Api-Key <key>")
        await respond(send, 401, body, headers=[(b"www-authenticate", b"Api-Key")])
        return
    try:
        body = await read_body(scope, receive, service.config.max_body_bytes)
        step = await decode(service, body, binary_in, deadline)
        if isinstance(step, list):
            await _handle_rows(service, step, scope, receive, send, received, binary_out)
            return
        step.received, step.timing = received, asks_timing(timing)
        scope[STEP_KEY] = (step.episode or "-", "-", "-")
        reply = await while_connected(receive, service.router.act(step), scope.get(CONNECTION))
        scope[STEP_KEY] = (step.episode or "-", reply.device, reply.routing)
    except ClientGone as exc:  # nobody will read the reply: the step did not happen
        if isinstance(exc.result, Reply):
            await service.router.undelivered(exc.result)
        await respond_gone(send)
    except (BodyError, InvalidInput, InvalidArgument, Unavailable, Refused) as exc:
        await respond_error(send, exc, metrics.rejected)
    else:
        body, kind, headers = encode(reply, binary_out, step.timing)
        await respond(send, 200, body, kind, headers)


def encode_row(result: Reply | Exception, timing: bool = False) -> dict[str, Any]:
    """One row of a reply of rows: what a one-row reply's body says, or ``{"error":
    {"status", "code", "message", "field"?, "retry_after"?}}``."""
    if isinstance(result, Reply):
        row = {"outputs": result.outputs, **result.facts()}
        if timing:
            row["timing"] = result.split()
        return row
    o = outcome(result)
    err: dict[str, Any] = {"status": o.status, "code": o.code, "message": o.message}
    if o.field is not None:
        err["field"] = o.field
    if o.retry_after is not None:
        err["retry_after"] = max(1, round(o.retry_after))
    return {"error": err}


def split_rows(
    service: NodeService, rows: list[Step | Exception], received: float, timing: bool
) -> tuple[list[Step], list[int], list[Reply | Exception | None]]:
    """A message's rows as its door decoded them: the steps to serve (each stamped with
    the request's arrival and its ask for the timing split), where each sits in the
    message, and the results so far (the rows refused already, each counted)."""
    steps: list[Step] = []
    at: list[int] = []
    results: list[Reply | Exception | None] = [None] * len(rows)
    for i, row in enumerate(rows):
        if isinstance(row, Step):
            row.received, row.timing = received, timing
            steps.append(row)
            at.append(i)
        else:
            results[i] = row
            reason = outcome(row).reject_reason
            if reason is not None:
                service.metrics.rejected.labels(reason).inc()
    return steps, at, results


def joined_rows(
    results: list[Reply | Exception | None], at: list[int], served: list[Reply | Exception | None]
) -> list[Reply | Exception]:
    """Every row's result in the message's order: the refused ones and the ``served``
    steps put back ``at`` their places (a step left unanswered: 503 ``deadline``)."""
    for i, result in zip(at, served, strict=True):
        results[i] = result if result is not None else Unavailable("deadline", "not served")
    return [r for r in results if r is not None]


async def _handle_rows(
    service: NodeService,
    rows: list[Step | Exception],
    scope: Scope,
    receive: Receive,
    send: Send,
    received: float,
    binary: bool,
) -> None:
    """Serve a message of rows (:meth:`node.router.Router.act_rows`) and answer
    ``{"steps": [...]}`` in order (:func:`encode_row`); 200 whatever each row's outcome."""
    timing = asks_timing(header(scope, TIMING_HEADER))
    steps, at, results = split_rows(service, rows, received, timing)
    served: list[Reply | Exception | None] = [None] * len(steps)
    scope[STEP_KEY] = (f"{len(rows)} rows", "-", "-")
    try:
        await while_connected(
            receive, service.router.act_rows(steps, served), scope.get(CONNECTION)
        )
    except ClientGone:  # nobody will read the replies: the rows' steps did not happen
        for result in served:
            if isinstance(result, Reply):
                await service.router.undelivered(result)
        await respond_gone(send)
        return
    doc = {"steps": [encode_row(r, timing) for r in joined_rows(results, at, served)]}
    if binary:
        body, kind = wire.encode(doc), MSGPACK.encode()
    else:
        body = orjson.dumps(doc, default=plain, option=orjson.OPT_SERIALIZE_NUMPY)
        kind = b"application/json"
    await respond(send, 200, body, kind)
