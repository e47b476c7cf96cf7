"""Scored placement's measurements: each device's step time as a function of its batch, and
the score a node publishes for it at each renewal (docs/policies.md, "How a device is
chosen").

The model: an EWMA of the run time per batch size seen (weight 0.2 per run). Batch sizes
are few (1 to ``--max-batch``), and a GPU's run time is not linear in its batch (flat, then
rising), so a curve fitted through all sizes would be wrong at both ends. A size not seen yet
is read off linearly between the nearest sizes seen (beyond them: the nearest one's time,
scaled by the batch beyond the largest).

The score of a device with ``n`` episodes is the step time a new episode would see there:
``n + 1`` episodes in batches of at most ``B`` (``--max-batch``) take ``ceil((n+1)/B)``
runs at batch ``min(n+1, B)``, each one run after the other. Its cost is what one more
episode adds to that (a claim moves the device's score by it, so a burst spreads). A device
never measured scores 0 with a nominal cost (1 ms): it is tried, then measured.

Runs are recorded on the workers' threads (:meth:`StepTimes.ran`), read on the event loop
at a renewal (:meth:`StepTimes.scores`): one lock between them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

from affinity.registry import DeviceScore

__all__ = ["NOMINAL_COST_MS", "StepTimes"]

ALPHA = 0.2  # weight of a new run in its batch size's average
NOMINAL_COST_MS = 1.0  # the cost a device never measured publishes
MIN_COST_MS = 0.01  # a cost never rounds to nothing: a burst still spreads


class StepTimes:
    """Run times per (device, batch size) and the scores they give (see the module doc).
    ``max_batch``: the node's most steps per run (1: no batching)."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max(1, max_batch)
        self._lock = threading.Lock()
        self._ms: dict[str, dict[int, float]] = {}  # device -> batch size -> EWMA of ms

    def ran(self, device: str, run: tuple[int, float]) -> None:
        """One model run on ``device``: (its batch size, its seconds). A worker's hook."""
        rows, seconds = run
        if rows < 1 or not seconds >= 0:
            return
        ms = seconds * 1000
        with self._lock:
            sizes = self._ms.setdefault(device, {})
            old = sizes.get(rows)
            sizes[rows] = ms if old is None else old + ALPHA * (ms - old)

    def run_ms(self, device: str, batch: int) -> float | None:
        """The run time (ms) of a batch of ``batch`` on ``device``; None: never measured."""
        with self._lock:
            sizes = dict(self._ms.get(device, {}))
        if not sizes:
            return None
        if batch in sizes:
            return sizes[batch]
        seen = sorted(sizes)
        below = [s for s in seen if s < batch]
        above = [s for s in seen if s > batch]
        if below and above:
            lo, hi = below[-1], above[0]
            return sizes[lo] + (sizes[hi] - sizes[lo]) * (batch - lo) / (hi - lo)
        if above:  # smaller than any seen: no faster than the smallest
            return sizes[above[0]]
        largest = below[-1]  # larger than any seen: at least proportionally slower
        return sizes[largest] * batch / largest

    def step_ms(self, device: str, episodes: int) -> float | None:
        """The step time (ms) of ``episodes`` stepping together on ``device``."""
        b = min(episodes, self.max_batch)
        run = self.run_ms(device, b)
        return None if run is None else run * math.ceil(episodes / self.max_batch)

    def score(self, device: str, live: int) -> tuple[float, float]:
        """(step ms a new episode would see, cost ms of one more) with ``live`` held."""
        now = self.step_ms(device, live + 1)
        after = self.step_ms(device, live + 2)
        if now is None or after is None:
            return 0.0, NOMINAL_COST_MS
        return now, max(after - now, MIN_COST_MS)

    def scores(
        self, devices: Sequence[tuple[int, str]], live: Callable[[str], int], capacity: int
    ) -> list[DeviceScore]:
        """The scores to publish: one per (index, device id) with room (its ``live``
        episodes fewer than ``capacity``)."""
        out = []
        for index, device in devices:
            n = live(device)
            if n < capacity:
                step, cost = self.score(device, n)
                out.append(DeviceScore(index, step, cost))
        return out
