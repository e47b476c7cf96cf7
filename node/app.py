"""The node's ASGI application: the hot endpoints as plain handlers, FastAPI for the rest.

``POST /act`` (JSON or msgpack), ``POST /internal/act`` (forwards between nodes) and every
path under ``/v2`` (KServe v2, ``node/protocols/kserve/``) are dispatched straight to
their protocol modules in ``node/protocols/``, without a
framework's routing, validation or response classes on the request path. Everything else —
inspection, administration, ``/metrics``, ``/docs`` — is a FastAPI app. Every error is
JSON ``{"error": {"code", "message", "field"?}}`` (404 and 405 included; under ``/v2``
KServe's own ``{"error": "<message>"}``); 4xx for the
client's mistakes (nothing changes), 503 with ``Retry-After`` for what cannot be decided
or served now.

Two checks run before any route (:meth:`NodeApp._http`):

- a request that changes something (any method but GET, HEAD, OPTIONS, and every
  websocket: openpi's steps) sent by a browser on behalf of another site
  (``Sec-Fetch-Site`` other than ``same-origin``/``none``, or an ``Origin`` that is not
  this host) is refused 403 ``cross_site``: a page elsewhere cannot release episodes,
  drive a robot's episode or drain devices through an operator's browser;
- with ``--api-key``, every endpoint that reads or changes episodes (:data:`PROTECTED`)
  wants ``Authorization: Api-Key <key>`` or the admin's ``Bearer <token>`` (401 without).
  ``/healthz``, ``/readyz``, ``/metrics``, ``/model``, ``/ui`` (the page, not its data)
  and ``/docs`` stay open: they hold no episode id and change nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from affinity import (
    AffinityError,
    BackendUnavailable,
    InvalidArgument,
    NotReplicated,
    PoolExhausted,
    StaleToken,
    UnknownDevice,
    UnknownEpisode,
)
from node.accesslog import AccessLog
from node.asgi import Receive, Scope, Send, error_body, header, respond
from node.fleet import add_fleet_routes
from node.lease import VERSION
from node.protocols import act, internal, kserve, openpi
from node.service import NodeService
from node.step import Refused, Unavailable

__all__ = ["PROTECTED", "NodeApp", "create_app", "cross_site"]

Handler = Callable[[NodeService, Scope, Receive, Send], Awaitable[None]]
SAFE_METHODS = frozenset(("GET", "HEAD", "OPTIONS"))
PROTECTED = ("/episodes/", "/devices", "/nodes", "/events/stream")
"""Path prefixes that read or change episodes (or the fleet): they want the API key."""


def cross_site(scope: Scope) -> bool:
    """Whether a browser sent this request on behalf of another site: its
    ``Sec-Fetch-Site`` is neither ``same-origin`` nor ``none`` (typed in), or, from a
    browser that does not send that, its ``Origin`` is not this ``Host``. Clients that are
    not browsers send neither and pass."""
    fetch_site = origin = host = None
    for key, value in scope["headers"]:
        if key == b"sec-fetch-site":
            fetch_site = value
        elif key == b"origin":
            origin = value
        elif key == b"host":
            host = value
    if fetch_site is not None:
        return fetch_site not in (b"same-origin", b"none")
    if origin is None:
        return False
    netloc = origin.partition(b"://")[2]
    return not netloc or host is None or netloc.lower() != host.lower()


class NodeApp:
    """The ASGI callable uvicorn runs: hot routes first, websockets to the openpi protocol
    (any path), then the FastAPI app."""

    def __init__(
        self, api: FastAPI, hot: dict[tuple[str, str], Handler], access: AccessLog
    ) -> None:
        self.api = api
        self.hot = hot
        self.paths = {path for _, path in hot}
        self.access = access

    @property
    def state(self) -> Any:
        return self.api.state

    @property
    def service(self) -> NodeService:
        service: NodeService = self.api.state.service
        return service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.access(self._http, scope, receive, send)
        elif scope["type"] == "websocket":
            if cross_site(scope):  # a page elsewhere must not drive a robot's episode
                self.service.metrics.rejected.labels("forbidden").inc()
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 1008})  # before accept: 403
                return
            await openpi.handle(self.service, scope, receive, send, self.access)
        else:
            await self.api(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in SAFE_METHODS and cross_site(scope):
            self.service.metrics.rejected.labels("forbidden").inc()
            body = error_body("cross_site", "refused: sent by a browser from another site (Origin)")
            await respond(send, 403, body)
            return
        path = scope["path"]
        if path.startswith(PROTECTED) and not self.service.reader_allowed(
            header(scope, b"authorization")
        ):
            self.service.metrics.rejected.labels("unauthorized").inc()
            body = error_body(
                "unauthorized", "this node wants Authorization: Api-Key <key> (or the admin's)"
            )
            await respond(send, 401, body, headers=[(b"www-authenticate", b"Api-Key")])
            return
        handler = self.hot.get((scope["method"], scope["path"]))
        if handler is not None:
            await handler(self.service, scope, receive, send)
        elif scope["path"] in self.paths:
            body = error_body("method_not_allowed", f"use POST {scope['path']}")
            await respond(send, 405, body, headers=[(b"allow", b"POST")])
        elif scope["path"] == "/v2" or scope["path"].startswith("/v2/"):
            await kserve.handle(self.service, scope, receive, send)  # KServe v2, its own errors
        else:
            await self.api(scope, receive, send)


def error(
    status: int, code: str, message: str, field: str | None = None, retry_after: float | None = None
) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return JSONResponse({"error": body}, status_code=status, headers=headers)


# ---- OpenAPI documentation of the hot endpoint (served by node/protocols/act.py) --------


class ActRequest(BaseModel):
    """One step of an episode."""

    episode_id: str | None = Field(
        None, max_length=512, description="Sticky key of the episode (UTF-8, no control chars)."
    )
    session_id: str | None = Field(
        None, max_length=512, description="Used when episode_id is missing (degraded routing)."
    )
    inputs: dict[str, Any] = Field(
        description="Observation input name -> nested list of the model's shape "
        "(GET /model); with Content-Type application/msgpack, arrays in openpi's encoding."
    )
    end: bool = Field(False, description="Release the episode after serving this step.")
    token: int | None = Field(
        None, ge=0, description="The token of the previous reply; a lost assignment is then "
        "reported as state_reset.",
    )  # fmt: skip
    claim: str | None = Field(
        None, max_length=64, description="The claim of the previous reply; a claim other than "
        "the one serving the step (even under the same token number) is reported as state_reset.",
    )  # fmt: skip
    execute_steps: int | None = Field(
        None, ge=1, description="Action-chunk execution: run the policy every k steps."
    )

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {
            "examples": [{"episode_id": "ep-42", "inputs": {"obs": [[0.1] * 8]}, "token": 17}]
        },
    }


class ActReply(BaseModel):
    """What a step returns; X-Affinity-* headers repeat the facts."""

    outputs: dict[str, Any] = Field(description="Output name -> nested list (or msgpack array).")
    episode_id: str | None
    device: str = Field(description="The device that served the step, e.g. gpu-a/1.")
    node: str
    token: int = Field(description="Fencing token of the assignment; echo it in the next step.")
    claim: str | None = Field(
        None, description="The claim id issued with the token; echo it in the next step."
    )
    routing: str = Field(description="hit | claimed | reassigned | stateless")
    state_reset: bool = Field(description="The episode's state started over with this step.")
    degraded: bool = Field(description="Routed by session_id for lack of an episode_id.")
    source: str = Field(description="model, or buffer for an action from the chunk buffer.")

    model_config = {
        "json_schema_extra": {
            "examples": [
                {
                    "outputs": {"actions": [[[0.06, -0.22], [0.1, 0.3], [0.0, 0.1], [0.2, 0.2]]]},
                    "episode_id": "ep-42",
                    "device": "gpu-a/0",
                    "node": "gpu-a",
                    "token": 1796000000000123,
                    "routing": "hit",
                    "state_reset": False,
                    "degraded": False,
                    "source": "model",
                }
            ]
        }
    }


def _act_openapi(api: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (ActRequest, ActReply):
        components[model.__name__] = model.model_json_schema(
            ref_template="#/components/schemas/{model}"
        )
    error_ref = {"description": "Error", "content": {"application/json": {}}}
    schema["paths"]["/act"] = {
        "post": {
            "summary": "One step of an episode",
            "description": act.__doc__,
            "operationId": "act",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ActRequest"}},
                    "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
                },
            },
            "responses": {
                "200": {
                    "description": "The step's outputs and where it ran",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ActReply"}},
                        "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
                    },
                },
                "400": error_ref,
                "413": error_ref,
                "422": error_ref,
                "500": error_ref,
                "503": error_ref,
            },
        }
    }
    return schema


def create_app(
    service_factory: Callable[[], Awaitable[NodeService]],
    *,
    access_log: bool = True,
    log_json: bool = False,
) -> NodeApp:
    """The app; ``service_factory`` builds the node (devices, sessions, Redis) at start-up.
    ``access_log`` writes one line per request (``node/accesslog.py``), as JSON with
    ``log_json``."""
    access = AccessLog(access_log, json=log_json)

    @asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        service = await service_factory()
        await service.start()
        api.state.service = service
        access.on_drop = service.metrics.log_dropped.inc
        try:
            yield
        finally:
            await service.stop()
            access.flush()

    # /docs and /redoc with Swagger UI's and ReDoc's files served by the node itself (from
    # fastapi-offline's package), not from a CDN: GPU clusters are often air-gapped
    api = FastAPIOffline(title="affinity node", version=VERSION, lifespan=lifespan)

    def svc() -> NodeService:
        service: NodeService = api.state.service
        return service

    @api.post("/episodes/{episode_id:path}/end")
    async def end_episode(episode_id: str) -> Response:
        """Release the episode (its next step claims anew); 404 when it has no assignment."""
        s = svc()
        try:  # at its owner, wherever this request arrived (Routing.end)
            device = await s.router.end_anywhere(episode_id)
            if device is None:
                return error(404, "not_found", f"episode {episode_id!r} has no live assignment")
        except InvalidArgument as exc:
            return error(422, "bad_input", str(exc), field="episode_id")
        except (UnknownEpisode, StaleToken) as exc:
            return error(409, "changed", f"{exc}; try again")
        except Unavailable as exc:
            return error(503, exc.reason, str(exc), retry_after=exc.retry_after)
        return JSONResponse({"episode_id": episode_id, "released": True, "device": device})

    @api.get("/episodes/{episode_id:path}")
    async def get_episode(episode_id: str) -> Response:
        """Device, node, token, ttl_ms, device state and whether the owner is alive."""
        try:
            info = await svc().claims.lookup(episode_id)
        except InvalidArgument as exc:
            return error(422, "bad_input", str(exc), field="episode_id")
        if info is None:
            return error(404, "not_found", f"episode {episode_id!r} has no live assignment")
        body = info.to_json()
        body["episode_id"] = body.pop("episode")  # the HTTP API's name, as in /act replies
        return JSONResponse(body)

    @api.get("/devices")
    async def devices() -> Response:
        """Every device of the fleet; this node's own add crash-tracker facts."""
        s = svc()
        listed = await s.registry.devices()
        out = []
        for d in listed:
            row = d.to_json()
            if d.device in s.device_ids:
                tracker = s.health.tracker(d.device)
                row["local"] = {
                    "live_episodes": s.table.live(d.device),
                    "consecutive_failures": tracker.failures,
                    "crash_down": tracker.down,
                }
            out.append(row)
        return JSONResponse({"node": s.node_id, "devices": out})

    def admin(request: Request) -> Response | None:
        """None when the request carries the admin's token; else the refusal: 401 without
        valid credentials (none, or a wrong token), 403 with credentials that are valid but
        not the admin's (a client's API key), or while the admin API is disabled."""
        s = svc()
        expected = s.config.admin_token
        if not expected:
            s.metrics.rejected.labels("forbidden").inc()
            return error(403, "admin_disabled", "admin API disabled: set AFFINITY_ADMIN_TOKEN")
        given = request.headers.get("authorization", "")
        bearer = given.lower().startswith("bearer ")
        if bearer and hmac.compare_digest(given[7:].strip().encode(), expected.encode()):
            return None
        if s.config.api_key and s.client_allowed(given):
            s.metrics.rejected.labels("forbidden").inc()
            return error(403, "forbidden", "an API key is a client's: use the admin's bearer token")
        s.metrics.rejected.labels("unauthorized").inc()
        return JSONResponse(
            {"error": {"code": "unauthorized",
                       "message": "wrong admin token" if bearer else "bearer token required"}},
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer error="invalid_token"' if bearer else "Bearer"},
        )  # fmt: skip

    async def set_state(request: Request, device: str, state: str) -> Response:
        denied = admin(request)
        if denied is not None:
            return denied
        reason = request.query_params.get("reason", "")
        s = svc()
        try:
            if state == "draining":
                change = await s.registry.drain(device, reason)
            else:  # undrain acts on a draining device only; a down one comes back by probe
                change = await s.registry.undrain(device)
        except UnknownDevice as exc:
            return error(404, "not_found", str(exc))
        except InvalidArgument as exc:
            return error(422, "bad_input", str(exc), field=exc.field)
        if device in s.device_ids:
            s.metrics.set_state(device, change.state)
        return JSONResponse({"device": device, "state": change.state, "previous": change.previous})

    @api.post("/devices/{device:path}/drain")
    async def drain(request: Request, device: str) -> Response:
        """Admin: the device keeps its episodes and takes no new ones."""
        return await set_state(request, device, "draining")

    @api.post("/devices/{device:path}/undrain")
    async def undrain(request: Request, device: str) -> Response:
        """Admin: a draining device takes new episodes again."""
        return await set_state(request, device, "active")

    @api.get("/healthz")
    async def healthz() -> Response:
        """The process is alive."""
        return JSONResponse({"ok": True, "node": svc().node_id})

    @api.get("/readyz")
    async def readyz() -> Response:
        """Registered, lease current, not leaving."""
        s = svc()
        if not s.lease.valid():
            return error(503, "fenced", "lease not current", retry_after=1)
        if s.lease.leaving:
            return error(503, "leaving", "the node is shutting down", retry_after=1)
        return JSONResponse({"ready": True, "node": s.node_id, "devices": s.device_ids})

    @api.get("/model")
    async def model() -> Response:
        """The policy contract of the node's model: inputs a client sends, outputs,
        fed-back state (a node serving several models: 422, see ``/models/{name}``)."""
        s = svc()
        if len(s.models) > 1:
            names = ", ".join(s.models)
            return error(422, "model_required", f"this node serves {names}: GET /models/{{name}}")
        return JSONResponse(s.contract.to_json())

    @api.get("/models")
    async def models() -> Response:
        """Every model of the fleet: name, version, the live nodes serving it, its rollout
        weight (null: the newest version takes new episodes), and whether it is the newest
        version of its name and served on this node."""
        s = svc()
        here = {str(m) for m, _ in s.models.values()}
        try:
            rows = await s.registry.models()
        except BackendUnavailable as exc:
            return error(503, "redis", str(exc), retry_after=1)
        return JSONResponse(
            {"models": [{**r.to_json(), "local": f"{r.name}@{r.version}" in here} for r in rows]}
        )

    @api.get("/models/{name}")
    async def model_named(name: str, version: str | None = None) -> Response:
        """The contract of model ``name`` (``?version=``: of that version; else the one
        served here, else the newest served), as ``GET /model`` has it, with its name and
        version."""
        s = svc()
        try:
            chosen, contract = await s.model_for(name, version)
        except Refused as exc:
            return error(exc.status, exc.reason, str(exc))
        except InvalidArgument as exc:
            return error(422, "bad_input", str(exc))
        local = s.models.get(chosen)
        shown = version or (local[0].version if local else s.catalog.newest(chosen))
        return JSONResponse({"name": chosen, "version": shown, **contract.to_json()})

    @api.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format."""
        s = svc()
        s.owner.refresh_gauges()
        return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_fleet_routes(api, svc)  # /ui, /nodes, /events/stream

    @api.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error(exc.status_code, code, message)

    @api.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        """FastAPI's own validation (query and path parameters), in the project's shape."""
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"][1:]) or str(first["loc"][0])
        message = f"{field} {first.get('input')!r:.80}: {first['msg']}"
        return error(422, "bad_input", message, field=field)

    @api.exception_handler(BackendUnavailable)
    async def redis_unavailable(request: Request, exc: BackendUnavailable) -> Response:
        """The one answer of every endpoint whose Redis call failed: 503 ``busy`` when the
        call only waited for this node's pool (it is overloaded), ``not_replicated`` when
        too few replicas acknowledged its write, else ``redis``."""
        code = (
            "busy"
            if isinstance(exc, PoolExhausted)
            else "not_replicated"
            if isinstance(exc, NotReplicated)
            else "redis"
        )
        return error(503, code, str(exc), retry_after=1)

    @api.exception_handler(AffinityError)
    async def affinity_error(request: Request, exc: AffinityError) -> Response:
        return error(503, "affinity", str(exc), retry_after=1)

    api.openapi = lambda: api.openapi_schema or _cache(api, _act_openapi(api))  # type: ignore[method-assign]

    hot: dict[tuple[str, str], Handler] = {
        ("POST", "/act"): act.handle,
        ("POST", "/internal/act"): internal.handle,
        ("POST", "/internal/move"): internal.move,
    }
    return NodeApp(api, hot, access)


def _cache(api: FastAPI, schema: dict[str, Any]) -> dict[str, Any]:
    api.openapi_schema = schema
    return schema
