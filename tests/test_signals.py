"""The fleet's autoscaling signals (``Inventory.fleet_view``, ``node/signals.py``) and a step's
time against its control period (``node/timing.py``): on fakeredis and a real Redis, and
with in-process nodes (real ONNX Runtime) behind every front door."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Mapping
from typing import Any

import fakeredis
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from affinity import BackendUnavailable, Claims, Inventory, Keys, ModelId, Registry, Settings, wire
from affinity.inventory import FleetView, ModelLoad
from node.accesslog import AccessLog
from node.catalog import file_version
from node.metrics import Metrics
from node.models import DEMO_MODEL
from node.protocols import openpi
from node.protocols.kserve.grpc import GrpcFrontDoor
from node.signals import FleetSignals
from tests.conftest import Env, cpu_devices
from tests.inproc import InProcNode, cluster, config
from tests.test_grpc import _Context, message

pytestmark = pytest.mark.anyio
KEYS = Keys()
OBS = {"obs": [[0.2] * 8]}
DEMO = f"{DEMO_MODEL.stem}@{file_version(DEMO_MODEL)}"
PI, ARM = ModelId("pi", "v1"), ModelId("arm", "v1")
PARTS = ("total_ms", "queue_ms", "run_ms", "forward_ms")


# ---- the fleet's view in Redis ---------------------------------------------------------


async def two_models(env: Env, capacity: int = 4) -> None:
    """Node a serves pi@v1 on two devices, node b pi@v1 and arm@v1 on two devices."""
    for node, served in (("a", {PI: "{}"}), ("b", {PI: "{}", ARM: "{}"})):
        devices = cpu_devices(2, capacity=capacity, uuid_prefix=node)
        await env.registry.register(node, f"http://{node}.test", devices, models=served)


async def by_devices(env: Env) -> dict[str, tuple[int, int]]:
    """The same figures from the operators' device listing: the oracle."""
    out: dict[str, tuple[int, int]] = {}
    nodes = {n.node: n for n in await env.inventory.nodes()}
    for d in await env.inventory.devices():
        node = nodes[d.node]
        for m in node.models if node.alive and node.state == "up" else ():
            live, cap = out.get(m, (0, 0))
            usable = d.alive and d.state == "active"
            out[m] = (live + d.load * usable, cap + d.capacity * usable)
    return out


async def test_fleet_load_counts_the_devices_that_may_take_a_new_episode_of_each_model(
    env: Env,
) -> None:
    await two_models(env)
    for i in range(5):
        await env.claims.resolve(f"one-{i}", model="pi", version="v1")
    for i in range(3):
        await env.claims.resolve(f"two-{i}", model="arm", version="v1")
    loads = await env.inventory.fleet_load()
    assert {m.model: (m.live, m.capacity) for m in loads} == await by_devices(env)
    by = {m.model: m for m in loads}
    # a device's live episodes count for every model its node serves (capacity is shared)
    assert by["pi@v1"].live == 8 and by["pi@v1"].capacity == 16
    assert by["arm@v1"].capacity == 8 and by["arm@v1"].live >= 3  # b's devices: pi's too
    assert by["pi@v1"].saturation == 0.5

    await env.registry.drain("b/0")  # no new episode there: its capacity and load go out
    await env.registry.drain("b/1")
    by = {m.model: m for m in await env.inventory.fleet_load()}
    assert by["arm@v1"] == ModelLoad("arm@v1", 0, 0) and by["arm@v1"].saturation == 1.0
    assert by["pi@v1"].capacity == 8
    assert {m: (x.live, x.capacity) for m, x in by.items()} == await by_devices(env)
    await env.lapse("b")  # a dead node serves nothing
    assert [m.model for m in await env.inventory.fleet_load()] == ["pi@v1"]


async def test_one_node_a_period_reads_the_fleet_and_the_others_read_its_result(
    env: Env,
) -> None:
    await two_models(env)
    await env.claims.resolve("e-1", model="pi", version="v1")
    first = await env.inventory.fleet_view("a", 60_000)  # a reads the devices this period
    assert first is not None and first.at_ms == first.now_ms
    assert await env.redis.get(env.keys.view_reader) == "a"
    await env.claims.resolve("e-2", model="pi", version="v1")
    second = await env.inventory.fleet_view("b", 60_000)  # b reads what a wrote
    assert second is not None and second.at_ms == first.at_ms
    assert second.models == first.models
    assert sum(m.live for m in second.models if m.model == "pi@v1") == 1  # not e-2 yet
    await env.redis.delete(env.keys.view_reader)  # the period is over
    third = await env.inventory.fleet_view("b", 60_000)
    assert third is not None and third.at_ms > first.at_ms
    assert next(m.live for m in third.models if m.model == "pi@v1") == 2
    # a view older than three periods is no view (its reader died, say)
    doc = json.loads(await env.redis.get(env.keys.view))
    doc["at"] -= 3 * 60_000 + 1
    await env.redis.set(env.keys.view, json.dumps(doc))
    assert await env.inventory.fleet_view("a", 60_000) is None


async def test_the_view_costs_three_commands_a_node_and_one_read_of_the_fleet_a_period(
    real_redis_url: str,
) -> None:
    """On a real Redis (``INFO commandstats``): the reader of a period runs 3 + 2 + one per
    live node + one per listed device + 1 commands; every other node 3."""
    r = Redis.from_url(real_redis_url, decode_responses=True)
    try:
        settings = Settings(redis_url=None, lease_ttl_s=10)
        inventory = Inventory(r, settings)
        await two_models(Env(r, settings, Claims(r, settings), Registry(r, settings)))

        async def calls() -> int:
            stats = await r.info("commandstats")
            return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")

        before = await calls()
        await inventory.fleet_view("a", 60_000)
        reader = await calls() - before
        before = await calls()
        await inventory.fleet_view("b", 60_000)
        other = await calls() - before
    finally:
        await r.aclose()
    assert other == 3
    assert reader == 3 + 2 + 2 + 4 + 1  # two live nodes, four listed devices


def view(at_ms: int, now_ms: int, **models: tuple[int, int]) -> FleetView:
    loads = (ModelLoad(m.replace("_", "@"), live, cap) for m, (live, cap) in models.items())
    return FleetView(at_ms, now_ms, tuple(loads))


def gauges(metrics: Metrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            if s.name.startswith("affinity_fleet_"):
                out[(s.name, s.labels["model"])] = s.value
    return out


class FlakyViews:
    """An inventory whose ``fleet_view`` answers the views it is given, or fails."""

    def __init__(self) -> None:
        self.views: list[FleetView | Exception | None] = []

    async def fleet_view(self, node: str, every_ms: int) -> FleetView | None:
        answer = self.views.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_every_node_exports_the_view_and_no_stale_one() -> None:
    now = [100.0]
    source = FlakyViews()
    metrics = Metrics(["a/0"], 4)
    signals = FleetSignals("a", source, metrics, 10.0, clock=lambda: now[0])  # type: ignore[arg-type]
    source.views.append(view(1000, 1000, pi_v1=(3, 4), pi_v2=(0, 0)))
    await signals.refresh()
    assert gauges(metrics) == {
        ("affinity_fleet_saturation", "pi@v1"): 0.75,
        ("affinity_fleet_live_episodes", "pi@v1"): 3,
        ("affinity_fleet_capacity", "pi@v1"): 4,
        ("affinity_fleet_saturation", "pi@v2"): 1.0,
        ("affinity_fleet_live_episodes", "pi@v2"): 0,
        ("affinity_fleet_capacity", "pi@v2"): 0,
    }
    # a version no live node serves any more goes; a failed read keeps the last view...
    source.views.append(view(2000, 5000, pi_v1=(1, 4)))  # read 3 s ago by another node
    await signals.refresh()
    assert set(gauges(metrics)) == {(n, "pi@v1") for n in (
        "affinity_fleet_saturation", "affinity_fleet_live_episodes", "affinity_fleet_capacity"
    )}  # fmt: skip
    now[0] += 26.0  # 29 s old by now
    source.views.append(BackendUnavailable("redis is away"))
    await signals.refresh()
    assert gauges(metrics)[("affinity_fleet_saturation", "pi@v1")] == 0.25
    # ... until it is three periods old: then nothing, never a stale figure
    now[0] += 1.5
    source.views.append(BackendUnavailable("redis is away"))
    await signals.refresh()
    assert gauges(metrics) == {}
    source.views.append(None)  # no view yet (a new fleet)
    await signals.refresh()
    assert gauges(metrics) == {}


# ---- a step's time and its control period ---------------------------------------------


def scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


async def value(node: InProcNode, name: str, **labels: str) -> float:
    r = await node.client.get("/metrics")
    return scrape(r.text).get((name, frozenset(labels.items())), 0.0)


async def misses(node: InProcNode, door: str) -> float:
    return await value(node, "affinity_deadline_miss_total", model=DEMO, door=door)


async def steps(node: InProcNode, door: str) -> float:
    return await value(node, "affinity_step_seconds_count", model=DEMO, door=door)


async def part(node: InProcNode, name: str) -> float:
    return await value(node, "affinity_step_part_seconds_count", model=DEMO, part=name)


def split_ok(timing: Mapping[str, float], forwarded: bool) -> None:
    assert set(timing) == set(PARTS), timing
    assert timing["run_ms"] > 0 and timing["queue_ms"] >= 0
    assert (timing["forward_ms"] > 0) == forwarded
    assert timing["total_ms"] >= timing["queue_ms"] + timing["run_ms"] + timing["forward_ms"]


async def test_a_step_over_its_control_period_is_a_miss_counted_where_it_came_in() -> None:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    cfgs = [config("a", cluster_secret="k"), config("b", cluster_secret="k", control_hz=0.001)]
    async with cluster(redis, cfgs) as (nodes, _):
        a, b = nodes
        on_b = None
        for i in range(8):  # an episode owned by b, stepped through a
            body = (await a.act(episode_id=f"fwd-{i}", inputs=OBS)).json()
            if body["node"] == "b":
                on_b = body["episode_id"]
                break
        assert on_b is not None
        counted = {
            n.service.node_id: (await misses(n, "act"), await steps(n, "act")) for n in nodes
        }
        forwards = await part(a, "forward")
        # 10 kHz: a period of 0.1 ms, which no step through a router makes
        r = await a.client.post(
            "/act",
            json={"episode_id": on_b, "inputs": OBS, "control_hz": 10_000},
            headers={"X-Affinity-Timing": "1"},
        )
        assert r.status_code == 200, r.text
        split_ok(r.json()["timing"], forwarded=True)
        assert await misses(a, "act") == counted["a"][0] + 1  # at its entry node...
        assert await steps(a, "act") == counted["a"][1] + 1
        assert await part(a, "forward") == forwards + 1
        assert (await misses(b, "act"), await steps(b, "act")) == counted["b"]  # ...only
        assert await value(a, "affinity_control_period_seconds", model=DEMO) == 0.0001
        # not asked: no split in the reply
        r = await a.act(episode_id=on_b, inputs=OBS, control_hz=10_000)
        assert "timing" not in r.json()
        assert await misses(a, "act") == counted["a"][0] + 2
        # a period of 1000 s (b's --control-hz, for a step that names none) is never missed
        before = await misses(b, "act")
        r = await b.act(episode_id=on_b, inputs=OBS)
        assert r.status_code == 200 and await misses(b, "act") == before
        assert await steps(b, "act") == counted["b"][1] + 1
        assert await value(b, "affinity_control_period_seconds", model=DEMO) == 1000
        # a's steps without a rate have no period: never a miss
        before = await misses(a, "act")
        assert (await a.act(episode_id=on_b, inputs=OBS)).status_code == 200
        assert await misses(a, "act") == before
        # any model's step may name its rate; a bad one is refused, as for real-time chunking
        r = await a.act(episode_id=on_b, inputs=OBS, control_hz=0)
        assert r.status_code == 422 and r.json()["error"]["field"] == "control_hz"


async def test_every_front_door_replies_the_split_when_asked_and_counts_its_door() -> None:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a")]) as (nodes, _):
        (a,) = nodes
        service = a.service
        name = DEMO_MODEL.stem
        # KServe over HTTP: the header (or the parameter); the split as flat parameters
        for asked, params in ((True, {}), (True, {"timing": True}), (False, {})):
            before = await misses(a, "kserve_http")
            doc = {
                "inputs": [{"name": "obs", "datatype": "FP32", "shape": [1, 8],
                            "data": [0.1] * 8}],
                "parameters": {"sequence_id": "s-1", "sequence_start": True,
                               "control_hz": 10_000, **params},
            }  # fmt: skip
            headers = {"X-Affinity-Timing": "1"} if asked and not params else {}
            r = await a.client.post(f"/v2/models/{name}/infer", json=doc, headers=headers)
            assert r.status_code == 200, r.text
            got = r.json()["parameters"]
            timing = {k.removeprefix("timing_"): v for k, v in got.items() if "timing" in k}
            if asked:
                split_ok(timing, forwarded=False)
            else:
                assert timing == {}
            assert await misses(a, "kserve_http") == before + 1
        # KServe over gRPC: the parameter
        door = GrpcFrontDoor(service, AccessLog(enabled=False))
        for asked in (True, False):
            before = await misses(a, "kserve_grpc")
            msg = message([1, 8], [np.full((1, 8), 0.3, np.float32).tobytes()])
            msg.model_name = door.model_name
            msg.parameters["sequence_id"].string_param = "g-1"
            msg.parameters["sequence_start"].bool_param = True
            msg.parameters["control_hz"].double_param = 10_000
            if asked:
                msg.parameters["timing"].bool_param = True
            reply = await door.infer(msg, _Context(None), "ModelInfer")
            timing = {k.removeprefix("timing_"): p.double_param
                      for k, p in reply.parameters.items() if k.startswith("timing_")}  # fmt: skip
            if asked:
                split_ok(timing, forwarded=False)
            else:
                assert timing == {}
            assert await misses(a, "kserve_grpc") == before + 1
        # openpi: a key of the observation; the split as a map
        for asked in (True, False):
            before = await misses(a, "openpi")
            frames = await openpi_step(a, {"obs": np.full(8, 0.2), "control_hz": 10_000.0,
                                           **({"timing": True} if asked else {})})  # fmt: skip
            if asked:
                split_ok(frames["timing"], forwarded=False)
            else:
                assert "timing" not in frames
            assert await misses(a, "openpi") == before + 1
        assert await steps(a, "act") == 0  # each door counted as itself


async def openpi_step(
    node: InProcNode, observation: dict[str, Any], episode: str = "pi-1"
) -> dict[str, Any]:
    """One openpi step of ``episode`` over the node's websocket handler, in process: the
    reply frame."""
    incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    sent: list[dict[str, Any]] = []
    for frame in ({"type": "websocket.connect"},
                  {"type": "websocket.receive", "bytes": wire.encode(observation)}):  # fmt: skip
        incoming.put_nowait(frame)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "websocket.send" and len(sent) == 3:  # accept, metadata, reply
            incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})

    scope = {"type": "websocket", "path": "/", "query_string": f"episode_id={episode}".encode(),
             "headers": [], "client": ("127.0.0.1", 1)}  # fmt: skip
    access = AccessLog(stream=io.StringIO())
    await asyncio.wait_for(openpi.handle(node.service, scope, incoming.get, send, access), 30)
    reply = sent[2]
    assert "bytes" in reply, sent
    doc: dict[str, Any] = wire.decode(reply["bytes"])
    return doc


def test_a_loop_histogram_exports_what_prometheus_clients_histogram_does() -> None:
    """The lock-free histogram of the per-step series counts like prometheus-client's:
    the same values give the same buckets (a value on a bound counts in it), sum and
    count, and the family is declared before any child exists."""
    from prometheus_client import CollectorRegistry, Histogram

    from node.metrics import STEP_BUCKETS, LoopHistogram

    values = [0.0001, 0.0005, 0.0005001, 0.01, 0.0333, 0.04, 2.5, 7.0, 0.0125]
    pages = []
    for kind in ("loop", "client"):
        registry = CollectorRegistry()
        if kind == "loop":
            h: Any = LoopHistogram("x_seconds", "x", ["model"], STEP_BUCKETS, registry)
        else:
            h = Histogram("x_seconds", "x", ["model"], buckets=STEP_BUCKETS, registry=registry)
        assert "# TYPE x_seconds histogram" in generate_latest(registry).decode()
        for v in values:
            h.labels("m@1").observe(v)
        pages.append(
            {
                (s.name, s.labels.get("le")): s.value
                for f in text_string_to_metric_families(generate_latest(registry).decode())
                for s in f.samples
                if not s.name.endswith("_created")
            }
        )
    assert pages[0] == pages[1]
    assert pages[0][("x_seconds_bucket", "0.0005")] == 2
    assert pages[0][("x_seconds_count", None)] == len(values)


async def test_the_view_loop_stops_even_when_redis_swallows_its_cancellation() -> None:
    """redis-py on Python 3.11 may swallow a cancellation that lands in a call (gh-86296):
    the loop must end at stop() all the same (it once slept on, and a node's stop hung)."""
    entered = asyncio.Event()

    class Swallowing:
        async def fleet_view(self, node: str, every_ms: int) -> FleetView | None:
            entered.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
            return None

    signals = FleetSignals("a", Swallowing(), Metrics(["a/0"], 4), 3600.0)  # type: ignore[arg-type]
    signals.start()
    await entered.wait()
    await asyncio.wait_for(signals.stop(), 60)  # (a guard: it returns at once)
    assert signals._task is not None and signals._task.done()
