"""The node's processes as its registration and each renewal publish them (issue 43:
``affinity nodes`` and the fleet page show the processes of each node).

With ``--front-doors N`` > 1 a node is its core and N front processes the core supervises
(``node/fronts.py``); with ``--device-workers process`` the core also supervises one worker
process per device (``node/deviceprocs.py``, roles ``dev<index>``). An operator looking at
the fleet must see that shape, each process's pid, a front or worker that keeps being
restarted, and a saturated event loop, without logging in to the host. The fronts' fork
server (``node/forkserver.py``) is listed apart, as a helper (``helpers``), with its pid and
restarts: a process of the node, and of its memory, that serves no door itself. :class:`Processes`
describes them (:class:`affinity.registry.NodeProcesses`) when the lease asks: at
registration and at each renewal, riding the same script call, so it costs no Redis command
more and is at most a renewal old. A process the core restarted shows with its new pid and
its restart count at the next renewal.

The lag is read from the histograms ``affinity_event_loop_lag_seconds`` already keeps (the
core's own, and each front's in its hop's shared memory): the 99th percentile of the samples
since the last description, as the upper bound of its bucket. Nothing is sampled for it. A
device worker has no event loop: its histogram is empty (no counts), its lag None.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from affinity.registry import NodeProcess, NodeProcesses

__all__ = ["NO_LAG", "Lagging", "ProcessSource", "Processes", "Running", "p99_ms"]


class Lagging(Protocol):
    """A process's loop-lag histogram: one count per bound, then the count past them; no
    counts at all for a process without an event loop (a device worker)."""

    @property
    def counts(self) -> list[int]: ...


class _NoLag:
    @property
    def counts(self) -> list[int]:
        return []


NO_LAG: Lagging = _NoLag()
"""The histogram of a process without an event loop (a device worker, the fork server):
nothing sampled."""


@dataclass(frozen=True)
class Running:
    """One running process as its supervisor knows it."""

    role: str
    pid: int
    since_ms: int
    restarts: int
    lag: Lagging


class ProcessSource(Protocol):
    """What supervises processes beside the core (``node.fronts.Fronts``, the device
    workers' supervisor)."""

    def running(self) -> list[Running]:
        """The processes running now, in their order (one waiting to be restarted is not
        among them)."""

    def helpers(self) -> list[Running]:
        """The helper processes running now (the fronts' fork server); their lag is not
        read."""


def p99_ms(bounds: Sequence[float], before: Sequence[int], now: Sequence[int]) -> float | None:
    """The 99th percentile of the samples counted between ``before`` and ``now`` (each a
    histogram's counts since it began, one per bound then one past them) as its bucket's
    upper bound in ms: None when none was counted (or there are no counts: a process
    without an event loop), ``math.inf`` past the largest bound."""
    window = [max(0, b - a) for a, b in zip(before, now, strict=True)]
    total = sum(window)
    if total == 0:
        return None
    rank = math.ceil(0.99 * total)
    seen = 0
    for bound, count in zip(bounds, window, strict=False):
        seen += count
        if seen >= rank:
            return bound * 1000
    return math.inf


class Processes:
    """The description of this node's processes that its lease publishes: the core (this
    process) and whatever :meth:`watch` was given (the fronts and the device workers, once
    started). ``fronts`` is ``--front-doors``, ``workers`` the device worker processes the
    node runs (0: its devices run in the core's threads)."""

    def __init__(
        self, fronts: int, core_lag: Lagging, bounds: Sequence[float], workers: int = 0
    ) -> None:
        self.fronts = fronts
        self.workers = workers
        self.bounds = tuple(bounds)
        self.core = Running("core", os.getpid(), int(time.time() * 1000), 0, core_lag)
        self._sources: list[ProcessSource] = []
        self._seen: dict[str, list[int]] = {}  # role -> its counts at the last description

    def watch(self, source: ProcessSource) -> None:
        """Describe ``source``'s processes too (the fronts or the device workers, from when
        they start)."""
        self._sources.append(source)

    def describe(self) -> NodeProcesses:
        """Every process running now; each one's lag over the samples since the last call."""
        running = [self.core, *(r for source in self._sources for r in source.running())]
        helpers = tuple(
            NodeProcess(h.role, h.pid, h.since_ms, h.restarts)
            for source in self._sources
            for h in source.helpers()
        )
        rows = []
        for r in running:
            counts = list(r.lag.counts)
            before = self._seen.get(r.role, [0] * len(counts))
            self._seen[r.role] = counts
            lag = p99_ms(self.bounds, before, counts)
            rows.append(NodeProcess(r.role, r.pid, r.since_ms, r.restarts, lag))
        return NodeProcesses(self.fronts, tuple(rows), self.workers, helpers)
