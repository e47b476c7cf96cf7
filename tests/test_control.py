"""Triton's control inputs (``control.start/end/ready/corrid``), filled by the node on every
front door: the contract, and an accumulator built here (Triton's ``simple_sequence`` idea:
the running sum resets on START) served by three real nodes, stepped through KServe over
HTTP and gRPC, ``/act`` and openpi's websocket, each equal to a replay."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from onnx import TensorProto, helper
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from node.contract import PolicyContract, TensorSpec, load_contract
from node.control import control_feed, corrid_of
from node.dispatcher import MultiGpuDispatcher
from node.models._build import Weights, model, tensor, write
from node.protocols.kserve.request import model_metadata
from tests.dispatch import dispatch
from tests.procs import Node, RedisServer, free_port
from tests.test_cluster import Cluster, grpc_nodes, running

NAME = "accumulate"


def accumulator(out_dir: Path, *, corrid: int = TensorProto.UINT64, extra: str = "") -> Path:
    """``total = obs + (1 - start) * acc`` (state ``acc``), and ``seen`` = the step's
    ``[start, end, ready]`` and ``corrid`` back as outputs."""
    w = Weights(seed=1)
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Cast", ["control.start"], ["start_f"], to=f),
        helper.make_node("Sub", [w.constant("one", np.ones((1, 1), np.float32)), "start_f"],
                         ["keep"]),
        helper.make_node("Mul", ["state_in.acc", "keep"], ["kept"]),
        helper.make_node("Add", ["obs", "kept"], ["state_out.acc"]),
        helper.make_node("Identity", ["state_out.acc"], ["total"]),
        helper.make_node("Concat", ["control.start", "control.end", "control.ready"], ["seen"],
                         axis=1),
        helper.make_node("Identity", ["control.corrid"], ["corrid"]),
    ]  # fmt: skip
    inputs = [
        tensor("obs", f, 2),
        tensor("state_in.acc", f, 2),
        tensor("control.start", TensorProto.INT32, 1),
        tensor("control.end", TensorProto.INT32, 1),
        tensor("control.ready", TensorProto.INT32, 1),
        tensor("control.corrid", corrid, 1),
    ]
    if extra:
        inputs.append(tensor(extra, f, 1))
        nodes.append(helper.make_node("Identity", [extra], ["extra_out"]))
    outputs = [
        tensor("total", f, 2),
        tensor("state_out.acc", f, 2),
        tensor("seen", TensorProto.INT32, 3),
        tensor("corrid", corrid, 1),
    ]
    if extra:
        outputs.append(tensor("extra_out", f, 1))
    path, _ = write(out_dir, f"{NAME}.onnx", model(NAME, nodes, inputs, outputs, w, "tests"), {})
    return path


def replay(obs: list[np.ndarray], corrid: int) -> list[dict[str, Any]]:
    """What a served episode of ``obs`` must answer: starts once, ends on its last step."""
    acc = np.zeros((1, 2), np.float32)
    out = []
    for i, o in enumerate(obs):
        acc = o + acc if i else o.copy()
        seen = [[int(i == 0), int(i == len(obs) - 1), 1]]
        out.append({"total": acc.copy(), "seen": np.array(seen, np.int32), "corrid": corrid})
    return out


def steps(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 2)).astype(np.float32) for _ in range(n)]


def check(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g["total"]).reshape(1, 2), w["total"], rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(g["seen"]).reshape(1, 3), w["seen"])
        assert int(np.asarray(g["corrid"]).reshape(-1)[0]) == w["corrid"]


# ---- the contract ------------------------------------------------------------------------


def test_control_inputs_are_hidden_and_checked(tmp_path: Path) -> None:
    contract = load_contract(accumulator(tmp_path))
    assert [s.name for s in contract.observation_inputs] == ["obs"]
    assert [s.name for s in contract.control_inputs] == [
        "control.start", "control.end", "control.ready", "control.corrid",
    ]  # fmt: skip
    assert [t["name"] for t in model_metadata(contract, NAME)["inputs"]] == ["obs"]
    with pytest.raises(ValueError, match="control inputs the node fills"):
        load_contract(accumulator(tmp_path / "bad", extra="control.bogus"))
    with pytest.raises(ValueError, match="uint64, int64 or string"):
        load_contract(accumulator(tmp_path / "f", corrid=TensorProto.FLOAT))


def test_corrid_of_episodes() -> None:
    assert corrid_of("kserve:i:77", "uint64") == 77
    assert corrid_of(None, "int64") == 0
    text = corrid_of("kserve:s:77", "uint64")
    assert text == corrid_of("kserve:s:77", "uint64") != corrid_of("kserve:s:78", "uint64")
    assert 0 <= corrid_of("kserve:i:18446744073709551615", "int64") < 1 << 63


# ---- three real nodes --------------------------------------------------------------------


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, list[str]]]:
    tmp = tmp_path_factory.mktemp("control")
    with grpc_nodes(tmp, "c", ["--model", str(accumulator(tmp / "model"))]) as three:
        yield three


@pytest.mark.integration
def test_kserve_http_and_grpc_sequences_equal_a_replay(three: tuple[Cluster, list[str]]) -> None:
    cluster, addresses = three
    rng = random.Random(3)
    http = [th.InferenceServerClient(f"{n.host}:{n.port}") for n in cluster.nodes]
    grpc = [tg.InferenceServerClient(a) for a in addresses]
    try:
        obs = steps(1, 8)
        got = []
        for i, o in enumerate(obs):
            tensor = th.InferInput("obs", [1, 2], "FP32").set_data_from_numpy(o)
            r = rng.choice(http).infer(NAME, [tensor], sequence_id=77, sequence_start=i == 0,
                                       sequence_end=i == len(obs) - 1)  # fmt: skip
            got.append({k: r.as_numpy(k) for k in ("total", "seen", "corrid")})
        check(got, replay(obs, 77))
        obs = steps(2, 8)
        got = []
        for i, o in enumerate(obs):
            tensor = tg.InferInput("obs", [1, 2], "FP32")
            tensor.set_data_from_numpy(o)
            r = rng.choice(grpc).infer(NAME, [tensor], sequence_id="g", sequence_start=i == 0,
                                       sequence_end=i == len(obs) - 1)  # fmt: skip
            got.append({k: r.as_numpy(k) for k in ("total", "seen", "corrid")})
        check(got, replay(obs, corrid_of("kserve:s:g", "uint64")))
        meta = http[0].get_model_metadata(NAME)
        assert [t["name"] for t in meta["inputs"]] == ["obs"]  # control inputs hidden
    finally:
        for c in http:
            c.close()
        for g in grpc:
            g.close()


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")
def test_act_and_openpi_episodes_equal_a_replay(three: tuple[Cluster, list[str]]) -> None:
    cluster, _ = three
    obs = steps(3, 6)
    got = []
    with httpx.Client(timeout=20) as client:
        for i, o in enumerate(obs):
            node = cluster.nodes[i % 3]
            r = client.post(f"{node.url}/act", json={
                "episode_id": "act-ep", "inputs": {"obs": o.tolist()}, "end": i == len(obs) - 1,
            })  # fmt: skip
            assert r.status_code == 200, r.text
            got.append(r.json()["outputs"])
        r = client.post(
            f"{cluster.nodes[0].url}/act",
            json={"inputs": {"control.start": [[1]], "obs": obs[0].tolist()}},
        )
        assert r.status_code == 422  # a client cannot send a control input
    check(got, replay(obs, corrid_of("act-ep", "uint64")))
    node = cluster.nodes[1]
    policy = WebsocketClientPolicy(f"ws://{node.host}:{node.port}/?episode_id=pi-ep")
    try:
        got = [policy.infer({"obs": o[0]}) for o in obs]
    finally:
        policy._ws.close()
    want = replay(obs, corrid_of("pi-ep", "uint64"))
    for step in want:  # an openpi connection does not end the episode on a step
        step["seen"][0, 1] = 0
    check(got, want)


# ---- the dispatcher: start after a reset, ready 0 on padding rows ------------------------


class Recording:
    """A session that runs only at batch size 4 (padded runs), records each run's control
    inputs and returns ``h' = h + obs``."""

    batch_sizes = (4,)

    def __init__(self, device: str) -> None:
        self.runs: list[dict[str, list[int]]] = []

    def run(self, names: Any, feed: Any) -> list[Any]:
        self.runs.append({k: feed[k][:, 0].tolist() for k in ("control.start", "control.ready")})
        h = feed["state_in.h"] + feed["obs"]
        return [h.copy(), h]


async def _steps() -> list[dict[str, list[int]]]:
    specs = [TensorSpec(n, ("b", 1), "float32") for n in ("obs", "state_in.h")]
    controls = [TensorSpec(n, ("b", 1), "int32") for n in ("control.start", "control.ready")]
    contract = PolicyContract(
        inputs=(*specs, *controls),
        outputs=(TensorSpec("act", ("b", 1), "float32"), TensorSpec("state_out.h", ("b", 1),
                                                                    "float32")),
        state={"state_in.h": "state_out.h"},
        batch_axis=True,
    )  # fmt: skip
    sessions: dict[str, Recording] = {}

    def factory(device: str) -> Recording:
        sessions[device] = Recording(device)
        return sessions[device]

    d = MultiGpuDispatcher(["n/0"], factory, contract)
    try:
        one = {"obs": np.ones((1, 1), np.float32)}

        def feed(episode: str) -> dict[str, Any]:
            return {**one, **control_feed(contract, episode, start=False, end=False)}

        await dispatch(d, "n/0", "e", 1, True, feed("e"))  # a fresh claim: start
        await dispatch(d, "n/0", "e", 1, False, feed("e"))  # its next step
        d.table.release("e", "end")  # the state is gone: the next step is a reset
        await dispatch(d, "n/0", "e", 1, False, feed("e"))
        return sessions["n/0"].runs
    finally:
        d.close()


def test_start_follows_resets_and_padding_rows_are_not_ready() -> None:
    runs = asyncio.run(_steps())
    assert [r["control.start"][0] for r in runs] == [1, 0, 1]
    assert all(r["control.ready"] == [1, 0, 0, 0] for r in runs)


# ---- a string corrid (Triton's sequence(string_id)) ---------------------------------------


def test_a_string_corrid_is_the_sequence_id_as_sent(tmp_path: Path) -> None:
    assert corrid_of("kserve:s:robot-7", "object") == "robot-7"
    assert corrid_of("kserve:i:7", "object") == "7"
    assert corrid_of("act-ep", "object") == "act-ep"
    assert corrid_of(None, "object") == ""
    contract = load_contract(accumulator(tmp_path, corrid=TensorProto.STRING))
    feed = control_feed(contract, "kserve:s:robot-7", start=True, end=False)
    assert feed["control.corrid"].dtype == object
    assert feed["control.corrid"].reshape(-1).tolist() == ["robot-7"]


@pytest.mark.integration
def test_a_string_corrid_model_over_kserve_http_and_grpc(tmp_path: Path) -> None:
    path = accumulator(tmp_path / "model", corrid=TensorProto.STRING)
    redis = RedisServer(tmp_path)
    port = free_port()
    node = Node(tmp_path, "sc", redis.url, devices="cpu:1",
                extra=["--model", str(path), "--grpc-port", str(port)])  # fmt: skip
    with running(redis, [node]):
        http = th.InferenceServerClient(f"{node.host}:{node.port}")
        grpc = tg.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            for client, kind, sequence in ((http, th, "robot-h"), (grpc, tg, "robot-g")):
                obs = steps(4, 3)
                got = []
                for i, o in enumerate(obs):
                    tensor = kind.InferInput("obs", [1, 2], "FP32")
                    tensor.set_data_from_numpy(o)
                    last = i == len(obs) - 1
                    r = client.infer(NAME, [tensor], sequence_id=sequence,
                                     sequence_start=i == 0, sequence_end=last)  # fmt: skip
                    got.append({k: r.as_numpy(k) for k in ("total", "seen", "corrid")})
                want = replay(obs, 0)
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_allclose(np.asarray(g["total"]).reshape(1, 2), w["total"])
                    np.testing.assert_array_equal(np.asarray(g["seen"]).reshape(1, 3), w["seen"])
                    assert [bytes(v) for v in g["corrid"].reshape(-1)] == [sequence.encode()]
        finally:
            http.close()
            grpc.close()
