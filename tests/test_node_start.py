"""Issue 36: what a new user meets starting ``affinity-node``, with real processes: a
model file ONNX Runtime cannot load, a model with string inputs (Triton's
``simple_string``), warm-up samples beside the model, a gRPC port in use or equal to the
HTTP one, and Redis not running. Each failure is one line with the documented exit code
(docs/configuration.md), and nothing else before it."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from node import startup, warmup
from node.catalog import ModelSpec
from node.contract import load_contract
from node.startup import StartupError
from tests.models import string_adder, string_corrid_sequence, unknown_control
from tests.procs import ROOT, Node, RedisServer, free_port, tmpdir
from tests.test_node_cli import assert_one_line, node

pytestmark = pytest.mark.integration

SECRET = {"AFFINITY_CLUSTER_SECRET": "s"}  # as the README's fleet sets it: no warning line


@pytest.fixture
def adder(tmp_path: Path) -> Path:
    return string_adder(tmp_path / "models")


def integers(*values: int) -> list[str]:
    """One step's 16 strings holding integers, as ``simple_string`` takes them."""
    return [str(v) for v in (list(values) * 16)[:16]]


def test_a_file_that_is_not_a_model_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Item 7: ``--model bad.onnx`` printed a 38-line traceback and exited 1."""
    bad = tmp_path / "bad.onnx"
    bad.write_text("not a model\n")
    out = node("--model", str(bad), "--devices", "cpu:1", "--port", str(free_port()))
    assert_one_line(out, f"--model {bad}: not a model ONNX Runtime can load")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(tmpdir()).start()
    yield server
    server.stop()


@pytest.mark.shapes  # string tensors cross the fronts' and the workers' hops by value
def test_a_string_model_without_samples_starts_unwarmed_and_serves(
    adder: Path, redis_server: RedisServer
) -> None:
    """Item 7: the warm-up fed made-up empty strings to a model that parses integers from
    them; ONNX Runtime's Cast failed and the node exited. Strings are never made up now:
    one info line says the model is not warmed up, and it serves real steps."""
    n = Node(tmpdir(), "strings", redis_server.url, devices="cpu:1",
             extra=["--model", str(adder)], env=SECRET).start()  # fmt: skip
    try:
        body = {"episode_id": "s-1", "inputs": {"INPUT0": [integers(1, 2)],
                                                 "INPUT1": [integers(3)]}}  # fmt: skip
        r = httpx.post(n.url + "/act", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"]["OUTPUT0"] == [integers(4, 5)]
        assert r.json()["outputs"]["OUTPUT1"] == [integers(-2, -1)]
        skipped = [line for line in n.proc.log().splitlines() if "not warmed up" in line]
        assert len(skipped) == 1 and "INFO" in skipped[0], n.proc.log()
        assert "INPUT0, INPUT1 are string inputs" in skipped[0]
        assert "simple_string.warmup.npz" in skipped[0] and "model simple_string" in skipped[0]
    finally:
        n.stop()


@pytest.mark.shapes  # string tensors cross the fronts' and the workers' hops by value
def test_warm_up_samples_beside_the_model_warm_it_up(
    adder: Path, redis_server: RedisServer
) -> None:
    """Item 7: the operator gives sample inputs (Triton's ``model_warmup``) in
    ``<model>.warmup.npz``; the node warms the model up with them."""
    np.savez(adder.with_name("simple_string.warmup.npz"),
             INPUT0=np.array([integers(1)]), INPUT1=np.array([integers(2)]))  # fmt: skip
    n = Node(tmpdir(), "samples", redis_server.url, devices="cpu:2",
             extra=["--model", str(adder)], env=SECRET).start()  # fmt: skip
    try:
        log = n.proc.log()
        assert "not warmed up" not in log
        assert "2 device(s) warmed up on their workers with simple_string@" in log, log
    finally:
        n.stop()


@pytest.mark.parametrize(
    ("samples", "words"),
    [
        (
            {"INPUT0": [integers(1)], "INPUT1": [["x"] * 16]},
            "--model simple_string: the warm-up run failed on the samples of {path}: "
            "RuntimeException",
        ),
        (
            {"INPUT0": [integers(1)]},
            "--model simple_string: warm-up samples: {path}: inputs.INPUT1: missing",
        ),
        (
            {"INPUT0": [integers(1)], "INPUT1": [integers(1)[:3]]},
            "--model simple_string: warm-up samples: {path}: inputs.INPUT1: has shape [1, 3]",
        ),
    ],
)
def test_a_warm_up_that_fails_is_one_line_naming_the_model_and_the_input(
    adder: Path, samples: dict[str, list[list[str]]], words: str
) -> None:
    """Item 7: a warm-up failure is one line naming the model and what it was fed, exit 2
    (it used to be a traceback and exit 1); samples that do not fit the model name the
    input, as a client's step would be told."""
    path = adder.with_name("simple_string.warmup.npz")
    np.savez(path, **{name: np.array(value) for name, value in samples.items()})
    out = node("--model", str(adder), "--devices", "cpu:1", "--port", str(free_port()))
    assert_one_line(out, words.format(path=path))


def test_a_grpc_port_another_node_serves_on_is_exit_6_not_shared(
    redis_server: RedisServer,
) -> None:
    """Item 6: gRPC binds with SO_REUSEPORT, so a second node on the same --grpc-port
    started too and the two split new connections; the port is now held exclusively
    until gRPC takes it over, and the second node stops with one line, exit 6."""
    grpc_port = free_port()
    first = Node(tmpdir(), "grpc-a", redis_server.url, devices="cpu:1", env=SECRET,
                 extra=["--grpc-port", str(grpc_port)]).start()  # fmt: skip
    try:
        out = node("--devices", "cpu:1", "--port", str(free_port()),
                   "--grpc-port", str(grpc_port), "--node-id", "grpc-b", timeout=60)  # fmt: skip
        assert_one_line(out, f"cannot listen on 127.0.0.1:{grpc_port} (--grpc-port)", code=6)
        with socket.create_connection(("127.0.0.1", grpc_port), timeout=5):
            pass  # the first node still serves it
        assert first.ready()
    finally:
        first.stop()


def test_a_grpc_port_equal_to_the_http_port_is_a_usage_error() -> None:
    port = str(free_port())
    out = node("--devices", "cpu:1", "--port", port, "--grpc-port", port, timeout=60)
    assert_one_line(out, f"--grpc-port {port}: must differ from --port")


def test_redis_not_running_is_one_line_saying_connection_refused_with_the_url() -> None:
    """Item 8: Redis not running was reported as "all 4 Redis connections of this process
    stayed busy (overloaded; Redis itself was not asked)", after two INFO lines; the
    cause was a refused connection. Item 14: a node that cannot start prints its one
    error line and nothing before it."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    out = node("--redis", url, "--devices", "cpu:1", "--port", str(free_port()), env=SECRET)
    assert_one_line(out, f"cannot reach Redis at {url} (--redis): connection refused", code=3)
    assert "busy" not in out.stderr


def test_the_cli_says_connection_refused_with_the_url_in_one_line() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    out = subprocess.run(
        [sys.executable, "-m", "affinity.cli", "--redis", url, "devices"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 3, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"affinity: cannot reach Redis at {url}: connection refused")
    assert "busy" not in lines[0]


def test_a_model_error_names_the_model_path_once(tmp_path: Path) -> None:
    """Issue 42 item 13: ``--model`` naming no file said the path twice; a model whose
    own checks fail (no sidecar: they name the model file) said it twice too."""
    missing = tmp_path / "nope.onnx"
    out = node("--model", str(missing), "--devices", "cpu:1", "--port", str(free_port()))
    assert_one_line(out, f"--model {str(missing)!r}: not a packaged model")
    assert out.stderr.count(str(missing)) == 1, out.stderr

    model = unknown_control(tmp_path / "bad_control.onnx")
    out = node("--model", str(model), "--devices", "cpu:1", "--port", str(free_port()))
    assert_one_line(out, f"--model {model}: ")
    assert out.stderr.count(str(model)) == 1, out.stderr


def test_a_string_correlation_id_model_warms_up_and_steps(redis_server: RedisServer) -> None:
    """Issue 42 item 15: Triton's ``simple_string_dyna_sequence`` (a STRING
    ``control.corrid`` the model casts to a number) could not start: the warm-up fed the
    id an empty string and the cast failed, and the error named ``INPUT``. The warm-up
    feeds the id as a real step of KServe sequence id 0 does (``"0"``); it starts warmed
    up and serves an episode whose id is its correlation id."""
    model = string_corrid_sequence(tmpdir() / "models")
    n = Node(tmpdir(), "corrid", redis_server.url, devices="cpu:1",
             extra=["--model", str(model)], env=SECRET).start()  # fmt: skip
    try:
        log = n.proc.log()
        assert "1 device(s) warmed up on their workers with simple_string_dyna_sequence@" in log
        outputs = []
        for value in (5, 7):
            body = {"episode_id": "1000", "inputs": {"INPUT": [[value]]}}
            r = httpx.post(n.url + "/act", json=body, timeout=30)
            assert r.status_code == 200, r.text
            outputs.append(r.json()["outputs"]["OUTPUT"])
        assert outputs == [[[1005]], [[1012]]]  # the running sum plus the id
    finally:
        n.stop()


@pytest.mark.anyio
async def test_a_warm_up_failing_names_the_control_inputs_the_node_fed(tmp_path: Path) -> None:
    """Issue 42 item 15: a failed warm-up named only the inputs fed zeros ("failed on zeros
    for INPUT") while the run failed on the correlation id the node itself had fed: the
    node's control inputs are named too, with their values."""
    path = string_corrid_sequence(tmp_path / "models")
    contract = load_contract(path)

    class Failing:
        async def warm_up(self) -> None:
            raise RuntimeError("Cast failed")

    with pytest.raises(StartupError) as failed:
        await startup._warm_up("seq", ModelSpec(path, "seq", None), contract, Failing())  # type: ignore[arg-type]
    assert str(failed.value) == (
        "--model seq: the warm-up run failed on zeros for INPUT (no sample; give one in "
        f"{warmup.samples_path(path)}) and the node's control inputs control.corrid='0': "
        "RuntimeError: Cast failed (docs/policies.md#warm-up)"
    )
