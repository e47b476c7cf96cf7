"""A device's worker: its thread, its queue and its batch window.

The thread runs one model's session on one device. The queue holds work waiting for it.
The batch window gathers waiting steps into one run.

It knows sessions and futures, not episodes. A :class:`~node.jobs.Job` (its types are in
``node/jobs.py``) carries an opaque ``key`` (None: distinct). Jobs with one key run one at
a time, in arrival order, at most one in a run.
Its owner (the commit rules, ``node/commit.py``) says through two callables what a job
runs with (``prepare``) and what is kept of the run (``commit``). Both answer through
:meth:`DeviceWorker.answer`.

Why this is hard:

- One run at a time on a device. ``busy``, under ``cond``, is held by the worker's round
  or by an inline run on the event loop's thread.
- The worker hands its answers to their loops (``flush``) before it frees the device, so an
  inline round never shares its outbox.
- A caller may give up at any moment (``Job.gave_up``). A run still going at a step's
  deadline counts once as a failure (``count_hang``): a hung GPU goes down like one that raises.
- A failed batched run is run again one step at a time. Only single runs count as
  failures, so one bad step cannot take its batch's device down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from node import control
from node.crashes import CrashTracker, Transition
from node.errors import DeviceDown, ModelFailure, NotKept, WorkerFenced, WorkerGone
from node.jobs import Arrivals, Job, Member, Run, Session

__all__ = [
    "DEFAULT_BATCH_DELAY_US",
    "MAX_DEFAULT_BATCH",
    "DeviceWorker",
    "WorkerHooks",
    "batch_limit",
]

log = logging.getLogger("affinity.node")

Array = np.ndarray[Any, Any]

MAX_DEFAULT_BATCH = 8
"""``max_batch`` when not given and the model allows batching."""
DEFAULT_BATCH_DELAY_US = 500.0
"""How long a waiting step may wait for others to join its run (microseconds)."""
_RECENT_S = 1.0  # a key that sent a step this recently is expected to send another


def batch_limit(blocker: str | None, max_batch: int | None, model: str = "") -> tuple[int, str]:
    """The most steps per run, and why batching is off ("": on), for a model that
    ``blocker`` says cannot batch (None: it can) and the limit asked (None:
    :data:`MAX_DEFAULT_BATCH`). Says which in one log line, naming ``model`` (a node
    serving several says it once for each)."""
    of = f" for {model}" if model else ""
    if max_batch == 1:
        log.info("batching is off%s (max batch 1)", of)
        return 1, "max batch 1"
    if blocker is not None:
        log.log(
            logging.INFO if max_batch is None else logging.WARNING,
            "batching is off%s: %s; every step runs alone",
            of,
            blocker,
        )
        return 1, blocker
    size = MAX_DEFAULT_BATCH if max_batch is None else max_batch
    log.info("batching is on%s: up to %d steps per model run", of, size)
    return size, ""


@dataclass(eq=False)
class _Call:
    """Other work on a device's thread (a probe, the warm-up): runs alone, in order."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]


class RemoteRun(Protocol):
    """A session in a worker process (``node.deviceprocs.RemoteSession``): it can also be
    run from the event loop without blocking it."""

    async def run_from_loop(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]
    ) -> list[Any]: ...


class RowsRun(Protocol):
    """A session in a worker process that holds its episodes' states: a batch is stacked
    there (``node.deviceprocs.RemoteSession.run_rows``), each step's outputs returned."""

    def run_rows(
        self, output_names: Sequence[str], feeds: Sequence[Mapping[str, Any]], size: int
    ) -> list[dict[str, Any]]: ...


Prepare = Callable[["DeviceWorker", Any], "Member | None"]
"""``prepare(worker, job)``: the member ``job`` (the owner's :class:`Job`) runs as, or None
when it needs no run (given up, or answered through ``worker.answer``)."""
Commit = Callable[["DeviceWorker", Any, dict[str, Array]], None]
"""``commit(worker, member, outputs)``: keep what the run gave ``member`` (the member
``prepare`` made) and answer it through ``worker.answer``."""


@dataclass(frozen=True)
class WorkerHooks:
    """What a device's worker tells, each called on its thread (None: nobody listens).

    ``on_transition(device, to, reason)`` as its crash tracker goes down or up;
    ``on_batch(device, size)`` for each run; ``on_queue_wait(device, seconds)`` for each job
    that reaches the model; ``on_run(device, (batch size, seconds))`` after each run
    (scored placement's step times, ``node/placement.py``)."""

    on_transition: Transition | None = None
    on_batch: Callable[[str, int], None] | None = None
    on_queue_wait: Callable[[str, float], None] | None = None
    on_run: Callable[[str, tuple[int, float]], None] | None = None


class DeviceWorker:
    """One model's session on one device, its thread and its queue (see the module doc).

    ``max_batch``: most jobs per run. ``batch_delay_s``: how long a waiting job may wait
    for others. It waits only while ``arrivals`` counts a step on its way and a key that
    sent a job here in the last second has none waiting. ``inline_under_s``: a job runs on
    the event loop's thread, instead of the worker's, when the device's runs take less on
    average and nothing else waits (:meth:`run_inline`; 0: never). ``peers``: the workers of
    the same model, the device's included. ``hooks``: what it tells (:class:`WorkerHooks`).
    """

    def __init__(
        self,
        id: str,
        session: Session,
        tracker: CrashTracker,
        *,
        outputs: Sequence[str],
        prepare: Prepare,
        commit: Commit,
        max_batch: int,
        batch_delay_s: float,
        arrivals: Arrivals,
        peers: Mapping[str, DeviceWorker],
        inline_under_s: float = 0.0,
        hooks: WorkerHooks = WorkerHooks(),
    ) -> None:
        self.id = id
        self.session = session
        self.tracker = tracker
        self.outputs = list(outputs)
        self.prepare = prepare
        self.commit = commit
        sizes = getattr(session, "batch_sizes", None)
        self.sizes: tuple[int, ...] | None = tuple(sorted(sizes)) if sizes else None
        self.max_batch = min(max_batch, self.sizes[-1]) if self.sizes else max_batch
        self.batch_delay_s = batch_delay_s
        self.arrivals = arrivals
        self.peers = peers
        self.inline_under_s = inline_under_s
        self.on_transition = hooks.on_transition
        self.on_batch = hooks.on_batch
        self.on_queue_wait = hooks.on_queue_wait
        self.on_run = hooks.on_run
        self.cond = threading.Condition()
        self.pending: deque[Job | _Call | None] = deque()  # None: stop
        self.recent: dict[str, float] = {}  # key -> when its last job was queued
        # answers made by the worker, handed to their loops together (one wake-up per loop)
        self.outbox: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        self.thread: threading.Thread | None = None
        self.busy = False  # a run (the worker's, or one inline on the loop) holds the device
        self.probing = False  # a probe's run is queued or running (node/warmup.py: one at once)
        self.run_s = float("inf")  # moving average of its model runs' wall time
        # a session in a worker process, run from the loop without waiting (run_inline)
        remote = session if hasattr(session, "run_from_loop") else None
        self.remote: RemoteRun | None = remote  # type: ignore[assignment]
        # ... which holds its episodes' states: it stacks a batch's (RemoteSession.run_rows)
        rows = session if hasattr(session, "run_rows") else None
        self.rows: RowsRun | None = rows  # type: ignore[assignment]
        self.inline_tasks: set[asyncio.Task[None]] = set()

    # ---- the queue -------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._work, name=f"affinity-{self.id}", daemon=True)
        self.thread.start()

    def put(self, item: Job | _Call | None) -> None:
        """Queue ``item`` for the worker (None: stop once what is queued has run)."""
        with self.cond:
            self.pending.append(item)
            if isinstance(item, Job) and item.key is not None and self.max_batch > 1:
                self.recent[item.key] = item.enqueued
            self.cond.notify()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` alone on the worker's thread; return or raise what it did."""
        call = _Call(fn, asyncio.get_running_loop().create_future())
        self.put(call)
        return await call.future

    def bucket(self, n: int) -> int:
        """The batch size to run ``n`` steps at: padded up to a session's size, if any."""
        if self.sizes is None:
            return n
        return next((s for s in self.sizes if s >= n), n)

    def answer(self, future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        """Complete ``future`` with the next :meth:`flush` (the thread running the round)."""
        self.outbox.append((future, result, exc))

    def flush(self) -> None:
        """Hand every answer made since the last flush to its loop."""
        if not self.outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for item in self.outbox:
            by_loop.setdefault(item[0].get_loop(), []).append(item)
        self.outbox = []
        for loop, items in by_loop.items():
            # a loop that closed meanwhile has nobody left waiting
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, items)

    def _work(self) -> None:
        while True:
            item = self.next_batch()
            if item is None:
                return
            try:
                if isinstance(item, _Call):
                    try:
                        result, error = item.fn(), None
                    except BaseException as exc:  # handed to the awaiting task
                        result, error = None, exc
                    self.answer(item.future, result, error)
                else:
                    self._run_batch_safely(item)
            finally:
                self.flush()  # while still busy: an inline round must not share the outbox
                with self.cond:
                    self.busy = False

    def run_inline(self, job: Job) -> bool:
        """Run ``job`` now, on the event loop's thread, instead of handing it to the
        worker's, when that costs less and takes nothing from anyone. Three things must
        hold. The device's model runs take less than :attr:`inline_under_s` on average; the
        hand-off there and back (two thread wake-ups, the GIL changing hands) costs about
        as much as such a run. The device is idle. No other step is on its way through the
        node nor any peer busy; the loop waits for the run, so a step for another device
        would wait too. The node gives a bound to CPU devices only. A GPU run that hangs
        must not stop the event loop. There its worker's watch marks the device down and
        the node goes on. False: the worker runs it, as always under load.

        A session in a worker process (``run_from_loop``: ``node/deviceprocs.py``) is run
        from the loop without waiting for it (:meth:`_run_remote`): the loop hands the run to the
        process and goes on, so neither the run's length nor a hung process holds it. Only
        the device idle, no step on its way and one row are asked then (a lone robot's
        step: no batch to wait for), whatever the device and its runs' length."""
        if self.inline_under_s <= 0 or self.arrivals.count > 0 or not job.one_row:
            return False
        if self.remote is not None:
            if not self._take_device():
                return False
            task = asyncio.ensure_future(self._run_remote(job))
            self.inline_tasks.add(task)
            task.add_done_callback(self.inline_tasks.discard)
            return True
        if self.run_s >= self.inline_under_s:
            return False
        if len(self.peers) > 1 and any(
            d.busy or d.pending for d in self.peers.values() if d is not self
        ):
            return False
        if not self._take_device():
            return False
        try:
            self._run_batch_safely([job])
        finally:
            self._free_device()
        return True

    def _take_device(self) -> bool:
        """Hold the device for a run from the event loop, if it is idle (nothing queued)."""
        with self.cond:
            if self.busy or self.pending:
                return False
            self.busy = True
            return True

    def _free_device(self) -> None:
        """Give back the device a run from the loop held, and settle that run's answers
        (on this loop already: no wake-up through ``call_soon_threadsafe``)."""
        items, self.outbox = self.outbox, []  # the worker waits: only this run's
        with self.cond:
            self.busy = False
            if self.pending:
                self.cond.notify()
        _settle(items)

    async def _run_remote(self, job: Job) -> None:
        """:meth:`run_inline` for a session in a worker process: ``job`` alone, the device
        held (``busy``) until its answer, the loop free meanwhile."""
        assert self.remote is not None
        try:
            member = self._prepared([job])
            if member:
                m = member[0]
                taken = self._alone_feed(m)
                if taken is not None and taken[1] > 1:  # padded by the process: its thread
                    await asyncio.to_thread(self._run_alone, m)
                elif taken is not None:
                    feed, size = taken
                    run, started = self._run_begins([m])
                    try:  # its time is the job's before the commit reads it, as in _session_run
                        values = await self.remote.run_from_loop(self.outputs, feed)
                    except Exception as exc:
                        self._run_ends([m], run, started)
                        self._failed(m, exc)
                    else:
                        self._run_ends([m], run, started)
                        self._alone_done(m, size, dict(zip(self.outputs, values, strict=True)))
        except Exception as exc:  # a bug here must not leave its caller waiting forever
            log.exception("device %s: a run from the event loop broke", self.id)
            self.answer(job.future, None, exc)
        finally:
            self._free_device()

    # ---- the batch window --------------------------------------------------------------

    def next_batch(self) -> _Call | list[Job] | None:
        """The next work: a call, or the jobs of one run (distinct keys). Waits for it."""
        with self.cond:
            while True:
                while not self.pending or self.busy:
                    self.cond.wait()
                head = self.pending.popleft()
                if not isinstance(head, Job):
                    self.busy = head is not None
                    return head
                if not head.gave_up():
                    break
            self.busy = True
            taken = [head]
            if self.max_batch == 1 or not head.one_row:
                return taken
            cutoff = time.perf_counter() - _RECENT_S
            for key, at in list(self.recent.items()):
                if at < cutoff:
                    del self.recent[key]
            until = head.enqueued + self.batch_delay_s
            while True:
                self.take_joiners(taken)
                now = time.perf_counter()
                if len(taken) >= self.max_batch or now >= until or not self.others_expected(taken):
                    return taken
                self.cond.wait(until - now)

    def take_joiners(self, taken: list[Job]) -> None:
        """Move waiting jobs that may join ``taken`` from :attr:`pending` into it."""
        # keys with a job taken or left waiting: their later jobs wait (jobs without a key
        # are all distinct)
        busy = {j.key for j in taken if j.key is not None}
        left: deque[Job | _Call | None] = deque()
        for item in self.pending:
            if isinstance(item, Job):
                if item.gave_up():
                    continue
                joins = len(taken) < self.max_batch and item.one_row and item.key not in busy
                if item.key is not None:
                    busy.add(item.key)
                if joins:
                    taken.append(item)
                    continue
            left.append(item)
        self.pending = left

    def others_expected(self, taken: list[Job]) -> bool:
        """Whether another key is likely to send a job soon. Some step is on its way
        through the node (:class:`Arrivals`). And a key that sent a job to this device
        within the last second has none in ``taken`` or waiting. A robot stepping alone,
        or one client stepping many episodes in turn, never waits."""
        if self.arrivals.count <= 0:  # an int read from the worker: atomic under the GIL
            return False
        waiting = {j.key for j in taken}
        waiting.update(j.key for j in self.pending if isinstance(j, Job))
        return any(key not in waiting for key in self.recent)

    # ---- runs --------------------------------------------------------------------------

    def _run_batch_safely(self, jobs: list[Job]) -> None:
        try:
            self.run_batch(jobs)
        except Exception as exc:  # a bug here must not leave callers waiting forever
            log.exception("device %s: a run of %d steps broke", self.id, len(jobs))
            for job in jobs:
                self.answer(job.future, None, exc)

    def _prepared(self, jobs: list[Job]) -> list[Member]:
        """The members of ``jobs`` that need the model (:attr:`prepare`), their queue time
        told."""
        members: list[Member] = []
        now = time.perf_counter()
        for job in jobs:
            member = self.prepare(self, job)
            if member is None:
                continue
            job.queue_s = now - job.enqueued
            if self.on_queue_wait is not None:
                _observe(self.on_queue_wait, self.id, job.queue_s)
            members.append(member)
        return members

    def run_batch(self, jobs: list[Job]) -> None:
        """Prepare ``jobs`` and run those that need the model, together where their
        tensors agree beyond the first axis."""
        members = self._prepared(jobs)
        self.flush()  # steps answered from a buffer do not wait for the model run
        if len(members) == 1:  # a step alone (one client, or one inline): nothing to group
            self._run_alone(members[0])
            return
        groups: dict[tuple[tuple[str, tuple[int, ...], str], ...], list[Member]] = {}
        for m in members:  # steps whose tensors differ beyond the first axis run apart
            key = tuple(sorted((k, v.shape[1:], v.dtype.str) for k, v in m.feed.items()))
            groups.setdefault(key, []).append(m)
        for group in groups.values():
            if len(group) == 1:
                self._run_alone(group[0])
            else:
                self._run_stacked(group)

    def _run_stacked(self, group: list[Member]) -> None:
        """One run of ``group`` stacked along the first axis, padded to :meth:`bucket`."""
        n = len(group)
        size = self.bucket(n)
        try:
            if self.rows is not None:  # the process holds their states: it stacks them
                rows = self._rows_run(group, size)
            else:
                values = self._session_run(_stacked([m.feed for m in group], size), group)
                for name, value in values.items():
                    if value.shape[:1] != (size,):
                        raise ValueError(
                            f"output {name!r} has shape {value.shape} for a batch of {size}"
                        )
                # state kept on the device (node.binding.DeviceTensor) is scattered through
                # the host
                host = {name: np.asarray(v) for name, v in values.items()}
                rows = [{name: v[i : i + 1].copy() for name, v in host.items()} for i in range(n)]
        except Exception as exc:
            if not isinstance(exc, WorkerFenced):  # (else: each says so, run alone)
                log.warning(
                    "device %s: a batched run of %d steps failed (%s: %s); running them one by one",
                    self.id,
                    n,
                    type(exc).__name__,
                    exc,
                )
            for m in group:
                self._run_alone(m)
                self.flush()  # each as soon as it is known
            return
        self.count_success()
        for m, outputs in zip(group, rows, strict=True):
            self.commit(self, m, outputs)

    def _rows_run(self, members: list[Member], size: int) -> list[dict[str, Array]]:
        """One run of ``members`` in the worker process (:attr:`rows`), stacked there."""
        assert self.rows is not None
        run, started = self._run_begins(members)
        try:
            return self.rows.run_rows(self.outputs, [m.feed for m in members], size)
        finally:
            self._run_ends(members, run, started)

    def _run_alone(self, m: Member) -> None:
        taken = self._alone_feed(m)
        if taken is None:
            return
        feed, size = taken
        try:
            if self.rows is not None and size > 1:  # padded by the process, its state there
                values = self._rows_run([m], size)[0]
                size = 1
            else:
                values = self._session_run(feed, [m])
        except Exception as exc:
            self._failed(m, exc)
            return
        self._alone_done(m, size, values)

    def _failed(self, m: Member, exc: Exception) -> None:
        """``m``'s run raised ``exc``: the device's failure, counted, unless the episode's
        state was lost with a worker process, or the process refused it (the lease), or
        the process died in it (the device goes down by that death, once: a run the hang
        watch killed was counted as hung already, and a batch's steps rerun alone on a
        dead process are one death, not one failure each)."""
        if isinstance(exc, WorkerFenced):
            self.answer(m.job.future, None, NotKept(m.job.key or ""))
            return
        if not isinstance(exc, WorkerGone):  # (StateLost: the episode's loss, not the device's)
            self.count_failure(f"{type(exc).__name__}: {exc}")
        self.answer(m.job.future, None, ModelFailure(self.id, exc))

    def _alone_feed(self, m: Member) -> tuple[dict[str, Array], int] | None:
        """The feed ``m`` runs alone with and its batch size (padded to a session's); None
        when it needs no run (given up, or answered: the device is down)."""
        with m.job.lock:
            if m.job.gave_up():
                return None
        if self.tracker.down:  # an earlier step of its failed batch took the device down
            self.answer(m.job.future, None, DeviceDown(self.id))
            return None
        size = self.bucket(1) if m.job.one_row else 1
        if size > 1 and self.rows is None:
            return _stacked([m.feed], size), size
        return m.feed, size

    def _alone_done(self, m: Member, size: int, values: dict[str, Array]) -> None:
        """``m``'s run alone at batch ``size`` gave ``values``: counted, kept."""
        self.count_success()
        if size > 1:
            values = {name: np.asarray(v)[:1].copy() for name, v in values.items()}
        self.commit(self, m, values)

    def _session_run(self, feed: dict[str, Array], members: list[Member]) -> dict[str, Array]:
        run, started = self._run_begins(members)
        try:
            values = self.session.run(self.outputs, feed)
        finally:
            self._run_ends(members, run, started)
        return dict(zip(self.outputs, values, strict=True))

    def _run_begins(self, members: list[Member]) -> tuple[Run, float]:
        """A model run of ``members`` begins (each job knows its run: a hang is counted)."""
        run = Run()
        for m in members:
            with m.job.lock:
                m.job.run = run
        return run, time.perf_counter()

    def _run_ends(self, members: list[Member], run: Run, started: float) -> None:
        """The run begun at ``started`` ended, well or not: its time kept and told."""
        took = time.perf_counter() - started
        self.run_s = took if self.run_s == float("inf") else 0.8 * self.run_s + 0.2 * took
        with run.lock:
            run.active = False
        for m in members:
            with m.job.lock:
                m.job.run = None
                m.job.run_s = took
        if self.on_batch is not None:
            _observe(self.on_batch, self.id, len(members))
        if self.on_run is not None:
            _observe(self.on_run, self.id, (len(members), took))

    # ---- the device's health -----------------------------------------------------------

    def count_success(self) -> None:
        """Record a good run (or a probe that needs none): a down device comes back up."""
        if self.tracker.success():
            self._transition("up", "")

    def count_failure(self, error: str) -> None:
        """Record a failed run: at the tracker's threshold the device goes down."""
        went_down = self.tracker.failure(error)
        log.error("model failure on %s (%d in a row): %s", self.id, self.tracker.failures, error)
        if went_down:
            self._transition("down", self.tracker.last_error)

    def go_down(self, reason: str) -> None:
        """Take the device down at once (its worker process died, ``node/deviceprocs.py``):
        its episodes move at their next step, as after repeated failures."""
        if self.tracker.force_down(reason):
            self._transition("down", reason)

    def count_hang(self, run: Run) -> None:
        """``run`` was still going at a step's deadline: count one failure (once per run)."""
        # A device that hangs must go down like one that raises, or its episodes never
        # move. One count per run, however many of its steps gave up.
        with run.lock:
            if not run.active or run.hang_counted:
                return
            run.hang_counted = True
        self.count_failure("a model run outlived its request's deadline")

    def _transition(self, to: str, reason: str) -> None:
        # said once per device by the node's health (node/health.py), not once per model
        log.debug("device %s: a model's tracker has it %s%s", self.id, to,
                  f": {reason}" if reason else "")  # fmt: skip
        if self.on_transition is not None:
            self.on_transition(self.id, to, reason)


def _stacked(feeds: list[dict[str, Array]], size: int) -> dict[str, Array]:
    """``feeds`` stacked along the first axis, padded to ``size`` rows with padding rows
    made from the first feed's (:func:`node.control.padding`)."""
    first = feeds[0]
    pad = size - len(feeds)
    return {
        name: np.concatenate([f[name] for f in feeds] + [control.padding(name, first[name])] * pad)
        for name in first
    }


def _observe(hook: Callable[[str, Any], None], device: str, value: Any) -> None:
    try:
        hook(device, value)
    except Exception:  # a metrics hook must never fail a model run
        log.exception("device %s: a dispatcher hook raised", device)


def _settle(items: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, result, exc in items:
        if future.done():  # cancelled, or already failed by a broken round
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
