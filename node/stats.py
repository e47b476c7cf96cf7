"""Model statistics in Triton's shape (``GET /v2/models/{m}/stats``, gRPC ``ModelStatistics``),
read from the node's own Prometheus series, so they count exactly what ``/metrics`` counts.

What each field holds, for the one model a node serves:

- ``inference_count``: steps its devices ran through the model (the sum of
  ``affinity_batch_size``: one per row of a model run, padding not counted);
  ``execution_count``: model runs (the count of ``affinity_batch_size``).
- ``inference_stats.success``: steps this node routed and answered (any front door, served
  here or forwarded), with their total latency (``affinity_act_seconds``).
- ``inference_stats.fail``: steps this node refused with a 503 or a model failure
  (``affinity_routing_total`` ``full``, ``no_nodes``, ``unavailable``, ``failed``); their
  duration is not measured, so ``ns`` is 0.
- ``inference_stats.queue``: steps that waited on a device for their model run, and the
  total wait (``affinity_queue_wait_seconds``).
- ``compute_input``, ``compute_infer``, ``compute_output``, ``cache_hit``, ``cache_miss``:
  not measured apart (the model run is one ONNX Runtime call; there is no response cache),
  so always zero; ``last_inference`` is 0 and ``batch_stats`` empty for the same reason.

The counters are the node process's: they start at zero when it starts, like Triton's.
"""

from __future__ import annotations

from typing import Any

from node.metrics import Metrics

__all__ = ["model_statistics"]

_FAILED = ("full", "no_nodes", "unavailable", "failed")
_UNMEASURED = ("compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


def _sum(metrics: Metrics, name: str, labels: list[dict[str, str]]) -> float:
    get = metrics.registry.get_sample_value
    return sum(get(name, one) or 0.0 for one in labels)


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": int(count), "ns": int(seconds * 1e9)}


def model_statistics(
    metrics: Metrics, devices: list[str], name: str, version: str
) -> dict[str, Any]:
    """One model's entry of Triton's ``model_stats`` list (see the module doc)."""
    on_devices = [{"device": d} for d in devices]
    paths = [{"path": "local"}, {"path": "forwarded"}]
    inference_stats: dict[str, dict[str, int]] = {
        "success": _duration(
            _sum(metrics, "affinity_act_seconds_count", paths),
            _sum(metrics, "affinity_act_seconds_sum", paths),
        ),
        "fail": _duration(
            _sum(metrics, "affinity_routing_total", [{"result": r} for r in _FAILED]), 0.0
        ),
        "queue": _duration(
            _sum(metrics, "affinity_queue_wait_seconds_count", on_devices),
            _sum(metrics, "affinity_queue_wait_seconds_sum", on_devices),
        ),
    }
    inference_stats.update({key: _duration(0, 0.0) for key in _UNMEASURED})
    return {
        "name": name,
        "version": version,
        "last_inference": 0,
        "inference_count": int(_sum(metrics, "affinity_batch_size_sum", on_devices)),
        "execution_count": int(_sum(metrics, "affinity_batch_size_count", on_devices)),
        "inference_stats": inference_stats,
        "batch_stats": [],
    }
