"""``affinity-node``'s process: listen, start, serve over uvicorn, stop gracefully, exit.

The listening sockets are bound before the node registers: a node that cannot serve must
never advertise itself. The first SIGTERM leaves the fleet while still listening; a second
one stops at once. Hazard: uvicorn's HTTP protocol is subclassed here (keep-alive, one
write per reply, the connection probe), so a uvicorn upgrade is checked against it.

Exit codes:

- 0 after a graceful stop (SIGTERM: episodes handed over, deregistered).
- 2 for a usage or configuration error. One line names the flag; every flag is checked
  before anything starts.
- 3 when Redis cannot be reached at start-up.
- 4 when another running process holds this node id.
- 5 when GPUs are found that CUDA cannot run.
- 6 when the node cannot listen on --host/--port or --grpc-port (checked before it
  registers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from affinity import BackendUnavailable, NodeConflict
from affinity.errors import SecretMismatch
from node.accesslog import JsonFormatter
from node.app import create_app
from node.cli import EXIT_USAGE, parse_args
from node.config import NodeConfig
from node.errors import GpuUnavailable
from node.fleet import Fleet
from node.forkserver import ForkServer
from node.fronts import Fronts, core_socket, fork_server
from node.httpproto import KeepAliveProtocol
from node.service import NodeService
from node.startup import StartupError, build_service

__all__ = [
    "EXIT_CONFLICT",
    "EXIT_LISTEN",
    "EXIT_NO_GPU",
    "EXIT_REDIS",
    "EXIT_USAGE",
    "StopBounds",
    "bind",
    "main",
    "stop_bounds",
]

log = logging.getLogger("affinity.node")
EXIT_REDIS = 3
"""Exit status when Redis cannot be reached at start-up."""
EXIT_CONFLICT = 4
"""Exit status when another process holds this node id (Redis names it as the holder)."""
EXIT_NO_GPU = 5
"""Exit status when --devices names GPUs (or auto finds some) that CUDA cannot run."""
EXIT_LISTEN = 6
"""Exit status when the node cannot listen on --host/--port (it has not registered)."""
GRPC_STOP_GRACE_S = 1.0
"""Seconds gRPC's stop leaves its running calls, after the HTTP server closed."""


@dataclass(frozen=True)
class StopBounds:
    """The most each stage of a graceful stop takes, in seconds, in the order they run."""

    drain_s: float
    """Handing the episodes over (``--drain-timeout``), before deregistering."""
    http_close_s: int
    """uvicorn's ``timeout_graceful_shutdown``: open requests finish, then it closes."""
    grpc_stop_s: float
    """gRPC's stop grace (0 when gRPC is not served)."""


def stop_bounds(config: NodeConfig) -> StopBounds:
    """The bounds of a graceful stop of a node configured as ``config``."""
    return StopBounds(
        drain_s=config.drain_timeout_s,
        http_close_s=int(config.act_deadline_s) + 5,
        grpc_stop_s=GRPC_STOP_GRACE_S if config.grpc_port is not None else 0.0,
    )


class _Server(uvicorn.Server):
    """uvicorn's server with the node's graceful stop. The first SIGTERM/SIGINT makes the
    node leave the fleet while it still listens: episodes handed over, deregistered, no
    more renewals. Then uvicorn closes the listener and drains. A second one forces."""

    def __init__(self, config: uvicorn.Config, service: NodeService, fleet: Fleet) -> None:
        super().__init__(config)
        self.service = service
        self.fleet = fleet
        self.leave_requested = False
        self.leaving: asyncio.Task[None] | None = None
        self.fronts: Fronts | None = None
        """The front door processes (``--front-doors`` > 1): stopped before this server."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.leave_requested or self.should_exit:
            self.fleet.close()  # a graceful stop waits for open responses: streams never end
            super().handle_exit(sig, frame)
        else:
            self.leave_requested = True  # picked up by on_tick, on the event loop

    async def on_tick(self, counter: int) -> bool:
        if self.leave_requested and self.leaving is None:
            log.info("node %s leaving the fleet (signal)", self.service.node_id)
            self.leaving = asyncio.create_task(self.service.owner.leave())
        if self.leaving is not None and self.leaving.done():
            self.should_exit = True
        if self.service.lease.conflict is not None:
            self.should_exit = True
        if self.should_exit:
            self.fleet.close()  # a graceful stop waits for open responses: streams never end
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.fronts is not None:  # they finish their requests, served by this process
            grace = self.config.timeout_graceful_shutdown or 0
            await self.fronts.stop(0 if self.force_exit else grace)
        await super().shutdown(sockets)


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The node's listening socket, bound (not yet listening) before anything registers:
    a node that could not serve must never advertise itself. ``reuse_port``: one of the
    fronts' sockets (``SO_REUSEPORT``). Raises ``OSError``."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


async def _serve(config: NodeConfig, held: _HeldLines | None = None) -> int:
    ports = {"--host/--port": config.port}
    if config.grpc_port is not None:
        ports["--grpc-port"] = config.grpc_port
    socks: list[socket.socket] = []
    fronts: list[socket.socket] = []
    for flag, port in ports.items():
        try:
            socks.append(bind(config.host, port))
            if flag == "--host/--port" and config.front_doors > 1:
                fronts = front_sockets(config.host, port, config.front_doors, socks.pop())
                socks.append(fronts[0])
            elif config.front_doors > 1:  # --grpc-port: held for the fronts' listeners
                socks.extend(front_sockets(config.host, port, 1, socks.pop()))
        except OSError as exc:
            for sock in socks + fronts:
                sock.close()
            print(f"affinity-node: cannot listen on {config.host}:{port} ({flag}): "
                  f"{exc.strerror or exc}", file=sys.stderr)  # fmt: skip
            return EXIT_LISTEN
    with socks[0]:
        grpc_sock = socks[1] if len(socks) > 1 else None
        try:
            return await _serve_on(config, socks[0], grpc_sock, held, fronts)
        finally:
            for sock in fronts:
                sock.close()


def front_sockets(host: str, port: int, count: int, probe: socket.socket) -> list[socket.socket]:
    """``count`` sockets bound to ``host:port`` with ``SO_REUSEPORT``, one a front: the
    kernel spreads new connections over them evenly (one socket shared by all fronts gave
    every connection of a burst to the front that woke first). ``probe`` holds the port
    exclusively until they are bound, so a port another process listens on (with or
    without ``SO_REUSEPORT``) is refused as it is without fronts; a socket of a front that
    died stays open here, its queued connections kept for the front that replaces it."""
    with probe:
        probe.close()
        socks: list[socket.socket] = []
        try:
            for _ in range(count):
                socks.append(bind(host, port, reuse_port=True))
        except OSError:
            for sock in socks:
                sock.close()
            raise
    return socks


async def _register(config: NodeConfig, service: NodeService) -> int | None:
    """Start the service (register, lease); None, or the exit code with its one line said."""
    try:
        await service.start()
    except BackendUnavailable as exc:
        print(
            f"affinity-node: cannot reach Redis at {_safe_url(config)} (--redis): {exc}",
            file=sys.stderr,
        )
        await service.stop()
        return EXIT_REDIS
    except NodeConflict as exc:
        print(f"affinity-node: {exc}", file=sys.stderr)
        await service.stop()
        return EXIT_CONFLICT
    except SecretMismatch as exc:
        print(f"affinity-node: {exc}", file=sys.stderr)
        await service.stop()
        return EXIT_USAGE
    return None


async def _serve_on(
    config: NodeConfig,
    sock: socket.socket,
    grpc_sock: socket.socket | None = None,
    held: _HeldLines | None = None,
    fronts: list[socket.socket] | None = None,
) -> int:
    """Start the node on ``sock`` (bound) and serve until it stops; ``grpc_sock`` holds
    ``--grpc-port`` (bound, exclusively) until gRPC's own listener takes it over. With
    fronts, ``grpc_sock`` (``SO_REUSEPORT``) holds it for the node's life: the fronts
    listen on it beside it, and the core serves gRPC on an abstract Unix name. The
    fronts' fork server is started first: its imports run while the node starts."""
    forks = None
    if fronts:
        forks = fork_server(grpc_sock is not None)
        forks.start()
    try:
        started = await _start(config, grpc_sock, held, bool(fronts))
    except BaseException:
        if forks is not None:
            forks.close()
            await asyncio.to_thread(forks.reap)
        raise
    finally:
        if grpc_sock is not None and not fronts:
            grpc_sock.close()  # gRPC's own listener has the port now (or nothing does)
    if isinstance(started, int):
        if grpc_sock is not None:
            grpc_sock.close()
        if forks is not None:
            forks.close()
            await asyncio.to_thread(forks.reap)
        return started
    service, grpc_server, grpc_core = started
    if held is not None:
        held.serving()  # it serves: the lines held since it started are written now
    bounds = stop_bounds(config)
    server = _http_server(config, service, bounds)
    try:
        if fronts:
            await _serve_fronts(config, service, server, fronts, bounds, grpc_core, forks)
        else:
            await server.serve(sockets=[sock])
    finally:
        if grpc_server is not None:
            await grpc_server.stop(bounds.grpc_stop_s)
        if grpc_sock is not None and fronts:
            grpc_sock.close()
    return EXIT_CONFLICT if service.lease.conflict is not None else 0


async def _serve_fronts(
    config: NodeConfig, service: NodeService, server: _Server, socks: list[socket.socket],
    bounds: StopBounds, grpc_core: str | None = None, forks: ForkServer | None = None,
) -> None:  # fmt: skip
    """Serve with ``--front-doors`` processes, front k accepting on ``socks[k]``
    (node/fronts.py), and on ``--grpc-port`` if any (passing what it does not decode to
    ``grpc_core``, this process's gRPC server); this process serves their steps over the
    hop, and its app on a Unix socket for the rest."""
    for sock in socks:
        sock.listen(2048)
    core, name = core_socket()
    spec = {
        "api_key": config.api_key,
        "max_body_bytes": config.max_body_bytes,
        "max_rows": config.max_rows,
        "keep_alive_s": config.keep_alive_s,
        "close_s": bounds.http_close_s,
        "slot_wait_s": config.act_deadline_s,  # a step past the hop's slots waits its turn
        "access_log": config.access_log,
        "log_format": config.log_format,
        "log_level": config.log_level,
    }
    if grpc_core is not None:
        spec.update(host=config.host, grpc_port=config.grpc_port, grpc_core=grpc_core,
                    grpc_stop_s=bounds.grpc_stop_s)  # fmt: skip
    fronts = Fronts(service, socks, name, spec, forks)
    # openpi's websocket is the fronts' (each step over the hop): none reaches this socket
    server.config.ws = "none"
    server.fronts = fronts
    await fronts.start()
    with core:
        await server.serve(sockets=[core])


async def _start(
    config: NodeConfig,
    grpc_sock: socket.socket | None,
    held: _HeldLines | None,
    fronted: bool = False,
) -> tuple[NodeService, Any, str | None] | int:
    """The node built, gRPC listening (with ``grpc_sock``) and registered; or the exit
    code, its one line said and everything started stopped again. ``fronted`` (front door
    processes): gRPC listens on an abstract Unix name instead (returned), for the calls the
    fronts pass on; ``grpc_sock`` stays the fronts' reservation of the port."""
    try:
        service = await build_service(config)()
    except StartupError as exc:
        print(f"affinity-node: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except GpuUnavailable as exc:
        print(f"affinity-node: {exc}", file=sys.stderr)
        return EXIT_NO_GPU
    grpc_server = None
    grpc_core: str | None = None
    if grpc_sock is not None:  # bound before registering, like the HTTP listener
        from node.protocols.kserve import grpc  # grpcio loads only where gRPC is served

        assert config.grpc_port is not None
        if fronted:
            grpc_core = f"affinity-grpc-{os.getpid()}-{secrets.token_hex(4)}"
        else:
            # gRPC binds its own listener (without SO_REUSEPORT: grpc.so_reuseport 0); the
            # port was held exclusively until here, and is handed over now
            grpc_sock.close()
        try:
            grpc_server = await grpc.start(service, config.host, config.grpc_port, grpc_core)
        except RuntimeError as exc:
            print(f"affinity-node: cannot listen on {config.host}:{config.grpc_port} "
                  f"(--grpc-port): {exc}", file=sys.stderr)  # fmt: skip
            await service.stop()
            return EXIT_LISTEN
    if held is not None:
        held.registering()
    code = await _register(config, service)
    if code is not None:
        if grpc_server is not None:
            await grpc_server.stop(0)
        return code
    return service, grpc_server, grpc_core


def _http_server(config: NodeConfig, service: NodeService, bounds: StopBounds) -> _Server:
    """uvicorn serving the node's app for the started ``service``."""

    async def started() -> NodeService:
        return service

    app = create_app(
        started,
        access_log=config.access_log,
        log_json=config.log_format == "json",
        freeze_gc=True,
    )
    return _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            http=KeepAliveProtocol,
            ws="websockets-sansio",
            ws_max_size=config.max_body_bytes,
            log_level="warning",
            access_log=False,  # node/accesslog.py writes the node's own, with the step's facts
            proxy_headers=False,
            server_header=False,
            timeout_keep_alive=max(1, round(config.keep_alive_s)),
            timeout_graceful_shutdown=bounds.http_close_s,
            lifespan="on",
        ),
        service,
        app.state.fleet,
    )


def _safe_url(config: NodeConfig) -> str:
    url = config.settings.redis_url or "the embedded store"
    return re.sub(r"//[^@/]*@", "//***@", url)


class _HeldLines(logging.Handler):
    """The node's log handler while it starts. What it says before it serves is held, and
    written once it serves (:meth:`serving`). A node that cannot start prints its one
    error line and nothing else. While it builds its sessions every line below ERROR is
    held. Once it registers (:meth:`registering`), warnings go out at once. So a wait for
    another process's lease on the node id says so while it waits."""

    def __init__(self, target: logging.Handler) -> None:
        super().__init__()
        self.target = target
        self.below = logging.ERROR  # records below this level are held
        self.held: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < self.below:
            self.held.append(record)
        else:
            self.target.handle(record)

    def registering(self) -> None:
        self.below = logging.WARNING

    def serving(self) -> None:
        """Write the held lines, and every line from now on."""
        self.below = logging.NOTSET
        held, self.held = self.held, []
        for record in held:
            self.target.handle(record)


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if config.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    held = _HeldLines(handler)
    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.INFO),
                        handlers=[held])  # fmt: skip
    import uvloop

    code = uvloop.run(_serve(config, held))
    # a graceful stop on a signal ends the way the signal would (uvicorn re-raises it)
    sys.exit(code)


if __name__ == "__main__":
    main()
