"""The node's FastAPI routes, one router per concern: episodes, devices, models, health, metrics.

The hot paths (``/act``, ``/internal/act``, ``/v2``) never come here: ``node/app.py``
sends them to their protocol modules first. Every route reads the running node through
:data:`Service`. Errors are JSON ``{"error": {"code", "message", "field"?}}`` (:func:`error`);
an exception's status and code come from ``node.errors.outcome`` (:func:`error_for`).
Hazard: the admin routes refuse through :class:`AdminRefused`, which ``create_app`` renders.
"""

from __future__ import annotations

import hmac
import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from affinity import (
    InvalidArgument,
    Inventory,
    StaleToken,
    UnknownDevice,
    UnknownEpisode,
)
from affinity.registry import MoveRequest
from node.errors import AdminRefused, Refused, Unavailable, outcome
from node.service import NodeService

__all__ = ["Service", "devices", "episodes", "error", "health", "metrics", "models"]


async def _service(request: Request) -> NodeService:  # async: no thread per request
    service: NodeService = request.app.state.service
    return service


Service = Annotated[NodeService, Depends(_service)]
"""The running node, as a route's parameter."""


def error(
    status: int, code: str, message: str, field: str | None = None, retry_after: float | None = None
) -> JSONResponse:
    """The node's error reply: ``{"error": {"code", "message", "field"?}}``, and
    ``Retry-After`` in whole seconds (at least 1) when ``retry_after`` is given."""
    body: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def error_for(exc: BaseException, field: str | None = None) -> JSONResponse:
    """:func:`error` for ``exc`` as :func:`node.errors.outcome` maps it; ``field`` names the
    request field at fault (none by default: each route knows its own)."""
    o = outcome(exc)
    return error(o.status, o.code, o.message, field, o.retry_after)


# ---- episodes --------------------------------------------------------------------------

episodes = APIRouter()


@episodes.post("/episodes/{episode_id:path}/end")
async def end_episode(episode_id: str, s: Service) -> Response:
    """Release the episode (its next step claims anew); 404 when it has no assignment."""
    try:  # at its owner, wherever this request arrived (Router.end_anywhere)
        device = await s.router.end_anywhere(episode_id)
        if device is None:
            return error(404, "not_found", f"episode {episode_id!r} has no live assignment")
    except InvalidArgument as exc:
        return error_for(exc, field="episode_id")
    except (UnknownEpisode, StaleToken) as exc:  # it changed while this ran: not the table's
        return error(409, "changed", f"{exc}; try again")
    except Unavailable as exc:
        return error_for(exc)
    return JSONResponse({"episode_id": episode_id, "released": True, "device": device})


@episodes.get("/episodes/{episode_id:path}")
async def get_episode(episode_id: str, s: Service) -> Response:
    """Device, node, token, ttl_ms, device state and whether the owner is alive."""
    try:
        info = await s.claims.lookup(episode_id)
    except InvalidArgument as exc:
        return error_for(exc, field="episode_id")
    if info is None:
        return error(404, "not_found", f"episode {episode_id!r} has no live assignment")
    body = info.to_json()
    body["episode_id"] = body.pop("episode")  # the HTTP API's name, as in /act replies
    return JSONResponse(body)


# ---- devices (the admin's) -------------------------------------------------------------


async def admin(request: Request, s: Service) -> None:
    """Pass the admin's token; else raise :class:`AdminRefused`. 401 without valid
    credentials (none, or a wrong token). 403 with credentials that are valid but not the
    admin's (a client's API key), or while the admin API is disabled."""
    expected = s.config.admin_token
    if not expected:
        raise AdminRefused(403, "admin_disabled", "admin API disabled: set AFFINITY_ADMIN_TOKEN")
    given = request.headers.get("authorization", "")
    bearer = given.lower().startswith("bearer ")
    if bearer and hmac.compare_digest(given[7:].strip().encode(), expected.encode()):
        return
    if s.config.api_key and s.client_allowed(given):
        why = "an API key is a client's: use the admin's bearer token"
        raise AdminRefused(403, "forbidden", why)
    raise AdminRefused(
        401,
        "unauthorized",
        "wrong admin token" if bearer else "bearer token required",
        'Bearer error="invalid_token"' if bearer else "Bearer",
    )


devices = APIRouter()


@devices.get("/devices", name="devices")
async def list_devices(s: Service) -> Response:
    """Every device of the fleet; this node's own add crash-tracker facts."""
    out = []
    for d in await Inventory(s.redis, s.config.settings).devices():
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


@devices.post("/devices/{device:path}/drain", dependencies=[Depends(admin)])
async def drain(request: Request, device: str, s: Service) -> Response:
    """Admin: the device takes no new episodes. It keeps the ones it has. With
    ``move=true`` its node moves them to other devices with their state at its next lease
    renewal (as ``affinity drain --move``)."""
    move = request.query_params.get("move", "false").lower()
    if move not in ("true", "false", "1", "0"):
        return error(
            422, "bad_input", f"move must be true or false, not {move[:16]!r}", field="move"
        )
    reply = await _set_state(s, device, "draining", request.query_params.get("reason", ""))
    if reply.status_code != 200 or move in ("false", "0"):
        return reply
    await s.registry.request_move(device.rpartition("/")[0], MoveRequest(device=device))
    return JSONResponse({**json.loads(bytes(reply.body)), "move": True})


@devices.post("/devices/{device:path}/undrain", dependencies=[Depends(admin)])
async def undrain(device: str, s: Service) -> Response:
    """Admin: a draining device takes new episodes again."""
    return await _set_state(s, device, "active")


async def _set_state(s: NodeService, device: str, state: str, reason: str = "") -> Response:
    try:
        if state == "draining":
            change = await s.registry.drain(device, reason)
        else:  # undrain acts on a draining device only; a down one comes back by probe
            change = await s.registry.undrain(device)
    except UnknownDevice as exc:
        return error(404, "not_found", str(exc))
    except InvalidArgument as exc:
        return error_for(exc, field=exc.field)
    if device in s.device_ids:
        s.metrics.set_state(device, change.state)
    return JSONResponse({"device": device, "state": change.state, "previous": change.previous})


# ---- health ----------------------------------------------------------------------------

health = APIRouter()


@health.get("/healthz")
async def healthz(s: Service) -> Response:
    """The process is alive."""
    return JSONResponse({"ok": True, "node": s.node_id})


@health.get("/readyz")
async def readyz(s: Service) -> Response:
    """Registered, lease current, not leaving."""
    if not s.lease.valid():
        return error(503, "fenced", "lease not current", retry_after=1)
    if s.lease.leaving:
        return error(503, "leaving", "the node is shutting down", retry_after=1)
    return JSONResponse({"ready": True, "node": s.node_id, "devices": s.device_ids})


# ---- models ----------------------------------------------------------------------------

models = APIRouter()


@models.get("/model")
async def model(s: Service) -> Response:
    """The policy contract of the node's model: inputs a client sends, outputs,
    fed-back state (a node serving several models: 422, see ``/models/{name}``)."""
    if len(s.models) > 1:
        names = ", ".join(s.models)
        return error(422, "model_required", f"this node serves {names}: GET /models/{{name}}")
    return JSONResponse(s.contract.to_json())


@models.get("/models", name="models")
async def list_models(s: Service) -> Response:
    """Every model of the fleet: name, version, the live nodes serving it, its rollout
    weight. A null weight means the newest version takes new episodes. Also whether it is
    the newest version of its name and served on this node."""
    here = {str(m) for m, _ in s.models.values()}
    rows = await Inventory(s.redis, s.config.settings).models()  # BackendUnavailable: the app's
    return JSONResponse(
        {"models": [{**r.to_json(), "local": f"{r.name}@{r.version}" in here} for r in rows]}
    )


@models.get("/models/{name}")
async def model_named(name: str, s: Service, version: str | None = None) -> Response:
    """The contract of model ``name`` (``?version=``: of that version; else the one
    served here, else the newest served), as ``GET /model`` has it, with its name and
    version."""
    try:
        chosen, contract = await s.model_for(name, version)
    except (Refused, InvalidArgument) as exc:
        return error_for(exc)
    local = s.models.get(chosen)
    shown = version or (local[0].version if local else s.catalog.newest(chosen))
    return JSONResponse({"name": chosen, "version": shown, **contract.to_json()})


# ---- metrics ---------------------------------------------------------------------------

metrics = APIRouter()


@metrics.get("/metrics", name="metrics")
async def prometheus(s: Service) -> Response:
    """Prometheus text format."""
    s.owner.refresh_gauges()
    return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)
