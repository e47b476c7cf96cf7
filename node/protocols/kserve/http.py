"""KServe v2 over HTTP/REST, as the unmodified ``tritonclient.http`` (sync and ``aio``)
speaks it: the infer body, the reply, and the handler of every path under ``/v2``.

**Infer.** The body is the JSON request, or the binary tensor extension (``tensors.py``).
``tritonclient`` sends the extension by default: ``Inference-Header-Content-Length`` bytes
of JSON followed by each binary input's raw bytes, in input order.

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
from typing import Any

import numpy as np
import orjson

from affinity.wire import MAX_ELEMENTS
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
from node.errors import (
    BadRequest,
    ClientGone,
    NotServed,
    outcome,
)
from node.protocols.kserve.request import (
    EXTENSIONS,
    REFUSED,
    ROW_PARAMETERS,
    InferRequest,
    check_custom,
    config_of,
    episode_of,
    find_model,
    kserve_outcome,
    metadata_of,
    rows_of,
    serve_rows,
    service_step,
    stack_rows,
    statistics_of,
    stats_for,
    step_parameters,
    timing_parameters,
)
from node.protocols.kserve.tensors import (
    DATATYPE_OF,
    MAX_TENSORS,
    STRINGS,
    as_object,
    body_inputs,
    inflate,
    kind_of,
    tensor_bytes,
)
from node.service import NodeService
from node.step import Reply
from node.timing import TIMING_HEADER, asks_timing

__all__ = ["ROUTES", "Route", "decode_infer", "encode_infer", "handle"]

_JSON = b"application/json"
_HEADER_LENGTH = b"inference-header-content-length"


def decode_infer(
    body: bytes,
    header_length: str | None,
    *,
    content_encoding: str | None = None,
    max_bytes: int = 1 << 24,
    max_elements: int = MAX_ELEMENTS,
    max_rows: int = 256,
) -> InferRequest:
    """Decode one infer body (see the module doc). ``header_length`` is the
    ``Inference-Header-Content-Length`` header, if any; ``max_bytes`` bounds an inflated
    body. Raises :class:`BadRequest` (400) or ``BodyError`` (413, an inflated body past
    ``max_bytes``); allocates nothing from a declared size before checking it."""
    if content_encoding is not None:
        body = inflate(body, content_encoding.strip().lower(), max_bytes)
    if header_length is None:
        json_end = len(body)
    else:
        text = header_length.strip()
        if not text.isdigit() or len(text) > 20 or int(text) > len(body):
            raise BadRequest(
                f"Inference-Header-Content-Length {header_length[:24]!r} must be the length of "
                f"the JSON header within the {len(body)}-byte body",
                "malformed",
            )
        json_end = int(text)
    try:
        doc = orjson.loads(memoryview(body)[:json_end])
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request JSON is not valid: {exc}"[:300], "malformed") from None
    if not isinstance(doc, dict):
        raise BadRequest("the request must be a JSON object", "malformed")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(f"id must be a string, not {kind_of(request_id)}")
    params = as_object(doc.get("parameters"), "parameters")
    check_custom(params)
    rows = rows_of(params, max_rows)  # before any input is decoded
    if rows is not None:  # the per-row ones are in rows
        params = {k: v for k, v in params.items() if k not in ROW_PARAMETERS}
    sequence = params.get("sequence_id")
    episode = episode_of(sequence)
    start = _flag(params, "sequence_start")
    end = _flag(params, "sequence_end")
    if episode is None and (start or end):
        raise BadRequest("sequence_start and sequence_end need a non-zero sequence_id")
    timeout = params.get("timeout")
    if timeout is not None and (type(timeout) is not int or timeout < 0):
        raise BadRequest(f"timeout {timeout!r:.40} must be a whole number of microseconds")
    steps, ensemble = params.get("execute_steps"), params.get("ensemble")
    if steps is not None and type(steps) is not int:
        raise BadRequest(f"execute_steps must be an integer, not {kind_of(steps)}")
    if ensemble is not None and not isinstance(ensemble, str):
        raise BadRequest(f"ensemble must be a string, not {kind_of(ensemble)}")
    seq = params.get("seq")
    if seq is not None and (type(seq) is not int or seq < 1):
        raise BadRequest(f"seq {seq!r:.40} must be a step number >= 1")
    arrays = body_inputs(doc.get("inputs"), body, json_end, max_elements)
    binary_output = _flag(params, "binary_data_output")
    return InferRequest(
        id=request_id,
        sequence=None if episode is None else sequence,
        episode=episode,
        start=start,
        end=end,
        arrays=arrays,
        outputs=_requested(doc.get("outputs"), binary_output),
        binary_output=binary_output,
        timing=_flag(params, "timing"),
        rows=rows,
        **step_parameters(params),
    )


def _requested(raw: object, binary_output: bool) -> dict[str, bool] | None:
    if raw is None or raw == []:  # none named: every output
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise BadRequest(f"outputs must be a list of at most {MAX_TENSORS} objects")
    requested: dict[str, bool] = {}
    for i, tensor in enumerate(raw):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise BadRequest(f"outputs[{i}] must be an object with a name")
        name = tensor["name"]
        params = as_object(tensor.get("parameters"), f"output {name[:64]!r} parameters")
        for key in params:
            if key == "classification" or key.startswith("shared_memory"):
                raise BadRequest(f"output {name[:64]!r}: {key} is not supported")
        if name in requested:
            raise BadRequest(f"output {name[:64]!r} is requested twice")
        binary = params.get("binary_data", binary_output)
        if not isinstance(binary, bool):
            raise BadRequest(f"output {name[:64]!r}: binary_data must be true or false")
        requested[name] = binary
    return requested


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, not {kind_of(value)}")
    return value


def encode_infer(
    reply: Reply, request: InferRequest, model_name: str, rows: str | None = None
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """(body, headers) of a step's reply: JSON, or a JSON header and binary outputs with
    ``Inference-Header-Content-Length`` when any output goes back binary. ``rows``: the
    reply of a request of rows (``reply`` holds the stacked outputs), whose parameters are
    ``rows`` alone (:func:`~node.protocols.kserve.request.stack_rows`)."""
    wanted = request.outputs
    if wanted is None:
        wanted = dict.fromkeys(reply.outputs, request.binary_output)
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, binary in wanted.items():
        array = reply.outputs[name]
        entry: dict[str, Any] = {
            "name": name,
            "datatype": DATATYPE_OF[array.dtype],
            "shape": array.shape,
        }
        if binary:
            blob = tensor_bytes(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif array.dtype == STRINGS:
            entry["data"] = [str(v) for v in array.reshape(-1).tolist()]
        else:
            entry["data"] = np.ascontiguousarray(array).reshape(-1)
        outputs.append(entry)
    version = reply.model.partition("@")[2]  # the version that served it
    doc: dict[str, Any] = {"model_name": model_name, "model_version": version}
    if request.id is not None:
        doc["id"] = request.id
    if rows is not None:
        doc["parameters"] = {"rows": rows}
    else:
        doc["parameters"] = {k: v for k, v in reply.facts(flat=True).items() if v is not None}
    if request.timing and rows is None:
        doc["parameters"].update(timing_parameters(reply))
    doc["outputs"] = outputs
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    headers = [(b"x-affinity-node", reply.node.encode())]
    if reply.url:
        headers.append((b"x-affinity-url", reply.url.encode()))
    if not blobs:
        return head, [(b"content-type", _JSON), *headers]
    return b"".join([head, *blobs]), [
        (b"content-type", b"application/octet-stream"),
        (_HEADER_LENGTH, str(len(head)).encode()),
        *headers,
    ]


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


_MODEL = r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"
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
        if request.rows is not None:
            await _infer_rows(service, model, scope, receive, send, request, started + budget,
                              version)  # fmt: skip
            return
        step = await service_step(service, request, started + budget, model_name, version, model)
        step.door, step.received = "kserve_http", started
        scope[STEP_KEY] = (step.episode or "-", "-", "-")
        reply = await while_connected(receive, service.router.act(step), scope.get(CONNECTION))
        scope[STEP_KEY] = (step.episode or "-", reply.device, reply.routing)
        stats_for(service, model_name).answered(time.monotonic() - started)
    except ClientGone as exc:  # nobody will read the reply: the step did not happen
        if isinstance(exc.result, Reply):
            await service.router.undelivered(exc.result)
        await respond_gone(send)
    except REFUSED as exc:
        own = budget if budget < service.config.act_deadline_s else None
        o = kserve_outcome(service, model_name, exc, request, own)
        retry = [] if o.retry_after is None else [(b"retry-after", o.retry_header.encode())]
        await _error(send, o.status, o.message, retry)
    else:
        payload, headers = encode_infer(reply, request, model_name)
        content_type = headers[0][1]
        await respond(send, 200, payload, content_type, headers[1:])


async def _infer_rows(
    service: NodeService,
    model: tuple[str, PolicyContract],
    scope: Scope,
    receive: Receive,
    send: Send,
    request: InferRequest,
    deadline: float,
    version: str | None,
) -> None:
    """A request of rows (``episode_ids``): each row a step; the reply's outputs stacked
    along the rows' axis, each row's facts or error in the ``rows`` parameter. Raises what
    :func:`_infer` answers for the request as a whole."""
    started = time.monotonic()
    model_name, contract = model
    served: list[Reply | Exception | None] = []
    scope[STEP_KEY] = (f"{len(request.rows or ())} rows", "-", "-")
    work = serve_rows(service, request, deadline, model_name, version, model, "kserve_http",
                      served)  # fmt: skip
    try:
        results = await while_connected(receive, work, scope.get(CONNECTION))
    except ClientGone:  # nobody will read the replies: the rows' steps did not happen
        for r in served:
            if isinstance(r, Reply):
                await service.router.undelivered(r)
        await respond_gone(send)
        return
    outputs, rows, first = stack_rows(contract, results, model_name)
    stats_for(service, model_name).answered(time.monotonic() - started)
    if request.outputs is not None and first is None:
        request.outputs = None  # no row served: no output to send
    reply = Reply(outputs, None, "", service.node_id, 0, "rows", False, False,
                  model=first.model if first else "")  # fmt: skip
    payload, headers = encode_infer(reply, request, model_name, rows)
    await respond(send, 200, payload, headers[0][1], headers[1:])
