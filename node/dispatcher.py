"""``MultiGpuDispatcher``: one worker thread per device, batched runs, per-episode state.

Pure composition: no HTTP, no Redis. Sessions come from an injectable factory, so the
routing, batching and state logic is tested with fakes and no GPU.

- Each device runs its model on its own worker thread. ONNX Runtime releases the GIL while
  it runs, so runs on different GPUs overlap; runs on one device are serialized.
- Per-episode state is one :class:`node.episodes.Episode` record per episode: the claim
  (device, token, claim id), the step count ``seq``, the recurrent state, the action buffer
  (:mod:`node.chunks`), the last reply and the record before the last step. The rules
  (:func:`node.episodes.admit`) are applied under one lock, in each episode's arrival
  order: a step of another claim starts from the initial state and says
  ``state_reset=True``, as does a step of an episode that was not freshly claimed but has
  no record here (a restarted node); a step naming the ``seq`` already applied is answered
  with the stored reply. :meth:`MultiGpuDispatcher.undo` restores the previous record.
- **Batching.** When the model allows it (a batch axis, dynamic on every input and output:
  ``PolicyContract.batch_blocker``; else batching is off with one log line saying why), the
  worker takes up to ``max_batch`` waiting steps of different episodes, stacks their inputs
  and states along the first axis, runs the model once and splits the outputs and new
  states back. An episode has at most one step in a run and its steps run in arrival
  order. Once a step is waiting, the worker waits up to ``batch_delay_us`` (counted from
  that step's arrival) for more, but only while another episode that sent a step on this
  device in the last second has none waiting: a lone robot never waits. A session with a
  ``batch_sizes`` attribute (CUDA graphs captured per batch size) gets every run padded
  to the smallest of those sizes that fits (the padding rows repeat the first step's and
  are dropped). When a batched run fails, its steps are run again one by one, so one bad
  episode cannot fail the others; only the single runs count as failures.
- **Chunk execution** (:mod:`node.chunks`): a step answered from the episode's action
  buffer needs no model. When no other step of the episode is queued or running it is
  answered at once on the event loop, never behind model runs; else it waits its turn
  on the worker (its episode's earlier steps come first) and is answered there, outside
  any batch.
- A crash tracker per device counts consecutive model failures; at the threshold it calls
  ``on_transition(device, "down", reason)``; after the cool-down a probe run on the
  device's worker decides whether it comes back (``on_transition(device, "up", "")``).
  Bad client input is rejected before it reaches the dispatcher and never counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from affinity.errors import InvalidArgument
from node import control, warmup
from node.chunks import ActionBuffer, ChunkMode, find_chunk
from node.episodes import (
    Apply,
    ClaimEnded,
    Episode,
    EpisodeTable,
    ForwardCancelled,
    NotKept,
    SeqConflict,
    StepResult,
    advance,
)
from node.policy import PolicyContract
from node.rtc import Ask, Used, control_rate, rtc_of

__all__ = [
    "DEFAULT_BATCH_DELAY_US",
    "MAX_DEFAULT_BATCH",
    "Arrival",
    "Arrivals",
    "CrashTracker",
    "DeviceDown",
    "ModelFailure",
    "MultiGpuDispatcher",
    "SeqConflict",
    "Session",
    "StepResult",
]

log = logging.getLogger("affinity.node")

Array = np.ndarray[Any, Any]

MAX_DEFAULT_BATCH = 8
"""``max_batch`` when not given and the model allows batching."""
DEFAULT_BATCH_DELAY_US = 500.0
"""How long a waiting step may wait for others to join its run (microseconds)."""
_RECENT_S = 1.0  # an episode that sent a step this recently is expected to send another


class Session(Protocol):
    """What the dispatcher needs of a model session (``onnxruntime.InferenceSession``).

    A session may also have ``batch_sizes``, a tuple of the batch sizes it runs best (e.g.
    one captured CUDA graph each): batched runs are then padded to the smallest of them
    that fits, and no run is larger than the largest. A step whose client sent several
    rows runs alone, unpadded.
    """

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[Any]:
        """Run the model; return the outputs in ``output_names`` order."""


class ModelFailure(Exception):
    """The model session raised while running a step; the device's crash count went up."""

    def __init__(self, device: str, cause: BaseException) -> None:
        self.device = device
        super().__init__(f"model failed on {device}: {type(cause).__name__}: {cause}")


class DeviceDown(Exception):
    """The device is marked down by its crash tracker and is waiting for a probe."""

    def __init__(self, device: str) -> None:
        self.device = device
        super().__init__(f"device {device} is down after repeated model failures")


@dataclass
class CrashTracker:
    """Consecutive model failures of one device, with a cool-down before a probe."""

    threshold: int
    cooldown_s: float
    clock: Callable[[], float]
    failures: int = 0
    down_since: float | None = None
    last_error: str = ""
    # the device's worker and the event loop (deadline hits) both record outcomes
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def success(self) -> bool:
        """Record a good run; True when this brings the device back up."""
        with self.lock:
            was_down = self.down
            self.failures = 0
            self.down_since = None
            return was_down

    def failure(self, error: str) -> bool:
        """Record a failed run; True when this takes the device down."""
        with self.lock:
            self.failures += 1
            self.last_error = error
            if not self.down and self.failures >= self.threshold:
                self.down_since = self.clock()
                return True
            if self.down:
                self.down_since = self.clock()  # a failed probe restarts the cool-down
            return False

    def probe_due(self) -> bool:
        return self.down_since is not None and self.clock() - self.down_since >= self.cooldown_s


@dataclass
class _Run:
    """One model run in progress; a run that outlives its steps' deadlines counts once."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    active: bool = True
    hang_counted: bool = False


@dataclass(eq=False)
class _Job:
    """A step (or a stateless run, ``episode`` None) and what it shares with its caller
    to agree on whether its state is kept."""

    episode: str | None
    token: int
    claim: str
    fresh: bool
    seq: int | None  # the seq the caller expects to be applied (None: not sent)
    origin: str  # the forward it came in (""; not forwarded)
    inputs: dict[str, Array]
    mode: ChunkMode | None
    future: asyncio.Future[StepResult]
    one_row: bool  # every input has a first dimension of 1: it may join a batch
    rtc: Ask | None = None  # real-time chunking: what the step says (RTC models only)
    arrived: float = 0.0  # the dispatcher's clock when the step arrived at the node
    generation: int = 0  # the table's generation when the step began (a drop since: not kept)
    asked: Mapping[str, Array] | None = None  # its inputs when it named its seq (see admit)
    enqueued: float = field(default_factory=time.perf_counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    committed: int = 0  # the seq it applied (0: none yet)
    run: _Run | None = None  # the model run it is part of, while that runs
    queue_s: float = 0.0  # from being queued to its run (worker thread)
    run_s: float = 0.0  # its model run (worker thread)

    def gave_up(self) -> bool:
        # Task.cancel() cancels the awaited future at once but runs the caller's handler
        # (which sets `abandoned`) later; a plain read of the future's state (atomic under
        # the GIL) closes that gap for the worker.
        return self.abandoned or self.future.cancelled()


@dataclass(eq=False)
class _Call:
    """Other work on a device's thread (a probe, the warm-up): runs alone, in order."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]


@dataclass(eq=False)
class _Member:
    """A job taken into a model run, with what it read of its episode's state."""

    job: _Job
    feed: dict[str, Array]
    read: Episode | None  # the record it read (committed only if still current)
    base: Episode | None  # the record it runs on (None: the initial state)
    reset: bool
    rtc: Used | None = None  # real-time chunking: what the step runs with


class Arrivals:
    """How many steps are on their way through the node (being resolved or checked), for
    every dispatcher of the node: while any is, a device holding a waiting step may wait up
    to ``batch_delay`` for others to join its run. Event loop only (workers read it)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def arrival(self) -> Arrival:
        """Count one step until its ``done()``: the node opens one when a request arrives
        and closes it as the step is handed to a device (or leaves the node)."""
        return Arrival(self)


class Arrival:
    """One step on its way through the node (:meth:`Arrivals.arrival`)."""

    __slots__ = ("_arrivals", "_open")

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals = arrivals
        self._open = True
        arrivals.count += 1

    def done(self) -> None:
        """The step reached a device, left the node or failed; idempotent."""
        if self._open:
            self._open = False
            self._arrivals.count -= 1


class _Device:
    def __init__(self, id: str, session: Session, tracker: CrashTracker, max_batch: int) -> None:
        self.id = id
        self.session = session
        self.tracker = tracker
        sizes = getattr(session, "batch_sizes", None)
        self.sizes: tuple[int, ...] | None = tuple(sorted(sizes)) if sizes else None
        self.max_batch = min(max_batch, self.sizes[-1]) if self.sizes else max_batch
        self.cond = threading.Condition()
        self.pending: deque[_Job | _Call | None] = deque()  # None: stop
        self.recent: dict[str, float] = {}  # episode -> when its last step was queued
        # answers made by the worker, handed to their loops together (one wake-up per loop)
        self.outbox: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        self.thread: threading.Thread | None = None
        self.busy = False  # a run (the worker's, or one inline on the loop) holds the device
        self.run_s = float("inf")  # moving average of its model runs' wall time

    def bucket(self, n: int) -> int:
        """The batch size to run ``n`` steps at: padded up to a session's size, if any."""
        if self.sizes is None:
            return n
        return next((s for s in self.sizes if s >= n), n)

    def answer(self, future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        """Complete ``future`` with the next :meth:`flush` (worker thread only)."""
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

    def put(self, item: _Job | _Call | None) -> None:
        with self.cond:
            self.pending.append(item)
            if isinstance(item, _Job) and item.episode is not None and self.max_batch > 1:
                self.recent[item.episode] = item.enqueued
            self.cond.notify()


Transition = Callable[[str, str, str], None]


class MultiGpuDispatcher:
    """Routes steps to per-device sessions and keeps per-episode state.

    ``devices`` are device ids (``<node>/<index>``); ``session_factory(device_id)`` builds
    the device's session (called once per device, in the constructor). ``clock`` is a
    monotonic clock in seconds. Use from one asyncio event loop.

    ``max_batch``: most steps per model run (None: ``MAX_DEFAULT_BATCH`` when the model
    allows batching, else 1; 1 turns batching off). ``batch_delay_us``: how long a waiting
    step may wait for others (see the module doc). ``inline_under_us`` and
    ``inline_devices``: which devices may run a step on the event loop's thread when that
    is cheaper than the hand-off to their worker (:meth:`_inline`; 0 or none: never).
    ``execute_steps``, ``ensemble`` and
    ``ensemble_decay``: the node's chunk-execution mode (see :mod:`node.chunks`; both None
    or ``"none"``: off). ``on_batch(device, size)`` is called for each model run of steps,
    ``on_queue_wait(device, seconds)`` for each step that reaches the model (time from
    being queued to its run); both on the device's worker thread, so they must be quick and
    thread-safe (Prometheus metrics are). Raises ``ValueError`` for a bad setting.
    """

    def __init__(
        self,
        devices: Sequence[str],
        session_factory: Callable[[str], Session],
        contract: PolicyContract,
        *,
        failure_threshold: int = 3,
        cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Transition | None = None,
        max_batch: int | None = None,
        batch_delay_us: float = DEFAULT_BATCH_DELAY_US,
        inline_under_us: float = 0.0,
        inline_devices: Collection[str] = (),
        execute_steps: int | None = None,
        ensemble: str | None = None,
        ensemble_decay: float = 0.01,
        on_batch: Callable[[str, int], None] | None = None,
        on_queue_wait: Callable[[str, float], None] | None = None,
        control_hz: float | None = None,
        table: EpisodeTable | None = None,
        arrivals: Arrivals | None = None,
        model: str = "",
    ) -> None:
        if not devices:
            raise ValueError("a dispatcher needs at least one device")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold={failure_threshold}: must be >= 1")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"batch size limit {max_batch}: must be >= 1 (steps per model run)")
        if not (math.isfinite(batch_delay_us) and batch_delay_us >= 0):
            raise ValueError(f"batch_delay_us={batch_delay_us}: must be a finite number >= 0")
        self.contract = contract
        self.clock = clock
        self.on_transition = on_transition
        self.on_batch = on_batch
        self.on_queue_wait = on_queue_wait
        self.batch_delay_s = batch_delay_us / 1e6
        if not 0 <= inline_under_us <= 1_000_000:
            raise ValueError(f"inline_under_us must be 0-1000000, not {inline_under_us}")
        self.inline_under_s = inline_under_us / 1e6
        self.inline_devices = frozenset(inline_devices)
        self.chunk, self._no_chunk = find_chunk(contract)
        self.rtc = rtc_of(contract)
        """The model's real-time-chunking inputs (None: it has none; ``node/rtc.py``)."""
        self.control_hz = control_hz
        self.ensemble_decay = ensemble_decay
        self.chunk_mode: ChunkMode | None = None
        """The node's chunk-execution mode (None: off)."""
        if execute_steps is not None or ensemble not in (None, "none"):
            self.chunk_mode = self.mode_for(execute_steps, ensemble)
        self.max_batch, self.batching_off = self._batching(contract, max_batch)
        self.table = table if table is not None else EpisodeTable(clock)
        """The node's episode records, shared by the dispatchers of all its models."""
        self.arrivals = arrivals if arrivals is not None else Arrivals()
        self.model = model
        """``name@version`` of the model (its records' claims); "" where none is given."""
        self._outputs = [o.name for o in contract.outputs]
        self._fed_back = set(contract.state.values())
        self._devices: dict[str, _Device] = {}
        for device in devices:
            tracker = CrashTracker(failure_threshold, cooldown_s, clock)
            self._devices[device] = _Device(
                device, session_factory(device), tracker, self.max_batch
            )
        for dev in self._devices.values():
            dev.thread = threading.Thread(
                target=self._work, args=(dev,), name=f"affinity-{dev.id}", daemon=True
            )
            dev.thread.start()

    @staticmethod
    def _batching(contract: PolicyContract, max_batch: int | None) -> tuple[int, str]:
        problem = contract.batch_blocker
        if max_batch == 1:
            log.info("batching is off (max batch 1)")
            return 1, "max batch 1"
        if problem is not None:
            log.log(
                logging.INFO if max_batch is None else logging.WARNING,
                "batching is off: %s; every step runs alone",
                problem,
            )
            return 1, problem
        size = MAX_DEFAULT_BATCH if max_batch is None else max_batch
        log.info("batching is on: up to %d steps per model run", size)
        return size, ""

    # ---- inspection ------------------------------------------------------------------

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    def tracker(self, device: str) -> CrashTracker:
        return self._device(device).tracker

    def live_episodes(self, device: str) -> int:
        """How many episode records (of any model) are on ``device``."""
        self._device(device)
        return self.table.live(device)

    def arrival(self) -> Arrival:
        """Count one step on its way through the node (:meth:`Arrivals.arrival`)."""
        return self.arrivals.arrival()

    def _device(self, device: str) -> _Device:
        try:
            return self._devices[device]
        except KeyError:
            raise KeyError(f"device {device!r} is not served by this dispatcher") from None

    # ---- steps -----------------------------------------------------------------------

    def mode_for(self, execute_steps: object = None, ensemble: object = None) -> ChunkMode | None:
        """The chunk mode of a step with these overrides (None: off).

        With neither override, the node's mode. An override replaces the node's mode for
        the step: ``execute_steps=k`` alone is execute-k without ensembling,
        ``ensemble="exp"`` alone ensembles (the model runs every step), ``"none"`` alone is
        execute-1. Raises :class:`affinity.InvalidArgument` for k outside 1..H, a
        non-integer k, an unknown ensemble mode, ensembling with k > 1, or any override
        when the model has no action chunk.
        """
        if execute_steps is None and ensemble is None:
            return self.chunk_mode
        return ChunkMode.checked(
            self.chunk, self._no_chunk, execute_steps, ensemble, self.ensemble_decay
        )

    def rtc_for(
        self,
        executed: object = None,
        inference_delay: object = None,
        control_hz: object = None,
        pending: object = None,
    ) -> Ask | None:
        """A step's real-time-chunking values, checked (None for a model without ``rtc.*``
        inputs). Raises :class:`affinity.InvalidArgument` naming the bad one, or
        ``executed``, ``inference_delay`` or ``pending`` given to a model without them (see
        :meth:`node.rtc.RtcSpec.ask`; any model's step may name its ``control_hz``)."""
        if self.rtc is None:
            given = {"executed": executed, "inference_delay": inference_delay,
                     "pending": pending}  # fmt: skip
            for name, value in given.items():
                if value is not None:
                    shown = "(array)" if name == "pending" else value
                    raise InvalidArgument(name, shown, "this model takes no rtc.* inputs")
            control_rate(control_hz)
            return None
        return self.rtc.ask(executed, inference_delay, control_hz, self.control_hz, pending)

    def observed(self, episode: str, seq: int, seconds: float) -> None:
        """Add the latency of step ``seq`` of ``episode`` (arrival to reply, seconds) to its
        record, which the delay estimate reads (RTC models only)."""
        if self.rtc is not None:
            self.table.observed(episode, seq, seconds)

    async def step(
        self,
        device: str,
        episode: str,
        token: int,
        fresh: bool,
        inputs: Mapping[str, Array],
        *,
        claim: str = "",
        seq: int | None = None,
        origin: str = "",
        deadline: float | None = None,
        execute_steps: int | None = None,
        ensemble: str | None = None,
        rtc: Ask | None = None,
        arrived: float | None = None,
        generation: int | None = None,
    ) -> StepResult:
        """Run one step of ``episode`` on ``device`` with the state of its claim (token and
        claim id), by the rules of :func:`node.episodes.admit`.

        ``fresh`` says the episode was just claimed, so no state is expected anywhere.
        ``seq`` is the step number the caller expects to be applied: the one already
        applied gets its stored reply again (``replayed``, no model run) when the inputs
        are the same; any other mismatch raises :class:`SeqConflict` and changes nothing.
        ``origin`` names the forward the step came in (see :meth:`EpisodeTable.undo`).
        ``deadline`` (``time.monotonic()``) is the step's: a step cancelled mid-run counts
        as a hung run of its device only once its deadline has passed (None: always),
        never when its client merely left. ``execute_steps`` and ``ensemble`` override the
        node's chunk mode for this step (see :meth:`mode_for`; a bad one raises
        :class:`affinity.InvalidArgument` before anything changes). ``rtc`` is what the
        step says for real-time chunking (from :meth:`rtc_for`; None: estimate both) and
        ``arrived`` the clock when it reached the node (None: now). ``generation`` is the
        table's generation when the step began (None: now): a drop since then keeps
        nothing of it.

        Raises :class:`ModelFailure` (the session raised; counted), :class:`DeviceDown`,
        :class:`ClaimEnded` (the claim ended here first), :class:`NotKept` (the node
        dropped its records meanwhile) and :class:`ForwardCancelled`. A step whose caller
        is cancelled keeps nothing (skipped, or undone if it was applied), unless it named
        its ``seq``: that one runs on and keeps its result for the caller's retry, which
        gets the run under way or its stored reply.
        """
        dev = self._device(device)
        table = self.table
        current = table.generation
        if generation is not None and generation != current:
            raise NotKept(episode)
        mode = self.mode_for(execute_steps, ensemble)
        if self.rtc is not None and rtc is None:
            rtc = self.rtc_for()
        if dev.tracker.down:
            raise DeviceDown(device)
        feed = dict(inputs)
        asked = feed if seq is not None else None
        if not fresh and (seq is not None or mode is not None) and not table.in_flight(episode):
            # a replay or a buffered action, perhaps, with nothing of this episode on the
            # worker: its record cannot change under us
            with table.lock:
                _, verdict = table.admit_locked(
                    episode, device, token, claim, fresh, seq, origin, asked
                )
                if not isinstance(verdict, Apply):
                    table.pin_locked(episode)  # delivered now: never undone
                    return verdict.result
                if mode is not None and verdict.base is not None:
                    served = self._from_buffer(dev, episode, verdict.base, mode, origin, asked)
                    if served is not None:
                        return served
        one_row = all(a.ndim >= 1 and a.shape[0] == 1 for a in feed.values())
        future = asyncio.get_running_loop().create_future()
        job = _Job(episode, token, claim, fresh, seq, origin, feed, mode, future, one_row, rtc,
                   self.clock() if arrived is None else arrived, current, asked)  # fmt: skip
        table.enter(episode)
        held = False
        try:
            if not self._inline(dev, job):
                dev.put(job)
            if seq is None:
                return await job.future
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            with job.lock:
                run = job.run
                if seq is None:
                    job.abandoned = True
                    committed = job.committed
            if run is not None and (deadline is None or time.monotonic() >= deadline):
                self._hung(dev, run)
            if seq is not None:  # held for the caller's retry: it runs on and keeps its result
                held = True
                job.future.add_done_callback(functools.partial(_held_done, table, episode))
            elif committed:
                table.undo(episode, committed)
            raise
        finally:
            if not held:
                table.leave(episode)

    def undo(self, episode: str, seq: int | None = None, origin: str | None = None) -> bool:
        """:meth:`EpisodeTable.undo` (the node's records, whichever model)."""
        return self.table.undo(episode, seq, origin)

    def _from_buffer(
        self,
        dev: _Device,
        episode: str,
        base: Episode,
        mode: ChunkMode,
        origin: str,
        asked: Mapping[str, Array] | None,
    ) -> StepResult | None:
        """Answer the step from the buffer of ``base``, the episode's current record that
        :func:`admit` chose (holding the table's lock), or None."""
        if base.buffer is None or base.device != dev.id:
            return None
        action = base.buffer.buffered(mode)
        if action is None:
            return None
        assert self.chunk is not None  # a buffer exists only for a model with a chunk
        outputs = {self.chunk.output: self.chunk.action(action.copy())}
        result = StepResult(outputs, base.doubt, base.seq + 1, "buffer")
        self.table.replace_locked(episode, advance(
            base, dev.id, base.token, base.claim, base.state, base.buffer.served(), result,
            self.clock(), None, origin, base.sent, asked=asked,
        ))  # fmt: skip
        return result

    async def run_stateless(self, device: str, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """One run from the initial state, keeping nothing (requests without any id)."""
        dev = self._device(device)
        if dev.tracker.down:
            raise DeviceDown(device)
        feed = dict(inputs)
        one_row = all(a.ndim >= 1 and a.shape[0] == 1 for a in feed.values())
        future = asyncio.get_running_loop().create_future()
        dev.put(_Job(None, 0, "", True, None, "", feed, None, future, one_row))
        result: StepResult = await future
        return result.outputs

    # ---- the device's worker ---------------------------------------------------------

    def _work(self, dev: _Device) -> None:
        while True:
            item = self._next(dev)
            if item is None:
                return
            try:
                if isinstance(item, _Call):
                    try:
                        result, error = item.fn(), None
                    except BaseException as exc:  # handed to the awaiting task
                        result, error = None, exc
                    dev.answer(item.future, result, error)
                else:
                    self._round_safely(dev, item)
            finally:
                dev.flush()  # while still busy: an inline round must not share the outbox
                with dev.cond:
                    dev.busy = False

    def _round_safely(self, dev: _Device, jobs: list[_Job]) -> None:
        try:
            self._round(dev, jobs)
        except Exception as exc:  # a bug here must not leave callers waiting forever
            log.exception("device %s: a run of %d steps broke", dev.id, len(jobs))
            for job in jobs:
                dev.answer(job.future, None, exc)

    def _inline(self, dev: _Device, job: _Job) -> bool:
        """Run ``job`` now, on the event loop's thread, instead of handing it to the
        device's worker thread, when that costs less and takes nothing from anyone: the
        device's model runs take less than :attr:`inline_under_s` on average (the hand-off
        there and back, two thread wake-ups and the GIL changing hands, costs about as much
        as such a run), the device is idle, and no other step is on its way through the
        node nor any other device busy (the loop waits for the run, so a step for another
        device would wait too). Only devices in ``inline_devices`` (the node passes its CPU
        devices: a GPU run that hangs must not stop the event loop, where its worker's
        watch marks the device down and the node goes on). False: the worker runs it, as
        always under load."""
        if dev.run_s >= self.inline_under_s or self.arrivals.count > 0 or not job.one_row:
            return False
        if dev.id not in self.inline_devices:
            return False
        if len(self._devices) > 1 and any(
            d.busy or d.pending for d in self._devices.values() if d is not dev
        ):
            return False
        with dev.cond:
            if dev.busy or dev.pending:
                return False
            dev.busy = True
        try:
            self._round_safely(dev, [job])
        finally:
            items, dev.outbox = dev.outbox, []  # the worker waits: only this round's
            with dev.cond:
                dev.busy = False
                if dev.pending:
                    dev.cond.notify()
        _settle(items)  # on this loop already: no wake-up through call_soon_threadsafe
        return True

    def _next(self, dev: _Device) -> _Call | list[_Job] | None:
        """The next work of ``dev``: a call, or the steps of one run (distinct episodes)."""
        with dev.cond:
            while True:
                while not dev.pending or dev.busy:
                    dev.cond.wait()
                head = dev.pending.popleft()
                if not isinstance(head, _Job):
                    dev.busy = head is not None
                    return head
                if not head.gave_up():
                    break
            dev.busy = True
            taken = [head]
            if dev.max_batch == 1 or not head.one_row:
                return taken
            cutoff = time.perf_counter() - _RECENT_S
            for episode, at in list(dev.recent.items()):
                if at < cutoff:
                    del dev.recent[episode]
            until = head.enqueued + self.batch_delay_s
            while True:
                self._take(dev, taken)
                now = time.perf_counter()
                if len(taken) >= dev.max_batch or now >= until or not self._expect(dev, taken):
                    return taken
                dev.cond.wait(until - now)

    @staticmethod
    def _take(dev: _Device, taken: list[_Job]) -> None:
        """Move waiting steps that may join ``taken`` from ``dev.pending`` into it."""
        # episodes with a step taken or left waiting: their later steps wait (stateless
        # runs, episode None, are all distinct)
        busy = {j.episode for j in taken if j.episode is not None}
        left: deque[_Job | _Call | None] = deque()
        for item in dev.pending:
            if isinstance(item, _Job):
                if item.gave_up():
                    continue
                joins = len(taken) < dev.max_batch and item.one_row and item.episode not in busy
                if item.episode is not None:
                    busy.add(item.episode)
                if joins:
                    taken.append(item)
                    continue
            left.append(item)
        dev.pending = left

    def _expect(self, dev: _Device, taken: list[_Job]) -> bool:
        """Whether another episode is likely to send a step soon: some step is on its way
        through the node (see :meth:`arrival`) and an episode that sent a step to this
        device within the last second has none in ``taken`` or waiting. A robot stepping
        alone, or one client stepping many episodes in turn, never waits."""
        if self.arrivals.count <= 0:  # an int read from the worker: atomic under the GIL
            return False
        waiting = {j.episode for j in taken}
        waiting.update(j.episode for j in dev.pending if isinstance(j, _Job))
        return any(episode not in waiting for episode in dev.recent)

    def _round(self, dev: _Device, jobs: list[_Job]) -> None:
        members: list[_Member] = []
        now = time.perf_counter()
        for job in jobs:
            member = self._prepare(dev, job)
            if member is None:
                continue
            job.queue_s = now - job.enqueued
            if self.on_queue_wait is not None:
                _observe(self.on_queue_wait, dev.id, job.queue_s)
            members.append(member)
        dev.flush()  # steps answered from a buffer do not wait for the model run
        if len(members) == 1:  # a step alone (one client, or one inline): nothing to group
            self._run_alone(dev, members[0])
            return
        groups: dict[tuple[tuple[str, tuple[int, ...], str], ...], list[_Member]] = {}
        for m in members:  # steps whose tensors differ beyond the first axis run apart
            key = tuple(sorted((k, v.shape[1:], v.dtype.str) for k, v in m.feed.items()))
            groups.setdefault(key, []).append(m)
        for group in groups.values():
            if len(group) == 1:
                self._run_alone(dev, group[0])
            else:
                self._run_batch(dev, group)

    def _prepare(self, dev: _Device, job: _Job) -> _Member | None:
        """Read the job's episode state; answer a buffered step at once. None: no run."""
        result: StepResult | None = None
        error: SeqConflict | ForwardCancelled | ClaimEnded | NotKept | None = None
        table = self.table
        with job.lock, table.lock:
            if job.gave_up():
                return None
            if job.episode is None:
                feed = {**job.inputs, **self.contract.initial_state()}
                if self.rtc is not None:
                    feed.update(self.rtc.none())
                return _Member(job, feed, None, None, False)
            try:
                if job.generation != table.generation:
                    raise NotKept(job.episode)
                st, verdict = table.admit_locked(
                    job.episode, dev.id, job.token, job.claim, job.fresh, job.seq, job.origin,
                    job.asked,
                )  # fmt: skip
            except (SeqConflict, ForwardCancelled, ClaimEnded, NotKept) as exc:
                error = exc
            else:
                if not isinstance(verdict, Apply):
                    table.pin_locked(job.episode)  # delivered now: never undone
                    result = verdict.result
                else:
                    base, reset = verdict.base, verdict.reset
                    if base is not None and job.mode is not None:
                        result = self._from_buffer(
                            dev, job.episode, base, job.mode, job.origin, job.asked
                        )
                        job.committed = 0 if result is None else result.seq
                    if result is None:
                        state = self.contract.initial_state() if base is None else base.state
                        feed = {**job.inputs, **state}
                        if base is None:  # the episode's first step, or its first after a reset
                            control.started(feed)
                        used = None
                        if self.rtc is not None:
                            assert job.rtc is not None  # step() gives every job of an RTC model one
                            sent = None if base is None or reset else base.sent
                            latency = () if base is None else base.latency
                            rtc_feed, used = self.rtc.feed(
                                sent, job.rtc, job.arrived, latency, self.control_hz
                            )
                            feed.update(rtc_feed)
                        return _Member(job, feed, st, base, reset, used)
        dev.answer(job.future, result, error)
        return None

    def _run_batch(self, dev: _Device, group: list[_Member]) -> None:
        n = len(group)
        size = dev.bucket(n)
        feed = {
            name: np.concatenate(
                [m.feed[name] for m in group]
                + [control.padding(name, group[0].feed[name])] * (size - n)
            )
            for name in group[0].feed
        }
        try:
            values = self._session_run(dev, feed, group)
            for name, value in values.items():
                if value.shape[:1] != (size,):
                    raise ValueError(
                        f"output {name!r} has shape {value.shape} for a batch of {size}"
                    )
        except Exception as exc:
            log.warning(
                "device %s: a batched run of %d steps failed (%s: %s); running them one by one",
                dev.id,
                n,
                type(exc).__name__,
                exc,
            )
            for m in group:
                self._run_alone(dev, m)
                dev.flush()  # each as soon as it is known
            return
        if dev.tracker.success():
            self._transition(dev.id, "up", "")
        # state kept on the device (node.binding.DeviceTensor) is scattered through the host
        host = {name: np.asarray(v) for name, v in values.items()}
        for i, m in enumerate(group):
            self._commit(dev, m, {name: v[i : i + 1].copy() for name, v in host.items()})

    def _run_alone(self, dev: _Device, m: _Member) -> None:
        with m.job.lock:
            if m.job.gave_up():
                return
        if dev.tracker.down:  # an earlier step of its failed batch took the device down
            dev.answer(m.job.future, None, DeviceDown(dev.id))
            return
        size = dev.bucket(1) if m.job.one_row else 1
        feed = m.feed
        if size > 1:
            feed = {
                name: np.concatenate([v] + [control.padding(name, v)] * (size - 1))
                for name, v in feed.items()
            }
        try:
            values = self._session_run(dev, feed, [m])
        except Exception as exc:
            self._failed(dev, f"{type(exc).__name__}: {exc}")
            dev.answer(m.job.future, None, ModelFailure(dev.id, exc))
            return
        if dev.tracker.success():
            self._transition(dev.id, "up", "")
        if size > 1:
            values = {name: np.asarray(v)[:1].copy() for name, v in values.items()}
        self._commit(dev, m, values)

    def _session_run(
        self, dev: _Device, feed: dict[str, Array], members: list[_Member]
    ) -> dict[str, Array]:
        run = _Run()
        for m in members:
            with m.job.lock:
                m.job.run = run
        started = time.perf_counter()
        try:
            values = dev.session.run(self._outputs, feed)
        finally:
            took = time.perf_counter() - started
            dev.run_s = took if dev.run_s == float("inf") else 0.8 * dev.run_s + 0.2 * took
            with run.lock:
                run.active = False
            for m in members:
                with m.job.lock:
                    m.job.run = None
                    m.job.run_s = took
            if self.on_batch is not None:
                _observe(self.on_batch, dev.id, len(members))
        return dict(zip(self._outputs, values, strict=True))

    def _commit(self, dev: _Device, m: _Member, outputs: dict[str, Array]) -> None:
        """Keep the member's new state (if its caller still waits) and answer it."""
        job = m.job
        buffer: ActionBuffer | None = None
        if job.mode is None:
            visible = {k: v for k, v in outputs.items() if k not in self._fed_back}
        else:
            assert self.chunk is not None  # a mode exists only for a model with a chunk
            chunk = self.chunk.chunk_of(outputs[self.chunk.output])
            old = None if m.base is None else m.base.buffer
            buffer, action = (old or ActionBuffer()).after_run(chunk, job.mode)
            visible = {self.chunk.output: self.chunk.action(action)}
        seq = 1 if m.base is None else m.base.seq + 1
        result = StepResult(visible, m.reset, seq, "model", rtc=m.rtc, queue_s=job.queue_s,
                            run_s=job.run_s)  # fmt: skip
        episode = job.episode
        if episode is not None:
            new_state = {name: outputs[out] for name, out in self.contract.state.items()}
            now = self.clock()
            sent = None
            if self.rtc is not None:
                assert self.chunk is not None  # an RTC model has a chunk (checked at load)
                sent = (self.chunk.chunk_of(outputs[self.chunk.output]), now)
            table = self.table
            with job.lock, table.lock:
                # keep nothing for a caller that gave up (its router, for a forward whose
                # undo came while it ran), after a drop meanwhile, or when the record it
                # read was released or replaced meanwhile; and then answer no result
                if table.cancelled_locked(job.origin):
                    dev.answer(job.future, None, ForwardCancelled(job.origin))
                    return
                if job.gave_up():
                    return
                new = advance(
                    m.base, dev.id, job.token, job.claim, new_state, buffer, result, now,
                    None if m.base else {n: m.feed[n] for n in self.contract.state},
                    job.origin, sent, model=self.model, asked=job.asked,
                )  # fmt: skip
                if not table.keep_locked(episode, m.read, job.generation, new):
                    lost = job.generation != table.generation
                    why = NotKept(episode) if lost else ClaimEnded(episode, job.claim)
                    dev.answer(job.future, None, why)
                    return
                job.committed = seq
        dev.answer(job.future, result, None)

    def _failed(self, dev: _Device, error: str) -> None:
        went_down = dev.tracker.failure(error)
        log.error("model failure on %s (%d in a row): %s", dev.id, dev.tracker.failures, error)
        if went_down:
            self._transition(dev.id, "down", dev.tracker.last_error)

    def _hung(self, dev: _Device, run: _Run) -> None:
        # The model was still running at a request's deadline: a device that hangs must go
        # down like one that raises, or its episodes never move. One count per run, however
        # many of its steps gave up.
        with run.lock:
            if not run.active or run.hang_counted:
                return
            run.hang_counted = True
        self._failed(dev, "a model run outlived its request's deadline")

    def _transition(self, device: str, to: str, reason: str) -> None:
        log.warning("device %s is %s%s", device, to, f": {reason}" if reason else "")
        if self.on_transition is not None:
            self.on_transition(device, to, reason)

    async def _call(self, dev: _Device, fn: Callable[[], Any]) -> Any:
        call = _Call(fn, asyncio.get_running_loop().create_future())
        dev.put(call)
        return await call.future

    def _run_counted(self, dev: _Device, feed: dict[str, Array]) -> None:
        try:
            dev.session.run(self._outputs, feed)
        except Exception as exc:
            self._failed(dev, f"{type(exc).__name__}: {exc}")
            raise ModelFailure(dev.id, exc) from exc
        if dev.tracker.success():
            self._transition(dev.id, "up", "")

    async def probe(self) -> list[str]:
        """Probe every down device whose cool-down has passed, with the warm-up's feed
        (``node.warmup``); a model nothing may be fed to made up comes back untested, and
        its next steps probe it (a failure takes it down again).

        Returns the devices that came back up."""
        back = []
        for dev in self._devices.values():
            if not dev.tracker.probe_due():
                continue
            feed = warmup.feed(self.contract)
            if feed is None:
                if dev.tracker.success():
                    self._transition(dev.id, "up", "")
                back.append(dev.id)
                continue
            try:
                await self._call(dev, functools.partial(self._run_counted, dev, feed))
            except ModelFailure:
                continue
            back.append(dev.id)
        return back

    async def warm_up(self) -> None:
        """Warm every device up on its own worker thread, one device after another, before
        serving. A session with a ``warm_up()`` method (``node.binding.BoundSession``, which
        captures its CUDA graph there) is asked to; any other runs the feed of
        ``node.warmup`` (the operator's samples, else zeros) once at every batch size it will
        use (a session with ``batch_sizes`` captures one graph per size there); a model with
        an input nothing may be fed (``node.warmup.unfed``) is not run at all.
        ONNX Runtime keeps a captured CUDA graph per thread, so the capture must happen on the
        thread that runs the device's steps; CUDA's capture mode is process-wide, so devices
        go one at a time. Raises what a run raised (nothing is counted: the node stops)."""
        if warmup.unfed(self.contract):
            return
        for dev in self._devices.values():
            warm = getattr(dev.session, "warm_up", None)
            if warm is not None:
                await self._call(dev, warm)
                continue
            for size in [s for s in dev.sizes or () if s <= dev.max_batch] or [dev.bucket(1)]:
                feed = warmup.feed(self.contract, size)
                assert feed is not None  # no unfed input
                run = functools.partial(warmup.run, dev.session, self._outputs, feed)
                await self._call(dev, run)

    def close(self) -> None:
        for dev in self._devices.values():
            dev.put(None)
        for dev in self._devices.values():
            if dev.thread is not None:
                dev.thread.join(timeout=30)


def _observe(hook: Callable[[str, Any], None], device: str, value: Any) -> None:
    try:
        hook(device, value)
    except Exception:  # a metrics hook must never fail a model run
        log.exception("device %s: a dispatcher hook raised", device)


def _held_done(table: EpisodeTable, episode: str, future: asyncio.Future[Any]) -> None:
    """A step held for its caller's retry ended: it no longer counts as in flight."""
    if not future.cancelled():
        future.exception()  # retrieved: nobody else awaits it
    table.leave(episode)


def _settle(items: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, result, exc in items:
        if future.done():  # cancelled, or already failed by a broken round
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
