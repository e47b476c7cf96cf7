"""The node's front doors in several processes (``--front-doors N``, issue 43): the core's
side. The core is the node's process as it always was (router, owner, episode table, lease,
devices); with N > 1 it does not accept on the HTTP port itself. It spawns N fronts
(``node/front.py``) that share its listening socket, serves each front's ``/act`` steps over
the shared-memory hop (``node/hop.py``), and serves its whole app on a Unix socket (an
abstract name: no file) for every other path the fronts pass on.

The supervisor (:class:`Fronts`) restarts a front that died (backoff 0.1 s doubling to 5 s,
logged, counted in ``affinity_front_restarts_total``), each time with a fresh region. Each
front is forked by the node's fork server (``node/forkserver.py``: its imports shared, a
front serving milliseconds after its fork), the core's child; each dies with its parent
(``PR_SET_PDEATHSIG`` = SIGKILL): a node killed with ``kill -9`` takes its server and
fronts with it, and the next start binds the same ports at once. On
a graceful stop the fronts keep serving while the episodes are handed over, then they stop
(SIGUSR1: they close their listener and finish what they started), then the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from affinity import InvalidArgument
from affinity.registry import FORK_SERVER_ROLE
from node.errors import (
    BodyError,
    ForkServerStarting,
    HopError,
    InvalidInput,
    Outcome,
    Refused,
    StaleCheck,
    Unavailable,
    outcome,
)
from node.forkserver import Forked, ForkServer
from node.hop import (
    ACT,
    KSERVE,
    NEVER_NS,
    NOTE,
    ROWS,
    WS_CLOSE,
    WS_OPEN,
    WS_STEP,
    Array,
    CoreHop,
    Region,
    SharedLoopBuckets,
    contiguous,
    lift,
    lower,
)
from node.inputs import Checked, checked_of, taught
from node.metrics import REJECTED
from node.procs import NO_LAG, Running
from node.protocols import act, openpi
from node.protocols.kserve import http as kserve_http
from node.protocols.openpiframe import refusal
from node.service import NodeService
from node.step import Reply

__all__ = ["MAX_FRONT_DOORS", "Fronts", "core_socket", "fork_server", "serve_request"]

log = logging.getLogger("affinity.node")

MAX_FRONT_DOORS = 64
SLOTS = 32
"""Steps one front may have in flight over the hop; one more is refused 503 ``busy``."""
SLOT_HEADROOM = 1 << 16
"""Bytes a slot has beyond ``--max-body-bytes`` (a step's inputs are never larger than its
body, nor a reply than a slot: one that is is answered 500)."""
SECRETS = frozenset(("AFFINITY_CLUSTER_SECRET", "AFFINITY_ADMIN_TOKEN", "AFFINITY_API_KEY"))
"""Variables a front is started without: it checks no secret but the API key (in its spec)."""
BACKOFF_S = (0.1, 5.0)
"""A front that died is restarted after the first, doubling up to the second."""
STOP_S = 10.0
"""Seconds the fronts get to finish their requests after SIGUSR1, before SIGKILL."""
MIN_HANG_S = 2.0
"""The least ``--front-hang-timeout`` taken (a lower one is raised to it): a healthy loop
can stop for a few hundred milliseconds (a collection, a large body's decode)."""
START_HANG_S = 60.0
"""How long a front that has not yet sampled its loop (imports, start-up) may take before
the hang watch kills it, whatever a shorter ``--front-hang-timeout`` says."""
SERVER_STARTS = 3
"""How many times the node's start starts a fork server again that died before it forked
every front (then the node's start fails)."""
LOOK_S = 0.25
"""The most stillness one look of the hang watch counts (it looks every 50 ms): a late
look, the core itself paused or slow, never counts what it missed against a front."""


def core_socket() -> tuple[socket.socket, str]:
    """The core's Unix socket for the paths the fronts pass on, bound (abstract: no file,
    gone with the process), and its name."""
    name = f"\0affinity-core-{os.getpid()}-{secrets.token_hex(4)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(name)
    return sock, name


# ---- one request over the hop ---------------------------------------------------------------


def _feed(row: dict[str, Any], arrays: list[Array], at: int) -> tuple[dict[str, Any], int]:
    """A row's body as ``act`` decodes it: its fields and its inputs, tensors taken from
    ``arrays`` from ``at`` on; and the next ``at``."""
    doc = row.get("doc")
    if not isinstance(doc, dict):
        raise HopError("a row has no fields")
    doc = dict(doc)
    if "raw" in row:
        doc["inputs"] = row["raw"]
    elif "in" in row:
        feed: dict[Any, Any] = {}
        for entry in row["in"]:
            if not isinstance(entry, list) or not entry:
                raise HopError("bad input entry")
            if entry[0] == "n" and len(entry) == 2:
                if at >= len(arrays):
                    raise HopError("fewer tensors than inputs")
                feed[entry[1]] = arrays[at]
                at += 1
            elif entry[0] == "v" and len(entry) == 3:
                feed[entry[1]] = entry[2]
            else:
                raise HopError("bad input entry")
        doc["inputs"] = feed
    return doc, at


def _error(exc: BaseException) -> dict[str, Any]:
    return _err(outcome(exc))


def _err(o: Outcome) -> dict[str, Any]:
    """A refusal as the hop carries it (``node/front.py``'s ``_outcome`` reads it back)."""
    return {"err": [o.status, o.code, o.message, o.field, o.retry_after]}


def _refused(service: NodeService, exc: BaseException) -> dict[str, Any]:
    """The reply's meta of a refused step, counted as ``act`` counts it."""
    _count(service, exc)
    return _error(exc)


def _count(service: NodeService, exc: BaseException) -> None:
    reason = outcome(exc).reject_reason
    if reason is not None:
        service.metrics.rejected.labels(reason).inc()


def _reply_meta(reply: Reply, timing: bool) -> tuple[dict[str, Any], list[Array]]:
    facts = reply.facts()
    if timing:
        facts["timing"] = reply.split()
    names = list(reply.outputs)
    out: list[Array] = []
    strings: dict[str, Any] = {}
    for name in names:
        value = np.asarray(reply.outputs[name])
        if value.dtype.hasobject:  # a string output: by value in the header (hop.lift)
            strings[name] = lift(value, [])
        else:
            out.append(contiguous(value))
    meta: dict[str, Any] = {"facts": facts, "names": names}
    if strings:
        meta["x"] = strings
    return meta, out


Connections = dict[int, openpi.Connection]
"""A front's open openpi connections in the core, by the front's number for each."""


async def serve_openpi(
    service: NodeService,
    kind: int,
    meta: dict[str, Any],
    arrays: list[Array],
    conns: Connections,
) -> tuple[dict[str, Any], list[Array]]:
    """One openpi request of a front, which holds the websocket and decodes and encodes
    its frames: a connection opened (the reply: its metadata frame, or its error), one
    observation served by the connection's :class:`~node.protocols.openpi.Connection`
    (the reply: outputs and facts with their arrays raw, or openpi's error text,
    counted), the connection closed (its own episode ends)."""
    number = meta.get("c")
    if type(number) is not int:
        raise HopError("no connection number")
    if kind == WS_OPEN:
        query = meta.get("q")
        if not isinstance(query, bytes) or number in conns:
            raise HopError("bad connection")
        try:
            conn, frame, problem = await openpi.opening(service, query)
        except Exception as exc:  # Redis gone while it picks the model, say
            return _err(openpi.open_failed(exc)), []  # answered before the upgrade
        if conn is None:
            return {"frame": frame, "problem": problem}, []
        conns[number] = conn
        check = conn.contract.input_check  # (the front checks each frame's inputs with it)
        return {"frame": frame, "problem": None, "fixed": conn.fixed, "own": conn.own,
                "chk": None if check is None else list(check)}, []  # fmt: skip
    conn = conns.get(number)
    if conn is None:
        raise HopError(f"no connection {number}")
    if kind == WS_CLOSE:
        del conns[number]
        await conn.close()
        return {}, []
    received = meta.get("recv")
    if not isinstance(received, float):
        raise HopError("no receive time")
    observation = lower(meta.get("o"), arrays)
    if not isinstance(observation, dict):
        raise HopError("an observation is a map")
    checked = None
    if meta.get("ok") is True:  # its inputs checked and converted by the front
        key, given, ignored = meta.get("ck"), lower(meta.get("in"), arrays), meta.get("ig")
        if not (isinstance(key, str) and isinstance(given, dict) and isinstance(ignored, list)):
            raise HopError("a checked observation without its key, inputs or ignored keys")
        checked = openpi.FrontChecked(key, given, tuple(map(str, ignored)))
    try:
        served = await conn.step(observation, received, openpi.unwatched, checked)
    except openpi.REFUSALS as exc:
        o = outcome(exc)
        _count(service, exc)
        return {"fail": refusal(o), "status": o.status, "ep": conn.episode}, []
    out: list[Array] = []
    try:
        doc = lift(served.doc, out)
    except HopError as exc:  # an output the hop cannot carry: as one too big, undone
        await undeliver(service, served.replies)
        return {"fail": f"internal: {exc}", "status": 500, "ep": conn.episode}, []
    reply = {
        "doc": doc,
        "rows": served.rows,
        "ep": conn.episode,
        "at": served.served,
        "ms": served.device_ms,
        "split": served.split,
        "keep": served.replies,
    }
    return reply, out


async def serve_request(
    service: NodeService,
    kind: int,
    meta: dict[str, Any],
    arrays: list[Array],
    slot: int,
    conns: Connections | None = None,
) -> tuple[dict[str, Any], list[Array]]:
    """Serve one request a front sent over the hop, as ``node/protocols/act.py`` serves a
    body it decoded itself: the same decoding of fields and inputs, the router's path, the
    same errors and counts (openpi's requests: :func:`serve_openpi`, with the front's
    ``conns``). The reply's meta carries ``keep``: what to undo if the front says it was
    not delivered."""
    metrics = service.metrics
    if kind == NOTE:
        reason = meta.get("rejected")
        if isinstance(reason, str) and reason in REJECTED:
            metrics.rejected.labels(reason).inc()
        return {}, []
    if kind == KSERVE:  # decoded by the front as node/protocols/kserve/http.py would
        return await kserve_http.serve_hop(service, meta, arrays)
    if kind in (WS_OPEN, WS_STEP, WS_CLOSE):
        if conns is None:
            raise HopError("no openpi connections here")
        return await serve_openpi(service, kind, meta, arrays, conns)
    received = meta.get("recv")
    if not isinstance(received, float):
        raise HopError("no receive time")
    timing = bool(meta.get("timing"))
    listed = meta.get("j") is True  # a JSON body: its tensors were lists
    deadline = received + service.config.act_deadline_s
    if kind == ACT:
        checked = checked_of(meta)
        try:
            doc, _ = _feed(meta, arrays, 0)
            step = await act.decode_doc(service, doc, True, deadline, listed=listed,
                                        checked=checked)  # fmt: skip
            step.received, step.timing = received, timing
            reply = await service.router.act(step)
        except StaleCheck:
            return taught({"recheck": True}, [checked]), []
        except (BodyError, InvalidInput, InvalidArgument, Unavailable, Refused) as exc:
            return taught(_refused(service, exc), [checked]), []
        try:
            done, out = _reply_meta(reply, timing)
        except HopError as exc:  # an output the hop cannot carry: as one too big, undone
            await service.router.undelivered(reply)
            return {"err": [500, "internal", str(exc), None, None]}, []
        done["url"] = reply.url
        done["keep"] = reply
        return taught(done, [checked]), out
    if kind != ROWS:
        raise HopError(f"unknown request kind {kind}")
    if "bad" in meta:  # a message of rows whose shape is wrong: act says how
        try:
            await act.decode_rows(service, meta["bad"], True, deadline)
        except (BodyError, InvalidInput, InvalidArgument, Unavailable, Refused) as exc:
            return _refused(service, exc), []
        raise HopError("a malformed message of rows decoded")
    rows: list[Any] = []
    checks: list[Checked | None] = []
    at = 0
    for row in meta.get("rows", []):
        if isinstance(row, dict) and "row" in row:
            rows.append(row["row"])  # not a map: decode_rows says so
            checks.append(None)
        elif isinstance(row, dict):
            doc, at = _feed(row, arrays, at)
            rows.append(doc)
            checks.append(checked_of(row))
        else:
            raise HopError("bad row")
    try:
        decoded = await act.decode_rows(service, {"steps": rows}, True, deadline,
                                        listed=listed, checks=checks)  # fmt: skip
    except StaleCheck:
        return taught({"recheck": True}, checks), []
    except (BodyError, InvalidInput, InvalidArgument, Unavailable, Refused) as exc:
        return taught(_refused(service, exc), checks), []
    steps, where, refused = act.split_rows(service, decoded, received, timing)
    served: list[Reply | Exception | None] = [None] * len(steps)
    await service.router.act_rows(steps, served)
    results = act.joined_rows(refused, where, served)
    metas: list[dict[str, Any]] = []
    outs: list[Array] = []
    keep = [r for r in results if isinstance(r, Reply)]
    try:
        for result in results:
            if isinstance(result, Reply):
                row_meta, row_out = _reply_meta(result, timing)
                metas.append(row_meta)
                outs.extend(row_out)
            else:
                metas.append(act.encode_row(result))
    except HopError as exc:  # an output the hop cannot carry: as one too big, all undone
        await undeliver(service, keep)
        return {"err": [500, "internal", str(exc), None, None]}, []
    return taught({"rows": metas, "keep": keep}, checks), outs


async def undeliver(service: NodeService, kept: Any, doubt: bool = False) -> None:
    """Undo what a front could not deliver (its client had gone), or may not have
    (``doubt``: it died handing it over). A message of rows undoes the rows served here
    first, before its first wait: a retry the core serves next finds them undone (a row
    forwarded to another node is undone by a request to it, which no order here binds)."""
    replies = [r for r in (kept if isinstance(kept, list) else [kept]) if isinstance(r, Reply)]
    for reply in sorted(replies, key=lambda r: bool(r.origin)):
        await service.router.undelivered(reply, doubt)


def lighten(kept: Any) -> Any:
    """What the core holds of a kept step while its reply is parked with a slow client
    (``CoreHop.lighten``): its reply without the outputs, which an undo never reads."""
    if isinstance(kept, list):
        return [lighten(reply) for reply in kept]
    return replace(kept, outputs={}) if isinstance(kept, Reply) else kept


# ---- the supervisor -------------------------------------------------------------------------


@dataclass
class _Front:
    index: int
    process: Forked | None = None
    hop: CoreHop | None = None
    lag: SharedLoopBuckets | None = None
    restarts: int = 0  # in a row (the backoff's): 0 again once it ran a while
    restarted: int = 0  # since the core started (what operators see: node/procs.py)
    started: float = 0.0
    since_ms: int = 0  # when it started, the wall clock's ms
    conns: Connections = field(default_factory=dict)
    beat: int = -1  # its loop's lag samples when last seen to change (the hang watch)
    still: float = 0.0  # seconds its samples have not moved since (each look's share capped)
    refused: int = 0  # steps its region says the front refused itself, counted here so far
    spawning: bool = False  # its fork asked of the fork server, not yet answered


def fork_server(grpc: bool) -> ForkServer:
    """The fronts' fork server, not started: the node's environment without its secrets
    (a front needs none: the API key it checks is in its settings, sent with each ask)."""
    return ForkServer({k: v for k, v in os.environ.items() if k not in SECRETS}, grpc)


class Fronts:
    """A front process per socket of ``listeners`` (bound with ``SO_REUSEPORT``, listening,
    kept open here across a front's restarts), their hops served by the core's event loop,
    each restarted when it dies, stopped by :meth:`stop`."""

    def __init__(
        self,
        service: NodeService,
        listeners: list[socket.socket],
        core_name: str,
        spec: dict[str, Any],
        forks: ForkServer | None = None,
    ) -> None:
        self.service = service
        self.listeners = listeners
        self.core_name = core_name
        self.spec = spec
        self.slot_size = int(spec["max_body_bytes"]) + SLOT_HEADROOM
        self.fronts = [_Front(k) for k in range(len(listeners))]
        self.stopping = False
        self._watch: asyncio.Task[None] | None = None
        self._ending: set[asyncio.Task[None]] = set()
        metrics = service.metrics
        self.restarts = metrics.front_restarts
        self.parked = metrics.replies_parked
        self.routing = metrics.routing
        metrics.before_read(self._parked)
        self.bounds = metrics.loop_lag.bounds
        hang_s = service.config.front_hang_s
        self.hang_s = 0.0 if hang_s <= 0 else max(hang_s, MIN_HANG_S)
        self._looked = time.monotonic()  # the hang watch's last look
        # what forks each front (node/forkserver.py): started early by the node, or here
        self.forks = forks or fork_server(spec.get("grpc_port") is not None)

    def _parked(self) -> None:
        """Each front's tickets in use, into ``affinity_front_replies_parked`` (at a scrape)."""
        for front in self.fronts:
            hop, parked = front.hop, 0
            if hop is not None and hop.alive:
                with contextlib.suppress(ValueError):  # (its region closed as it died)
                    parked = hop.region.parked()
            self.parked.labels(str(front.index)).set(parked)

    async def start(self) -> None:
        """Start the fork server (unless the node did), wait for its imports, fork every
        front. A server that died meanwhile (it was started before the node's own start,
        which may take minutes) is started again, up to :data:`SERVER_STARTS` times, within
        :data:`START_HANG_S` in all."""
        try:
            if self.forks.process is None:
                self.forks.start()
            deadline, starts = time.monotonic() + START_HANG_S, SERVER_STARTS
            for front in self.fronts:
                while True:
                    left = max(0.0, deadline - time.monotonic())
                    if not await self.forks.wait_ready(left) and self.forks.alive():
                        raise OSError(
                            f"the front fork server was not ready in {START_HANG_S:.0f} s"
                        )
                    try:  # (a server found dead is started again: ForkServerStarting)
                        await self._spawn(front)
                        break
                    except ForkServerStarting:
                        starts -= 1
                        if starts < 0:
                            raise OSError(
                                "the front fork server died each time it started"
                            ) from None
        except BaseException:  # (the node exits: nothing it started is left running)
            self.stopping = True
            for front in self.fronts:
                self._drop(front)
            self.forks.close()
            await asyncio.to_thread(self.forks.reap)
            raise
        self._watch = asyncio.create_task(self._supervise(), name="affinity-fronts")
        self.service.processes.watch(self)  # published at each renewal from now on
        self.service.lease.renew_soon()  # the registration had none of them running yet

    def running(self) -> list[Running]:
        """Each front running now: index, pid, start, restarts, its lag histogram."""
        return [
            Running(str(f.index), f.process.pid, f.since_ms, f.restarted, f.lag)
            for f in self.fronts
            if f.process is not None and f.lag is not None
        ]

    def helpers(self) -> list[Running]:
        """The fork server, while it runs (its restarts: its starts after the first)."""
        forks, process = self.forks, self.forks.process  # (read once: a stop's reap, in
        if process is None or process.poll() is not None:  # a thread, sets it to None)
            return []
        return [Running(FORK_SERVER_ROLE, process.pid, forks.since_ms, forks.restarts, NO_LAG)]

    def pids(self) -> list[int]:
        return [f.process.pid for f in self.fronts if f.process is not None]

    async def _spawn(self, front: _Front) -> None:
        region = Region.create(SLOTS, self.slot_size)
        made: list[int] = []  # (no descriptor left midway: what was made is closed)
        try:
            made.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
            made.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
        except BaseException:
            for fd in made:
                os.close(fd)
            region.close()
            raise
        ask, answer = made
        service = self.service
        conns: Connections = {}
        front.conns = conns

        async def handler(
            kind: int, meta: dict[str, Any], arrays: list[Array], slot: int
        ) -> tuple[dict[str, Any], list[Array]]:
            return await serve_request(service, kind, meta, arrays, slot, conns)

        async def undelivered(kept: Any) -> None:
            await undeliver(service, kept)

        async def doubted(kept: Any) -> None:
            await undeliver(service, kept, doubt=True)

        hop = CoreHop(region, ask, answer, handler, undelivered, doubted, lighten)
        listener = self.listeners[front.index]
        fds = (listener.fileno(), region.fd, ask, answer)
        try:
            core = self.core_name.encode().hex()
            process = await self.forks.spawn(front.index, core, fds, self.spec)
            if self.stopping:  # (the node began to stop meanwhile: it serves nothing)
                process.kill()
                raise ForkServerStarting("the node is stopping")
        except BaseException:  # (no fork: memory, file descriptors) nothing of it is left
            for fd in (ask, answer):
                os.close(fd)
            region.close()
            raise
        front.process = process
        hop.start()  # (a ring before this waits in the eventfd)
        front.hop = hop
        front.refused = 0  # (a fresh region)
        front.started = time.monotonic()
        front.beat, front.still = -1, 0.0  # (its imports and start: START_HANG_S)
        front.since_ms = int(time.time() * 1000)
        if front.lag is None:
            front.lag = SharedLoopBuckets(region.mm, self.bounds)
            self.service.metrics.loop_lag.attach((str(front.index),), front.lag)
        else:
            front.lag.mm = region.mm
        log.info("front %d started (pid %d)", front.index, front.process.pid)

    def _tell(self) -> None:
        """Tell every front that this loop runs and until when the lease lets the node
        serve (``Region.tell``: a front refuses steps itself only when neither is current),
        count the steps a front so refused while this loop did not run, and let go of the
        replies its tickets handed over (``CoreHop.forget_handed``)."""
        until = self.service.lease.serves_until_ns()
        now = time.monotonic_ns()
        for front in self.fronts:
            if front.hop is None:
                continue
            region = front.hop.region
            region.tell(now, NEVER_NS if until is None else until)
            front.hop.forget_handed()
            refused = region.refused()
            if refused > front.refused:  # answered 503 (fenced, busy, deadline) by the front
                self.routing.labels("unavailable").inc(refused - front.refused)
                front.refused = refused

    async def _supervise(self) -> None:
        while not self.stopping:
            await asyncio.sleep(0.05)
            try:
                self._tell()
            except Exception:  # never the end of the supervision (a front's restarts)
                log.exception("telling the fronts the lease failed")
            try:
                self._watch_hangs()
            except Exception:  # never the end of the supervision
                log.exception("watching the fronts' event loops failed")
            for front in self.fronts:
                process = front.process
                if process is None or process.poll() is None or self.stopping:
                    continue
                self._drop(front)
                front.restarted += 1
                self.restarts.inc()
                if time.monotonic() - front.started > 10 * BACKOFF_S[1]:
                    front.restarts = 0  # it ran a while: no backoff from earlier deaths
                backoff = self._backoff(front)
                log.warning("front %d (pid %d) exited with %s; restarting in %.1f s",
                            front.index, process.pid, process.returncode, backoff)  # fmt: skip
                front.process = None
                asyncio.get_running_loop().call_later(backoff, self._respawn, front)

    def _watch_hangs(self) -> None:
        """Kill a front whose event loop has not run for ``--front-hang-timeout`` (paused,
        or blocked by a bug): the kernel still queues new connections on its socket, and
        nobody would answer them. Its death is then handled as any (its steps undone, in
        doubt or held as its slots and tickets say) and it is restarted; the connections
        queued on its socket wait for the new one. Its loop's lag samples (50 a second)
        say it runs. Each look counts at most :data:`LOOK_S` of stillness, so a look of
        this loop's own that came late (the core paused or blocked, the node frozen as a
        whole) does not count the time it missed against anyone. A front that has not
        sampled yet (its imports, its start) has :data:`START_HANG_S` at least."""
        now = time.monotonic()
        elapsed, self._looked = now - self._looked, now
        if self.hang_s <= 0 or self.stopping:
            return
        for front in self.fronts:
            process, lag = front.process, front.lag
            if process is None or lag is None or process.poll() is not None:
                continue
            beat = lag.samples()
            if beat != front.beat:
                front.beat, front.still = beat, 0.0
                continue
            front.still += min(elapsed, LOOK_S)
            limit = self.hang_s if beat > 0 else max(self.hang_s, START_HANG_S)
            if front.still > limit:
                log.warning("front %d (pid %d): its event loop has not run for %.0f s; "
                            "killing it (--front-hang-timeout)", front.index, process.pid,
                            front.still)  # fmt: skip
                process.kill()
                front.still = 0.0  # (its death is seen at the next look)

    @staticmethod
    def _backoff(front: _Front) -> float:
        """The wait before ``front``'s next start, doubling with its restarts in a row."""
        front.restarts += 1
        return float(min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** min(front.restarts - 1, 6)))

    def _respawn(self, front: _Front) -> None:
        if self.stopping or front.process is not None or front.spawning:
            return
        front.spawning = True
        task = asyncio.create_task(self._respawning(front), name=f"affinity-front-{front.index}")
        self._ending.add(task)  # (a stop waits for it)
        task.add_done_callback(self._ending.discard)

    async def _respawning(self, front: _Front) -> None:
        try:
            await self._spawn(front)
        except ForkServerStarting:  # its fork server died, and is starting again: forked as
            # soon as it is ready, its backoff left as it was (the server's start is no
            # failure of the front's); one that does not get ready backs off as a failure
            ready = await self.forks.wait_ready(START_HANG_S)
            if not self.stopping:
                wait = 0.0 if ready else self._backoff(front)
                asyncio.get_running_loop().call_later(wait, self._respawn, front)
        except Exception as exc:  # tried again: a front index never stays without a process
            if self.stopping:  # (its server closed by the stop: nothing to start again)
                return
            backoff = self._backoff(front)
            log.error("front %d could not be started (%s: %s); trying again in %.1f s",
                      front.index, type(exc).__name__, exc, backoff)  # fmt: skip
            asyncio.get_running_loop().call_later(backoff, self._respawn, front)
        finally:
            front.spawning = False

    def _drop(self, front: _Front) -> None:
        if front.lag is not None:
            front.lag.detach()
        if front.hop is not None:
            front.hop.drop()  # (which starts the undo of what its front left unsaid)
            running = set(front.hop.running)
            front.hop = None
            if front.conns or running:  # its openpi connections closed with it; its steps
                # undone (a stop waits for them, so none runs on past the service's end)
                task = asyncio.create_task(self._close(running, list(front.conns.values())))
                self._ending.add(task)
                task.add_done_callback(self._ending.discard)
            front.conns = {}

    async def _close(
        self, running: set[asyncio.Task[None]], conns: list[openpi.Connection]
    ) -> None:
        """End the openpi connections of a front that is gone, as their clients' closes
        would: once its steps still running have finished (and been undone), each
        connection's own episode ends."""
        if running:
            await asyncio.wait(running)
        for conn in conns:
            try:
                await conn.close()
            except Exception:  # the episode is released by its expiry instead
                log.exception("ending the episode %s of a closed connection", conn.own)

    async def stop(self, timeout_s: float = STOP_S) -> None:
        """Stop every front: it closes its listener, finishes its open requests (their
        steps still served by this core), exits; SIGKILL past ``timeout_s``."""
        self.stopping = True
        for front in self.fronts:  # stopping: what they still get, the core answers
            if front.hop is not None:
                front.hop.region.tell(time.monotonic_ns(), NEVER_NS)
        if self._watch is not None:
            self._watch.cancel()
        running = [f for f in self.fronts if f.process is not None]
        for front in running:
            assert front.process is not None
            if front.process.poll() is None:
                front.process.send_signal(signal.SIGUSR1)
        until = time.monotonic() + timeout_s
        for front in running:
            assert front.process is not None
            while front.process.poll() is None and time.monotonic() < until:
                await asyncio.sleep(0.05)
            if front.process.poll() is None:
                front.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):  # (its server's word
                    # late: the server is closed below, and takes it with it)
                    await asyncio.to_thread(front.process.wait, STOP_S)
            self._drop(front)
        self.forks.close()  # (it exits: every front it forked has)
        await asyncio.to_thread(self.forks.reap)
        if self._ending:
            await asyncio.wait(set(self._ending), timeout=timeout_s)
