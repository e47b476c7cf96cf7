"""Ghost episodes: a candidate version shadows live episodes at their owner (issue 47).

For each shadow an operator started (``affinity shadow``, ``affinity/shadows.py``), the
owner of a chosen live episode of the live version runs each step's inputs through the
candidate too, after the live step's reply was built, as a *ghost episode*. A ghost has
its own recurrent state, chunk buffer and real-time-chunking chunk: a record in the
runner's own :class:`EpisodeTable` (the *ghost table*), kept by the candidate's own
dispatcher with the same commit rules as a live record. It is never in the live table,
never claimed in Redis, never flushed, and never answers the robot.

Off the step path, on spare capacity only: a live step's reply queues its ghost's step
(a copy of the outputs, nothing else). One task of the node (:meth:`ShadowRunner._drain`)
runs the queued ghost steps one at a time, each on the candidate's device worker (never
inline on the event loop), and each only once the node is *quiet*: no live step on its
way through the node nor queued or running on a device, and none answered in the last
``quiet_s``. It waits while live work is there (yields to every arriving live step), and
the divergence math waits for quiet again after the ghost's run. A ghost step not
started when its live episode's next step comes (its window), or beyond
``max_in_flight`` queued at once, is skipped (counted, reason ``busy``) and the ghost's
next run starts its state over, counted as a restart: a ghost that ran from its live
episode's first step and never restarted is *continuous*; the others' figures are kept
apart (``restarted_*``), never mixed. A saturating live load leaves no quiet: every
ghost step is skipped, and the live steps pay only the reply's hook.

Elsewhere: an owner that does not run the candidate sends the ghost step (the live step,
its outputs, seq, whether the live state started over; :class:`node.forward.GhostStep`)
to one of the nodes running it, which say so in Redis at each renewal
(:meth:`Shadows.advertise`), picked per episode by a rendezvous hash (:func:`_rank`), over
``POST /internal/ghost``, when quiet and under the same window and room (:meth:`_send`).
That node takes it as a ghost of its own (:meth:`receive`: the same ghost table, rules and
totals; a seq that does not follow restarts it); it frees it with the step that ends the
live episode, on a stop, or once no step came for ``idle_s`` (a lost end). A node not
reached or refusing counts ``failed`` at the owner and is passed over until the renewal.

Divergence: per compared step, the candidate's outputs minus the live ones (each output
both gave, same shape), as max-abs and L2 per action dimension (the last axis); kept per
ghost episode, per (candidate, live) pair, as metrics, and written to Redis at each
renewal (:meth:`Shadows.publish`).

Lifecycle: :meth:`ShadowRunner.sync` runs at each lease renewal. It reads the shadows
(no Redis command per step), frees every ghost of a stopped shadow, and frees the ghosts
whose live episode this node no longer holds (an end, idle expiry, a drop, a fence) once
no step of theirs waits or runs. A step that ends its episode ends its ghost once it ran.
A ghost freed while its step runs keeps its record until that run ends (then compared). A
crash takes the ghosts with the process. A hand-over carries the ghost in step with the live record
(:meth:`ShadowRunner.carry`, ``node/transfer.py``'s ``GhostCarry``); the new owner holds
it beside the copy (:meth:`ShadowRunner.adopt`); a ghost not in step stays behind and
restarts there.

Hazard: the live step's inputs and outputs are read, never written. The ghost gets
copies of the outputs and the same input arrays, which no one changes after the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from affinity import AffinityError, Assignment
from affinity.shadows import PairTotals, Shadow, Shadows, selected
from node.contract import PolicyContract
from node.control import control_feed
from node.dispatcher import MultiGpuDispatcher
from node.episodes import Episode, EpisodeTable
from node.forward import GHOST_PATH, GhostStep, Poster
from node.jobs import Arrivals
from node.record import StepResult
from node.recorder import Recorder
from node.step import Step
from node.transfer import GhostCarry, Install

__all__ = ["SHADOW_LABELS", "Ghost", "Sent", "ShadowRunner", "divergence"]

log = logging.getLogger("affinity.node")

Array = np.ndarray[Any, Any]

RESULTS = ("compared", "compared_restarted", "busy", "not_served", "failed")
"""A ghost step's outcomes: compared (its ghost continuous or restarted), or skipped."""
SHADOW_LABELS: dict[str, dict[str, tuple[str, ...] | str]] = {
    "affinity_shadow_steps_total": {"candidate": "shadow", "live": "shadow", "result": RESULTS},
    "affinity_shadow_restarts_total": {"candidate": "shadow", "live": "shadow"},
    "affinity_shadow_max_abs": {"candidate": "shadow", "live": "shadow"},
    "affinity_shadow_step_max_abs": {"candidate": "shadow", "live": "shadow"},
    "affinity_shadow_ghosts": {"candidate": "shadow", "live": "shadow"},
}
"""The shadow series and their labels (``shadow``: the ``name@version`` of a shadow an
operator started, candidate or live; docs/metrics.md)."""
DIVERGENCE_BUCKETS = (0.0, 1e-6, 1e-4, 1e-3, 0.01, 0.1, 1.0, 10.0)
MAX_IN_FLIGHT = 64
"""Ghost steps queued at once on one node (beyond: skipped, ``busy``)."""
QUIET_S = 0.002
"""How long the node must have answered no live step, with none on its way, before a
ghost step starts (seconds): robots in lock-step send their next steps closer together,
so a ghost runs in the pauses between their control periods, not between their steps."""
SEND_S = 2.0
"""How long a ghost step's send to the node running its candidate may take (then it
counts ``failed``, and that node is passed over until the renewal)."""
CARRY_WAIT_S = 0.25
"""How long a hand-over waits for its episode's ghost step on its way (then the ghost
stays behind and restarts at the new owner)."""


def divergence(candidate: Mapping[str, Array], live: Mapping[str, Array]) -> Array | None:
    """Per action dimension (the last axis), the max-abs and the L2 of ``candidate`` minus
    ``live`` over every output both hold with the same shape: an array of shape (2, D)
    (row 0 max-abs, row 1 L2), or None when no output compares."""
    rows = []
    for name, want in live.items():
        got = candidate.get(name)
        if got is None or np.shape(got) != np.shape(want) or np.ndim(want) == 0:
            continue
        a, b = np.asarray(got), np.asarray(want)
        if not (np.issubdtype(a.dtype, np.number) and np.issubdtype(b.dtype, np.number)):
            continue
        diff = (a.astype(np.float64) - b.astype(np.float64)).reshape(-1, a.shape[-1])
        rows.append(np.stack([np.abs(diff).max(axis=0), np.sqrt((diff**2).sum(axis=0))]))
    if not rows:
        return None
    width = max(r.shape[1] for r in rows)
    out = np.zeros((2, width))
    for r in rows:  # outputs of several widths: each dimension's worst
        out[0, : r.shape[1]] = np.maximum(out[0, : r.shape[1]], r[0])
        out[1, : r.shape[1]] = np.maximum(out[1, : r.shape[1]], r[1])
    return out


@dataclass
class Ghost:
    """One ghost episode: the candidate's record of a live episode (its state is in the
    ghost table under the episode id, with this token and claim)."""

    episode: str
    candidate: str
    live: str
    device: str
    token: int
    claim: str
    live_claim: str
    continuous: bool  # ran from its live episode's first step, never restarted
    last_seq: int = 0  # the live seq it ran last (0: none yet)
    restart: bool = False  # a step was skipped: its next run starts over
    waiting: list[tuple[Step, StepResult]] = field(default_factory=list)
    queued: bool = False  # in the runner's queue, its waiting step not started
    running: bool = False  # its step is on the candidate's worker
    settled: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))
    """Set while none of its steps waits nor runs (a hand-over waits for it)."""
    ran: bool = False  # it has a record in the ghost table
    compared: int = 0
    max_abs: float = 0.0  # this episode's worst step
    ended: bool = False
    remote: bool = False  # its live episode's owner is another node (``/internal/ghost``)
    touched: float = 0.0  # a remote ghost: when its last step came (clock)


@dataclass
class Sent:
    """A ghost this owner sends to another node, ``node`` at ``url``, which runs its
    candidate (this node does not): the step waiting to be sent, if any."""

    episode: str
    candidate: str
    live: str
    node: str
    url: str
    waiting: GhostStep | None = None
    queued: bool = False


class ShadowRunner:
    """The owner's ghosts (see the module doc). ``live`` is the node's episode table;
    ``live_dispatchers`` its models' dispatchers (their queues say whether a device is
    busy); ``candidates`` the candidate versions this node can run (``"name@version"`` ->
    a dispatcher on :attr:`table`). ``quiet_s`` (:data:`QUIET_S`) and ``max_in_flight``
    (:data:`MAX_IN_FLIGHT`): when a ghost step may start, how many may wait.
    ``recorder`` (``--record``): each compared ghost step joins its live episode's
    recording as the paired stream (:meth:`Recorder.offer_shadow`). Event loop only."""

    def __init__(
        self,
        node_id: str,
        live: EpisodeTable,
        table: EpisodeTable,
        live_dispatchers: Mapping[str, MultiGpuDispatcher],
        candidates: Mapping[str, MultiGpuDispatcher],
        shadows: Shadows | None,
        registry: CollectorRegistry,
        max_in_flight: int = MAX_IN_FLIGHT,
        clock: Callable[[], float] = time.monotonic,
        quiet_s: float = QUIET_S,
        recorder: Recorder | None = None,
        url: str = "",
        pool: Poster | None = None,
        idle_s: float = 300.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.node_id = node_id
        self.live = live
        self.table = table
        """The ghost table: the ghosts' records, apart from the live ones."""
        self.live_dispatchers = live_dispatchers
        self.candidates = dict(candidates)
        self.shadows = shadows
        self.max_in_flight = max_in_flight
        self.clock = clock
        self.quiet_s = quiet_s
        self.recorder = recorder
        self.url = url
        self.pool = pool
        self.idle_s = idle_s
        self.wall = wall
        self.runners: dict[str, dict[str, str]] = {}
        """Candidate not run here -> node id -> URL of the nodes running it (at renewal)."""
        self.unreachable: set[str] = set()  # URLs a ghost step failed to reach since then
        self.sent: dict[str, Sent] = {}  # the ghosts this owner sends elsewhere
        self._sends: deque[Sent] = deque()
        self._sender: asyncio.Task[None] | None = None
        # the live steps on their way through the node (one count for all its models)
        self.arrivals = next((d.arrivals for d in live_dispatchers.values()), Arrivals())
        self.last_live = -math.inf  # when the node last answered a live step (clock)
        self.known: dict[str, Shadow] = {}  # the shadows Redis held at the last renewal
        self.active: dict[str, Shadow] = {}
        """Live ``"name@version"`` -> the shadow running beside it (read at renewal)."""
        self.ghosts: dict[str, Ghost] = {}
        self.totals: dict[tuple[str, str], PairTotals] = {}
        self.in_flight = 0
        self._queue: deque[Ghost] = deque()  # ghosts with a step waiting to start, in order
        self._drainer: asyncio.Task[None] | None = None
        self._tokens = 0
        self.steps = Counter(
            "affinity_shadow_steps_total",
            "Ghost steps by result: compared (continuous or restarted ghost), or skipped "
            "(busy, not_served, failed).",
            ["candidate", "live", "result"],
            registry=registry,
        )
        self.restarts = Counter(
            "affinity_shadow_restarts_total",
            "Ghost episodes whose state started over in mid-episode (a skipped step, a gap, "
            "a hand-over).",
            ["candidate", "live"],
            registry=registry,
        )
        self.max_abs = Gauge(
            "affinity_shadow_max_abs",
            "The largest max-abs divergence of a continuous ghost's step from its live step.",
            ["candidate", "live"],
            registry=registry,
        )
        self.step_max_abs = Histogram(
            "affinity_shadow_step_max_abs",
            "Each compared ghost step's max-abs divergence from its live step.",
            ["candidate", "live"],
            buckets=DIVERGENCE_BUCKETS,
            registry=registry,
        )
        self.held = Gauge(
            "affinity_shadow_ghosts",
            "Ghost episodes this node holds.",
            ["candidate", "live"],
            registry=registry,
        )

    # ---- renewal -----------------------------------------------------------------------

    async def sync(self) -> None:
        """At each lease renewal: read the shadows, free the ghosts of stopped shadows and
        of live episodes no longer held here, write this node's totals. Raises what Redis
        raises (:class:`AffinityError`): the ghosts stay as they were."""
        if self.shadows is None:
            return
        shadows = await self.shadows.all()
        if not shadows and self.known:  # Redis lost them (a stop marks, never deletes)
            put = await self.shadows.restore(self.known)
            if put:
                log.warning("put back %d shadow(s) Redis no longer held: %s", put,
                            ", ".join(sorted(self.known)))  # fmt: skip
            shadows = await self.shadows.all()
        self.known = dict(shadows)
        self.apply(shadows)
        await self.shadows.publish(self.node_id, self.totals)
        now_ms, ttl_ms = round(self.wall() * 1000), round(self.shadows.settings.lease_ttl_s * 1000)
        if self.url:
            await self.shadows.advertise(self.node_id, self.url, sorted(self.candidates),
                                         now_ms, ttl_ms)  # fmt: skip
        elsewhere = sorted({str(s.candidate) for s in self.active.values()} - set(self.candidates))
        self.runners = await self.shadows.runners(elsewhere, now_ms) if elsewhere else {}
        self.unreachable.clear()

    def apply(self, shadows: Mapping[str, Shadow]) -> None:
        """Take ``shadows`` (by candidate) as the running ones; free what they end."""
        self.active = {str(s.live): s for s in shadows.values() if not s.stopped}
        for episode, ghost in list(self.ghosts.items()):
            shadow = self.active.get(ghost.live)
            if shadow is None or str(shadow.candidate) != ghost.candidate:
                self.free(episode)
            elif ghost.remote:  # its end may be lost: freed once idle as long as an episode
                if self.clock() - ghost.touched > self.idle_s and ghost.settled.is_set():
                    self.free(episode)
            elif self.live.get(episode) is None and ghost.settled.is_set():
                # its live episode ended, idled, moved or was dropped (a step of it still
                # waiting or running goes first: the step that ended it, compared)
                self.free(episode)
        for episode, sent in list(self.sent.items()):
            shadow = self.active.get(sent.live)
            if (
                shadow is None or str(shadow.candidate) != sent.candidate
                or self.live.get(episode) is None
            ):  # fmt: skip
                self._unsend(episode)  # (its remote ghost idles out there, or stops)
        self._count_held()

    def _count_held(self) -> None:
        held = dict.fromkeys(self.totals, 0)
        for ghost in self.ghosts.values():
            pair = (ghost.candidate, ghost.live)
            held[pair] = held.get(pair, 0) + 1
        for (candidate, live), n in held.items():
            self.held.labels(candidate, live).set(n)

    def free(self, episode: str) -> None:
        """Let go of the ghost of ``episode`` and its record."""
        ghost = self.ghosts.pop(episode, None)
        if ghost is None:
            return
        ghost.ended = True
        self._drop_waiting(ghost)
        if not ghost.running:  # else its step on the worker ends first, then is compared
            ghost.settled.set()
            self.table.release(episode, "end", ghost.token)
        self._count_held()

    # ---- after a live step -------------------------------------------------------------

    def after(self, assignment: Assignment, step: Step, result: StepResult) -> None:
        """The live step of ``assignment`` returned ``result``: its ghost's turn, if its
        episode is shadowed. Takes no lock and no Redis command; the ghost runs later, when
        the node is quiet."""
        if not self.active:
            return
        self.last_live = self.clock()
        if result.replayed:
            return
        shadow = self.active.get(assignment.model)
        if shadow is None or not selected(assignment.episode, shadow.fraction):
            return
        candidate, live = str(shadow.candidate), str(shadow.live)
        if candidate in self.candidates:
            self._run_here(assignment, step, result, candidate, live)
            ghost = self.ghosts.get(assignment.episode)
            if ghost is not None:  # (one another node sent before its episode came here)
                ghost.remote = False
        else:  # another node runs it, if any
            self._send(assignment, step, result, candidate, live)

    def receive(self, message: GhostStep) -> bool:
        """A ghost step another node's live step sent (``POST /internal/ghost``): its
        ghost's turn here, as for a live step of this node (the same ghost table, rules and
        totals). False: no such shadow is on or this node does not run its candidate."""
        shadow = self.active.get(message.live)
        episode = message.step.episode
        if (
            episode is None or shadow is None or str(shadow.candidate) != message.candidate
            or message.candidate not in self.candidates
        ):  # fmt: skip
            return False
        own = self.ghosts.get(episode)
        if own is not None and not own.remote:  # the live episode is here now: not twice
            return True
        assignment = Assignment(episode, "hit", "", 0, "", "", None, message.claim, "",
                                message.live)  # fmt: skip
        result = StepResult(message.outputs, message.reset, message.seq)
        self._run_here(assignment, message.step, result, message.candidate, message.live)
        ghost = self.ghosts.get(episode)
        if ghost is not None:
            ghost.remote, ghost.touched = True, self.clock()
        return True

    def _run_here(
        self, assignment: Assignment, step: Step, result: StepResult, candidate: str, live: str
    ) -> None:
        episode = assignment.episode
        dispatcher = self.candidates[candidate]
        ghost = self.ghosts.get(episode)
        if ghost is not None and (ghost.candidate != candidate or ghost.live != live):
            self.free(episode)
            ghost = None
        if ghost is None:
            device = assignment.device if assignment.device in dispatcher.devices else ""
            self._tokens += 1
            ghost = Ghost(
                episode, candidate, live, device or dispatcher.devices[0], self._tokens,
                f"ghost-{self._tokens}", assignment.claim, result.seq == 1 or result.state_reset,
            )  # fmt: skip
            ghost.last_seq = result.seq - 1
            self.ghosts[episode] = ghost
            self._count_held()
            if not ghost.continuous:  # began in mid-episode: a restart
                ghost.restart = True
        elif ghost.live_claim != assignment.claim:  # claimed anew meanwhile: start over
            ghost.live_claim, ghost.restart = assignment.claim, True
        if self.in_flight >= self.max_in_flight or ghost.waiting:
            # no room, or its last step's window passed unstarted: this step, and the one
            # that still waited, are skipped, each counted
            for _ in range(1 + len(ghost.waiting)):
                self._count(candidate, live, "busy")
            ghost.restart = True
            self._drop_waiting(ghost)
            if not ghost.running:
                ghost.settled.set()
            if step.end:
                self.free(episode)
            return
        outputs = {k: np.array(v, copy=True) for k, v in result.outputs.items()}
        ghost.waiting.append((step, replace(result, outputs=outputs)))
        ghost.settled.clear()
        self.in_flight += 1
        if not ghost.running:
            self._enqueue(ghost)

    def _send(
        self, assignment: Assignment, step: Step, result: StepResult, candidate: str, live: str
    ) -> None:
        """The ghost step of a candidate another node runs: to the one the episode's
        rendezvous hash picks among them (those reached since the renewal first), sent when
        the node is quiet, under the same window and room as a ghost run here."""
        episode = assignment.episode
        runners = self.runners.get(candidate, {})
        reached = {n: u for n, u in runners.items() if u not in self.unreachable} or runners
        if self.pool is None or not reached:
            self._count(candidate, live, "not_served")
            self._unsend(episode)
            return
        sent = self.sent.get(episode)
        if sent is not None and reached.get(sent.node) == sent.url:
            node = sent.node  # (its node still runs it: no hash on the live step's hook)
        else:
            node = max(reached, key=lambda n: _rank(episode, n))
        if sent is None or (sent.candidate, sent.live, sent.node) != (candidate, live, node):
            # a new ghost, or one moving to another node: it starts over there (seq)
            self._unsend(episode)
            sent = self.sent[episode] = Sent(episode, candidate, live, node, reached[node])
        if self.in_flight >= self.max_in_flight or sent.waiting is not None:
            for _ in range(1 + (sent.waiting is not None)):  # as for a ghost run here
                self._count(candidate, live, "busy")
            self._drop_sent(sent)
            if step.end:
                self._unsend(episode)
            return
        outputs = {k: np.array(v, copy=True) for k, v in result.outputs.items()}
        sent.waiting = GhostStep(step, live, candidate, assignment.claim, result.seq,
                                 result.state_reset, outputs)  # fmt: skip
        self.in_flight += 1
        if step.end:  # its end goes with its last step; nothing more for this episode
            self.sent.pop(episode, None)
        if not sent.queued:
            sent.queued = True
            self._sends.append(sent)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_all())

    def _drop_sent(self, sent: Sent) -> None:
        if sent.waiting is not None:
            sent.waiting = None
            self.in_flight -= 1

    def _unsend(self, episode: str) -> None:
        sent = self.sent.pop(episode, None)
        if sent is not None:
            self._drop_sent(sent)

    async def _send_all(self) -> None:
        """The queued ghost steps for other nodes, one at a time, each once the node is
        quiet. A node not reached within :data:`SEND_S`, or answering other than 204,
        counts the step ``failed``; the next goes to another node running the candidate,
        if any."""
        assert self.pool is not None
        while self._sends:
            await self._until_quiet()
            sent = self._sends.popleft()
            sent.queued = False
            message, sent.waiting = sent.waiting, None
            if message is None:
                continue
            try:
                async with asyncio.timeout(SEND_S):
                    resp = await self.pool.post(sent.url, message.encode(), GHOST_PATH)
                failed = "" if resp.status == 204 else f"it answered {resp.status}"
            except Exception as exc:  # unreachable, or a bug: never the live episode's
                failed = f"{type(exc).__name__}: {exc}"
            finally:
                self.in_flight -= 1
            if failed:
                log.debug("ghost step of %s for node %s failed: %s", sent.episode,
                          sent.node, failed)  # fmt: skip
                self._count(sent.candidate, sent.live, "failed")
                self.unreachable.add(sent.url)

    def _enqueue(self, ghost: Ghost) -> None:
        if not ghost.queued:
            ghost.queued = True
            self._queue.append(ghost)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    def _drop_waiting(self, ghost: Ghost) -> None:
        self.in_flight -= len(ghost.waiting)
        ghost.waiting.clear()

    def quiet_in(self) -> float:
        """Seconds before the node may be quiet (0 or less: it is): while a live step is
        on its way or on a device, ``quiet_s`` (asked again then)."""
        if self.arrivals.count > 0 or self.live.stepping():
            return max(self.quiet_s, 1e-4)
        return self.last_live + self.quiet_s - self.clock()

    async def _until_quiet(self) -> None:
        while (wait := self.quiet_in()) > 0:
            await asyncio.sleep(wait)

    async def _drain(self) -> None:
        """The queued ghost steps, one at a time, each once the node is quiet (see the
        module doc): the candidate's run, then the comparison, each after live work."""
        while self._queue:
            await self._until_quiet()
            ghost = self._queue.popleft()
            ghost.queued = False
            if ghost.ended or not ghost.waiting:
                continue
            step, live = ghost.waiting.pop(0)
            dispatcher = self.candidates[ghost.candidate]
            ghost.running = True
            try:
                got = await self._step(ghost, dispatcher, step, live)
            except Exception:  # a bug here must not stop every ghost of the node
                log.exception("ghost step of %s on %s broke", ghost.episode, ghost.candidate)
                got, ghost.restart = None, True
            finally:
                self.in_flight -= 1
                ghost.running = False
            if ghost.ended:  # freed while its step ran: its record goes now
                self.table.release(ghost.episode, "end", ghost.token)
            if got is not None:  # (compared even if freed meanwhile: it ran in step)
                await self._until_quiet()  # the divergence math after live work too
                self._compared(ghost, got, live)
            if step.end and self.ghosts.get(ghost.episode) is ghost:
                self.free(ghost.episode)
            if ghost.waiting and not ghost.ended:
                self._enqueue(ghost)  # its next step came while this one ran
            else:
                ghost.settled.set()

    async def _step(
        self, ghost: Ghost, dispatcher: MultiGpuDispatcher, step: Step, live: StepResult
    ) -> StepResult | None:
        """The candidate's run of the ghost's ``step``: its result, or None (skipped,
        failed and counted, or freed meanwhile)."""
        candidate, pair = ghost.candidate, (ghost.candidate, ghost.live)
        restarted = live.state_reset or ghost.restart or ghost.last_seq != live.seq - 1
        fresh = not ghost.ran or restarted
        if restarted and ghost.ran:  # it ran before: start its state over
            self.table.release(ghost.episode, "end", ghost.token)
            self._tokens += 1
            ghost.token, ghost.claim = self._tokens, f"ghost-{self._tokens}"
        if live.state_reset:  # the live episode started over too: continuous again
            ghost.continuous = True
        elif restarted:  # a skipped step, a gap, a start in mid-episode: said, kept apart
            ghost.continuous = False
            self.restarts.labels(candidate, ghost.live).inc()
            self._totals(pair).restarts += 1
        ghost.restart = False
        assignment = Assignment(ghost.episode, "claimed" if fresh else "hit", ghost.device,
                                ghost.token, self.node_id, "", None, ghost.claim, "",
                                candidate)  # fmt: skip
        ghost_step = Step(ghost.episode, step.inputs, math.inf, end=step.end,
                          execute_steps=step.execute_steps, ensemble=step.ensemble,
                          rtc=step.rtc if dispatcher.rtc is not None else None,
                          model=candidate.partition("@")[0])  # fmt: skip
        feed = {**step.inputs, **control_feed(dispatcher.contract, ghost.episode, start=False,
                                              end=step.end)}  # fmt: skip
        try:
            got = await dispatcher.step(ghost_step, assignment, inputs=feed)
        except Exception as exc:  # a candidate that fails never touches the live episode
            if ghost.ended:  # freed while it ran (its episode ended, the shadow stopped)
                return None
            log.debug("ghost step of %s on %s failed: %s", ghost.episode, candidate, exc)
            self._count(candidate, ghost.live, "failed")
            ghost.restart = True
            return None
        ghost.last_seq, ghost.ran = live.seq, True
        return got

    def _compared(self, ghost: Ghost, got: StepResult, live: StepResult) -> None:
        diff = divergence(got.outputs, live.outputs)
        if diff is None:
            self._count(ghost.candidate, ghost.live, "failed")
            return
        self._compare(ghost, diff)
        if self.recorder is not None:  # the paired stream of a recorded episode
            self.recorder.offer_shadow(ghost.live, ghost.episode, ghost.live_claim, live.seq,
                                       ghost.candidate, got.outputs, float(diff[0].max()),
                                       ghost.continuous)  # fmt: skip

    def _compare(self, ghost: Ghost, diff: Array) -> None:
        pair = (ghost.candidate, ghost.live)
        totals = self._totals(pair)
        worst, l2 = float(diff[0].max()), float(diff[1].max())
        ghost.compared += 1
        ghost.max_abs = max(ghost.max_abs, worst)
        self.step_max_abs.labels(*pair).observe(worst)
        if ghost.continuous:
            self._count(*pair, "compared")
            totals.compared += 1
            totals.max_abs = max(totals.max_abs, worst)
            totals.l2_max = max(totals.l2_max, l2)
            dims = list(totals.max_abs_dims) + [0.0] * (diff.shape[1] - len(totals.max_abs_dims))
            for i, v in enumerate(diff[0]):
                dims[i] = max(dims[i], float(v))
            totals.max_abs_dims = dims
            self.max_abs.labels(*pair).set(totals.max_abs)
        else:
            self._count(*pair, "compared_restarted")
            totals.restarted_compared += 1
            totals.restarted_max_abs = max(totals.restarted_max_abs, worst)

    def _count(self, candidate: str, live: str, result: str) -> None:
        self.steps.labels(candidate, live, result).inc()
        if result not in ("compared", "compared_restarted"):
            skipped = self._totals((candidate, live)).skipped
            skipped[result] = skipped.get(result, 0) + 1

    def _totals(self, pair: tuple[str, str]) -> PairTotals:
        totals = self.totals.get(pair)
        if totals is None:
            totals = self.totals[pair] = PairTotals()
        return totals

    # ---- hand-over (node/handover.py's Ghosts) -----------------------------------------

    @property
    def contracts(self) -> Mapping[str, PolicyContract]:
        """``"name@version"`` -> contract of each candidate this node runs (the ghosts a
        hand-over may bring here)."""
        return {m: d.contract for m, d in self.candidates.items()}

    def lost(self, device: str) -> None:
        """``device``'s worker process died with the states it held: the ghosts there start
        their state over at their next step (counted as a restart, kept apart)."""
        for ghost in self.ghosts.values():
            if ghost.device == device:
                ghost.restart = True

    async def carry(self, episode: str, record: Episode) -> GhostCarry | None:
        """What a hand-over of ``episode`` (its live ``record``) carries of its ghost: the
        ghost's record once its step on its way ran (bounded by :data:`CARRY_WAIT_S`), if
        it is in step with the live record; else None (it restarts at the new owner)."""
        ghost = self.ghosts.get(episode)
        if ghost is None:
            return None
        if not ghost.settled.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ghost.settled.wait(), CARRY_WAIT_S)
        own = self.table.get(episode)
        if (
            ghost.running or ghost.waiting or ghost.restart or ghost.ended or own is None
            or ghost.last_seq != record.seq or own.claim != ghost.claim
        ):  # fmt: skip
            return None
        return GhostCarry(ghost.candidate, ghost.live, ghost.continuous, ghost.last_seq,
                          ghost.compared, ghost.max_abs, own)  # fmt: skip

    def adopt(self, install: Install) -> None:
        """Hold the ghost a hand-over brought with ``install`` (beside the live copy: a
        ghost answers nobody, so it needs no confirmation; a copy never confirmed frees it
        at the next renewal). Nothing when this node does not run its candidate."""
        carried, episode = install.ghost, install.episode
        if carried is None:
            return
        dispatcher = self.candidates.get(carried.candidate)
        if dispatcher is None:
            return
        self.free(episode)
        self._tokens += 1
        token, claim = self._tokens, f"ghost-{self._tokens}"
        device = install.device if install.device in dispatcher.devices else dispatcher.devices[0]
        record = replace(carried.record, device=device, token=token, claim=claim,
                         last_used=self.clock())  # fmt: skip
        if not (self.table.install(episode, record) and self.table.confirm(episode, claim)):
            return
        ghost = Ghost(
            episode, carried.candidate, carried.live, device, token, claim, install.claim,
            carried.continuous, last_seq=carried.last_seq, ran=True, compared=carried.compared,
            max_abs=carried.max_abs,
        )  # fmt: skip
        self.ghosts[episode] = ghost
        self._count_held()

    # ---- the candidates' devices -------------------------------------------------------

    async def probe(self) -> list[tuple[str, str]]:
        """Probe each candidate's down devices whose cool-down has passed, as the live
        models' are (:meth:`node.health.DeviceHealth.probe`, at the node's maintenance):
        the (candidate, device) pairs that came back up. A candidate's device down skips
        its ghost steps (``failed``); it never takes the live model's device down."""
        back: list[tuple[str, str]] = []
        for candidate, dispatcher in self.candidates.items():
            back += [(candidate, device) for device in await dispatcher.probe()]
        return back

    # ---- inspection and stop -----------------------------------------------------------

    async def idle(self) -> None:
        """Return once no ghost step is queued or on its way (tests, the bench)."""
        while any(t is not None and not t.done() for t in (self._drainer, self._sender)):
            for task in (self._drainer, self._sender):
                if task is not None:
                    await asyncio.gather(task, return_exceptions=True)

    def close(self) -> None:
        for task in (self._drainer, self._sender):
            if task is not None:
                task.cancel()
        for dispatcher in self.candidates.values():
            dispatcher.close()


def _rank(episode: str, node: str) -> bytes:
    """The rendezvous hash of ``episode`` on ``node``: the highest picks the node, so an
    episode stays on its node while that node runs the candidate."""
    return hashlib.blake2b(f"{episode}\0{node}".encode(), digest_size=8).digest()


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


async def sync_quietly(runner: ShadowRunner) -> None:
    """:meth:`ShadowRunner.sync` at a renewal, which it never fails: a Redis failure is
    tried again at the next one; anything else is logged."""
    try:
        await runner.sync()
    except AffinityError:
        pass
    except Exception:
        log.exception("the shadows of node %s could not be read", runner.node_id)
