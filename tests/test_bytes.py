"""BYTES tensors (a model's string inputs and outputs) in and out of three real nodes:
``tritonclient.http`` with binary and JSON tensors, ``tritonclient.grpc``, and JSON
``/act``, through random entry nodes (so forwards carry strings between nodes too)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from onnx import TensorProto, helper

from node.models._build import Weights, model, tensor, write
from tests.test_cluster import Cluster, grpc_nodes

NAME = "echo"
PROMPTS = ["pick up the red cube", "", "é ✓ 中文", "x" * 1000]


def echo_policy(out_dir: Path) -> Path:
    """``echo`` = the ``prompt`` string, ``doubled`` = ``2 * obs``; a recurrent ``count``
    so the episode's steps are sticky."""
    w = Weights(seed=2)
    nodes = [
        helper.make_node("Identity", ["prompt"], ["echo"]),
        helper.make_node("Add", ["obs", "obs"], ["doubled"]),
        helper.make_node("Add", ["state_in.count", w.constant("one", np.ones((1, 1), "f4"))],
                         ["state_out.count"]),
        helper.make_node("Identity", ["state_out.count"], ["count"]),
    ]  # fmt: skip
    inputs = [
        tensor("prompt", TensorProto.STRING, 1),
        tensor("obs", TensorProto.FLOAT, 2),
        tensor("state_in.count", TensorProto.FLOAT, 1),
    ]
    outputs = [
        tensor("echo", TensorProto.STRING, 1),
        tensor("doubled", TensorProto.FLOAT, 2),
        tensor("state_out.count", TensorProto.FLOAT, 1),
        tensor("count", TensorProto.FLOAT, 1),
    ]
    path, _ = write(out_dir, f"{NAME}.onnx", model(NAME, nodes, inputs, outputs, w, "tests"), {})
    return path


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, list[str]]]:
    tmp = tmp_path_factory.mktemp("bytes")
    with grpc_nodes(tmp, "b", ["--model", str(echo_policy(tmp / "model"))]) as three:
        yield three


def prompt(text: str) -> np.ndarray:
    value = np.empty((1, 1), dtype=object)
    value[0, 0] = text.encode()
    return value


@pytest.mark.integration
def test_bytes_round_trip_over_http_binary_and_json(three: tuple[Cluster, list[str]]) -> None:
    cluster, _ = three
    clients = [th.InferenceServerClient(f"{n.host}:{n.port}") for n in cluster.nodes]
    rng = random.Random(1)
    obs = np.array([[0.5, -1.0]], np.float32)
    try:
        meta = clients[0].get_model_metadata(NAME)
        assert {t["name"]: t["datatype"] for t in meta["inputs"]} == {"prompt": "BYTES",
                                                                       "obs": "FP32"}  # fmt: skip
        for i, text in enumerate(PROMPTS * 2):
            binary = i % 2 == 0
            inputs = [
                th.InferInput("prompt", [1, 1], "BYTES").set_data_from_numpy(
                    prompt(text), binary_data=binary
                ),
                th.InferInput("obs", [1, 2], "FP32").set_data_from_numpy(obs, binary_data=binary),
            ]
            outputs = [th.InferRequestedOutput(n, binary_data=not binary)
                       for n in ("echo", "doubled", "count")]  # fmt: skip
            r = rng.choice(clients).infer(NAME, inputs, outputs=outputs, sequence_id="bytes-h",
                                          sequence_start=i == 0)  # fmt: skip
            echo = r.as_numpy("echo")
            got = echo[0, 0] if isinstance(echo[0, 0], bytes) else str(echo[0, 0]).encode()
            assert got == text.encode()
            np.testing.assert_array_equal(r.as_numpy("doubled"), obs * 2)
            assert float(r.as_numpy("count")[0, 0]) == i + 1  # one episode, state kept
    finally:
        for c in clients:
            c.close()


@pytest.mark.integration
def test_bytes_round_trip_over_grpc_and_act(three: tuple[Cluster, list[str]]) -> None:
    cluster, addresses = three
    clients = [tg.InferenceServerClient(a) for a in addresses]
    rng = random.Random(2)
    obs = np.array([[1.0, 2.0]], np.float32)
    try:
        for i, text in enumerate(PROMPTS):
            words = tg.InferInput("prompt", [1, 1], "BYTES")
            words.set_data_from_numpy(prompt(text))
            numbers = tg.InferInput("obs", [1, 2], "FP32")
            numbers.set_data_from_numpy(obs)
            r = rng.choice(clients).infer(NAME, [words, numbers], sequence_id=5,
                                          sequence_start=i == 0)  # fmt: skip
            assert r.as_numpy("echo")[0, 0] == text.encode()
            assert float(r.as_numpy("count")[0, 0]) == i + 1
    finally:
        for c in clients:
            c.close()
    with httpx.Client(timeout=20) as http:
        for i, text in enumerate(PROMPTS):
            node = cluster.nodes[i % 3]
            r = http.post(f"{node.url}/act", json={
                "episode_id": "bytes-act", "inputs": {"prompt": [[text]], "obs": obs.tolist()},
            })  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["outputs"]["echo"] == [[text]]
        r = http.post(f"{cluster.nodes[0].url}/act",
                      json={"inputs": {"prompt": [[3]], "obs": obs.tolist()}})  # fmt: skip
        assert r.status_code == 422 and "must be a string" in r.text
