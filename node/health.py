"""The health of a node's devices, and Redis's view of it.

Each model has a crash tracker per device (``node/crashes.py``). The probe and warm-up runs
are made on a device's worker (``node/warmup.py``). :class:`DeviceHealth` carries the
trackers' transitions to Redis and makes Redis agree with them.

A device is down when any of its models' trackers has it down. Failures are counted per
model, by the device's worker (``node/worker.py``). ``down`` belongs to the node. Redis is
told at each transition and made to agree again at each renewal. A lost or reordered write
must not leave a crashed device taking claims, or a healthy one down. An operator's drain
belongs to Redis. Bad client input never reaches a model, so it never counts.

A device that went down is *unchecked* until its owner has checked its records against
Redis once it is up again, here and in Redis: while it was down a step of its episodes may
have been moved elsewhere (``reassigned``), and a record Redis no longer names must never
serve again (``Owner.recheck``). It is marked on the device's own thread, as it goes down,
so it is never back up unmarked.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import Protocol

from affinity import AffinityError, Registry
from node.crashes import CrashTracker
from node.metrics import Metrics

__all__ = ["DeviceHealth", "ModelDevices"]

log = logging.getLogger("affinity.node")


class ModelDevices(Protocol):
    """One model's devices, as the health asks them (``node.dispatcher.MultiGpuDispatcher``)."""

    @property
    def devices(self) -> list[str]: ...

    def tracker(self, device: str) -> CrashTracker: ...

    async def probe(self) -> list[str]: ...

    def close(self) -> None: ...


class DeviceHealth:
    """The health of one node's devices, over the dispatchers of all its models."""

    def __init__(
        self,
        dispatchers: Mapping[str, ModelDevices],
        registry: Registry,
        metrics: Metrics,
    ) -> None:
        self.dispatchers = dispatchers
        self.registry = registry
        self.metrics = metrics
        self.devices = next(iter(dispatchers.values())).devices
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._unchecked: dict[str, int] = {}  # device -> how many times it went down
        self._lock = threading.Lock()  # the device threads mark, the loop checks
        self._down: set[str] = set()
        """The devices whose last transition said was down: a device goes down once when
        its first model's tracker does, and up once its last one's is up again."""

    def start(self) -> None:
        """Begin taking transitions (from the device threads) on the running loop."""
        self._loop = asyncio.get_running_loop()

    def tracker(self, device: str) -> CrashTracker:
        """A tracker that has ``device`` down, if any model's does; else the first one."""
        trackers = [d.tracker(device) for d in self.dispatchers.values()]
        return next((t for t in trackers if t.down), trackers[0])

    def down(self, device: str) -> bool:
        return any(d.tracker(device).down for d in self.dispatchers.values())

    def unchecked(self, device: str) -> bool:
        """Whether ``device`` went down since its records were last checked (module doc)."""
        return device in self._unchecked

    async def back_up(self) -> dict[str, int]:
        """The unchecked devices that are up here and in Redis (no step moves an episode
        away from them any more), each with its mark for :meth:`checked`. Raises what the
        registry raises."""
        with self._lock:
            marks = {d: n for d, n in self._unchecked.items() if not self.down(d)}
        if not marks:
            return {}
        states = await self.registry.states(list(marks))
        return {d: n for d, n in marks.items() if states.get(d) != "down"}

    def checked(self, device: str, mark: int) -> None:
        """``device``'s records were checked after :meth:`back_up` gave it ``mark``: served
        from memory again, unless it went down once more meanwhile."""
        with self._lock:
            if self._unchecked.get(device) == mark:
                del self._unchecked[device]

    def on_transition_threadsafe(self, device: str, to: str, reason: str) -> None:
        """A crash tracker took ``device`` down or brought it back (any thread)."""
        if to == "down":  # marked at once: before it can come back up
            with self._lock:
                self._unchecked[device] = self._unchecked.get(device, 0) + 1
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._track, device, to, reason)

    def _track(self, device: str, to: str, reason: str) -> None:
        task = asyncio.ensure_future(self._on_transition(device, to, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_transition(self, device: str, to: str, reason: str) -> None:
        if to == "down":
            if device in self._down:  # another model's tracker has it down already
                return
            self._down.add(device)
        else:
            if device not in self._down or self.down(device):  # another model's still down
                return
            self._down.discard(device)
        log.warning("device %s is %s%s", device, to, f": {reason}" if reason else "")
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
