"""Scored placement's measurements: each device's step time as a function of its batch, and
the score a node publishes for it at each renewal (docs/policies.md, "How a device is
chosen").

The run time: an EWMA per batch size seen (weight 0.2 per run). Batch sizes are few (1 to
``--max-batch``), and a GPU's run time is not linear in its batch (flat, then rising), so
one curve fitted through all sizes would be wrong at both ends. A size not seen yet is read
off linearly between the nearest sizes seen (beyond them: the nearest one's time, scaled by
the batch beyond the largest).

The step time a new episode would see: the device's batcher runs what queued during the
run before, so with ``n + 1`` episodes stepping at ``r`` steps/ms each (measured: rows run
per ms since the last renewal over the episodes held) its batch settles at the smallest
``b`` with ``b = (n + 1) r t(b)`` (1 when it idles between steps), and a step waits for the
run in progress, then runs: ``2 t(b)``. When even a full batch cannot keep up
(``(n + 1) r t(B) > B``, ``B`` = ``--max-batch``) the queue grows without bound: the score
is ``2 t(B)`` times the overload, so the gate refuses it. Its cost, what a claim adds to the
score, is what one more episode adds to that, at least a row's share of a batch-1 run
(``t(1) / B``) so that a burst spreads. A device never measured scores 0 with a nominal cost
(1 ms): it is tried, then measured.

Runs are noted on the workers' threads (:meth:`StepTimes.ran`: an append, no lock, as it
comes each step) and counted into the averages, under one lock, every :data:`COUNT_EVERY`
runs and before every read, such as the event loop's at a renewal
(:meth:`StepTimes.scores`): a read sees every run noted before it, in order.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

from affinity.registry import DeviceScore

__all__ = ["COUNT_EVERY", "NOMINAL_COST_MS", "StepTimes"]

ALPHA = 0.2  # weight of a new run in its batch size's average
NOMINAL_COST_MS = 1.0  # the cost a device never measured publishes
MIN_COST_MS = 0.01  # a cost never rounds to nothing: a burst still spreads
COUNT_EVERY = 256  # runs noted before they are counted (a read counts them at once)


class StepTimes:
    """Run times per (device, batch size) and the scores they give (see the module doc).
    ``max_batch``: the node's most steps per run (1: no batching). ``clock``: seconds."""

    def __init__(self, max_batch: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_batch = max(1, max_batch)
        self.clock = clock
        self._lock = threading.Lock()
        self._ms: dict[str, dict[int, float]] = {}  # device -> batch size -> EWMA of ms
        self._rows: dict[str, int] = {}  # device -> rows run since the last scores()
        self._rate: dict[str, float] = {}  # device -> steps/ms of one episode held (EWMA)
        self._since = clock()
        self._noted: list[tuple[str, tuple[int, float]]] = []  # runs not counted yet

    def ran(self, device: str, run: tuple[int, float]) -> None:
        """One model run on ``device``: (its batch size, its seconds). A worker's hook."""
        noted = self._noted
        noted.append((device, run))
        if len(noted) >= COUNT_EVERY:
            with self._lock:
                self._count_locked()

    def _count_locked(self) -> None:
        """Count the runs noted so far into the averages (the lock held)."""
        noted = self._noted
        runs = noted[: len(noted)]
        del noted[: len(runs)]  # (runs noted meanwhile stay, at its end)
        for device, (rows, seconds) in runs:
            if rows < 1 or not seconds >= 0:
                continue
            ms = seconds * 1000
            sizes = self._ms.get(device)
            if sizes is None:
                sizes = self._ms[device] = {}
            old = sizes.get(rows)
            sizes[rows] = ms if old is None else old + ALPHA * (ms - old)
            self._rows[device] = self._rows.get(device, 0) + rows

    def run_ms(self, device: str, batch: int) -> float | None:
        """The run time (ms) of a batch of ``batch`` on ``device``; None: never measured."""
        with self._lock:
            self._count_locked()
            sizes = dict(self._ms.get(device, {}))
        return _read_off(sizes, batch)

    def step_ms(self, device: str, episodes: int, rate: float) -> float | None:
        """The step time (ms) ``episodes`` see on ``device``, each stepping at ``rate``
        steps/ms (see the module doc); None: never measured."""
        with self._lock:
            self._count_locked()
            sizes = dict(self._ms.get(device, {}))
        if not sizes:
            return None
        arrivals = episodes * rate  # steps/ms
        full = _read_off(sizes, self.max_batch)
        assert full is not None
        if arrivals * full > self.max_batch:  # not even full batches keep up
            return 2 * full * arrivals * full / self.max_batch
        b = 1.0
        for _ in range(32):  # the smallest fixed point of b = arrivals x t(b), from below
            t = _read_off(sizes, max(1, min(self.max_batch, math.ceil(b))))
            assert t is not None
            nxt = max(1.0, arrivals * t)
            if abs(nxt - b) < 1e-3:
                break
            b = nxt
        t = _read_off(sizes, max(1, min(self.max_batch, math.ceil(b))))
        assert t is not None
        return 2 * t

    def score(self, device: str, live: int, rate: float) -> tuple[float, float]:
        """(step ms a new episode would see, cost ms of one more) with ``live`` held."""
        now = self.step_ms(device, live + 1, rate)
        after = self.step_ms(device, live + 2, rate)
        one = self.run_ms(device, 1)
        if now is None or after is None or one is None:
            return 0.0, NOMINAL_COST_MS
        return now, max(after - now, one / self.max_batch, MIN_COST_MS)

    def scores(
        self, devices: Sequence[tuple[int, str]], live: Callable[[str], int], capacity: int
    ) -> list[DeviceScore]:
        """The scores to publish: one per (index, device id) with room (its ``live``
        episodes fewer than ``capacity``). Reads the step rates since the last call."""
        now = self.clock()
        with self._lock:
            self._count_locked()
            rows, self._rows = self._rows, {}
            window_ms = (now - self._since) * 1000
            self._since = now
        out = []
        for index, device in devices:
            n = live(device)
            if n > 0 and window_ms > 0 and device in rows:
                measured = rows[device] / window_ms / n
                old = self._rate.get(device)
                self._rate[device] = measured if old is None else old + 0.5 * (measured - old)
            if n < capacity:
                known = list(self._rate.values())
                rate = self._rate.get(device, sum(known) / len(known) if known else 0.0)
                step, cost = self.score(device, n, rate)
                out.append(DeviceScore(index, step, cost))
        return out


def _read_off(sizes: dict[int, float], batch: int) -> float | None:
    """The run time (ms) at ``batch`` from the EWMAs per batch size (module doc)."""
    if not sizes:
        return None
    if batch in sizes:
        return sizes[batch]
    below = [s for s in sizes if s < batch]
    above = [s for s in sizes if s > batch]
    if below and above:
        lo, hi = max(below), min(above)
        return sizes[lo] + (sizes[hi] - sizes[lo]) * (batch - lo) / (hi - lo)
    if above:  # smaller than any seen: no faster than the smallest
        return sizes[min(above)]
    largest = max(below)  # larger than any seen: at least proportionally slower
    return sizes[largest] * batch / largest
