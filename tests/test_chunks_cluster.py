"""Action-chunk execution through real nodes: three nodes, random entry nodes, the demo
policy (H = 4, D = 2); every reply equals a plain-numpy reference over the chunks the model
predicts, and a SIGKILL of the owner never lets a stale buffered action through."""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from node.models import DEMO_MODEL
from tests.procs import Node, RedisServer, wait_until
from tests.rollout import reference_rollout
from tests.test_cluster import Cluster, running
from tests.test_dispatcher import reference_ensemble, reference_execute

pytestmark = pytest.mark.integration

DECAY = 0.3
H = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("chunks")
    redis = RedisServer(tmp)
    extra = ["--lease-ttl", "2", "--act-deadline", "8", "--ensemble-decay", str(DECAY)]
    nodes = [
        Node(tmp, f"k{i}", redis.url, devices="cpu:1", env={"AFFINITY_CLUSTER_SECRET": "s"},
             extra=extra)
        for i in range(3)
    ]  # fmt: skip
    with running(redis, nodes) as c:
        yield c


def observations(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def drive(
    cluster: Cluster, episode: str, obs: list[np.ndarray], **mode: Any
) -> list[dict[str, Any]]:
    rng = random.Random(episode)
    replies: list[dict[str, Any]] = []
    with httpx.Client(timeout=20) as client:
        for o in obs:
            body = {"episode_id": episode, "inputs": {"obs": o.tolist()}, **mode}
            if replies:
                body["token"] = replies[-1]["token"]
            r = client.post(rng.choice(cluster.nodes).url + "/act", json=body)
            assert r.status_code == 200, r.text
            replies.append(r.json())
    return replies


@pytest.mark.parametrize(("k", "ensemble"), [(1, None), (2, None), (H, None), (None, "exp")])
def test_replies_equal_the_numpy_reference(
    cluster: Cluster, k: int | None, ensemble: str | None
) -> None:
    steps = 3 * H + 1
    obs = observations(k or 99, steps)
    mode: dict[str, Any] = {"execute_steps": k} if k else {"ensemble": ensemble}
    replies = drive(cluster, f"chunk-{k}-{ensemble}", obs, **mode)
    ran = list(range(steps)) if ensemble else list(range(0, steps, k or 1))
    chunks = [step["actions"][0] for step in reference_rollout(DEMO_MODEL, [obs[t] for t in ran])]
    want = (
        reference_ensemble(chunks, DECAY, steps)
        if ensemble
        else reference_execute(chunks, k or 1, steps)
    )
    assert len({r["device"] for r in replies}) == 1
    for t, (reply, (action, source)) in enumerate(zip(replies, want, strict=True)):
        got = np.asarray(reply["outputs"]["actions"])
        assert got.shape == (1, 2), got.shape
        np.testing.assert_allclose(got[0], action, rtol=1e-4, atol=1e-6)
        assert reply["source"] == source, t
        assert reply["state_reset"] is False


def test_a_killed_owner_never_serves_a_stale_buffered_action(cluster: Cluster) -> None:
    obs = observations(7, 6)
    first = drive(cluster, "chunk-kill", obs[:2], execute_steps=H)
    assert [r["source"] for r in first] == ["model", "buffer"]
    owner = cluster.node(first[0]["node"])
    owner.stop(signal.SIGKILL)
    try:
        rest = [n for n in cluster.nodes if n is not owner]
        body = {"episode_id": "chunk-kill", "inputs": {"obs": obs[2].tolist()},
                "execute_steps": H, "token": first[-1]["token"]}  # fmt: skip
        # 503 owner_unreachable until the dead owner's lease lapses, then the episode moves

        def moved() -> httpx.Response | None:
            resp = httpx.post(rest[0].url + "/act", json=body, timeout=20)
            return None if resp.status_code == 503 else resp

        r = wait_until(moved, 30, "the episode moved", interval=0.2)
        assert r.status_code == 200, r.text
        after = r.json()
        # the buffer died with its owner: a fresh run on the new device, and the client is told
        assert after["state_reset"] is True and after["routing"] == "reassigned"
        assert after["source"] == "model" and after["node"] != owner.node_id
        fresh = reference_rollout(DEMO_MODEL, [obs[2]])[0]["actions"][0]
        np.testing.assert_allclose(np.asarray(after["outputs"]["actions"])[0], fresh[0], rtol=1e-4)
    finally:
        owner.proc.start()  # back for the other tests of the module
        wait_until(owner.ready, 60, "owner back")


def test_bad_overrides_are_422_and_change_nothing(cluster: Cluster) -> None:
    r = cluster.redis.client()
    url = cluster.nodes[0].url
    for mode, field in [
        ({"execute_steps": 0}, "execute_steps"),
        ({"execute_steps": H + 1}, "execute_steps"),
        ({"ensemble": "mean"}, "ensemble"),
        ({"ensemble": "exp", "execute_steps": 2}, "execute_steps"),
    ]:
        resp = httpx.post(
            url + "/act", json={"episode_id": "chunk-bad", "inputs": {"obs": [[0] * 8]}, **mode}
        )
        assert resp.status_code == 422 and resp.json()["error"]["field"] == field, resp.text
    assert r.get("{affinity}:episode:chunk-bad") is None
