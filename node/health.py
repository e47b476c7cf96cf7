"""The health of a node's devices: crash trackers, probe and warm-up runs, and Redis's view.

Each model has a crash tracker per device. The probe and warm-up runs are made on a
device's worker. :class:`DeviceHealth` carries the trackers' transitions to Redis and
makes Redis agree with them.

A device is down when any of its models' trackers has it down. Failures are counted per
model, by the device's worker (``node/worker.py``). ``down`` belongs to the node. Redis is
told at each transition and made to agree again at each renewal. A lost or reordered write
must not leave a crashed device taking claims, or a healthy one down. An operator's drain
belongs to Redis. Bad client input never reaches a model, so it never counts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from affinity import AffinityError, Registry
from node import warmup
from node.contract import Array, PolicyContract
from node.errors import DeviceDown, ModelFailure
from node.metrics import Metrics

if TYPE_CHECKING:
    from node.dispatcher import MultiGpuDispatcher
    from node.worker import DeviceWorker

__all__ = [
    "CrashTracker",
    "DeviceDown",
    "DeviceHealth",
    "ModelFailure",
    "Transition",
    "probe",
    "warm_up",
]

log = logging.getLogger("affinity.node")

Transition = Callable[[str, str, str], None]
"""``(device, "down" | "up", reason)``: a crash tracker took a device down or brought it
back. Called on the device's worker thread (or the event loop, for a hung run)."""


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


async def probe(worker: DeviceWorker, contract: PolicyContract) -> bool:
    """Probe ``worker``'s device if it is down and its cool-down has passed. The probe runs
    the warm-up's feed (``node.warmup``) on its worker thread. True when it came back up. A
    model nothing may be fed to made up comes back untested, and its next steps probe it (a
    failure takes it down again)."""
    if not worker.tracker.probe_due():
        return False
    feed = warmup.feed(contract)
    if feed is None:
        worker.count_success()
        return True
    try:
        await worker.call(functools.partial(_run_counted, worker, feed))
    except ModelFailure:
        return False
    return True


def _run_counted(worker: DeviceWorker, feed: dict[str, Array]) -> None:
    """One run of ``feed`` that counts as the device's; raises :class:`ModelFailure`."""
    try:
        worker.session.run(worker.outputs, feed)
    except Exception as exc:
        worker.count_failure(f"{type(exc).__name__}: {exc}")
        raise ModelFailure(worker.id, exc) from exc
    worker.count_success()


async def warm_up(worker: DeviceWorker, contract: PolicyContract) -> None:
    """Warm ``worker``'s device up on its worker thread, before serving. A session with a
    ``warm_up()`` method is asked to (``node.binding.BoundSession`` captures its CUDA graph
    there). Any other runs the feed of ``node.warmup`` (the operator's samples, else zeros).
    It runs once at every batch size it will use. A session with ``batch_sizes`` captures
    one graph per size there. A model with an input nothing may be fed
    (``node.warmup.unfed``) is not run at all. ONNX Runtime keeps a captured CUDA graph per
    thread. So the capture must happen on the thread that runs the device's steps. CUDA's
    capture mode is process-wide, so warm one device at a time. Raises what a run raised
    (nothing is counted: the node stops)."""
    if warmup.unfed(contract):
        return
    warm = getattr(worker.session, "warm_up", None)
    if warm is not None:
        await worker.call(warm)
        return
    sizes = [s for s in worker.sizes or () if s <= worker.max_batch] or [worker.bucket(1)]
    for size in sizes:
        feed = warmup.feed(contract, size)
        assert feed is not None  # no unfed input
        await worker.call(functools.partial(warmup.run, worker.session, worker.outputs, feed))


class DeviceHealth:
    """The health of one node's devices, over the dispatchers of all its models."""

    def __init__(
        self,
        dispatchers: Mapping[str, MultiGpuDispatcher],
        registry: Registry,
        metrics: Metrics,
    ) -> None:
        self.dispatchers = dispatchers
        self.registry = registry
        self.metrics = metrics
        self.devices = next(iter(dispatchers.values())).devices
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Begin taking transitions (from the device threads) on the running loop."""
        self._loop = asyncio.get_running_loop()

    def tracker(self, device: str) -> CrashTracker:
        """A tracker that has ``device`` down, if any model's does; else the first one."""
        trackers = [d.tracker(device) for d in self.dispatchers.values()]
        return next((t for t in trackers if t.down), trackers[0])

    def down(self, device: str) -> bool:
        return any(d.tracker(device).down for d in self.dispatchers.values())

    def on_transition_threadsafe(self, device: str, to: str, reason: str) -> None:
        """A crash tracker took ``device`` down or brought it back (any thread)."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._track, device, to, reason)

    def _track(self, device: str, to: str, reason: str) -> None:
        task = asyncio.ensure_future(self._on_transition(device, to, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

    async def reconcile(self) -> None:
        """Make Redis agree with the crash trackers, and the state gauges with Redis (an
        operator's drain). Raises what the registry raises."""
        states = await self.registry.states(self.devices)
        for device, state in states.items():
            tracker = self.tracker(device)
            if tracker.down and state in ("active", "draining"):
                state = "down"
                await self.registry.set_state(device, "down", tracker.last_error[:256])
            elif not tracker.down and state == "down":
                change = await self.registry.set_state(device, "active", "", only_if="down")
                state = change.state  # a drain from before comes back
            if state in ("active", "draining", "down"):
                self.metrics.set_state(device, state)

    async def probe(self) -> list[str]:
        """Probe every down device whose cool-down has passed (each model's session);
        returns the devices that came back up."""
        back: list[str] = []
        for d in self.dispatchers.values():
            back += [dev for dev in await d.probe() if dev not in back]
        return back

    def close(self) -> None:
        for d in self.dispatchers.values():
            d.close()
