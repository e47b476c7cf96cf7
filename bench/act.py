"""/act figures with real processes on loopback, driven by wrk (a C load generator).

1. throughput, p50 and server CPU per request of one node (one CPU device, the demo policy,
   64 sticky episodes: each a hit, served from the owner's records with no Redis command on
   its way) vs the minimal FastAPI app of
   ``bench/baseline_app.py`` running the same ONNX session on the same server stack
   (uvicorn with uvloop and httptools), both saturated by the same wrk settings;
2. p50 of one client in lockstep (one connection) against each: the latency a robot sees;
3. a forwarded /act (sent to a node that does not own the episode) vs a direct one, p50 of
   one connection in lockstep each.

Rounds alternate node and baseline; each figure is the median over ``--runs`` rounds of a
ratio measured in the same run. Server CPU per request is read from /proc.

Usage: python -m bench.act [--runs 5] [--seconds 4] [--connections 16]
(``BENCH_NODE_ARGS="--access-log off"`` passes extra flags to the measured nodes)
"""

from __future__ import annotations

import os
import signal

import httpx

from bench.common import (
    Node,
    RedisServer,
    baseline,
    median,
    options,
    report,
    tmpdir,
    wait_until,
    wrk,
)

EXTRA = os.environ.get("BENCH_NODE_ARGS", "").split()
OBS = "[[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8]]"


def episodes_lua(count: int, accept: str = "application/json", prefix: str = "ep") -> str:
    """wrk's request(): JSON /act bodies cycling over ``count`` episode ids, the replies
    asked for as ``accept``."""
    return f"""
local i = 0
request = function()
  i = i + 1
  local body = '{{"episode_id":"{prefix}-' .. (i % {count}) .. '","inputs":{{"obs":{OBS}}}}}'
  return wrk.format("POST", "/act", {{["Content-Type"] = "application/json",
    ["Accept"] = "{accept}"}}, body)
end
"""


def one_episode_lua(episode: str) -> str:
    body = f'{{"episode_id":"{episode}","inputs":{{"obs":{OBS}}}}}'
    return f"""
request = function()
  return wrk.format("POST", "/act", {{["Content-Type"] = "application/json"}}, '{body}')
end
"""


def main() -> None:
    a = options(runs=5, seconds=4.0, connections=16)
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    base, port = baseline("bench.baseline_app")
    base_url = f"http://127.0.0.1:{port}"
    extra = ["--capacity", "1000", "--lease-ttl", "30", *EXTRA]
    one = Node(tmp, "one", redis.url, devices="cpu:1", extra=extra)
    owner = Node(tmp, "fa", redis.url, devices="cpu:1", extra=extra)
    router = Node(tmp, "fb", redis.url, devices="cpu:1", extra=extra)
    rounds: list[dict[str, float]] = []
    try:
        wait_until(lambda: httpx.get(base_url + "/readyz").status_code == 200, 60, "baseline")
        one.start()
        assert one.proc.popen is not None
        node_pid = one.proc.popen.pid
        load = episodes_lua(64)
        for url in (base_url, one.url):  # warm both (sessions, connections, claims)
            wrk(url, load, duration_s=1, connections=a.connections)
        for _ in range(a.runs):
            b = wrk(base_url, load, duration_s=a.seconds, connections=a.connections,
                    server_pids=[base.pid])  # fmt: skip
            n = wrk(one.url, load, duration_s=a.seconds, connections=a.connections,
                    server_pids=[node_pid])  # fmt: skip
            b1 = wrk(base_url, load, duration_s=a.seconds / 2, connections=1)
            n1 = wrk(one.url, load, duration_s=a.seconds / 2, connections=1)
            rounds.append(
                {
                    "rps_node": n.rps,
                    "rps_base": b.rps,
                    "p50_node": n.p50,
                    "p50_base": b.p50,
                    "cpu_node_us": n.cpu_per_request * 1e6,
                    "cpu_base_us": b.cpu_per_request * 1e6,
                    "p50_1_node": n1.p50,
                    "p50_1_base": b1.p50,
                }
            )
        one.stop(signal.SIGTERM)  # hands its episodes over and deregisters
        base.kill()
        owner.start()
        router.start()
        episode = next(
            f"fw-{i}"
            for i in range(200)
            if httpx.post(
                owner.url + "/act", json={"episode_id": f"fw-{i}", "inputs": {"obs": [[0.1] * 8]}}
            ).json()["node"]
            == "fa"
        )
        script = one_episode_lua(episode)
        wrk(router.url, script, duration_s=1, connections=1)  # warm the forward pool
        for r in rounds:
            r["p50_direct"] = wrk(owner.url, script, duration_s=a.seconds / 2, connections=1).p50
            r["p50_forwarded"] = wrk(
                router.url, script, duration_s=a.seconds / 2, connections=1
            ).p50
    finally:
        base.kill()
        for node in (one, owner, router):
            node.stop()
        redis.stop()

    def med(key: str) -> float:
        return median([r[key] for r in rounds])

    tp = median([r["rps_node"] / r["rps_base"] for r in rounds])
    p50 = median([r["p50_node"] / r["p50_base"] for r in rounds])
    p50_1 = median([r["p50_1_node"] / r["p50_1_base"] for r in rounds])
    cpu = median([r["cpu_node_us"] / r["cpu_base_us"] for r in rounds])
    added = median([(r["p50_forwarded"] - r["p50_direct"]) * 1000 for r in rounds])
    figures = [
        {
            "figure": f"/act throughput, wrk -c{a.connections}, node / minimal app (same ONNX "
            "session, same server stack)",
            "value": tp,
            "result": f"{tp:.0%} ({med('rps_node'):.0f} vs {med('rps_base'):.0f} req/s)",
            "goal": ">= 90%",
            "ok": tp >= 0.9,
        },
        {
            "figure": "/act p50 under that load, node / minimal app",
            "value": p50,
            "result": f"{p50:.2f}x ({med('p50_node') * 1e3:.2f} ms vs "
            f"{med('p50_base') * 1e3:.2f} ms)",
            "goal": "<= 1.1x",
            "ok": p50 <= 1.1,
        },
        {
            "figure": "server CPU per /act, node / minimal app",
            "value": cpu,
            "result": f"{cpu:.2f}x ({med('cpu_node_us'):.0f} µs vs {med('cpu_base_us'):.0f} µs)",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "/act p50 of one client in lockstep, node / minimal app",
            "value": p50_1,
            "result": f"{p50_1:.2f}x ({med('p50_1_node') * 1e3:.2f} ms vs "
            f"{med('p50_1_base') * 1e3:.2f} ms)",
            "goal": "<= 1.2x (issue 22)",
            "ok": p50_1 <= 1.2,
        },
        {
            "figure": "forwarded /act p50 - direct p50 (one client in lockstep)",
            "value": added,
            "result": f"+{added:.2f} ms ({med('p50_forwarded') * 1e3:.2f} ms vs "
            f"{med('p50_direct') * 1e3:.2f} ms)",
            "goal": "<= 1 ms",
            "ok": added <= 1.0,
        },
    ]
    report("act", figures, {"rounds": rounds})


if __name__ == "__main__":
    main()
