"""Failover: from SIGKILL of an owner to the first served reassigned /act, as a ratio to
the bound lease TTL + one renewal period (real redis-server, two real nodes).

Usage: python -m bench.failover [--runs 3] [--lease 2]
"""

from __future__ import annotations

import signal
import time

import httpx

from bench.common import Node, RedisServer, median, options, report, tmpdir

OBS = {"obs": [[0.0] * 8]}


def one_run(lease: float) -> float:
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    extra = ["--lease-ttl", str(lease)]
    a = Node(tmp, "fa", redis.url, devices="cpu:1", extra=extra)
    b = Node(tmp, "fb", redis.url, devices="cpu:1", extra=extra)
    try:
        a.start()
        b.start()
        with httpx.Client(timeout=5) as c:
            owned = None
            for i in range(10):
                r = c.post(a.url + "/act", json={"episode_id": f"e{i}", "inputs": OBS}).json()
                if r["node"] == "fb":
                    owned = r["episode_id"]
                    break
            assert owned is not None
            b.stop(signal.SIGKILL)
            killed = time.monotonic()
            deadline = killed + lease * 5
            while time.monotonic() < deadline:
                r = c.post(a.url + "/act", json={"episode_id": owned, "inputs": OBS})
                if r.status_code == 200:
                    assert r.json()["routing"] == "reassigned", r.text
                    return time.monotonic() - killed
                time.sleep(0.01)
            raise AssertionError("no reassignment within 5 leases")
    finally:
        a.stop()
        b.stop()
        redis.stop()


def main() -> None:
    a = options(runs=3, lease=2.0)
    times = [one_run(a.lease) for _ in range(a.runs)]
    bound = a.lease + a.lease / 3
    ratio = median(times) / bound
    report(
        "failover",
        [
            {
                "figure": "SIGKILL of owner -> first reassigned /act, / (lease + renewal)",
                "value": ratio,
                "result": f"{ratio:.2f}x ({median(times):.2f} s; lease {a.lease:g} s, "
                f"renewal {a.lease / 3:.2f} s)",
                "goal": "<= 1.0x",
                "ok": ratio <= 1.0,
            }
        ],
        {"runs_s": times},
    )


if __name__ == "__main__":
    main()
