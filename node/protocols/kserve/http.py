"""KServe v2 over HTTP/REST, as the unmodified ``tritonclient.http`` (sync and ``aio``)
speaks it: the infer body, the reply, and the handler of every path under ``/v2``.

**Infer.** The body is the JSON request, or the binary tensor extension (``tensors.py``).
``tritonclient`` sends the extension by default: ``Inference-Header-Content-Length`` bytes
of JSON followed by each binary input's raw bytes, in input order. Its decode and the
reply's encoding are ``body.py``'s, which a front door process (``--front-doors``) runs
too; the request is served by :func:`serve_infer` either way (from a front: over the hop,
:func:`serve_hop`).

The reply holds every returned output (or those ``outputs`` names), as JSON ``data``. With
``parameters.binary_data_output`` or an output's ``binary_data`` it is binary data after
the JSON header instead. Affinity's facts are in ``parameters``. They include the split of
the step's time (``timing_total_ms``, ``timing_queue_ms``, ``timing_run_ms``,
``timing_forward_ms``). That split comes when the request has the header
``X-Affinity-Timing: 1`` or the parameter ``timing: true``.

**Errors** are KServe's: a non-200 status with ``{"error": "<message>"}``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from node import VERSION
from node.accesslog import STEP_KEY
from node.asgi import (
    CONNECTION,
    Receive,
    Scope,
    Send,
    read_body,
    respond,
    respond_gone,
    while_connected,
)
from node.contract import PolicyContract
from node.errors import ClientGone, HopError, NotServed, StaleCheck, outcome
from node.inputs import checked_of, taught, trusted
from node.metrics import REJECTED
from node.protocols.kserve.body import (
    HEADER_LENGTH,
    JSON,
    MODEL_PATH,
    InferRequest,
    check_name,
    decode_infer,
    encode_reply,
    reply_meta,
    request_of,
)
from node.protocols.kserve.request import (
    EXTENSIONS,
    REFUSED,
    config_of,
    find_model,
    kserve_outcome,
    metadata_of,
    serve_rows,
    service_step,
    stack_rows,
    statistics_of,
    stats_for,
    timing_parameters,
)
from node.protocols.kserve.tensors import Array
from node.service import NodeService
from node.step import Reply
from node.timing import TIMING_HEADER, asks_timing

__all__ = [
    "ROUTES",
    "Route",
    "decode_infer",
    "encode_infer",
    "handle",
    "reply_parts",
    "serve_hop",
    "serve_infer",
]

_JSON = JSON
_HEADER_LENGTH = HEADER_LENGTH
T = TypeVar("T")


def reply_parts(
    reply: Reply, request: InferRequest, rows: str | None = None
) -> tuple[dict[str, Array], dict[str, bool], str, dict[str, Any]]:
    """What :func:`~node.protocols.kserve.body.encode_reply` takes of a step's reply
    (outputs, the wanted ones and whether each goes binary, the version that served it,
    the reply's parameters). ``rows``: the reply of a request of rows (``reply`` holds the
    stacked outputs), whose parameters are ``rows`` alone
    (:func:`~node.protocols.kserve.request.stack_rows`)."""
    wanted = request.outputs
    if wanted is None:
        wanted = dict.fromkeys(reply.outputs, request.binary_output)
    version = reply.model.partition("@")[2]  # the version that served it
    if rows is not None:
        parameters: dict[str, Any] = {"rows": rows}
    else:
        parameters = {k: v for k, v in reply.facts(flat=True).items() if v is not None}
    if request.timing and rows is None:
        parameters.update(timing_parameters(reply))
    return reply.outputs, wanted, version, parameters


def encode_infer(
    reply: Reply, request: InferRequest, model_name: str, rows: str | None = None
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """(body, headers) of a step's reply (:func:`reply_parts`,
    :func:`~node.protocols.kserve.body.encode_reply`), with ``X-Affinity-Node`` and
    ``X-Affinity-URL``."""
    outputs, wanted, version, parameters = reply_parts(reply, request, rows)
    body, headers = encode_reply(outputs, wanted, model_name, version, request.id, parameters)
    headers.append((b"x-affinity-node", reply.node.encode()))
    if reply.url:
        headers.append((b"x-affinity-url", reply.url.encode()))
    return body, headers


# ---- the route table ---------------------------------------------------------------------


async def _error(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await respond(send, status, orjson.dumps({"error": message}), _JSON, headers or [])


async def _json(send: Send, status: int, doc: dict[str, Any]) -> None:
    await respond(send, status, orjson.dumps(doc), _JSON)


def _not_ready(service: NodeService) -> str | None:
    if not service.lease.valid():
        return f"node {service.node_id} is not registered with a current lease"
    if service.lease.leaving:
        return f"node {service.node_id} is shutting down"
    return None


Params = dict[str, str | None]
Endpoint = Callable[[NodeService, Scope, Receive, Send, Params], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: ``method`` and a path ``pattern`` (matched whole) -> ``endpoint``, which
    gets the pattern's named groups."""

    method: str
    pattern: re.Pattern[str]
    endpoint: Endpoint


async def _server_metadata(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    await _json(send, 200, {"name": "affinity", "version": VERSION,
                            "extensions": list(EXTENSIONS)})  # fmt: skip


async def _live(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    await _json(send, 200, {"live": True})


async def _ready(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    if (why := _not_ready(service)) is not None:
        await _json(send, 400, {"ready": False, "error": why})
    else:
        await _json(send, 200, {"ready": True})


async def _index(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    """The models of the fleet (any node routes any of them)."""
    await service.catalog.refresh(force=True)
    listed = [{"name": n, "versions": service.catalog.versions(n)}
              for n in service.catalog.served()]  # fmt: skip
    await _json(send, 200, {"models": listed})


async def _every_statistics(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    """Every model's statistics: those served here."""
    stats = [statistics_of(service, served) for served in service.models]
    await _json(send, 200, {"model_stats": stats})


async def _model(
    service: NodeService, send: Send, params: Params
) -> tuple[str, PolicyContract] | None:
    """The model ``params`` name and its contract; None once a 404 was sent for a model or
    version no live node serves."""
    try:
        return await find_model(service, params["name"] or "", params["version"])
    except NotServed as exc:
        o = outcome(exc)
        await _error(send, o.status, o.message)
        return None


async def _metadata(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    if (model := await _model(service, send, params)) is None:
        return
    await _json(send, 200, metadata_of(service, *model))


async def _config(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    if (model := await _model(service, send, params)) is not None:
        await _json(send, 200, config_of(service, *model))


async def _model_ready(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    if (model := await _model(service, send, params)) is None:
        return
    if (why := _not_ready(service)) is not None:
        await _json(send, 400, {"name": model[0], "ready": False, "error": why})
    else:
        await _json(send, 200, {"name": model[0], "ready": True})


async def _model_statistics(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    if (model := await _model(service, send, params)) is not None:
        await _json(send, 200, {"model_stats": [statistics_of(service, model[0])]})


async def _model_infer(
    service: NodeService, scope: Scope, receive: Receive, send: Send, params: Params
) -> None:
    if (model := await _model(service, send, params)) is not None:
        await _infer(service, model, scope, receive, send, params["version"])


_MODEL = MODEL_PATH
ROUTES = tuple(
    Route(method, re.compile(pattern), endpoint)
    for method, pattern, endpoint in (
        ("POST", _MODEL + "/infer", _model_infer),  # first: the hot one
        ("GET", "/v2", _server_metadata),
        ("GET", "/v2/health/live", _live),
        ("GET", "/v2/health/ready", _ready),
        ("GET", "/v2/models", _index),
        ("GET", "/v2/models/stats", _every_statistics),
        ("GET", _MODEL, _metadata),
        ("GET", _MODEL + "/ready", _model_ready),
        ("GET", _MODEL + "/stats", _model_statistics),
        ("GET", _MODEL + "/config", _config),
    )
)
"""Every KServe v2 endpoint; a path no route matches is 404, one matched for another
method 405 (with ``Allow``). A path matching two routes of one method takes the first."""


async def handle(service: NodeService, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI handler of every path under ``/v2``.

    It runs the first route of :data:`ROUTES` whose pattern and method match. Else 405 when
    the path matched for other methods, else 404."""
    path = scope["path"].rstrip("/")
    method = scope["method"]
    allowed: list[str] = []
    for route in ROUTES:
        match = route.pattern.fullmatch(path)
        if match is None:
            continue
        if route.method == method:
            await route.endpoint(service, scope, receive, send, match.groupdict())
            return
        allowed.append(route.method)
    if allowed:
        allow = ", ".join(sorted(set(allowed)))
        await _error(send, 405, f"use {allow} {scope['path'][:200]}", [(b"allow", allow.encode())])
    else:
        await _error(send, 404, f"{method} {scope['path'][:200]}: not a KServe v2 endpoint")


async def _infer(
    service: NodeService,
    model: tuple[str, PolicyContract],
    scope: Scope,
    receive: Receive,
    send: Send,
    version: str | None = None,
) -> None:
    started = time.monotonic()
    model_name = model[0]
    rejected = service.metrics.rejected
    authorization = header_length = encoding = timing = None
    for key, value in scope["headers"]:  # one pass for the four this door reads (first wins)
        if key == b"authorization" and authorization is None:
            authorization = value.decode("latin-1")
        elif key == _HEADER_LENGTH and header_length is None:
            header_length = value.decode("latin-1")
        elif key == b"content-encoding" and encoding is None:
            encoding = value.decode("latin-1")
        elif key == TIMING_HEADER and timing is None:
            timing = value.decode("latin-1")
    if not service.client_allowed(authorization):
        rejected.labels("unauthorized").inc()
        await _error(send, 401, "this node wants Authorization: Api-Key <key>",
                     [(b"www-authenticate", b"Api-Key")])  # fmt: skip
        return
    budget = service.config.act_deadline_s
    request: InferRequest | None = None
    connection = scope.get(CONNECTION)

    def watch(work: Awaitable[T]) -> Awaitable[T]:
        return while_connected(receive, work, connection)

    try:
        body = await read_body(scope, receive, service.config.max_body_bytes)
        request = decode_infer(
            body,
            header_length,
            content_encoding=encoding,
            max_bytes=service.config.max_body_bytes,
            max_rows=service.config.max_rows,
        )
        if request.timeout_s is not None:
            budget = min(budget, request.timeout_s)
        request.timing = request.timing or asks_timing(timing)
        scope[STEP_KEY] = _step_key(request, None)
        reply, rows, _ = await serve_infer(service, model, request, started, version, budget,
                                           watch)  # fmt: skip
    except ClientGone:  # nobody will read the reply: serve_infer undid the step
        await respond_gone(send)
    except REFUSED as exc:
        own = budget if budget < service.config.act_deadline_s else None
        o = kserve_outcome(service, model_name, exc, request, own)
        retry = [] if o.retry_after is None else [(b"retry-after", o.retry_header.encode())]
        await _error(send, o.status, o.message, retry)
    else:
        scope[STEP_KEY] = _step_key(request, reply)
        payload, headers = encode_infer(reply, request, model_name, rows)
        await respond(send, 200, payload, headers[0][1], headers[1:])


def _step_key(request: InferRequest, reply: Reply | None) -> tuple[str, str, str]:
    """The access line's episode, device and routing of an infer request (its reply's,
    once served)."""
    if request.rows is not None:
        return (f"{len(request.rows)} rows", "-", "-")
    if reply is None:
        return (request.episode or "-", "-", "-")
    return (request.episode or "-", reply.device, reply.routing)


def _unwatched(work: Awaitable[T]) -> Awaitable[T]:
    return work


async def serve_infer(
    service: NodeService,
    model: tuple[str, PolicyContract],
    request: InferRequest,
    started: float,
    version: str | None,
    budget: float,
    watch: Callable[[Awaitable[Any]], Awaitable[Any]] = _unwatched,
    door: str = "kserve_http",
    checked: bool = False,
) -> tuple[Reply, str | None, Reply | list[Reply]]:
    """Serve a decoded infer request for ``model`` (``version`` as its path named it),
    received at ``started`` with ``budget`` seconds to answer: one step, or a request of
    rows (``episode_ids``: each row a step; the reply's outputs stacked along the rows'
    axis, each row's facts or error in the ``rows`` parameter). Returns the reply, the
    ``rows`` parameter (None for one step) and what to undo if the reply is not delivered.
    ``watch`` awaits the work while the client stays (``while_connected``); when it raises
    :class:`ClientGone` the steps already served are undone first. Raises what
    :data:`~node.protocols.kserve.request.REFUSED` holds for the request as a whole.
    ``door``: the step's door label (``kserve_grpc`` for gRPC decoded in a front).
    ``checked``: a front checked and converted the inputs against ``model``'s contract
    (``node/checks.py``): they are taken as they are.

    Both ways of taking the request in serve it here: the node's own HTTP door
    (:func:`_infer`) and a front door process, over the hop (:func:`serve_hop`)."""
    model_name, contract = model
    deadline = started + budget
    if request.rows is not None:
        served: list[Reply | Exception | None] = []
        work = serve_rows(service, request, deadline, model_name, version, model, door,
                          served, checked)  # fmt: skip
        try:
            results = await watch(work)
        except ClientGone:  # nobody will read the replies: the rows' steps did not happen
            for r in served:
                if isinstance(r, Reply):
                    await service.router.undelivered(r)
            raise
        outputs, rows, first = stack_rows(contract, results, model_name)
        stats_for(service, model_name).answered(time.monotonic() - started)
        if request.outputs is not None and first is None:
            request.outputs = None  # no row served: no output to send
        reply = Reply(outputs, None, "", service.node_id, 0, "rows", False, False,
                      model=first.model if first else "")  # fmt: skip
        return reply, rows, [r for r in results if isinstance(r, Reply)]
    step = await service_step(service, request, deadline, model_name, version, model, checked)
    step.door, step.received = door, started
    try:
        reply = await watch(service.router.act(step))
    except ClientGone as exc:  # nobody will read the reply: the step did not happen
        if isinstance(exc.result, Reply):
            await service.router.undelivered(exc.result)
        raise
    stats_for(service, model_name).answered(time.monotonic() - started)
    return reply, None, reply


async def serve_hop(
    service: NodeService, meta: dict[str, Any], arrays: list[Array]
) -> tuple[dict[str, Any], list[Array]]:
    """Serve an infer request a front door process decoded and sent over the hop
    (``node/front.py``; :func:`~node.protocols.kserve.body.request_meta`), or the refusal
    it found (``refused``: status, message, rejection reason, headers). The model is
    looked up first, as :func:`_model_infer` does (a model no node serves is 404 before
    anything of the body counts). The reply's meta is the encoded reply's parts
    (:func:`~node.protocols.kserve.body.reply_meta`) with the node, URL and the access
    line's facts, or ``kerr``: [status, message, headers]; ``keep`` is what to undo if
    the front could not deliver it. Raises :class:`HopError` for a meta no front wrote.

    A gRPC request (``grpc``: the seconds left of the client's deadline, or None) is
    served as ``grpc.py``'s servicer serves one: that deadline joins the budget, its steps
    are the door ``kserve_grpc``'s, a ``deadline`` refusal names no timeout, and the reply
    carries the model's name as found (``name``)."""
    name, version = meta.get("model"), meta.get("version")
    started = meta.get("recv")
    if not isinstance(name, str) or not isinstance(started, float):
        raise HopError("an infer request without its model or receive time")
    if version is not None and not isinstance(version, str):
        raise HopError("an infer request whose version is not a string")
    try:
        model = await find_model(service, name, version)
    except NotServed as exc:
        o = outcome(exc)
        return {"kerr": [o.status, o.message, []]}, []
    refused = meta.get("refused")
    if refused is not None:
        try:
            status, message, reason, headers = refused
        except (TypeError, ValueError):
            raise HopError("a bad refusal") from None
        if reason in REJECTED:
            service.metrics.rejected.labels(reason).inc()
        return {"kerr": [status, message, headers]}, []
    try:
        request, _, _ = request_of(meta, arrays)
    except ValueError as exc:
        raise HopError(str(exc)) from None
    checked = checked_of(meta)
    try:  # inputs the front checked against this contract's check are taken as they are
        taken = trusted(checked, check_name(name, version), model[1], request.arrays)
    except StaleCheck:  # against another: sent again unchecked, before anything counted
        return taught({"recheck": True}, [checked]), []
    budget = service.config.act_deadline_s
    if request.timeout_s is not None:
        budget = min(budget, request.timeout_s)
    grpc = "grpc" in meta
    client_s = meta.get("grpc")
    if isinstance(client_s, float):
        budget = min(budget, client_s)
    door = "kserve_grpc" if grpc else "kserve_http"
    try:
        reply, rows, keep = await serve_infer(service, model, request, started, version, budget,
                                              door=door, checked=taken)  # fmt: skip
    except REFUSED as exc:
        own = budget if budget < service.config.act_deadline_s and not grpc else None
        o = kserve_outcome(service, model[0], exc, request, own)
        retry = [] if o.retry_after is None else [[b"retry-after", o.retry_header.encode()]]
        return taught({"kerr": [o.status, o.message, retry]}, [checked]), []
    done, out = reply_meta(*reply_parts(reply, request, rows))
    done["node"], done["url"] = reply.node, reply.url
    done["log"] = _step_key(request, reply)
    done["name"] = model[0]
    done["keep"] = keep
    return taught(done, [checked]), out
