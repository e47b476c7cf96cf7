"""The node's HTTP API (FastAPI on uvicorn).

``POST /act`` routes one step of an episode to its device (serving it here or forwarding
it once to the owner); the rest is inspection and administration. Every error is JSON:
``{"error": {"code", "message", "field"?}}``; 4xx for the client's mistakes (nothing
changes), 503 with ``Retry-After`` for what cannot be decided or served now.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from affinity import (
    AffinityError,
    BackendUnavailable,
    InvalidArgument,
    StaleToken,
    UnknownDevice,
    UnknownEpisode,
)
from node.dispatcher import DeviceDown, ModelFailure
from node.fleet import add_fleet_routes
from node.policy import InvalidInput
from node.service import SECRET_HEADER, ActReply, NodeService, Refused, Unavailable

__all__ = ["create_app"]

log = logging.getLogger("affinity.node")

ACT_BODY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "episode_id": {"type": "string", "maxLength": 512},
        "session_id": {"type": "string", "maxLength": 512},
        "inputs": {"type": "object", "additionalProperties": {"type": "array"}},
        "end": {"type": "boolean"},
        "token": {"type": "integer", "minimum": 0},
    },
    "required": ["inputs"],
}


def error(
    status: int, code: str, message: str, field: str | None = None, retry_after: float | None = None
) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return JSONResponse({"error": body}, status_code=status, headers=headers)


class BodyError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        self.status, self.code = status, code
        super().__init__(message)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, "too_large", f"body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyError(413, "too_large", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise BodyError(400, "malformed", f"body is not valid JSON: {exc}"[:300]) from None
    if not isinstance(body, dict):
        raise BodyError(400, "malformed", "body must be a JSON object")
    return body


def act_response(reply: ActReply) -> JSONResponse:
    headers = {
        "X-Affinity-Device": reply.device,
        "X-Affinity-Node": reply.node,
        "X-Affinity-Token": str(reply.token),
        "X-Affinity-Routing": reply.routing,
        "X-Affinity-State-Reset": "true" if reply.state_reset else "false",
        "X-Affinity-Degraded": "true" if reply.degraded else "false",
    }
    return JSONResponse(reply.to_json(), headers=headers)


def create_app(
    service_factory: Callable[[], Awaitable[NodeService]],
) -> FastAPI:
    """The app; ``service_factory`` builds the node (devices, sessions, Redis) at start-up."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = await service_factory()
        await service.start()
        app.state.service = service
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="affinity node", version="0.1.0", lifespan=lifespan)

    def svc() -> NodeService:
        service: NodeService = app.state.service
        return service

    async def guarded(
        request: Request, run: Callable[[dict[str, Any]], Awaitable[ActReply]]
    ) -> Response:
        s = svc()
        try:
            body = await read_json(request, s.config.max_body_bytes)
        except BodyError as exc:
            s.metrics.rejected.labels(exc.code).inc()
            return error(exc.status, exc.code, str(exc))
        try:
            async with asyncio.timeout(s.config.act_deadline_s):
                return act_response(await run(body))
        except InvalidInput as exc:
            s.metrics.rejected.labels("bad_input").inc()
            return error(422, "bad_input", str(exc), field=f"inputs.{exc.field}".rstrip("."))
        except InvalidArgument as exc:
            s.metrics.rejected.labels("bad_input").inc()
            return error(422, "bad_input", str(exc), field=exc.field.replace(" ", "_"))
        except Unavailable as exc:
            return error(503, exc.reason, str(exc), retry_after=exc.retry_after)
        except Refused as exc:
            if exc.status == 403:
                s.metrics.rejected.labels("forbidden").inc()
            return error(exc.status, exc.reason, str(exc))
        except DeviceDown as exc:
            return error(503, "device_down", str(exc), retry_after=5)
        except ModelFailure as exc:
            s.metrics.model_failures.labels(exc.device).inc()
            return error(500, "model_failure", str(exc))
        except TimeoutError:
            return error(
                503, "deadline", f"no answer within {s.config.act_deadline_s}s", retry_after=1
            )
        except BackendUnavailable as exc:
            return error(503, "redis", str(exc), retry_after=1)

    @app.post(
        "/act",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ACT_BODY_SCHEMA}},
            }
        },
    )
    async def act(request: Request) -> Response:
        """One step of an episode; see the README for the body and the reply."""
        return await guarded(request, svc().act)

    @app.post("/internal/act", include_in_schema=False)
    async def internal_act(request: Request) -> Response:
        secret = request.headers.get(SECRET_HEADER)
        return await guarded(request, lambda body: svc().act_forwarded(body, secret))

    @app.get("/episodes/{episode_id}")
    async def get_episode(episode_id: str) -> Response:
        try:
            info = await svc().claims.lookup(episode_id)
        except InvalidArgument as exc:
            return error(422, "bad_input", str(exc), field="episode_id")
        except BackendUnavailable as exc:
            return error(503, "redis", str(exc), retry_after=1)
        if info is None:
            return error(404, "not_found", f"episode {episode_id!r} has no live assignment")
        return JSONResponse(info.to_json())

    @app.post("/episodes/{episode_id}/end")
    async def end_episode(episode_id: str) -> Response:
        s = svc()
        try:
            info = await s.claims.lookup(episode_id)
            if info is None:
                return error(404, "not_found", f"episode {episode_id!r} has no live assignment")
            await s.claims.release(episode_id, info.token, reason="end")
        except InvalidArgument as exc:
            return error(422, "bad_input", str(exc), field="episode_id")
        except (UnknownEpisode, StaleToken) as exc:
            return error(409, "changed", f"{exc}; try again")
        except BackendUnavailable as exc:
            return error(503, "redis", str(exc), retry_after=1)
        s.dispatcher.release(episode_id)
        return JSONResponse({"episode_id": episode_id, "released": True, "device": info.device})

    @app.get("/devices")
    async def devices() -> Response:
        s = svc()
        try:
            listed = await s.registry.devices()
        except BackendUnavailable as exc:
            return error(503, "redis", str(exc), retry_after=1)
        out = []
        for d in listed:
            row = d.to_json()
            if d.device in s.device_ids:
                tracker = s.dispatcher.tracker(d.device)
                row["local"] = {
                    "live_episodes": s.dispatcher.live_episodes(d.device),
                    "consecutive_failures": tracker.failures,
                    "crash_down": tracker.down,
                }
            out.append(row)
        return JSONResponse({"node": s.node_id, "devices": out})

    def admin(request: Request) -> Response | None:
        s = svc()
        expected = s.config.admin_token
        if not expected:
            s.metrics.rejected.labels("forbidden").inc()
            return error(403, "admin_disabled", "admin API disabled: set AFFINITY_ADMIN_TOKEN")
        given = request.headers.get("authorization", "")
        if not given.lower().startswith("bearer "):
            s.metrics.rejected.labels("unauthorized").inc()
            return JSONResponse(
                {"error": {"code": "unauthorized", "message": "bearer token required"}},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(given[7:].strip().encode(), expected.encode()):
            s.metrics.rejected.labels("forbidden").inc()
            return error(403, "forbidden", "wrong admin token")
        return None

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
        except BackendUnavailable as exc:
            return error(503, "redis", str(exc), retry_after=1)
        if device in s.device_ids:
            s.metrics.set_state(device, change.state)
        return JSONResponse({"device": device, "state": change.state, "previous": change.previous})

    @app.post("/devices/{device:path}/drain")
    async def drain(request: Request, device: str) -> Response:
        return await set_state(request, device, "draining")

    @app.post("/devices/{device:path}/undrain")
    async def undrain(request: Request, device: str) -> Response:
        return await set_state(request, device, "active")

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse({"ok": True, "node": svc().node_id})

    @app.get("/readyz")
    async def readyz() -> Response:
        s = svc()
        if s.fenced():
            return error(503, "fenced", "lease not current", retry_after=1)
        return JSONResponse({"ready": True, "node": s.node_id, "devices": s.device_ids})

    @app.get("/model")
    async def model() -> Response:
        return JSONResponse(svc().contract.to_json())

    @app.get("/metrics")
    async def metrics() -> Response:
        s = svc()
        s.refresh_gauges()
        return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_fleet_routes(app, svc)  # /ui, /nodes, /events/stream

    @app.exception_handler(AffinityError)
    async def affinity_error(request: Request, exc: AffinityError) -> Response:
        return error(503, "affinity", str(exc), retry_after=1)

    return app
