"""A device's crash tracking: consecutive model failures and the cool-down before a probe.

Each model has a crash tracker per device, fed by the device's worker (``node/worker.py``).
Its transitions go to the node's :class:`node.health.DeviceHealth`, which tells Redis.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["CrashTracker", "Transition"]

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

    def force_down(self, error: str) -> bool:
        """Take the device down now, whatever the count (its worker process died); True
        when this takes it down."""
        with self.lock:
            self.last_error = error
            self.failures = max(self.failures, self.threshold)
            was_down = self.down
            self.down_since = self.clock()
            return not was_down

    def probe_due(self) -> bool:
        return self.down_since is not None and self.clock() - self.down_since >= self.cooldown_s
