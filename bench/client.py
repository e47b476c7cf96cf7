"""``affinity.Client`` against ``openpi-client`` for a camera step, to the same node.

One ``affinity-node`` on loopback with the camera-sized policy (``--model vla-demo``: two
uint8 [224, 224, 3] cameras and an 8-dim state, a [10, 7] action chunk out), three robots in
lockstep, each its own episode, taking turns step by step over the same observations:

1. ``openpi-client`` over the websocket (the baseline);
2. ``affinity.Client`` with its default encoding (msgpack with numpy arrays, ``POST /act``);
3. ``affinity.Client(encoding="json")`` (nested lists), fewer steps: it is slow.

Figures: the p50 of 2 / the p50 of 1 (goal <= 1.2x), and of 3 / 1 (reported); each the
median over ``--runs`` rounds measured in the same run. Reported with them, 2 / 1: the
client's CPU per step (``time.process_time``, every thread of this process: the websocket
client reads in a thread of its own) and the node's (its ``/proc`` CPU across each step,
summed per client: which side a difference comes from).

Usage: python -m bench.client [--runs 5] [--steps 100] [--json-steps 10]
"""

from __future__ import annotations

import time

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from affinity import Client
from bench.common import Node, RedisServer, cpu_seconds, median, options, pct, report, tmpdir
from node.contract import load_contract
from node.inputs import from_observation
from node.models import resolve_model
from tests.test_openpi import libero


def main() -> None:
    a = options(runs=5, steps=100, json_steps=10)
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    extra = ["--model", "vla-demo", "--max-batch", "1", "--lease-ttl", "30", "--capacity", "100"]
    node = Node(
        tmp, "cl", redis.url, devices="cpu:1", extra=extra, env={"AFFINITY_ACCESS_LOG": "off"}
    )
    contract = load_contract(resolve_model("vla-demo"))
    obs = libero(0, a.steps)
    inputs = [from_observation(contract, o).inputs for o in obs]
    rounds: list[dict[str, float]] = []
    cpu = {"client": {"openpi": 0.0, "msgpack": 0.0}, "node": {"openpi": 0.0, "msgpack": 0.0}}
    counted = {"openpi": 0, "msgpack": 0}
    try:
        node.start()
        assert node.proc.popen is not None
        pid = node.proc.popen.pid
        openpi = WebsocketClientPolicy(f"ws://{node.host}:{node.port}/?episode_id=bench-openpi")
        binary = Client(node.url, timeout=30)
        as_json = Client(node.url, timeout=30, encoding="json")
        robots = {
            "openpi": lambda t: openpi.infer(obs[t])["actions"],
            "msgpack": lambda t: binary.act("bench-msgpack", inputs[t]).outputs["actions"][0],
            "json": lambda t: as_json.act("bench-json", inputs[t]).outputs["actions"][0],
        }
        for step in robots.values():  # warm: the session, the connections
            for t in range(5):
                step(t)
        for _ in range(a.runs):
            lat: dict[str, list[float]] = {k: [] for k in robots}
            for t in range(a.steps):
                for kind, step in robots.items():
                    if kind == "json" and t >= a.json_steps:
                        continue
                    n0, c0 = cpu_seconds(pid), time.process_time()
                    t0 = time.perf_counter()
                    actions = step(t)
                    lat[kind].append(time.perf_counter() - t0)
                    if kind in counted:
                        cpu["client"][kind] += time.process_time() - c0
                        cpu["node"][kind] += cpu_seconds(pid) - n0
                        counted[kind] += 1
                    assert np.asarray(actions).shape == (10, 7), kind
            rounds.append({k: pct(v, 50) for k, v in lat.items()})
        openpi._ws.close()
        binary.close()
        as_json.close()
    finally:
        node.stop()
        redis.stop()

    def ms(key: str) -> float:
        return median([r[key] for r in rounds]) * 1000

    def per_step(side: str, kind: str) -> float:
        return cpu[side][kind] / counted[kind] * 1000

    ratio = median([r["msgpack"] / r["openpi"] for r in rounds])
    json_ratio = median([r["json"] / r["openpi"] for r in rounds])
    figures = [
        {
            "figure": "camera step p50 (vla-demo), affinity.Client (msgpack) / openpi-client, "
            "same node",
            "value": ratio,
            "result": f"{ratio:.2f}x ({ms('msgpack'):.2f} ms vs {ms('openpi'):.2f} ms)",
            "goal": "<= 1.2x",
            "ok": ratio <= 1.2,
        },
        {
            "figure": "camera step p50 (vla-demo), affinity.Client(encoding='json') / "
            "openpi-client",
            "value": json_ratio,
            "result": f"{json_ratio:.1f}x ({ms('json'):.1f} ms vs {ms('openpi'):.2f} ms)",
            "goal": "reported",
            "ok": True,
        },
    ]
    for side in ("client", "node"):
        mine, theirs = per_step(side, "msgpack"), per_step(side, "openpi")
        figures.append(
            {
                "figure": f"{side} CPU per camera step, affinity.Client (msgpack) / openpi-client",
                "value": mine / theirs,
                "result": f"{mine / theirs:.2f}x ({mine:.2f} ms vs {theirs:.2f} ms)",
                "goal": "reported",
                "ok": True,
            }
        )
    report("client", figures, {"rounds": rounds})


if __name__ == "__main__":
    main()
