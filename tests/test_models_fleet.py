"""Several policies on one fleet (issue 24), with real processes: a real redis-server and
three ``affinity-node`` processes, A serving ``demo``, B ``demo`` and ``vla-demo``, C
``vla-demo`` (two CPU devices each, KServe over gRPC too). Every episode, through every
entry node and front door, lands only on a device that serves its model; a rollout of a
new ``demo`` version takes new episodes by weight while old ones keep theirs; Triton's
own two-model sequence example (``simple_http_sequence_sync_infer_client.py -d``) runs
with the unmodified ``tritonclient``. Every loop is bounded; every process is killed."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from onnx import TensorProto, helper, numpy_helper
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from tritonclient.utils import InferenceServerException

from affinity import Client, Keys, RequestRefused, wire
from node.catalog import file_version
from node.models import DEMO_MODEL
from node.models._build import Weights, model, tensor, write
from tests.procs import ROOT, Node, RedisServer, free_port
from tests.test_cluster import Cluster, running

pytestmark = [
    pytest.mark.integration,
    # openpi-client 0.1.2 calls websockets' connect() the pre-17.1 way
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]

KEYS = Keys()
DEMO, VLA = "demo_policy", "vla_demo"
DEMO_V1 = file_version(DEMO_MODEL)
SERVES = {DEMO: {"A", "B"}, VLA: {"B", "C"}}
OBS = np.arange(8, dtype=np.float32).reshape(1, 8) / 8


@pytest.fixture(scope="module")
def abc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("models")
    redis = RedisServer(tmp)
    models = {"A": ["demo"], "B": ["demo", "vla-demo"], "C": ["vla-demo"]}
    grpc = {n: free_port() for n in models}
    nodes = [
        Node(
            tmp,
            n,
            redis.url,
            devices="cpu:2",
            env={"AFFINITY_CLUSTER_SECRET": "s"},
            extra=[
                *(a for m in ms for a in ("--model", m)),
                *("--lease-ttl", "5", "--act-deadline", "8", "--grpc-port", str(grpc[n])),
            ],
        )
        for n, ms in models.items()
    ]
    with running(redis, nodes) as c:
        yield c, {n: f"127.0.0.1:{p}" for n, p in grpc.items()}


def vla_inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (1, 224, 224, 3), dtype=np.uint8),
        "wrist_image": rng.integers(0, 256, (1, 224, 224, 3), dtype=np.uint8),
        "state": rng.standard_normal((1, 8)).astype(np.float32),
    }


def act(node: Node, body: dict[str, Any], *, binary: bool = False) -> httpx.Response:
    if binary:
        return httpx.post(
            node.url + "/act",
            content=wire.encode(body),
            headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
            timeout=10,
        )
    return httpx.post(node.url + "/act", json=body, timeout=10)


def held_by(cluster: Cluster, episode: str) -> tuple[str, str]:
    """(node, model) of the episode's assignment, as Redis holds it."""
    value = cluster.redis.client().get(KEYS.episode(episode))
    assert value, episode
    device, _, _, held = value.split(" ")[:4]
    return device.split("/")[0], held


def device_states(cluster: Cluster) -> set[str]:
    r = cluster.redis.client()
    return {r.hget(KEYS.device(d), "state") for d in r.smembers(KEYS.devices)}


def test_every_episode_lands_on_a_device_of_its_model(abc: tuple[Cluster, dict[str, str]]) -> None:
    cluster, grpc = abc
    landed: dict[str, set[str]] = {DEMO: set(), VLA: set()}
    for entry in cluster.nodes:
        for i in range(4):  # /act, JSON for demo, msgpack for both
            ep = f"act-{entry.node_id}-{i}"
            r = act(entry, {"episode_id": ep, "model": DEMO, "inputs": {"obs": OBS.tolist()}})
            assert r.status_code == 200, r.text
            landed[DEMO].add(r.json()["node"])
            assert held_by(cluster, ep) == (r.json()["node"], f"{DEMO}@{DEMO_V1}")
            for step in range(2):
                r = act(entry, {"episode_id": f"vla-{ep}", "model": VLA,
                                "inputs": vla_inputs(step)}, binary=True)  # fmt: skip
                assert r.status_code == 200, r.text
                doc = wire.decode(r.content)
                assert doc["routing"] == ("claimed" if step == 0 else "hit")
                landed[VLA].add(doc["node"])
                assert doc["outputs"]["actions"].shape == (1, 10, 7)
        # KServe over HTTP and gRPC, with the model in the URL (and a version, the old "1")
        http = th.InferenceServerClient(f"{entry.host}:{entry.port}")
        rpc = tg.InferenceServerClient(grpc[entry.node_id])
        try:
            for kind, client in ((th, http), (tg, rpc)):
                for seq in range(3):
                    sid = f"k-{entry.node_id}-{kind.__name__}-{seq}"
                    tensors = []
                    for name, value in vla_inputs(seq).items():
                        t = kind.InferInput(name, list(value.shape), "UINT8" if
                                            value.dtype == np.uint8 else "FP32")  # fmt: skip
                        t.set_data_from_numpy(value)
                        tensors.append(t)
                    r = client.infer(VLA, tensors, sequence_id=sid, sequence_start=True)
                    assert r.as_numpy("actions").shape == (1, 10, 7)
                    landed[VLA].add(held_by(cluster, f"kserve:s:{sid}")[0])
                    t = kind.InferInput("obs", [1, 8], "FP32")
                    t.set_data_from_numpy(OBS)
                    client.infer(DEMO, [t], model_version="1", sequence_id=sid, sequence_start=True)
                    landed[DEMO].add(held_by(cluster, f"kserve:s:{sid}")[0])
            assert [t["name"] for t in http.get_model_metadata(VLA)["inputs"]] == [
                "image", "wrist_image", "state",
            ]  # fmt: skip
            assert http.is_model_ready(DEMO) and not http.is_model_ready("pi0")
        finally:
            http.close()
            rpc.close()
        # openpi: ?model= names the model; its metadata describes that model
        policy = WebsocketClientPolicy(f"ws://{entry.host}:{entry.port}/?model={VLA}")
        meta = policy.get_server_metadata()
        assert meta["affinity"]["model"] == VLA
        assert "observation/image" in meta["affinity"]["policy"]["observations"]
        for step in range(2):
            obs = vla_inputs(step)
            reply = policy.infer({"observation/image": obs["image"][0],
                                  "observation/wrist_image": obs["wrist_image"][0],
                                  "observation/state": obs["state"][0].astype(float)})  # fmt: skip
            assert reply["actions"].shape == (10, 7)
            assert reply["model"].startswith(f"{VLA}@")
            landed[VLA].add(reply["node"])
    for name, nodes in landed.items():
        assert nodes == SERVES[name], (name, nodes)  # every node of the model, and no other
    # Redis agrees: each episode's device belongs to a node that serves its model
    r = cluster.redis.client()
    for key in r.scan_iter(KEYS.episode("*")):
        node, held = held_by(cluster, key.removeprefix(KEYS.episode("")))
        assert node in SERVES[held.split("@")[0]], (key, node, held)


def test_the_python_client_names_its_model(abc: tuple[Cluster, dict[str, str]]) -> None:
    """``affinity.Client(...).act(..., model=...)``: each episode lands on a node that serves
    its model, the step says which version served it, and an unnamed one is refused."""
    cluster, _ = abc
    with Client([node.url for node in cluster.nodes]) as client:
        for i in range(3):
            for name, inputs in ((DEMO, {"obs": OBS}), (VLA, vla_inputs(i))):
                ep = f"client-{name}-{i}"
                step = client.act(ep, inputs, model=name)
                assert step.model is not None and step.model.startswith(name + "@"), step
                assert step.node in SERVES[name] and held_by(cluster, ep) == (
                    step.node,
                    step.model,
                ), (ep, step)
        with pytest.raises(RequestRefused) as refused:
            client.act("client-unnamed", {"obs": OBS})
    assert refused.value.status == 422 and refused.value.code == "model_required"


def test_a_step_without_a_model_or_with_an_unknown_one(abc: tuple[Cluster, dict[str, str]]) -> None:
    cluster, grpc = abc
    for entry in cluster.nodes:
        r = act(entry, {"episode_id": "no-model", "inputs": {"obs": OBS.tolist()}})
        assert r.status_code == 422 and r.json()["error"]["code"] == "model_required", r.text
        assert DEMO in r.json()["error"]["message"] and VLA in r.json()["error"]["message"]
        r = act(entry, {"episode_id": "unknown", "model": "pi0", "inputs": {"obs": OBS.tolist()}})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_model", r.text
        r = httpx.post(f"{entry.url}/v2/models/pi0/infer", json={"inputs": []}, timeout=5)
        assert r.status_code == 404 and "unknown model" in r.json()["error"]
        rpc = tg.InferenceServerClient(grpc[entry.node_id])
        t = tg.InferInput("obs", [1, 8], "FP32")
        t.set_data_from_numpy(OBS)
        with pytest.raises(InferenceServerException, match="unknown model"):
            rpc.infer("pi0", [t], sequence_id="x", sequence_start=True)
        rpc.close()
        listed = httpx.get(entry.url + "/v2/models", timeout=5).json()["models"]
        assert [m["name"] for m in listed] == [DEMO, VLA]
        models = httpx.get(entry.url + "/models", timeout=5).json()["models"]
        assert {(m["name"], tuple(m["nodes"])) for m in models} == {
            (DEMO, ("A", "B")), (VLA, ("B", "C")),
        }  # fmt: skip
        named = httpx.get(f"{entry.url}/models/{VLA}", timeout=5).json()
        assert named["name"] == VLA and [i["name"] for i in named["inputs"]] == [
            "image", "wrist_image", "state",
        ]  # fmt: skip
    assert cluster.redis.client().get(KEYS.episode("no-model")) is None
    assert cluster.redis.client().get(KEYS.episode("unknown")) is None
    # the old single-model endpoint: still there on a node with one model
    assert (
        httpx.get(cluster.node("A").url + "/model", timeout=5).json()["inputs"][0]["name"] == "obs"
    )
    assert httpx.get(cluster.node("B").url + "/model", timeout=5).status_code == 422


def test_inputs_of_another_model_are_the_clients_error(abc: tuple[Cluster, dict[str, str]]) -> None:
    cluster, _ = abc
    for entry in cluster.nodes:  # A serves no vla-demo: it checks the registered contract
        for i in range(5):  # more than --failure-threshold (3)
            r = act(entry, {"episode_id": f"bad-{entry.node_id}-{i}", "model": VLA,
                            "inputs": {"obs": OBS.tolist()}})  # fmt: skip
            assert r.status_code == 422 and r.json()["error"]["code"] == "bad_input", r.text
            r = act(entry, {"episode_id": f"bad-{entry.node_id}-{i}", "model": DEMO,
                            "inputs": vla_inputs(i)}, binary=True)  # fmt: skip
            assert r.status_code == 422, r.text
    assert device_states(cluster) == {"active"}
    r = cluster.redis.client()
    assert not [k for k in r.scan_iter(KEYS.episode("bad-*"))]


def test_a_rollout_shares_new_episodes_and_old_ones_keep_their_version(
    abc: tuple[Cluster, dict[str, str]], tmp_path: Path
) -> None:
    cluster, _ = abc
    a = cluster.node("A")
    old = act(a, {"episode_id": "old", "model": DEMO, "inputs": {"obs": OBS.tolist()}}).json()
    # a new version of demo on a fourth node: the newest takes every new episode
    d = Node(tmp_path, "D", cluster.redis.url, devices="cpu:2",
             env={"AFFINITY_CLUSTER_SECRET": "s"},
             extra=["--model", f"{DEMO}=demo@v2", "--lease-ttl", "5"]).start()  # fmt: skip
    try:
        for i in range(4):
            r = act(a, {"episode_id": f"new-{i}", "model": DEMO, "inputs": {"obs": OBS.tolist()}})
            assert r.status_code == 200 and r.json()["node"] == "D", r.text
            assert r.json()["model"] == f"{DEMO}@v2"  # the reply names the version served
            assert held_by(cluster, f"new-{i}") == ("D", f"{DEMO}@v2")
        again = act(a, {"episode_id": "old", "model": DEMO, "inputs": {"obs": OBS.tolist()}})
        assert (again.json()["node"], again.json()["routing"]) == (old["node"], "hit")
        # a step of the old episode naming the new version: 409, nothing changes
        r = act(a, {"episode_id": "old", "model": f"{DEMO}@v2", "inputs": {"obs": OBS.tolist()}})
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_conflict", r.text
        assert held_by(cluster, "old") == (old["node"], f"{DEMO}@{DEMO_V1}")
        # the operator shares new episodes 1:1 between the versions
        for version in (DEMO_V1, "v2"):
            cli = [sys.executable, "-m", "affinity.cli", "--redis", cluster.redis.url,
                   "rollout", DEMO, version, "1"]  # fmt: skip
            done = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
        assert "v2" in done.stdout and DEMO_V1 in done.stdout
        got = Counter()
        for i in range(10):
            r = act(a, {"episode_id": f"split-{i}", "model": DEMO, "inputs": {"obs": OBS.tolist()}})
            assert r.status_code == 200, r.text
            got[held_by(cluster, f"split-{i}")[1]] += 1
        assert got == {f"{DEMO}@{DEMO_V1}": 5, f"{DEMO}@v2": 5}
        # a KServe URL may name the version
        r = httpx.post(f"{a.url}/v2/models/{DEMO}/versions/v2/infer", timeout=5, json={
            "parameters": {"sequence_id": "kv2", "sequence_start": True},
            "inputs": [{"name": "obs", "shape": [1, 8], "datatype": "FP32",
                        "data": OBS.reshape(-1).tolist()}],
        })  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["model_version"] == "v2"
        assert held_by(cluster, "kserve:s:kv2") == ("D", f"{DEMO}@v2")
        # the claims say which version each took: events and the routers' metrics
        events = cluster.redis.client().xrange(KEYS.events)
        claims = [
            f for _, f in events if f.get("type") == "claim" and f["episode"].startswith("split-")
        ]
        assert Counter(f["model"] for f in claims) == got
        text = httpx.get(a.url + "/metrics", timeout=5).text
        assert (
            f'affinity_model_claims_total{{model="{DEMO}",result="claimed",version="v2"}}' in text
        )
    finally:
        d.stop()


# ---- Triton's own sequence example, two-model ("dyna") mode ---------------------------


def dyna_models(out: Path) -> tuple[Path, Path]:
    """Triton's two sequence models of ``simple_http_sequence_sync_infer_client.py -d``:
    ``simple_dyna_sequence`` answers INPUT + START, plus the correlation id on END;
    ``simple_string_dyna_sequence`` (a string correlation id) accumulates INPUT from START
    and adds the id, as a number, on END."""
    i32 = TensorProto.INT32
    w = Weights(seed=0)
    ints = model(
        "simple_dyna_sequence",
        [
            helper.make_node("Cast", ["control.corrid"], ["id"], to=i32),
            helper.make_node("Mul", ["id", "control.end"], ["id_end"]),
            helper.make_node("Add", ["INPUT", "control.start"], ["started"]),
            helper.make_node("Add", ["started", "id_end"], ["OUTPUT"]),
        ],
        [tensor("INPUT", i32, 1), tensor("control.start", i32, 1), tensor("control.end", i32, 1),
         tensor("control.corrid", TensorProto.UINT64, 1)],
        [tensor("OUTPUT", i32, 1)],
        w,
        "tests",
    )  # fmt: skip
    # StringConcat (opset 20) makes "" (a warm-up's, a stateless step's id) read as 0
    one = numpy_helper.from_array(np.ones((1, 1), np.int32), "one")
    zero = helper.make_tensor("zero", TensorProto.STRING, [1, 1], [b"0"])
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["one", "control.start"], ["keep"]),
            helper.make_node("Mul", ["state_in.acc", "keep"], ["kept"]),
            helper.make_node("Add", ["INPUT", "kept"], ["state_out.acc"]),
            helper.make_node("StringConcat", ["zero", "control.corrid"], ["digits"]),
            helper.make_node("Cast", ["digits"], ["id"], to=i32),
            helper.make_node("Mul", ["id", "control.end"], ["id_end"]),
            helper.make_node("Add", ["state_out.acc", "id_end"], ["OUTPUT"]),
        ],
        "simple_string_dyna_sequence",
        [tensor("INPUT", i32, 1), tensor("state_in.acc", i32, 1), tensor("control.start", i32, 1),
         tensor("control.end", i32, 1), tensor("control.corrid", TensorProto.STRING, 1)],
        [tensor("OUTPUT", i32, 1), tensor("state_out.acc", i32, 1)],
        initializer=[one, zero],
    )  # fmt: skip
    strings = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    strings.ir_version = 10  # onnx writes IR 14 by default, which onnxruntime refuses
    return (
        write(out, "simple_dyna_sequence.onnx", ints, {})[0],
        write(out, "simple_string_dyna_sequence.onnx", strings, {})[0],
    )


def sync_send(client: Any, values: list[int], sequence_id: object, model_name: str) -> list[int]:
    """The example's ``sync_send``: one sequence, START on the first value, END on the last."""
    out = []
    for count, value in enumerate(values, 1):
        data = np.full((1, 1), value, dtype=np.int32)
        t = th.InferInput("INPUT", list(data.shape), "INT32")
        t.set_data_from_numpy(data)
        r = client.infer(model_name=model_name, inputs=[t],
                         outputs=[th.InferRequestedOutput("OUTPUT")], sequence_id=sequence_id,
                         sequence_start=count == 1, sequence_end=count == len(values))  # fmt: skip
        out.append(int(r.as_numpy("OUTPUT")[0][0]))
    return out


def test_tritons_two_model_sequence_example(tmp_path: Path) -> None:
    ints, strings = dyna_models(tmp_path / "models")
    redis = RedisServer(tmp_path)
    both = Node(tmp_path, "T1", redis.url, devices="cpu:1",
                extra=["--model", str(ints), "--model", str(strings)])  # fmt: skip
    one = Node(tmp_path, "T2", redis.url, devices="cpu:1", extra=["--model", str(ints)])
    with running(redis, [both, one]):
        for entry in (one, both):  # T2 does not serve the string model: it routes it to T1
            client = th.InferenceServerClient(f"{entry.host}:{entry.port}")
            try:
                values = [11, 7, 5, 3, 2, 0, 1]
                int0 = sync_send(client, [0, *values], 1000, "simple_dyna_sequence")
                int1 = sync_send(client, [100, *(-v for v in values)], 1001, "simple_dyna_sequence")
                string0 = sync_send(client, [20, *(-v for v in values)], "1002",
                                    "simple_string_dyna_sequence")  # fmt: skip
            finally:
                client.close()
            for i in range(len(int0)):  # the example's own expectations, -d
                want0 = 1 if i == 0 else values[i - 1]
                want1 = 101 if i == 0 else -values[i - 1]
                want_s = 20 if i == 0 else -values[i - 1] + string0[i - 1]
                if i != 0 and values[i - 1] == 1:
                    want0, want1, want_s = want0 + 1000, want1 + 1001, want_s + 1002
                assert (int0[i], int1[i], string0[i]) == (want0, want1, want_s), i
