"""KServe v2 over gRPC through a node with ``--front-doors 2`` (issue 43), real processes:
``ModelInfer`` and ``ModelStreamInfer`` are decoded in the fronts (each a ``grpc.aio``
server on the gRPC port with ``SO_REUSEPORT``), the step crosses the shared-memory hop to
the node's process (the core), which has no handler for them any more; every other RPC is
passed to the core's own gRPC server as bytes. The unmodified ``tritonclient.grpc`` keeps
its sequences sticky; every answer, errors included, is what a node of one process says;
a front killed mid-step costs only its call (a retry with ``seq`` gets the kept reply), a
cancelled call has its step undone; the gRPC port in use still exits 6, and ``kill -9``
of the core frees both ports at once."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from node.models import DEMO_MODEL
from node.protocols.kserve.pb import kserve_pb2 as pb
from tests.models import counter_policy
from tests.procs import (
    Node,
    RedisServer,
    free_port,
    handing_over,
    held_mid_step,
    listening,
    on_the_hop,
    wait_until,
)
from tests.rollout import reference_rollout
from tests.test_fronts_kserve_procs import counter_delta, rejected
from tests.test_fronts_procs import alive, embedded, fronts
from tests.test_kserve import MODEL, observations

pytestmark = pytest.mark.integration

KEY = "k-fronts"
HEADERS = {"authorization": f"Api-Key {KEY}"}
SERVICE = "/inference.GRPCInferenceService/"


class Pair:
    """A node of two fronts and a node of one process, each alone in its own fleet, both
    serving gRPC (``grpc`` holds their addresses)."""

    def __init__(self, fronted: Node, single: Node, grpc: list[str]) -> None:
        self.fronted = fronted
        self.single = single
        self.grpc = grpc


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp: Path = tmp_path_factory.mktemp("fronts-grpc")
    for k in range(2):
        (tmp / f"r{k}").mkdir()
        (tmp / f"n{k}").mkdir()
    redis = [RedisServer(tmp / f"r{k}").start() for k in range(2)]
    ports = [free_port() for _ in range(2)]
    common = ["--api-key", KEY]
    fronted = Node(tmp / "n0", "gf", redis[0].url, devices="cpu:1",
                   extra=[*common, "--front-doors", "2", "--grpc-port", str(ports[0])])  # fmt: skip
    single = Node(tmp / "n1", "gs", redis[1].url, devices="cpu:1",
                  extra=[*common, "--grpc-port", str(ports[1])])  # fmt: skip
    try:
        fronted.start(timeout=60)
        single.start(timeout=60)
        wait_until(lambda: len(fronts(fronted)) == 2, 30, "two fronts")
        grpc_up(fronted, ports[0])
        yield Pair(fronted, single, [f"127.0.0.1:{p}" for p in ports])
    finally:
        fronted.stop()
        single.stop()
        for r in redis:
            r.stop()


def grpc_up(node: Node, port: int) -> None:
    """Wait until both fronts listen on the gRPC port (each binds it once started)."""
    wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
    wait_until(lambda: all(listening(p, port) for p in fronts(node)), 30, "gRPC in both fronts")


def grpc_input(obs: np.ndarray) -> tg.InferInput:
    tensor = tg.InferInput("obs", list(obs.shape), "FP32")
    return tensor.set_data_from_numpy(obs)


def facts(result: tg.InferResult) -> dict[str, Any]:
    params = result.get_response().parameters
    return {key: getattr(p, p.WhichOneof("parameter_choice")) for key, p in params.items()}


def count(result: tg.InferResult) -> int:
    return int(result.as_numpy("count").reshape(-1)[0])


def core_grpc_name(node: Node) -> str:
    """The abstract Unix name of the core's own gRPC server (``/proc/net/unix``)."""
    assert node.proc.popen is not None
    prefix = f"@affinity-grpc-{node.proc.popen.pid}-"
    with open("/proc/net/unix") as f:
        names = {line.split()[-1] for line in f if len(line.split()) >= 8}
    (name,) = [n for n in names if n.startswith(prefix)]
    return name[1:]


def test_a_front_decodes_grpc_without_the_node_s_heavy_modules() -> None:
    """What a front imports to serve gRPC (its fork server loads it before it forks one)
    loads neither ONNX Runtime, FastAPI nor the node's service."""
    heavy = ("onnxruntime", "fastapi", "starlette", "node.service",
             "node.protocols.kserve.request", "node.protocols.kserve.grpc")  # fmt: skip
    code = (
        "import sys; from node.forkserver import _preload; _preload(grpc=True);"
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=root, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
    assert "grpc" in subprocess.run(
        [sys.executable, "-c", "import sys, node.protocols.kserve.grpc_front; print(*sys.modules)"],
        capture_output=True, text=True, timeout=60, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    ).stdout.split()  # fmt: skip


def test_a_held_grpc_reply_weighs_its_encoded_bytes() -> None:
    """What a gRPC reply parked with a slow client keeps in its front counts against the
    front's budget as its encoded size (its raw tensors included); a refusal weighs
    nothing (it is settled at once)."""
    from node.protocols.kserve.grpc_front import _size
    from node.protocols.kserve.messages import Abort

    reply = pb.ModelInferResponse(model_name="m", raw_output_contents=[b"x" * 300_000])
    assert 300_000 < _size(reply) == reply.ByteSize() < 300_100
    assert _size(Abort(grpc.StatusCode.UNAVAILABLE, "busy")) == 0

    import asyncio

    from node.protocols.kserve.grpc_front import FrontServicer

    asked: dict[str, Any] = {}

    class Hop:  # the front's call: it must say how to weigh the reply it holds
        async def call(self, *args: Any, **kwargs: Any) -> Any:
            asked.update(kwargs)
            return reply, lambda delivered: None

    class Context:
        cancelled = staticmethod(lambda: False)
        time_remaining = staticmethod(lambda: None)

    class Access:
        enabled = False

    hop: Any = Hop()
    access: Any = Access()
    servicer = FrontServicer(hop, None, access, 64, lambda _: True, None)  # type: ignore[arg-type]
    ask = pb.ModelInferRequest(model_name="m")
    asyncio.run(servicer.infer(ask, Context(), "ModelInfer", lambda settle: None))
    assert asked["hold"] and asked.get("size") is _size


def test_sequences_stick_and_the_core_never_decodes_an_infer(pair: Pair) -> None:
    """int and string sequence ids, a new channel a step (either front takes it): the
    steps stick to one device, equal a replay, end with ``sequence_end``; and the core's
    own gRPC server answers ``ModelInfer`` UNIMPLEMENTED while it answers the rest."""
    address = pair.grpc[0]
    for n, sequence in enumerate((17, "seventeen")):
        obs = observations(400 + n, 10)
        ref = reference_rollout(DEMO_MODEL, obs)
        got = []
        for i, o in enumerate(obs):
            client = tg.InferenceServerClient(address)
            try:
                res = client.infer(MODEL, [grpc_input(o)], sequence_id=sequence,
                                   sequence_start=i == 0, headers=HEADERS)  # fmt: skip
            finally:
                client.close()
            np.testing.assert_allclose(res.as_numpy("actions"), ref[i]["actions"],
                                       rtol=1e-4, atol=1e-6)  # fmt: skip
            got.append(facts(res))
        episode = "kserve:i:17" if sequence == 17 else "kserve:s:seventeen"
        assert {f["episode_id"] for f in got} == {episode}
        assert len({f["device"] for f in got}) == 1
        assert [f["routing"] for f in got] == ["claimed"] + ["hit"] * 9
        client = tg.InferenceServerClient(address)
        try:
            client.infer(MODEL, [grpc_input(obs[0])], sequence_id=sequence, sequence_end=True,
                         headers=HEADERS)  # fmt: skip
            with pytest.raises(InferenceServerException, match="START flag") as err:
                client.infer(MODEL, [grpc_input(obs[0])], sequence_id=sequence, headers=HEADERS)
            assert err.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        finally:
            client.close()
    # the core: no handler for the infer RPCs (the fronts decoded every one above)
    with grpc.insecure_channel(f"unix-abstract:{core_grpc_name(pair.fronted)}") as channel:
        live = channel.unary_unary(SERVICE + "ServerLive")(
            pb.ServerLiveRequest().SerializeToString(), timeout=10
        )
        assert pb.ServerLiveResponse.FromString(live).live
        msg = pb.ModelInferRequest(model_name=MODEL)
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(SERVICE + "ModelInfer")(
                msg.SerializeToString(), metadata=tuple(HEADERS.items()), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def call(address: str, method: str, request: bytes, key: bool = True) -> tuple[Any, ...]:
    """One unary call as raw bytes: ("OK", the reply's bytes) or (code, details,
    retry-after)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = channel.unary_unary(SERVICE + method if "/" not in method else method)(
                request, metadata=tuple(HEADERS.items()) if key else (), timeout=30
            )
        except grpc.RpcError as exc:
            trailing = dict(exc.trailing_metadata() or ())
            return exc.code(), exc.details(), trailing.get("retry-after")
        return "OK", reply


def infer_message(shape: list[int], **params: Any) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=params.pop("model", MODEL),
                               model_version=params.pop("version", ""))  # fmt: skip
    msg.inputs.add(name="obs", datatype=params.pop("datatype", "FP32"), shape=shape)
    raw = params.pop("raw", np.zeros(shape, np.float32).tobytes())
    if raw is not None:
        msg.raw_input_contents.append(raw)
    for key, value in params.items():
        p = msg.parameters[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            p.int64_param = value
        else:
            p.string_param = value
    return msg


def test_errors_are_those_of_one_process(pair: Pair) -> None:
    """The same calls to both nodes: the same status codes and messages (and retry-after),
    counted alike; and the RPCs passed to the core answer byte for byte alike."""
    typed = infer_message([1, 8], raw=None)
    typed.inputs[0].contents.fp32_contents.extend([0.0] * 7)  # 7 values for 8
    both = infer_message([1, 8])
    both.inputs[0].contents.fp32_contents.extend([0.0] * 8)
    fp16 = infer_message([1, 8], raw=None, datatype="FP16")
    unwanted = infer_message([1, 8])
    unwanted.outputs.add(name="no")
    cases: list[tuple[str, bytes, bool]] = [
        ("ModelInfer", infer_message([1, 8]).SerializeToString(), False),  # no key
        ("ModelInfer", infer_message([1, 8], model="other").SerializeToString(), True),
        (
            "ModelInfer",
            infer_message([1, 8], model="other", datatype="FP99").SerializeToString(),
            True,
        ),
        ("ModelInfer", infer_message([1, 8], version="3").SerializeToString(), True),
        ("ModelInfer", infer_message([1, 5]).SerializeToString(), True),  # bad shape
        ("ModelInfer", infer_message([1, 8], sequence_id=123).SerializeToString(), True),
        ("ModelInfer", infer_message([1, 8], raw=b"\0" * 7).SerializeToString(), True),
        ("ModelInfer", typed.SerializeToString(), True),
        ("ModelInfer", both.SerializeToString(), True),
        ("ModelInfer", fp16.SerializeToString(), True),
        ("ModelInfer", unwanted.SerializeToString(), True),
        ("ModelInfer", infer_message([1, 8], datatype="FP99").SerializeToString(), True),
        ("ModelInfer", infer_message([1, 8], seq=-1).SerializeToString(), True),
        ("ModelInfer", infer_message([1, 8], sequence_start=True).SerializeToString(), True),
        ("ModelInfer", infer_message([1, 8], sequence_id="a\nb").SerializeToString(), True),
        (
            "ModelInfer",
            infer_message(
                [2, 8], episode_ids=json.dumps(["r-1", 0]), sequence_start=True
            ).SerializeToString(),
            True,
        ),
        ("ModelInfer", infer_message([2, 8], episode_ids="[1, 1]").SerializeToString(), True),
        (
            "ModelInfer",
            infer_message([1, 8], episode_ids=json.dumps(list(range(1, 300)))).SerializeToString(),
            True,
        ),
        ("ModelInfer", b"\xff\xff", True),  # not a message: grpc's own answer
        ("ServerLive", pb.ServerLiveRequest().SerializeToString(), False),
        ("ServerReady", pb.ServerReadyRequest().SerializeToString(), True),
        ("ServerMetadata", pb.ServerMetadataRequest().SerializeToString(), True),
        ("ModelReady", pb.ModelReadyRequest(name=MODEL).SerializeToString(), True),
        ("ModelReady", pb.ModelReadyRequest(name="other").SerializeToString(), True),
        ("ModelMetadata", pb.ModelMetadataRequest(name=MODEL).SerializeToString(), True),
        ("ModelMetadata", pb.ModelMetadataRequest(name="other").SerializeToString(), True),
        ("ModelConfig", pb.ModelConfigRequest(name=MODEL).SerializeToString(), True),
        (
            "ModelConfig",
            pb.ModelConfigRequest(name=MODEL, version="9").SerializeToString(),
            True,
        ),
        ("ModelStatistics", pb.ModelStatisticsRequest(name="other").SerializeToString(), True),
        ("RepositoryIndex", b"", True),  # not the node's: UNIMPLEMENTED
        ("/other.Service/Nothing", b"", True),
    ]
    before = {n: rejected(n) for n in (pair.fronted, pair.single)}
    got = [[call(address, m, r, k) for m, r, k in cases] for address in pair.grpc]
    for (method, request, _), a, b in zip(cases, got[0], got[1], strict=True):
        assert a == b, (method, request[:80], a, b)
    codes = [a[0] for a in got[0]]
    assert codes[:5] == [grpc.StatusCode.UNAUTHENTICATED] + [grpc.StatusCode.NOT_FOUND] * 3 + [
        grpc.StatusCode.INVALID_ARGUMENT
    ]
    assert grpc.StatusCode.ABORTED in codes  # too many rows (413)
    counted = {n: counter_delta(before[n], rejected(n)) for n in (pair.fronted, pair.single)}
    assert counted[pair.fronted] == counted[pair.single] != {}, counted


def test_replies_equal_one_process(pair: Pair) -> None:
    """Stateless steps (raw and typed contents, an id, named outputs, the timing split)
    and a request of rows: the same outputs and parameters, less the node's own names and
    times."""
    obs = observations(500, 1)[0]
    typed = infer_message([1, 8], raw=None)
    typed.inputs[0].contents.fp32_contents.extend(obs.reshape(-1).tolist())
    named = infer_message([1, 8], raw=obs.tobytes(), timing=True)
    named.id = "r7"
    named.outputs.add(name="actions")
    rows = infer_message([2, 8], raw=np.concatenate([obs, obs]).tobytes(),
                         episode_ids=json.dumps(["ra", "rb"]), sequence_start=True)  # fmt: skip
    requests = [infer_message([1, 8], raw=obs.tobytes()), typed, named, rows]
    replies = [
        [call(address, "ModelInfer", r.SerializeToString()) for r in requests]
        for address in pair.grpc
    ]
    for a, b in zip(*replies, strict=True):
        assert a[0] == b[0] == "OK", (a, b)
        r1, r2 = pb.ModelInferResponse.FromString(a[1]), pb.ModelInferResponse.FromString(b[1])
        assert (r1.model_name, r1.model_version, r1.id) == (r2.model_name, r2.model_version, r2.id)
        assert [(o.name, o.datatype, list(o.shape)) for o in r1.outputs] == [
            (o.name, o.datatype, list(o.shape)) for o in r2.outputs
        ]
        for x, y in zip(r1.raw_output_contents, r2.raw_output_contents, strict=True):
            np.testing.assert_allclose(np.frombuffer(x, np.float32), np.frombuffer(y, np.float32),
                                       rtol=1e-6)  # fmt: skip
        assert set(r1.parameters) == set(r2.parameters), (r1.parameters, r2.parameters)
        if "rows" in r1.parameters:
            p1, p2 = (json.loads(r.parameters["rows"].string_param) for r in (r1, r2))
            assert [sorted(r) for r in p1] == [sorted(r) for r in p2]
    assert pb.ModelInferResponse.FromString(replies[0][2][1]).id == "r7"


def stream(address: str, requests: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    """Each request's answer on one ``tritonclient`` stream: (result, error)."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tg.InferenceServerClient(address)
    client.start_stream(
        callback=lambda result, error: answers.put((result, error)), headers=HEADERS
    )
    try:
        for kw in requests:
            client.async_stream_infer(MODEL, **kw)
        return [answers.get(timeout=30) for _ in requests]
    finally:
        client.stop_stream()
        client.close()


def test_a_stream_through_a_front_equals_a_replay_and_its_errors_one_process(pair: Pair) -> None:
    obs = observations(600, 6)
    ref = reference_rollout(DEMO_MODEL, obs)
    bad = tg.InferInput("obs", [1, 5], "FP32").set_data_from_numpy(np.zeros((1, 5), "f4"))
    requests: list[dict[str, Any]] = []
    for i, o in enumerate(obs):
        requests.append({"inputs": [grpc_input(o)], "sequence_id": 61, "sequence_start": i == 0})
        if i == 2:  # an error answers that request; the stream goes on
            requests.append({"inputs": [bad], "sequence_id": 61})
    got = [stream(address, requests) for address in pair.grpc]
    for answers in got:
        results = [r for r, e in answers if e is None]
        for r, want in zip(results, ref, strict=True):
            np.testing.assert_allclose(r.as_numpy("actions"), want["actions"],
                                       rtol=1e-4, atol=1e-6)  # fmt: skip
        assert [f["routing"] for f in map(facts, results)] == ["claimed"] + ["hit"] * 5
    errors = [[str(e) for _, e in answers if e is not None] for answers in got]
    assert len(errors[0]) == 1 and errors[0] == errors[1], errors


def test_a_front_killed_mid_step_costs_its_call_only(tmp_path: Path) -> None:
    """The front holding a tritonclient's channel is killed while the core runs the step
    (a slow model): the retry with the same ``seq`` parameter, through another front, gets
    the kept reply; the step counted once. Then a call cancelled mid-step (its front
    alive) has its step undone: the next step counts as if it never came."""
    grpc_port = free_port()
    node = embedded(tmp_path, "gk", model=counter_policy(tmp_path, repeats=400, width=512))
    node.proc.argv += ["--grpc-port", str(grpc_port)]
    address = f"127.0.0.1:{grpc_port}"
    node.start(timeout=60)
    try:
        grpc_up(node, grpc_port)
        zeros = np.zeros((1, 8), np.float32)
        (model,) = [m["name"] for m in httpx.get(node.url + "/v2/models").json()["models"]]

        def step(seq: int | None, **kw: Any) -> tg.InferResult:
            client = tg.InferenceServerClient(address)
            try:
                params = {} if seq is None else {"seq": seq}
                return client.infer(model, [grpc_input(zeros)], sequence_id="slow",
                                    parameters=params, client_timeout=60, **kw)  # fmt: skip
            finally:
                client.close()

        assert count(step(1, sequence_start=True)) == 1
        lost: list[InferenceServerException] = []

        def second() -> None:
            try:
                step(2)
            except InferenceServerException as exc:  # the call went with its front
                lost.append(exc)

        sender = threading.Thread(target=second)
        sender.start()
        with held_mid_step(lambda: fronts(node), grpc_port, node.pid()) as holder:
            assert sender.is_alive(), "the step was answered before its front could be killed"
            os.kill(holder, signal.SIGKILL)  # the core paused: the step still runs
        sender.join(60)
        assert lost and lost[0].status() == str(grpc.StatusCode.UNAVAILABLE), lost
        for _ in range(100):
            try:
                retry = step(2)
                break
            except InferenceServerException as exc:  # still running: busy
                assert exc.status() == str(grpc.StatusCode.UNAVAILABLE), exc
                time.sleep(0.1)
        got = facts(retry)
        assert got["replayed"] and count(retry) == 2 and not got["state_reset"], got
        assert count(step(3)) == 3
        # a call cancelled mid-step, its front alive: the step is undone
        client = tg.InferenceServerClient(address)
        done: queue.Queue[Any] = queue.Queue()
        try:
            pending = client.async_infer(
                model,
                [grpc_input(zeros)],
                lambda result, error: done.put((result, error)),
                sequence_id="slow",
            )
            with held_mid_step(lambda: fronts(node), grpc_port, node.pid()):
                pending.cancel()  # while the core runs its step
                result, error = done.get(timeout=30)
            assert result is None and error is not None
            # a stateless step behind it on the one device: done once that run ended (and
            # the front, told of the answer, had it undone)
            client.infer(model, [grpc_input(zeros)], client_timeout=60)
        finally:
            client.close()
        # the core answers the front's word once it has undone the step: the slot frees
        wait_until(lambda: not any(on_the_hop(f) for f in fronts(node)), 60, "the undo")
        fourth = step(None)
        assert count(fourth) == 4 and not facts(fourth)["state_reset"]
    finally:
        node.stop()


def test_the_grpc_port_in_use_exits_6(tmp_path: Path) -> None:
    """A gRPC port another process listens on, and one a node with fronts serves (its
    fronts listen with ``SO_REUSEPORT``, its core holds it): the next node exits 6 with its
    one line, and the first still answers."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        node = embedded(tmp_path, "gu")
        node.proc.argv += ["--grpc-port", str(holder.getsockname()[1])]
        node.proc.start()
        assert node.proc.popen is not None
        assert node.proc.popen.wait(60) == 6, node.proc.log()
        assert "(--grpc-port)" in node.proc.log()
    finally:
        holder.close()
    grpc_port = free_port()
    first = embedded(tmp_path, "gv")
    first.proc.argv += ["--grpc-port", str(grpc_port)]
    first.start(timeout=60)
    try:
        grpc_up(first, grpc_port)
        second = embedded(tmp_path, "gw")
        second.proc.argv += ["--grpc-port", str(grpc_port)]
        second.proc.start()
        assert second.proc.popen is not None
        assert second.proc.popen.wait(60) == 6, second.proc.log()
        assert f"cannot listen on 127.0.0.1:{grpc_port} (--grpc-port)" in second.proc.log()
        client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            assert client.is_server_live()
        finally:
            client.close()
    finally:
        first.stop()


def test_kill_9_of_the_core_leaves_no_front_and_frees_both_ports(tmp_path: Path) -> None:
    grpc_port = free_port()
    node = embedded(tmp_path, "g9")
    node.proc.argv += ["--grpc-port", str(grpc_port)]
    node.start(timeout=60)
    grpc_up(node, grpc_port)
    pids = fronts(node)
    assert node.proc.popen is not None
    assert not listening(node.proc.popen.pid, grpc_port)  # the core holds it, not listening
    client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        assert client.is_server_live()
    finally:
        client.close()
    node.stop(signal.SIGKILL)
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the fronts gone")
    again = embedded(tmp_path, "g9b", node.port)
    again.proc.argv += ["--grpc-port", str(grpc_port)]
    try:
        again.start(timeout=60)  # binds both ports: nothing holds them
        grpc_up(again, grpc_port)
        client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            res = client.infer(MODEL, [grpc_input(np.zeros((1, 8), np.float32))])
            assert res.as_numpy("actions") is not None
        finally:
            client.close()
    finally:
        again.stop()


def test_sigterm_stops_the_fronts_grpc_servers_and_exits_0(tmp_path: Path) -> None:
    """A graceful stop with gRPC in the fronts (after a stream through one): the fronts'
    gRPC servers stop with them, the node exits 0 once it left, and no front stays."""
    grpc_port = free_port()
    node = embedded(tmp_path, "gt")
    node.proc.argv += ["--grpc-port", str(grpc_port)]
    node.start(timeout=60)
    grpc_up(node, grpc_port)
    pids = fronts(node)
    obs = observations(700, 3)
    answers = stream(f"127.0.0.1:{grpc_port}", [
        {"inputs": [grpc_input(o)], "sequence_id": 71, "sequence_start": i == 0}
        for i, o in enumerate(obs)
    ])  # fmt: skip
    assert all(e is None for _, e in answers), answers
    assert node.proc.popen is not None
    node.proc.popen.send_signal(signal.SIGTERM)
    assert node.proc.popen.wait(30) == 0, node.proc.log()
    assert "left: moved" in node.proc.log()
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the fronts gone")


CLIENT = """
import sys
import numpy as np
import tritonclient.grpc as tg
address, model = sys.argv[1:3]
tensor = tg.InferInput("obs", [1, 8], "FP32").set_data_from_numpy(np.zeros((1, 8), np.float32))
client = tg.InferenceServerClient(address)
client.infer(model, [tensor], sequence_id="gd", client_timeout=120)
"""
"""One call in a process of its own (stopped while gRPC sends it its reply)."""


def test_a_front_dead_while_grpc_sends_a_reply_leaves_that_step_in_doubt(tmp_path: Path) -> None:
    """gRPC hides when a reply reaches the kernel, so a front holds a call's slot until
    the call is done. A client stopped before its 12 MB reply arrives: gRPC cannot send it
    (flow control), the slot says DELIVERING. The front is killed then: the episode's next
    step starts clean and says ``state_reset`` (or, overtaking the core's notice of the
    death, the one after does). (Before, the slot was freed as the reply was handed to
    gRPC: the step stood, its reply gone with the process.)"""
    grpc_port = free_port()
    slow_and_wide = counter_policy(tmp_path, repeats=400, width=512, wide=3 << 20)
    node = embedded(tmp_path, "gd", model=slow_and_wide)
    node.proc.argv += ["--grpc-port", str(grpc_port)]
    address = f"127.0.0.1:{grpc_port}"
    node.start(timeout=60)
    client: subprocess.Popen[bytes] | None = None
    try:
        grpc_up(node, grpc_port)
        (model,) = [m["name"] for m in httpx.get(node.url + "/v2/models").json()["models"]]

        def step(**kw: Any) -> tg.InferResult:
            one = tg.InferenceServerClient(address)
            try:
                return one.infer(model, [grpc_input(np.zeros((1, 8), np.float32))],
                                 sequence_id="gd", client_timeout=120, **kw)  # fmt: skip
            finally:
                one.close()

        assert count(step(sequence_start=True)) == 1
        wait_until(lambda: handing_over(lambda: fronts(node)) is None, 30, "the reply sent")
        client = subprocess.Popen([sys.executable, "-c", CLIENT, address, model])
        with held_mid_step(lambda: fronts(node), grpc_port, node.pid()):
            os.kill(client.pid, signal.SIGSTOP)  # it reads nothing more
        holder = wait_until(lambda: handing_over(lambda: fronts(node)), 60,
                            "a front whose gRPC call holds the reply", interval=0.01)  # fmt: skip
        os.kill(holder, signal.SIGKILL)
        client.kill()
        client.wait(30)
        seen = []
        for _ in range(2):  # the other front, or the new one once it is up
            for _ in range(100):
                try:
                    result = step()
                    break
                except InferenceServerException:
                    time.sleep(0.1)
            seen.append((count(result), bool(facts(result)["state_reset"])))
        assert seen in ([(1, True), (2, False)], [(3, False), (1, True)]), seen
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        node.stop()
