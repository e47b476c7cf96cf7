"""A node's membership of the fleet: registration, its lease, self-fencing, and leaving.

- ``register`` writes the node and its devices (with the crash trackers' states) and
  starts the lease; only then does the node serve.
- The lease is renewed every lease-TTL/3. The local deadline is the time the renewal was
  *sent* plus the lease TTL less a small margin (monotonic clock), so it ends no later
  than Redis' own. Past it the node fences itself: it drops every episode's state and
  answers 503 ``fenced`` until it registers again. Serving checks the deadline before and
  after each model run.
- Another process holding this node id (seen at renewal: Redis restarted empty and a
  duplicate registered first) fences this one at once and stops it with exit code
  :data:`EXIT_CONFLICT`.
- ``leave`` is the graceful stop: the node's devices take no new episodes; each episode
  held here is handed over (its next step is ``reassigned`` on another device, with
  ``state_reset``) as soon as its in-flight step, if any, has finished; then the node
  deregisters and stops renewing — all while it still listens, so forwards keep getting
  answers instead of connection errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping

from affinity import (
    AffinityError,
    Claims,
    DeviceRegistration,
    ModelId,
    NodeConflict,
    Registry,
    __version__,
)
from affinity.registry import Held
from node.catalog import Dispatchers
from node.config import NodeConfig
from node.metrics import Metrics
from node.ownership import Ownership
from node.step import Unavailable

__all__ = ["EXIT_CONFLICT", "VERSION", "Membership"]

log = logging.getLogger("affinity.node")
VERSION = __version__
EXIT_CONFLICT = 4
"""Exit code of a node that found its id held by another running process."""


class Membership:
    """Registration, lease and fencing of one node (see the module doc)."""

    def __init__(
        self,
        config: NodeConfig,
        registry: Registry,
        claims: Claims,
        dispatcher: Dispatchers,
        metrics: Metrics,
        registrations: Callable[[], list[DeviceRegistration]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.registry = registry
        self.claims = claims
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.registrations = registrations
        self.models: Mapping[ModelId, str] = {}  # what the node serves -> its contract record
        self.clock = clock
        self.instance = uuid.uuid4().hex  # tells this process from another with the same id
        self.lease_deadline = float("-inf")  # monotonic; nothing is served before register
        self.registered = False
        self.leaving = False
        self.conflict: str | None = None  # why this process must stop (another instance)
        self.on_conflict: Callable[[], None] = lambda: None
        self._fenced_logged = False
        self.server_id: str | None = None  # run_id of the Redis server last seen
        self._revoked: list[tuple[str, int]] = []  # revocations carried out, not yet said
        self._no_server_id = False  # logged that run_id cannot be read
        self._handing: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ownership = Ownership(
            self.node_id,
            config.advertise_url,
            config.settings.lease_ttl_s,
            config.settings.backstop_ms / 1000,
            registry,
            dispatcher,
            clock,
            lambda reason, n: metrics.owner_dropped.labels(reason).inc(n),
        )

    # ---- lease -----------------------------------------------------------------------

    @property
    def lease_s(self) -> float:
        """How long after sending a renewal this node may serve: the lease TTL less a small
        margin, since Redis floors its clock to milliseconds and clock rates differ."""
        ttl = self.config.settings.lease_ttl_s
        return ttl - max(0.01, 0.02 * ttl)

    def fenced(self) -> bool:
        """True (and local state dropped) when the lease deadline has passed locally."""
        if self.clock() < self.lease_deadline:
            return False
        if not self._fenced_logged:
            self._fenced_logged = True
            dropped = self.dispatcher.drop_all()
            self.ownership.drop()
            self.metrics.fenced.set(1)
            if self.registered:
                log.error(
                    "node %s fenced itself: lease not renewed within %.1fs; dropped %d "
                    "episode state(s), answering 503 until registered again",
                    self.node_id,
                    self.config.settings.lease_ttl_s,
                    dropped,
                )
        return True

    def authority(self) -> bool:
        """Whether this instance may serve the episodes it holds from memory now: it is
        registered, its lease is valid by its own conservative clock, it is not leaving,
        and no other instance holds its node id."""
        return (
            self.registered
            and not self.leaving
            and self.conflict is None
            and self.clock() < self.lease_deadline
        )

    def check_lease(self) -> None:
        """Raise :class:`Unavailable` (``fenced``) unless the lease is current."""
        if self.fenced():
            why = self.conflict or f"node {self.node_id} lease is not current"
            raise Unavailable("fenced", why, 1.0)

    async def register(self) -> None:
        """Register (again); only then does this node serve. Drops any local state: a node
        that lost its registration may have lost its episodes to other devices."""
        await self.registry.check_secret(self.config.cluster_secret)  # SecretMismatch
        sent = self.clock()
        # Within its own lease (Redis lost its data: nobody can have taken an episode over,
        # and the grace period holds new claims back), the episodes held here are kept and
        # re-asserted in the same script; otherwise they may be another node's by now.
        own_until = self.lease_deadline
        keep = self.registered and self.conflict is None and sent < own_until
        held: list[Held] = []
        if keep:
            held = [h for h, _ in self.dispatcher.held()]
        else:
            self.dispatcher.drop_all()
            self.ownership.drop()
        done = await self.registry.register(
            self.node_id,
            self.config.advertise_url,
            self.registrations(),
            VERSION,
            instance=self.instance,
            models=self.models,
            episodes=held,
        )
        if held and self.clock() >= own_until:  # answered after this node's own lease ended
            self.dispatcher.drop_all()
            self.ownership.drop()
        else:
            lost = self.ownership.unchanged(held, done.lost)
            for episode in lost:
                self.dispatcher.release(episode)
            if lost:
                self.metrics.owner_dropped.labels("lost").inc(len(lost))
        if held:
            log.warning(
                "node %s re-registered within its lease (Redis lost its data?): re-asserted "
                "%d episode(s), %d held by another claim now and dropped; grace period %.1fs",
                self.node_id,
                len(held) - len(done.lost),
                len(done.lost),
                done.grace_ms / 1000,
            )
        self.ownership.grace_ms = done.grace_ms
        self.ownership.flushed_at = sent  # every backstop of what is held is fresh now
        self.ownership.asserted([h.episode for h in held], sent)
        self.lease_deadline = sent + self.lease_s
        self.registered = True
        self._fenced_logged = False
        self.metrics.fenced.set(0)
        log.info(
            "node %s registered %d device(s) at %s",
            self.node_id,
            len(self.dispatcher.devices),
            self.config.advertise_url,
        )
        with contextlib.suppress(AffinityError):
            await self._check_server()  # the server this registration was made on

    async def start(self) -> None:
        """Register, waiting for an earlier process's lease on this node id to lapse (a
        restart right after a kill); then start the renewal and maintenance loops."""
        self._loop = asyncio.get_running_loop()
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
        self._tasks = [
            asyncio.create_task(self._renew_loop(), name="affinity-renew"),
            asyncio.create_task(self._maintenance_loop(), name="affinity-maintenance"),
        ]

    async def renew_once(self) -> None:
        sent = self.clock()
        try:
            revoked = await self.registry.renewal(self.node_id, self.instance, self._revoked)
        except NodeConflict as exc:
            self._lost_to_another(str(exc))
            return
        except AffinityError as exc:
            self.metrics.renewals.labels("failed").inc()
            log.warning("lease renewal of %s failed: %s", self.node_id, exc)
            return
        if revoked is not None:
            self.metrics.renewals.labels("ok").inc()
            self.lease_deadline = sent + self.lease_s
            for episode, token in revoked:  # released in Redis by an operator
                claim = self.dispatcher.claim_of(episode)
                if claim is not None and claim[1] == token:
                    log.info("episode %r was released in Redis: its state here is dropped", episode)
                    self.dispatcher.release(episode)
                    self.metrics.owner_dropped.labels("revoked").inc()
            self._revoked = revoked  # said done at the next renewal (removed then)
            with contextlib.suppress(AffinityError):
                await self._check_server()
            with contextlib.suppress(AffinityError):
                await self._reconcile()
            if self._fenced_logged:
                log.info("node %s lease renewed; serving again", self.node_id)
                self._fenced_logged = False
                self.metrics.fenced.set(0)
            return
        log.warning("node %s is no longer registered (lease lapsed or Redis lost it)", self.node_id)
        try:
            await self.register()
            self.metrics.renewals.labels("reregistered").inc()
        except NodeConflict as exc:
            self._lost_to_another(str(exc))
        except AffinityError as exc:
            self.metrics.renewals.labels("failed").inc()
            log.warning("re-registration of %s failed: %s", self.node_id, exc)

    async def _check_server(self) -> None:
        """Notice that another Redis server answers now (a restart from a snapshot, a
        failover to a replica): it may lack the last writes, claims of episodes held here
        among them, and then grant them again. Every record held here is checked in the
        next flush (slid: one Redis lost or gave to another claim is dropped), ≤ 1 s, not
        when its slide would next be due (minutes)."""
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
                len(self.dispatcher.held()),
            )
            self.ownership.check_all()
        self.server_id = run_id

    def check_instance(self, instance: str) -> None:
        """Raise :class:`Unavailable` (``fenced``) unless ``instance``, the process Redis
        says holds this node id's registration, is this one ("" from an older fleet: not
        checked). When it is another, this process has lost the node id: it fences now,
        before serving anything more, and stops (as when a renewal finds the conflict)."""
        if instance and instance != self.instance:
            if self.conflict is None:
                self._lost_to_another(f"Redis names instance {instance} as the holder")
            self.check_lease()

    def _lost_to_another(self, why: str) -> None:
        """Another instance holds this node id: fence now and stop the process."""
        self.metrics.renewals.labels("failed").inc()
        self.lease_deadline = float("-inf")
        self.registered = False
        self.conflict = (
            f"node id {self.node_id} is now held by another process (instance); this one "
            f"stops: {why}"
        )
        self.fenced()
        log.error("%s", self.conflict)
        self.on_conflict()

    async def _renew_loop(self) -> None:
        while self.conflict is None:
            interval = self.config.renew_every_s
            if self.fenced():
                interval = min(interval, 0.5)  # come back quickly once Redis answers
            await asyncio.sleep(interval)
            try:
                await self.renew_once()
            except Exception:  # a renewal loop that dies would fence the node for good
                self.metrics.renewals.labels("failed").inc()
                log.exception("lease renewal of %s failed", self.node_id)

    async def _maintenance_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.renew_every_s))
            try:
                self.fenced()
                try:
                    await self.ownership.flush(self.instance, self.registered)
                except AffinityError as exc:  # kept for the next flush
                    log.warning("flush of node %s failed: %s", self.node_id, exc)
                async with asyncio.timeout(self.config.act_deadline_s):
                    for device in await self.dispatcher.probe():
                        log.info("device %s passed its probe", device)
                self.refresh_gauges()
            except Exception:  # includes a probe that hangs past the deadline
                log.exception("maintenance of node %s failed", self.node_id)

    def refresh_gauges(self) -> None:
        for device in self.dispatcher.devices:
            self.metrics.live.labels(device).set(self.dispatcher.live_episodes(device))

    async def _reconcile(self) -> None:
        """Make Redis agree with the local crash trackers (a lost or reordered down/up
        write must not leave a crashed device taking claims, or a healthy one down), and
        the state gauges with Redis (an operator's drain). ``down`` belongs to the node."""
        states = await self.registry.states(self.dispatcher.devices)
        for device, state in states.items():
            tracker = self.dispatcher.tracker(device)
            if tracker.down and state in ("active", "draining"):
                state = "down"
                await self.registry.set_state(device, "down", tracker.last_error[:256])
            elif not tracker.down and state == "down":
                change = await self.registry.set_state(device, "active", "", only_if="down")
                state = change.state  # a drain from before comes back
            if state in ("active", "draining", "down"):
                self.metrics.set_state(device, state)

    # ---- crash tracker -> registry -----------------------------------------------------

    def on_transition_threadsafe(self, device: str, to: str, reason: str) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.call_soon_threadsafe(
            lambda: self._tasks.append(
                asyncio.ensure_future(self._on_transition(device, to, reason))
            )
        )

    async def _on_transition(self, device: str, to: str, reason: str) -> None:
        self.metrics.transitions.labels(device, to).inc()
        self.metrics.set_state(device, "down" if to == "down" else "active")
        try:
            if to == "down":
                await self.registry.set_state(device, "down", reason[:256])
            else:  # back to what it was before (an operator's drain stays a drain)
                await self.registry.set_state(device, "active", "", only_if="down")
        except AffinityError as exc:
            log.error("could not record %s as %s: %s", device, to, exc)

    # ---- leaving -----------------------------------------------------------------------

    async def hand_over(self, episode: str) -> None:
        """Hand ``episode`` over to the fleet once its in-flight step (if any) finished:
        its next step is ``reassigned`` elsewhere, with clean state. Idempotent; concurrent
        callers share one hand-over."""
        task = self._handing.get(episode)
        if task is None:
            task = asyncio.ensure_future(self._hand_over(episode))
            self._handing[episode] = task
        await asyncio.shield(task)

    async def _hand_over(self, episode: str) -> None:
        await self.dispatcher.wait_idle(episode)
        token = self.dispatcher.token_of(episode)
        self.dispatcher.release(episode)
        if token is not None:
            try:
                await self.claims.handoff(episode, token)
            except AffinityError as exc:  # deregistration below covers it
                log.warning("could not hand %s over: %s", episode, exc)

    async def leave(self) -> None:
        """The graceful stop (see the module doc). Bounded by the act deadline for the
        in-flight steps plus the Redis deadline for each write."""
        if self.leaving:
            return
        self.leaving = True
        started = self.clock()
        if self.registered:
            try:
                await self.registry.leave(self.node_id, self.instance)
            except AffinityError as exc:
                log.error("could not mark node %s as leaving: %s", self.node_id, exc)
        held = [episode for episode, _, _ in self.dispatcher.episodes()]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.act_deadline_s + 1):
                await asyncio.gather(*(self.hand_over(ep) for ep in held))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self.dispatcher.drop_all()
        if self.registered and self.conflict is None:
            try:
                released = await self.registry.deregister(self.node_id, self.instance)
                log.info(
                    "node %s left: handed over %d episode(s), deregistered %d more in %.2fs",
                    self.node_id,
                    len(held),
                    max(released, 0),
                    self.clock() - started,
                )
            except AffinityError as exc:
                log.error("could not deregister node %s: %s", self.node_id, exc)
        self.registered = False
        self.lease_deadline = float("-inf")  # serve nothing more, whatever is still queued
