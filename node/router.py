"""Find the owner of a step's episode and forward the step once: the router.

Every front door calls :meth:`Router.act` with a decoded :class:`~node.step.Step`. The
layers each add one concern, outermost first:

- :meth:`Router.act`: metrics.
- ``_act_within_deadline``: the client's deadline, patient retries.
- ``_act_handling_restart``: a restart is made by the owner; an episode held here is
  served from memory; a hint is tried.
- ``_act_asking_again``: the one re-resolve. An owner that turned out stale (it no longer
  holds the claim, it is another process, it is handing its episodes over) sends the step
  back to Redis once; the leaves below never resolve themselves.
- ``_act_at_owner``: serve here, or forward once.

Routers ask, owners answer: Redis (a resolve) decides who owns an episode. A hint (the
owner the last forward found, :class:`Locator`) is only where to ask first. It is evicted
when the owner answers that it does not hold the episode. Nothing a router knows fences
any node. A step whose reply reaches nobody is undone at its owner (:meth:`Router.undelivered`),
unless it named its ``seq``: then it is held for the client's retry. The questions to
Redis are ``node/resolver.py``'s; a step without an episode is ``node/stateless.py``'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace

from affinity import (
    Assignment,
    Claims,
    ModelConflict,
    UnknownEpisode,
    wire,
)
from node.catalog import Catalog
from node.config import NodeConfig
from node.dispatcher import Arrival, MultiGpuDispatcher
from node.errors import ClaimEnded, ForwardError, Refused, Unavailable
from node.forward import ROWS_PATH, Forward, Poster, Response, decode_reply, send_undo
from node.health import DeviceHealth
from node.jobs import together
from node.lease import Lease
from node.metrics import Metrics
from node.owner import Owner
from node.peers import PeerHealth
from node.resolver import Placement, Resolver
from node.stateless import Stateless
from node.step import Reply, Step, TimeLimit
from node.timing import StepTimes

__all__ = ["FORWARD_MARGIN_S", "MAX_HINTS", "TRANSIENT", "UNDO_S", "Locator", "Router"]

log = logging.getLogger("affinity.node")

FORWARD_MARGIN_S = 0.05
"""Kept back from a forwarded step's budget for the owner's reply to reach the router."""

STALE_HINT = frozenset({"fenced", "leaving", "device_down", "unknown_device"})
"""What an owner named by a hint may answer that sends the router to Redis (once). So does
an owner the forward never reached (:class:`_NotSent`: it left after a hand-over, say);
one that broke after the forward left is not retried (the step may have run there): the
hint is gone, so the client's retry resolves."""

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


class _NotSent(Unavailable):
    """``owner_unreachable`` for a forward that never left this node (refused connection):
    the step did not run anywhere, so it may be routed again."""


class _Stale(Unavailable):
    """The owner Redis (or a hint) named cannot serve the step as named: Redis is asked
    again, once (:meth:`Router._act_asking_again`). Raised as it is, its 503, when Redis was
    asked again already."""


class _LetGo(_Stale):
    """This node refused a claim Redis named when asked again, and handed it over in Redis
    (token-checked): asking once more finds a fresh claim."""


class Locator:
    """Where each episode's owner was last found (Orleans' locator cache): never
    authority, only where to forward first. Evicted when the owner says it does not hold
    the episode, cannot be reached, or the episode ends; the oldest goes past
    :data:`MAX_HINTS`."""

    def __init__(self) -> None:
        self._hints: OrderedDict[str, Assignment] = OrderedDict()

    def lookup(self, episode: str) -> Assignment | None:
        return self._hints.get(episode)

    def remember(self, assignment: Assignment) -> None:
        if assignment.episode not in self._hints and len(self._hints) >= MAX_HINTS:
            self._hints.popitem(last=False)
        self._hints[assignment.episode] = (
            assignment
            if assignment.status == "hit"
            else assignment._replace(status="hit", previous=None)
        )

    def forget(self, episode: str) -> None:
        self._hints.pop(episode, None)

    def __len__(self) -> int:
        return len(self._hints)


class Router:
    """Resolve, then serve here or forward once (see the module doc)."""

    def __init__(
        self,
        config: NodeConfig,
        claims: Claims,
        dispatchers: dict[str, MultiGpuDispatcher],
        lease: Lease,
        owner: Owner,
        health: DeviceHealth,
        metrics: Metrics,
        pool: Poster,
        clock: Callable[[], float] = time.monotonic,
        catalog: Catalog | None = None,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.claims = claims
        self.arrivals = next(iter(dispatchers.values())).arrivals
        self.lease = lease
        self.owner = owner
        self.metrics = metrics
        self.pool = pool
        self.clock = clock
        self.peers = PeerHealth()
        placement = Placement(config.placement, config.placement_headroom, config.control_hz)
        self.resolver = Resolver(claims, owner.first_model, metrics, self.peers,
                                 config.admission_wait_s, clock, catalog, placement)  # fmt: skip
        self.stateless = Stateless(self.node_id, config.advertise_url, dispatchers, health,
                                   owner.models)  # fmt: skip
        self._restarting: dict[str, int] = {}  # episodes whose restart claim is in flight
        self.locator = Locator()
        self.times = StepTimes(metrics, self.node_id, config.control_hz)

    # ---- the layers --------------------------------------------------------------------

    async def act(
        self, step: Step, *, patient: bool = False, resolved: Assignment | None = None
    ) -> Reply:
        """Route and serve one step within ``step.deadline``.

        ``patient`` retries transient conditions (owner unreachable, a Redis blip, ``full``)
        inside the node until the deadline, for clients that cannot retry (openpi's).
        ``resolved``: what Redis answered for the step just now (a row of a message,
        :meth:`act_rows`), tried first instead of a lookup here.
        Raises :class:`Unavailable` (503), :class:`Refused` (its status), and
        ``InvalidArgument`` for a bad id."""
        started = time.monotonic()
        if step.received is None:
            step.received = started
        if step.arrived is None:
            step.arrived = self.clock()
        arrival = self.arrivals.arrival()  # lets a device with a waiting step wait for it
        try:
            reply = await self._act_within_deadline(step, patient, arrival, resolved)
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
        self._served(step, reply, started)
        return reply

    def _served(self, step: Step, reply: Reply, started: float) -> None:
        """Count a served step: its routing, its path's seconds, its split."""
        now = time.monotonic()  # one clock read for both
        assert step.received is not None
        self.times.served(step, reply, now - started, now - step.received)

    async def _act_within_deadline(
        self, step: Step, patient: bool, arrival: Arrival, resolved: Assignment | None
    ) -> Reply:
        last: Unavailable | None = None
        late: Reply | None = None
        backoff = 0.025
        try:
            with TimeLimit(step.deadline - self.clock()):
                while True:
                    try:
                        reply = await self._act_handling_restart(step, arrival, resolved)
                        break
                    except Unavailable as exc:
                        resolved = None  # a retry asks again
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

    async def _act_handling_restart(
        self, step: Step, arrival: Arrival, resolved: Assignment | None = None
    ) -> Reply:
        if not self.lease.left:
            self.lease.require()
        elif step.episode is None:  # a node that left routes episodes' steps, runs none
            raise Unavailable("leaving", f"node {self.node_id} is shutting down", 1.0)
        if step.episode is None:
            return await self.stateless.run(step, arrival)
        if resolved is not None and not step.restart:  # Redis answered for it just now
            return await self._act_asking_again(
                step, arrival, self._act_at_owner(resolved, step, arrival)
            )
        if step.restart:
            # only the owner starts its episode over: it drops what it holds, then claims
            # anew, so no node serves the old claim from memory meanwhile
            try:  # the episode's own model: a restart may name any
                current = await self.resolver.resolve(step.episode, claim=False)
            except UnknownEpisode:
                current = None
            if current is not None and current.node != self.node_id:
                return await self._act_asking_again(
                    step, arrival, self._forward(current, step, arrival)
                )
            return await self.restart_here(step, arrival)
        hint: Assignment | None = None
        unsent: _NotSent | None = None  # the hinted owner refused the connection
        if step.episode not in self._restarting:
            # the owner serves the episodes it holds from memory; a router forwards to
            # where the episode was last time (the owner checks it)
            held = self.owner.serving(step.episode)
            if held is not None:
                if self.resolver.names_other(step, held.model):
                    raise Refused(
                        409,
                        "model_conflict",
                        str(ModelConflict(step.episode, held.model, self.resolver.asked(step))),
                    )
                try:  # the hot path: no layer more than it needs
                    return await self._serve_here(held, step, arrival)
                except _Stale:
                    return await self._act_asking_again(step, arrival, None)
            hint = self.locator.lookup(step.episode) if self.lease.may_serve() else None
            if hint is not None and not self.resolver.names_other(step, hint.model):
                # (a hint of another model or version: Redis answers, 409 or a new place)
                try:
                    return await self._forward(hint, step, arrival)
                except _Stale:
                    pass  # it does not hold the episode (any more): ask Redis
                except Unavailable as exc:
                    if exc.reason not in STALE_HINT and not isinstance(exc, _NotSent):
                        raise
                    # the owner it names cannot serve (it left, fenced, is gone): ask Redis
                    unsent = exc if isinstance(exc, _NotSent) else None
        assignment = await self.resolver.for_step(step)
        if (
            unsent is not None
            and hint is not None
            and (assignment.node, assignment.token) == (hint.node, hint.token)
        ):
            raise unsent  # Redis still names the owner that refused: unreachable, not moved
        return await self._act_asking_again(
            step, arrival, self._act_at_owner(assignment, step, arrival)
        )

    async def restart_here(self, step: Step, arrival: Arrival) -> Reply:
        """Start ``step``'s episode over, this node being its owner (or none being): drop
        what is held here, claim anew, serve the step there."""
        assert step.episode is not None
        self.locator.forget(step.episode)
        self._restarting[step.episode] = self._restarting.get(step.episode, 0) + 1
        try:  # not served from memory meanwhile; the fresh claim replaces the record
            assignment = await self.resolver.resolve(
                step.episode,
                restart=True,
                deadline=step.deadline,
                model=step.model or self.resolver.first_model,
                version=step.version or "",
            )
        finally:
            left = self._restarting.pop(step.episode) - 1
            if left:
                self._restarting[step.episode] = left
        if assignment.node != self.node_id:
            self.owner.table.release(step.episode, "end")  # the new owner is another node
        step = replace(step, restart=False)
        return await self._act_asking_again(
            step, arrival, self._act_at_owner(assignment, step, arrival)
        )

    async def _act_asking_again(
        self, step: Step, arrival: Arrival, first: Awaitable[Reply] | None
    ) -> Reply:
        """``first`` (the step at the owner found first; None: it turned out stale
        already); if that owner turned out stale (:class:`_Stale`), Redis is asked again
        and the step goes to the owner it names then. Once: a second stale owner is the
        step's 503, unless it was this node refusing a claim Redis names, which it let go
        in Redis (:class:`_LetGo`): the third answer is a fresh claim."""
        if first is not None:
            try:
                return await first
            except _Stale:
                pass
        for tries_left in (1, 0):
            assignment = await self.resolver.for_step(step)
            try:
                return await self._act_at_owner(assignment, step, arrival, again=True)
            except _LetGo:
                if not tries_left:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _act_at_owner(
        self, assignment: Assignment, step: Step, arrival: Arrival, *, again: bool = False
    ) -> Reply:
        """Serve or forward the step of ``assignment``, which Redis has just decided
        (``again``: a second time, for this step)."""
        if assignment.node != self.node_id:
            return await self._forward(assignment, step, arrival)
        self.lease.require_instance(
            assignment.instance
        )  # Redis' word: the registration must be ours
        if self.lease.leaving:
            leaving = f"node {self.node_id} is shutting down"
            if again:
                raise Unavailable("leaving", leaving, 1.0)
            # this node is handing its episodes over: this one goes now, then to its new owner
            await self.owner.handovers.hand_over(assignment.episode)
            raise _Stale("leaving", leaving, 1.0)
        return await self._serve_here(assignment, step, arrival, again=again)

    async def _serve_here(
        self, assignment: Assignment, step: Step, arrival: Arrival, *, again: bool = False
    ) -> Reply:
        """The owner serves ``assignment`` here; a claim that ended here meanwhile is
        :class:`_Stale` (a step queued behind an end, a release, an idle expiry), or
        :class:`_LetGo` when Redis named it when asked ``again`` and it was let go there."""
        try:
            return await self.owner.serve(assignment, step, arrival)
        except ClaimEnded as exc:
            error = _Stale("owner_refused", str(exc), 1.0)
        await self.owner.ended(
            assignment.episode
        )  # an end's release in flight: Redis answers after it
        if again:
            # Redis names, asked again, a claim this node ended: it is handed over in Redis
            # at once, so it is reassigned (state_reset), never refused for as long as its
            # robot retries
            a = assignment
            if await self.owner.let_go(a.episode, a.device, a.token, a.claim):
                raise _LetGo(error.reason, str(error), 1.0)
        raise error

    # ---- many episodes' steps in one message (issue 44) ---------------------------------

    async def act_rows(
        self, steps: list[Step], results: list[Reply | Exception | None], *, patient: bool = False
    ) -> None:
        """Route and serve the rows of one message, each row as :meth:`act` serves a step
        (its claim, stickiness, ``seq``, hand-over waits); ``results[i]`` becomes row i's
        reply, or the exception that is its error, as each row finishes (a caller cut off
        undoes the replies there). One row's failure never touches another's.

        A row held here is served from memory. The others' owners are found (a hint, else
        Redis: the rows' questions go together, in one round trip), grouped by owner, and
        each owner gets one message with its rows (:data:`~node.forward.ROWS_PATH`). A row
        its owner does not hold (any more), or an owner the message never reached, goes the
        one-row way alone (:meth:`act`: Redis is asked again). ``patient``: as
        :meth:`act`'s, for each row (a row of a message whose owner answered a transient 503
        goes alone again)."""
        started = time.monotonic()
        groups: dict[str, list[tuple[int, Assignment]]] = {}
        alone: list[int] = []
        unknown: list[int] = []
        resolved: dict[int, Assignment] = {}
        for i, step in enumerate(steps):
            if step.received is None:
                step.received = started
            if step.arrived is None:
                step.arrived = self.clock()
            episode = step.episode
            if (
                episode is None
                or step.restart
                or episode in self._restarting
                or not self.lease.may_serve()
                or self.owner.serving(episode) is not None
            ):
                alone.append(i)  # served here, stateless, or a restart: the one-row way
                continue
            hint = self.locator.lookup(episode)
            if hint is None:
                unknown.append(i)
            elif hint.node == self.node_id or self.resolver.names_other(step, hint.model):
                alone.append(i)
            else:
                groups.setdefault(hint.url, []).append((i, hint))
        if unknown:  # asked together: one round trip to Redis
            found = await self.resolver.for_steps([steps[i] for i in unknown])
            for i, got in zip(unknown, found, strict=True):
                if isinstance(got, Assignment):
                    if got.node == self.node_id:
                        resolved[i] = got
                        alone.append(i)
                    else:
                        groups.setdefault(got.url, []).append((i, got))
                elif patient and _transient(got):
                    alone.append(i)  # retried the one-row way, within its deadline
                else:
                    self._count_failure(got)
                    results[i] = got

        async def one(i: int) -> None:
            try:
                results[i] = await self.act(steps[i], patient=patient, resolved=resolved.get(i))
            except Exception as exc:  # the row's error, rendered by its door
                results[i] = exc

        async def group(rows: list[tuple[int, Assignment]]) -> None:
            again = await self._forward_rows(rows, steps, results, started)
            if patient:  # transient failures are retried the one-row way, within the deadline
                again += [i for i, _ in rows if _transient(results[i])]
            await asyncio.gather(*(one(i) for i in again))

        # the forwards first (the longest way: the owner's reply is what the message waits
        # for); a device's worker waits for the message's other rows (its batch window):
        # they become one run where the batch sizes allow, not one run each
        work = [*(group(g) for g in groups.values()), *(one(i) for i in alone)]
        await together(self.arrivals, work, batch=len(alone) > 1)

    def _count_failure(self, exc: Exception) -> None:
        if isinstance(exc, Unavailable):
            self.metrics.routing.labels(
                exc.reason if exc.reason in ("full", "no_nodes") else "unavailable"
            ).inc()
        elif isinstance(exc, Refused):
            self.metrics.routing.labels("failed").inc()

    async def _forward_rows(
        self,
        rows: list[tuple[int, Assignment]],
        steps: list[Step],
        results: list[Reply | Exception | None],
        started: float,
    ) -> list[int]:
        """Forward ``rows`` (of ``steps``, all of one owner) in one message; fill
        ``results`` with each row's answer. Returns the rows to route again one by one:
        those the owner does not hold as named, or all of them when the message never
        left this node."""
        owner = rows[0][1]
        budget = min(steps[i].deadline for i, _ in rows) - self.clock() - FORWARD_MARGIN_S
        if budget <= 0:
            for i, _ in rows:
                results[i] = Unavailable("deadline", f"no time left to forward to {owner.node}")
                self._count_failure(results[i])  # type: ignore[arg-type]
            return []
        origins: list[str] = []
        bodies: list[bytes] = []
        message = os.urandom(8).hex()  # the rows' forward ids: one random draw a message
        for k, (i, a) in enumerate(rows):
            step = steps[i]
            origins.append(f"{message}.{k}")
            arrived = step.arrived
            bodies.append(
                Forward(
                    step,
                    a.token,
                    a.device,
                    a.status,
                    budget,
                    claim=a.claim,
                    instance=a.instance,
                    model=a.model,
                    elapsed_s=0.0 if arrived is None else max(0.0, self.clock() - arrived),
                    origin=origins[-1],
                ).encode()
            )
            self.locator.forget(a.episode)  # kept again only when the row is answered
        sent = time.monotonic()
        unheld = [(a, o) for (i, a), o in zip(rows, origins, strict=True) if steps[i].seq is None]
        try:
            with TimeLimit(budget + FORWARD_MARGIN_S / 2):
                resp = await self.pool.post(owner.url, wire.encode({"rows": bodies}), ROWS_PATH)
        except asyncio.CancelledError:
            await self._undo_rows(unheld)  # the owner may have applied them
            raise
        except (ForwardError, TimeoutError) as exc:
            self.metrics.forwarded.labels("unreachable").inc()
            if isinstance(exc, ForwardError):
                self.peers.failed(owner.node, owner.url, exc)
                if exc.unsent:  # it never left: each row goes the one-row way (Redis asked)
                    return [i for i, _ in rows]
            await self._undo_rows(unheld)  # it broke after the message left: they may have run
            what = f"{exc}" if isinstance(exc, ForwardError) else f"nothing within {budget:.3f}s"
            for i, a in rows:
                results[i] = Unavailable(
                    "owner_unreachable",
                    f"episode {a.episode!r} is owned by {a.device} on {a.node} ({a.url}), "
                    f"which did not answer: {what}",
                    1.0,
                )
                self._count_failure(results[i])  # type: ignore[arg-type]
            return []
        self.peers.answered(owner.node)
        answers: list[object] = []
        if resp.status == 200:
            try:
                doc = wire.decode(resp.body)
                answers = list(doc["rows"]) if isinstance(doc, dict) else []
            except (ValueError, KeyError, TypeError):
                answers = []
            if len(answers) != len(rows):  # not an owner's answer: as if it broke
                broken = "its answer to a message of rows is malformed"
                answers = [{"status": 503, "code": "owner_unreachable", "message": broken}] * len(
                    rows
                )
        else:
            code, message = _error_of(resp)  # the message as a whole (a wrong secret)
            refusal = {"status": resp.status, "code": code, "message": message,
                       "retry_after": resp.headers.get("retry-after", "1")}  # fmt: skip
            answers = [refusal] * len(rows)
        self.metrics.forwarded.labels("ok" if resp.status == 200 else "refused").inc()
        hop = (time.monotonic() - sent) * 1000
        again: list[int] = []
        for (i, a), origin, answer in zip(rows, origins, answers, strict=True):
            step = steps[i]
            got = answer if isinstance(answer, dict) else {}
            status = got.get("status")
            if status == 200:
                try:
                    reply = decode_reply(got["reply"])
                except (KeyError, TypeError, ValueError) as exc:
                    results[i] = Unavailable("owner_unreachable", f"owner {a.node}: {exc}", 1.0)
                    self._count_failure(results[i])  # type: ignore[arg-type]
                    continue
                reply.timing["forward_ms"] = max(0.0, hop - reply.timing.get("device_ms", 0.0))
                reply.origin = origin
                reply.held = step.seq is not None
                if not (step.end or step.restart):
                    self.locator.remember(a)
                self._served(step, reply, started)
                results[i] = reply
                continue
            error = _refused_by(
                a.node,
                status if isinstance(status, int) else 503,
                str(got.get("code", "owner_error")),
                str(got.get("message", "")),
                got.get("retry_after"),
            )
            if isinstance(error, _Stale) or (
                isinstance(error, Unavailable) and error.reason in STALE_HINT
            ):
                again.append(i)  # not held there as named: Redis is asked again, for it alone
            else:
                self._count_failure(error)
                results[i] = error
        return again

    async def _undo_rows(self, rows: list[tuple[Assignment, str]]) -> None:
        await asyncio.gather(
            *(self._undo_at(a.url, a.episode, a.token, a.device, o) for a, o in rows)
        )

    # ---- undo and end ------------------------------------------------------------------

    async def undelivered(self, reply: Reply, doubt: bool = False) -> None:
        """Undo the step of ``reply``, which did not reach a live caller: here when it was
        served here, else by telling its owner (bounded by :data:`UNDO_S`). Nothing for a
        replayed reply (an earlier attempt applied it, whose own fate decides) or a step
        that named its ``seq`` (held for the client's retry). ``doubt``: it may have reached
        its caller (a front died handing it over), so the episode's next step starts clean
        and says ``state_reset``."""
        if reply.episode is None or reply.replayed or reply.held:
            return
        if not reply.origin:
            await self.owner.undo(reply.episode, reply.seq, doubt=doubt)
            return
        await self._undo_at(reply.url, reply.episode, reply.token, reply.device, reply.origin,
                            doubt)  # fmt: skip

    async def _undo_at(
        self, url: str, episode: str, token: int, device: str, origin: str, doubt: bool = False
    ) -> None:
        undo = Forward.about(episode, token, device, UNDO_S, origin=origin, undo=True,
                             doubt=doubt)  # fmt: skip
        problem = await send_undo(self.pool, url, undo)
        if problem:
            log.warning("could not tell %s to undo a step of %r (%s)", url, episode, problem)

    async def end_anywhere(self, episode: str) -> str | None:
        """End ``episode`` where it lives (``POST /episodes/<id>/end`` on any node). Its
        owner drops it, then releases it in Redis, token-checked. An end sent to another
        node is forwarded to the owner. So no owner keeps serving from memory an episode
        Redis gave up. Returns the device it was on, None when Redis holds no assignment.
        Raises ``StaleToken``/``UnknownEpisode`` (it changed meanwhile),
        ``BackendUnavailable``, :class:`Unavailable` (an owner alive but unreachable)."""
        info = await self.claims.lookup(episode)
        if info is None:
            return None
        self.locator.forget(episode)
        if info.node == self.node_id or not info.alive:  # nobody serves it from memory elsewhere
            await self.owner.end(episode, info.token, strict=True)
            return info.device
        body = Forward.about(episode, info.token, info.device, UNDO_S, release=True)
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

    async def end_here(self, episode: str, token: int) -> None:
        """End ``episode``, served here under ``token`` (a closed websocket's own episode):
        :meth:`Owner.end`; a release Redis cannot take now is left to its backstop."""
        self.locator.forget(episode)
        await self.owner.end(episode, token)

    # ---- forwarding --------------------------------------------------------------------

    async def _forward(self, owner: Assignment, step: Step, arrival: Arrival) -> Reply:
        """Forward ``step`` once to the owner Redis or a hint names; map its answer
        (:class:`_Stale` when it does not hold the episode)."""
        sent = time.monotonic()
        budget = step.deadline - self.clock() - FORWARD_MARGIN_S
        if budget <= 0:
            raise Unavailable("deadline", f"no time left to forward to {owner.node}", 1.0)
        origin = os.urandom(8).hex()
        body = Forward(
            step,
            owner.token,
            owner.device,
            owner.status,
            budget,
            claim=owner.claim,
            instance=owner.instance,
            model=self.resolver.asked(step) if step.restart else owner.model,
            elapsed_s=0.0 if step.arrived is None else max(0.0, self.clock() - step.arrived),
            origin=origin,
        ).encode()
        arrival.done()  # it leaves this node
        self.locator.forget(owner.episode)  # kept again only when this forward is answered
        held = step.seq is not None  # a step that names its seq is never undone: its retry is safe
        try:
            resp = await self.pool.post(owner.url, body)
        except asyncio.CancelledError:
            # cut off (the deadline, the client left): the owner may have applied the step
            # and even sent its reply; it is undone there before this caller hears anything
            if not held:
                await self._undo_at(owner.url, owner.episode, owner.token, owner.device, origin)
            raise
        except ForwardError as exc:
            if not exc.unsent and not held:  # it broke after the request left: it may have run
                await self._undo_at(owner.url, owner.episode, owner.token, owner.device, origin)
            self.metrics.forwarded.labels("unreachable").inc()
            self.peers.failed(owner.node, owner.url, exc)
            raise (_NotSent if exc.unsent else Unavailable)(
                "owner_unreachable",
                f"episode {owner.episode!r} is owned by {owner.device} on "
                f"{owner.node} ({owner.url}), which did not answer: {exc}",
                1.0,
            ) from exc
        self.peers.answered(owner.node)
        if resp.status == 200:
            try:
                reply = decode_reply(resp.body)
            except ValueError as exc:
                self.metrics.forwarded.labels("unreachable").inc()
                raise Unavailable("owner_unreachable", f"owner {owner.node}: {exc}", 1.0) from exc
            self.metrics.forwarded.labels("ok").inc()
            hop = (time.monotonic() - sent) * 1000 - reply.timing.get("device_ms", 0.0)
            reply.timing["forward_ms"] = max(0.0, hop)  # encoding, the network, decoding
            reply.origin = origin
            reply.held = held
            if not (step.end or step.restart):
                self.locator.remember(owner)
            return reply
        self.metrics.forwarded.labels("refused").inc()
        code, message = _error_of(resp)
        raise _refused_by(owner.node, resp.status, code, message, resp.headers.get("retry-after"))


def _error_of(resp: Response) -> tuple[str, str]:
    try:
        err = json.loads(resp.body)["error"]
        return str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        return "owner_error", resp.body[:200].decode("utf-8", "replace")


def _refused_by(
    node: str, status: int, code: str, message: str, retry_after: object
) -> Unavailable | Refused:
    """The step's error for an owner's refusal (:class:`_Stale`: ask Redis again)."""
    text = f"owner {node} answered {status}: {message}"
    if code == "seq_conflict":
        return Refused(409, code, message)
    if status in (409, 421):  # not there (any more), or not that process: ask Redis
        return _Stale("owner_refused", text, 1.0)
    if status == 503 or code == "bad_secret":  # the nodes' secrets differ: not the client's
        try:
            wait = float(retry_after) if isinstance(retry_after, int | float | str) else 1.0
        except ValueError:
            wait = 1.0
        return Unavailable(code, text, wait)
    return Refused(status, code, text)


def _transient(result: Reply | Exception | None) -> bool:
    return isinstance(result, Unavailable) and result.reason in TRANSIENT
