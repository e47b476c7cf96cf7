"""May this node serve an episode, and serve it: the owner's authority over its episodes.

Redis decides who owns an episode, once, in the claim; the owner decides each step
(DESIGN.md, "Ownership and steps"). A step of an episode whose record this node holds is
served from memory, with no Redis command, while the lease is valid (``node/lease.py``),
the last flush succeeded less than a lease ago, and the episode's backstop in Redis is
more than :data:`EXPIRY_MARGIN_S` away by this node's clock.

Only the owner lets an episode go (DESIGN.md rule 8): a client's end, idle expiry, an
operator's revocation (carried out at the renewal that brings it), a hand-over. Each drops
the record first (the table then refuses any step of that claim still queued), then tells
Redis: at once for an end or a hand-over, in the next flush for idle expiry (a load slot
may stay taken until then, never the reverse).

The flush (``affinity/lua/flush.lua``, one round trip, at most once a second, only when
there is something to say) releases what idled out and slides the backstop of an episode
stepped since its last slide once that backstop is less than a lease + :data:`SLIDE_AHEAD_S`
from running out: with the default 300 s idle timeout, one slide every ~5 minutes a
stepping episode. An episode Redis answers as lost (another claim holds it) is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from affinity import (
    Assignment,
    BackendUnavailable,
    Claims,
    InvalidArgument,
    PoolExhausted,
    Registry,
    StaleToken,
    UnknownEpisode,
)
from affinity.registry import Held, MoveRequest, Registered
from affinity.transfers import Transfers
from node import inputs
from node.config import NodeConfig
from node.control import control_feed
from node.dispatcher import Arrival, DeviceDown, ModelFailure, MultiGpuDispatcher
from node.episodes import ClaimEnded, EpisodeTable, ForwardCancelled, NotKept, SeqConflict
from node.forward import Forward, Poster
from node.handover import Mover, Outcome, Reason
from node.health import DeviceHealth
from node.inputs import InvalidInput
from node.lease import Lease
from node.metrics import Metrics
from node.rtc import Ask
from node.step import Refused, Reply, Step, TimeLimit, Unavailable

if TYPE_CHECKING:
    from node.router import Router

__all__ = ["EXPIRY_MARGIN_S", "MOVES_AT_ONCE", "SLIDE_AHEAD_S", "Owner"]

log = logging.getLogger("affinity.node")

SLIDE_AHEAD_S = 3.0
"""A stepped episode is slid once its backstop has less than a lease TTL + this left (the
flush runs every second; this leaves room for retries)."""
EXPIRY_MARGIN_S = 1.0
"""Never served from memory within this of its backstop by the owner's clock (drift)."""
MOVES_AT_ONCE = 16
"""How many episodes a graceful stop hands over at a time."""


class Owner:
    """Serve from memory, serve what a router forwards, let go, flush (see the module doc).
    It is the lease's listener (``node.lease.LeaseListener``)."""

    def __init__(
        self,
        config: NodeConfig,
        table: EpisodeTable,
        dispatchers: Mapping[str, MultiGpuDispatcher],
        lease: Lease,
        health: DeviceHealth,
        claims: Claims,
        lease_claims: Claims,
        registry: Registry,
        metrics: Metrics,
        pool: Poster,
        clock: Callable[[], float] = time.monotonic,
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
        self.lease_claims = lease_claims  # the lease's own pool (hand-overs at a stop)
        self.registry = registry  # the lease's own pool (flushes)
        self.metrics = metrics
        self.clock = clock
        self.lease_ttl_s = config.settings.lease_ttl_s
        self.backstop_s = config.settings.backstop_ms / 1000
        self.idle_ttl_s = config.settings.episode_ttl_s
        self.local_devices = frozenset(health.devices)
        self.arrivals = next(iter(dispatchers.values())).arrivals
        # name -> "name@version" of the models served here (for the replies)
        self.models = {name: d.model for name, d in dispatchers.items()}
        self.router: Router | None = None  # set by the service: a restart claims through it
        self.flushed_at = float("-inf")  # send time of the last flush that succeeded
        self.grace_ms = 0  # the fleet's grace period left, as the last script said
        self._slid: dict[str, float] = {}  # episode -> send time of its backstop's last write
        self._idle: list[tuple[str, int]] = []  # dropped here for idleness: to release
        self._releasing: set[str] = set()  # in the flush in flight: never from memory
        self._handing: dict[str, asyncio.Task[Outcome]] = {}
        self._ending: dict[str, asyncio.Event] = {}  # ends whose release in Redis is in flight
        self._moving: set[asyncio.Task[Outcome]] = set()  # operators' moves under way
        self._gate = asyncio.Semaphore(MOVES_AT_ONCE)  # hand-overs under way, at most
        self.mover = Mover(
            self.node_id,
            table,
            lease,
            Transfers(lease_claims.redis, config.settings),
            lease_claims,
            pool,
            metrics,
            {name: d.contract for name, d in dispatchers.items()},
            config.cluster_secret,
            clock,
        )
        lease.listener = self

    # ---- may I serve -------------------------------------------------------------------

    def current(self) -> bool:
        """Whether the last flush succeeded less than a lease TTL ago."""
        return self.clock() < self.flushed_at + self.lease_ttl_s

    def serving(self, episode: str) -> Assignment | None:
        """The assignment to serve ``episode`` from memory now, or None (ask Redis): a
        record held here, a valid lease, a current flush, its backstop not near, and a
        device that is not down. The caller checks that the step names its model."""
        if not self.lease.may_serve():
            return None
        record = self.table.get(episode)
        if record is None or episode in self._releasing or not self.current():
            return None
        if not record.confirmed or self.table.moving(episode):
            return None  # handed over here, not yet confirmed by Redis; or moving away
        slid = self._slid.get(episode)  # None: claimed since the last flush, backstop fresh
        if slid is not None and self.clock() >= slid + self.backstop_s - EXPIRY_MARGIN_S:
            return None  # its backstop is near (flushes failed): Redis answers, and slides it
        if self.health.down(record.device):
            return None  # Redis moves it: the resolve says reassigned
        return Assignment(episode, "hit", record.device, record.token, self.node_id, self.url,
                          None, record.claim, self.lease.instance, record.model)  # fmt: skip

    # ---- serve -------------------------------------------------------------------------

    async def serve(self, a: Assignment, step: Step, arrival: Arrival) -> Reply:
        """Run the step here, on the device and under the claim Redis confirmed. It is
        answered only if its result was kept under the registration it started with.
        Raises :class:`Unavailable`, :class:`Refused` and ``ClaimEnded`` (the claim ended
        here meanwhile: nothing applied; ask Redis again)."""
        if a.device not in self.local_devices:
            raise Unavailable(
                "unknown_device",
                f"Redis assigns episode {a.episode!r} to {a.device}, which node "
                f"{self.node_id} does not serve; its registration is being renewed",
                1.0,
            )
        name = a.model.partition("@")[0] or step.model or self.first_model
        dispatcher = self.dispatchers.get(name)
        if dispatcher is None:
            raise Unavailable(
                "unknown_device",
                f"Redis assigns episode {a.episode!r} with model {name!r} to {a.device}, "
                f"whose node {self.node_id} does not serve it; its registration is being renewed",
                1.0,
            )
        if self.table.moving(a.episode):  # a hand-over is under way: wait for it (bounded
            await self.table.wait_moved(a.episode)  # by the step's deadline), then go on
        generation = self.table.generation  # the registration this step is served under
        self.lease.require()  # the resolve may have taken a while: check again
        arrival.done()  # handed to its device now
        started = time.perf_counter()
        try:
            result = await dispatcher.step(
                step,
                a,
                inputs={
                    **step.inputs,
                    **control_feed(dispatcher.contract, a.episode, start=False, end=step.end),
                },
                generation=generation,
            )
        except SeqConflict as exc:
            raise Refused(409, "seq_conflict", str(exc)) from None
        except ForwardCancelled as exc:  # its router answered 503 deadline already
            raise Unavailable("deadline", str(exc), 1.0) from None
        except NotKept as exc:
            raise Unavailable("fenced", str(exc), 1.0) from None
        except ClaimEnded:
            if any(ep == a.episode for ep, _ in self._idle):
                await self.flush()  # it idled out here: release it now, so a resolve claims anew
            raise
        except DeviceDown as exc:
            raise Unavailable("device_down", str(exc), 5.0) from exc
        except ModelFailure as exc:
            self.metrics.model_failures.labels(exc.device).inc()
            raise Refused(500, "model_failure", str(exc)) from exc
        try:  # the lease ran out, or the node registered anew, while the model ran
            self.lease.require(generation)
        except Unavailable:
            if not result.replayed:
                self.table.undo(a.episode, result.seq)  # answered 503: not applied
            raise
        if result.source == "model" and not result.replayed and step.arrived is not None:
            dispatcher.observed(a.episode, result.seq, self.clock() - step.arrived)
        if step.end:
            await self.end(a.episode, a.token)
        # A client's echo of its last claim (or token) tells a lost assignment (Redis
        # restarted empty, a failover dropped the last writes) from a new episode when the
        # step started clean; a claim that changed with the record (a hand-over) is no reset.
        echoed = result.seq == 1 and (
            step.client_claim not in (None, a.claim)
            if step.client_claim is not None and a.claim
            else step.client_token not in (None, a.token)
        )
        timing = {"device_ms": (time.perf_counter() - started) * 1000}
        if result.run_s and not result.replayed:  # the model ran for this step
            timing["queue_ms"], timing["run_ms"] = result.queue_s * 1000, result.run_s * 1000
        return Reply(
            result.outputs,
            a.episode,
            a.device,
            self.node_id,
            a.token,
            a.status,
            result.state_reset or echoed,
            step.degraded,
            url=self.url,
            source=result.source,
            timing=timing,
            seq=result.seq,
            replayed=result.replayed,
            rtc=None if result.rtc is None else result.rtc.to_json(),
            model=a.model or self.models.get(name, ""),
            claim=a.claim,
            held=step.seq is not None,
        )

    async def serve_forwarded(self, body: bytes, secret: str | None) -> Reply | None:
        """Serve a step another node resolved and forwarded here; or undo (``undo``) or
        end (``release``) what a forward names (None).

        Refuses (403) a wrong cluster secret, (400) a malformed forward, (421) a device not
        on this node, (409) a claim Redis no longer holds for the episode, a registration
        other than this process's (the router's view is stale: it asks Redis), or an
        episode this leaving node just handed over; 503 when out of budget or fenced."""
        received = self.clock()
        expected = self.config.cluster_secret or ""
        if expected and not hmac.compare_digest((secret or "").encode(), expected.encode()):
            raise Refused(403, "bad_secret", "missing or wrong cluster secret")
        try:
            fwd = Forward.decode(body)
        except ValueError as exc:
            raise Refused(400, "bad_forward", str(exc)) from None
        if fwd.device not in self.local_devices:
            raise Refused(421, "not_owner", f"device {fwd.device!r} is not on node {self.node_id}")
        if fwd.undo:
            await self.undo(fwd.episode, fwd.step.seq, fwd.step.origin)
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
            assert self.router is not None
            return await self.router.restart_here(step, arrival)
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
            await self.hand_over(fwd.episode)
            raise Refused(409, "moved", f"node {self.node_id} handed {fwd.episode!r} over")
        assignment = Assignment(fwd.episode, fwd.routing, fwd.device, fwd.token, self.node_id,  # type: ignore[arg-type]
                                "", None, fwd.claim, fwd.instance, fwd.model)  # fmt: skip
        try:
            return await self.serve(assignment, step, arrival)
        except ClaimEnded as exc:  # its router asks Redis again
            raise Refused(409, "ended", str(exc)) from None

    async def undo(self, episode: str, seq: int | None, origin: str = "") -> None:
        """Undo step ``seq`` of ``episode`` (or forward ``origin``'s), served here, whose
        reply reached nobody (a step that named its seq is held for the retry instead). An
        undo for an episode whose record was handed over since follows it there."""
        if self.table.undo(episode, None if origin else seq, origin or None):
            return
        if self.table.get(episode) is None and self.table.moved_to(episode) is not None:
            await self.mover.undo_moved(episode, None if origin else seq, origin or None)

    # ---- let go ------------------------------------------------------------------------

    async def end(self, episode: str, token: int, *, strict: bool = False) -> None:
        """End ``episode`` here (a step that said ``end``, a closed websocket, an end
        forwarded by a router): drop the record if it serves ``token``, then release it in
        Redis, token-checked. ``strict``: raise what the release raises; else a release
        Redis cannot take now is left to the episode's backstop."""
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

    async def ended(self, episode: str) -> None:
        """Wait for the release of an end of ``episode`` in flight here, if any (bounded by
        the Redis deadline): until then Redis still holds the claim the end dropped, and a
        step that asks it would be sent back here to a claim that no longer exists."""
        ending = self._ending.get(episode)
        if ending is not None:
            await ending.wait()

    async def hand_over(self, episode: str, reason: Reason = "stop", target: str = "") -> Outcome:
        """Hand ``episode`` over once its in-flight step (if any) finished: with its state
        to a device that serves its model and has room (``node/handover.py``), else
        without it (its next step is ``reassigned``, ``state_reset``). Idempotent;
        concurrent callers share one hand-over. :data:`MOVES_AT_ONCE` run at a time (a
        drain's, a graceful stop's and an operator's together); an episode waiting its turn
        goes on stepping here."""
        task = self._handing.get(episode)
        if task is None:
            task = asyncio.ensure_future(self._gated(episode, reason, target))
            self._handing[episode] = task
            task.add_done_callback(lambda _: self._handing.pop(episode, None))
        return await asyncio.shield(task)

    async def _gated(self, episode: str, reason: Reason, target: str) -> Outcome:
        async with self._gate:
            return await self.mover.hand_over(episode, reason, target)

    def move_requested(self, moves: Sequence[MoveRequest]) -> None:
        """Carry out the moves an operator asked (read at the renewal): every episode of a
        drained device, or one episode to a target; in the background."""
        for move in moves:
            if move.device:
                episodes = [ep for ep, r in self.table.records() if r.device == move.device]
                targets = [(ep, "drain", "") for ep in episodes]
            else:
                targets = [(move.episode, "move", move.target)]
            for ep, reason, target in targets:
                task = asyncio.ensure_future(self.hand_over(ep, reason, target))  # type: ignore[arg-type]
                self._moving.add(task)
                task.add_done_callback(self._moving.discard)

    async def leave(self) -> None:
        """The graceful stop: no new episodes here; every episode is handed over with its
        state (after its in-flight step; :data:`MOVES_AT_ONCE` at a time), or without it
        when nothing can take it, within ``--drain-timeout``; what is left then is handed
        over by the deregistration, without its state. Then the node deregisters, while it
        still listens (forwards get answers, not connection errors)."""
        if self.lease.leaving:
            return
        started = self.clock()
        registered = self.lease.registered
        await self.lease.begin_leave()
        held = [episode for episode, _ in self.table.records()]
        outcomes: list[Outcome | BaseException] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.drain_timeout_s):
                outcomes = await asyncio.gather(
                    *(self.hand_over(ep, "stop") for ep in held), return_exceptions=True
                )
        self.table.drop_all("handed")
        released = await self.lease.end()
        if registered:
            log.info(
                "node %s left: moved %d episode(s) with their state, handed over %d without, "
                "deregistered %d more in %.2fs",
                self.node_id,
                sum(o == "moved" for o in outcomes),
                sum(o == "reset" for o in outcomes),
                max(released, 0),
                self.clock() - started,
            )

    # ---- the lease's listener ------------------------------------------------------------

    def held(self) -> list[Held]:
        """Every record held here, as re-asserted at a registration."""
        return [Held(ep, r.device, r.token, r.claim, r.model) for ep, r in self.table.records()]

    def registered(self, held: Sequence[Held], done: Registered, sent: float) -> None:
        lost = self._unchanged(held, done.lost)
        for episode in lost:
            self.table.release(episode, "lost")
        if lost:
            self.metrics.owner_dropped.labels("lost").inc(len(lost))
        self.grace_ms = done.grace_ms
        self.flushed_at = sent  # every backstop of what is held is fresh now
        for h in held:
            self._slid[h.episode] = sent

    def revoked(self, revoked: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        for episode, token in revoked:  # released in Redis by an operator
            if self.table.release(episode, "revoked", token) is not None:
                log.info("episode %r was released in Redis: its state here is dropped", episode)
                self.metrics.owner_dropped.labels("revoked").inc()
        return list(revoked)  # carried out, held or not

    def server_changed(self) -> None:
        self._slid.clear()  # every record is due (and stays due until a flush succeeds)

    def dropped(self) -> None:
        self._slid.clear()
        self._idle.clear()

    def _unchanged(self, sent: Sequence[Held], lost: Sequence[str]) -> list[str]:
        """The episodes of ``lost`` (Redis' answer to ``sent``) whose record here is still
        the claim that was sent: one ended, or claimed anew, meanwhile stays."""
        sent_as = {h.episode: (h.device, h.token, h.claim) for h in sent}
        out = []
        for episode in lost:
            record = self.table.get(episode)
            if record is not None and (record.device, record.token, record.claim) == sent_as.get(
                episode
            ):
                out.append(episode)
        return out

    # ---- the flush ---------------------------------------------------------------------

    async def flush(self) -> None:
        """Expire idle records here, then release them and slide the backstops in one
        round trip (nothing to say: no round trip). Raises what the registry raises; the
        work is kept for the next flush."""
        sent = self.clock()
        expired = self.table.expire_idle(self.idle_ttl_s)
        if expired:
            self.metrics.owner_dropped.labels("idle").inc(len(expired))
        self._idle.extend(expired)
        records = self.table.records()
        never = float("-inf")
        due = self.backstop_s - self.lease_ttl_s - SLIDE_AHEAD_S
        slide = [
            Held(ep, r.device, r.token, r.claim, r.model)
            for ep, r in records
            if r.last_used > self._slid.get(ep, never) and sent - self._slid.get(ep, never) >= due
        ]
        holding = {ep for ep, _ in records}
        idle = [(ep, token) for ep, token in self._idle if ep not in holding]
        if not slide and not idle:
            self.flushed_at = sent
            self._prune(holding)
            return
        if not self.lease.registered:
            return
        self._releasing = {ep for ep, _ in idle}
        try:
            done = await self.registry.flush(self.node_id, self.lease.instance, slide, idle)
        finally:
            self._releasing = set()
        if done is None:
            return  # no current lease here: the renewal registers again
        released = {ep for ep, _ in idle}
        self._idle = [item for item in self._idle if item[0] not in released]
        lost = self._unchanged(slide, done.lost)
        if lost:
            self.metrics.owner_dropped.labels("lost").inc(len(lost))
        for episode in lost:
            log.warning(
                "episode %r is no longer this node's in Redis (another claim holds it, or "
                "it was released): its state here is dropped",
                episode,
            )
            self.table.release(episode, "lost")
        self.grace_ms = done.grace_ms
        if not done.replicated:  # a failover could undo the slides: not done, sent again
            log.warning(
                "flush of node %s: fewer Redis replicas than --redis-replicas acknowledged "
                "its slides; they are sent again at the next flush",
                self.node_id,
            )
            return
        for h in slide:
            self._slid[h.episode] = sent
        self.flushed_at = sent
        self._prune({ep for ep, _ in self.table.records()})

    def _prune(self, holding: set[str]) -> None:
        for episode in [ep for ep in self._slid if ep not in holding]:
            del self._slid[episode]

    def refresh_gauges(self) -> None:
        for device in self.local_devices:
            self.metrics.live.labels(device).set(self.table.live(device))
