"""``MultiGpuDispatcher``: one session and one worker thread per device, per-episode state.

Pure composition: no HTTP, no Redis. Sessions come from an injectable factory, so the
routing and state logic is tested with fakes and no GPU.

- Each device runs its model on its own single worker thread. ONNX Runtime releases the
  GIL while it runs, so runs on different GPUs overlap; runs on one device are serialized,
  which also serializes the read-modify-write of an episode's state.
- Per-episode state is keyed by (episode, token). A step whose token differs from the
  stored one starts from the initial state and says ``state_reset=True``; so does a step
  of an episode that was not freshly claimed but has no state here (a restarted node).
- A crash tracker per device counts consecutive model failures; at the threshold it calls
  ``on_transition(device, "down", reason)``; after the cool-down a probe run on the
  device's worker decides whether it comes back (``on_transition(device, "up", "")``).
  Bad client input is rejected before it reaches the dispatcher and never counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from node.policy import PolicyContract

__all__ = [
    "CrashTracker",
    "DeviceDown",
    "ModelFailure",
    "MultiGpuDispatcher",
    "Session",
    "StepResult",
]

log = logging.getLogger("affinity.node")

Array = np.ndarray[Any, Any]


class Session(Protocol):
    """What the dispatcher needs of a model session (``onnxruntime.InferenceSession``)."""

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


@dataclass(frozen=True)
class StepResult:
    outputs: dict[str, Array]  # every model output that is not fed back as state
    state_reset: bool
    step: int  # 1-based step count of this (episode, token) on this device


@dataclass
class _EpisodeState:
    device: str
    token: int
    state: dict[str, Array]
    last_used: float
    steps: int = 0


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


T = TypeVar("T")


class _Abandoned(Exception):
    """A queued step whose caller gave up before it started: it is not run."""


@dataclass
class _Job:
    """What a step and its caller share to agree on whether its state is kept."""

    future: asyncio.Future[StepResult]
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    committed: bool = False
    running: bool = False  # the model run has started and not returned


class _Worker:
    """One thread that runs one device's work items in order.

    Lighter than a one-thread ``ThreadPoolExecutor`` behind ``run_in_executor`` (no
    concurrent future chained to an asyncio one): a work item is queued with the asyncio
    future it completes, and the thread completes it with ``call_soon_threadsafe``.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self.submit(future, fn, *args)
        return future

    def submit(self, future: asyncio.Future[T], fn: Callable[..., T], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread and complete ``future`` (of the running loop)."""
        self._queue.put((future.get_loop(), future, fn, args))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            loop, future, fn, args = item
            if future.cancelled():  # racy read, only to skip work early; _Job decides
                continue
            try:
                result, exc = fn(*args), None
            except BaseException as error:  # handed to the awaiting task, not swallowed
                result, exc = None, error
            # a loop that closed meanwhile has nobody left waiting
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, result, exc)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


@dataclass
class _Device:
    id: str
    session: Session
    worker: _Worker
    tracker: CrashTracker
    live: set[str] = field(default_factory=set)


Transition = Callable[[str, str, str], None]


class MultiGpuDispatcher:
    """Routes steps to per-device sessions and keeps per-episode state.

    ``devices`` are device ids (``<node>/<index>``); ``session_factory(device_id)`` builds
    the device's session (called once per device, in the constructor). ``clock`` is a
    monotonic clock in seconds. Thread-safe for use from one asyncio loop.
    """

    def __init__(
        self,
        devices: Sequence[str],
        session_factory: Callable[[str], Session],
        contract: PolicyContract,
        *,
        idle_ttl_s: float = 300.0,
        failure_threshold: int = 3,
        cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Transition | None = None,
    ) -> None:
        if not devices:
            raise ValueError("a dispatcher needs at least one device")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold={failure_threshold}: must be >= 1")
        self.contract = contract
        self.idle_ttl_s = idle_ttl_s
        self.clock = clock
        self.on_transition = on_transition
        self._lock = threading.Lock()
        self._states: dict[str, _EpisodeState] = {}
        # steps whose caller still waits, per episode; touched only on the event loop
        self._in_flight: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self._generation = 0  # bumped by drop_all(): steps running across it keep nothing
        self._outputs = [o.name for o in contract.outputs]
        self._fed_back = set(contract.state.values())
        self._devices: dict[str, _Device] = {}
        for device in devices:
            self._devices[device] = _Device(
                id=device,
                session=session_factory(device),
                worker=_Worker(f"affinity-{device}"),
                tracker=CrashTracker(failure_threshold, cooldown_s, clock),
            )

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    def tracker(self, device: str) -> CrashTracker:
        return self._device(device).tracker

    def live_episodes(self, device: str) -> int:
        with self._lock:
            return len(self._device(device).live)

    def has_state(self, episode: str) -> bool:
        with self._lock:
            return episode in self._states

    def token_of(self, episode: str) -> int | None:
        """The token of the state held here for ``episode``, if any."""
        with self._lock:
            st = self._states.get(episode)
            return None if st is None else st.token

    def episodes(self) -> list[tuple[str, int, str]]:
        """(episode, token, device) of every episode with state held here."""
        with self._lock:
            return [(ep, st.token, st.device) for ep, st in self._states.items()]

    def in_flight(self, episode: str) -> bool:
        """True while a step of ``episode`` is queued or running and its caller still waits.

        A step whose caller gave up (deadline, cancellation) no longer counts: it keeps no
        state, so it cannot change the episode any more (see :meth:`step`).
        """
        return episode in self._in_flight

    async def wait_idle(self, episode: str) -> None:
        """Return once no step of ``episode`` is in flight (see :meth:`in_flight`).

        After it returns, the episode's state here changes only through a new step: a
        graceful hand-over waits for this before giving the episode away. It waits as long
        as the model runs; bound it with a timeout (a hung device's steps end at their
        deadlines).
        """
        while episode in self._in_flight:
            idle = self._idle.get(episode)
            if idle is None:
                idle = self._idle[episode] = asyncio.Event()
            await idle.wait()

    def _started(self, episode: str) -> None:
        self._in_flight[episode] = self._in_flight.get(episode, 0) + 1

    def _ended(self, episode: str) -> None:
        left = self._in_flight[episode] - 1
        if left:
            self._in_flight[episode] = left
            return
        del self._in_flight[episode]
        idle = self._idle.pop(episode, None)
        if idle is not None:
            idle.set()

    def _device(self, device: str) -> _Device:
        try:
            return self._devices[device]
        except KeyError:
            raise KeyError(f"device {device!r} is not served by this dispatcher") from None

    async def step(
        self, device: str, episode: str, token: int, fresh: bool, inputs: Mapping[str, Array]
    ) -> StepResult:
        """Run one step of ``episode`` on ``device`` with the state of (episode, token).

        ``fresh`` says the episode was just claimed, so no state is expected anywhere.
        Raises :class:`ModelFailure` (the session raised; counted) and
        :class:`DeviceDown`. The state is only advanced when the run succeeds and its
        caller is still waiting: a step whose request was cancelled (its deadline passed)
        is skipped if it has not started, and keeps nothing if it has. In the instant where
        the state was kept but the caller is cancelled anyway, the state is dropped, so the
        episode's next step starts clean and says ``state_reset``.
        """
        dev = self._device(device)
        if dev.tracker.down:
            raise DeviceDown(device)
        job = _Job(asyncio.get_running_loop().create_future())
        dev.worker.submit(job.future, self._step, dev, episode, token, fresh, dict(inputs), job)
        self._started(episode)
        try:
            return await job.future
        except asyncio.CancelledError:
            with job.lock:
                job.abandoned = True
                committed = job.committed
            if committed:
                self.release(episode)
            if job.running:
                # the model was still running at the request's deadline: a device that
                # hangs must go down like one that raises, or its episodes never move
                self._failed(dev, "a model run outlived its request's deadline")
            raise
        finally:
            self._ended(episode)

    def _step(
        self,
        dev: _Device,
        episode: str,
        token: int,
        fresh: bool,
        inputs: dict[str, Array],
        job: _Job,
    ) -> StepResult:
        if job.abandoned:
            raise _Abandoned
        with self._lock:
            st = self._states.get(episode)
            generation = self._generation
        if st is not None and st.token == token and st.device == dev.id:
            state, reset, steps = st.state, False, st.steps
        else:
            state, reset, steps = self.contract.initial_state(), st is not None or not fresh, 0
        job.running = True
        try:
            outputs = self._run(dev, {**inputs, **state})
        finally:
            job.running = False
        new_state = {name: outputs[out] for name, out in self.contract.state.items()}
        now = self.clock()
        with job.lock, self._lock:
            # Keep nothing for a caller that gave up, or after drop_all() ran meanwhile.
            # Task.cancel() cancels the awaited future at once, before the task runs its
            # handler (which sets `abandoned`): a plain read of it (atomic under the GIL)
            # keeps a step cancelled while it ran from committing and being read by the
            # episode's next queued step before the handler can drop it.
            cancelled = job.abandoned or job.future.cancelled()
            if not cancelled and generation == self._generation:
                old = self._states.get(episode)
                if old is not None and old.device != dev.id:
                    self._devices[old.device].live.discard(episode)
                self._states[episode] = _EpisodeState(dev.id, token, new_state, now, steps + 1)
                dev.live.add(episode)
                job.committed = True
        visible = {k: v for k, v in outputs.items() if k not in self._fed_back}
        return StepResult(visible, reset, steps + 1)

    def _run(self, dev: _Device, feed: dict[str, Array]) -> dict[str, Array]:
        try:
            values = dev.session.run(self._outputs, feed)
        except Exception as exc:
            self._failed(dev, f"{type(exc).__name__}: {exc}")
            raise ModelFailure(dev.id, exc) from exc
        if dev.tracker.success():
            self._transition(dev.id, "up", "")
        return dict(zip(self._outputs, values, strict=True))

    def _failed(self, dev: _Device, error: str) -> None:
        went_down = dev.tracker.failure(error)
        log.error("model failure on %s (%d in a row): %s", dev.id, dev.tracker.failures, error)
        if went_down:
            self._transition(dev.id, "down", dev.tracker.last_error)

    def _transition(self, device: str, to: str, reason: str) -> None:
        log.warning("device %s is %s%s", device, to, f": {reason}" if reason else "")
        if self.on_transition is not None:
            self.on_transition(device, to, reason)

    async def run_stateless(self, device: str, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """One run from the initial state, keeping nothing (requests without any id)."""
        dev = self._device(device)
        if dev.tracker.down:
            raise DeviceDown(device)
        feed = {**inputs, **self.contract.initial_state()}
        outputs = await dev.worker.run(self._run, dev, feed)
        return {k: v for k, v in outputs.items() if k not in self._fed_back}

    async def probe(self) -> list[str]:
        """Probe every down device whose cool-down has passed, with a run of zeros.

        Returns the devices that came back up."""
        back = []
        for dev in self._devices.values():
            if not dev.tracker.probe_due():
                continue
            feed = {spec.name: spec.zeros() for spec in self.contract.observation_inputs}
            feed.update(self.contract.initial_state())
            try:
                await dev.worker.run(self._run, dev, feed)
            except ModelFailure:
                continue
            back.append(dev.id)
        return back

    def release(self, episode: str) -> bool:
        """Drop the state of ``episode``; True when there was some."""
        with self._lock:
            st = self._states.pop(episode, None)
            if st is not None:
                self._devices[st.device].live.discard(episode)
        return st is not None

    def expire_idle(self) -> int:
        """Drop the state of episodes idle for longer than ``idle_ttl_s``; return how many."""
        cutoff = self.clock() - self.idle_ttl_s
        with self._lock:
            stale = [ep for ep, st in self._states.items() if st.last_used < cutoff]
            for ep in stale:
                st = self._states.pop(ep)
                self._devices[st.device].live.discard(ep)
        return len(stale)

    def drop_all(self) -> int:
        """Drop every episode's state (self-fencing); return how many."""
        with self._lock:
            n = len(self._states)
            self._states.clear()
            self._generation += 1
            for dev in self._devices.values():
                dev.live.clear()
        return n

    def close(self) -> None:
        for dev in self._devices.values():
            dev.worker.close()
