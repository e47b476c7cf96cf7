"""Many episodes' steps in one message (issue 44), in-process on fakeredis and a real
redis-server: rows spread over several owners (one forward per owner), a row whose owner
cannot be reached, a bad row beside good ones, duplicate ids, ``--max-rows`` refused
before any decoding, and ``seq`` replays of a whole message and of one row."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from affinity import wire
from node.errors import ForwardError
from node.forward import INTERNAL_PATH, ROWS_PATH, Response
from node.protocols.act import FIELDS
from tests.conftest import RoundTrips
from tests.inproc import InProcNode, Router, cluster, config

pytestmark = pytest.mark.anyio


class Counting(Router):
    """The in-process forward pool, counting what goes where; hosts in ``broken`` break
    a message of rows after it left (no answer)."""

    def __init__(self, inner: Router) -> None:
        super().__init__()
        self.inner = inner
        self.sent: Counter[str] = Counter()
        self.broken: set[str] = set()

    async def post(self, url: str, body: bytes, path: str = INTERNAL_PATH) -> Response:
        self.sent[path] += 1
        if path == ROWS_PATH and any(h in url for h in self.broken):
            raise ForwardError("connection closed after 0 bytes of the response")
        return await self.inner.post(url, body, path)


def obs(value: float) -> list[list[float]]:
    return np.full((1, 8), value, np.float32).tolist()


async def rows(node: InProcNode, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = await node.client.post("/act", json={"steps": steps})
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()["steps"]
    assert len(out) == len(steps)
    return out


def counting(nodes: list[InProcNode], pool: Router) -> Counting:
    spy = Counting(pool)
    for n in nodes:
        n.service.router.pool = spy
    return spy


async def test_rows_over_several_owners_go_one_message_per_owner(redis: Any) -> None:
    """K rows through one node: each answered in order, sticky, numbered; the rows of
    other owners travel in one message per owner (none one by one) once their owners are
    known, and each row's reply matches its one-row reply."""
    cfgs = [config(n) for n in ("a", "b", "c")]
    async with cluster(redis, cfgs) as (nodes, pool):
        a = nodes[0]
        spy = counting(nodes, pool)
        episodes = [f"ep-{i}" for i in range(12)]
        first = await rows(a, [{"episode_id": e, "inputs": {"obs": obs(i)}}
                               for i, e in enumerate(episodes)])  # fmt: skip
        assert [r["episode_id"] for r in first] == episodes
        assert all("error" not in r and r["seq"] == 1 for r in first), first
        owners = {r["node"] for r in first}
        assert len(owners) >= 2, owners  # round-robin spreads them over the fleet
        remote = owners - {"a"}
        # new rows too: claimed (concurrently), then one message to each other owner
        assert spy.sent[ROWS_PATH] == len(remote) and spy.sent[INTERNAL_PATH] == 0, spy.sent
        spy.sent.clear()
        second = await rows(a, [{"episode_id": e, "inputs": {"obs": obs(i)}, "seq": 2}
                                for i, e in enumerate(episodes)])  # fmt: skip
        for before, after in zip(first, second, strict=True):
            assert (after["node"], after["device"], after["token"]) == (
                before["node"], before["device"], before["token"],
            )  # fmt: skip
            assert after["seq"] == 2 and after["routing"] == "hit" and not after["replayed"]
        assert spy.sent[ROWS_PATH] == len(remote) and spy.sent[INTERNAL_PATH] == 0, spy.sent
        # a row's outputs are what the model gives for its inputs, whichever way it went
        one = (await a.act(episode_id="solo", inputs={"obs": obs(3)})).json()
        assert np.allclose(one["outputs"]["actions"], first[3]["outputs"]["actions"])


async def test_new_rows_are_claimed_in_one_round_trip_to_redis(
    redis: Any, round_trips: RoundTrips
) -> None:
    """K new rows of one message (unknown to the node) are claimed together: the resolve
    script goes to Redis in one round trip, however many rows and owners; a row Redis
    refuses (a model no node registered) answers its own error beside them."""
    async with cluster(redis, [config("a"), config("b")]) as ([a, _b], _pool):
        assert a.service.claims is not None
        resolve = a.service.claims.scripts.resolve.sha
        assert (await a.act(episode_id="warm", inputs={"obs": obs(0)})).status_code == 200
        round_trips.writes.clear()  # (the script is known to Redis now)
        steps = [{"episode_id": f"new-{i}", "inputs": {"obs": obs(i)}} for i in range(8)]
        steps.insert(3, {"episode_id": "nowhere", "inputs": {"obs": obs(1)},
                         "model": "nope"})  # fmt: skip
        got = await rows(a, steps)
        assert round_trips.carrying(resolve) == 1, round_trips.writes
        assert got[3]["error"]["status"] == 404, got[3]
        assert all(r["seq"] == 1 and r["routing"] == "claimed" for r in got[:3] + got[4:]), got
        assert {r["node"] for r in got if "node" in r} == {"a", "b"}


async def test_the_openapi_schema_describes_the_list_form(redis: Any) -> None:
    """``POST /act`` in the OpenAPI document: one row or ``{"steps": [...]}``, answered
    one reply or ``{"steps": [...]}`` with a per-row error; a real message and its reply
    (a bad row beside a good one) validate against it."""
    import jsonschema

    async with cluster(redis, [config("a")]) as ([a], _pool):
        spec = (await a.client.get("/openapi.json")).json()
        body = {"steps": [{"episode_id": "o-1", "inputs": {"obs": obs(1)}, "seq": 1},
                          {"episode_id": "o-2", "inputs": {"obs": [[1.0]]}}]}  # fmt: skip
        r = await a.client.post("/act", json=body, headers={"x-affinity-timing": "1"})
        assert r.status_code == 200, r.text
        reply = r.json()
        one = {"episode_id": "o-3", "inputs": {"obs": obs(1)}, "seq": 1}
        single = (await a.client.post("/act", json=one, headers={"x-affinity-timing": "1"})).json()
    post = spec["paths"]["/act"]["post"]
    refs = "#/components/schemas/"
    asked = post["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    assert asked == [{"$ref": refs + "ActRequest"}, {"$ref": refs + "ActRows"}]
    answered = post["responses"]["200"]["content"]["application/json"]["schema"]["oneOf"]
    assert answered == [{"$ref": refs + "ActReply"}, {"$ref": refs + "ActRowsReply"}]
    schemas = spec["components"]["schemas"]
    assert schemas["ActRows"]["properties"]["steps"]["items"] == {"$ref": refs + "ActRequest"}
    rows_of = schemas["ActRowsReply"]["properties"]["steps"]["items"]["anyOf"]
    assert {"$ref": refs + "ActRowError"} in rows_of and {"$ref": refs + "ActReply"} in rows_of
    assert {"status", "code", "message"} <= set(schemas["RowError"]["required"])
    assert set(schemas["ActRequest"]["properties"]) == set(FIELDS)  # what /act's wire takes

    def check(instance: Any, model: str) -> None:
        schema = {"$ref": refs + model, "components": spec["components"]}
        jsonschema.Draft202012Validator(schema).validate(instance)

    check(body, "ActRows")
    check(reply, "ActRowsReply")
    check(single, "ActReply")
    # every field a reply (one row's or a row of many) carries is described, timing included
    described = set(schemas["ActReply"]["properties"])
    for answer in (single, reply["steps"][0]):
        assert set(answer) <= described, set(answer) - described
        assert {"seq", "replayed", "timing"} <= set(answer)
    assert {"seq", "replayed", "model", "rtc", "timing", "claim"} <= described
    assert set(schemas["Timing"]["properties"]) == {"total_ms", "queue_ms", "run_ms", "forward_ms"}
    assert reply["steps"][1]["error"]["code"] == "bad_input"
    for example in (*schemas["ActRows"]["examples"], body["steps"][0]):
        check(example, "ActRows" if "steps" in example else "ActRequest")
    with pytest.raises(jsonschema.ValidationError):  # a row is a one-step body, no more
        check({"steps": [{"episode_id": "x", "inputs": {}, "stepz": 1}]}, "ActRows")


async def test_msgpack_rows_and_stateless_rows(redis: Any) -> None:
    async with cluster(redis, [config("a"), config("b")]) as ([a, _], _pool):
        body = {"steps": [
            {"episode_id": "m-1", "inputs": {"obs": np.ones((1, 8), np.float32)}},
            {"inputs": {"obs": np.ones((1, 8), np.float32)}},  # stateless: never claimed
            {"episode_id": "m-2", "inputs": {"obs": np.ones((1, 8), np.float32)}},
        ]}  # fmt: skip
        r = await a.client.post(
            "/act",
            content=wire.encode(body),
            headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
        )
        assert r.status_code == 200, r.text
        got = wire.decode(r.content)["steps"]
        assert [g["episode_id"] for g in got] == ["m-1", None, "m-2"]
        assert got[1]["routing"] == "stateless"
        assert isinstance(got[0]["outputs"]["actions"], np.ndarray)
        assert np.array_equal(got[0]["outputs"]["actions"], got[2]["outputs"]["actions"])


async def test_a_bad_row_fails_alone(redis: Any) -> None:
    """A row whose inputs do not fit the model, or that is not a map, answers its own
    error; the rows beside it are served."""
    async with cluster(redis, [config("a"), config("b")]) as ([a, _], _pool):
        got = await rows(a, [
            {"episode_id": "g-1", "inputs": {"obs": obs(1)}},
            {"episode_id": "g-2", "inputs": {"obs": [[1.0, 2.0]]}},
            "not a row",
            {"episode_id": "g-4", "inputs": {"obs": obs(1)}},
        ])  # fmt: skip
        assert got[0]["seq"] == 1 and got[3]["seq"] == 1
        assert got[1]["error"]["status"] == 422 and got[1]["error"]["code"] == "bad_input"
        assert got[2]["error"]["status"] == 400
        got = await rows(a, [
            {"episode_id": "g-1", "inputs": {"obs": obs(1)}, "seq": 5},  # not its next step
            {"episode_id": "g-4", "inputs": {"obs": obs(1)}, "seq": 2},
        ])  # fmt: skip
        assert got[0]["error"]["status"] == 409 and got[0]["error"]["code"] == "seq_conflict"
        assert got[1]["seq"] == 2
        assert a.service.claims is not None
        assert await a.service.claims.lookup("g-2") is None  # nothing claimed for it


async def test_duplicate_episode_ids_are_refused_before_anything_runs(redis: Any) -> None:
    async with cluster(redis, [config("a")]) as ([a], _pool):
        r = await a.client.post("/act", json={"steps": [
            {"episode_id": "d-1", "inputs": {"obs": obs(1)}},
            {"episode_id": "d-2", "inputs": {"obs": obs(1)}},
            {"episode_id": "d-1", "inputs": {"obs": obs(2)}},
        ]})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_episode"
        assert "d-1" in r.json()["error"]["message"]
        assert await a.service.claims.lookup("d-1") is None
        assert await a.service.claims.lookup("d-2") is None


async def test_more_rows_than_max_rows_are_refused_before_any_decoding(redis: Any) -> None:
    """413 ``too_many_rows``: in JSON before any row's inputs are looked at (these would
    be 422), in msgpack before the body is decoded at all (these arrays would be a 400)."""
    async with cluster(redis, [config("a", max_rows=4)]) as ([a], _pool):
        bad = [{"episode_id": f"x-{i}", "inputs": {"obs": [[1.0]]}} for i in range(5)]
        r = await a.client.post("/act", json={"steps": bad})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_rows"
        broken = {b"__ndarray__": True, b"data": b"\0", b"dtype": "<f4", b"shape": [1 << 20]}
        body = msgpack.packb({"steps": [{"episode_id": f"x-{i}", "inputs": {"obs": broken}}
                                        for i in range(5)]})  # fmt: skip
        with pytest.raises(wire.WireError):
            wire.decode(body)  # what a decode would have said
        r = await a.client.post("/act", content=body,
                                headers={"content-type": "application/msgpack"})  # fmt: skip
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_rows"
        at_limit = [{"episode_id": f"ok-{i}", "inputs": {"obs": obs(0)}} for i in range(4)]
        assert all(r["seq"] == 1 for r in await rows(a, at_limit))


async def test_a_row_whose_owner_cannot_be_reached_says_so_and_the_others_answer(
    redis: Any,
) -> None:
    """The owner of some rows is gone (its connection refused), or its message of rows
    breaks after it left: only those rows answer 503 ``owner_unreachable``; the others are
    served, and a broken row's step is undone at its owner (its next step is not a gap)."""
    cfgs = [config(n) for n in ("a", "b", "c")]
    async with cluster(redis, cfgs) as (nodes, pool):
        a = nodes[0]
        spy = counting(nodes, pool)
        episodes = [f"u-{i}" for i in range(9)]
        first = await rows(a, [{"episode_id": e, "inputs": {"obs": obs(1)}, "seq": 1}
                               for e in episodes])  # fmt: skip
        where = {r["episode_id"]: r["node"] for r in first}
        assert {"b", "c"} <= set(where.values()), where
        pool.down.add("c.test")  # refused connections: never reached
        spy.broken.add("b.test")  # breaks after it left: it may have run
        got = await rows(a, [{"episode_id": e, "inputs": {"obs": obs(1)}, "seq": 2}
                             for e in episodes])  # fmt: skip
        for e, r in zip(episodes, got, strict=True):
            if where[e] == "a":
                assert r["seq"] == 2 and r["node"] == "a"
            else:
                assert r["error"]["status"] == 503, r
                assert r["error"]["code"] == "owner_unreachable"
                assert where[e] in r["error"]["message"]
        pool.down.clear()
        spy.broken.clear()
        again = await rows(a, [{"episode_id": e, "inputs": {"obs": obs(1)}, "seq": 2}
                               for e in episodes])  # fmt: skip
        for e, r in zip(episodes, again, strict=True):
            assert r["seq"] == 2 and r["node"] == where[e], r  # b's and c's: applied once


async def test_seq_replays_a_whole_message_and_one_row(redis: Any) -> None:
    """A message sent again (its reply was lost) gets every row's stored reply, no model
    run; a message retrying one row's step beside others' next steps replays that row
    alone."""
    cfgs = [config("a"), config("b")]
    async with cluster(redis, cfgs) as (nodes, _pool):
        a = nodes[0]
        episodes = [f"s-{i}" for i in range(6)]

        def message(seqs: list[int], value: float) -> list[dict[str, Any]]:
            return [{"episode_id": e, "inputs": {"obs": obs(value)}, "seq": s}
                    for e, s in zip(episodes, seqs, strict=True)]  # fmt: skip

        first = await rows(a, message([1] * 6, 1))
        replay = await rows(a, message([1] * 6, 1))
        for f, r in zip(first, replay, strict=True):
            assert "error" not in r, r
            assert r["replayed"] and r["seq"] == 1 and r["outputs"] == f["outputs"], r
        retry = message([2, 2, 2, 1, 2, 2], 2)
        retry[3]["inputs"] = {"obs": obs(1)}  # step 1 again, as it was sent
        second = await rows(a, retry)
        assert second[3]["replayed"] and second[3]["outputs"] == first[3]["outputs"]
        assert all(not r["replayed"] and r["seq"] == 2 for i, r in enumerate(second) if i != 3)
        third = await rows(a, message([3, 3, 3, 2, 3, 3], 2))  # the replayed row goes on
        assert all(not r["replayed"] for r in third)
        assert [r["seq"] for r in third] == [3, 3, 3, 2, 3, 3]


async def test_a_message_of_rows_to_an_owner_needs_the_cluster_secret(redis: Any) -> None:
    async with cluster(redis, [config("a", cluster_secret="s")]) as ([a], _pool):
        transport = httpx.ASGITransport(app=a.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://a.test") as raw:
            r = await raw.post(ROWS_PATH, content=wire.encode({"rows": [b"x"]}))
            assert r.status_code == 403 and r.json()["error"]["code"] == "bad_secret"


async def test_the_async_client_steps_many_episodes_numpy_in_numpy_out(redis: Any) -> None:
    from affinity.client import AsyncClient, StepReply

    async with cluster(redis, [config("a"), config("b")]) as ([a, _b], _pool):
        transport = httpx.ASGITransport(app=a.app)
        async with AsyncClient("http://a.test", transport=transport) as client:
            ids = [f"c-{i}" for i in range(6)]
            stacked = np.stack([np.full((1, 8), i, np.float32) for i in range(6)])
            first = await client.step_many(ids, {"obs": stacked})
            assert first.ok and [r.seq for r in first.replies] == [1] * 6  # type: ignore[union-attr]
            actions = first.stacked("actions")
            assert actions.shape[0] == 6
            solo = await client.act("solo", {"obs": stacked[4]})
            assert np.allclose(actions[4], solo.outputs["actions"])
            second = await client.step_many(ids, {"obs": stacked})
            assert all(isinstance(r, StepReply) and r.seq == 2 for r in second.replies)
            with pytest.raises(ValueError, match="distinct"):
                await client.step_many(["x", "x"], {"obs": stacked[:2]})


def test_the_client_sends_a_row_answered_503_again_with_its_seq() -> None:
    """A row that answers 503 goes again, alone, with the same ``seq`` (so a step that
    did run is replayed, never applied twice); the rows served keep their replies."""
    from affinity.client import Client, ServiceUnavailable

    bodies: list[Any] = []

    def reply(row: dict[str, Any], seq: int) -> dict[str, Any]:
        return {"outputs": {"actions": [[float(seq)]]}, "episode_id": row["episode_id"],
                "device": "a/0", "node": "a", "token": 7, "routing": "hit",
                "state_reset": False, "degraded": False, "seq": seq}  # fmt: skip

    def handler(request: httpx.Request) -> httpx.Response:
        doc = wire.decode(request.content)
        bodies.append(doc)
        out = []
        for row in doc["steps"]:
            if row["episode_id"] == "e-1" and len(bodies) == 1:
                out.append({"error": {"status": 503, "code": "owner_unreachable",
                                      "message": "gone", "retry_after": 1}})  # fmt: skip
            else:
                out.append(reply(row, row["seq"]))
        return httpx.Response(200, content=wire.encode({"steps": out}),
                              headers={"content-type": "application/msgpack"})  # fmt: skip

    with Client("http://a.test", transport=httpx.MockTransport(handler)) as client:
        client._routes.retry_budget_s = 5.0
        rows = client.step_many(["e-0", "e-1", "e-2"], {"obs": np.zeros((3, 1, 8), np.float32)})
        assert rows.ok and rows.stacked("actions").shape == (3, 1, 1)
        assert [r["episode_id"] for r in bodies[1]["steps"]] == ["e-1"]
        assert bodies[1]["steps"][0]["seq"] == bodies[0]["steps"][1]["seq"] == 1
        client._routes.retries = 0
        bodies.clear()
        again = client.step_many(["e-0", "e-1"], {"obs": np.zeros((2, 1, 8), np.float32)})
        assert [r["seq"] for r in bodies[0]["steps"]] == [2, 2]
        assert isinstance(again.replies[1], ServiceUnavailable)  # no retries left
        with pytest.raises(ServiceUnavailable):
            again.stacked("actions")


def triton_rows(obs: np.ndarray, **parameters: Any) -> tuple[bytes, dict[str, str]]:
    """The body ``tritonclient.http`` (unmodified) sends for a request of rows: the
    stacked input and the rows in custom parameters."""
    import tritonclient.http as th

    tensor = th.InferInput("obs", list(obs.shape), "FP32").set_data_from_numpy(obs)
    params = {k: v if isinstance(v, str | bool | int) else json.dumps(v)
              for k, v in parameters.items()}  # fmt: skip
    body, size = th.InferenceServerClient.generate_request_body([tensor], parameters=params)
    return body, {} if size is None else {"Inference-Header-Content-Length": str(size)}


def parsed(r: httpx.Response) -> Any:
    """What ``tritonclient.http`` makes of a reply."""
    import tritonclient.http as th

    length = r.headers.get("inference-header-content-length")
    return th.InferenceServerClient.parse_response_body(
        r.content, header_length=None if length is None else int(length)
    )


async def test_kserve_http_rows_from_the_unmodified_tritonclient(redis: Any) -> None:
    """``episode_ids`` with a leading row axis: the outputs come back stacked along it (a
    failed row's zeros), each row's facts or error in the ``rows`` parameter; the rows
    keep their sequences, ``seqs`` replays one row; duplicates and ``--max-rows`` are
    refused before the tensors are decoded."""
    infer = "/v2/models/demo_policy/infer"
    async with cluster(redis, [config("a", max_rows=8), config("b", max_rows=8)]) as (
        [a, _b],
        _pool,
    ):
        obs = np.stack([np.full((8,), i, np.float32) for i in range(5)])  # [rows, 8]
        ids = [11, 12, "thirteen", 14, 15]
        body, headers = triton_rows(obs, episode_ids=ids, sequence_starts=[True] * 5,
                                    seqs=[1] * 5)  # fmt: skip
        r = await a.client.post(infer, content=body, headers=headers)
        assert r.status_code == 200, r.text
        result = parsed(r)
        actions = result.as_numpy("actions")
        assert actions.shape[0] == 5
        rows = json.loads(result.get_response()["parameters"]["rows"])
        assert [row["episode_id"] for row in rows] == [
            "kserve:i:11", "kserve:i:12", "kserve:s:thirteen", "kserve:i:14", "kserve:i:15",
        ]  # fmt: skip
        assert {row["node"] for row in rows} == {"a", "b"}
        one = await a.act(episode_id="ref", inputs={"obs": obs[2:3].tolist()})
        assert np.allclose(actions[2], one.json()["outputs"]["actions"][0])
        # row 1 retries step 1 (same inputs), the others go on; row 3 sends a bad seq
        body, headers = triton_rows(obs, episode_ids=ids, seqs=[2, 1, 2, 9, 2])
        r = await a.client.post(infer, content=body, headers=headers)
        rows = json.loads(parsed(r).get_response()["parameters"]["rows"])
        assert rows[1]["replayed"] and rows[1]["seq"] == 1
        assert [rows[i]["seq"] for i in (0, 2, 4)] == [2, 2, 2]
        assert rows[3]["error"]["status"] == 409 and rows[3]["error"]["code"] == "seq_conflict"
        body, headers = triton_rows(obs, episode_ids=[1, 2, 1, 3, 4])
        r = await a.client.post(infer, content=body, headers=headers)
        assert r.status_code == 400 and "two rows" in r.json()["error"]
        big = np.zeros((9, 8), np.float32)
        body, headers = triton_rows(big, episode_ids=list(range(1, 10)))
        r = await a.client.post(infer, content=body, headers=headers)
        assert r.status_code == 413 and "too_many_rows" in r.json()["error"]


class _Context:
    """What the gRPC front door asks of a call's context."""

    def time_remaining(self) -> float | None:
        return None

    def cancelled(self) -> bool:
        return False

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"


async def test_kserve_grpc_rows_as_the_unmodified_tritonclient_sends_them(redis: Any) -> None:
    """The ``ModelInferRequest`` ``tritonclient.grpc`` builds with ``episode_ids`` in its
    custom parameters, through the gRPC front door: outputs stacked, ``rows`` says each
    row's facts or its own error."""
    import io

    import tritonclient.grpc as tg
    from tritonclient.grpc._utils import _get_inference_request

    from node.accesslog import AccessLog
    from node.protocols.kserve.grpc import GrpcFrontDoor
    from node.protocols.kserve.pb import kserve_pb2 as pb

    async with cluster(redis, [config("a"), config("b")]) as ([a, _b], _pool):
        door = GrpcFrontDoor(a.service, AccessLog(stream=io.StringIO()))
        obs = np.stack([np.full((8,), i, np.float32) for i in range(4)])

        def msg(**parameters: Any) -> Any:
            tensor = tg.InferInput("obs", list(obs.shape), "FP32").set_data_from_numpy(obs)
            params = {k: json.dumps(v) for k, v in parameters.items()}
            built = _get_inference_request(door.model_name, [tensor], "", "", None, 0, False,
                                           False, 0, None, params)  # fmt: skip
            return pb.ModelInferRequest.FromString(built.SerializeToString())

        got = await door.infer(msg(episode_ids=["r0", "r1", "r2", "r3"], seqs=[1, 1, 1, 1],
                                   sequence_starts=[True] * 4),
                               _Context(), "ModelInfer")  # fmt: skip
        rows = json.loads(got.parameters["rows"].string_param)
        assert all("error" not in r for r in rows), rows
        assert [r["seq"] for r in rows] == [1, 1, 1, 1] and {r["node"] for r in rows} == {"a", "b"}
        actions = np.frombuffer(got.raw_output_contents[0], np.float32).reshape(
            list(got.outputs[0].shape)
        )
        assert actions.shape[0] == 4
        solo = await a.act(episode_id="ref", inputs={"obs": obs[3:4].tolist()})
        assert np.allclose(actions[3], solo.json()["outputs"]["actions"][0])
        got = await door.infer(msg(episode_ids=["r0", "r1", "r2", "r3"], seqs=[2, 7, 1, 2]),
                               _Context(), "ModelInfer")  # fmt: skip
        rows = json.loads(got.parameters["rows"].string_param)
        assert rows[0]["seq"] == 2 and rows[3]["seq"] == 2
        assert rows[1]["error"]["code"] == "seq_conflict"
        assert rows[2]["replayed"] and rows[2]["seq"] == 1


async def openpi_frames(node: InProcNode, frames: list[bytes], answers: int) -> list[Any]:
    """Frames sent over one in-process openpi connection (no ``?episode_id=``): the
    node's answers (after the metadata), text or decoded bytes, until ``answers`` came or
    it closed."""
    import asyncio
    import io

    from node.accesslog import AccessLog
    from node.protocols import openpi

    incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    incoming.put_nowait({"type": "websocket.connect"})
    for frame in frames:
        incoming.put_nowait({"type": "websocket.receive", "bytes": frame})
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] in ("websocket.send", "websocket.close") and len(sent) == answers + 2:
            incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})

    scope = {"type": "websocket", "path": "/", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 1)}  # fmt: skip
    access = AccessLog(stream=io.StringIO())
    await asyncio.wait_for(openpi.handle(node.service, scope, incoming.get, send, access), 30)
    out: list[Any] = []
    for m in sent[2:]:
        if m["type"] == "websocket.send":
            out.append(wire.decode(m["bytes"]) if m.get("bytes") is not None else m["text"])
    return out


async def test_openpi_rows_in_one_observation_from_the_openpi_client_wire(redis: Any) -> None:
    """An observation (packed by ``openpi-client``'s own ``msgpack_numpy``) with
    ``episode_ids`` and a leading environment axis: ``actions`` stacked ``[K, H, D]``,
    ``rows`` each environment's facts or error; a bad row does not close the connection;
    duplicate ids do (the frame's error)."""
    from openpi_client import msgpack_numpy

    async with cluster(redis, [config("a"), config("b")]) as ([a, _b], _pool):
        envs = np.stack([np.full(8, i, np.float64) for i in range(4)])
        ids = ["env-0", "env-1", "env-2", "env-3"]
        first = msgpack_numpy.packb({"obs": envs, "episode_ids": ids, "seq": [1, 1, 1, 1]})
        second = msgpack_numpy.packb({"obs": envs, "episode_ids": ids, "seq": [2, 2, 1, 9]})
        dup = msgpack_numpy.packb({"obs": envs, "episode_ids": ["x", "y", "x", "z"]})
        got = await openpi_frames(a, [first, second, dup], 3)
        one, two, refused = got
        assert [r["seq"] for r in one["rows"]] == [1, 1, 1, 1]
        assert {r["node"] for r in one["rows"]} == {"a", "b"}
        assert one["actions"].shape[0] == 4
        ref = await a.act(episode_id="ref", inputs={"obs": envs[1:2].tolist()})
        assert np.allclose(one["actions"][1], ref.json()["outputs"]["actions"][0])
        assert [r.get("seq") for r in two["rows"][:3]] == [2, 2, 1]
        assert two["rows"][2]["replayed"] and np.allclose(two["actions"][2], one["actions"][2])
        assert two["rows"][3]["error"]["code"] == "seq_conflict"
        assert not two["actions"][3].any()  # a failed row's zeros
        assert isinstance(refused, str) and "duplicate_episode" in refused


@pytest.mark.parametrize("inline_under_us", [0.0, 1_000_000.0], ids=["worker", "inline"])
async def test_rows_on_one_device_share_model_runs(
    redis: Any, inline_under_us: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows of one message on one device join its batches, on the entry node and at
    another owner: fewer model runs than rows (``affinity_batch_size``: its sum is the
    steps, its count the runs). Also where a lone step would run inline on the event loop
    (a quick model on a CPU): a message's first row never runs alone while the others are
    on their way."""
    import re

    import node.worker

    # the episodes of the first message stay "recent" (expected to step again) however long
    # a busy machine takes between the two messages (the worker's window is 1 s)
    monkeypatch.setattr(node.worker, "_RECENT_S", 600.0)

    async def runs(node: InProcNode, device: str) -> tuple[float, float]:
        text = (await node.client.get("/metrics")).text
        count = re.search(rf'^affinity_batch_size_count\{{device="{device}"\}} (\S+)', text, re.M)
        total = re.search(rf'^affinity_batch_size_sum\{{device="{device}"\}} (\S+)', text, re.M)
        return (0.0, 0.0) if count is None or total is None else (
            float(count.group(1)), float(total.group(1)))  # fmt: skip

    # a window that a busy machine cannot outrun
    cfgs = [config(n, devices="cpu:1", max_batch=16, inline_under_us=inline_under_us,
                   batch_delay_us=50_000) for n in ("a", "b")]  # fmt: skip
    async with cluster(redis, cfgs) as ([a, b], _pool):
        steps = [{"episode_id": f"b-{i}", "inputs": {"obs": obs(i)}} for i in range(16)]
        first = await rows(a, steps)
        on = Counter(r["node"] for r in first)
        assert on["a"] >= 2 and on["b"] >= 2, on
        before = [await runs(a, "a/0"), await runs(b, "b/0")]
        await rows(a, steps)
        after = [await runs(a, "a/0"), await runs(b, "b/0")]
        for node, (ran0, steps0), (ran1, steps1) in zip("ab", before, after, strict=True):
            ran, stepped = ran1 - ran0, steps1 - steps0
            assert stepped == on[node] and ran < stepped, (node, ran, stepped)


async def test_each_row_keeps_its_action_chunk(redis: Any) -> None:
    """Action-chunk execution per row (``execute_steps``), wherever its owner is: the
    first step runs the model, the next comes from that row's own buffer."""
    async with cluster(redis, [config("a"), config("b")]) as ([a, _b], _pool):
        steps = [{"episode_id": f"k-{i}", "inputs": {"obs": obs(i)}, "execute_steps": 2}
                 for i in range(6)]  # fmt: skip
        first = await rows(a, steps)
        second = await rows(a, steps)
        assert {r["node"] for r in first} == {"a", "b"}
        assert [r["source"] for r in first] == ["model"] * 6
        assert [r["source"] for r in second] == ["buffer"] * 6
        for one, two in zip(first, second, strict=True):  # the chunk's next action
            assert one["outputs"] != two["outputs"] and one["token"] == two["token"]


async def test_openpi_rows_wait_out_a_transient_owner_as_one_row_steps_do(redis: Any) -> None:
    """openpi clients cannot retry: a row whose owner cannot be reached for a moment is
    retried inside the node within the deadline (as a one-row openpi step is), and the
    frame answers every row."""
    import asyncio

    from openpi_client import msgpack_numpy

    cfgs = [config("a", act_deadline_s=10.0), config("b", act_deadline_s=10.0)]
    async with cluster(redis, cfgs) as ([a, _b], pool):
        envs = np.stack([np.full(8, i, np.float64) for i in range(6)])
        ids = [f"w-{i}" for i in range(6)]
        first = (
            await openpi_frames(a, [msgpack_numpy.packb({"obs": envs, "episode_ids": ids})], 1)
        )[0]
        assert "b" in {r["node"] for r in first["rows"]}
        pool.down.add("b.test")

        async def back() -> None:
            await asyncio.sleep(0.3)
            pool.down.clear()

        healing = asyncio.create_task(back())
        frame = msgpack_numpy.packb({"obs": envs, "episode_ids": ids})
        got = (await openpi_frames(a, [frame], 1))[0]
        await healing
        assert all("error" not in r for r in got["rows"]), got["rows"]
        assert [r["node"] for r in got["rows"]] == [r["node"] for r in first["rows"]]


async def test_a_lone_row_served_here_runs_inline_as_a_one_row_step(
    redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message with one row served here (alone, or beside rows of other owners) opens
    no arrival: its row runs inline where a one-row step would (a quick model on a CPU),
    instead of paying the hand-off to the worker's thread for a batch nobody joins."""
    from node.worker import DeviceWorker

    inline: list[bool] = []
    real = DeviceWorker.run_inline

    def spy(self: DeviceWorker, job: Any) -> bool:
        ran = real(self, job)
        inline.append(ran)
        return ran

    monkeypatch.setattr(DeviceWorker, "run_inline", spy)
    cfgs = [config("a", devices="cpu:1", inline_under_us=1_000_000.0)]
    async with cluster(redis, cfgs) as ([a], _pool):

        async def plain(i: int) -> None:
            r = await a.act(episode_id="plain", inputs={"obs": obs(i)})
            assert r.status_code == 200, r.text

        async def lone(i: int) -> None:
            got = await rows(a, [{"episode_id": "lone", "inputs": {"obs": obs(i)}}])
            assert "error" not in got[0], got

        for send in (plain, lone):
            # the claim is an arrival of its own, and a step right after a run on the
            # worker's thread may find it still busy: step until one ran inline (then the
            # worker's thread has nothing left), and the next ones run inline too
            inline.clear()
            for i in range(20):
                await send(i)
                if inline and inline[-1]:
                    break
            inline.clear()
            for i in range(2):
                await send(i)
            assert inline == [True, True], (send.__name__, inline)


async def test_together_counts_a_message_until_each_row_is_on_its_way() -> None:
    """``node.jobs.together``: each row's first step runs while the message still counts
    as an arrival (so a worker waits for the rows instead of running the first alone);
    then it counts no more; cancelled, every row is cancelled and has ended first."""
    import asyncio

    from node.jobs import Arrivals, together

    arrivals = Arrivals()
    seen: list[int] = []
    go = asyncio.Event()

    async def row(i: int) -> int:
        seen.append(arrivals.count)
        await go.wait()
        return i

    task = asyncio.create_task(together(arrivals, [row(i) for i in range(3)]))
    for _ in range(3):
        await asyncio.sleep(0)
    assert seen == [1, 1, 1] and arrivals.count == 0
    go.set()
    assert await task == [0, 1, 2]

    ended: list[int] = []

    async def stuck(i: int) -> int:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(i)
        return i

    seen.clear()  # one row served here: no arrival, so it may run inline as a lone step
    assert await together(arrivals, [row(9)], batch=False) == [9]
    assert seen == [0] and arrivals.count == 0

    task = asyncio.create_task(together(arrivals, [stuck(i) for i in range(3)]))
    for _ in range(3):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(ended) == [0, 1, 2] and arrivals.count == 0
