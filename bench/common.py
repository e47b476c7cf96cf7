"""Shared helpers of the benchmarks: options, processes, percentiles, reporting."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.procs import Node, RedisServer, free_port, tmpdir, wait_until  # noqa: E402

__all__ = [
    "Node",
    "RedisServer",
    "Wrk",
    "baseline",
    "cpu_seconds",
    "free_port",
    "median",
    "options",
    "pct",
    "report",
    "tmpdir",
    "wait_until",
    "wrk",
]

RESULTS = ROOT / "bench" / "results"


def options(**defaults: Any) -> argparse.Namespace:
    """A bench's command line: one ``--name`` per keyword (``_`` written ``-``) of its
    default's type; a ``False`` default makes a flag; ``(default, "help")`` adds a help."""
    p = argparse.ArgumentParser()
    for name, given in defaults.items():
        default, help = given if isinstance(given, tuple) else (given, None)
        flag = "--" + name.replace("_", "-")
        if default is False:
            p.add_argument(flag, action="store_true", help=help)
        else:
            p.add_argument(flag, type=type(default), default=default, help=help)
    return p.parse_args()


def baseline(module: str) -> tuple[subprocess.Popen[bytes], int]:
    """``python -m module PORT`` started from the checkout on a free port: the process and
    its port (the caller waits for it and kills it)."""
    port = free_port()
    return subprocess.Popen([sys.executable, "-m", module, str(port)], cwd=ROOT), port


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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


_WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass(frozen=True)
class Wrk:
    """What one wrk run measured; latencies in seconds, cpu_per_request in seconds."""

    requests: int
    seconds: float
    rps: float
    p50: float
    p99: float
    errors: int
    cpu_per_request: float


def wrk(
    url: str,
    request_lua: str,
    *,
    duration_s: float,
    connections: int,
    threads: int = 1,
    server_pids: Sequence[int] = (),
    allow_errors: bool = False,
) -> Wrk:
    """Drive ``url`` with wrk (C, not the bottleneck) for ``duration_s``; ``request_lua``
    defines wrk's ``request`` function. Server CPU per request is the CPU the processes
    ``server_pids`` used during the run divided by the requests served. Fails on any
    non-2xx answer or socket error, unless ``allow_errors`` (then counted in ``errors``)."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is missing: apt-get install wrk (bash .ci/run installs it)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(request_lua + _WRK_DONE)
        script = f.name
    try:
        before = sum(cpu_seconds(p) for p in server_pids)
        seconds = f"{max(1, round(duration_s))}s"  # wrk takes whole seconds
        argv = ["wrk", "-t", str(threads), "-c", str(connections), "-d", seconds]
        out = subprocess.run(
            [*argv, "--timeout", "10s", "-s", script, url],
            capture_output=True,
            text=True,
            check=True,
            timeout=duration_s + 60,
        ).stdout
        cpu = sum(cpu_seconds(p) for p in server_pids) - before
    finally:
        os.unlink(script)
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    n, us, status_errors, socket_errors, p50_us, p99_us = (int(x) for x in line.split()[1:])
    if (status_errors or socket_errors) and not allow_errors:
        raise RuntimeError(
            f"wrk against {url}: {status_errors} non-2xx, {socket_errors} socket errors"
        )
    errors = status_errors + socket_errors
    return Wrk(n, us / 1e6, n / (us / 1e6), p50_us / 1e6, p99_us / 1e6, errors, cpu / max(n, 1))
