"""The fleet's autoscaling signals and the deadline misses under load, with real processes:
one redis-server, two ``affinity-node`` processes (one CPU device of capacity 2 each: the
fleet holds 4 episodes), and the unmodified clients of every front door (``httpx`` on
``/act``, ``tritonclient.http`` and ``tritonclient.grpc``, ``openpi-client``). Every wait is
bounded: a number of polls of ``/metrics``, a number of steps."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from node.catalog import file_version
from node.models import DEMO_MODEL
from tests.procs import Node, RedisServer, free_port, metrics, wait_until
from tests.test_cluster import Cluster, running

pytestmark = [
    pytest.mark.shapes,
    pytest.mark.integration,
    # openpi-client 0.1.2 calls websockets' connect() the pre-17.1 way; its warning is the
    # client's, not ours
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]

MODEL = DEMO_MODEL.stem
DEMO = f"{MODEL}@{file_version(DEMO_MODEL)}"
VIEW_EVERY = 0.2  # --fleet-view-every: the view is read five times a second here
FAST = 10_000.0  # control_hz whose period (0.1 ms) no step makes: every step misses it
SLOW = 1.0  # a period of 1 s: no step here misses it


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, node_shape: str
) -> Iterator[tuple[Cluster, list[int]]]:
    tmp: Path = tmp_path_factory.mktemp("signals")
    redis = RedisServer(tmp)
    grpc_ports = [free_port() for _ in range(2)]
    flags = ["--capacity", "2", "--admission-wait", "4", "--act-deadline", "8",
             "--lease-ttl", "5", "--fleet-view-every", str(VIEW_EVERY)]  # fmt: skip
    nodes = [
        Node(
            tmp,
            f"s{i}",
            redis.url,
            devices="cpu:1",
            env={"AFFINITY_CLUSTER_SECRET": "s"},
            extra=[*flags, "--grpc-port", str(port)],
        )
        for i, port in enumerate(grpc_ports)
    ]
    with running(redis, nodes) as c:
        yield c, grpc_ports


def one(node: Node, name: str, **labels: str) -> float | None:
    return metrics(node).get((name, frozenset(labels.items())))


def fleet_figures(node: Node) -> tuple[float | None, float | None, float | None]:
    m = metrics(node)
    key = frozenset({("model", DEMO)})
    return tuple(  # type: ignore[return-value]
        m.get((f"affinity_fleet_{n}", key)) for n in ("saturation", "live_episodes", "capacity")
    )


def every_node_shows(c: Cluster, figures: tuple[float, float, float], what: str) -> None:
    """Every node exports the same view: wait (bounded) until each shows ``figures``."""
    for n in c.nodes:
        wait_until(lambda n=n: fleet_figures(n) == figures, 30, f"{n.node_id}: {what}", 0.05)


def act_misses(node: Node) -> float:
    return one(node, "affinity_deadline_miss_total", model=DEMO, door="act") or 0.0


def act(node: Node, episode: str, **fields: Any) -> httpx.Response:
    body = {"episode_id": episode, "inputs": {"obs": [[0.1] * 8]}, **fields}
    return httpx.post(node.url + "/act", json=body, timeout=30)


def test_the_saturation_gauges_move_under_load_on_every_node(
    fleet: tuple[Cluster, list[int]],
) -> None:
    """Robots step their episodes without a pause while episodes start and end: every node
    shows the same saturation, live episodes and capacity, moving with them; a fifth episode
    that finds no slot within --admission-wait is refused full (the counter moves); a sixth
    waits in the backlog (the gauge shows it) until a slot frees; when every episode ended
    the saturation is 0 again."""
    c, _ = fleet
    a, b = c.nodes
    every_node_shows(c, (0.0, 0.0, 4.0), "an empty fleet of capacity 4")
    missed = sum(act_misses(n) for n in c.nodes)
    stop = threading.Event()
    served = [0] * 4
    errors: list[str] = []

    def robot(k: int) -> None:
        entry = c.nodes[k % 2]
        for _ in range(5000):  # bounded: until told to stop, at most 5000 steps
            if stop.is_set():
                return
            r = act(entry, f"load-{k}", control_hz=FAST if k % 2 else SLOW)
            if r.status_code != 200:
                errors.append(r.text)
                return
            served[k] += 1

    seen: list[tuple[float | None, ...]] = []
    with ThreadPoolExecutor(6) as pool:
        robots = []
        for k, want in enumerate((0.25, 0.5, 0.75)):
            robots.append(pool.submit(robot, k))
            every_node_shows(c, (want, k + 1.0, 4.0), f"{k + 1} of 4 taken")
            seen.append(fleet_figures(a))
        robots.append(pool.submit(robot, 3))
        every_node_shows(c, (1.0, 4.0, 4.0), "the fleet full")
        seen.append(fleet_figures(b))
        # a fifth episode, through b, finds no slot within --admission-wait: 503 full
        fifth = act(b, "fifth")
        assert fifth.status_code == 503 and fifth.json()["error"]["code"] == "full"
        assert (one(b, "affinity_routing_total", result="full") or 0.0) >= 1
        stop.set()
        for r in robots:
            r.result(timeout=60)
        assert not errors, errors[:3]
        # a sixth waits in a's backlog (the gauge shows it) until a slot frees
        full_before = one(a, "affinity_routing_total", result="full") or 0.0
        sixth = pool.submit(act, a, "sixth")
        wait_until(lambda: one(a, "affinity_admission_waiting") == 1, 30, "sixth waits", 0.02)
        assert act(a, "load-0", end=True).status_code == 200  # the slot it takes
        got = sixth.result(timeout=30)
        assert got.status_code == 200 and got.json()["routing"] == "claimed", got.text
        assert one(a, "affinity_admission_waiting") == 0
        assert (one(a, "affinity_routing_total", result="full") or 0.0) == full_before
    every_node_shows(c, (1.0, 4.0, 4.0), "full again (sixth took load-0's slot)")
    for k, entry in ((1, b), (2, a), (3, b)):
        assert act(entry, f"load-{k}", end=True).status_code == 200
    assert act(b, "sixth", end=True).status_code == 200
    every_node_shows(c, (0.0, 0.0, 4.0), "every episode ended")
    assert min(served) > 0, served
    # the robots at 10 kHz missed every step; those at 1 Hz none (counted where they came in)
    assert sum(act_misses(n) for n in c.nodes) - missed == served[1] + served[3], served
    print(f"\nsaturation on a, then b, as episodes started: {seen}; steps per robot: {served}")


def test_every_door_counts_its_misses_and_replies_the_split_when_asked(
    fleet: tuple[Cluster, list[int]],
) -> None:
    """The unmodified client of each front door names its rate and asks for the split:
    the reply carries it, and the entry node counts a miss under that door."""
    c, grpc_ports = fleet
    a = c.nodes[0]
    obs = np.full((1, 8), 0.2, np.float32)

    def missed(door: str) -> float:
        return one(a, "affinity_deadline_miss_total", model=DEMO, door=door) or 0.0

    # /act, with the header
    before = missed("act")
    r = httpx.post(
        a.url + "/act",
        json={"episode_id": "door-act", "inputs": {"obs": obs.tolist()}, "control_hz": FAST},
        headers={"X-Affinity-Timing": "1"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["timing"]["total_ms"] > 0
    assert missed("act") == before + 1
    # KServe over HTTP (tritonclient.http): the header, the rate as a parameter
    before = missed("kserve_http")
    http = th.InferenceServerClient(f"{a.host}:{a.port}", network_timeout=30)
    try:
        x = th.InferInput("obs", [1, 8], "FP32").set_data_from_numpy(obs)
        result = http.infer(MODEL, [x], sequence_id="door-http", sequence_start=True,
                            parameters={"control_hz": FAST},
                            headers={"X-Affinity-Timing": "1"})  # fmt: skip
        params = result.get_response()["parameters"]
        assert params["timing_total_ms"] >= params["timing_run_ms"] > 0
    finally:
        http.close()
    assert missed("kserve_http") == before + 1
    # KServe over gRPC (tritonclient.grpc): both as parameters
    before = missed("kserve_grpc")
    grpc = tg.InferenceServerClient(f"127.0.0.1:{grpc_ports[0]}")
    try:
        x = tg.InferInput("obs", [1, 8], "FP32")
        x.set_data_from_numpy(obs)
        result = grpc.infer(MODEL, [x], sequence_id="door-grpc", sequence_start=True,
                            parameters={"control_hz": FAST, "timing": True})  # fmt: skip
        params = result.get_response().parameters
        assert params["timing_total_ms"].double_param >= params["timing_run_ms"].double_param > 0
    finally:
        grpc.close()
    assert missed("kserve_grpc") == before + 1
    # openpi (openpi-client): keys of the observation
    before = missed("openpi")
    policy = WebsocketClientPolicy(host=a.host, port=a.port)
    got = policy.infer({"obs": obs[0], "control_hz": FAST, "timing": True})
    assert got["timing"]["total_ms"] >= got["timing"]["run_ms"] > 0
    plain = policy.infer({"obs": obs[0]})
    assert "timing" not in plain
    assert missed("openpi") == before + 1  # the step without a rate has no period
