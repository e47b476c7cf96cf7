"""The unmodified openpi-client against three real nodes on loopback, with the
camera-sized demo policy and LIBERO-shaped observations."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openpi_client.action_chunk_broker import ActionChunkBroker
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from affinity import Keys
from node.contract import load_contract
from node.inputs import from_observation
from node.models import resolve_model
from tests.procs import Node, RedisServer, wait_until
from tests.rollout import reference_rollout
from tests.test_cluster import Cluster, running

pytestmark = [
    pytest.mark.integration,
    # openpi-client 0.1.2 calls websockets' connect() the pre-17.1 way; its warning is the
    # client's, not ours
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]

VLA = resolve_model("vla-demo")
LEASE = 2.0
KEYS = Keys()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("openpi")
    redis = RedisServer(tmp)
    nodes = [
        Node(
            tmp,
            f"p{i}",
            redis.url,
            devices="cpu:2",
            env={"AFFINITY_CLUSTER_SECRET": "s"},
            extra=["--model", "vla-demo", "--lease-ttl", str(LEASE), "--act-deadline", "8"],
        )
        for i in range(3)
    ]
    with running(redis, nodes) as c:
        yield c


@pytest.fixture(scope="module")
def robots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    """One node per other robot's demo policy (each in its own namespace)."""
    tmp = tmp_path_factory.mktemp("openpi-robots")
    redis = RedisServer(tmp)
    redis.namespaces = ("droid-demo", "aloha-demo")
    nodes = {
        model: Node(
            tmp,
            model,
            redis.url,
            devices="cpu:1",
            extra=["--model", model, "--namespace", model, "--act-deadline", "8"],
        )
        for model in ("droid-demo", "aloha-demo")
    }
    with running(redis, list(nodes.values())):
        yield nodes


# openpi's examples/simple_client/main.py, as it builds each environment's observation
def _random_observation_aloha() -> dict[str, Any]:
    return {
        "state": np.ones((14,)),
        "images": {
            "cam_high": np.random.randint(256, size=(3, 224, 224), dtype=np.uint8),
            "cam_low": np.random.randint(256, size=(3, 224, 224), dtype=np.uint8),
            "cam_left_wrist": np.random.randint(256, size=(3, 224, 224), dtype=np.uint8),
            "cam_right_wrist": np.random.randint(256, size=(3, 224, 224), dtype=np.uint8),
        },
        "prompt": "do something",
    }


def _random_observation_droid() -> dict[str, Any]:
    return {
        "observation/exterior_image_1_left": np.random.randint(
            256, size=(224, 224, 3), dtype=np.uint8
        ),
        "observation/wrist_image_left": np.random.randint(256, size=(224, 224, 3), dtype=np.uint8),
        "observation/joint_position": np.random.rand(7),
        "observation/gripper_position": np.random.rand(1),
        "prompt": "do something",
    }


def _random_observation_libero() -> dict[str, Any]:
    return {
        "observation/state": np.random.rand(8),
        "observation/image": np.random.randint(256, size=(224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": np.random.randint(256, size=(224, 224, 3), dtype=np.uint8),
        "prompt": "do something",
    }


ENVIRONMENTS = {  # openpi's EnvMode -> (observations, the model, its action chunk)
    "ALOHA": (_random_observation_aloha, "aloha-demo", (50, 14)),
    "ALOHA_SIM": (_random_observation_aloha, "aloha-demo", (50, 14)),
    "DROID": (_random_observation_droid, "droid-demo", (10, 8)),
    "LIBERO": (_random_observation_libero, "vla-demo", (10, 7)),
}


@pytest.mark.parametrize("env", list(ENVIRONMENTS))
def test_openpis_example_client_runs_every_environment(
    env: str, cluster: Cluster, robots: dict[str, Node]
) -> None:
    """What ``examples/simple_client/main.py --env <env>`` does: connect by host and port,
    read the metadata, two warm-up steps, then steps; here checked against the model."""
    obs_fn, model, chunk = ENVIRONMENTS[env]
    node = cluster.nodes[0] if model == "vla-demo" else robots[model]
    np.random.seed(sum(map(ord, env)))
    policy = WebsocketClientPolicy(host=node.host, port=node.port)
    assert policy.get_server_metadata()["affinity"]["policy"]["inputs"]
    sent = [obs_fn() for _ in range(5)]
    replies = [policy.infer(obs) for obs in sent]
    policy._ws.close()
    path = resolve_model(model)
    contract = load_contract(path)
    feeds = [from_observation(contract, obs).inputs for obs in sent]
    want = [step["actions"][0] for step in reference_rollout(path, feeds)]
    assert [r["routing"] for r in replies] == ["claimed"] + ["hit"] * 4
    for got, expected in zip(replies, want, strict=True):
        assert got["actions"].shape == chunk and got["actions"].dtype == np.float32
        np.testing.assert_allclose(got["actions"], expected, rtol=1e-4, atol=1e-5)
        assert got["server_timing"]["infer_ms"] > 0


def libero(seed: int, steps: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/state": rng.standard_normal(8),
            "prompt": "put the bowl on the plate",
        }
        for _ in range(steps)
    ]


def replay(observations: list[dict[str, Any]]) -> list[np.ndarray]:
    """What one node alone must answer, step by step: the reference rollout's actions."""
    contract = load_contract(VLA)
    feeds = [from_observation(contract, obs).inputs for obs in observations]
    return [step["actions"][0] for step in reference_rollout(VLA, feeds)]


def client(node: Node, episode: str | None = None) -> WebsocketClientPolicy:
    url = f"ws://{node.host}:{node.port}/"
    return WebsocketClientPolicy(url + (f"?episode_id={episode}" if episode else ""))


def live_load(cluster: Cluster) -> int:
    r = cluster.redis.client()
    now = int(r.time()[0]) * 1000
    return sum(r.zcount(k, now, "+inf") for k in r.keys(KEYS.load("*")))


def test_connections_to_different_nodes_stay_on_one_device(cluster: Cluster) -> None:
    obs = libero(1, 12)
    want = replay(obs)
    replies = []
    for i, o in enumerate(obs):
        policy = client(cluster.nodes[i % 3], "pi-ep-1")  # a new connection, another node
        meta = policy.get_server_metadata()
        assert meta["affinity"]["node"] == cluster.nodes[i % 3].node_id
        assert meta["action_horizon"] == 10  # the sidecar's metadata
        replies.append(policy.infer(o))
        policy._ws.close()
    assert len({r["device"] for r in replies}) == 1
    assert [r["routing"] for r in replies] == ["claimed"] + ["hit"] * 11
    assert not any(r["state_reset"] for r in replies)
    for got, expected in zip(replies, want, strict=True):
        assert got["actions"].shape == (10, 7) and got["actions"].dtype == np.float32
        np.testing.assert_allclose(got["actions"], expected, rtol=1e-4, atol=1e-5)
        assert got["server_timing"]["infer_ms"] > 0 and "infer_ms" in got["policy_timing"]


def test_a_connection_without_an_episode_is_released_when_it_closes(cluster: Cluster) -> None:
    before = live_load(cluster)
    policy = client(cluster.nodes[0])
    first = policy.infer(libero(2, 1)[0])
    assert first["episode_id"].startswith("ws-") and first["routing"] == "claimed"
    assert live_load(cluster) == before + 1
    policy._ws.close()
    wait_until(lambda: live_load(cluster) == before, 10, "the episode released on close")


def test_the_action_chunk_broker_works(cluster: Cluster) -> None:
    broker = ActionChunkBroker(client(cluster.nodes[1], "pi-broker"), action_horizon=10)
    obs = libero(3, 20)
    want = replay([obs[0], obs[10]])
    actions = [broker.infer(o) for o in obs]
    for i, a in enumerate(actions):
        assert a["actions"].shape == (7,)
        np.testing.assert_allclose(a["actions"], want[i // 10][i % 10], rtol=1e-4, atol=1e-5)
        assert a["routing"] == ("claimed" if i < 10 else "hit")  # scalars pass through


def test_a_bad_observation_is_the_clients_runtime_error(cluster: Cluster) -> None:
    policy = client(cluster.nodes[2], "pi-bad")
    bad = libero(4, 1)[0]
    bad["observation/image"] = bad["observation/image"][:100]
    with pytest.raises(RuntimeError, match="observation/image"):
        policy.infer(bad)
    r = cluster.redis.client()
    assert r.get(KEYS.episode("pi-bad")) is None  # nothing was claimed


def test_each_step_writes_one_access_line(cluster: Cluster) -> None:
    node = cluster.nodes[1]
    policy = client(node, "pi-logged")
    replies = [policy.infer(o) for o in libero(6, 3)]
    policy._ws.close()
    device = replies[0]["device"]

    def lines() -> list[str]:
        text = node.proc.log_path.read_text(errors="replace")
        return [line for line in text.splitlines() if "episode=pi-logged" in line]

    wait_until(lambda: len(lines()) == 3, 10, "three access lines")
    for line, routing in zip(lines(), ["claimed", "hit", "hit"], strict=True):
        assert " INFO affinity.access: 127.0.0.1:" in line and '"WS /" 200 ' in line, line
        assert line.endswith(f"ms episode=pi-logged device={device} routing={routing}"), line


def test_an_unknown_query_key_is_the_clients_runtime_error(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    policy = WebsocketClientPolicy(f"ws://{node.host}:{node.port}/?episode=typo-key")
    with pytest.raises(RuntimeError, match="bad query: unknown key 'episode'"):
        policy.infer(libero(5, 1)[0])
    r = cluster.redis.client()
    assert r.get(KEYS.episode("typo-key")) is None


def test_sigkill_of_the_owner_mid_episode(cluster: Cluster, tmp_path: Path) -> None:
    # an episode owned by a node other than the one the robot is connected to
    entry = cluster.nodes[0]
    for i in range(50):
        policy = client(entry, f"pi-kill-{i}")
        first = policy.infer(libero(5, 1)[0])
        if first["node"] != entry.node_id:
            break
        policy._ws.close()
    owner = cluster.node(first["node"])
    owner.stop(signal.SIGKILL)
    after = policy.infer(libero(6, 1)[0])  # retried inside the node until the lease lapsed
    assert after["state_reset"] is True and after["routing"] == "reassigned"
    assert after["node"] != owner.node_id and after["token"] > first["token"]
    np.testing.assert_allclose(after["actions"], replay(libero(6, 1))[0], rtol=1e-4, atol=1e-5)
    owner.proc.start()  # back for the other tests of the module
    wait_until(owner.ready, 60, "owner back")


@pytest.mark.parametrize("handing", [False, True])
def test_a_close_seen_while_the_reply_is_handed_over_cancels_nothing(handing: bool) -> None:
    """A step's work is cancelled (``ClientGone``: undone) by a close seen while it runs,
    but not once its reply is being handed over: the send then fails and says that
    nothing went (undone, not put in doubt as a cancelled hand-over would be)."""
    import asyncio

    from node.errors import ClientGone
    from node.protocols.openpiframe import watching

    async def run() -> str:
        async def receive() -> dict[str, Any]:
            return {"type": "websocket.disconnect", "code": 1000}

        async def work() -> str:
            await asyncio.sleep(0.1)  # past WATCH_AFTER_S: watched
            return "sent"

        early: list[Any] = []
        try:
            return await watching(receive, work(), early, lambda: handing)
        except ClientGone:
            return "cancelled"

    assert asyncio.run(run()) == ("sent" if handing else "cancelled")


@pytest.mark.parametrize("gone", [OSError, RuntimeError])
def test_an_error_for_a_client_already_gone_is_no_crash(gone: type[Exception]) -> None:
    """openpi's error frame to a client that left (uvicorn's ``ClientDisconnected``, an
    ``OSError``; or the ``RuntimeError`` of a send after uvicorn closed the connection
    itself) is dropped: the handler ends as for any client gone, nothing raised."""
    import asyncio

    from node.protocols.openpiframe import fail

    sent: list[str] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["type"])
        raise gone("the client is gone")

    asyncio.run(fail(send, "bad_input: no"))
    assert sent == ["websocket.send"]
