"""affinity.Client and AsyncClient against three real nodes on loopback."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from affinity import AsyncClient, Client, RequestRefused, ServiceUnavailable, StateReset, wire
from node.models import DEMO_MODEL
from tests.procs import Node, RedisServer, wait_until
from tests.rollout import reference_rollout
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
    with Client(entry.url) as binary, Client(entry.url, encoding="json") as as_json:
        for e in range(6):
            client = binary if e % 2 else as_json  # msgpack by default, JSON when asked
            xs = obs(e, 8)
            steps = [client.act(f"cl-{e}", {"obs": x}) for x in xs]
            assert len({s.device for s in steps}) == 1 and steps[0].routing == "claimed"
            assert not any(s.state_reset for s in steps)
            for s, want in zip(steps, reference_rollout(DEMO_MODEL, xs), strict=True):
                actions = s.outputs["actions"]
                assert isinstance(actions, np.ndarray) and actions.shape == (1, 4, 2)
                assert actions.dtype == (np.float32 if client is binary else np.float64)
                np.testing.assert_allclose(actions, want["actions"], rtol=1e-5)
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


def test_the_body_is_msgpack_with_arrays_by_default_and_json_when_asked() -> None:
    sent: list[httpx.Request] = []
    reply = {
        "outputs": {"actions": np.arange(8, dtype=np.float32).reshape(1, 4, 2)},
        "episode_id": "ep", "device": "a/0", "node": "a", "token": 7, "routing": "claimed",
        "state_reset": False, "degraded": False, "source": "model",
    }  # fmt: skip

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if request.headers["accept"] == "application/msgpack":
            return httpx.Response(
                200, content=wire.encode(reply), headers={"content-type": "application/msgpack"}
            )
        as_lists = {**reply, "outputs": {"actions": reply["outputs"]["actions"].tolist()}}
        return httpx.Response(200, json=as_lists)

    x = np.full((1, 8), 0.5, np.float32)
    for encoding in ("msgpack", "json"):
        transport = httpx.MockTransport(answer)
        with Client("http://a.test", encoding=encoding, transport=transport) as client:  # type: ignore[arg-type]
            step = client.act("ep", {"obs": x})
        np.testing.assert_array_equal(step.outputs["actions"], reply["outputs"]["actions"])
    binary, text = sent
    assert binary.headers["content-type"] == "application/msgpack"
    body = wire.decode(binary.content)
    assert (
        isinstance(body["inputs"]["obs"], np.ndarray) and body["inputs"]["obs"].dtype == np.float32
    )
    assert body["episode_id"] == "ep"
    assert text.headers["content-type"] == "application/json"
    assert json.loads(text.content)["inputs"] == {"obs": [[0.5] * 8]}
    with pytest.raises(ValueError, match="encoding 'xml': must be one of msgpack, json"):
        Client("http://a.test", encoding="xml")  # type: ignore[arg-type]
