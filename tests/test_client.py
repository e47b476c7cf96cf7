"""affinity.Client and AsyncClient against three real nodes on loopback."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from affinity import AsyncClient, Client, RequestRefused, ServiceUnavailable, StateReset
from node.policy import DEMO_MODEL, reference_rollout
from tests.procs import Node, RedisServer, wait_until
from tests.test_cluster import Cluster, running

pytestmark = pytest.mark.integration

LEASE = 2.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    redis = RedisServer(tmp_path)
    nodes = [
        Node(tmp_path, f"c{i}", redis.url, devices="cpu:1",
             env={"AFFINITY_CLUSTER_SECRET": "s"}, extra=["--lease-ttl", str(LEASE)])
        for i in range(3)
    ]  # fmt: skip
    with running(redis, nodes) as c:
        yield c


def forwarded(node: Node) -> float:
    text = httpx.get(node.url + "/metrics").text
    line = next(
        x for x in text.splitlines() if x.startswith('affinity_forwarded_total{result="ok"}')
    )
    return float(line.rsplit(" ", 1)[1])


def obs(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def test_steps_go_straight_to_the_owner_and_match_the_reference(cluster: Cluster) -> None:
    entry = cluster.nodes[0]
    seen: dict[str, str] = {}
    with Client(entry.url) as client:
        for e in range(6):
            xs = obs(e, 8)
            steps = [client.act(f"cl-{e}", {"obs": x}) for x in xs]
            assert len({s.device for s in steps}) == 1 and steps[0].routing == "claimed"
            assert not any(s.state_reset for s in steps)
            for s, want in zip(steps, reference_rollout(DEMO_MODEL, xs), strict=True):
                np.testing.assert_allclose(s.outputs["actions"], want["actions"], rtol=1e-5)
            seen[f"cl-{e}"] = steps[0].node
    # only each episode's first step went through the entry node and was forwarded
    not_entry = sum(node != entry.node_id for node in seen.values())
    assert not_entry > 0 and forwarded(entry) == not_entry


def test_the_owner_dies_the_client_falls_back_and_is_told(cluster: Cluster) -> None:
    entry = cluster.nodes[0]
    with Client([entry.url], retry_budget_s=30, raise_on_reset=True) as client:
        for e in range(20):
            first = client.act(f"die-{e}", {"obs": obs(e, 1)[0]})
            if first.node != entry.node_id:
                break
        owner = cluster.node(first.node)
        owner.stop(signal.SIGKILL)
        with pytest.raises(StateReset) as info:
            client.act(first.episode_id, {"obs": obs(99, 1)[0]})  # type: ignore[arg-type]
        step = info.value.step
        assert step.routing == "reassigned" and step.node != owner.node_id
        assert step.token > first.token
        again = client.act(first.episode_id, {"obs": obs(98, 1)[0]})  # type: ignore[arg-type]
        assert again.state_reset is False and again.device == step.device


def test_errors_are_typed(cluster: Cluster) -> None:
    with Client(cluster.nodes[1].url, retries=2, retry_budget_s=3) as client:
        with pytest.raises(RequestRefused) as bad:
            client.act("typed", {"obs": [[1, 2]]})
        assert bad.value.status == 422 and bad.value.field == "inputs.obs"
        cluster.redis.stop()
        with pytest.raises(ServiceUnavailable) as down:
            client.act("typed", {"obs": obs(1, 1)[0]})
        assert down.value.code in ("redis", "fenced")  # the lease lapses while it retries


def test_the_async_client_steps_episodes_concurrently(cluster: Cluster) -> None:
    async def run() -> None:
        async with AsyncClient([n.url for n in cluster.nodes]) as client:

            async def episode(e: int) -> None:
                xs = obs(100 + e, 6)
                steps = [await client.act(f"ac-{e}", {"obs": x}) for x in xs]
                assert len({s.device for s in steps}) == 1
                for s, want in zip(steps, reference_rollout(DEMO_MODEL, xs), strict=True):
                    np.testing.assert_allclose(s.outputs["actions"], want["actions"], rtol=1e-5)
                end = await client.act(f"ac-{e}", {"obs": xs[0]}, end=True)
                assert end.device == steps[0].device

            await asyncio.gather(*(episode(e) for e in range(12)))

    asyncio.run(run())
    r = cluster.redis.client()
    wait_until(lambda: not list(r.scan_iter("{affinity}:episode:ac-*")), 5, "ended episodes gone")
