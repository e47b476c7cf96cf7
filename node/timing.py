"""A served step's time at the node it came in by, its parts, and its control period.

The node a step comes in by (``Router.act``, behind every front door) counts each served
step once: its outcome (``affinity_routing_total``), its time from the request to the
reply on its path (``affinity_act_seconds``: ``local`` or ``forwarded``) and at its door
(``affinity_step_seconds``), and the parts of it that the owner and the forward measured
(``affinity_step_part_seconds``: ``queue``, ``run``, ``forward``). The step may have a
control period: its ``control_hz``, else the node's ``--control-hz``. Then it counts a
deadline miss when that time exceeded the period (``affinity_deadline_miss_total``). The
owner of a forwarded step counts nothing of it: its router does. The reply's ``timing``
gets ``total_ms``. A front door sends it back with the rest of the split when the client
asks for it (``Reply.split``).

A step only notes its figures (one tuple); they are counted every :data:`COUNT_EVERY`
steps, and before every read of the node's registry (a scrape), which so sees every step
served before it. Counting each step as it is served cost ~2 µs of a sticky ``/act``
step by the clock, far more than its instructions: its histograms and counters are cold
by the time the next step comes; counted together, they stay warm.
"""

from __future__ import annotations

import threading
from typing import Any

from node.metrics import ROUTING, Metrics
from node.step import Reply, Step

__all__ = ["COUNT_EVERY", "TIMING_HEADER", "StepTimes", "asks_timing"]

COUNT_EVERY = 256
"""Served steps noted before they are counted (a scrape counts them at once)."""

TIMING_HEADER = b"x-affinity-timing"
"""The HTTP request header that asks for the split of the step's time in the reply."""


def asks_timing(value: str | None) -> bool:
    """Whether an ``X-Affinity-Timing`` header asks for the split: ``1`` or ``true``."""
    return value is not None and value.strip().lower() in ("1", "true")


class _Series:
    """The labelled children of one (model, door) (``labels()`` takes a lock each call)."""

    __slots__ = ("forward", "miss", "period", "queue", "run", "step")

    def __init__(self, metrics: Metrics, model: str, door: str) -> None:
        self.step = metrics.step_seconds.labels(model, door)
        self.queue = metrics.step_parts.labels(model, "queue")
        self.run = metrics.step_parts.labels(model, "run")
        self.forward = metrics.step_parts.labels(model, "forward")
        self.miss: Any = metrics.deadline_misses.labels(model, door)
        self.period: Any = metrics.control_period.labels(model)


class StepTimes:
    """Counts served steps at the node they came in by (see the module doc). ``node_id``:
    this node (a reply from another is ``forwarded``). ``control_hz``: the node's
    ``--control-hz`` (None: only steps that name a rate have a period)."""

    def __init__(self, metrics: Metrics, node_id: str, control_hz: float | None) -> None:
        self.metrics = metrics
        self.node_id = node_id
        self.control_hz = control_hz
        self._routing = {r: metrics.routing.labels(r) for r in ROUTING}
        self._paths = {p: metrics.act_seconds.labels(p) for p in ("local", "forwarded")}
        self._series: dict[tuple[str, str], _Series] = {}
        self._periods: dict[str, float] = {}  # model -> the period its gauge shows
        self._noted: list[tuple[Any, ...]] = []
        self._counting = threading.Lock()  # a scrape's thread may count too
        metrics.before_read(self.count)

    def served(self, step: Step, reply: Reply, path_seconds: float, seconds: float) -> None:
        """Note ``step``, served as ``reply`` in ``seconds`` from its request
        (``path_seconds`` from the router's start), and put ``total_ms`` in the reply's
        timing. ``reply.model`` (the ``name@version`` that served it, as registered) and
        ``step.door`` are the labels: both bounded."""
        timing = reply.timing
        timing["total_ms"] = seconds * 1000
        noted = self._noted
        noted.append((reply.routing, reply.node, reply.model, step.door, step.control_hz,
                      path_seconds, seconds, timing.get("queue_ms"), timing.get("run_ms"),
                      timing.get("forward_ms")))  # fmt: skip
        if len(noted) >= COUNT_EVERY:
            self.count()

    def count(self) -> None:
        """Count the steps noted so far (see the module doc)."""
        with self._counting:
            noted = self._noted
            steps = noted[: len(noted)]
            del noted[: len(steps)]  # (steps noted meanwhile stay, at its end)
            routed: dict[str, int] = {}
            for routing, node, model, door, hz, path_seconds, seconds, queue, run, fwd in steps:
                routed[routing] = routed.get(routing, 0) + 1
                self._paths["local" if node == self.node_id else "forwarded"].observe(path_seconds)
                key = (model, door)
                series = self._series.get(key)
                if series is None:
                    series = self._series[key] = _Series(self.metrics, model, door)
                series.step.observe(seconds)
                if run is not None:
                    series.queue.observe((queue or 0.0) / 1000)
                    series.run.observe(run / 1000)
                if fwd is not None:
                    series.forward.observe(fwd / 1000)
                hz = hz or self.control_hz
                if hz:
                    period = 1.0 / hz
                    if self._periods.get(model) != period:  # (a gauge's set takes a lock)
                        series.period.set(period)
                        self._periods[model] = period
                    if seconds > period:
                        series.miss.inc()
            for routing, n in routed.items():
                (self._routing.get(routing) or self.metrics.routing.labels(routing)).inc(n)
