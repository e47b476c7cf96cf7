"""The node's HTTP API in process: real ONNX Runtime on the CPU with the demo policy,
fakeredis and a real Redis (same bodies)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from affinity import Keys
from affinity.registry import MoveRequest
from node.asgi import header, header_values
from node.forward import SECRET_HEADER as SECRET
from node.forward import Forward
from node.models import DEMO_MODEL
from node.step import Step
from tests.conftest import new_fleet
from tests.inproc import Gate, InProcNode, Router, cluster, config
from tests.rollout import reference_rollout

pytestmark = pytest.mark.anyio
KEYS = Keys()


async def slid(node: InProcNode) -> None:
    """The owner's flush with every episode it holds due for a slide."""
    o = node.service.owner.flusher
    o._slid.clear()
    await node.service.owner.flush()


def forward(episode: str, token: int, device: str, routing: str) -> bytes:
    obs = np.zeros((1, 8), np.float32)
    return Forward(Step(episode, {"obs": obs}, 0.0), token, device, routing, budget_s=2.0).encode()


def observations(seed: int, n: int = 20) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


@pytest.fixture
async def node(redis: Any) -> AsyncIterator[InProcNode]:
    async with cluster(redis, [config("a", admin_token="s3cret")]) as (nodes, _):
        yield nodes[0]


@pytest.fixture
async def two(redis: Any) -> AsyncIterator[tuple[list[InProcNode], Router]]:
    cfgs = [config("a", cluster_secret="k"), config("b", cluster_secret="k")]
    async with cluster(redis, cfgs) as pair:
        yield pair


async def snapshot(redis: Any) -> dict[str, Any]:
    """The keyspace a request could write. The node's own upkeep runs whenever it is due
    (a renewal re-scores the node and ring sorted sets, the fleet view is rewritten), so
    those scores and the view are left out: a slow machine must not fail the comparison."""
    from tests.conftest import Env

    snap = await Env(redis, None, None, None).snapshot()  # type: ignore[arg-type]
    for key, value in list(snap.items()):
        if key in (KEYS.view, KEYS.view_reader):
            del snap[key]
        elif (
            isinstance(value, list)
            and not key.startswith(KEYS.load(""))
            and all(isinstance(m, list | tuple) and len(m) == 2 for m in value)
        ):
            snap[key] = [m[0] for m in value]  # a sorted set's members, not their scores
    return snap


def test_header_values_reads_each_first_value_as_header_does_in_one_pass() -> None:
    scope = {
        "headers": [(b"accept", b"a"), (b"x-other", b"o"), (b"accept", b"b"),
                    (b"authorization", b"Api-Key \xe9")],
    }  # fmt: skip
    names = (b"content-type", b"accept", b"authorization")
    assert header_values(scope, names) == [None, "a", "Api-Key \xe9"]
    assert header_values(scope, names) == [header(scope, n) for n in names]


async def test_episode_matches_reference(node: InProcNode) -> None:
    obs = observations(1)
    ref = reference_rollout(DEMO_MODEL, obs)
    devices = set()
    for i, o in enumerate(obs):
        r = await node.act(episode_id="ep-1", inputs={"obs": o.tolist()})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["routing"] == ("claimed" if i == 0 else "hit")
        assert body["state_reset"] is False
        np.testing.assert_allclose(body["outputs"]["actions"], ref[i]["actions"], rtol=1e-5)
        devices.add(body["device"])
        assert r.headers["x-affinity-device"] == body["device"]
        assert r.headers["x-affinity-token"] == str(body["token"])
    assert len(devices) == 1


async def test_interleaved_episodes_on_one_device(redis: Any) -> None:
    async with cluster(redis, [config("a", devices="cpu:1")]) as (nodes, _):
        n = nodes[0]
        oa, ob = observations(2), observations(3)
        ra, rb = reference_rollout(DEMO_MODEL, oa), reference_rollout(DEMO_MODEL, ob)
        for i in range(20):
            a = (await n.act(episode_id="a", inputs={"obs": oa[i].tolist()})).json()
            b = (await n.act(episode_id="b", inputs={"obs": ob[i].tolist()})).json()
            assert a["device"] == b["device"] == "a/0"
            np.testing.assert_allclose(a["outputs"]["actions"], ra[i]["actions"], rtol=1e-5)
            np.testing.assert_allclose(b["outputs"]["actions"], rb[i]["actions"], rtol=1e-5)


async def test_token_change_resets_state(node: InProcNode, redis: Any) -> None:
    obs = observations(4)
    ref = reference_rollout(DEMO_MODEL, obs)
    first = (await node.act(episode_id="ep", inputs={"obs": obs[0].tolist()})).json()
    await node.act(episode_id="ep", inputs={"obs": obs[1].tolist()})
    # as if the episode had been claimed anew elsewhere and back: same device, new token;
    # the owner serves from memory until its next slide of the episode finds it changed
    await redis.set(KEYS.episode("ep"), f"{first['device']} {first['token'] + 5}", px=60_000)
    await slid(node)
    r = (await node.act(episode_id="ep", inputs={"obs": obs[0].tolist()})).json()
    assert r["state_reset"] is True and r["token"] == first["token"] + 5
    np.testing.assert_allclose(r["outputs"]["actions"], ref[0]["actions"], rtol=1e-5)


BAD = [
    ({"episode_id": "e", "inputs": {}}, 422, "inputs.obs"),
    ({"episode_id": "e", "inputs": {"obs": [[1] * 8], "zzz": [1]}}, 422, "inputs.zzz"),
    ({"episode_id": "e", "inputs": {"obs": [[1] * 7]}}, 422, "inputs.obs"),
    ({"episode_id": "e", "inputs": {"obs": [["a"] * 8]}}, 422, "inputs.obs"),
    ({"episode_id": "e", "inputs": {"obs": [[1e39] * 8]}}, 422, "inputs.obs"),
    (
        {"episode_id": "e", "inputs": {"obs": [[1] * 8], "state_in.hidden": [[0] * 16]}},
        422,
        "inputs.state_in.hidden",
    ),
    ({"episode_id": "x" * 513, "inputs": {"obs": [[1] * 8]}}, 422, "episode_id"),
    ({"episode_id": "", "inputs": {"obs": [[1] * 8]}}, 422, "episode_id"),
    ({"episode_id": 5, "inputs": {"obs": [[1] * 8]}}, 422, "episode_id"),
    ({"episode_id": "e"}, 422, "inputs"),
]


async def test_bad_input_changes_nothing(node: InProcNode, redis: Any) -> None:
    ok = await node.act(episode_id="kept", inputs={"obs": [[0.5] * 8]})
    before = await snapshot(redis)
    for body, status, field in BAD:
        r = await node.act(**body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["field"].startswith(field), (body, err)
    for raw in [
        b"{not json",
        b"[1,2]",
        b"[" * 100_000 + b"]" * 100_000,
        b"\xff\xfe",
        b'{"inputs": {"obs": [[NaN, 1, 1, 1, 1, 1, 1, 1]]}, "episode_id": "e"}',
        b'{"inputs": {"obs": [[1e400, 1, 1, 1, 1, 1, 1, 1]]}, "episode_id": "e"}',
        rb'{"episode_id": "\u0000\ud800", "inputs": {"obs": [[1,1,1,1,1,1,1,1]]}}',
    ]:
        r = await node.client.post("/act", content=raw)
        assert r.status_code in (400, 422), (raw[:20], r.text)
    big = b'{"inputs": {"obs": [' + b"1," * 9_000_000 + b"1]}}"
    r = await node.client.post("/act", content=big)
    assert r.status_code == 413
    assert await snapshot(redis) == before
    s = node.service
    assert all(s.health.tracker(d).failures == 0 for d in s.device_ids)
    again = await node.act(episode_id="kept", inputs={"obs": [[0.5] * 8]})
    assert again.json()["token"] == ok.json()["token"] and again.json()["routing"] == "hit"
    assert (await node.client.get("/healthz")).status_code == 200


async def test_full_is_503_with_retry_after(redis: Any) -> None:
    async with cluster(redis, [config("a", devices="cpu:1", capacity=1)]) as (nodes, _):
        n = nodes[0]
        assert (await n.act(episode_id="one", inputs={"obs": [[0] * 8]})).status_code == 200
        r = await n.act(episode_id="two", inputs={"obs": [[0] * 8]})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "full"


async def test_degraded_and_stateless(node: InProcNode, redis: Any) -> None:
    r = (await node.act(session_id="s-1", inputs={"obs": [[0.1] * 8]})).json()
    assert r["degraded"] is True and r["routing"] == "claimed" and r["episode_id"] == "s-1"
    assert await redis.get(KEYS.episode("s-1")) is not None
    before = await snapshot(redis)
    r = await node.act(inputs={"obs": [[0.1] * 8]})
    assert r.status_code == 200 and r.json()["routing"] == "stateless"
    assert r.json()["episode_id"] is None
    assert await snapshot(redis) == before


async def test_end_releases(node: InProcNode, redis: Any) -> None:
    r = (await node.act(episode_id="e1", inputs={"obs": [[0] * 8]}, end=True)).json()
    assert await redis.get(KEYS.episode("e1")) is None
    assert node.service.table.get("e1") is None
    await node.act(episode_id="e2", inputs={"obs": [[0] * 8]})
    got = await node.client.get("/episodes/e2")
    assert got.status_code == 200 and got.json()["node"] == "a"
    assert (await node.client.post("/episodes/e2/end")).json()["released"] is True
    assert (await node.client.get("/episodes/e2")).status_code == 404
    assert (await node.client.post("/episodes/e2/end")).status_code == 404
    assert r["routing"] == "claimed"


async def test_admin_endpoints(node: InProcNode, redis: Any) -> None:
    url = "/devices/a/0/drain"
    assert (await node.client.post(url)).status_code == 401
    r = await node.client.post(url, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "wrong admin token"
    r = await node.client.post(
        url, params={"reason": "fan"}, headers={"Authorization": "Bearer s3cret"}
    )
    assert r.status_code == 200 and r.json() == {
        "device": "a/0",
        "state": "draining",
        "previous": "active",
    }
    devices = {d["device"]: d for d in (await node.client.get("/devices")).json()["devices"]}
    assert devices["a/0"]["state"] == "draining" and devices["a/0"]["reason"] == "fan"
    assert devices["a/0"]["provider"] == "CPUExecutionProvider"
    r = await node.client.post("/devices/zz/9/drain", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 404
    r = await node.client.post("/devices/a/0/undrain", headers={"Authorization": "Bearer s3cret"})
    assert r.json()["state"] == "active"
    # with move=true its node is asked to move the device's episodes, with their state
    asked: list[tuple[str, Any]] = []
    registry = node.service.registry
    request_move = registry.request_move

    async def spy(who: str, move: Any) -> None:
        asked.append((who, move))
        await request_move(who, move)

    registry.request_move = spy  # type: ignore[method-assign]
    r = await node.client.post(
        "/devices/a/1/drain", params={"move": "true"}, headers={"Authorization": "Bearer s3cret"}
    )
    registry.request_move = request_move  # type: ignore[method-assign]
    assert r.json() == {"device": "a/1", "state": "draining", "previous": "active", "move": True}
    assert asked == [("a", MoveRequest(device="a/1"))]
    r = await node.client.post(
        "/devices/a/0/drain", params={"move": "yes"}, headers={"Authorization": "Bearer s3cret"}
    )
    assert r.status_code == 422 and r.json()["error"]["field"] == "move"
    devices = {d["device"]: d for d in (await node.client.get("/devices")).json()["devices"]}
    assert devices["a/0"]["state"] == "active"  # a bad request changes nothing


async def test_admin_refused_without_configured_token(redis: Any) -> None:
    async with cluster(redis, [config("a")]) as (nodes, _):
        r = await nodes[0].client.post(
            "/devices/a/0/drain", headers={"Authorization": "Bearer anything"}
        )
        assert r.status_code == 403 and "AFFINITY_ADMIN_TOKEN" in r.text


async def test_any_node_serves_any_episode(two: tuple[list[InProcNode], Router]) -> None:
    (a, b), _ = two
    obs = observations(5, 10)
    ref = reference_rollout(DEMO_MODEL, obs)
    owners = set()
    for i, o in enumerate(obs):
        via = (a, b)[i % 2]
        r = await via.act(episode_id="ep", inputs={"obs": o.tolist()})
        assert r.status_code == 200, r.text
        body = r.json()
        owners.add(body["device"])
        np.testing.assert_allclose(body["outputs"]["actions"], ref[i]["actions"], rtol=1e-5)
        assert body["state_reset"] is False
    assert len(owners) == 1


async def test_forward_needs_the_secret(two: tuple[list[InProcNode], Router]) -> None:
    (a, _), _ = two
    body = forward("e", 1, "a/0", "claimed")
    for secret in ("wrong", ""):
        r = await a.client.post("/internal/act", content=body, headers={SECRET: secret})
        assert r.status_code == 403 and r.json()["error"]["code"] == "bad_secret"


async def test_a_ghost_step_needs_the_secret(two: tuple[list[InProcNode], Router]) -> None:
    (a, _), _ = two
    for secret in ("wrong", ""):
        r = await a.client.post("/internal/ghost", content=b"\x80", headers={SECRET: secret})
        assert r.status_code == 403 and r.json()["error"]["code"] == "bad_secret"
    r = await a.client.post("/internal/ghost", content=b"\x80", headers={SECRET: "k"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_forward"


async def test_unreachable_owner_gets_503_never_a_second_owner(
    two: tuple[list[InProcNode], Router], redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "affinity.node")
    (a, _), router = two
    first = None
    for i in range(4):  # find an episode owned by b
        r = (await a.act(episode_id=f"ep{i}", inputs={"obs": [[0] * 8]})).json()
        if r["node"] == "b":
            first = r
            break
    assert first is not None
    router.down.add("b.test")
    r = await a.act(episode_id=first["episode_id"], inputs={"obs": [[0] * 8]})
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "owner_unreachable"
    value = await redis.get(KEYS.episode(first["episode_id"]))
    assert value.startswith(f"{first['device']} {first['token']} ")
    again = await a.act(episode_id=first["episode_id"], inputs={"obs": [[0] * 8]})
    assert again.status_code == 503
    warnings = [r.getMessage() for r in caplog.records if r.name == "affinity.node"]
    assert len([w for w in warnings if "owner b (http://b.test" in w]) == 1, warnings  # once
    assert (
        "is unreachable" in warnings[-1] and "until it answers or its lease lapses" in warnings[-1]
    )
    router.down.discard("b.test")
    back = await a.act(episode_id=first["episode_id"], inputs={"obs": [[0] * 8]})
    assert back.status_code == 200 and back.json()["node"] == "b"
    recovered = [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()]
    assert recovered == ["owner b answers again (2 forward(s) failed meanwhile)"]


async def test_fenced_node_refuses_then_reregisters(node: InProcNode, redis: Any) -> None:
    await node.act(episode_id="ep", inputs={"obs": [[0] * 8]})
    s = node.service
    s.lease.deadline = s.clock() - 0.01  # as if renewals had failed for a whole lease
    r = await node.act(episode_id="ep", inputs={"obs": [[0] * 8]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "fenced"
    assert s.table.get("ep") is not None  # a query never acts: the renewal loop fences
    assert s.lease.fence() and s.table.get("ep") is None
    assert (await node.client.get("/readyz")).status_code == 503
    await redis.delete(KEYS.node("a"))  # the lease lapsed in Redis too
    await s.lease.renew_once()
    r = await node.act(episode_id="ep", inputs={"obs": [[0] * 8]})
    assert r.status_code == 200 and r.json()["state_reset"] is True


async def test_model_endpoint(node: InProcNode) -> None:
    body = (await node.client.get("/model")).json()
    assert body["inputs"] == [{"name": "obs", "shape": [1, 8], "dtype": "float32"}]
    assert body["state"] == {"state_in.hidden": "state_out.hidden"}


async def test_concurrent_requests_one_episode_stay_consistent(node: InProcNode) -> None:
    rs = await asyncio.gather(
        *(node.act(episode_id="same", inputs={"obs": [[0.1] * 8]}) for _ in range(10))
    )
    assert {r.json()["device"] for r in rs} == {rs[0].json()["device"]}
    assert sorted(r.json()["routing"] for r in rs).count("claimed") == 1


async def test_lost_assignment_is_a_reset_when_the_client_echoes_its_token(
    node: InProcNode, redis: Any
) -> None:
    first = (await node.act(episode_id="ep", inputs={"obs": [[0.3] * 8]})).json()
    await redis.delete(KEYS.episode("ep"))  # as after a failover that lost the last claim
    await slid(node)  # the owner's next slide of it finds it gone: it drops it
    r = (await node.act(episode_id="ep", inputs={"obs": [[0.3] * 8]}, token=first["token"])).json()
    assert r["routing"] == "claimed" and r["token"] > first["token"]
    assert r["state_reset"] is True
    again = (await node.act(episode_id="ep", inputs={"obs": [[0.3] * 8]}, token=r["token"])).json()
    assert again["state_reset"] is False
    bad = await node.act(episode_id="ep", inputs={"obs": [[0.3] * 8]}, token="x")
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "token"


async def test_owner_refuses_a_forward_for_an_assignment_redis_no_longer_has(
    two: tuple[list[InProcNode], Router], redis: Any
) -> None:
    (_, b), _ = two
    body = forward("gone", 12345, "b/0", "hit")
    r = await b.client.post("/internal/act", content=body, headers={SECRET: "k"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_token"
    assert b.service.table.get("gone") is None


async def test_lease_running_out_during_the_step_is_a_503(redis: Any) -> None:
    from node.devices import DeviceSpec
    from node.models import DEMO_MODEL
    from node.providers import ProviderSettings, build_session

    services: list[Any] = []

    class Slow:
        def __init__(self, spec: DeviceSpec) -> None:
            self.inner = build_session(DEMO_MODEL, spec, ProviderSettings()).session

        def run(self, names: Any, feed: Any) -> Any:
            if services and services[0].lease.deadline > 0 and feed["obs"][0][0] == 9:
                services[0].lease.deadline = services[0].clock() - 1  # time passes
            return self.inner.run(names, dict(feed))

    async with cluster(
        redis, [config("a", devices="cpu:1")], session_factory=lambda spec: (Slow(spec), "CPU")
    ) as (nodes, _):
        n = nodes[0]
        services.append(n.service)
        assert (await n.act(episode_id="ep", inputs={"obs": [[0] * 8]})).status_code == 200
        r = await n.act(episode_id="ep", inputs={"obs": [[9] * 8]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "fenced"
        record = n.service.table.get("ep")
        assert record is not None and record.seq == 1  # the step answered 503 is undone
        assert n.service.lease.fence() and n.service.table.get("ep") is None


async def test_renewal_reconciles_down_with_the_crash_tracker(node: InProcNode, redis: Any) -> None:
    s = node.service
    # a 'down' that the tracker does not hold (its 'up' write was lost): restored
    await redis.hset(KEYS.device("a/0"), mapping={"state": "down", "prev_state": "active"})
    await s.lease.renew_once()
    assert await redis.hget(KEYS.device("a/0"), "state") == "active"
    # a crash the registry never heard of: written again
    tracker = s.health.tracker("a/1")
    tracker.failure("boom")
    tracker.failure("boom")
    tracker.failure("boom")
    await s.lease.renew_once()
    assert await redis.hget(KEYS.device("a/1"), "state") == "down"


async def test_episode_ids_with_slashes_and_errors_in_the_projects_shape(node: InProcNode) -> None:
    r = await node.act(episode_id="robot/7/ep 1", inputs={"obs": [[0.1] * 8]})
    assert r.status_code == 200
    got = await node.client.get("/episodes/robot/7/ep%201")
    assert got.status_code == 200 and got.json()["episode_id"] == "robot/7/ep 1"
    assert got.json()["device"] == r.json()["device"]
    ended = await node.client.post("/episodes/robot/7/ep%201/end")
    assert ended.status_code == 200 and ended.json()["released"] is True
    assert (await node.client.get("/episodes/robot/7/ep%201")).status_code == 404
    for method, path, status in [
        ("GET", "/no/such/path", 404),
        ("GET", "/act", 405),
        ("DELETE", "/healthz", 405),
        ("GET", "/internal/act", 405),
    ]:
        r = await node.client.request(method, path)
        assert r.status_code == status, (method, path, r.text)
        assert set(r.json()["error"]) >= {"code", "message"}, r.text


async def test_an_unknown_top_level_field_is_refused_by_name(node: InProcNode, redis: Any) -> None:
    before = await snapshot(redis)
    r = await node.act(episodeId="typo", inputs={"obs": [[0.1] * 8]})
    assert r.status_code == 422
    assert r.json()["error"]["field"] == "episodeId"
    assert r.json()["error"]["message"].startswith("unknown field 'episodeId'; expected: ")
    assert await snapshot(redis) == before


async def test_a_forwarded_step_past_the_routers_budget_keeps_no_state(redis: Any) -> None:
    cfgs = [config("a", cluster_secret="k"), config("b", cluster_secret="k")]
    Gate.go.clear()
    Gate.entered.clear()
    async with cluster(redis, cfgs, session_factory=lambda s: (Gate(s), "CPU")) as (nodes, _):
        a, b = nodes
        first = None
        for i in range(8):
            first = (await a.act(episode_id=f"bud{i}", inputs={"obs": [[0.5] * 8]})).json()
            if first["node"] == "b":
                break
        assert first is not None and first["node"] == "b"
        ep, obs = first["episode_id"], observations(9)
        # the owner gets what is left of the router's deadline: here, 0.3 s
        claim = (await redis.get(KEYS.episode(ep))).split(" ")[2]
        body = Forward(Step(ep, {"obs": np.full((1, 8), 9, np.float32)}, 0.0),
                       first["token"], first["device"], "hit", budget_s=0.3,
                       claim=claim).encode()  # fmt: skip
        r = await b.client.post("/internal/act", content=body, headers={SECRET: "k"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "deadline"
        assert Gate.entered.is_set()
        Gate.go.set()  # the run ends after its budget: its state must not be kept
        # the next step queues behind the late run on the same device and must see the
        # state of the first step, not of the step the router was told failed
        again = await a.act(episode_id=ep, inputs={"obs": obs[0].tolist()}, token=first["token"])
        assert again.status_code == 200 and again.json()["state_reset"] is False
        ref = reference_rollout(DEMO_MODEL, [np.full((1, 8), 0.5, np.float32), obs[0]])
        np.testing.assert_allclose(again.json()["outputs"]["actions"], ref[1]["actions"], rtol=1e-5)


async def test_the_router_forwards_only_what_is_left_of_its_deadline(redis: Any) -> None:
    cfgs = [config("a", cluster_secret="k", act_deadline_s=2.0), config("b", cluster_secret="k")]
    async with cluster(redis, cfgs) as (nodes, router):
        a, _ = nodes
        sent: list[Forward] = []
        post = router.post

        async def spy(url: str, body: bytes) -> Any:
            sent.append(Forward.decode(body))
            return await post(url, body)

        router.post = spy  # type: ignore[method-assign]
        resolve = a.service.claims.resolve

        async def stalled(episode: str, **kw: Any) -> Any:
            await asyncio.sleep(0.6)  # Redis stalls during the router's resolve
            return await resolve(episode, **kw)

        for i in range(8):
            r = (await a.act(episode_id=f"st{i}", inputs={"obs": [[0.5] * 8]})).json()
            if r["node"] == "b":
                break
        a.service.claims.resolve = stalled  # type: ignore[method-assign]
        a.service.router.locator._hints.clear()  # so that it resolves (a hint skips Redis)
        sent.clear()
        assert (
            await a.act(episode_id=r["episode_id"], inputs={"obs": [[0.5] * 8]})
        ).status_code == 200
        assert len(sent) == 1 and sent[0].budget_s <= 2.0 - 0.6


async def test_an_owner_obeys_redis_when_tokens_differ(
    two: tuple[list[InProcNode], Router], redis: Any
) -> None:
    (a, b), _ = two
    obs = observations(11)
    for i in range(8):
        first = (await a.act(episode_id=f"fo{i}", inputs={"obs": obs[0].tolist()})).json()
        if first["node"] == "b":
            break
    ep = first["episode_id"]
    await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})
    # a failover lost the last claim: Redis now holds an older token than the owner's state;
    # the owner learns it at its next slide of the episode, the router when b says so
    await redis.set(KEYS.episode(ep), f"{first['device']} {first['token'] - 1}", px=60_000)
    await slid(b)
    r = await a.act(episode_id=ep, inputs={"obs": obs[0].tolist()})
    assert r.status_code == 200, r.text  # served at once, not refused until the state idles out
    assert r.json()["state_reset"] is True and r.json()["token"] == first["token"] - 1
    want = reference_rollout(DEMO_MODEL, obs[:1])[0]["actions"]
    np.testing.assert_allclose(r.json()["outputs"]["actions"], want, rtol=1e-5)


def mp(body: dict[str, Any]) -> bytes:
    from affinity import wire

    return wire.encode(body)


MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}


async def test_msgpack_and_json_give_the_same_steps_direct_and_forwarded(
    two: tuple[list[InProcNode], Router],
) -> None:
    from affinity import wire

    (a, b), _ = two
    obs = observations(21)
    ref = reference_rollout(DEMO_MODEL, obs)
    for encoding in ("json", "msgpack"):
        for i, o in enumerate(obs):
            entry = (a, b)[i % 2]  # every other step forwarded
            body = {"episode_id": f"enc-{encoding}", "inputs": {"obs": o}}
            if encoding == "json":
                r = await entry.client.post("/act", json={**body, "inputs": {"obs": o.tolist()}})
                got = r.json()
            else:
                r = await entry.client.post("/act", content=mp(body), headers=MSGPACK)
                assert r.headers["content-type"] == "application/msgpack"
                got = wire.decode(r.content)
                assert isinstance(got["outputs"]["actions"], np.ndarray)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(got["outputs"]["actions"], ref[i]["actions"], rtol=1e-5)
            assert got["routing"] == ("claimed" if i == 0 else "hit")


async def test_bad_msgpack_bodies_are_4xx_and_change_nothing(node: InProcNode, redis: Any) -> None:
    before = await snapshot(redis)
    good = np.zeros((1, 8), np.float32)
    for body, status, field in [
        ({"episode_id": "m", "inputs": {"obs": good.astype(np.float64)[:, :7]}}, 422, "inputs.obs"),
        ({"episode_id": "m", "inputs": {"obs": np.zeros((3, 8), np.float32)}}, 422, "inputs.obs"),
        ({"episode_id": "m", "inputs": {"obs": good.astype(np.float64) + 1e39}}, 422, "inputs.obs"),
        ({"episode_id": "m", "inputs": {"obs": good, "x": good}}, 422, "inputs.x"),
        ({"episode_id": "m", "inputs": good}, 422, "inputs"),
        ({"episode_id": b"\xff", "inputs": {"obs": good}}, 422, "episode_id"),
        ({"episode_id": "m", "inputs": {"obs": good}, "execute_steps": 0}, 422, "execute_steps"),
    ]:
        r = await node.client.post("/act", content=mp(body), headers=MSGPACK)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["field"].startswith(field), r.text
    for raw in [b"\x81", b"\xc1", b"\x91" * 5000, mp({"inputs": 1})[:-1], b"[1]"]:
        r = await node.client.post("/act", content=raw, headers=MSGPACK)
        assert r.status_code in (400, 422), (raw[:10], r.text)
        assert r.text.count("not valid msgpack") <= 1, r.text  # said once, not twice
    garbage = await node.client.post("/act", content=b"\xc1", headers=MSGPACK)
    assert garbage.json()["error"]["message"].startswith("body is not valid msgpack: ")
    assert await snapshot(redis) == before
    assert all(node.service.health.tracker(d).failures == 0 for d in node.service.device_ids)


async def test_a_websocket_step_writes_one_access_line_in_both_formats() -> None:
    import io
    import json
    import time

    from node.accesslog import AccessLog
    from node.protocols.openpi import log_step
    from node.step import Step

    scope = {"type": "websocket", "path": "/", "client": ("10.0.0.7", 5123)}
    step = Step(episode="ep-ws", inputs={}, deadline=0.0)
    plain, as_json = AccessLog(stream=io.StringIO()), AccessLog(json=True, stream=io.StringIO())
    for log in (plain, as_json):
        log_step(log, scope, time.monotonic(), 200, step, ("gpu-a/1", "hit"))
        log_step(log, scope, time.monotonic(), 422, None)
        log.flush()
    served, refused = plain.stream.getvalue().splitlines()  # type: ignore[union-attr]
    assert ' INFO affinity.access: 10.0.0.7:5123 "WS /" 200 ' in served
    assert served.endswith("ms episode=ep-ws device=gpu-a/1 routing=hit")
    assert '"WS /" 422 ' in refused and refused.endswith("episode=- device=- routing=-")
    docs = [json.loads(line) for line in as_json.stream.getvalue().splitlines()]  # type: ignore[union-attr]
    assert [(d["method"], d["path"], d["status"]) for d in docs] == [
        ("WS", "/", 200),
        ("WS", "/", 422),
    ]
    assert (docs[0]["episode"], docs[0]["device"], docs[0]["routing"]) == (
        "ep-ws",
        "gpu-a/1",
        "hit",
    )
    off = AccessLog(False, stream=io.StringIO())
    log_step(off, scope, time.monotonic(), 200, step, ("gpu-a/1", "hit"))
    off.flush()
    assert off.stream.getvalue() == ""  # type: ignore[union-attr]


async def test_the_access_log_has_one_line_per_request_with_the_steps_facts(
    node: InProcNode,
) -> None:
    import io
    import json

    log = node.app.access
    log.stream = io.StringIO()
    r = await node.act(episode_id="logged", inputs={"obs": [[0.1] * 8]})
    await node.client.get("/healthz")
    await node.act(episode_id="logged", inputs={"obs": [[1]]})
    log.flush()
    step, health, bad = log.stream.getvalue().splitlines()
    assert " INFO affinity.access: " in step
    assert '"POST /act" 200' in step and "episode=logged" in step
    assert f"device={r.json()['device']}" in step and "routing=claimed" in step
    assert '"GET /healthz" 200' in health and "episode=" not in health
    assert '"POST /act" 422' in bad
    log.json, log.stream = True, io.StringIO()
    await node.act(episode_id="logged", inputs={"obs": [[0.1] * 8]})
    log.flush()
    doc = json.loads(log.stream.getvalue())
    assert (doc["method"], doc["path"], doc["status"], doc["episode"]) == (
        "POST",
        "/act",
        200,
        "logged",
    )
    assert doc["routing"] == "hit" and doc["ms"] > 0 and doc["logger"] == "affinity.access"


async def test_a_re_registration_carries_the_crash_trackers_down_states(redis: Any) -> None:
    class Broken(Gate):
        def run(self, names: Any, feed: Any) -> Any:
            if feed["obs"][0][0] == 7:
                raise RuntimeError("injected model failure")
            return super().run(names, feed)

    cfg = config("a", devices="cpu:1", failure_threshold=1, cooldown_s=3600)
    async with cluster(redis, [cfg], session_factory=lambda s: (Broken(s), "CPU")) as (nodes, _):
        n = nodes[0]
        r = await n.act(episode_id="crash", inputs={"obs": [[7] * 8]})
        assert r.status_code == 500
        assert n.service.health.tracker("a/0").down
        # Redis lost the node (restarted empty, or its lease lapsed): it registers again
        await redis.flushdb()
        await new_fleet(redis)  # no grace period: this test is about the device's state
        await n.service.lease.renew_once()
        assert await redis.hget(KEYS.device("a/0"), "state") == "down"
        r = await n.act(episode_id="after", inputs={"obs": [[0] * 8]})
        assert r.status_code == 503 and r.json()["error"]["code"] in ("full", "no_nodes")


async def test_a_slow_probe_holds_up_no_upkeep_and_is_not_asked_again_behind_itself(
    redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe waits for its device's run, which can take seconds (after a recycle, a
    first run on a GPU captures graphs, loads engines). The node's upkeep (a fence, a flush)
    goes on once a second meanwhile, and the probe is not asked again behind itself, even
    by the rounds that come once one gave up at its bound (here 1 s): once it answers, the
    device is up and no other probe run was queued."""
    import threading

    from node import service as service_module

    monkeypatch.setattr(service_module, "WARM_HANG_S", 1.0)  # a round's bound: 1 s here

    entered, release = threading.Event(), threading.Event()
    probes: list[int] = []

    class SlowProbe(Gate):
        armed = False

        def run(self, names: Any, feed: Any) -> Any:
            if feed["obs"][0][0] == 7:
                raise RuntimeError("injected model failure")
            if SlowProbe.armed and not np.asarray(feed["obs"]).any():  # the probe's zeros
                probes.append(1)
                entered.set()
                release.wait(30)
            return super().run(names, feed)

    cfg = config("a", devices="cpu:1", failure_threshold=1, cooldown_s=0.0, act_deadline_s=0.5)
    async with cluster(redis, [cfg], session_factory=lambda s: (SlowProbe(s), "CPU")) as (nodes, _):
        n = nodes[0]
        svc = n.service
        upkeeps: list[int] = []
        refresh = svc.owner.refresh_gauges
        svc.owner.refresh_gauges = lambda: upkeeps.append(1) or refresh()  # type: ignore[method-assign]
        SlowProbe.armed = True
        r = await n.act(episode_id="crash", inputs={"obs": [[7] * 8]})
        assert r.status_code == 500 and svc.health.tracker("a/0").down
        try:
            await asyncio.wait_for(asyncio.to_thread(entered.wait, 30), 35)
            seen = len(upkeeps)
            for _ in range(300):  # three rounds of upkeep while the probe runs (30 s at most)
                if len(upkeeps) >= seen + 3:
                    break
                await asyncio.sleep(0.1)
            assert len(upkeeps) >= seen + 3, "the upkeep waited for the probe"
        finally:
            release.set()
        worker = next(iter(svc.dispatchers.values()))._device("a/0")
        for _ in range(300):
            if not svc.health.tracker("a/0").down and not worker.busy and not worker.pending:
                break
            await asyncio.sleep(0.1)
        assert not svc.health.tracker("a/0").down
        assert not worker.pending and len(probes) == 1, probes  # asked once, not behind itself
        r = await n.act(episode_id="after", inputs={"obs": [[0.5] * 8]})
        assert r.status_code == 200, r.text


async def test_a_node_process_freezes_what_it_started_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """``create_app(freeze_gc=True)`` (a node's own process, ``node/server.py``) collects,
    then freezes what the process holds once the node has started, so a full collection
    later walks only what serving made; the default (in-process tests, an embedding) does
    neither."""
    import gc

    from node.app import create_app

    calls: list[str] = []

    class Started:
        async def start(self) -> None:
            calls.append("start")

        async def stop(self) -> None:
            calls.append("stop")

    async def factory() -> Any:
        return Started()

    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    for freeze, want in ((False, ["start"]), (True, ["start", "collect", "freeze"])):
        calls.clear()
        app = create_app(factory, freeze_gc=freeze)
        async with app.api.router.lifespan_context(app.api):
            assert calls == want
        assert calls[-1] == "stop"
