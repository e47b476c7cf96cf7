"""The openpi websocket front door with the unmodified ``openpi-client``, camera-sized policy
(``--model vla-demo``), real processes on loopback, one robot in lockstep.

1. step p50 direct to the owner node / a minimal single-process openpi-style server
   (``bench/openpi_baseline.py``: same ONNX session, same observations, no fleet);
2. step p50 through a node that forwards to the owner - direct to the owner.

The client and its encoding are the same in every case (LIBERO-shaped observations: two
224x224x3 cameras, an 8-dim state, a prompt). Within a round the three connections take
turns step by step; each figure is the median over ``--runs`` rounds.

Usage: python -m bench.openpi [--runs 5] [--steps 100]
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from bench.common import (
    Node,
    RedisServer,
    baseline,
    median,
    options,
    pct,
    report,
    tmpdir,
    wait_until,
)
from tests.test_openpi import libero


def main() -> None:
    a = options(runs=5, steps=100)
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    base, port = baseline("bench.openpi_baseline")
    extra = ["--model", "vla-demo", "--max-batch", "1", "--lease-ttl", "30", "--capacity", "100"]
    env = {"AFFINITY_CLUSTER_SECRET": "bench", "AFFINITY_ACCESS_LOG": "off"}
    owner = Node(tmp, "oa", redis.url, devices="cpu:1", extra=extra, env=env)
    router = Node(tmp, "ob", redis.url, devices="cpu:1", extra=extra, env=env)
    rounds: list[dict[str, float]] = []
    try:
        owner.start()
        router.start()
        wait_until(lambda: _open(port), 60, "baseline server")
        # an episode the owner holds (claimed through the owner, then stepped via either)
        episode = next(
            f"ws-{i}"
            for i in range(200)
            if httpx.post(
                owner.url + "/act", json={"episode_id": f"ws-{i}", "inputs": _inputs()}, timeout=30
            ).json()["node"]
            == "oa"
        )
        clients = {
            "baseline": WebsocketClientPolicy(f"ws://127.0.0.1:{port}"),
            "direct": WebsocketClientPolicy(
                f"ws://{owner.host}:{owner.port}/?episode_id={episode}"
            ),
            "forwarded": WebsocketClientPolicy(
                f"ws://{router.host}:{router.port}/?episode_id={episode}"
            ),
        }
        obs = libero(0, a.steps)
        for c in clients.values():  # warm: sessions, connections, the forward pool
            for o in obs[:10]:
                c.infer(o)
        for _ in range(a.runs):
            lat: dict[str, list[float]] = {k: [] for k in clients}
            for o in obs:
                for kind, c in clients.items():
                    t0 = time.perf_counter()
                    reply = c.infer(o)
                    lat[kind].append(time.perf_counter() - t0)
                    assert reply["actions"].shape == (10, 7)
            rounds.append({k: pct(v, 50) for k, v in lat.items()})
        for c in clients.values():
            c._ws.close()
    finally:
        base.kill()
        owner.stop()
        router.stop()
        redis.stop()
    ratio = median([r["direct"] / r["baseline"] for r in rounds])
    added = median([(r["forwarded"] - r["direct"]) * 1000 for r in rounds])

    def ms(key: str) -> float:
        return median([r[key] for r in rounds]) * 1000

    figures = [
        {
            "figure": "websocket step p50, direct to the owner node / minimal openpi-style server "
            "(vla-demo, openpi-client)",
            "value": ratio,
            "result": f"{ratio:.2f}x ({ms('direct'):.2f} ms vs {ms('baseline'):.2f} ms)",
            "goal": "<= 1.1x",
            "ok": ratio <= 1.1,
        },
        {
            "figure": "websocket step p50, forwarded - direct",
            "value": added,
            "result": f"+{added:.2f} ms ({ms('forwarded'):.2f} ms vs {ms('direct'):.2f} ms)",
            "goal": "<= 1 ms",
            "ok": added <= 1.0,
        },
    ]
    report("openpi", figures, {"rounds": rounds})


def _inputs() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    return {
        "image": rng.integers(0, 256, (1, 224, 224, 3)).tolist(),
        "wrist_image": rng.integers(0, 256, (1, 224, 224, 3)).tolist(),
        "state": [[0.0] * 8],
    }


def _open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


if __name__ == "__main__":
    main()
