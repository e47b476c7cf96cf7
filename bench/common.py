"""Shared helpers of the benchmarks: processes, percentiles, reporting."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.procs import Node, RedisServer, free_port, tmpdir, wait_until  # noqa: E402

__all__ = [
    "Node",
    "RedisServer",
    "free_port",
    "median",
    "pct",
    "report",
    "tmpdir",
    "wait_until",
]

RESULTS = ROOT / "bench" / "results"


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def report(name: str, figures: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
    """Print one line per figure and write bench/results/<name>.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    for f in figures:
        verdict = "meets" if f["ok"] else "MISSES"
        print(f"{f['figure']}: {f['result']}  (goal {f['goal']}: {verdict})")
    payload = {
        "bench": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "figures": figures,
        **(extra or {}),
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
