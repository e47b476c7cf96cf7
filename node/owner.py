"""May this node serve an episode, and serve it: the owner's authority over its episodes.

Redis decides who owns an episode, once, in the claim; the owner decides each step
(DESIGN.md, "Ownership and steps"). A step of an episode whose record this node holds is
served from memory, with no Redis command, while three things hold. The lease is valid
(``node/lease.py``). The last flush succeeded less than a lease ago (``node/flusher.py``).
The episode's backstop in Redis is not near by this node's clock.

Only the owner lets an episode go (DESIGN.md rule 8): a client's end, idle expiry, an
operator's revocation (carried out at the renewal that brings it), a hand-over
(``node/handover.py``). Each drops the record first; the table then refuses any step of
that claim still queued. Then it tells Redis: at once for an end or a hand-over, in the
next flush for idle expiry. A load slot may stay taken until then, never the reverse.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from affinity import (
    AffinityError,
    Assignment,
    BackendUnavailable,
    Claims,
    InvalidArgument,
    PoolExhausted,
    StaleToken,
    UnknownEpisode,
)
from affinity.transfers import Transfers
from node import inputs
from node.config import NodeConfig
from node.control import control_feed
from node.dispatcher import Arrival, MultiGpuDispatcher
from node.episodes import EpisodeTable
from node.errors import (
    ClaimEnded,
    InvalidInput,
    ModelFailure,
    Refused,
    StepRefused,
    Unavailable,
    refusal,
)
from node.flusher import Flusher
from node.forward import Forward, Poster
from node.handover import HandOvers, Mover
from node.health import DeviceHealth
from node.lease import Lease
from node.metrics import Metrics
from node.record import StepResult
from node.rtc import Ask
from node.shadow import ShadowRunner
from node.step import Array, Reply, Step, TimeLimit

__all__ = ["Owner", "Restart"]

Restart = Callable[[Step, Arrival], Awaitable[Reply]]
"""Start a forwarded step's episode over here (``node.router.Router.restart_here``): it
claims anew through the router's resolve."""

log = logging.getLogger("affinity.node")

RECHECK_BATCH = 512
"""Records of a device back up that :meth:`Owner.recheck` looks up in one round trip."""


class Owner:
    """Serve from memory, serve what a router forwards, let go (see the module doc); its
    :class:`Flusher` tells Redis, its :class:`HandOvers` hand episodes over."""

    def __init__(
        self,
        config: NodeConfig,
        table: EpisodeTable,
        dispatchers: Mapping[str, MultiGpuDispatcher],
        lease: Lease,
        health: DeviceHealth,
        claims: Claims,
        lease_claims: Claims,
        flusher: Flusher,
        metrics: Metrics,
        pool: Poster,
        clock: Callable[[], float] = time.monotonic,
        restart: Restart | None = None,
        shadow: ShadowRunner | None = None,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.url = config.advertise_url
        self.table = table
        self.dispatchers = dispatchers
        self.first_model = next(iter(dispatchers))
        self.lease = lease
        self.health = health
        self.claims = claims  # the request path's pool (lookups, ends)
        self.metrics = metrics
        self.clock = clock
        self.local_devices = frozenset(health.devices)
        self.arrivals = next(iter(dispatchers.values())).arrivals
        # name -> "name@version" of the models served here (for the replies)
        self.models = {name: d.model for name, d in dispatchers.items()}
        self.restart = restart  # a forwarded restart claims anew through the router
        self.shadow = shadow  # ghost episodes after live steps (node/shadow.py)
        self._ending: dict[str, asyncio.Event] = {}  # ends whose release in Redis is in flight
        settings = config.settings  # the flushes and hand-overs use the lease's own pool
        self.flusher = flusher  # the lease's listener too
        self.mover = Mover(
            self.node_id,
            table,
            lease,
            Transfers(lease_claims.redis, settings),
            lease_claims,
            pool,
            metrics,
            {d.model: d.contract for d in dispatchers.values()},
            clock,
            ghosts=shadow,  # a move carries the episode's ghost
        )
        self.handovers = HandOvers(self.node_id, table, lease, self.mover,
                                   config.drain_timeout_s, clock)  # fmt: skip

    # ---- may I serve -------------------------------------------------------------------

    def serving(self, episode: str) -> Assignment | None:
        """The assignment to serve ``episode`` from memory now, or None (ask Redis). It
        needs a record held here, a valid lease, a current flush, its backstop not near, and
        a device that is not down. The caller checks that the step names its model."""
        if not self.lease.may_serve():
            return None
        record = self.table.get(episode)
        if record is None or not self.flusher.fresh(episode):
            return None
        if not record.confirmed or self.table.moving(episode):
            return None  # handed over here, not yet confirmed by Redis; or moving away
        if self.health.down(record.device) or self.health.unchecked(record.device):
            return None  # Redis moves it: the resolve says reassigned (or, back up, hit)
        return Assignment(episode, "hit", record.device, record.token, self.node_id, self.url,
                          None, record.claim, self.lease.instance, record.model)  # fmt: skip

    # ---- serve -------------------------------------------------------------------------

    async def serve(self, assignment: Assignment, step: Step, arrival: Arrival) -> Reply:
        """Run the step here, on the device and under the claim Redis confirmed. It is
        answered only if its result was kept under the registration it started with.
        Raises :class:`Unavailable`, :class:`Refused` and ``ClaimEnded`` (the claim ended
        here meanwhile: nothing applied; ask Redis again)."""
        name, dispatcher = self._dispatcher_for(assignment, step)
        episode = assignment.episode
        if self.table.moving(episode):  # a hand-over is under way: wait for it (bounded
            await self.table.wait_moved(episode)  # by the step's deadline), then go on
        generation = self.table.generation  # the registration this step is served under
        self.lease.require()  # the resolve may have taken a while: check again
        arrival.done()  # handed to its device now
        started = time.perf_counter()
        feed = {
            **step.inputs,
            **control_feed(dispatcher.contract, episode, start=False, end=step.end),
        }
        try:  # inline, not a coroutine of its own: one frame fewer each step
            result = await dispatcher.step(step, assignment, inputs=feed, generation=generation)
        except ClaimEnded:
            if self.flusher.idled(episode):  # it idled out here: release it now,
                await self.flush()  # so a resolve claims anew
            raise
        except StepRefused as exc:
            raise self._refused(exc, assignment, dispatcher, feed, step) from exc
        try:  # the lease ran out, or the node registered anew, while the model ran
            self.lease.require(generation)
        except Unavailable:
            if not result.replayed:
                self.table.undo(episode, result.seq)  # answered 503: not applied
            raise
        if result.source == "model" and not result.replayed and step.arrived is not None:
            dispatcher.observed(episode, result.seq, self.clock() - step.arrived)
        if step.end:
            await self.end(episode, assignment.token)
        reply = self._reply(assignment, step, result, name, started)
        if self.shadow is not None:  # its ghost runs after the reply, off the step path
            self.shadow.after(assignment, step, result)
        return reply

    def _dispatcher_for(self, assignment: Assignment, step: Step) -> tuple[str, MultiGpuDispatcher]:
        """The name and dispatcher of the model ``assignment`` is served with here. Raises
        :class:`Unavailable` (``unknown_device``) for a device or model not served here."""
        if assignment.device not in self.local_devices:
            raise Unavailable(
                "unknown_device",
                f"Redis assigns episode {assignment.episode!r} to {assignment.device}, which "
                f"node {self.node_id} does not serve; its registration is being renewed",
                1.0,
            )
        name = assignment.model.partition("@")[0] or step.model or self.first_model
        dispatcher = self.dispatchers.get(name)
        if dispatcher is None:
            raise Unavailable(
                "unknown_device",
                f"Redis assigns episode {assignment.episode!r} with model {name!r} to "
                f"{assignment.device}, whose node {self.node_id} does not serve it; its "
                "registration is being renewed",
                1.0,
            )
        return name, dispatcher

    def _refused(
        self,
        exc: StepRefused,
        assignment: Assignment,
        dispatcher: MultiGpuDispatcher,
        feed: dict[str, Array],
        step: Step,
    ) -> Unavailable | Refused:
        """The step's error for the dispatcher's refusal ``exc`` (counted, and recorded
        with ``--record --errors`` when the node is at fault)."""
        if isinstance(exc, ModelFailure):
            self.metrics.model_failures.labels(exc.device).inc()
        refused = refusal(exc)
        if isinstance(refused, Unavailable) or refused.status >= 500:  # --record --errors
            dispatcher.failed(assignment, feed, step.seq, refused.reason)
        return refused

    def _reply(
        self, assignment: Assignment, step: Step, result: StepResult, name: str, started: float
    ) -> Reply:
        # A client's echo of its last claim (or token) tells a lost assignment (Redis
        # restarted empty, a failover dropped the last writes) from a new episode when the
        # step started clean; a claim that changed with the record (a hand-over) is no reset.
        claim, token = assignment.claim, assignment.token
        echoed = result.seq == 1 and (
            step.client_claim not in (None, claim)
            if step.client_claim is not None and claim
            else step.client_token not in (None, token)
        )
        timing = {"device_ms": (time.perf_counter() - started) * 1000}
        if result.run_s and not result.replayed:  # the model ran for this step
            timing["queue_ms"], timing["run_ms"] = result.queue_s * 1000, result.run_s * 1000
        return Reply(
            result.outputs,
            assignment.episode,
            assignment.device,
            self.node_id,
            token,
            assignment.status,
            result.state_reset or echoed,
            step.degraded,
            url=self.url,
            source=result.source,
            timing=timing,
            seq=result.seq,
            replayed=result.replayed,
            rtc=None if result.rtc is None else result.rtc.to_json(),
            model=assignment.model or self.models.get(name, ""),
            claim=claim,
            held=step.seq is not None,
        )

    async def serve_forwarded(self, fwd: Forward, received: float) -> Reply | None:
        """Serve a step another node resolved and forwarded here (``fwd``: decoded by the
        door, ``node/protocols/internal.py``, which received it at ``received`` by this
        owner's clock); or undo (``undo``) or end (``release``) what it names (None).

        Refuses (421) a device not on this node. Refuses (409) a claim Redis no longer holds
        for the episode, or an episode this leaving node just handed over. Also 409 for a
        registration other than this process's; the router's view is stale, so it asks
        Redis. 503 when out of budget or fenced."""
        if fwd.device not in self.local_devices:
            raise Refused(421, "not_owner", f"device {fwd.device!r} is not on node {self.node_id}")
        if fwd.undo:
            await self.undo(fwd.episode, fwd.step.seq, fwd.step.origin, fwd.doubt)
            return None
        if fwd.release:
            await self.end(fwd.episode, fwd.token)
            return None
        name = fwd.model.partition("@")[0] or self.first_model
        rtc = fwd.step.rtc
        dispatcher = self.dispatchers.get(name)
        if dispatcher is not None:
            try:  # the router checked them against the model; a node serving another one
                inputs.from_arrays(dispatcher.contract, fwd.step.inputs)  # refuses them as the
            except InvalidInput as exc:  # client's error (never a crash)
                raise Refused(
                    422, "bad_input", f"not an input of node {self.node_id}'s model: {exc}"
                ) from None
            try:  # checked against this node's model and --control-hz, as the inputs are
                ask = fwd.step.rtc or Ask()
                rtc = dispatcher.rtc_for(ask.executed, ask.delay, ask.control_hz, ask.pending)
            except InvalidArgument as exc:
                raise Refused(422, "bad_input", f"node {self.node_id}: {exc}") from None
        elif not fwd.step.restart:  # a restart may name a model served elsewhere: its claim says
            raise Refused(421, "not_owner", f"node {self.node_id} does not serve model {name!r}")
        arrival = self.arrivals.arrival()
        try:
            with TimeLimit(fwd.budget_s):
                return await self._serve_forwarded(fwd, arrival, rtc, received - fwd.elapsed_s)
        except TimeoutError:
            raise Unavailable(
                "deadline", f"the router's budget of {fwd.budget_s:.3f}s ran out", 1.0
            ) from None
        finally:
            arrival.done()

    async def _serve_forwarded(
        self, fwd: Forward, arrival: Arrival, rtc: Ask | None, arrived: float
    ) -> Reply:
        self.lease.require()
        if fwd.instance and fwd.instance != self.lease.instance:
            # the router's view names another process with this node id (a predecessor,
            # from a hint): a hint never fences anyone; the router asks Redis again
            raise Refused(
                409,
                "stale_instance",
                f"node {self.node_id} is another process now (instance {self.lease.instance}, "
                f"not {fwd.instance}): ask Redis again",
            )
        step = fwd.step
        step.deadline, step.rtc, step.arrived = self.clock() + fwd.budget_s, rtc, arrived
        if step.restart:  # the router found this node the owner: it starts the episode over
            assert self.restart is not None
            return await self.restart(step, arrival)
        if not self.table.holds(fwd.episode, fwd.device, fwd.token, fwd.claim):
            # a claim this node does not hold: obey Redis, which has the last word (a
            # forward that was in flight while the episode moved must never start a second
            # owner; a token re-issued after a lossy failover is another claim id)
            try:
                info = await self.claims.lookup(fwd.episode)
            except PoolExhausted as exc:
                raise Unavailable("busy", str(exc), 1.0) from exc
            except BackendUnavailable as exc:
                raise Unavailable("redis", str(exc), 1.0) from exc
            held = None if info is None else (info.device, info.token, info.claim)
            if held != (fwd.device, fwd.token, fwd.claim) or (info and info.moved):
                raise Refused(
                    409,
                    "stale_token",
                    f"episode {fwd.episode!r} is no longer {fwd.device} with token {fwd.token}",
                )
        if self.lease.leaving:
            await self.handovers.hand_over(fwd.episode)
            raise Refused(409, "moved", f"node {self.node_id} handed {fwd.episode!r} over")
        assignment = Assignment(fwd.episode, fwd.routing, fwd.device, fwd.token, self.node_id,  # type: ignore[arg-type]
                                "", None, fwd.claim, fwd.instance, fwd.model)  # fmt: skip
        try:
            return await self.serve(assignment, step, arrival)
        except ClaimEnded as exc:  # its router asks Redis again (never sent back here)
            await self.let_go(fwd.episode, fwd.device, fwd.token, fwd.claim)
            raise Refused(409, "ended", str(exc)) from None

    async def undo(
        self, episode: str, seq: int | None, origin: str = "", doubt: bool = False
    ) -> None:
        """Undo step ``seq`` of ``episode`` (or forward ``origin``'s), served here, whose
        reply reached nobody (a step that named its seq is held for the retry instead), or
        may have reached its client (``doubt``: the next step starts clean and says so). An
        undo for an episode whose record was handed over since follows it there (where it
        leaves the episode in doubt anyway: the record before the step did not move)."""
        if self.table.moving(episode):  # the undo waits for the move, or spoils it
            await self.mover.undo_during_move(
                episode, None if origin else seq, origin or None, doubt
            )
            return
        if self.table.undo(episode, None if origin else seq, origin or None, doubt):
            return
        if self.table.get(episode) is None and self.table.moved_to(episode) is not None:
            await self.mover.undo_moved(episode, None if origin else seq, origin or None)

    # ---- let go ------------------------------------------------------------------------

    async def end(self, episode: str, token: int, *, strict: bool = False) -> None:
        """End ``episode`` here (a step that said ``end``, a closed websocket, an end
        forwarded by a router). Drop the record if it serves ``token``. Then release it in
        Redis, token-checked. ``strict``: raise what the release raises; else a release
        Redis cannot take now is left to the episode's backstop. An end that arrives while
        the episode is being moved waits for the move; if it moved, the end follows it."""
        if self.table.moving(episode):
            await self.table.wait_moved(episode)
            if self.table.get(episode) is None and await self.mover.end_moved(episode):
                return
        self.table.release(episode, "end", token)
        ending = self._ending[episode] = asyncio.Event()
        try:
            if strict:
                await self.claims.release(episode, token, reason="end", owner=True)
                return
            try:
                await self.claims.release(episode, token, owner=True)
            except (StaleToken, UnknownEpisode):
                pass
            except BackendUnavailable as exc:  # its backstop ends it instead
                log.warning("could not release %s: %s", episode, exc)
        finally:
            ending.set()
            if self._ending.get(episode) is ending:
                del self._ending[episode]

    async def let_go(self, episode: str, device: str, token: int, claim: str) -> bool:
        """A step of a claim this node refuses (ended here: an end, an idle expiry, a
        hand-over) while Redis may still name that claim as this node's. Redis restored
        from a snapshot older than a move, an end whose release was lost: the claim would
        be refused for as long as its robot retries. So hand it over in Redis at once,
        token-checked: its next resolve reassigns it, ``state_reset``. True when it did."""
        await self.ended(episode)  # an end's release in flight: Redis answers after it
        try:
            info = await self.claims.lookup(episode)
        except AffinityError as exc:
            log.warning("could not ask Redis about %s: %s", episode, exc)
            return False
        if (
            info is None
            or (info.device, info.token, info.claim) != (device, token, claim)
            or info.moved
            or info.revoked
            or info.device not in self.local_devices
            or self.table.holds(episode, device, token, claim)
        ):
            return False
        try:
            handed = await self.claims.handoff(episode, token)
        except AffinityError as exc:
            log.warning("could not hand %s over: %s", episode, exc)
            return False
        if handed:
            self.metrics.owner_dropped.labels("refused").inc()
            log.warning(
                "episode %r: Redis names claim %s of %s as this node's, which no longer "
                "holds it (ended or handed over here; Redis restored from an older "
                "snapshot?): handed over in Redis, its next step is reassigned, state_reset",
                episode,
                claim,
                device,
            )
        return handed

    async def ended(self, episode: str) -> None:
        """Wait for the release of an end of ``episode`` in flight here, if any (bounded by
        the Redis deadline). Until then Redis still holds the claim the end dropped. A step
        that asks it would be sent back here to a claim that no longer exists."""
        ending = self._ending.get(episode)
        if ending is not None:
            await ending.wait()

    async def leave(self) -> None:
        """The graceful stop (:meth:`HandOvers.leave`)."""
        await self.handovers.leave()

    async def flush(self) -> None:
        """The flusher's flush (:meth:`Flusher.flush`) under this process's registration."""
        await self.flusher.flush(self.lease.instance if self.lease.registered else None)

    async def recheck(self) -> None:
        """Drop each record of a device back up after it went down that Redis no longer
        names: a step moved its episode elsewhere (``reassigned``) while the device was down,
        and it must never serve again. The others are served from memory again
        (``node/health.py``). Raises what Redis raised (the next call checks again)."""
        for device, mark in (await self.health.back_up()).items():
            held = [(e, r.token) for e, r in self.table.owned() if r.device == device]
            for at in range(0, len(held), RECHECK_BATCH):  # a round trip per batch
                batch = held[at : at + RECHECK_BATCH]
                found = await self.claims.lookup_many([episode for episode, _ in batch])
                for (episode, token), info in zip(batch, found, strict=True):
                    if info is not None and (info.device, info.token) == (device, token):
                        continue
                    if self.table.release(episode, "lost", token) is not None:
                        log.info("episode %r moved off %s while it was down: its state here "
                                 "is dropped", episode, device)  # fmt: skip
                        self.metrics.owner_dropped.labels("lost").inc()
            self.health.checked(device, mark)

    def refresh_gauges(self) -> None:
        for device in self.local_devices:
            self.metrics.live.labels(device).set(self.table.live(device))
            queued = (d.queued(device) for d in self.dispatchers.values() if device in d.devices)
            self.metrics.queue_depth.labels(device).set(sum(queued))
