"""Routing of one step: resolve the episode in Redis, then serve it here or forward it once.

Every front door calls :meth:`Routing.act` with a decoded :class:`~node.step.Step`; the
owner side of a forward is :meth:`Routing.serve_forwarded`. Nothing here knows a wire
format except the forward's own msgpack body (``node/forward.py``).

- The lease is checked before anything else and again after the model ran.
- A node serves an episode only with the (device, token, claim id) Redis has just
  confirmed for this request: the router's resolve, or — for a forward whose claim differs
  from the one held here — a lookup by the owner, which then obeys what Redis says (a
  claim it has never seen starts clean state; one Redis no longer holds is refused with
  409 and the router resolves again once). It serves only while the registration Redis
  names for its node id is this process's (``Membership.check_instance``).
- The client's deadline bounds the whole step; a forward carries what is left of it, less
  a margin for the way back, and the owner keeps the step's state only within that budget,
  so a step the client was told failed never advanced the episode.
- A step whose reply does not reach a live caller is undone at the owner
  (:meth:`Routing.undelivered`): a front door whose client left calls it; a router whose
  forward was cut off (its deadline, its client leaving, a broken connection) tells the
  owner to undo whatever that forward applied before it answers its own client, so the
  client's retry never finds the step applied.
- While the node is leaving (graceful stop), an episode held here is handed over after its
  in-flight step and the request is routed again, to the episode's new owner.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from affinity import (
    Assignment,
    BackendUnavailable,
    Claims,
    InvalidArgument,
    ModelConflict,
    ModelId,
    NoCapacity,
    NotReplicated,
    PoolExhausted,
    Recovering,
    StaleToken,
    UnknownEpisode,
    UnknownModel,
)
from node.admission import Admission
from node.catalog import Catalog, Dispatchers
from node.config import NodeConfig
from node.control import control_feed
from node.dispatcher import Arrival, DeviceDown, ForwardCancelled, ModelFailure, SeqConflict
from node.forward import Forward, ForwardError, Poster, Response, decode_reply
from node.membership import Membership
from node.metrics import ROUTING, Metrics
from node.peers import PeerHealth
from node.policy import InvalidInput, PolicyContract, inputs_from_arrays
from node.rtc import Ask
from node.step import Refused, Reply, Step, Unavailable

__all__ = ["FORWARD_MARGIN_S", "MAX_HINTS", "TRANSIENT", "UNDO_S", "Routing"]

log = logging.getLogger("affinity.node")

FORWARD_MARGIN_S = 0.05
"""Kept back from a forwarded step's budget for the owner's reply to reach the router."""

STALE_HINT = frozenset({"fenced", "leaving", "device_down", "unknown_device"})
"""What an owner named by a hint may answer that sends the router to Redis (once). So does
an owner the forward never reached (:class:`_NotSent`: it left after a hand-over, say);
one that broke after the forward left is not retried (the step may have run there): the
hint is gone, so the client's retry resolves."""


class _TimeLimit:
    """``asyncio.timeout(delay)`` for the step path at a third of its cost (one timer
    handle, no state machine; ``asyncio.timeout`` costs ~6 µs a step): when ``delay``
    seconds pass before the ``with`` block ends, its task is cancelled and the block raises
    :class:`TimeoutError`; a cancellation from elsewhere passes through unchanged (the
    task's ``cancelling()`` count tells them apart, as ``asyncio.timeout`` does)."""

    __slots__ = ("_cancelling", "_delay", "_expired", "_handle", "_task")

    def __init__(self, delay: float) -> None:
        self._delay = delay

    def __enter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None, "a time limit needs a task"
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._handle = task.get_loop().call_later(self._delay, self._expire)

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        self._handle.cancel()
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and kind is asyncio.CancelledError
        ):
            raise TimeoutError from exc


class _NotSent(Unavailable):
    """``owner_unreachable`` for a forward that never left this node (refused connection):
    the step did not run anywhere, so it may be routed again."""


MAX_HINTS = 65_536
"""How many episodes' owners a router remembers (the oldest is forgotten first)."""

UNDO_S = 0.5
"""How long a router waits for the owner to confirm an undo before answering its client."""

TRANSIENT = frozenset(
    {
        "owner_unreachable",
        "owner_refused",
        "redis",
        "full",
        "no_nodes",
        "fenced",
        "device_down",
        "recovering",
        "not_replicated",
    }
)
"""503 reasons worth retrying inside the node for clients that cannot retry themselves."""


class Routing:
    """Resolve, serve or forward (see the module doc)."""

    def __init__(
        self,
        config: NodeConfig,
        claims: Claims,
        dispatcher: Dispatchers,
        membership: Membership,
        metrics: Metrics,
        contract: PolicyContract,
        pool: Poster,
        clock: Callable[[], float] = time.monotonic,
        catalog: Catalog | None = None,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.claims = claims
        self.dispatcher = dispatcher
        self.membership = membership
        self.metrics = metrics
        self.contract = contract
        self.pool = pool
        self.clock = clock
        self.catalog = catalog
        self.first_model = next(iter(dispatcher.by_model))  # a step that names none
        # name -> "name@version" of the models served here (for the replies)
        ids = catalog.local_ids() if catalog else []
        self.models = {m.name: str(m) for m in ids}
        self.local_devices = frozenset(dispatcher.devices)
        self.ownership = membership.ownership
        self.admission = (
            Admission(
                config.admission_wait_s, clock=clock, on_waiting=metrics.admission_waiting.set
            )
            if config.admission_wait_s
            else None
        )
        self._rr = 0
        # the labelled children of the per-step metrics (labels() takes a lock each call)
        self._routing_counted = {r: metrics.routing.labels(r) for r in ROUTING}
        self._act_seconds = {p: metrics.act_seconds.labels(p) for p in ("local", "forwarded")}
        self.peers = PeerHealth()
        self._restarting: dict[str, int] = {}  # episodes whose restart claim is in flight
        self.hints: dict[str, Assignment] = {}
        """Episode -> its owner elsewhere, as the last forward found it (oldest first):
        where this router forwards next without asking Redis. Never authority: the owner
        checks the claim and answers 409 when it does not hold it, and this router
        resolves again."""

    # ---- the router ------------------------------------------------------------------

    async def act(self, step: Step, *, patient: bool = False) -> Reply:
        """Route and serve one step within ``step.deadline``.

        ``patient`` retries transient conditions (owner unreachable, a Redis blip, ``full``)
        inside the node until the deadline, for clients that cannot retry (openpi's).
        Raises :class:`Unavailable` (503), :class:`Refused` (its status), and
        ``InvalidArgument`` for a bad id."""
        started = time.perf_counter()
        if step.arrived is None:
            step.arrived = self.clock()
        arrival = self.dispatcher.arrival()  # lets a device with a waiting step wait for it
        try:
            reply = await self._within_deadline(step, patient, arrival)
        except Unavailable as exc:
            self.metrics.routing.labels(
                exc.reason if exc.reason in ("full", "no_nodes") else "unavailable"
            ).inc()
            raise
        except Refused:
            self.metrics.routing.labels("failed").inc()
            raise
        finally:
            arrival.done()
        counted = self._routing_counted.get(reply.routing)
        (counted or self.metrics.routing.labels(reply.routing)).inc()
        path = "local" if reply.node == self.node_id else "forwarded"
        self._act_seconds[path].observe(time.perf_counter() - started)
        return reply

    async def _within_deadline(self, step: Step, patient: bool, arrival: Arrival) -> Reply:
        last: Unavailable | None = None
        late: Reply | None = None
        backoff = 0.025
        try:
            with _TimeLimit(step.deadline - self.clock()):
                while True:
                    try:
                        reply = await self._route(step, arrival)
                        break
                    except Unavailable as exc:
                        if not patient or exc.reason not in TRANSIENT:
                            raise
                        last = exc
                    await asyncio.sleep(min(backoff, last.retry_after))
                    backoff = min(backoff * 2, 0.5)
            if self.clock() >= step.deadline:
                # served past the deadline without a suspension the timeout could cancel (a
                # quick run on the event loop after a stall), or the cancellation was
                # swallowed (gh-86296, Python 3.11): answered 503, so it must not stay done
                late = reply
                raise TimeoutError
            return reply
        except TimeoutError:
            if late is not None:
                await self.undelivered(late)
            if last is not None:
                raise last from None
            raise Unavailable(
                "deadline", f"no answer within {self.config.act_deadline_s}s", 1.0
            ) from None

    async def _route(self, step: Step, arrival: Arrival, *, owner: bool = False) -> Reply:
        """``owner``: a restart forwarded here by a router that found this node the owner."""
        self.membership.check_lease()
        if step.episode is None:
            return await self._stateless(step, arrival)
        hint: Assignment | None = None
        unsent: _NotSent | None = None  # the hinted owner refused the connection
        if step.restart:
            # only the owner starts its episode over: it drops what it holds, then claims
            # anew, so no node serves the old claim from memory meanwhile
            if not owner:
                try:  # the episode's own model: a restart may name any
                    current = await self._resolve(step.episode, claim=False)
                except UnknownEpisode:
                    current = None
                if current is not None and current.node != self.node_id:
                    return await self._forward(current, step, arrival, retry=True)
            self.hints.pop(step.episode, None)
            self._restarting[step.episode] = self._restarting.get(step.episode, 0) + 1
            try:  # not served from memory meanwhile; the fresh claim replaces the record
                a = await self._resolve(
                    step.episode,
                    restart=True,
                    deadline=step.deadline,
                    model=step.model or self.first_model,
                    version=step.version or "",
                )
            finally:
                left = self._restarting.pop(step.episode) - 1
                if left:
                    self._restarting[step.episode] = left
            if a.node != self.node_id:
                self.dispatcher.release(step.episode)  # the new owner is another node
            return await self._routed(a, replace(step, restart=False), arrival)
        elif self.membership.authority() and step.episode not in self._restarting:
            # the owner serves the episodes it holds from memory (node/ownership.py); a
            # router forwards to where the episode was last time (the owner checks it)
            held = self.ownership.serving(step.episode, self.membership.instance)
            if held is not None:
                if self._names_other(step, held.model):
                    raise Refused(
                        409,
                        "model_conflict",
                        str(ModelConflict(step.episode, held.model, self._asked(step))),
                    )
                return await self._serve(held, step, arrival)
            hint = self.hints.get(step.episode)
            if hint is not None and not self._names_other(step, hint.model):
                # (a hint of another model or version: Redis answers, 409 or a new place)
                try:
                    return await self._forward(hint, step, arrival, retry=True)
                except Unavailable as exc:
                    if exc.reason not in STALE_HINT and not isinstance(exc, _NotSent):
                        raise
                    # the owner it names cannot serve (it left, fenced, is gone): ask Redis
                    unsent = exc if isinstance(exc, _NotSent) else None
        a = await self._resolve(
            step.episode,
            claim=not step.live_only,
            deadline=step.deadline,
            model=step.model or self.first_model,
            version=step.version or "",
        )
        if unsent is not None and hint is not None and (a.node, a.token) == (hint.node, hint.token):
            raise unsent  # Redis still names the owner that refused: unreachable, not moved
        return await self._routed(a, step, arrival)

    def _asked(self, step: Step) -> str:
        """The model a step names: ``"name@version"``, or its name alone."""
        name = step.model or self.first_model
        return f"{name}@{step.version}" if step.version else name

    def _names_other(self, step: Step, model: str) -> bool:
        """Whether ``step`` names another model name or version than ``model`` (an
        episode's ``"name@version"``; ``""``: a fleet without models), as resolve.lua
        decides it (``model_conflict``)."""
        if not model:
            return False
        name, _, version = model.partition("@")
        return (step.model or self.first_model) != name or (step.version or version) != version

    async def _routed(self, a: Assignment, step: Step, arrival: Arrival) -> Reply:
        """Serve or forward the step of ``a``, which Redis has just decided."""
        if a.node == self.node_id:
            self.membership.check_instance(a.instance)  # the registration must be this one's
        if a.node != self.node_id:
            return await self._forward(a, step, arrival, retry=True)
        if self.membership.leaving:
            # this node is handing its episodes over: this one goes now, then to its new owner
            await self.membership.hand_over(a.episode)
            a = await self._resolve(
                a.episode, claim=not step.live_only, model=step.model or self.first_model
            )
            if a.node == self.node_id:
                raise Unavailable("leaving", f"node {self.node_id} is shutting down", 1.0)
            return await self._forward(a, step, arrival, retry=False)
        return await self._serve(a, step, arrival)

    async def _resolve(
        self,
        episode: str,
        *,
        restart: bool = False,
        claim: bool = True,
        deadline: float | None = None,
        model: str = "",
        version: str = "",
    ) -> Assignment:
        """Raises ``UnknownEpisode`` when not ``claim`` and Redis holds no assignment.
        ``deadline``: a new step's; with ``--admission-wait`` a claim that finds every
        device full waits in the backlog until then at most (``node/admission.py``).
        ``model``/``version``: what the step names (Redis keeps an episode on its own;
        another version is :class:`Refused` 409 ``model_conflict``, a model no node
        registered 404 ``unknown_model``)."""

        def resolve() -> Awaitable[Assignment]:
            return self.claims.resolve(
                episode, restart=restart, claim=claim, model=model, version=version
            )

        try:
            try:
                assignment = await resolve()
            except NoCapacity as exc:
                if self.admission is None or deadline is None or exc.reason != "at_capacity":
                    raise
                assignment = await self.admission.wait(episode, resolve, deadline)
            self.peers.resolved(assignment)
            if assignment.status != "hit" and assignment.model:
                m = ModelId.parse(assignment.model)
                self.metrics.model_claims.labels(m.name, m.version, assignment.status).inc()
            return assignment
        except ModelConflict as exc:
            raise Refused(409, "model_conflict", str(exc)) from exc
        except UnknownModel as exc:
            served = self.catalog.served() if self.catalog else []
            raise Refused(404, "unknown_model", str(UnknownModel(exc.model, served))) from exc
        except PoolExhausted as exc:
            raise Unavailable("busy", str(exc), 1.0) from exc
        except NotReplicated as exc:  # nobody serves it: retry once the replicas catch up
            raise Unavailable("not_replicated", str(exc), 1.0) from exc
        except BackendUnavailable as exc:
            raise Unavailable("redis", str(exc), 1.0) from exc
        except Recovering as exc:
            raise Unavailable("recovering", str(exc), max(1.0, exc.retry_after_s)) from exc
        except NoCapacity as exc:
            if exc.reason == "no_nodes":
                raise Unavailable("no_nodes", str(exc), 1.0) from exc
            raise Unavailable("full", str(exc), 2.0) from exc

    async def _stateless(self, step: Step, arrival: Arrival) -> Reply:
        name = step.model or self.first_model
        if name not in self.dispatcher.by_model:
            raise Refused(
                404,
                "unknown_model",
                f"node {self.node_id} does not serve model {name!r}: a step without an "
                "episode runs where it arrives (send it to a node that serves the model)",
            )
        dispatcher = self.dispatcher.of(name)
        up = [d for d in self.dispatcher.devices if not self.dispatcher.tracker(d).down]
        if not up:
            raise Unavailable("device_down", "every device of this node is down", 5.0)
        device = up[self._rr % len(up)]
        self._rr += 1
        arrival.done()
        inputs = {**step.inputs, **control_feed(dispatcher.contract, None, start=True, end=True)}
        outputs = await dispatcher.run_stateless(device, inputs)
        return Reply(
            outputs, None, device, self.node_id, 0, "stateless", False, False,
            url=self.config.advertise_url, model=self.models.get(name, ""),
        )  # fmt: skip

    async def _serve(self, a: Assignment, step: Step, arrival: Arrival) -> Reply:
        """Run the step here, on the device and with the token Redis confirmed."""
        if a.device not in self.local_devices:
            raise Unavailable(
                "unknown_device",
                f"Redis assigns episode {a.episode!r} to {a.device}, which node "
                f"{self.node_id} does not serve; its registration is being renewed",
                1.0,
            )
        name = a.model.partition("@")[0] or step.model or self.first_model
        if name not in self.dispatcher.by_model:
            raise Unavailable(
                "unknown_device",
                f"Redis assigns episode {a.episode!r} with model {name!r} to {a.device}, "
                f"whose node {self.node_id} does not serve it; its registration is being renewed",
                1.0,
            )
        dispatcher = self.dispatcher.of(name)
        self.membership.check_lease()  # the resolve may have taken a while: check again
        arrival.done()  # handed to its device now
        started = time.perf_counter()
        try:
            result = await dispatcher.step(
                a.device,
                a.episode,
                a.token,
                a.status == "claimed",
                {
                    **step.inputs,
                    **control_feed(dispatcher.contract, a.episode, start=False, end=step.end),
                },
                claim=a.claim,
                seq=step.seq,
                origin=step.origin,
                deadline=step.deadline,
                execute_steps=step.execute_steps,
                ensemble=step.ensemble,
                rtc=step.rtc,
                arrived=step.arrived,
            )
        except SeqConflict as exc:
            raise Refused(409, "seq_conflict", str(exc)) from None
        except ForwardCancelled as exc:  # its router answered 503 deadline already
            raise Unavailable("deadline", str(exc), 1.0) from None
        except DeviceDown as exc:
            raise Unavailable("device_down", str(exc), 5.0) from exc
        except ModelFailure as exc:
            self.metrics.model_failures.labels(exc.device).inc()
            raise Refused(500, "model_failure", str(exc)) from exc
        if self.membership.fenced():  # the lease ran out while the model ran
            self.dispatcher.release(a.episode)
            raise Unavailable("fenced", f"node {self.node_id} lease ran out during the step", 1.0)
        if result.source == "model" and not result.replayed and step.arrived is not None:
            dispatcher.observed(a.episode, result.seq, self.clock() - step.arrived)
        if step.end:
            await self.end_episode(a.episode, a.token)
        # The client's echo of its last token tells a lost assignment (Redis restarted
        # empty, a failover dropped the last writes) from a new episode.
        reset = result.state_reset or (step.client_token not in (None, a.token))
        return Reply(
            result.outputs,
            a.episode,
            a.device,
            self.node_id,
            a.token,
            a.status,
            reset,
            step.degraded,
            url=self.config.advertise_url,
            source=result.source,
            timing={"device_ms": (time.perf_counter() - started) * 1000},
            seq=result.seq,
            replayed=result.replayed,
            rtc=None if result.rtc is None else result.rtc.to_json(),
            model=a.model or self.models.get(name, ""),
        )

    async def undelivered(self, reply: Reply) -> None:
        """Undo the step of ``reply``, which did not reach a live caller: here when it was
        served here, else by telling its owner (bounded by :data:`UNDO_S`). A replayed
        reply undoes nothing: its step was applied by an earlier attempt, whose own fate
        decides (e.g. a timed-out attempt read after its retry was answered)."""
        if reply.episode is None or reply.replayed:
            return
        if not reply.origin:
            self.dispatcher.undo(reply.episode, reply.seq)
            return
        await self._undo_at(reply.url, reply.episode, reply.token, reply.device, reply.origin)

    async def _undo_at(self, url: str, episode: str, token: int, device: str, origin: str) -> None:
        body = Forward(episode, token, device, "hit", {}, UNDO_S, origin=origin, undo=True)
        try:
            async with asyncio.timeout(UNDO_S):
                resp = await self.pool.post(url, body.encode())
            if resp.status == 204:
                return
            problem = f"it answered {resp.status}"
        except (TimeoutError, ForwardError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        log.warning("could not tell %s to undo a step of %r (%s)", url, episode, problem)

    async def end(self, episode: str) -> str | None:
        """End ``episode`` where it lives (``POST /episodes/<id>/end`` on any node): its
        owner drops it, then releases it in Redis, token-checked; a release sent to
        another node is forwarded to the owner, so no owner keeps serving from memory an
        episode Redis gave up. Returns the device it was on, None when Redis holds no
        assignment. Raises ``StaleToken``/``UnknownEpisode`` (it changed meanwhile),
        ``BackendUnavailable``, :class:`Unavailable` (an owner alive but unreachable)."""
        info = await self.claims.lookup(episode)
        if info is None:
            return None
        if info.node == self.node_id or not info.alive:  # nobody serves it from memory elsewhere
            await self._end_here(episode, info.token, strict=True)
            return info.device
        body = Forward(episode, info.token, info.device, "hit", {}, UNDO_S, release=True)
        try:
            async with asyncio.timeout(self.config.act_deadline_s):
                resp = await self.pool.post(info.url, body.encode())
        except (TimeoutError, ForwardError) as exc:
            raise Unavailable(
                "owner_unreachable",
                f"episode {episode!r} is owned by {info.node} ({info.url}), which did not "
                f"answer: {exc}",
                1.0,
            ) from exc
        if resp.status != 204:
            code, message = _error_of(resp)
            raise Unavailable(code, f"owner {info.node} answered {resp.status}: {message}", 1.0)
        return info.device

    async def _end_here(self, episode: str, token: int, *, strict: bool = False) -> None:
        """Drop the record of ``episode`` if it serves ``token``, then release it in Redis
        (``strict``: raise what the release raises)."""
        claim = self.dispatcher.claim_of(episode)
        if claim is None or claim[1] == token:
            self.dispatcher.release(episode)
        self.hints.pop(episode, None)
        if strict:
            await self.claims.release(episode, token, reason="end", owner=True)
            return
        try:
            await self.claims.release(episode, token, owner=True)
        except (StaleToken, UnknownEpisode):
            pass
        except BackendUnavailable as exc:  # its backstop ends it instead
            log.warning("could not release %s: %s", episode, exc)

    async def end_episode(self, episode: str, token: int) -> None:
        """End ``episode``, served here under ``token`` (a step that said ``end``, a closed
        websocket): :meth:`_end_here`; a release Redis cannot take now is left to the
        episode's backstop."""
        await self._end_here(episode, token)

    # ---- forwarding --------------------------------------------------------------------

    async def _forward(self, a: Assignment, step: Step, arrival: Arrival, *, retry: bool) -> Reply:
        budget = step.deadline - self.clock() - FORWARD_MARGIN_S
        if budget <= 0:
            raise Unavailable("deadline", f"no time left to forward to {a.node}", 1.0)
        origin = os.urandom(8).hex()
        body = Forward(
            episode=a.episode,
            token=a.token,
            device=a.device,
            routing=a.status,
            inputs=step.inputs,
            budget_s=budget,
            end=step.end,
            degraded=step.degraded,
            client_token=step.client_token,
            execute_steps=step.execute_steps,
            ensemble=step.ensemble,
            seq=step.seq,
            origin=origin,
            claim=a.claim,
            instance=a.instance,
            model=self._asked(step) if step.restart else a.model,
            rtc=step.rtc,
            elapsed_s=0.0 if step.arrived is None else max(0.0, self.clock() - step.arrived),
            restart=step.restart,
        ).encode()
        arrival.done()  # it leaves this node
        self.hints.pop(a.episode, None)  # kept again only when this forward is answered
        try:
            resp = await self.pool.post(a.url, body)
        except asyncio.CancelledError:
            # cut off (the deadline, the client left): the owner may have applied the step
            # and even sent its reply; it is undone there before this caller hears anything
            await self._undo_at(a.url, a.episode, a.token, a.device, origin)
            raise
        except ForwardError as exc:
            if not exc.unsent:  # it broke after the request left: the step may have run
                await self._undo_at(a.url, a.episode, a.token, a.device, origin)
            self.metrics.forwarded.labels("unreachable").inc()
            self.peers.failed(a.node, a.url, exc)
            raise (_NotSent if exc.unsent else Unavailable)(
                "owner_unreachable",
                f"episode {a.episode!r} is owned by {a.device} on {a.node} ({a.url}), "
                f"which did not answer: {exc}",
                1.0,
            ) from exc
        self.peers.answered(a.node)
        if resp.status == 200:
            try:
                reply = decode_reply(resp.body)
            except ValueError as exc:
                self.metrics.forwarded.labels("unreachable").inc()
                raise Unavailable("owner_unreachable", f"owner {a.node}: {exc}", 1.0) from exc
            self.metrics.forwarded.labels("ok").inc()
            reply.origin = origin
            self._hint(a, step.end or step.restart)
            return reply
        self.metrics.forwarded.labels("refused").inc()
        code, message = _error_of(resp)
        text = f"owner {a.node} answered {resp.status}: {message}"
        if code == "seq_conflict":
            raise Refused(409, code, message)
        if resp.status in (409, 421):  # not there (any more): ask Redis
            if not retry:
                raise Unavailable("owner_refused", text, 1.0)
            # our view was stale: resolve once more
            again = await self._resolve(
                a.episode,
                claim=not step.live_only,
                model=step.model or self.first_model,
                version=step.version or "",
            )
            if again.node == self.node_id:
                return await self._serve(again, step, arrival)
            return await self._forward(again, step, arrival, retry=False)
        if resp.status == 503 or code == "bad_secret":  # the nodes' secrets differ: not the
            raise Unavailable(code, text, float(resp.headers.get("retry-after", "1")))  # client's
        raise Refused(resp.status, code, text)

    def _hint(self, a: Assignment, ended: bool) -> None:
        if ended:
            self.hints.pop(a.episode, None)
            return
        if a.episode not in self.hints and len(self.hints) >= MAX_HINTS:
            del self.hints[next(iter(self.hints))]
        self.hints[a.episode] = a if a.status == "hit" else a._replace(status="hit", previous=None)

    # ---- the owner ---------------------------------------------------------------------

    async def serve_forwarded(self, body: bytes, secret: str | None) -> Reply | None:
        """Serve a step another node resolved and forwarded here, or undo the step a
        forward applied (``undo``; returns None).

        Refuses (403) a wrong cluster secret, (400) a malformed forward, (421) a device not
        on this node, (409) a (device, token) Redis no longer holds for the episode or an
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
            self.dispatcher.undo(fwd.episode, origin=fwd.origin)
            return None
        if fwd.release:
            await self._end_here(fwd.episode, fwd.token)
            return None
        name = fwd.model.partition("@")[0] or self.first_model
        rtc = fwd.rtc
        if name in self.dispatcher.by_model:
            try:  # the router checked them against the model; a node serving another one
                inputs_from_arrays(self.dispatcher.of(name).contract, fwd.inputs)  # refuses
            except InvalidInput as exc:  # them as the client's error (never a crash)
                raise Refused(
                    422, "bad_input", f"not an input of node {self.node_id}'s model: {exc}"
                ) from None
            try:  # checked against this node's model and --control-hz, as the inputs are
                ask = fwd.rtc or Ask()
                rtc = self.dispatcher.of(name).rtc_for(ask.executed, ask.delay, ask.control_hz)
            except InvalidArgument as exc:
                raise Refused(422, "bad_input", f"node {self.node_id}: {exc}") from None
        elif not fwd.restart:  # a restart may name a model served elsewhere: its claim says
            raise Refused(421, "not_owner", f"node {self.node_id} does not serve model {name!r}")
        arrival = self.dispatcher.arrival()
        try:
            with _TimeLimit(fwd.budget_s):
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
        self.membership.check_lease()
        self.membership.check_instance(fwd.instance)
        step = fwd.step(self.clock() + fwd.budget_s)
        step.rtc, step.arrived = rtc, arrived
        if fwd.restart:  # the router found this node the owner: it starts the episode over
            return await self._route(step, arrival, owner=True)
        if not self.dispatcher.holds(fwd.episode, fwd.device, fwd.token, fwd.claim):
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
            if held != (fwd.device, fwd.token, fwd.claim):
                raise Refused(
                    409,
                    "stale_token",
                    f"episode {fwd.episode!r} is no longer {fwd.device} with token {fwd.token}",
                )
        if self.membership.leaving:
            await self.membership.hand_over(fwd.episode)
            raise Refused(409, "moved", f"node {self.node_id} handed {fwd.episode!r} over")
        a = Assignment(fwd.episode, fwd.routing, fwd.device, fwd.token, self.node_id, "", None,  # type: ignore[arg-type]
                       fwd.claim, fwd.instance, fwd.model)  # fmt: skip
        return await self._serve(a, step, arrival)


def _error_of(resp: Response) -> tuple[str, str]:
    try:
        err = json.loads(resp.body)["error"]
        return str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        return "owner_error", resp.body[:200].decode("utf-8", "replace")
