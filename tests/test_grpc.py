"""KServe v2 over gRPC: the decoder in process (hostile messages refused before anything is
allocated), and the unmodified ``tritonclient.grpc`` (sync, aio and streaming) and
``tritonclient.http`` (statistics) against three real ``affinity-node`` processes."""

from __future__ import annotations

import asyncio
import contextlib
import io
import queue
import random
import signal
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import fakeredis
import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tg_aio
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from node.accesslog import AccessLog
from node.errors import BadRequest
from node.models import DEMO_MODEL
from node.protocols.kserve.body import reply_of, request_meta
from node.protocols.kserve.grpc import GrpcFrontDoor, decode_request
from node.protocols.kserve.http import serve_hop
from node.protocols.kserve.messages import encode_response
from node.protocols.kserve.pb import kserve_pb2 as pb
from tests.inproc import cluster, config
from tests.procs import unread_at, wait_until
from tests.rollout import reference_rollout
from tests.test_cluster import Cluster, grpc_nodes
from tests.test_kserve import observations

MODEL = "demo_policy"
KEY = "k-grpc"
HEADERS = {"authorization": f"Api-Key {KEY}"}


def close(want: np.ndarray, got: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def message(shape: list[int], raw: list[bytes] | None, datatype: str = "FP32") -> Any:
    msg = pb.ModelInferRequest(model_name=MODEL)
    msg.inputs.add(name="obs", datatype=datatype, shape=shape)
    if raw is not None:
        msg.raw_input_contents.extend(raw)
    return msg


# ---- the decoder in process --------------------------------------------------------------


def test_raw_and_typed_contents_decode_to_the_same_array() -> None:
    obs = observations(1, 1)[0]
    raw = decode_request(message([1, 8], [obs.tobytes()]))
    typed_msg = message([1, 8], None)
    typed_msg.inputs[0].contents.fp32_contents.extend(obs.reshape(-1).tolist())
    typed = decode_request(typed_msg)
    np.testing.assert_array_equal(raw.arrays["obs"], obs)
    np.testing.assert_array_equal(typed.arrays["obs"], obs)
    assert not raw.arrays["obs"].flags.writeable  # a view of the received bytes


def test_sequence_parameters() -> None:
    msg = message([1, 8], [bytes(32)])
    msg.parameters["sequence_id"].int64_param = 7
    msg.parameters["sequence_start"].bool_param = True
    msg.parameters["timeout"].int64_param = 250_000
    req = decode_request(msg)
    assert (req.episode, req.start, req.end, req.timeout_s) == ("kserve:i:7", True, False, 0.25)
    msg.parameters["sequence_id"].string_param = "7"
    assert decode_request(msg).episode == "kserve:s:7"
    msg.parameters["sequence_id"].int64_param = -1
    with pytest.raises(BadRequest, match="not a uint64"):
        decode_request(msg)
    msg.parameters["sequence_id"].int64_param = 0
    with pytest.raises(BadRequest, match="need a non-zero sequence_id"):
        decode_request(msg)


def test_the_seq_parameter_numbers_the_step() -> None:
    msg = message([1, 8], [bytes(32)])
    msg.parameters["sequence_id"].int64_param = 7
    assert decode_request(msg).seq is None
    msg.parameters["seq"].int64_param = 3
    assert decode_request(msg).seq == 3
    for bad in (0, -2):
        msg.parameters["seq"].int64_param = bad
        with pytest.raises(BadRequest, match="must be a step number"):
            decode_request(msg)
    msg.parameters["seq"].string_param = "3"
    with pytest.raises(BadRequest, match="must be a step number"):
        decode_request(msg)


def test_hostile_messages_are_refused_before_anything_is_allocated() -> None:
    hostile = [
        message([1 << 40, 1 << 20], [bytes(32)]),  # a huge declared shape, small raw bytes
        message([1 << 40, 1 << 20], None),  # huge shape, typed contents (none given)
        message([1, 1 << 22], [bytes(32)]),  # under the element limit: the raw size lies
        message([1, 8], [bytes(31)]),  # one byte short
        message([1, 8], [bytes(32), bytes(32)]),  # more raw contents than inputs
        message([-1, 8], [bytes(32)]),  # a negative dimension
        message([1] * 40, [bytes(4)]),  # past the rank limit
        message([2], [b"\x01\x00\x00\x00a\xff\xff\xff\x7fbcd"], "BYTES"),  # a lying length
        message([1 << 20], [bytes(8)], "BYTES"),  # a million elements in 8 bytes
        message([1, 8], [bytes(32)], "BF16"),
    ]
    tracemalloc.start()
    try:
        for msg in hostile:
            with pytest.raises(BadRequest):
                decode_request(msg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# ---- tritonclient against three real nodes -----------------------------------------------


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, list[str]]]:
    with grpc_nodes(tmp_path_factory.mktemp("grpc"), "g", ["--api-key", KEY]) as three:
        yield three


def grpc_input(obs: np.ndarray) -> tg.InferInput:
    tensor = tg.InferInput("obs", list(obs.shape), "FP32")
    tensor.set_data_from_numpy(obs)
    return tensor


def facts(result: tg.InferResult) -> dict[str, Any]:
    params = result.get_response().parameters
    return {key: getattr(p, p.WhichOneof("parameter_choice")) for key, p in params.items()}


@pytest.mark.integration
def test_health_metadata_and_errors(three: tuple[Cluster, list[str]]) -> None:
    _, addresses = three
    client = tg.InferenceServerClient(addresses[0])
    try:
        assert client.is_server_live(headers=HEADERS) and client.is_server_ready(headers=HEADERS)
        assert client.is_model_ready(MODEL, headers=HEADERS)
        assert not client.is_model_ready("other", headers=HEADERS)
        meta = client.get_model_metadata(MODEL, headers=HEADERS, as_json=True)
        assert [t["name"] for t in meta["inputs"]] == ["obs"]
        assert "sequence(string_id)" in client.get_server_metadata(as_json=True)["extensions"]
        obs = observations(2, 1)[0]
        with pytest.raises(InferenceServerException) as err:
            client.infer(MODEL, [grpc_input(obs)], sequence_id=1, sequence_start=True)
        assert err.value.status() == str(grpc.StatusCode.UNAUTHENTICATED)
        with pytest.raises(InferenceServerException) as err:
            client.infer("other", [grpc_input(obs)], headers=HEADERS)
        assert err.value.status() == str(grpc.StatusCode.NOT_FOUND)
        with pytest.raises(InferenceServerException, match="START flag") as err:
            client.infer(MODEL, [grpc_input(obs)], sequence_id=123456, headers=HEADERS)
        assert err.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        wrong = tg.InferInput("obs", [1, 5], "FP32").set_data_from_numpy(np.zeros((1, 5), "f4"))
        with pytest.raises(InferenceServerException) as err:
            client.infer(MODEL, [wrong], headers=HEADERS)
        assert err.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        with pytest.raises(InferenceServerException) as err:
            client.get_model_repository_index(headers=HEADERS)
        assert err.value.status() == str(grpc.StatusCode.UNIMPLEMENTED)
    finally:
        client.close()
    answers: queue.Queue[Any] = queue.Queue()
    client = tg.InferenceServerClient(addresses[0])
    client.start_stream(callback=lambda result, error: answers.put((result, error)))  # no key
    try:
        # The node may refuse the stream before the request is queued: then tritonclient
        # raises here, and the refusal reaches the callback all the same.
        with contextlib.suppress(InferenceServerException):
            client.async_stream_infer(MODEL, [grpc_input(obs)])
        result, error = answers.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert result is None and "Api-Key" in str(error)


@pytest.mark.integration
def test_hostile_raw_sizes_over_the_wire(three: tuple[Cluster, list[str]]) -> None:
    """A message whose raw bytes disagree with its shape, sent as bytes by grpcio itself."""
    _, addresses = three
    with grpc.insecure_channel(addresses[1]) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        metadata = tuple(HEADERS.items())
        for msg in (message([1 << 40, 1 << 30], [bytes(32)]), message([1, 8], [bytes(33)])):
            with pytest.raises(grpc.RpcError) as err:
                infer(msg, metadata=metadata, timeout=20)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = infer(message([1, 8], [bytes(32)]), metadata=metadata, timeout=20)
        assert ok.outputs[0].name == "actions"  # the node is healthy


@pytest.mark.integration
def test_unary_sequences_stick_across_random_entry_nodes(three: tuple[Cluster, list[str]]) -> None:
    cluster, addresses = three
    clients = [tg.InferenceServerClient(a) for a in addresses]
    rng = random.Random(1)
    try:
        for n, sequence in enumerate((17, "17")):
            obs = observations(70 + n, 12)
            results = [
                rng.choice(clients).infer(
                    MODEL, [grpc_input(o)], sequence_id=sequence, sequence_start=i == 0,
                    sequence_end=i == len(obs) - 1, headers=HEADERS,
                )
                for i, o in enumerate(obs)
            ]  # fmt: skip
            got = [facts(r) for r in results]
            assert len({f["device"] for f in got}) == 1
            assert [f["routing"] for f in got] == ["claimed"] + ["hit"] * 11
            assert not any(f["state_reset"] for f in got)
            for res, want in zip(results, reference_rollout(DEMO_MODEL, obs), strict=True):
                close(want["actions"], res.as_numpy("actions"))
        assert cluster.redis.client().get("{affinity}:episode:kserve:i:17") is None  # ended
    finally:
        for c in clients:
            c.close()


@pytest.mark.integration
def test_streams_through_different_entry_nodes_equal_a_replay(
    three: tuple[Cluster, list[str]],
) -> None:
    """One sequence, its steps sent in turn over streams opened on each of the three nodes
    (a stream keeps its requests in order); a second sequence interleaved on the same
    streams. Both equal the replay."""
    _, addresses = three
    sequences = {"s-a": observations(80, 9), "s-b": observations(81, 9)}
    answers: queue.Queue[Any] = queue.Queue()
    clients = [tg.InferenceServerClient(a) for a in addresses]
    for c in clients:
        c.start_stream(callback=lambda result, error: answers.put((result, error)),
                       headers=HEADERS)  # fmt: skip
    results: dict[str, list[Any]] = {name: [] for name in sequences}
    try:
        for i in range(9):
            client = clients[i % 3]
            for name, obs in sequences.items():
                client.async_stream_infer(
                    MODEL, [grpc_input(obs[i])], request_id=f"{name}/{i}", sequence_id=name,
                    sequence_start=i == 0,
                )  # fmt: skip
            for _ in sequences:  # both answered before the next node takes the next steps
                result, error = answers.get(timeout=30)
                assert error is None, error
                name, step = result.get_response().id.split("/")
                assert int(step) == i
                results[name].append(result)
    finally:
        for c in clients:
            c.stop_stream()
            c.close()
    for name, obs in sequences.items():
        got = [facts(r) for r in results[name]]
        assert len({f["device"] for f in got}) == 1 and not any(f["state_reset"] for f in got)
        for res, want in zip(results[name], reference_rollout(DEMO_MODEL, obs), strict=True):
            close(want["actions"], res.as_numpy("actions"))


@pytest.mark.integration
def test_stream_errors_answer_that_request_and_the_stream_goes_on(
    three: tuple[Cluster, list[str]],
) -> None:
    _, addresses = three
    answers: queue.Queue[Any] = queue.Queue()
    client = tg.InferenceServerClient(addresses[2])
    client.start_stream(
        callback=lambda result, error: answers.put((result, error)), headers=HEADERS
    )
    obs = observations(90, 1)[0]
    try:
        client.async_stream_infer(MODEL, [grpc_input(obs)], sequence_id="never-started")
        client.async_stream_infer(MODEL, [grpc_input(obs)], sequence_id="st", sequence_start=True)
        first, second = answers.get(timeout=30), answers.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert first[0] is None and "START flag" in str(first[1])
    assert second[1] is None
    close(reference_rollout(DEMO_MODEL, [obs])[0]["actions"], second[0].as_numpy("actions"))


@pytest.mark.integration
def test_aio_client_with_concurrent_sequences(three: tuple[Cluster, list[str]]) -> None:
    _, addresses = three
    sequences = {2000 + k: observations(100 + k, 8) for k in range(6)}

    async def main() -> dict[int, list[Any]]:
        clients = [tg_aio.InferenceServerClient(a) for a in addresses]
        rng = random.Random(2)
        try:

            async def one(sequence: int, obs: list[np.ndarray]) -> list[Any]:
                return [
                    await rng.choice(clients).infer(
                        MODEL, [grpc_input(o)], sequence_id=sequence, sequence_start=i == 0,
                        headers=HEADERS,
                    )
                    for i, o in enumerate(obs)
                ]  # fmt: skip

            done = await asyncio.gather(*(one(s, o) for s, o in sequences.items()))
            return dict(zip(sequences, done, strict=True))
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(main())
    for sequence, obs in sequences.items():
        assert len({facts(r)["device"] for r in results[sequence]}) == 1
        for res, want in zip(results[sequence], reference_rollout(DEMO_MODEL, obs), strict=True):
            close(want["actions"], res.as_numpy("actions"))


@pytest.mark.integration
def test_statistics_count_a_known_number_of_requests(three: tuple[Cluster, list[str]]) -> None:
    """Stateless steps run on the node that received them: its statistics grow by exactly
    that many inferences, over gRPC and over HTTP alike."""
    cluster, addresses = three
    node = cluster.nodes[1]
    grpc_client = tg.InferenceServerClient(addresses[1])
    http_client = th.InferenceServerClient(f"{node.host}:{node.port}")

    def counts() -> tuple[int, int, int, int]:
        stats = grpc_client.get_inference_statistics(MODEL, headers=HEADERS, as_json=True)
        (entry,) = stats["model_stats"]
        success = entry["inference_stats"]["success"]
        return (int(entry.get("inference_count", 0)), int(entry.get("execution_count", 0)),
                int(success.get("count", 0)), int(entry["inference_stats"]["queue"]
                                                  .get("count", 0)))  # fmt: skip

    try:
        before = counts()
        http_before = http_client.get_inference_statistics(MODEL)["model_stats"][0]
        assert http_before["inference_count"] == before[0]
        for o in observations(110, 5):
            grpc_client.infer(MODEL, [grpc_input(o)], headers=HEADERS)  # no sequence
        after = counts()
        assert [a - b for a, b in zip(after, before, strict=True)] == [5, 5, 5, 5]
        every = httpx.get(f"{node.url}/v2/models/stats").json()["model_stats"]
        assert [(e["name"], e["inference_count"]) for e in every] == [(MODEL, after[0])]
        one = http_client.get_inference_statistics(MODEL, "1")["model_stats"][0]
        assert one["inference_count"] == after[0] and one["execution_count"] == after[1]
        with pytest.raises(InferenceServerException):
            http_client.get_inference_statistics("other")
    finally:
        grpc_client.close()
        http_client.close()


# ---- in process: the budget and the access line of one gRPC step -------------------------


class _Context:
    """What the front door asks of a gRPC call's context."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.gone = False  # the client cancelled the call

    def time_remaining(self) -> float | None:
        return self.remaining

    def cancelled(self) -> bool:
        return self.gone

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"


@pytest.mark.anyio
@pytest.mark.parametrize("remaining", [1.5, None])  # (a busy machine: room to run)
async def test_a_grpc_deadline_shortens_the_step_and_each_step_writes_an_access_line(
    remaining: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a", act_deadline_s=5.0)]) as (nodes, _):
        service = nodes[0].service
        access = AccessLog(stream=io.StringIO())
        door = GrpcFrontDoor(service, access)
        budgets: list[float] = []
        act = service.router.act

        async def measured(step: Any) -> Any:
            budgets.append(step.deadline - time.monotonic())
            return await act(step)

        monkeypatch.setattr(service.router, "act", measured)
        msg = message([1, 8], [observations(1, 1)[0].tobytes()])
        msg.model_name = door.model_name
        msg.parameters["sequence_id"].string_param = "robot-7"
        msg.parameters["sequence_start"].bool_param = True
        await door.infer(msg, _Context(remaining), "ModelInfer")
        msg.model_name = "nope"
        with pytest.raises(Exception, match="unknown model"):
            await door.infer(msg, _Context(remaining), "ModelStreamInfer")
        access.flush()
    if remaining is None:
        assert 2.0 < budgets[0] <= 5.0  # --act-deadline (past the 1.5 s asked)
    else:
        assert 0 < budgets[0] <= remaining  # the client's deadline, not --act-deadline
    served, refused = access.stream.getvalue().splitlines()  # type: ignore[union-attr]
    assert '127.0.0.1:5555 "GRPC /inference.GRPCInferenceService/ModelInfer" 200' in served
    assert "episode=kserve:s:robot-7 device=a/" in served and "routing=claimed" in served
    assert '"GRPC /inference.GRPCInferenceService/ModelStreamInfer" 404' in refused


@pytest.mark.anyio
async def test_a_step_whose_call_was_cancelled_while_it_ran_is_undone() -> None:
    """The client cancels while the step runs (a quick one, on the event loop: nothing
    could cancel it): the reply cannot go, so the step is undone and the next one follows
    the state before it."""
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a", devices="cpu:1")]) as (nodes, _):
        service = nodes[0].service
        door = GrpcFrontDoor(service, AccessLog(enabled=False))
        obs = observations(5, 4)

        def msg(i: int) -> Any:
            m = message([1, 8], [obs[i].tobytes()])
            m.model_name = door.model_name
            m.parameters["sequence_id"].string_param = "robot-c"
            m.parameters["sequence_start"].bool_param = i == 0
            return m

        for i in range(2):  # (the second runs inline: the first gave the device its average)
            await door.infer(msg(i), _Context(None), "ModelInfer")
        cancelled = _Context(None)
        act = service.router.act

        async def cancelled_meanwhile(step: Any) -> Any:
            reply = await act(step)
            cancelled.gone = True
            return reply

        service.router.act = cancelled_meanwhile  # type: ignore[method-assign]
        with pytest.raises(asyncio.CancelledError):
            await door.infer(msg(2), cancelled, "ModelInfer")
        service.router.act = act  # type: ignore[method-assign]
        reply = await door.infer(msg(3), _Context(None), "ModelInfer")
    want = reference_rollout(DEMO_MODEL, [obs[0], obs[1], obs[3]])[-1]["actions"]
    got = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(want.shape)
    close(want, got)


@pytest.mark.anyio
async def test_a_call_refused_for_its_key_writes_an_access_line() -> None:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a", api_key="k")]) as (nodes, _):
        service = nodes[0].service
        access = AccessLog(stream=io.StringIO())
        door = GrpcFrontDoor(service, access)
        context = _Context(None)
        context.invocation_metadata = lambda: (("authorization", "Api-Key wrong"),)  # type: ignore[attr-defined]
        for rpc in ("ModelInfer", "ModelStreamInfer"):
            with pytest.raises(Exception, match="Api-Key"):
                door._check_key_logged(context, rpc)
        context.invocation_metadata = lambda: (("authorization", "Api-Key k"),)  # type: ignore[attr-defined]
        door._check_key_logged(context, "ModelInfer")  # allowed: no line
        access.flush()
    lines = access.stream.getvalue().splitlines()  # type: ignore[union-attr]
    assert len(lines) == 2
    assert '"GRPC /inference.GRPCInferenceService/ModelInfer" 401' in lines[0]
    assert '"GRPC /inference.GRPCInferenceService/ModelStreamInfer" 401' in lines[1]


@pytest.mark.integration
def test_a_step_whose_rpc_was_cancelled_is_undone(three: tuple[Cluster, list[str]]) -> None:
    """A tritonclient call cancelled (no deadline: the client gave up, or went away) while
    its owner was paused: the owner reads the request and the cancel together, and the
    step does not count; the sequence goes on from the state before it. (gRPC's core
    drops a call cancelled before it was handed to the handler, so this passes without
    ``undo_if_cancelled`` too; that one covers a cancel read while the handler runs.)"""
    cluster, addresses = three
    obs = observations(91, 3)
    client = tg.InferenceServerClient(addresses[0])
    try:
        first = client.infer(
            MODEL, [grpc_input(obs[0])], sequence_id=9191, sequence_start=True, headers=HEADERS
        )
        owner = next(n for n in cluster.nodes if n.node_id == facts(first)["node"])
        at = tg.InferenceServerClient(addresses[cluster.nodes.index(owner)])
        done: queue.Queue[Any] = queue.Queue()
        owner.proc.send(signal.SIGSTOP)
        try:
            call = at.async_infer(
                MODEL, [grpc_input(obs[1])], lambda result, error: done.put((result, error)),
                sequence_id=9191, headers=HEADERS,
            )  # fmt: skip
            port = int(addresses[cluster.nodes.index(owner)].rsplit(":", 1)[1])
            wait_until(lambda: unread_at(port) > 0, 30, "the request sent to the paused node")
            call.cancel()
        finally:
            owner.proc.send(signal.SIGCONT)
        result, error = done.get(timeout=30)
        assert result is None and error is not None  # cancelled: no reply
        time.sleep(0.5)  # the owner reads the request and the cancel
        r = at.infer(MODEL, [grpc_input(obs[2])], sequence_id=9191, headers=HEADERS)
        assert facts(r)["state_reset"] is False
        want = reference_rollout(DEMO_MODEL, [obs[0], obs[2]])[-1]["actions"]
        close(want, r.as_numpy("actions"))
        at.close()
    finally:
        client.close()


@pytest.mark.anyio
@pytest.mark.parametrize("remaining", [1.5, None])  # (a busy machine: room to run)
async def test_a_call_a_front_decoded_is_served_as_the_servicer_serves_it(
    remaining: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``ModelInfer`` a front door process decoded (``grpc_front``: the request over the
    hop with the client's remaining deadline): the core's ``serve_hop`` gives the step the
    client's deadline as its budget and the door ``kserve_grpc``, and the reply encodes to
    what the servicer answers for the same call."""
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a", act_deadline_s=5.0)]) as (nodes, _):
        service = nodes[0].service
        door = GrpcFrontDoor(service, AccessLog(stream=io.StringIO()))
        steps: list[tuple[float, str]] = []
        act = service.router.act

        async def measured(step: Any) -> Any:
            steps.append((step.deadline - time.monotonic(), step.door))
            return await act(step)

        monkeypatch.setattr(service.router, "act", measured)
        msg = message([1, 8], [observations(3, 1)[0].tobytes()])
        msg.model_name, msg.id = door.model_name, "r1"
        request = decode_request(msg)
        meta, arrays = request_meta(request, msg.model_name, None)
        meta["recv"], meta["grpc"] = time.monotonic(), remaining
        done, out = await serve_hop(service, meta, arrays)
        outputs, wanted, version, parameters = reply_of(done, out)
        fronted = encode_response(outputs, wanted, done["name"], version, request.id, parameters)
        direct = await door.infer(msg, _Context(remaining), "ModelInfer")
    budget, label = steps[0]
    assert label == "kserve_grpc" and steps[1][1] == "kserve_grpc"
    if remaining is None:
        assert 2.0 < budget <= 5.0  # --act-deadline (past the 1.5 s asked)
    else:
        assert 0 < budget <= remaining  # the client's deadline, not --act-deadline
    assert (fronted.model_name, fronted.model_version, fronted.id) == (
        direct.model_name, direct.model_version, "r1"
    )  # fmt: skip
    assert [(o.name, o.datatype, list(o.shape)) for o in fronted.outputs] == [
        (o.name, o.datatype, list(o.shape)) for o in direct.outputs
    ]
    assert fronted.raw_output_contents == direct.raw_output_contents  # stateless: the same
    assert set(fronted.parameters) == set(direct.parameters)
