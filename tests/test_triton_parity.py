"""What a real Triton (2.51, Python backend, sequence batching) answers and a node must
answer alike, found by driving both with the unmodified ``tritonclient``: statistics per
model, one version string, a missing input named, the model configuration Triton's own
tooling reads first, and the refusals of a node with ``--api-key`` (gRPC streams, the admin
API). One real node serving two models, over HTTP and gRPC."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tg_aio
import tritonclient.http as th
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from tests.procs import Node, RedisServer, free_port
from tests.test_cluster import running

KEY = "k-parity"
ADMIN = "adm-parity"


def auth() -> dict[str, str]:
    """The API key's header, a new dict each call: ``tritonclient.http`` adds its own
    headers to the dict it is given."""
    return {"authorization": f"Api-Key {KEY}"}


DEMO, VLA = "demo_policy", "vla_demo"
pytestmark = pytest.mark.integration


class Served:
    """One node serving both models, and a client of each kind."""

    def __init__(self, node: Node, grpc_port: int) -> None:
        self.node = node
        self.http = th.InferenceServerClient(f"{node.host}:{node.port}")
        self.grpc_address = f"127.0.0.1:{grpc_port}"
        self.grpc = tg.InferenceServerClient(self.grpc_address)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("parity")
    redis = RedisServer(tmp)
    port = free_port()
    extra = ["--model", "demo", "--model", "vla-demo", "--api-key", KEY, "--grpc-port", str(port)]
    node = Node(tmp, "parity", redis.url, devices="cpu:2", extra=extra,
                env={"AFFINITY_ADMIN_TOKEN": ADMIN})  # fmt: skip
    with running(redis, [node]):
        one = Served(node, port)
        try:
            yield one
        finally:
            one.http.close()
            one.grpc.close()


def step_arrays(config: dict[str, Any], rng: np.random.Generator) -> list[tuple[str, str, Any]]:
    """One step's inputs built from the model configuration alone, as PyTriton's
    ``ModelClient`` builds them: the config's dims with a batch axis of 1 in front when
    ``max_batch_size`` > 0, its data type; (name, datatype, array) each."""
    batch = [1] if config["max_batch_size"] > 0 else []
    out = []
    for spec in config["input"]:
        shape = batch + [int(d) for d in spec["dims"]]
        datatype = spec["data_type"].removeprefix("TYPE_")
        dtype = triton_to_np_dtype(datatype)
        data = rng.integers(0, 255, shape) if dtype == np.uint8 else rng.standard_normal(shape)
        out.append((spec["name"], datatype, data.astype(dtype)))
    return out


def config_from_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """The part of a configuration :func:`step_arrays` reads, from the model metadata (a
    ``-1`` dimension in front: the batch axis)."""
    return {
        "max_batch_size": 1,
        "input": [{"name": t["name"], "data_type": f"TYPE_{t['datatype']}",
                   "dims": t["shape"][1:]} for t in meta["inputs"]],
    }  # fmt: skip


def http_inputs(config: dict[str, Any], rng: np.random.Generator) -> list[th.InferInput]:
    return [th.InferInput(name, list(a.shape), datatype).set_data_from_numpy(a)
            for name, datatype, a in step_arrays(config, rng)]  # fmt: skip


def grpc_inputs(config: dict[str, Any], rng: np.random.Generator) -> list[tg.InferInput]:
    return [tg.InferInput(name, list(a.shape), datatype).set_data_from_numpy(a)
            for name, datatype, a in step_arrays(config, rng)]  # fmt: skip


def test_statistics_are_counted_per_model(served: Served) -> None:
    """Triton counts each model apart; a node gave every model its node-wide totals."""
    rng = np.random.default_rng(1)
    configs = {m: config_from_metadata(served.http.get_model_metadata(m, headers=auth()))
               for m in (DEMO, VLA)}  # fmt: skip

    def counts() -> dict[str, tuple[int, ...]]:
        out = {}
        for m in (DEMO, VLA):
            (h,) = served.http.get_inference_statistics(m, headers=auth())["model_stats"]
            (g,) = served.grpc.get_inference_statistics(m, headers=auth(), as_json=True)[
                "model_stats"
            ]
            assert h["name"] == g["name"] == m
            success = h["inference_stats"]["success"]["count"]
            assert int(g.get("inference_count", 0)) == h["inference_count"]
            out[m] = (h["inference_count"], h["execution_count"], success)
        return out

    before = counts()
    for _ in range(3):
        served.http.infer(DEMO, http_inputs(configs[DEMO], rng), headers=auth())
    served.grpc.infer(VLA, grpc_inputs(configs[VLA], rng), headers=auth())
    after = counts()
    assert [a - b for a, b in zip(after[DEMO], before[DEMO], strict=True)] == [3, 3, 3]
    assert [a - b for a, b in zip(after[VLA], before[VLA], strict=True)] == [1, 1, 1]
    every = served.http.get_inference_statistics("", headers=auth())["model_stats"]
    assert {e["name"]: e["inference_count"] for e in every} == {
        DEMO: after[DEMO][0],
        VLA: after[VLA][0],
    }
    listed = served.grpc.get_inference_statistics("", headers=auth(), as_json=True)
    assert sorted(e["name"] for e in listed["model_stats"]) == [DEMO, VLA]


def test_one_version_string_in_metadata_statistics_config_and_replies(served: Served) -> None:
    """A client that checks a reply's version against the metadata's finds it there."""
    rng = np.random.default_rng(2)
    for m in (DEMO, VLA):
        meta = served.http.get_model_metadata(m, headers=auth())
        config = config_from_metadata(meta)
        gmeta = served.grpc.get_model_metadata(m, headers=auth(), as_json=True)
        (stats,) = served.http.get_inference_statistics(m, headers=auth())["model_stats"]
        (version,) = meta["versions"]
        assert gmeta["versions"] == [version] and stats["version"] == version
        reply = served.http.infer(m, http_inputs(config, rng), headers=auth())
        assert reply.get_response()["model_version"] == version
        greply = served.grpc.infer(m, grpc_inputs(config, rng), headers=auth())
        assert greply.get_response(as_json=True)["model_version"] == version
        # the version as given back is accepted (and Triton's default "1" still is)
        for given in (version, "1"):
            reply = served.http.infer(m, http_inputs(config, rng), model_version=given,
                                      headers=auth())  # fmt: skip
            assert reply.get_response()["model_version"] == version


@pytest.mark.parametrize("model", [DEMO, VLA])
def test_an_infer_without_inputs_names_the_missing_ones(served: Served, model: str) -> None:
    """As with some inputs present: the message names each missing input."""
    expected = {DEMO: ["obs"], VLA: ["image", "wrist_image", "state"]}[model]
    with pytest.raises(InferenceServerException) as err:
        served.http.infer(model, [], headers=auth())
    assert err.value.status() == "400"
    assert all(name in err.value.message() for name in expected), err.value.message()
    with pytest.raises(InferenceServerException) as err:
        served.grpc.infer(model, [], headers=auth())
    assert err.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert all(name in err.value.message() for name in expected), err.value.message()


def test_the_model_configuration_drives_a_client_as_pytritons_model_client_does(
    served: Served,
) -> None:
    """``perf_analyzer`` and PyTriton's ``ModelClient`` read the configuration first:
    inputs, outputs, ``max_batch_size``, the sequence batcher and its control inputs.
    Here ``tritonclient`` does what ``ModelClient`` does with it: builds each input from
    the config, adds the batch axis, starts a sequence, reads back the outputs the config
    names, in the shapes it gives."""
    rng = np.random.default_rng(3)
    for m in (DEMO, VLA):
        config = served.http.get_model_config(m, headers=auth())
        wire = served.grpc.get_model_config(m, headers=auth(), as_json=True)["config"]
        assert wire["name"] == config["name"] == m
        assert int(wire["max_batch_size"]) == config["max_batch_size"] == 1
        assert [(t["name"], [int(d) for d in t["dims"]]) for t in wire["input"]] == [
            (t["name"], t["dims"]) for t in config["input"]
        ]
        assert config["platform"] == served.http.get_model_metadata(m, headers=auth())["platform"]
        controls = {
            c["name"]: c["control"][0] for c in config["sequence_batching"]["control_input"]
        }
        assert set(controls) == {"START", "END", "READY", "CORRID"}
        assert controls["CORRID"]["kind"] == "CONTROL_SEQUENCE_CORRID"
        assert [g["kind"] for g in config["instance_group"]] == ["KIND_CPU"]
        assert config["instance_group"][0]["count"] == 2  # the node's two devices
        names = [t["name"] for t in config["output"]]
        for step in range(3):
            result = served.http.infer(m, http_inputs(config, rng), sequence_id=f"mc-{m}",
                                       sequence_start=step == 0, headers=auth())  # fmt: skip
            for spec in config["output"]:
                got = result.as_numpy(spec["name"])
                assert got is not None and list(got.shape) == [1, *spec["dims"]], spec
            assert [o["name"] for o in result.get_response()["outputs"]] == names


def test_a_stream_without_the_key_is_unauthenticated_every_time(served: Served) -> None:
    """Streams without the API key, sync and ``aio``, each sending three steps: every one
    ends UNAUTHENTICATED, and no step of theirs runs. A node that answered before the
    client stopped writing made ``tritonclient.grpc.aio`` end ~1 stream in 10 INTERNAL
    (its own write failed: "Internal error from Core")."""
    config = config_from_metadata(served.http.get_model_metadata(DEMO, headers=auth()))
    rng = np.random.default_rng(4)
    (before,) = served.http.get_inference_statistics(DEMO, headers=auth())["model_stats"]
    for _ in range(4):
        answers: queue.Queue[Any] = queue.Queue()
        client = tg.InferenceServerClient(served.grpc_address)
        client.start_stream(callback=lambda result, error, answers=answers: answers.put(error))
        try:
            try:
                client.async_stream_infer(DEMO, grpc_inputs(config, rng), sequence_id=77,
                                          sequence_start=True)  # fmt: skip
            except InferenceServerException as exc:  # refused before the request was queued
                answers.put(exc)
            error = answers.get(timeout=30)
        finally:
            client.stop_stream()
            client.close()
        assert error.status() == str(grpc.StatusCode.UNAUTHENTICATED), error
        assert "Api-Key" in error.message()

    async def aio_streams() -> list[str]:
        codes = []
        for _ in range(40):
            client = tg_aio.InferenceServerClient(served.grpc_address)

            async def steps() -> AsyncIterator[dict[str, Any]]:
                for i in range(3):
                    yield {"model_name": DEMO, "inputs": grpc_inputs(config, rng),
                           "sequence_id": 78, "sequence_start": i == 0}  # fmt: skip

            try:
                async for _result, error in client.stream_infer(steps()):
                    codes.append(f"answered {error}")
            except grpc.RpcError as exc:
                codes.append(str(exc.code()))
            finally:
                await client.close()
        return codes

    codes = asyncio.run(aio_streams())
    assert codes == [str(grpc.StatusCode.UNAUTHENTICATED)] * 40, codes
    (after,) = served.http.get_inference_statistics(DEMO, headers=auth())["model_stats"]
    assert after["inference_count"] == before["inference_count"]


def test_the_admin_api_answers_401_without_valid_credentials_and_403_without_the_right(
    served: Served,
) -> None:
    url = f"{served.node.url}/devices/parity/0/drain"
    undrain = f"{served.node.url}/devices/parity/0/undrain"
    for headers, status in (
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),  # was 401 here, 403 on a node without a key
        ({"Authorization": "Api-Key wrong"}, 401),
        (auth(), 403),  # a client's valid key: not the admin
    ):
        r = httpx.post(url, headers=headers)
        assert r.status_code == status, (headers, r.text)
        assert r.json()["error"]["code"] == ("unauthorized" if status == 401 else "forbidden")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.post(url, headers=admin).json()["state"] == "draining"
    assert httpx.post(undrain, headers=admin).json()["state"] == "active"


def test_a_replys_head_and_body_leave_in_one_write() -> None:
    """uvicorn writes a reply's head and its body apart; the node's transport sends them
    in one write (one TCP segment, one wake-up of the client), and a head whose body does
    not follow in the same loop iteration (a streamed reply) leaves at its end."""
    from node.httpproto import OneWriteTransport

    class Recording:
        def __init__(self) -> None:
            self.sent: list[list[bytes]] = []

        def write(self, data: bytes) -> None:
            self.sent.append([data])

        def writelines(self, parts: Any) -> None:
            self.sent.append(list(parts))

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            self.sent.append([b"<close>"])

    loop = asyncio.new_event_loop()
    try:
        wire = Recording()
        transport = OneWriteTransport(wire, loop)  # type: ignore[arg-type]
        head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
        transport.write(head)
        transport.write(b"{}")
        assert wire.sent == [[head, b"{}"]]
        transport.write(head)  # a streamed reply: its head, then nothing in this iteration
        loop.run_until_complete(asyncio.sleep(0))
        assert wire.sent[1:] == [[head]]
        transport.write(b"data: 1\n\n")
        transport.write(head)
        transport.close()  # a held head leaves before the connection closes
        assert wire.sent[2:] == [[b"data: 1\n\n"], [head], [b"<close>"]]
    finally:
        loop.close()
