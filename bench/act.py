"""/act figures with real processes on loopback (a real redis-server, real nodes).

4. throughput and p50 latency of one node with one CPU device and the demo policy vs the
   minimal FastAPI app of bench/baseline_app.py running the same ONNX session
5. a forwarded /act (sent to a node that does not own the episode) vs a direct one, p50

Usage: python -m bench.act [--runs 3] [--requests 2000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time

import httpx

from bench.common import ROOT, Node, RedisServer, free_port, median, pct, report, tmpdir, wait_until

OBS = {"obs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]]}


async def load(url: str, n: int, concurrency: int, episodes: int) -> tuple[float, list[float]]:
    """Send n /act requests over `concurrency` clients; return (req/s, latencies)."""
    lat: list[float] = []
    per = n // concurrency
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as c:

        async def worker(w: int) -> None:
            for i in range(per):
                body = {"episode_id": f"ep-{(w * per + i) % episodes}", "inputs": OBS}
                t0 = time.perf_counter()
                r = await c.post(url + "/act", json=body)
                lat.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text

        await c.post(url + "/act", json={"episode_id": "warm", "inputs": OBS})
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return per * concurrency / (time.perf_counter() - t0), lat


async def sequential(client: httpx.AsyncClient, url: str, episode: str, n: int) -> list[float]:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await client.post(url + "/act", json={"episode_id": episode, "inputs": OBS})
        lat.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    return lat


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    a = p.parse_args()
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    port = free_port()
    base = subprocess.Popen([sys.executable, "-m", "bench.baseline_app", str(port)], cwd=ROOT)
    base_url = f"http://127.0.0.1:{port}"
    extra = ["--capacity", "1000", "--lease-ttl", "30"]
    one = Node(tmp, "one", redis.url, devices="cpu:1", extra=extra)
    a_node = Node(tmp, "fa", redis.url, devices="cpu:1", extra=extra)
    b_node = Node(tmp, "fb", redis.url, devices="cpu:1", extra=extra)
    try:
        wait_until(lambda: httpx.get(base_url + "/readyz").status_code == 200, 60, "baseline")
        one.start()
        tp_node, tp_base, p50_node, p50_base = [], [], [], []
        for _ in range(a.runs):
            t, lat = asyncio.run(load(base_url, a.requests, a.concurrency, 64))
            tp_base.append(t)
            p50_base.append(pct(lat, 50))
            t, lat = asyncio.run(load(one.url, a.requests, a.concurrency, 64))
            tp_node.append(t)
            p50_node.append(pct(lat, 50))
        one.stop(signal.SIGTERM)  # deregisters: its device takes no more claims
        base.kill()
        # forwarding: two nodes, one device each; episodes owned by fa
        a_node.start()
        b_node.start()

        async def forwarding() -> tuple[list[float], list[float]]:
            async with httpx.AsyncClient(timeout=30) as c:
                owned = []
                for i in range(40):
                    r = (
                        await c.post(
                            a_node.url + "/act", json={"episode_id": f"fw-{i}", "inputs": OBS}
                        )
                    ).json()
                    if r["node"] == "fa":
                        owned.append(r["episode_id"])
                direct, forwarded = [], []
                for _ in range(a.runs):
                    d, f = [], []
                    for ep in owned:
                        d += await sequential(c, a_node.url, ep, 10)
                        f += await sequential(c, b_node.url, ep, 10)
                    direct.append(pct(d, 50))
                    forwarded.append(pct(f, 50))
                return direct, forwarded

        direct, forwarded = asyncio.run(forwarding())
    finally:
        base.kill()
        for n in (one, a_node, b_node):
            n.stop()
        redis.stop()
    ratio_tp = median(tp_node) / median(tp_base)
    ratio_p50 = median(p50_node) / median(p50_base)
    added_ms = (median(forwarded) - median(direct)) * 1000
    figures = [
        {
            "figure": "/act throughput, 1 node 1 device / minimal FastAPI + same ONNX session",
            "value": ratio_tp,
            "result": f"{ratio_tp:.0%} ({median(tp_node):.0f} vs {median(tp_base):.0f} req/s, "
            f"{a.concurrency} clients)",
            "goal": ">= 90%",
            "ok": ratio_tp >= 0.9,
        },
        {
            "figure": "/act p50 latency / minimal app p50",
            "value": ratio_p50,
            "result": f"{ratio_p50:.2f}x ({median(p50_node) * 1e3:.2f} ms vs "
            f"{median(p50_base) * 1e3:.2f} ms)",
            "goal": "<= 1.1x",
            "ok": ratio_p50 <= 1.1,
        },
        {
            "figure": "forwarded /act p50 - direct p50",
            "value": added_ms,
            "result": f"+{added_ms:.2f} ms ({median(forwarded) * 1e3:.2f} ms vs "
            f"{median(direct) * 1e3:.2f} ms)",
            "goal": "<= 1 ms",
            "ok": added_ms <= 1.0,
        },
    ]
    report("act", figures)


if __name__ == "__main__":
    main()
