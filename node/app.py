"""The node's ASGI application: hot paths first, then FastAPI's routers for the rest.

``POST /act``, the nodes' ``POST /internal/*`` and ``/v2`` go straight to
``node/protocols/``, without a framework on the request path; websockets go to openpi.
Two checks run before any route. A browser's request from another site that changes
something is refused (403 ``cross_site``). With ``--api-key`` the paths of
:data:`PROTECTED` want the key (401). Errors are JSON ``{"error": {"code", "message",
"field"?}}``; under ``/v2`` KServe's own. Hazard: a new path that reads or changes
episodes must be listed in :data:`PROTECTED`.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException

from affinity import AffinityError
from node import VERSION, openapi, routes
from node.accesslog import AccessLog
from node.asgi import Receive, Scope, Send, cross_site, error_body, header, respond
from node.errors import AdminRefused, outcome
from node.fleet import add_fleet_routes
from node.protocols import act, internal, openpi
from node.protocols.kserve import http as kserve
from node.routes import error, error_for
from node.service import NodeService

__all__ = ["PROTECTED", "NodeApp", "create_app", "cross_site"]

Handler = Callable[[NodeService, Scope, Receive, Send], Awaitable[None]]
SAFE_METHODS = frozenset(("GET", "HEAD", "OPTIONS"))
PROTECTED = ("/episodes/", "/devices", "/nodes", "/events/stream")
"""Path prefixes that read or change episodes (or the fleet): they want the API key."""
ADMIN_ACTIONS = ("/drain", "/undrain")
"""The ends of the admin's ``POST /devices/{id}/...`` paths. ``node.routes.admin`` alone
decides those (401 without valid credentials, 403 for a client's key and while
``AFFINITY_ADMIN_TOKEN`` is unset: ``docs/security.md``), on a node with or without
``--api-key``."""


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
        self.started: NodeService | None = None
        """The node the lifespan built, also in ``api.state.service``. Read here on every
        request: Starlette's ``State`` costs ~0.5 µs an attribute read (a ``__getattr__``)."""

    @property
    def state(self) -> Any:
        return self.api.state

    @property
    def service(self) -> NodeService:
        if self.started is not None:
            return self.started
        service: NodeService = self.api.state.service  # set by hand (tests), or not yet
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
        if (
            path.startswith(PROTECTED)
            and not (path.startswith("/devices/") and path.endswith(ADMIN_ACTIONS))
            and not self.service.reader_allowed(header(scope, b"authorization"))
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


def create_app(
    service_factory: Callable[[], Awaitable[NodeService]],
    *,
    access_log: bool = True,
    log_json: bool = False,
    freeze_gc: bool = False,
) -> NodeApp:
    """The app; ``service_factory`` builds the node (devices, sessions, Redis) at start-up.
    ``access_log`` writes one line per request (``node/accesslog.py``), as JSON with
    ``log_json``. ``freeze_gc``: once started, what the process holds is moved out of the
    garbage collector's sight (:func:`freeze_startup`); for a node's own process only."""
    # the access log is made before the node (the lifespan builds it): it counts lines it
    # could not write on the node's metrics once there is one
    access = AccessLog(access_log, json=log_json, on_drop=lambda n: _log_dropped(api, n))

    @asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        service = await service_factory()
        await service.start()
        api.state.service = app.started = service
        if freeze_gc:
            freeze_startup()
        try:
            yield
        finally:
            await service.stop()
            access.flush()

    # /docs and /redoc with Swagger UI's and ReDoc's files served by the node itself (from
    # fastapi-offline's package), not from a CDN: GPU clusters are often air-gapped
    api = FastAPIOffline(title="affinity node", version=VERSION, lifespan=lifespan)
    for router in (routes.episodes, routes.devices, routes.health, routes.models, routes.metrics):
        api.include_router(router)
    add_fleet_routes(api, lambda: api.state.service)  # /ui, /nodes, /events/stream
    _add_error_handlers(api)
    openapi.document_act(api)
    hot: dict[tuple[str, str], Handler] = {
        ("POST", "/act"): act.handle,
        ("POST", "/internal/act"): internal.handle,
        ("POST", "/internal/rows"): internal.rows,
        ("POST", "/internal/move"): internal.move,
        ("POST", "/internal/ghost"): internal.ghost,
    }
    app = NodeApp(api, hot, access)
    return app


def freeze_startup() -> None:
    """Collect, then freeze (``gc.freeze``) every object the process holds: the modules,
    the models, the app, what the node built to start. They live as long as the process,
    and a full collection no longer walks them, only what serving made since. Without it,
    a full collection of a node's heap stops its event loop for tens of ms (40 to 110 ms
    measured under load on the 2-core CI machine, every 10 to 30 s), and every step in flight
    there waits: a message of rows waits for each of its owners, so such a pause at any
    node holds every message of the tick (``docs/benchmarks.md``, issue 44)."""
    gc.collect()
    gc.freeze()


def _log_dropped(api: FastAPI, lines: int) -> None:
    """Count ``lines`` the access log could not write, on the node's metrics (none before
    the node is built)."""
    service: NodeService | None = getattr(api.state, "service", None)
    if service is not None:
        service.metrics.log_dropped.inc(lines)


def _add_error_handlers(api: FastAPI) -> None:
    """Every error FastAPI's routes raise, in the node's JSON shape."""

    @api.exception_handler(AdminRefused)
    async def admin_refused(request: Request, exc: AdminRefused) -> Response:
        metrics = request.app.state.service.metrics
        metrics.rejected.labels(outcome(exc).reject_reason).inc()
        response = error_for(exc)
        if exc.challenge is not None:
            response.headers["WWW-Authenticate"] = exc.challenge
        return response

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

    @api.exception_handler(AffinityError)
    async def affinity_error(request: Request, exc: AffinityError) -> Response:
        """The one answer of every endpoint whose Redis call failed (``errors.outcome``).
        503 ``busy`` when the call only waited for this node's pool (it is overloaded).
        ``not_replicated`` when too few replicas acknowledged its write, else ``redis``."""
        return error_for(exc)
