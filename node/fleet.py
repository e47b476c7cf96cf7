"""Operator endpoints: the fleet page, the node list and the live event stream.

``add_fleet_routes(app, service)`` mounts, on every node:

- ``GET /ui`` — one page that shows the whole fleet as Redis sees it. It is HTML, CSS and
  plain JavaScript from ``node/ui/``, nothing loaded from anywhere else; a
  Content-Security-Policy says so to the browser. It shows nodes, devices, the event
  stream, an episode lookup and, once an admin token is typed in, drain/undrain buttons.
  It reads ``GET /nodes``, ``GET /devices``, ``GET /episodes/{id}`` and
  ``GET /events/stream``.
- ``GET /nodes`` — every registered node with its lease.
- ``GET /events/stream`` — the deployment's event stream as server-sent events. Each
  event's ``id:`` is its Redis stream id. A client that reconnects with ``Last-Event-ID``
  (browsers do it by themselves) gets every event after the last one it saw. That holds as
  long as the capped stream still holds it. Quiet streams send a comment line every
  ``heartbeat_s``; each wait on Redis is bounded by the Redis deadline.

Everything here is read-only, like the other GET endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import resources
from typing import Any, Protocol

from fastapi import FastAPI, Header, Query
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from affinity import BackendUnavailable, Inventory, Registry
from affinity.events import Event, EventStream, event_json
from affinity.shadows import Shadows
from affinity.shadows import status as shadow_status

__all__ = ["Fleet", "FleetSource", "add_fleet_routes"]

log = logging.getLogger("affinity.node")

UI_DIR = resources.files("node") / "ui"
ASSETS = {  # file in node/ui -> media type
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
# The page may load and call only this node: no inline script or style, no other origin.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
NO_CACHE = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
MAX_BACKLOG = 1000
RETRY_MS = 2000  # how soon a browser reconnects after the stream ends
MAX_STREAMS = 32


class FleetSource(Protocol):
    """What the fleet endpoints need of the node (``node.service.NodeService`` has it)."""

    node_id: str
    registry: Registry
    stream_registry: Registry  # on a pool of its own: streams never take the hot path's

    @property
    def instance(self) -> str: ...


class ProcessOut(BaseModel):
    """One process of a node (``--front-doors``, ``--device-workers process``), as its last
    renewal published it."""

    role: str = Field(
        description='"core" (the node\'s own process), a front\'s index, or "dev<index>" '
        "(a device's worker process)"
    )
    pid: int
    since_ms: int = Field(description="when it started, ms since the epoch (the node's clock)")
    restarts: int = Field(0, description="times the core restarted this front or worker")
    lag_p99_ms: float | None = Field(
        None,
        description="its event loop's lag, 99th percentile since the node's previous renewal "
        "(a bucket's upper bound, ms); absent: no sample since, or a worker (it has no event "
        "loop); null: past 2.5 s",
    )


class NodeOut(BaseModel):
    """One node as Redis holds it (more fields may be added)."""

    model_config = ConfigDict(extra="allow")

    node: str
    url: str = Field("", description="advertise URL")
    devices: list[str] = []
    alive: bool = Field(False, description="lease current (Redis server clock)")
    lease_ms: int = Field(0, description="ms left on the lease; negative: lapsed that long ago")
    started_at_ms: int = Field(0, description="registration time, ms since the epoch (Redis)")
    version: str = ""
    models: list[str] = Field([], description='"name@version" every device of the node serves')
    fronts: int = Field(1, description="--front-doors: 1 = one process, N = a core and N fronts")
    workers: int = Field(
        0,
        description="device worker processes (--device-workers process: one per device); "
        "absent: 0, the devices run in the core's threads",
    )
    processes: list[ProcessOut] = Field(
        [], description="its running processes, the core first; [] from a node of an older version"
    )


class NodesOut(BaseModel):
    node: str = Field(description="the node that answered")
    instance: str = Field(description="the answering process's instance id")
    nodes: list[NodeOut]

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "node": "gpu-a",
                    "instance": "5f0c2a7e9b1d4c3a8e6f00112233aabb",
                    "nodes": [
                        {
                            "node": "gpu-a",
                            "url": "http://gpu-a:8000",
                            "devices": ["gpu-a/0", "gpu-a/1"],
                            "alive": True,
                            "lease_ms": 8734,
                            "started_at_ms": 1795983840000,
                            "version": "0.1.0",
                            "models": ["demo_policy@3f2a9c1b7e0d"],
                            "fronts": 2,
                            "workers": 2,
                            "processes": [
                                {
                                    "role": "core",
                                    "pid": 4101,
                                    "since_ms": 1795983839120,
                                    "restarts": 0,
                                    "lag_p99_ms": 1.0,
                                },
                                {
                                    "role": "0",
                                    "pid": 4187,
                                    "since_ms": 1795983840310,
                                    "restarts": 0,
                                    "lag_p99_ms": 1.0,
                                },
                                {
                                    "role": "1",
                                    "pid": 5213,
                                    "since_ms": 1795984521775,
                                    "restarts": 1,
                                    "lag_p99_ms": 2.5,
                                },
                                {
                                    "role": "dev0",
                                    "pid": 4102,
                                    "since_ms": 1795983839480,
                                    "restarts": 0,
                                },
                                {
                                    "role": "dev1",
                                    "pid": 4103,
                                    "since_ms": 1795983839490,
                                    "restarts": 0,
                                },
                            ],
                        }
                    ],
                }
            ]
        }
    )


def _error(status: int, code: str, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse(
        {"error": {"code": code, "message": message}}, status_code=status, headers=headers
    )


class _EventStream(StreamingResponse):
    """A stream that frees its slot when the response ends, however it ends (the client
    may go away before the stream's first line, when its generator never runs)."""

    def __init__(
        self, content: AsyncIterator[str], release: Callable[[], None], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


def _id_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def sse_event(stream_id: str, fields: dict[str, str]) -> str:
    """One event in SSE framing: ``id:`` = the stream id, ``data:`` = one JSON line. The
    line holds the id and every field of the event (``type`` among them), numbers as
    numbers. It is what ``affinity events --json`` prints (``affinity.events.event_json``)."""
    data = json.dumps(event_json(stream_id, fields), separators=(",", ":"))
    return f"id: {stream_id}\ndata: {data}\n\n"


def sse_comment(text: str) -> str:
    return ": " + " ".join(text.split()) + "\n\n"  # one line, whatever the text held


class Fleet:
    """The open event streams of one app.

    ``close()`` ends every stream (each sends nothing more and returns). So a graceful
    shutdown does not wait for browsers to hang up; it is safe to call from a signal
    handler. At most ``max_streams`` streams are open at once; more are answered 503. Each
    holds a Redis connection of the streams' own pool in a blocking read. A slot is taken
    (:meth:`reserve`) when the request is admitted, not when its stream first runs. So
    concurrent connects cannot pass the limit together.
    """

    def __init__(self, heartbeat_s: float = 15.0, max_streams: int = MAX_STREAMS) -> None:
        self.heartbeat_s = heartbeat_s
        self.max_streams = max_streams
        self.open = 0
        self.closed = False
        self._closing = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def close(self) -> None:
        self.closed = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._closing.set)
        else:
            self._closing.set()

    def reserve(self) -> Callable[[], None] | None:
        """Take a stream slot now; ``None`` when all are taken. The returned release may
        be called any number of times (it frees the slot once)."""
        if self.open >= self.max_streams:
            return None
        self.open += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.open -= 1

        return release

    async def stream(
        self,
        events: EventStream,
        cursor: str,
        first: Sequence[Event] = (),
        gap: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        release: Callable[[], None] | None = None,
    ) -> AsyncIterator[str]:
        """SSE text: ``first``, then every event after ``cursor`` as it arrives.

        ``gap`` (an SSE ``gap`` event) is sent first when given. A Redis error is reported
        as a comment and the same cursor is read again after a second, so nothing is
        skipped. The slot is ``release``d when the stream ends (one is taken here when
        none is given)."""
        self._loop = asyncio.get_running_loop()
        if release is None:
            release = self.reserve()
            if release is None:
                return
        try:
            yield f"retry: {RETRY_MS}\n\n"
            if gap:
                yield gap
            for stream_id, fields in first:
                yield sse_event(stream_id, fields)
            quiet_since = clock()
            block_ms = max(1, round(self.heartbeat_s * 1000))
            while not self._closing.is_set():
                try:
                    batch = await events.wait(cursor, block_ms)
                except BackendUnavailable as exc:
                    yield sse_comment(f"redis unavailable, retrying: {exc}")
                    quiet_since = clock()
                    await self._pause(1.0)
                    continue
                for stream_id, fields in batch:
                    yield sse_event(stream_id, fields)
                    cursor = stream_id
                if batch:
                    quiet_since = clock()
                elif clock() - quiet_since >= self.heartbeat_s:
                    yield ": keep-alive\n\n"
                    quiet_since = clock()
        finally:
            release()

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), seconds)


async def resume_gap(events: EventStream, last_id: str) -> str | None:
    """An SSE ``gap`` event when events after ``last_id`` may have been trimmed from the
    capped stream (it no longer reaches back to ``last_id``), else ``None``."""
    oldest = await events.events("-", count=1)
    if oldest and _id_key(oldest[0][0]) > _id_key(last_id):
        data = json.dumps({"after": last_id, "oldest": oldest[0][0]})
        return f"event: gap\ndata: {data}\n\n"
    return None


STREAM_DOC = """The deployment's events (`claim`, `reassign`, `release`, `expire`, `drain`,
`undrain`, `down`, `up`, `node-up`, `node-leave`, `node-down` (`reason` `deregistered`: a
graceful stop; `lease lapsed`: a crash), `moved`, ...) as server-sent events.

Each event is `id: <Redis stream id>` and one `data:` line of JSON holding the id and the
event's fields. A new connection starts with the latest `backlog` events; one that sends
`Last-Event-ID` (browsers' `EventSource` does on reconnect; or `?last_event_id=`) gets
every event after that id instead, so nothing is missed while the capped stream still
holds it (an event named `gap` says when it may not). Comment lines (`: keep-alive`) are
sent every 15 s of quiet. At most 32 streams are open per node (503 `too_many_streams`
beyond, with `Retry-After`)."""

SSE_EXAMPLE = (
    "retry: 2000\n\n"
    "id: 1795983846527-0\n"
    'data: {"id":"1795983846527-0","type":"claim","episode":"ep-7","device":"gpu-a/1",'
    '"token":1795983846526991,"node":"gpu-a","from":""}\n\n'
    ": keep-alive\n\n"
)


async def open_stream(fleet: Fleet, s: FleetSource, backlog: int, last_id: str) -> Response:
    """``GET /events/stream``'s answer: the stream from ``last_id`` (else the latest
    ``backlog`` events), or its error (400, 503 ``stopping`` or ``too_many_streams``)."""
    if fleet.closed:
        return _error(503, "stopping", "node is shutting down", retry_after=1)
    if last_id and not STREAM_ID.match(last_id):
        return _error(400, "bad_input", "Last-Event-ID must be a stream id such as 17-0")
    release = fleet.reserve()  # before any await: the limit holds under concurrency
    if release is None:
        return _error(
            503,
            "too_many_streams",
            f"{fleet.max_streams} event streams are open here",
            retry_after=RETRY_MS // 1000,
        )
    events = EventStream(s.stream_registry.redis, s.stream_registry.settings)
    try:
        if last_id:
            first: list[Event] = []
            cursor, gap = last_id, await resume_gap(events, last_id)
        else:
            first, cursor = await events.latest(backlog)
            gap = None
    except BaseException:  # BackendUnavailable included: the app's one handler answers
        release()
        raise
    return _EventStream(
        fleet.stream(events, cursor, first, gap, release=release),
        release,
        media_type="text/event-stream",
        headers={**NO_CACHE, "X-Accel-Buffering": "no"},
    )


def add_fleet_routes(app: FastAPI, service: Callable[[], FleetSource]) -> Fleet:
    """Mount ``/ui`` (and its assets), ``/nodes`` and ``/events/stream`` on ``app``;
    ``service`` returns the running node. The returned :class:`Fleet` (also
    ``app.state.fleet``) ends the open event streams on ``close()``."""
    fleet = Fleet()
    app.state.fleet = fleet
    page = (UI_DIR / "index.html").read_bytes()
    assets = {name: (UI_DIR / name).read_bytes() for name in ASSETS}

    @app.get(
        "/ui",
        response_class=Response,
        responses={200: {"content": {"text/html": {}}, "description": "the fleet page"}},
        tags=["operators"],
    )
    async def ui() -> Response:
        """The fleet page: nodes, devices, live events, episode lookup (see README)."""
        headers = {**NO_CACHE, "Content-Security-Policy": CSP}
        return Response(page, media_type="text/html; charset=utf-8", headers=headers)

    def asset_route(name: str) -> None:
        async def asset() -> Response:
            return Response(assets[name], media_type=ASSETS[name], headers=NO_CACHE)

        app.add_api_route(f"/ui/{name}", asset, methods=["GET"], include_in_schema=False)

    for name in ASSETS:
        asset_route(name)

    @app.get(
        "/nodes",
        response_model=NodesOut,
        response_model_exclude_unset=True,  # a process's lag: absent (no sample) is not null
        responses={503: {"description": "Redis unreachable"}},
        tags=["operators"],
    )
    async def nodes() -> Any:
        """Every node in the registry, alive or lapsed, with its lease time left."""
        s = service()
        inventory = Inventory(s.registry.redis, s.registry.settings)
        listed = await inventory.nodes()  # BackendUnavailable: the app's one handler
        return {
            "node": s.node_id,
            "instance": s.instance,
            "nodes": [n.to_json() for n in listed],
        }

    @app.get(
        "/shadows",
        responses={503: {"description": "Redis unreachable"}},
        tags=["operators"],
    )
    async def shadows() -> Any:
        """Every shadow (``affinity shadow``) with the fleet's figures, as ``affinity shadow
        status --json`` gives them."""
        s = service()
        rows = await shadow_status(Shadows(s.registry.redis, s.registry.settings))
        return {"node": s.node_id, "shadows": rows}

    @app.get(
        "/events/stream",
        response_class=StreamingResponse,
        description=STREAM_DOC,
        responses={
            200: {
                "description": "an endless text/event-stream",
                "content": {"text/event-stream": {"example": SSE_EXAMPLE}},
            },
            400: {"description": "Last-Event-ID is not a stream id"},
            422: {"description": "backlog out of range"},
            503: {"description": "Redis unreachable, node shutting down, or too many streams"},
        },
        tags=["operators"],
    )
    async def events_stream(
        backlog: int = Query(50, ge=0, le=MAX_BACKLOG, description="events sent first"),
        last_event_id: str | None = Header(
            None, alias="Last-Event-ID", description="resume after this stream id"
        ),
        last_event_id_query: str | None = Query(
            None, alias="last_event_id", description="the same, for clients that cannot set it"
        ),
    ) -> Response:
        last_id = (last_event_id or last_event_id_query or "").strip()
        return await open_stream(fleet, service(), backlog, last_id)

    return fleet
