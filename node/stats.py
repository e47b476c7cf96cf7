"""Model statistics in Triton's shape (``GET /v2/models/{m}/stats``, gRPC ``ModelStatistics``),
one entry per model this node serves, counted apart for each model.

What each field holds, for one model on this node. Its counters start at zero when the
process starts, like Triton's.

- ``inference_count``: steps this node's devices ran through the model (one per row of a
  model run, padding not counted). ``execution_count``: its model runs. ``last_inference``:
  when the last run ended (ms since the epoch; 0 before the first).
- ``inference_stats.queue``: the model's steps that waited on a device for their run, and
  the total wait.
- ``inference_stats.success``: KServe infer requests (HTTP and gRPC) for the model that this
  node answered, with their total latency. They were served here or forwarded to the owner.
  ``fail``: those it answered with a 503 or a model failure (``ns`` 0: not measured).
  Steps through ``/act`` and openpi count in ``inference_count`` and in ``/metrics``.
- ``compute_input``, ``compute_infer``, ``compute_output``, ``cache_hit``, ``cache_miss``:
  not measured apart, so always zero. The model run is one ONNX Runtime call, and there is
  no response cache. ``batch_stats`` is empty for the same reason.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["ModelStats", "model_statistics"]

_UNMEASURED = ("compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


class ModelStats:
    """Triton's counters of one model on this node. :meth:`ran` and :meth:`queued` are the
    dispatcher's hooks (called on device worker threads); :meth:`answered` and
    :meth:`failed` are called by the KServe front doors on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rows = 0
        self.runs = 0
        self.last_ms = 0
        self.queue_count = 0
        self.queue_ns = 0
        self.success_count = 0
        self.success_ns = 0
        self.fail_count = 0

    def ran(self, device: str, rows: float) -> None:
        """One model run of ``rows`` steps on ``device``."""
        with self._lock:
            self.rows += int(rows)
            self.runs += 1
            self.last_ms = time.time_ns() // 1_000_000

    def queued(self, device: str, seconds: float) -> None:
        """One step waited ``seconds`` on ``device`` for its run."""
        with self._lock:
            self.queue_count += 1
            self.queue_ns += int(seconds * 1e9)

    def answered(self, seconds: float) -> None:
        """One infer request answered, ``seconds`` after it arrived."""
        self.success_count += 1  # event loop only
        self.success_ns += int(seconds * 1e9)

    def failed(self) -> None:
        """One infer request answered with a 503 or a model failure."""
        self.fail_count += 1


def model_statistics(stats: ModelStats | None, name: str, version: str) -> dict[str, Any]:
    """One model's entry of Triton's ``model_stats`` list (see the module doc); zeros for a
    model with no counters here (served by other nodes)."""
    s = stats or ModelStats()
    inference_stats: dict[str, dict[str, int]] = {
        "success": {"count": s.success_count, "ns": s.success_ns},
        "fail": {"count": s.fail_count, "ns": 0},
        "queue": {"count": s.queue_count, "ns": s.queue_ns},
    }
    inference_stats.update({key: {"count": 0, "ns": 0} for key in _UNMEASURED})
    return {
        "name": name,
        "version": version,
        "last_inference": s.last_ms,
        "inference_count": s.rows,
        "execution_count": s.runs,
        "inference_stats": inference_stats,
        "batch_stats": [],
    }
