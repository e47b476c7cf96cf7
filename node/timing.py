"""A served step's time at the node it came in by, its parts, and its control period.

The node a step comes in by (``Router.act``, behind every front door) counts each served
step once. It counts its time from the request to the reply (``affinity_step_seconds``).
It counts the parts of it that the owner and the forward measured
(``affinity_step_part_seconds``: ``queue``, ``run``, ``forward``). The step may have a
control period: its ``control_hz``, else the node's ``--control-hz``. Then it counts a
deadline miss when that time exceeded the period (``affinity_deadline_miss_total``). The
owner of a forwarded step counts nothing of it: its router does. The reply's ``timing``
gets ``total_ms``. A front door sends it back with the rest of the split when the client
asks for it (``Reply.split``).
"""

from __future__ import annotations

from typing import Any

from node.metrics import Metrics
from node.step import Reply, Step

__all__ = ["TIMING_HEADER", "StepTimes", "asks_timing"]

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
    """Counts served steps at the node they came in by (see the module doc).
    ``control_hz``: the node's ``--control-hz`` (None: only steps that name a rate have a
    period)."""

    def __init__(self, metrics: Metrics, control_hz: float | None) -> None:
        self.metrics = metrics
        self.control_hz = control_hz
        self._series: dict[tuple[str, str], _Series] = {}
        self._periods: dict[str, float] = {}  # model -> the period its gauge shows

    def served(self, step: Step, reply: Reply, seconds: float) -> None:
        """Count ``step``, served as ``reply`` in ``seconds`` from its request, and put
        ``total_ms`` in the reply's timing. ``reply.model`` (the ``name@version`` that
        served it, as registered) and ``step.door`` are the labels: both bounded."""
        key = (reply.model, step.door)
        series = self._series.get(key)
        if series is None:
            series = self._series.setdefault(key, _Series(self.metrics, *key))
        series.step.observe(seconds)
        timing = reply.timing
        timing["total_ms"] = seconds * 1000
        run = timing.get("run_ms")
        if run is not None:
            series.queue.observe(timing.get("queue_ms", 0.0) / 1000)
            series.run.observe(run / 1000)
        forward = timing.get("forward_ms")
        if forward is not None:
            series.forward.observe(forward / 1000)
        hz = step.control_hz or self.control_hz
        if hz:
            period = 1.0 / hz
            if self._periods.get(key[0]) != period:  # (a gauge's set takes a lock)
                series.period.set(period)
                self._periods[key[0]] = period
            if seconds > period:
                series.miss.inc()
