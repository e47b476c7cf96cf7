"""KServe v2 (HTTP/REST) with Triton's sequences: the decoder in process, the front door
in process (real ONNX Runtime, fakeredis and a real Redis), and the unmodified
``tritonclient.http`` (sync and aio) against three real ``affinity-node`` processes."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as th
import tritonclient.http.aio as th_aio
from tritonclient.utils import InferenceServerException

from affinity import Keys
from node.catalog import file_version
from node.contract import load_contract
from node.errors import BadRequest, Uncarried
from node.hop import Region
from node.models import DEMO_MODEL
from node.protocols.kserve.body import (
    Row,
    decode_infer,
    encode_reply,
    episode_of,
    reply_meta,
    reply_of,
    request_meta,
    request_of,
)
from node.protocols.kserve.request import model_metadata, to_step
from tests.inproc import InProcNode, cluster, config
from tests.procs import Node, RedisServer
from tests.rollout import reference_rollout
from tests.test_cluster import Cluster, running

KEYS = Keys()
MODEL = "demo_policy"
INFER = f"/v2/models/{MODEL}/infer"
CONTRACT = load_contract(DEMO_MODEL)
VERSION = file_version(DEMO_MODEL)
"""The version a node registers for the demo model when none is given: its file's hash."""


def observations(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def obs_input(obs: np.ndarray, *, binary: bool = True, datatype: str = "FP32") -> th.InferInput:
    tensor = th.InferInput("obs", list(obs.shape), datatype)
    return tensor.set_data_from_numpy(obs, binary_data=binary)


def request_body(
    obs: np.ndarray, *, binary: bool = True, **kw: Any
) -> tuple[bytes, dict[str, str]]:
    """The body and headers ``tritonclient`` itself sends for one step."""
    body, json_size = th.InferenceServerClient.generate_request_body(
        [obs_input(obs, binary=binary)], **kw
    )
    headers = {} if json_size is None else {"Inference-Header-Content-Length": str(json_size)}
    return body, headers


def raw_body(header: dict[str, Any], tail: bytes = b"") -> tuple[bytes, str]:
    """A hand-made binary body and its ``Inference-Header-Content-Length``."""
    head = orjson.dumps(header)
    return head + tail, str(len(head))


def binary_header(shape: list[Any], size: Any, datatype: str = "FP32") -> dict[str, Any]:
    return {
        "inputs": [
            {
                "name": "obs",
                "shape": shape,
                "datatype": datatype,
                "parameters": {"binary_data_size": size},
            }
        ]
    }


def json_body(name: str, shape: list[int], datatype: str, data: Any) -> tuple[bytes, None]:
    doc = {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]}
    return orjson.dumps(doc), None


def result_of(r: httpx.Response) -> th.InferResult:
    """What ``tritonclient`` makes of a reply (binary outputs after the JSON header)."""
    length = r.headers.get("inference-header-content-length")
    return th.InferenceServerClient.parse_response_body(
        r.content, header_length=None if length is None else int(length)
    )


# ---- the decoder -------------------------------------------------------------------------


def test_sequence_ids_keep_integers_and_strings_apart() -> None:
    assert episode_of(7) == "kserve:i:7"
    assert episode_of("7") == "kserve:s:7"
    assert episode_of(2**64 - 1) == f"kserve:i:{2**64 - 1}"
    assert episode_of("robot-3/ep 12") == "kserve:s:robot-3/ep 12"
    for stateless in (None, 0, ""):
        assert episode_of(stateless) is None
    for bad in (True, False, -1, 2**64, 1.5, 0.0, [7], {"id": 7}, "bad\x00id", "x" * 600):
        with pytest.raises(BadRequest, match="sequence_id"):
            episode_of(bad)


def test_binary_flat_and_nested_json_inputs_decode_alike() -> None:
    obs = observations(1, 1)[0]
    decoded = []
    for binary in (True, False):
        body, headers = request_body(obs, binary=binary, sequence_id="s", sequence_start=True)
        req = decode_infer(body, headers.get("Inference-Header-Content-Length"))
        assert (req.sequence, req.episode, req.start, req.end) == ("s", "kserve:s:s", True, False)
        decoded.append(req.arrays["obs"])
    nested, _ = raw_body(
        {"inputs": [{"name": "obs", "shape": [1, 8], "datatype": "FP32", "data": obs.tolist()}]}
    )
    decoded.append(decode_infer(nested, None).arrays["obs"])
    for array in decoded:
        assert array.dtype == np.float32 and array.shape == (1, 8)
        np.testing.assert_array_equal(array, obs)
    assert not decoded[0].flags.owndata  # the binary input is a view of the body


def test_a_decoded_request_and_its_reply_cross_the_hop_whole() -> None:
    """What a front door process sends the core over the shared-memory hop, and the reply
    back (``body.request_meta``/``request_of``, ``reply_meta``/``reply_of``): every field
    the core serves with, numeric tensors raw in the slot, BYTES ones as strings; a
    parameter msgpack cannot carry is refused before anything is written."""
    obs = observations(2, 2)[0]
    words = np.array(["ab", "", "ü"], dtype=object)
    tensors = [th.InferInput("obs", [1, 8], "FP32").set_data_from_numpy(obs),
               th.InferInput("w", [3], "BYTES").set_data_from_numpy(words)]  # fmt: skip
    params = {"episode_ids": json.dumps(["a", 9]), "seqs": "[3, null]", "timing": True,
              "execute_steps": 2, "pending": "[[1, 2]]"}  # fmt: skip
    body, size = th.InferenceServerClient.generate_request_body(
        tensors, outputs=[th.InferRequestedOutput("actions", binary_data=False)],
        parameters=params, timeout=5000,
    )  # fmt: skip
    req = decode_infer(body, None if size is None else str(size))
    region = Region.create(2, 1 << 16)
    try:
        meta, arrays = request_meta(req, MODEL, "3")
        region.write(0, 1, 5, meta, arrays)
        _, got_meta, got_arrays = region.read(0, copy=True)
        got, model, version = request_of(got_meta, got_arrays)
        assert (model, version) == (MODEL, "3")
        for f in ("sequence", "episode", "start", "end", "outputs", "binary_output", "timeout_s",
                  "execute_steps", "seq", "pending", "timing", "rows"):  # fmt: skip
            assert getattr(got, f) == getattr(req, f), f
        assert got.rows == [Row("a", "kserve:s:a", seq=3), Row(9, "kserve:i:9")]
        assert got.timeout_s == 0.005
        np.testing.assert_array_equal(got.arrays["obs"], obs)
        assert got.arrays["w"].tolist() == ["ab", "", "ü"] and got.arrays["w"].dtype == object
        outputs = {"actions": np.ones((1, 2), np.float32), "names": words, "extra": obs}
        wanted = {"names": True, "actions": False}
        meta, arrays = reply_meta(outputs, wanted, "v7", {"seq": 3})
        region.write(1, 3, 9, meta, arrays)
        _, got_meta, views = region.read(1, copy=False)
        out, got_wanted, served, parameters = reply_of(got_meta, views)
        assert list(got_wanted.items()) == list(wanted.items()) and set(out) == set(wanted)
        assert (served, parameters) == ("v7", {"seq": 3})
        head, _ = encode_reply(out, got_wanted, MODEL, served, "id-1", parameters)
        want, _ = encode_reply(outputs, wanted, MODEL, "v7", "id-1", {"seq": 3})
        assert head == want
        del out, views
        req.seq = 10**30  # JSON's decoder never makes it (a float): a door that would
        with pytest.raises(Uncarried):
            region.write(0, 1, 5, *request_meta(req, MODEL, None))
    finally:
        region.close()


def test_the_policy_rule_converts_and_refuses_after_decoding() -> None:
    wide = np.arange(8, dtype=np.float64).reshape(1, 8)
    body, length = raw_body(binary_header([1, 8], 64, "FP64"), wide.tobytes())
    req = decode_infer(body, length)
    step = to_step(CONTRACT, req, deadline=0.0)
    assert step.inputs["obs"].dtype == np.float32 and step.episode is None
    body, length = raw_body(binary_header([2, 8], 64), np.zeros((2, 8), np.float32).tobytes())
    with pytest.raises(ValueError, match="batch axis"):
        to_step(CONTRACT, decode_infer(body, length), 0.0)
    body, _ = request_body(wide.astype(np.float32), binary=False, outputs=None)
    req = decode_infer(body, None)
    req.outputs = {"state_out.hidden": True}
    with pytest.raises(BadRequest, match=r"unknown output 'state_out\.hidden'"):
        to_step(CONTRACT, req, 0.0)


F32 = np.zeros((1, 8), np.float32).tobytes()
GOOD = binary_header([1, 8], 32)
HOSTILE = {
    "header length past the body": (orjson.dumps(GOOD) + F32, "99999", "Header-Content-Length"),
    "header length not a number": (orjson.dumps(GOOD) + F32, "-5", "Header-Content-Length"),
    "header length cuts the JSON": (orjson.dumps(GOOD) + F32, "10", "not valid"),
    "size disagrees with the shape": (*raw_body(binary_header([1, 8], 16), F32[:16]), "32 bytes"),
    "size past the body": (*raw_body(binary_header([1, 8], 32), F32[:20]), "only 20 bytes"),
    "bytes left over": (*raw_body(GOOD, F32 + b"xx"), "declare 32"),
    "negative shape": (*raw_body(binary_header([-1, 8], 32), F32), "non-negative"),
    "huge shape": (*raw_body(binary_header([1 << 40, 1 << 20], 4 << 60), F32), "elements"),
    "huge size": (*raw_body(binary_header([1, 8], 1 << 62), F32), "disagrees"),
    "float shape": (*raw_body(binary_header([1.0, 8], 32), F32), "non-negative integers"),
    "size not a number": (*raw_body(binary_header([1, 8], "32"), F32), "disagrees"),
    "unknown datatype": (*raw_body(binary_header([1, 8], 32, "FLOAT32")), "unknown datatype"),
    "BYTES length past the data": (
        *raw_body(binary_header([2], 12, "BYTES"), b"\x01\x00\x00\x00a\xff\xff\xff\x7fbcd"),
        "declares 2147483647 bytes",
    ),
    "BYTES fewer bytes than lengths": (
        *raw_body(binary_header([1 << 20], 8, "BYTES"), bytes(8)), "disagrees"
    ),
    "BYTES trailing bytes": (
        *raw_body(binary_header([1], 6, "BYTES"), b"\x01\x00\x00\x00ab"), "after the BYTES"
    ),
    "BYTES not UTF-8": (
        *raw_body(binary_header([1], 5, "BYTES"), b"\x01\x00\x00\x00\xff"), "not UTF-8"
    ),
    "BF16": (*raw_body(binary_header([1, 8], 16, "BF16"), F32[:16]), "not supported"),
    "BOOL bytes not 0 or 1": (*raw_body(binary_header([2], 2, "BOOL"), b"\x01\x07"), "0 or 1"),
    "no data": (b'{"inputs": [{"name": "o", "shape": [1], "datatype": "FP32"}]}', None, "neither"),
    "twice": (*raw_body({"inputs": [GOOD["inputs"][0]] * 2}, F32 * 2), "twice"),
    "not JSON": (b"\x00\x01binary", None, "not valid"),
    "not an object": (b"[1, 2]", None, "JSON object"),
    "inputs not a list": (b'{"inputs": {"obs": 1}}', None, "inputs must be a list"),
    "JSON data of the wrong count": (*json_body("obs", [1, 8], "FP32", [1]), "1 values"),
    "JSON data ragged": (*json_body("obs", [2, 2], "FP32", [[1, 2], [3]]), "nested"),
    "JSON strings": (*json_body("obs", [2], "FP32", ["1", "2"]), "must be numbers"),
    "JSON bools as numbers": (*json_body("obs", [2], "INT32", [1, True]), "must be integers"),
    "JSON ints out of range": (*json_body("x", [1], "UINT8", [256]), "outside 0"),
    "JSON floats out of range": (*json_body("x", [1], "FP16", [1e6]), "range of float16"),
    "shared memory": (
        *raw_body({"inputs": [{**GOOD["inputs"][0], "parameters": {"shared_memory_region": "r"}}]}),
        "shared memory",
    ),
    "start without a sequence": (
        *raw_body({**GOOD, "parameters": {"sequence_start": True}}, F32),
        "need a non-zero sequence_id",
    ),
    "sequence_end not a bool": (
        *raw_body({**GOOD, "parameters": {"sequence_id": 3, "sequence_end": 1}}, F32),
        "sequence_end must be true or false",
    ),
    "classification": (
        *raw_body({**GOOD, "outputs": [{"name": "a", "parameters": {"classification": 2}}]}, F32),
        "classification is not supported",
    ),
    "a custom parameter Triton refuses": (
        *raw_body({**GOOD, "parameters": {"my_param": {"nested": 1}}}, F32),
        "parameter 'my_param' must be a boolean, a number or a string, not an object",
    ),
    "priority not a uint64": (
        *raw_body({**GOOD, "parameters": {"priority": -1}}, F32),
        "priority -1 must be an unsigned integer",
    ),
}  # fmt: skip


def test_custom_parameters_triton_takes_are_taken() -> None:
    body, length = raw_body(
        {**GOOD, "parameters": {"my_param": 42, "note": "x", "flag": True, "priority": 3}}, F32
    )
    assert decode_infer(body, length).arrays


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_bodies_are_refused_with_what_was_wrong(case: str) -> None:
    body, length, expected = HOSTILE[case]
    with pytest.raises(BadRequest, match=expected):
        decode_infer(body, length)


def test_declared_sizes_are_checked_before_anything_is_allocated() -> None:
    bodies = [
        raw_body(binary_header([1 << 40, 1 << 20], 4 << 60), F32),
        raw_body(binary_header([1 << 28], 1 << 30), F32),  # within the element limit
        raw_body(binary_header([1 << 26, 4], 1 << 30), F32),
        raw_body(
            {"inputs": [{"name": "obs", "shape": [1 << 27], "datatype": "FP64", "data": [0]}]}
        ),
    ]
    tracemalloc.start()
    try:
        for body, length in bodies:
            with pytest.raises(BadRequest):
                decode_infer(body, length)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_compressed_bodies_inflate_within_the_limit() -> None:
    obs = observations(2, 1)[0]
    body, headers = request_body(obs)
    length = headers["Inference-Header-Content-Length"]
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        req = decode_infer(packed, length, content_encoding=encoding)
        np.testing.assert_array_equal(req.arrays["obs"], obs)
    from node.errors import BodyError

    bomb = gzip.compress(b" " * (1 << 22))
    with pytest.raises(BodyError, match="inflated body exceeds"):
        decode_infer(bomb, None, content_encoding="gzip", max_bytes=1 << 20)
    with pytest.raises(BadRequest, match="truncated"):
        decode_infer(gzip.compress(body)[:-8], length, content_encoding="gzip")
    with pytest.raises(BadRequest, match="not supported"):
        decode_infer(body, length, content_encoding="br")


def test_metadata_hides_the_state_and_marks_variable_dimensions() -> None:
    meta = model_metadata(CONTRACT, MODEL, versions=[VERSION])
    assert meta == {
        "name": MODEL,
        "versions": [VERSION],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "obs", "datatype": "FP32", "shape": [-1, 8]}],
        "outputs": [{"name": "actions", "datatype": "FP32", "shape": [-1, 4, 2]}],
    }


# ---- the front door in process -----------------------------------------------------------


@pytest.fixture
async def node(redis: Any) -> AsyncIterator[InProcNode]:
    async with cluster(redis, [config("a")]) as (nodes, _):
        yield nodes[0]


async def infer(node: InProcNode, obs: np.ndarray, **kw: Any) -> httpx.Response:
    binary = kw.pop("binary", True)
    body, headers = request_body(obs, binary=binary, **kw)
    return await node.client.post(INFER, content=body, headers=headers)


@pytest.mark.anyio
async def test_health_metadata_and_kserve_errors(node: InProcNode) -> None:
    c = node.client
    server = (await c.get("/v2")).json()
    assert server["name"] == "affinity"
    assert {"binary_tensor_data", "sequence", "sequence(string_id)"} <= set(server["extensions"])
    assert (await c.get("/v2/health/live")).json() == {"live": True}
    assert (await c.get("/v2/health/ready")).status_code == 200
    for path in (f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/versions/1"):
        assert (await c.get(path)).json() == model_metadata(CONTRACT, MODEL, versions=[VERSION])
        assert (await c.get(path + "/ready")).json() == {"name": MODEL, "ready": True}
    for path, method, status, text in (
        ("/v2/models/other", "GET", 404, "unknown model: 'other'"),
        ("/v2/models/other/infer", "POST", 404, "unknown model: 'other'"),
        (f"/v2/models/{MODEL}/versions/2/infer", "POST", 404, "version 2 is not found"),
        (f"/v2/models/{MODEL}/config", "POST", 405, "use GET"),
        ("/v2/repository/index", "POST", 404, "not a KServe v2 endpoint"),
        (INFER, "GET", 405, "use POST"),
        (f"/v2/models/{MODEL}", "POST", 405, "use GET"),
        ("/v2/health/ready", "POST", 405, "use GET"),
    ):
        r = await c.request(method, path)
        assert r.status_code == status, (path, r.text)
        error = r.json()["error"]
        assert isinstance(error, str) and text in error, (path, error)
    node.service.lease.leaving = True
    try:
        r = await c.get("/v2/health/ready")
        assert r.status_code == 400 and "shutting down" in r.json()["error"]
        assert (await c.get(f"/v2/models/{MODEL}/ready")).status_code == 400
    finally:
        node.service.lease.leaving = False


@pytest.mark.anyio
async def test_a_sequence_matches_the_reference_and_ends(node: InProcNode, redis: Any) -> None:
    obs = observations(3, 6)
    ref = reference_rollout(DEMO_MODEL, obs)
    devices, tokens = set(), set()
    for i, o in enumerate(obs):
        r = await infer(node, o, sequence_id=41, sequence_start=i == 0, sequence_end=i == 5)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/octet-stream"
        result = result_of(r)
        np.testing.assert_allclose(result.as_numpy("actions"), ref[i]["actions"], rtol=1e-5)
        facts = result.get_response()["parameters"]
        assert facts["episode_id"] == "kserve:i:41" and facts["node"] == "a"
        assert facts["routing"] == ("claimed" if i == 0 else "hit")
        assert facts["state_reset"] is False
        devices.add(facts["device"])
        tokens.add(facts["token"])
        if i < 5:
            value = await redis.get(KEYS.episode("kserve:i:41"))
            assert value.startswith(f"{facts['device']} {facts['token']} ")
    assert len(devices) == 1 and len(tokens) == 1
    assert await redis.get(KEYS.episode("kserve:i:41")) is None  # sequence_end released it
    assert node.service.table.get("kserve:i:41") is None
    r = await infer(node, obs[0], sequence_id=41)
    assert r.status_code == 400 and "must specify the START flag" in r.json()["error"]


@pytest.mark.anyio
async def test_json_and_binary_give_the_same_outputs(node: InProcNode) -> None:
    obs = observations(4, 4)
    ref = reference_rollout(DEMO_MODEL, obs)
    json_out = [th.InferRequestedOutput("actions", binary_data=False)]
    for i, o in enumerate(obs):
        for seq, binary, outputs in (("bin", True, None), ("json", False, json_out)):
            r = await infer(node, o, binary=binary, outputs=outputs, sequence_id=seq,
                            sequence_start=i == 0)  # fmt: skip
            assert r.status_code == 200, r.text
            if outputs is not None:  # JSON all the way: no binary part
                assert "inference-header-content-length" not in r.headers
                assert r.json()["outputs"][0]["data"][:2] == pytest.approx(
                    ref[i]["actions"].reshape(-1)[:2].tolist(), rel=1e-5
                )
            np.testing.assert_allclose(
                result_of(r).as_numpy("actions"), ref[i]["actions"], rtol=1e-5
            )


@pytest.mark.anyio
async def test_stateless_requests_claim_nothing(node: InProcNode, redis: Any) -> None:
    obs = observations(5, 1)[0]
    for sequence in (0, ""):
        r = await infer(node, obs, sequence_id=sequence, request_id="req-1")
        assert r.status_code == 200, r.text
        response = result_of(r).get_response()
        assert response["id"] == "req-1" and response["parameters"]["routing"] == "stateless"
        assert "episode_id" not in response["parameters"]
        ref = reference_rollout(DEMO_MODEL, [obs])[0]["actions"]
        np.testing.assert_allclose(result_of(r).as_numpy("actions"), ref, rtol=1e-5)
    assert await redis.keys(KEYS.episode("*")) == []


@pytest.mark.anyio
async def test_bad_requests_are_400_and_counted(node: InProcNode, redis: Any) -> None:
    before = node.service.metrics.rejected.labels("bad_input")._value.get()
    malformed = node.service.metrics.rejected.labels("malformed")._value.get()
    r = await infer(node, np.zeros((1, 7), np.float32), sequence_id=9, sequence_start=True)
    assert r.status_code == 400 and "inputs.obs: has shape [1, 7]" in r.json()["error"]
    r = await infer(node, np.zeros((1, 8), np.float32), sequence_id=9)  # unknown sequence
    assert r.status_code == 400 and "sequence 9 to model 'demo_policy'" in r.json()["error"]
    body, length, _ = HOSTILE["header length past the body"]
    headers = {"Inference-Header-Content-Length": str(length)}
    r = await node.client.post(INFER, content=body, headers=headers)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    assert node.service.metrics.rejected.labels("bad_input")._value.get() == before + 2
    assert node.service.metrics.rejected.labels("malformed")._value.get() == malformed + 1
    assert await redis.keys(KEYS.episode("*")) == []  # nothing was claimed


@pytest.mark.anyio
async def test_a_sequence_released_behind_the_owners_back_is_not_silently_restarted(
    node: InProcNode,
) -> None:
    obs = observations(10, 2)
    r = await infer(node, obs[0], sequence_id=77, sequence_start=True)
    facts = result_of(r).get_response()["parameters"]
    await node.service.claims.release("kserve:i:77", facts["token"], reason="operator")
    assert node.service.table.get("kserve:i:77") is not None  # the owner still holds state
    # an operator's release reaches the owner at its next renewal; until then it serves on
    o = node.service.owner.flusher
    o._slid.clear()
    await node.service.owner.flush()
    r = await infer(node, obs[1], sequence_id=77)
    assert r.status_code == 200 and result_of(r).get_response()["parameters"]["seq"] == 2
    await node.service.lease.renew_once()  # the owner lets go: the sequence starts afresh
    assert node.service.table.get("kserve:i:77") is None
    r = await infer(node, obs[1], sequence_id=77)
    facts = result_of(r).get_response()["parameters"]
    assert (facts["routing"], facts["state_reset"], facts["seq"]) == ("reassigned", True, 1)


@pytest.mark.anyio
async def test_redis_unreachable_for_the_liveness_lookup_is_a_503(
    node: InProcNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    from affinity import BackendUnavailable

    async def down(episode: str, **_: Any) -> None:
        raise BackendUnavailable("redis://test", "connection refused")

    monkeypatch.setattr(node.service.claims, "resolve", down)
    unavailable = node.service.metrics.routing.labels("unavailable")._value.get()
    r = await infer(node, observations(11, 1)[0], sequence_id="blip")
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"].startswith("redis: ")
    assert node.service.metrics.routing.labels("unavailable")._value.get() == unavailable + 1


@pytest.mark.anyio
async def test_a_step_racing_its_sequences_end_never_starts_a_new_sequence(
    node: InProcNode, monkeypatch: pytest.MonkeyPatch, redis: Any
) -> None:
    """Issue 21 item 7: the END's release lands after the liveness decision began. The
    decision is the step's own resolve (one script), so the step is Triton's 400 and
    nothing is claimed; before, a lookup said "live" and the resolve then claimed anew."""
    obs = observations(13, 3)
    r = await infer(node, obs[0], sequence_id=77, sequence_start=True)
    assert r.status_code == 200, r.text
    claims = node.service.claims
    resolve = claims.resolve

    async def end_lands_first(episode: str, **kw: Any) -> Any:
        token = result_of(r).get_response()["parameters"]["token"]
        await claims.release(episode, token, owner=True)  # the END's release, just before
        return await resolve(episode, **kw)

    monkeypatch.setattr(claims, "resolve", end_lands_first)
    # the step takes the resolve path (as at a router, or before the owner's first flush):
    # at the owner an END drops the record before its release, so no step is served from it
    node.service.owner.flusher.flushed_at = float("-inf")
    plain = await infer(node, obs[1], sequence_id=77)
    assert plain.status_code == 400, plain.text
    assert "must specify the START flag" in plain.json()["error"]
    assert await redis.keys(KEYS.episode("*")) == []


@pytest.mark.anyio
async def test_concurrent_end_and_plain_steps_are_a_hit_or_triton_400(node: InProcNode) -> None:
    obs = observations(14, 4)
    for n in range(8):
        r = await infer(node, obs[0], sequence_id=f"race-{n}", sequence_start=True)
        assert r.status_code == 200, r.text
        end, plain = await asyncio.gather(
            infer(node, obs[1], sequence_id=f"race-{n}", sequence_end=True),
            infer(node, obs[2], sequence_id=f"race-{n}"),
        )
        assert end.status_code == 200, end.text
        if plain.status_code == 200:
            assert result_of(plain).get_response()["parameters"]["routing"] == "hit"
        else:
            assert plain.status_code == 400 and "START" in plain.json()["error"]


@pytest.mark.anyio
async def test_a_plain_step_behind_an_end_whose_release_is_slow_is_still_a_hit_or_400(
    node: InProcNode,
) -> None:
    """The end drops its record at once and releases it in Redis after: a plain step that
    finds the record gone asks Redis again only once that release is done, so it never hears
    Redis name the claim the end just dropped (which answered 503 owner_refused)."""
    claims = node.service.owner.claims
    release = claims.release

    async def slow(*args: Any, **kwargs: Any) -> Any:
        for _ in range(50):  # many loop turns: a slow Redis round trip for the release
            await asyncio.sleep(0)
        return await release(*args, **kwargs)

    claims.release = slow  # type: ignore[method-assign]  (this test's node only)
    obs = observations(15, 3)
    for n in range(4):
        r = await infer(node, obs[0], sequence_id=f"slow-{n}", sequence_start=True)
        assert r.status_code == 200, r.text
        end, plain = await asyncio.gather(
            infer(node, obs[1], sequence_id=f"slow-{n}", sequence_end=True),
            infer(node, obs[2], sequence_id=f"slow-{n}"),
        )
        assert end.status_code == 200, end.text
        assert plain.status_code in (200, 400), plain.text


@pytest.mark.anyio
async def test_action_chunk_execution(redis: Any) -> None:
    obs = observations(12, 5)
    chunks = [step["actions"][0] for step in reference_rollout(DEMO_MODEL, obs)]  # [4, 2]
    async with cluster(redis, [config("a", execute_steps=4)]) as (nodes, _):
        node = nodes[0]
        meta = (await node.client.get(f"/v2/models/{MODEL}")).json()
        assert meta["outputs"] == [{"name": "actions", "datatype": "FP32", "shape": [-1, 2]}]
        sources = []
        for i in range(5):  # the model runs at steps 0 and 4, on obs[0] and obs[1]
            r = await infer(node, obs[i // 4], sequence_id="chunked", sequence_start=i == 0)
            result = result_of(r)
            np.testing.assert_allclose(
                result.as_numpy("actions"), chunks[i // 4][i % 4 : i % 4 + 1], rtol=1e-5
            )
            sources.append(result.get_response()["parameters"]["source"])
        assert sources == ["model", "buffer", "buffer", "buffer", "model"]
        r = await infer(node, obs[0], sequence_id="chunked", parameters={"execute_steps": 9})
        assert r.status_code == 400 and "execute_steps" in r.json()["error"]
        r = await infer(node, obs[0], sequence_id="chunked", parameters={"execute_steps": "2"})
        assert r.status_code == 400 and "execute_steps must be an integer" in r.json()["error"]
    async with cluster(redis, [config("b")]) as (nodes, _):  # per-request override
        r = await infer(nodes[0], obs[0], sequence_id="once", sequence_start=True,
                        parameters={"execute_steps": 2})  # fmt: skip
        assert result_of(r).as_numpy("actions").shape == (1, 2)


@pytest.mark.anyio
async def test_claim_on_first_sight_when_configured(redis: Any) -> None:
    async with cluster(redis, [config("a", kserve_claim_unknown=True)]) as (nodes, _):
        r = await infer(nodes[0], observations(6, 1)[0], sequence_id="first-sight")
        assert r.status_code == 200, r.text
        assert result_of(r).get_response()["parameters"]["routing"] == "claimed"


@pytest.mark.anyio
async def test_api_key_deadline_and_capacity(redis: Any) -> None:
    cfg = config("a", api_key="k", devices="cpu:1", capacity=1)
    async with cluster(redis, [cfg]) as (nodes, _):
        node = nodes[0]
        obs = observations(7, 1)[0]
        r = await infer(node, obs, sequence_id=1, sequence_start=True)
        assert r.status_code == 401 and r.json() == {
            "error": "this node wants Authorization: Api-Key <key>"
        }
        node.client.headers["authorization"] = "Api-Key k"
        assert (await infer(node, obs, sequence_id=1, sequence_start=True)).status_code == 200
        r = await infer(node, obs, sequence_id=2, sequence_start=True)  # the one slot is taken
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"].startswith("full: ")


@pytest.mark.anyio
async def test_a_step_forwarded_to_the_owner_round_trips(redis: Any) -> None:
    cfgs = [config("a", cluster_secret="k"), config("b", cluster_secret="k")]
    async with cluster(redis, cfgs) as (nodes, _):
        a, b = nodes
        obs = observations(8, 5)
        ref = reference_rollout(DEMO_MODEL, obs)
        owners = set()
        for i, o in enumerate(obs):
            entry = (a, b)[i % 2]
            r = await infer(entry, o, sequence_id="fw", sequence_start=i == 0)
            assert r.status_code == 200, r.text
            result = result_of(r)
            np.testing.assert_allclose(result.as_numpy("actions"), ref[i]["actions"], rtol=1e-5)
            owners.add(result.get_response()["parameters"]["node"])
        assert len(owners) == 1  # one owner; every other step was forwarded to it
        assert (
            b.service.metrics.forwarded.labels("ok")._value.get()
            + a.service.metrics.forwarded.labels("ok")._value.get()
            >= 2
        )


@pytest.mark.anyio
async def test_sequence_start_starts_over_with_clean_state(node: InProcNode) -> None:
    """Needs ``Claims.resolve(restart=True)`` (a fresh token, status ``claimed``)."""
    obs = observations(9, 6)
    first = []
    for i, o in enumerate(obs[:3]):
        r = await infer(node, o, sequence_id="again", sequence_start=i == 0)
        first.append(result_of(r).get_response()["parameters"])
    ref = reference_rollout(DEMO_MODEL, obs[3:])
    for i, o in enumerate(obs[3:]):
        r = await infer(node, o, sequence_id="again", sequence_start=i == 0)
        result = result_of(r)
        facts = result.get_response()["parameters"]
        if i == 0:
            assert facts["routing"] == "claimed" and facts["token"] > first[-1]["token"]
            assert facts["state_reset"] is True  # the state held here was dropped
        np.testing.assert_allclose(result.as_numpy("actions"), ref[i]["actions"], rtol=1e-5)


# ---- tritonclient against three real nodes -----------------------------------------------


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("kserve")
    redis = RedisServer(tmp)
    nodes = [
        Node(
            tmp,
            f"k{i}",
            redis.url,
            devices="cpu:2",
            env={"AFFINITY_CLUSTER_SECRET": "s"},
            extra=["--lease-ttl", "5", "--act-deadline", "8"],
        )
        for i in range(3)
    ]
    with running(redis, nodes) as c:
        yield c


def hostport(node: Node) -> str:
    return f"{node.host}:{node.port}"


def triton(node: Node) -> th.InferenceServerClient:
    return th.InferenceServerClient(hostport(node), network_timeout=20)


def run_sequence(
    three: Cluster, sequence: int | str, obs: list[np.ndarray], seed: int, **kw: Any
) -> list[th.InferResult]:
    rng = random.Random(seed)
    clients = [triton(n) for n in three.nodes]
    try:
        return [
            rng.choice(clients).infer(
                MODEL, [obs_input(o)], sequence_id=sequence, sequence_start=i == 0, **kw
            )
            for i, o in enumerate(obs)
        ]
    finally:
        for c in clients:
            c.close()


@pytest.mark.integration
def test_tritonclient_health_and_metadata(three: Cluster) -> None:
    client = triton(three.nodes[0])
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
        assert not client.is_model_ready("other")
        meta = client.get_server_metadata()
        assert "sequence(string_id)" in meta["extensions"]
        assert client.get_model_metadata(MODEL) == model_metadata(
            CONTRACT, MODEL, versions=[VERSION]
        )
    finally:
        client.close()


@pytest.mark.integration
def test_int_and_string_sequences_stick_across_random_entry_nodes(three: Cluster) -> None:
    r = three.redis.client()
    for n, sequence in enumerate((7, "7")):  # two different sequences
        obs = observations(20 + n, 20)
        ref = reference_rollout(DEMO_MODEL, obs)
        results = run_sequence(three, sequence, obs, seed=n)
        facts = [res.get_response()["parameters"] for res in results]
        episode = "kserve:i:7" if sequence == 7 else "kserve:s:7"
        assert {f["episode_id"] for f in facts} == {episode}
        assert len({f["device"] for f in facts}) == 1
        assert [f["routing"] for f in facts] == ["claimed"] + ["hit"] * 19
        assert not any(f["state_reset"] for f in facts)
        for res, want in zip(results, ref, strict=True):
            np.testing.assert_allclose(
                res.as_numpy("actions"), want["actions"], rtol=1e-4, atol=1e-6
            )
        value = r.get(KEYS.episode(episode))
        assert value.startswith(f"{facts[0]['device']} {facts[0]['token']} ")
        shown = httpx.get(f"{three.nodes[2].url}/episodes/{episode}").json()
        assert shown["device"] == facts[0]["device"]


@pytest.mark.integration
def test_sequence_end_frees_the_slot(three: Cluster) -> None:
    r = three.redis.client()
    obs = observations(30, 4)
    results = run_sequence(three, "ends", obs[:3], seed=3)
    device = results[0].get_response()["parameters"]["device"]
    assert r.zscore(KEYS.load(device), "kserve:s:ends") is not None
    client = triton(three.nodes[1])
    try:
        last = client.infer(MODEL, [obs_input(obs[3])], sequence_id="ends", sequence_end=True)
        assert last.get_response()["parameters"]["device"] == device
        assert r.get(KEYS.episode("kserve:s:ends")) is None
        assert r.zscore(KEYS.load(device), "kserve:s:ends") is None
        with pytest.raises(InferenceServerException, match="must specify the START flag") as err:
            client.infer(MODEL, [obs_input(obs[0])], sequence_id="ends")
        assert err.value.status() == "400"
    finally:
        client.close()


@pytest.mark.integration
def test_sequence_start_over_resets_the_state(three: Cluster) -> None:
    """Needs ``Claims.resolve(restart=True)`` (a fresh token, status ``claimed``)."""
    obs = observations(40, 10)
    before = run_sequence(three, 99, obs[:5], seed=4)
    after = run_sequence(three, 99, obs[5:], seed=5)  # sequence_start on its first step
    facts = after[0].get_response()["parameters"]
    assert facts["routing"] == "claimed"
    assert facts["token"] > before[-1].get_response()["parameters"]["token"]
    for res, want in zip(after, reference_rollout(DEMO_MODEL, obs[5:]), strict=True):
        np.testing.assert_allclose(res.as_numpy("actions"), want["actions"], rtol=1e-4, atol=1e-6)


@pytest.mark.integration
def test_binary_and_json_inputs_give_the_same_outputs(three: Cluster) -> None:
    obs = observations(50, 5)
    ref = reference_rollout(DEMO_MODEL, obs)
    client = triton(three.nodes[2])
    json_out = [th.InferRequestedOutput("actions", binary_data=False)]
    try:
        for i, o in enumerate(obs):
            got = [
                client.infer(MODEL, [obs_input(o, binary=binary)], sequence_id=f"io-{k}",
                             sequence_start=i == 0, outputs=outputs).as_numpy("actions")
                for k, (binary, outputs) in enumerate(
                    ((True, None), (False, json_out), (True, json_out), (False, None))
                )
            ]  # fmt: skip
            for g in got:
                np.testing.assert_allclose(g, ref[i]["actions"], rtol=1e-4, atol=1e-6)
            np.testing.assert_array_equal(got[0], got[1])
    finally:
        client.close()


@pytest.mark.integration
def test_async_client_with_concurrent_sequences(three: Cluster) -> None:
    sequences = {1000 + k: observations(60 + k, 10) for k in range(8)}

    async def main() -> dict[int, list[th.InferResult]]:
        clients = [th_aio.InferenceServerClient(hostport(n)) for n in three.nodes]
        rng = random.Random(6)
        try:

            async def one(seq: int, obs: list[np.ndarray]) -> list[th.InferResult]:
                return [
                    await rng.choice(clients).infer(
                        MODEL, [obs_input(o)], sequence_id=seq, sequence_start=i == 0
                    )
                    for i, o in enumerate(obs)
                ]

            done = await asyncio.gather(*(one(s, o) for s, o in sequences.items()))
            return dict(zip(sequences, done, strict=True))
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(main())
    for seq, obs in sequences.items():
        facts = [res.get_response()["parameters"] for res in results[seq]]
        assert len({f["device"] for f in facts}) == 1 and facts[0]["routing"] == "claimed"
        for res, want in zip(results[seq], reference_rollout(DEMO_MODEL, obs), strict=True):
            np.testing.assert_allclose(
                res.as_numpy("actions"), want["actions"], rtol=1e-4, atol=1e-6
            )


@pytest.mark.integration
def test_errors_are_inference_server_exceptions(three: Cluster) -> None:
    client = triton(three.nodes[0])
    good = observations(70, 1)[0]
    missing = th.InferRequestedOutput("no")
    try:
        cases = [
            (lambda: client.infer("other", [obs_input(good)]), "404", "unknown model: 'other'"),
            (lambda: client.infer(MODEL, [obs_input(good)], model_version="3"), "404", "version 3"),
            (lambda: client.infer(MODEL, [obs_input(good[:, :4])]), "400", "inputs.obs: has shape"),
            (lambda: client.infer(MODEL, [obs_input(good.astype(np.int32), datatype="INT32")],
                                  sequence_id=5, sequence_start=True), "200", ""),
            (lambda: client.infer(MODEL, [obs_input(good)], sequence_id=123), "400", "START flag"),
            (lambda: client.infer(MODEL, [obs_input(good)], outputs=[missing]), "400",
             "unknown output 'no'"),
            (lambda: client.get_model_metadata("other"), "404", "unknown model"),
        ]  # fmt: skip
        for call, status, text in cases:
            if status == "200":
                call()  # INT32 into a FP32 input: converted by the policy's rule
                continue
            with pytest.raises(InferenceServerException) as err:
                call()
            assert err.value.status() == status and text in err.value.message(), err.value
    finally:
        client.close()


@pytest.mark.integration
def test_hostile_bodies_leave_the_node_healthy(three: Cluster) -> None:
    node = three.nodes[1]
    url = node.url + INFER
    with httpx.Client(timeout=10) as http:
        for case, (body, length, _) in HOSTILE.items():
            headers = {} if length is None else {"Inference-Header-Content-Length": length}
            r = http.post(url, content=body, headers=headers)
            assert r.status_code == 400, (case, r.text)
            assert isinstance(r.json()["error"], str), case
        big = np.zeros((1, 8), np.float32).tobytes()
        r = http.post(url, content=big * 100_000, headers={"Inference-Header-Content-Length": "1"})
        assert r.status_code == 400
        assert http.get(node.url + "/v2/health/ready").status_code == 200
    client = triton(node)
    try:
        obs = observations(80, 1)[0]
        got = client.infer(MODEL, [obs_input(obs)]).as_numpy("actions")
        np.testing.assert_allclose(
            got, reference_rollout(DEMO_MODEL, [obs])[0]["actions"], rtol=1e-5
        )
    finally:
        client.close()


def test_model_name_flag() -> None:
    from node.cli import parse_args

    assert parse_args(["--model", "vla-demo"], env={}).model_name == "vla_demo"
    assert parse_args([], env={"AFFINITY_MODEL_NAME": "policy"}).model_name == "policy"
    assert parse_args(["--kserve-claim-unknown"], env={}).kserve_claim_unknown is True
    with pytest.raises(SystemExit):
        parse_args(["--model-name", "a/b"], env={})
