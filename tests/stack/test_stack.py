"""The stack test: two nodes sharing one Redis, driven over HTTP only.

``docker/compose.yaml`` runs it in its ``stack-test`` service with ``AFFINITY_STACK_URLS``
naming the nodes. Without that variable the module starts the same topology itself on
loopback (a throwaway redis-server and two ``affinity-node`` processes with two ``cpu``
devices each and a cluster secret), so CI runs exactly these bodies. Prometheus likewise:
``AFFINITY_STACK_PROMETHEUS`` names the compose service, else Debian's ``prometheus`` runs
here with the stack's own configuration. Every loop is bounded in count and time.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

from node.contract import load_contract
from node.models import DEMO_MODEL
from tests.rollout import reference_rollout

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

EPISODES = 40
STEPS = 10
DEVICES_PER_NODE = 2
SECRET = "stack-test-secret"
TIMEOUT = httpx.Timeout(10.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The nodes' base URLs: ``AFFINITY_STACK_URLS``, else a stack started here."""
    given = os.environ.get("AFFINITY_STACK_URLS", "")
    if given.strip():
        urls = [u.strip().rstrip("/") for u in given.split(",") if u.strip()]
        assert len(urls) >= 2, f"AFFINITY_STACK_URLS names {len(urls)} node(s); the test needs 2"
        yield urls
        return

    from tests.procs import Node, RedisServer, wait_until

    tmp: Path = tmp_path_factory.mktemp("stack")
    redis = RedisServer(tmp)
    nodes = [
        Node(
            tmp,
            node_id,
            redis.url,
            devices=f"cpu:{DEVICES_PER_NODE}",
            env={"AFFINITY_CLUSTER_SECRET": SECRET},
        )
        for node_id in ("node-a", "node-b")
    ]
    try:
        redis.start()
        for n in nodes:  # start both, then wait for both
            n.proc.start()
        for n in nodes:
            wait_until(n.ready, 60, f"node {n.node_id} ready")
        yield [n.url for n in nodes]
    finally:
        for n in nodes:
            n.stop()
        redis.stop()


@pytest.fixture(scope="module")
def prometheus(stack: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus' base URL: ``AFFINITY_STACK_PROMETHEUS`` (the compose service), else
    Debian's prometheus binary started here with the compose stack's configuration."""
    given = os.environ.get("AFFINITY_STACK_PROMETHEUS", "").strip()
    if given:
        yield given.rstrip("/")
        return

    from urllib.parse import urlsplit

    from tests.stack.prometheus import Prometheus

    targets = {}
    for url in stack:
        node = httpx.get(f"{url}/healthz", timeout=TIMEOUT).json()["node"]
        targets[node] = urlsplit(url).netloc
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), targets).start()
    try:
        yield server.url
    finally:
        server.stop()


async def get_json(client: httpx.AsyncClient, url: str, status: int = 200) -> Any:
    r = await client.get(url)
    assert r.status_code == status, f"GET {url}: {r.status_code} {r.text}"
    return r.json()


async def test_every_node_is_ready(stack: list[str]) -> None:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        node_ids = []
        deadline = time.monotonic() + 60
        for url in stack:
            while True:
                r = await client.get(f"{url}/readyz")
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                await anyio.sleep(0.2)
            assert r.status_code == 200, f"{url} not ready: {r.text}"
            body = r.json()
            assert body["ready"] is True
            assert len(body["devices"]) == DEVICES_PER_NODE
            node_ids.append(body["node"])
            assert (await get_json(client, f"{url}/healthz"))["ok"] is True
        assert len(set(node_ids)) == len(stack), f"node ids must differ: {node_ids}"
        # Every node sees every device of the stack, alive and active, in the shared Redis.
        for url in stack:
            listed = (await get_json(client, f"{url}/devices"))["devices"]
            mine = [d for d in listed if d["node"] in node_ids]
            assert len(mine) == DEVICES_PER_NODE * len(stack)
            assert all(d["alive"] and d["state"] == "active" for d in mine), mine


async def test_episodes_stick_to_one_device_from_any_node(stack: list[str]) -> None:
    contract = load_contract(DEMO_MODEL)
    run = uuid.uuid4().hex[:8]  # episode ids unique per run: the stack may be reused
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    episodes = [f"stack-{run}-{i}" for i in range(EPISODES)]
    observed = contract.observation_inputs[0]
    shape = (STEPS, *observed.zeros().shape)
    observations = {
        ep: np.random.default_rng([seed, i]).standard_normal(shape).astype(observed.dtype)
        for i, ep in enumerate(episodes)
    }
    # Each step goes to a node drawn at random, as a load balancer without affinity would.
    entry = {ep: [rng.choice(stack) for _ in range(STEPS)] for ep in episodes}
    replies: dict[str, list[dict[str, Any]]] = {ep: [] for ep in episodes}

    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        served = await get_json(client, f"{stack[0]}/model")
        assert served == contract.to_json(), "the stack must serve the demo policy"

        async def drive(ep: str) -> None:
            for step in range(STEPS):
                r = await client.post(
                    f"{entry[ep][step]}/act",
                    json={
                        "episode_id": ep,
                        "inputs": {observed.name: observations[ep][step].tolist()},
                    },
                )
                assert r.status_code == 200, f"{ep} step {step} via {entry[ep][step]}: {r.text}"
                replies[ep].append(r.json())

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for ep in episodes:
                    tg.start_soon(drive, ep)

        used: set[str] = set()
        for ep in episodes:
            steps = replies[ep]
            assert len(steps) == STEPS
            where = {(s["device"], s["node"], s["token"]) for s in steps}
            assert len(where) == 1, f"{ep} moved (seed {seed}): {where}"
            device, node, token = where.pop()
            assert device.startswith(node + "/")
            assert [s["state_reset"] for s in steps] == [False] * STEPS, ep
            assert [s["routing"] for s in steps] == ["claimed"] + ["hit"] * (STEPS - 1), ep
            assert not any(s["degraded"] for s in steps)
            # The state stayed with the episode on its device: the outputs are those of one
            # uninterrupted rollout.
            reference = reference_rollout(DEMO_MODEL, list(observations[ep]))
            for s, ref in zip(steps, reference, strict=True):
                for output, value in s["outputs"].items():
                    np.testing.assert_allclose(value, ref[output], rtol=1e-5, atol=1e-6)
            used.add(device)

            # Every node agrees on where the episode lives.
            for url in stack:
                info = await get_json(client, f"{url}/episodes/{ep}")
                assert (info["device"], info["node"], info["token"]) == (device, node, token)
                assert info["alive"] is True and info["ttl_ms"] > 0
        assert len({d.split("/")[0] for d in used}) == len(stack), f"devices used: {used}"

        # Ending an episode through one node ends it for all of them.
        for i, ep in enumerate(episodes[:10]):
            ender, other = stack[i % len(stack)], stack[(i + 1) % len(stack)]
            r = await client.post(f"{ender}/episodes/{ep}/end")
            assert r.status_code == 200, r.text
            assert r.json()["released"] is True
            gone = await get_json(client, f"{other}/episodes/{ep}", status=404)
            assert gone["error"]["code"] == "not_found"
            await get_json(client, f"{ender}/episodes/{ep}", status=404)
        # The others are still where they were.
        for ep in episodes[10:]:
            info = await get_json(client, f"{stack[-1]}/episodes/{ep}")
            assert info["device"] == replies[ep][0]["device"]


def test_prometheus_scrapes_every_node_and_loads_the_alert_rules(
    stack: list[str], prometheus: str
) -> None:
    from tests.procs import wait_until
    from tests.stack.prometheus import query, scraped_nodes

    nodes = {httpx.get(f"{url}/healthz", timeout=TIMEOUT).json()["node"] for url in stack}
    wait_until(
        lambda: scraped_nodes(prometheus) == dict.fromkeys(nodes, 1.0),
        60,
        f"Prometheus scraping {sorted(nodes)}",
        interval=0.5,
    )
    fenced = {s["metric"]["node"]: s["value"][1] for s in query(prometheus, "affinity_fenced")}
    assert fenced == dict.fromkeys(nodes, "0")

    def evaluated() -> list[dict[str, Any]]:
        """The rules, once each has been evaluated (health is "unknown" until then)."""
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=TIMEOUT).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r["health"] != "unknown" for r in rules) else []

    rules = wait_until(evaluated, 60, "the alert rules evaluated", interval=0.5)
    assert {"AffinityNodeFenced", "AffinityDeviceDown"} <= {r["name"] for r in rules}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = [r["name"] for r in rules if r["state"] != "inactive"]
    assert firing == [], f"a healthy stack raises no alert: {firing}"


def test_grafana_serves_the_provisioned_dashboard(stack: list[str]) -> None:
    from tests.procs import wait_until

    grafana = os.environ.get("AFFINITY_STACK_GRAFANA", "").strip().rstrip("/")
    if not grafana:
        pytest.skip("Grafana runs in the compose stack only (docker/compose.yaml)")
    url = f"{grafana}/api/dashboards/uid/affinity"
    r = wait_until(
        lambda: (r := httpx.get(url, timeout=TIMEOUT)).status_code == 200 and r,
        60,
        "Grafana serving the dashboard",
        interval=1,
    )
    dashboard = r.json()["dashboard"]
    assert dashboard["title"] == "affinity" and dashboard["panels"]
    sources = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert sources == {"affinity-prometheus"}
