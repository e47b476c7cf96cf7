"""Is this node alive for the fleet: its registration, its lease, and fencing.

The node registers its devices (with their crash trackers' states) and renews its lease
every third of the lease Redis granted. Its own view of the lease is conservative: the
*send* time of the renewal that succeeded, plus the granted lease, less a drift margin.
:meth:`Lease.valid` answers that, and nothing else; :meth:`Lease.fence` is the action that
drops every record once the lease is gone, called by the renewal loop.

Why this is hard: another node may take this node's episodes over as soon as Redis sees
the lease lapse. A step must therefore be answered under the registration it started with
(``EpisodeTable.generation``, compared by :meth:`Lease.require`). Never merely under "a
lease is valid now". Else a paused process whose renewal re-registers first would answer
with state nobody keeps. Redis alone decides that another process holds this node id (a
renewal, a registration, a resolve). What a forward says is a hint, never that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from affinity import (
    AffinityError,
    DeviceRegistration,
    ModelId,
    NodeConflict,
    Registry,
    __version__,
)
from affinity.registry import (
    DeviceScore,
    Held,
    LeaseTerms,
    MoveRequest,
    NodeProcesses,
    Registered,
)
from node.config import NodeConfig
from node.episodes import EpisodeTable
from node.errors import Unavailable
from node.metrics import Metrics

__all__ = ["Lease", "LeaseListener"]

log = logging.getLogger("affinity.node")
"""Exit code of a node that found its id held by another running process."""


class LeaseListener(Protocol):
    """What the owner does when the lease changes what it may keep (``node/flusher.py``)."""

    def held(self) -> list[Held]:
        """The records to re-assert at a registration within the lease."""

    def registered(self, held: Sequence[Held], done: Registered, sent: float) -> None:
        """A registration answered; ``held`` were re-asserted (``done.lost``: not kept)."""

    def revoked(self, revoked: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """Drop what an operator released; return what was carried out (all of it)."""

    def server_changed(self) -> None:
        """Another Redis server answers now: check every record at the next flush."""

    def dropped(self) -> None:
        """Every record was dropped (a fence, a registration anew)."""


class Lease:
    """Registration, lease and fencing of one node process (see the module doc)."""

    def __init__(
        self,
        config: NodeConfig,
        registry: Registry,
        table: EpisodeTable,
        metrics: Metrics,
        registrations: Callable[[], list[DeviceRegistration]],
        clock: Callable[[], float] = time.monotonic,
        *,
        models: Mapping[ModelId, str] | None = None,
        on_renewed: Callable[[], Awaitable[None]] | None = None,
        scores: Callable[[], Sequence[DeviceScore]] = list,
        listener: LeaseListener | None = None,
        on_moves: Callable[[Sequence[MoveRequest]], None] | None = None,
        processes: Callable[[], NodeProcesses] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.registry = registry
        self.table = table
        self.metrics = metrics
        self.registrations = registrations
        self.clock = clock
        self.models: Mapping[ModelId, str] = models or {}  # served -> its contract record
        self.instance = uuid.uuid4().hex  # tells this process from another with the same id
        self.deadline = float("-inf")  # monotonic; nothing is served before register
        self.registered = False
        self.leaving = False
        self.left = False  # deregistered by a graceful stop: routes its stragglers, serves none
        self.conflict: str | None = None  # why this process must stop (another instance)
        self.on_conflict: Callable[[], None] = lambda: None
        self.on_renewed = on_renewed  # after each renewal
        # what serves_until_ns() or the table's generation says changed (a renewal, a
        # registration, a fence, a drop, the end): the device worker processes are told
        self.on_change = on_change or _nothing
        # the scores each renewal publishes (scored placement: node/placement.py)
        self.scores = scores
        self.listener = listener  # the owner's flusher: what the lease lets it keep
        # what an operator asked to move, read at a renewal (started in the background)
        self.on_moves = on_moves
        # this node's processes (node/procs.py), published with each registration and renewal
        self.processes = processes
        self.granted_s = config.settings.lease_ttl_s  # what Redis granted last
        self.longest_ms = 0  # the longest lease TTL of the fleet, as last heard
        self.server_id: str | None = None  # run_id of the Redis server last seen
        self._fenced = False  # fence() ran and no registration or renewal came since
        self._done: list[tuple[str, int]] = []  # revocations carried out, not yet said
        self._no_server_id = False  # logged that run_id cannot be read
        self._task: asyncio.Task[None] | None = None
        self._soon = asyncio.Event()  # renew now, not at the interval (renew_soon)
        self._ending = False  # end() began: the renewal loop renews no more

    # ---- queries (they never act) ----------------------------------------------------

    def known_ms(self) -> int:
        """The longest lease TTL of the fleet this node knows of (its own included): the
        least grace period it may start after Redis lost its data."""
        return max(self.config.settings.lease_ttl_ms, self.longest_ms)

    @property
    def lease_s(self) -> float:
        """How long after sending a renewal this node may serve: the granted lease less a
        margin (Redis floors its clock to milliseconds; clock rates differ)."""
        return self.granted_s - max(0.01, 0.02 * self.granted_s)

    @property
    def renew_every_s(self) -> float:
        return min(self.config.renew_every_s, self.granted_s / 3)

    def valid(self) -> bool:
        """Whether this process's lease is current by its own conservative clock."""
        return self.registered and self.conflict is None and self.clock() < self.deadline

    def may_serve(self) -> bool:
        """Whether this process may serve its episodes from memory now: its lease is valid
        and it is not leaving."""
        return not self.leaving and self.valid()

    def serves_until_ns(self) -> int | None:
        """Until when (``time.monotonic_ns``) this process's lease lets it serve, as of now:
        what the core tells its front door processes (``node.hop.Region.tell``). None: it
        never runs out (a node that left routes its stragglers' steps); 0: one not
        registered, or that lost its id to another process, has run out."""
        if self.left:
            return None
        if not self.registered or self.conflict is not None:
            return 0
        return int(self.deadline * 1e9)

    def require(self, generation: int | None = None) -> None:
        """Raise :class:`Unavailable` (``fenced``) unless the lease is valid and, given a
        ``generation`` (the table's when a step began), no record was dropped since."""
        if not self.valid():
            why = self.conflict or f"node {self.node_id} lease is not current"
            raise Unavailable("fenced", why, 1.0)
        if generation is not None and generation != self.table.generation:
            raise Unavailable(
                "fenced",
                f"node {self.node_id} dropped its episodes while the step ran (its lease "
                "lapsed, or it registered anew)",
                1.0,
            )

    def require_instance(self, instance: str) -> None:
        """Raise :class:`Unavailable` (``fenced``) unless ``instance``, the process *Redis*
        just named as the holder of this node id ("" from an older fleet: not checked), is
        this one. When it is another, this process lost the node id: it fences and stops.
        Never call it with what a forward or a hint says: that is no authority."""
        if instance and instance != self.instance:
            if self.conflict is None:
                self._lost_to_another(f"Redis names instance {instance} as the holder")
            self.require()

    # ---- actions ---------------------------------------------------------------------

    def _changed(self) -> None:
        try:
            self.on_change()
        except Exception:  # telling others never breaks the lease
            log.exception("telling the lease's change failed")

    def _processes(self) -> NodeProcesses | None:
        """This node's processes, each one's lag since the last call (node/procs.py)."""
        return self.processes() if self.processes is not None else None

    def fence(self) -> bool:
        """Drop every record once the lease is gone (once per lapse); True when fenced."""
        if self.valid():
            return False
        if not self._fenced:
            self._fenced = True
            dropped = self.table.drop_all("fenced")
            if self.listener is not None:
                self.listener.dropped()
            self._changed()
            self.metrics.fenced.set(1)
            if self.registered:
                log.error(
                    "node %s fenced itself: lease not renewed within %.1fs; dropped %d "
                    "episode state(s), answering 503 until registered again",
                    self.node_id,
                    self.granted_s,
                    dropped,
                )
        return True

    def _serving_again(self, sent: float, terms: LeaseTerms) -> None:
        self.granted_s = terms.granted_ms / 1000
        self.longest_ms = terms.longest_ms
        self.deadline = sent + self.lease_s
        if self._fenced:
            self._fenced = False
            self.metrics.fenced.set(0)
        self._changed()

    async def register(self) -> None:
        """Register (again); only then does this node serve. Drops every record unless it
        re-registers within its own lease; then it re-asserts them in the same script. That
        case means Redis lost its data. Nobody can have taken an episode over, and the grace
        period holds claims back."""
        await self.registry.check_secret(self.config.cluster_secret)  # SecretMismatch
        sent = self.clock()
        own_until = self.deadline
        keep = self.registered and self.conflict is None and sent < own_until
        listener = self.listener
        held = listener.held() if keep and listener is not None else []
        if not keep:
            self._drop("registered")
        done = await self.registry.register(
            self.node_id,
            self.config.advertise_url,
            self.registrations(),
            __version__,
            instance=self.instance,
            models=self.models,
            episodes=held,
            processes=self._processes(),
        )
        if held and self.clock() >= own_until:  # answered after this node's own lease ended
            self._drop("registered")
            held = []
        if listener is not None:
            listener.registered(held, done, sent)
        if held:
            log.warning(
                "node %s re-registered within its lease (Redis lost its data?): re-asserted "
                "%d episode(s), %d held by another claim now and dropped; grace period %.1fs",
                self.node_id,
                len(held) - len(done.lost),
                len(done.lost),
                done.grace_ms / 1000,
            )
        self._serving_again(sent, done.terms)
        self.registered = True
        self._changed()
        if self.granted_s < self.config.settings.lease_ttl_s:
            log.info(
                "node %s holds a %.1fs lease until every node heard of its %.1fs one",
                self.node_id,
                self.granted_s,
                self.config.settings.lease_ttl_s,
            )
        log.info(
            "node %s registered %d device(s) at %s",
            self.node_id,
            len(self.registrations()),
            self.config.advertise_url,
        )
        with contextlib.suppress(AffinityError):
            await self._check_server()  # the server this registration was made on

    def _drop(self, reason: str) -> None:
        self.table.drop_all("registered" if reason == "registered" else "fenced")
        if self.listener is not None:
            self.listener.dropped()
        self._changed()

    async def start(self) -> None:
        """Register, waiting for an earlier process's lease on this node id to lapse (a
        restart right after a kill); then start renewing."""
        waited_since = self.clock()
        limit = 2 * self.config.settings.lease_ttl_s + 1
        waiting = False
        while True:
            try:
                await self.register()
                break
            except NodeConflict:
                waited = self.clock() - waited_since
                if waited > limit:
                    raise
                if not waiting:  # one line with the wait and its bound, then the result
                    waiting = True
                    log.warning(
                        "node id %s is held by another process with a current lease; "
                        "waiting up to %.0fs for it to lapse (or start this one with another "
                        "--node-id)",
                        self.node_id,
                        limit,
                    )
                await asyncio.sleep(min(1.0, self.config.renew_every_s))
        if waiting:
            log.info(
                "node id %s: the other process's lease lapsed after %.1fs; registered",
                self.node_id,
                self.clock() - waited_since,
            )
        self._task = asyncio.create_task(self._renew_loop(), name="affinity-renew")

    async def renew_once(self) -> bool:
        """One renewal (registering again when Redis no longer holds the lease). An
        operator's revocations it answers are carried out and said at once, in a second
        renewal. True when the lease is current afterwards."""
        sent = self.clock()
        try:
            renewal = await self.registry.renew(
                self.node_id, self.instance, self._done, self.scores(), self._processes()
            )
        except NodeConflict as exc:
            self._lost_to_another(str(exc))
            return False
        except AffinityError as exc:
            self.metrics.renewals.labels("failed").inc()
            log.warning("lease renewal of %s failed: %s", self.node_id, exc)
            return False
        if renewal is None:
            log.warning(
                "node %s is no longer registered (lease lapsed or Redis lost it)", self.node_id
            )
            try:
                await self.register()
                self.metrics.renewals.labels("reregistered").inc()
                return True
            except NodeConflict as exc:
                self._lost_to_another(str(exc))
            except AffinityError as exc:
                self.metrics.renewals.labels("failed").inc()
                log.warning("re-registration of %s failed: %s", self.node_id, exc)
            return False
        self.metrics.renewals.labels("ok").inc()
        was_fenced = self._fenced
        self._serving_again(sent, renewal.terms)
        self._done = []
        if renewal.moves and self.on_moves is not None:
            self.on_moves(renewal.moves)
        if renewal.revoked and self.listener is not None:
            self._done = self.listener.revoked(renewal.revoked)
            # said now, not a third of a lease later: until Redis hears it, the episodes'
            # steps still come here (and are refused), so say it at once
            with contextlib.suppress(AffinityError):
                if await self.registry.renew(self.node_id, self.instance, self._done):
                    self._done = []
        with contextlib.suppress(AffinityError):
            await self._check_server()
        if self.on_renewed is not None:
            with contextlib.suppress(AffinityError):
                await self.on_renewed()
        if was_fenced:
            log.info("node %s lease renewed; serving again", self.node_id)
        return True

    async def _check_server(self) -> None:
        """Notice that another Redis server answers now (a restart from a snapshot, a
        failover to a replica). It may lack the last writes, claims of episodes held here
        among them, and then grant them again. The owner checks every record at its next
        flush (≤ 1 s)."""
        run_id = await self.registry.server_id()
        if run_id is None:
            if not self._no_server_id:
                self._no_server_id = True
                log.info(
                    "cannot tell one Redis server from another (no run_id: Redis Cluster, "
                    "an ACL user without +info, or the embedded store): a claim a failover "
                    "loses is found at the episode's next slide, not at the next renewal"
                )
            return
        if self.server_id is not None and run_id != self.server_id:
            log.warning(
                "another Redis server answers now (run_id %s, was %s: restarted or failed "
                "over): checking the %d episode(s) held here in the next flush",
                run_id[:12],
                self.server_id[:12],
                len(self.table),
            )
            if self.listener is not None:
                self.listener.server_changed()
        self.server_id = run_id

    def _lost_to_another(self, why: str) -> None:
        """Another instance holds this node id: fence now and stop the process."""
        self.metrics.renewals.labels("failed").inc()
        self.deadline = float("-inf")
        self.registered = False
        self.conflict = (
            f"node id {self.node_id} is now held by another process (instance); this one "
            f"stops: {why}"
        )
        self.fence()
        log.error("%s", self.conflict)
        self.on_conflict()

    def renew_soon(self) -> None:
        """Renew at once rather than at the interval: what a renewal publishes changed in a
        way the fleet should see now (the fronts, started after the registration, are
        running: without this they show as down for a renewal's interval)."""
        self._soon.set()

    async def _renew_loop(self) -> None:
        while self.conflict is None and not self._ending:
            interval = self.renew_every_s
            if self.fence():
                interval = min(interval, 0.5)  # come back quickly once Redis answers
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._soon.wait(), interval)
            self._soon.clear()
            if self._ending:  # (a cancellation end() sent may have been swallowed)
                return
            try:
                await self.renew_once()
            except Exception:  # a renewal loop that dies would fence the node for good
                self.metrics.renewals.labels("failed").inc()
                log.exception("lease renewal of %s failed", self.node_id)

    async def begin_leave(self) -> None:
        """The graceful stop begins: this node's devices take no new episodes."""
        self.leaving = True
        if self.registered:
            try:
                await self.registry.leave(self.node_id, self.instance)
            except AffinityError as exc:
                log.error("could not mark node %s as leaving: %s", self.node_id, exc)

    async def end(self) -> int:
        """Stop renewing and deregister (what is still held is handed over by Redis);
        serve nothing more. Returns how many episodes Redis handed over (-1: unknown)."""
        if self._task is not None:
            # The flag ends the loop even when the cancellation lands in a Redis call and is
            # swallowed there (redis-py's asyncio.wait_for on Python 3.11, CPython gh-86296:
            # see affinity.scripts.bounded): the loop then went on renewing, a node that
            # had left kept its lease, and this waited for it forever.
            self._ending = True
            self._soon.set()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        released = -1
        if self.registered and self.conflict is None:
            try:
                released = await self.registry.deregister(self.node_id, self.instance)
            except AffinityError as exc:
                log.error("could not deregister node %s: %s", self.node_id, exc)
        self.registered = False
        self.deadline = float("-inf")  # serve nothing more, whatever is still queued
        self.left = self.leaving
        self._changed()
        return released


def _nothing() -> None:
    pass
