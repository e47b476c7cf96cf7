"""Every documented series is driven by some path, and every emitted label value is
documented (node/metrics.py LABELS and docs/metrics.md)."""

from __future__ import annotations

import asyncio
import io
import re
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from affinity import Keys
from affinity.dataset import Selection
from node.accesslog import AccessLog
from node.admission import Admission
from node.catalog import file_version
from node.metrics import BUILD, FRONTS_ONLY, LABELS
from node.models import DEMO_MODEL
from node.protocols.kserve.grpc import GrpcFrontDoor
from node.providers import ProviderSettings, build_session
from node.resolver import Placement
from tests.inproc import InProcNode, claim_of, cluster, config
from tests.test_grpc import _Context, message
from tests.test_signals import openpi_step

pytestmark = pytest.mark.anyio
KEYS = Keys()
OBS = {"obs": [[0.2] * 8]}
METRICS_DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


class Flaky:
    """A real ORT session that can be told to fail."""

    fail = False

    def __init__(self, spec: Any) -> None:
        self.inner = build_session(DEMO_MODEL, spec, ProviderSettings()).session

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        if Flaky.fail:
            raise RuntimeError("injected model failure")
        return list(self.inner.run(names, dict(feed)))


class BrokenPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.append((s.name, dict(s.labels), s.value))
    return out


def family_of(sample_name: str) -> str:
    """The documented metric a sample belongs to (``_total``, ``_bucket``, ``_count``,
    ``_sum`` and prometheus-client's ``_created`` are suffixes of one family)."""
    base = sample_name.removesuffix("_created")
    for name in LABELS:
        stem = name.removesuffix("_total")
        if base in (name, stem) or base in (f"{stem}_bucket", f"{stem}_count", f"{stem}_sum"):
            return name
    raise AssertionError(f"undocumented series {sample_name}")


async def scrape(node: InProcNode) -> list[tuple[str, dict[str, str], float]]:
    r = await node.client.get("/metrics")
    assert r.status_code == 200
    return samples(r.text)


async def episode_on(node: InProcNode, via: InProcNode, prefix: str) -> dict[str, Any]:
    for i in range(8):
        body = (await via.act(episode_id=f"{prefix}{i}", inputs=OBS)).json()
        if body["node"] == node.service.node_id:
            return body
    raise AssertionError("round-robin never reached the node")


async def test_every_series_is_driven_and_labels_are_documented(tmp_path: Path) -> None:
    server = fakeredis.FakeServer()
    redis = fakeredis.aioredis.FakeRedis(server=server, decode_responses=True)
    cfgs = [
        config(
            "a",
            cluster_secret="k",
            admin_token="t",
            failure_threshold=1,
            cooldown_s=0,
            capacity=5,
            max_body_bytes=2000,
            record=str(tmp_path / "rec"),
        ),
        config("b", cluster_secret="k", capacity=5),
    ]
    seen: list[tuple[str, dict[str, str], float]] = []
    Flaky.fail = False
    async with cluster(redis, cfgs, session_factory=lambda s: (Flaky(s), "CPU")) as (nodes, router):
        a, b = nodes
        sa = a.service
        # the event loop's lag: a loop blocked for 0.1 s fires the watcher's 20 ms timer at
        # least 80 ms late (blocked again until its sample shows: the watcher may not have
        # begun waiting yet)
        lag = sa.metrics.loop_lag.labels("0")
        late = lag.bounds.index(0.05) + 1  # the counts of the buckets above 50 ms
        for _ in range(20):
            time.sleep(0.1)  # blocks the loop
            for _ in range(50):
                await asyncio.sleep(0.02)
                if sum(lag.counts[late:]):
                    break
            if sum(lag.counts[late:]):
                break
        assert sum(lag.counts[late:]) >= 1 and lag.sum >= 0.08, (lag.counts, lag.sum)
        # the owner drops: revoked (an operator's release), lost (Redis no longer holds it),
        # idle (its idle timeout)
        om = sa.owner.flusher
        own = {
            n: (await episode_on(a, a, f"own-{n}"))["episode_id"] for n in ("rev", "gone", "idle")
        }
        await sa.owner.flush()
        rev = claim_of(sa, own["rev"])
        assert rev is not None
        await sa.claims.release(own["rev"], rev[1], "operator")
        await sa.lease.renew_once()
        assert claim_of(sa, own["rev"]) is None
        await redis.delete(KEYS.episode(own["gone"]))
        om._slid.clear()  # (a failover, seen by its run_id, does this)
        await sa.owner.flush()
        assert claim_of(sa, own["gone"]) is None
        for _, record in sa.table.records():
            record.last_used -= 10_000  # every record idle past the timeout
        await sa.owner.flush()
        assert claim_of(sa, own["idle"]) is None
        # refused: a claim Redis names that its owner ended (a lost release, Redis restored
        # from an older snapshot) is handed over in Redis at its first refused step
        ended = (await episode_on(a, a, "own-refused"))["episode_id"]
        value = await redis.get(KEYS.episode(ended))
        held = claim_of(sa, ended)
        assert held is not None
        await sa.owner.end(ended, held[1])
        await redis.set(KEYS.episode(ended), value, px=60_000)
        r = await a.act(episode_id=ended, inputs=OBS)
        assert r.status_code == 200 and r.json()["state_reset"] is True, r.text
        seen += await scrape(a)
        # the recorder (--record): frames queued and written, then one dropped (queue full)
        rec = sa.recorder
        assert rec is not None
        rec.select({str(mid): Selection("all") for mid, _ in sa.models.values()})
        recorded = (await episode_on(a, a, "rec"))["episode_id"]
        rec.queue_max = 0
        assert (await a.act(episode_id=recorded, inputs=OBS)).status_code == 200
        for _ in range(100):  # the writer counts on its own thread
            if rec.written >= 1 or not rec.wait_idle():
                break
        rec.close()
        rec._count()
        # routing: claimed, hit, stateless, degraded; forwarded ok
        on_b = await episode_on(b, a, "fwd")
        assert (await a.act(episode_id=on_b["episode_id"], inputs=OBS)).status_code == 200
        await a.act(inputs=OBS)
        await a.act(session_id="sess", inputs=OBS)
        # slo: scored placement, every device predicting more than the step's period allows
        await sa.lease.renew_once()  # (publishes the scores)
        await b.service.lease.renew_once()
        sa.router.resolver.placement = Placement("scored", 0.8)
        for key in await redis.keys(KEYS.score_prefix + "*"):
            for device in await redis.zrange(key, 0, -1):
                await redis.zadd(key, {device: 1000.0})
        r = await a.act(episode_id="too-slow", inputs=OBS, control_hz=20)
        assert r.status_code == 503 and r.json()["error"]["code"] == "slo", r.text
        assert int(r.headers["retry-after"]) >= 1
        sa.router.resolver.placement = Placement()
        # a step's time, its parts (queue, run, forward) and deadline misses, by every door
        # (a 0.1 ms period: every step misses it), then the fleet's view
        fast = {"control_hz": 10_000}
        r = await a.act(episode_id=on_b["episode_id"], inputs=OBS, **fast)
        assert r.status_code == 200
        kserve = {"inputs": [{"name": "obs", "datatype": "FP32", "shape": [1, 8],
                              "data": [0.1] * 8}], "parameters": fast}  # fmt: skip
        r = await a.client.post(f"/v2/models/{DEMO_MODEL.stem}/infer", json=kserve)
        assert r.status_code == 200, r.text
        door = GrpcFrontDoor(sa, AccessLog(enabled=False))
        msg = message([1, 8], [np.full((1, 8), 0.3, np.float32).tobytes()])
        msg.model_name = door.model_name
        msg.parameters["control_hz"].double_param = 10_000
        await door.infer(msg, _Context(None), "ModelInfer")
        await openpi_step(a, {"obs": np.full(8, 0.2), **fast}, on_b["episode_id"])
        await redis.delete(KEYS.view_reader)  # a new period: a reads the fleet
        await sa.signals.refresh()
        # forwarded refused: the owner answers 503 (its lease is not current), passed on
        b.service.lease.deadline = b.service.clock() - 1
        r = await a.act(episode_id=on_b["episode_id"], inputs=OBS)
        assert r.status_code == 503 and r.json()["error"]["code"] == "fenced"
        await b.service.lease.renew_once()
        # forwarded unreachable
        router.down.add("b.test")
        other = await episode_on(b, b, "unreach")
        assert (await a.act(episode_id=other["episode_id"], inputs=OBS)).status_code == 503
        router.down.clear()
        # reassigned: b's lease lapses, a takes b's episodes
        await redis.zadd(KEYS.nodes, {"b": 1})
        await redis.delete(KEYS.node("b"))
        r = (await a.act(episode_id=other["episode_id"], inputs=OBS)).json()
        assert r["routing"] == "reassigned" and r["state_reset"] is True
        await b.service.lease.renew_once()  # b: not registered any more -> re-registers
        # live hand-overs: a drain's moves an episode with its state; a graceful stop's
        # finds no room (every other device draining) and hands one over without it; a
        # move of an episode not held here is kept
        made = []
        for i in range(16):
            made.append(f"mv{i}")
            body = (await a.act(episode_id=made[-1], inputs=OBS)).json()
            on_a = [ep for ep in made if sa.table.get(ep) is not None]
            if len(on_a) == 2:
                break
        assert len(on_a) == 2, [(ep, body) for ep in made]
        moving, resetting = on_a
        assert await sa.owner.handovers.hand_over(moving, "drain") == "moved"
        record = sa.table.get(resetting)
        assert record is not None
        others = sorted({"a/0", "a/1", "b/0", "b/1"} - {record.device})
        for device in others:
            await sa.registry.drain(device)
        assert await sa.owner.handovers.hand_over(resetting, "stop") == "reset"
        for device in others:
            await sa.registry.undrain(device)
        assert await sa.owner.handovers.hand_over("held-nowhere", "move") == "kept"
        for ep in made:  # their slots back, for the full fleet below
            await a.act(episode_id=ep, inputs=OBS, end=True)
        # crash tracker: a model failure takes the device down, the probe brings it up
        mine = await episode_on(a, a, "mine")
        Flaky.fail = True
        r = await a.act(episode_id=mine["episode_id"], inputs=OBS)
        assert r.status_code == 500 and mine["node"] == "a"
        await asyncio.gather(*sa.health._tasks)  # the transition's write to Redis
        assert (await redis.hget(KEYS.device(mine["device"]), "state")) == "down"
        seen += await scrape(a)
        Flaky.fail = False
        assert await sa.health.probe() == [mine["device"]]
        for _ in range(5):  # the transition reaches the loop (call_soon_threadsafe)...
            await asyncio.sleep(0)
        await asyncio.gather(*sa.health._tasks)  # ...and its write to Redis is done
        assert (await redis.hget(KEYS.device(mine["device"]), "state")) == "active"
        seen += await scrape(a)
        # full
        for i in range(20):
            await a.act(episode_id=f"fill{i}", inputs=OBS)
        # admission backlog: a new episode waits while every device is full, until one ends
        sa.router.resolver.admission = Admission(
            30.0, poll_s=0.001, on_waiting=sa.metrics.admission_waiting.set
        )
        waiting = asyncio.create_task(a.act(episode_id="backlog", inputs=OBS))
        for _ in range(2000):
            if sa.router.resolver.admission.waiting:
                break
            await asyncio.sleep(0.005)
        seen += await scrape(a)
        assert (await a.act(episode_id="fill0", inputs=OBS, end=True)).status_code == 200
        assert (await waiting).status_code == 200
        sa.router.resolver.admission = None
        # rejected: bad_input, too_large, malformed, unauthorized, forbidden
        await a.act(episode_id="x", inputs={"obs": [[1]]})
        await a.client.post("/act", content=b"x" * 3000)
        await a.client.post("/act", content=b"{")
        await a.client.post("/devices/a/0/drain")
        await a.client.post("/devices/a/0/drain", headers={"Authorization": "Bearer no"})
        await a.client.post("/devices/a/0/drain", headers={"Sec-Fetch-Site": "cross-site"})
        await a.client.post("/devices/a/0/drain", headers={"Authorization": "Bearer t"})
        # log lines dropped: the log stream broke (a log shipper that died)
        a.app.access.stream = BrokenPipe()
        await a.client.get("/healthz")
        a.app.access.flush()
        a.app.access.stream = None
        await redis.hset(KEYS.device("b/1"), "state", "draining")  # drained by an operator
        await b.service.lease.renew_once()  # the renewal picks the state up
        seen += await scrape(a)
        seen += await scrape(b)
        await a.client.post("/devices/a/0/undrain", headers={"Authorization": "Bearer t"})
        # lease renewals: ok, then failed while Redis is unreachable (also: routing unavailable)
        await sa.lease.renew_once()
        server.connected = False
        await sa.lease.renew_once()
        r = await a.act(episode_id="while-down", inputs=OBS)
        assert r.status_code == 503 and r.json()["error"]["code"] == "redis"
        server.connected = True
        # no_nodes: every lease lapsed in Redis (as after it restarted empty)
        await redis.zadd(KEYS.nodes, {"a": 1, "b": 1})
        r = await a.act(episode_id="nobody", inputs=OBS)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_nodes", r.text
        await sa.lease.renew_once()
        await b.service.lease.renew_once()
        # a device's queue: a job waits while another holds its worker
        worker = next(iter(sa.owner.dispatchers.values()))._device("a/0")
        hold = threading.Event()
        running = asyncio.ensure_future(worker.call(hold.wait))
        waiting_job = asyncio.ensure_future(worker.call(lambda: None))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if len(worker.pending) == 1:  # the first job runs, the second waits
                break
        seen += await scrape(a)
        assert ("affinity_worker_queue_depth", {"device": "a/0"}, 1.0) in seen
        hold.set()
        await asyncio.gather(running, waiting_job)
        # fenced
        sa.lease.deadline = sa.clock() - 1
        sa.lease.fence()  # what the renewal loop does once the lease is gone
        assert (await a.act(episode_id="fenced", inputs=OBS)).status_code == 503
        seen += await scrape(a)
        seen += await scrape(b)

    devices = {f"{n}/{i}" for n in "ab" for i in range(2)}
    models = {DEMO_MODEL.stem, file_version(DEMO_MODEL)}  # the name and version registered
    served = {f"{DEMO_MODEL.stem}@{file_version(DEMO_MODEL)}"}  # as "name@version"
    driven: dict[str, bool] = dict.fromkeys(LABELS, False)
    process = {name for name, _, value in seen if name.startswith("process_") and value > 0}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= process, process
    assert {"process_start_time_seconds", "process_open_fds"} <= process, process
    seen = [x for x in seen if not x[0].startswith("process_")]  # prometheus-client's own
    for name, labels, value in seen:
        family = family_of(name)
        documented = LABELS[family]
        assert set(labels) - {"le"} == set(documented), (name, labels)
        for label, value_label in labels.items():
            if label == "le":
                continue
            allowed = {
                "device": devices,
                "build": {BUILD.get(label, "")},
                "model": models,
                "served": served,
                "front": {"0"},  # one process: front 0 (the fronts' own test: the others)
            }.get(str(documented[label]), documented[label])
            assert value_label in allowed, (name, label, value_label)
        if value > 0 and not name.endswith("_created"):
            driven[family] = True
    for family, values in LABELS.items():
        for label, allowed in values.items():
            if allowed in ("device", "build", "model", "served", "front"):
                continue
            for v in allowed:
                hit = any(
                    family_of(n) == family
                    and lab.get(label) == v
                    and val > 0
                    and not n.endswith("_created")
                    and not n.endswith("_bucket")
                    for n, lab, val in seen
                )
                assert hit, f"{family}{{{label}={v!r}}} was never driven"
    assert all(d for f, d in driven.items() if f not in FRONTS_ONLY), [
        f for f, d in driven.items() if not d and f not in FRONTS_ONLY
    ]


def test_docs_document_every_metric_and_value() -> None:
    table = METRICS_DOC.read_text()
    for family, labels in LABELS.items():
        assert f"`{family}`" in table, family
        for label, values in labels.items():
            row = next(line for line in table.splitlines() if f"`{family}`" in line)
            assert f"`{label}`" in row, (family, label)
            if values not in ("device", "build", "model", "served", "front"):
                for v in values:
                    assert re.search(rf"`{re.escape(v)}`", row), (family, v)
