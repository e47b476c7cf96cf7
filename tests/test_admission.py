"""The backlog for new episodes (``--admission-wait``): the line itself with a fake claim, and
in-process nodes (real ONNX Runtime, fakeredis and a real Redis) whose devices are full."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from affinity import BackendUnavailable, NoCapacity
from node.admission import Admission
from node.cli import parse_args
from tests.inproc import InProcNode, cluster, config
from tests.procs import Node, RedisServer
from tests.test_cluster import running
from tests.test_kserve import observations

pytestmark = pytest.mark.anyio
MODEL = "demo_policy"

FAR = 1e12  # a deadline that never comes


class Slots:
    """A fake claim: succeeds while a slot is free, else raises ``NoCapacity``."""

    def __init__(self) -> None:
        self.free = 0
        self.calls = 0

    async def claim(self, who: str) -> str:
        self.calls += 1
        if self.free <= 0:
            raise NoCapacity(who)
        self.free -= 1
        return who


async def until(check: Any, what: str) -> None:
    for _ in range(2000):  # bounded: 2000 loop turns of ~5 ms at most
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


async def test_the_line_admits_in_order_as_slots_free() -> None:
    slots = Slots()
    line = Admission(30.0, poll_s=0.001)
    admitted: list[str] = []

    async def new(who: str) -> None:
        admitted.append(await line.wait(who, lambda: slots.claim(who), FAR))

    tasks = []
    for n, who in enumerate(("a", "b", "c"), 1):
        tasks.append(asyncio.create_task(new(who)))
        await until(lambda n=n: line.waiting == n, f"{who} waits")
    for n in (1, 2, 3):
        slots.free += 1
        await until(lambda n=n: len(admitted) == n, f"{n} admitted")
        assert line.waiting == 3 - n
    await asyncio.gather(*tasks)
    assert admitted == ["a", "b", "c"]


async def test_the_line_is_bounded_in_count_and_time() -> None:
    slots = Slots()
    line = Admission(0.05, limit=1, poll_s=0.001)
    first = asyncio.create_task(line.wait("a", lambda: slots.claim("a"), FAR))
    await until(lambda: line.waiting == 1, "a waits")
    calls = slots.calls
    with pytest.raises(NoCapacity):  # the line is full: at once, without asking Redis
        await line.wait("b", lambda: slots.claim("b"), FAR)
    assert slots.calls == calls
    with pytest.raises(NoCapacity):  # a waited its 50 ms: full, as without a backlog
        await first
    assert line.waiting == 0
    with pytest.raises(NoCapacity):  # a deadline already passed: no wait at all
        await Admission(30.0).wait("c", lambda: slots.claim("c"), 0.0)


async def test_other_errors_pass_through_and_leave_the_line() -> None:
    line = Admission(30.0, poll_s=0.001)

    async def down() -> str:
        raise BackendUnavailable("redis is down")

    async def no_nodes() -> str:
        raise NoCapacity("x", "no_nodes")

    with pytest.raises(BackendUnavailable):
        await line.wait("x", down, FAR)
    with pytest.raises(NoCapacity) as err:
        await line.wait("x", no_nodes, FAR)
    assert err.value.reason == "no_nodes" and line.waiting == 0


def test_the_flag_is_checked() -> None:
    assert parse_args(["--admission-wait", "2"], env={}).admission_wait_s == 2.0
    for bad in ("-1", "nan", "5"):  # 5: not less than the default --act-deadline of 5
        with pytest.raises(SystemExit):
            parse_args(["--admission-wait", bad], env={})


async def act(node: InProcNode, episode: str, **kw: Any) -> httpx.Response:
    obs = observations(1, 1)[0].tolist()
    return await node.client.post("/act", json={"episode_id": episode, "inputs": {"obs": obs},
                                                **kw})  # fmt: skip


async def test_full_nodes_hold_new_episodes_in_order_and_never_delay_running_ones(
    redis: Any,
) -> None:
    """Two nodes of one device of capacity 1: two running episodes fill the fleet. New
    episodes wait at the entry node and are admitted in order as the running ones end; the
    running ones step meanwhile; past the line's bound, and past the wait, 503 ``full``."""
    cfgs = [
        config(n, devices="cpu:1", capacity=1, admission_wait_s=1.0, cluster_secret="k")
        for n in ("a", "b")
    ]
    async with cluster(redis, cfgs) as (nodes, _):
        entry = nodes[0]
        line = entry.service.router.resolver.admission
        assert line is not None
        line.poll_s = 0.001
        for episode in ("run-1", "run-2"):
            assert (await act(entry, episode)).status_code == 200
        line.wait_s = 30.0  # the waits below end when a slot frees, not by time
        line.limit = 2
        waiting = []
        for n, episode in enumerate(("new-1", "new-2")):
            waiting.append(asyncio.create_task(act(entry, episode)))
            await until(lambda n=n: line.waiting == n + 1, f"{episode} waits")
        r = await act(entry, "new-3")  # past the bound: at once
        assert r.status_code == 503 and r.json()["error"]["code"] == "full"
        assert int(r.headers["retry-after"]) >= 1
        for episode in ("run-1", "run-2"):  # running episodes step while the line waits
            r = await act(nodes[1], episode)
            assert r.status_code == 200 and r.json()["routing"] == "hit"
        assert line.waiting == 2
        assert (await act(entry, "run-1", end=True)).status_code == 200
        first = await waiting[0]
        assert first.status_code == 200 and first.json()["routing"] == "claimed"
        assert not waiting[1].done() and line.waiting == 1
        assert (await act(nodes[1], "run-2", end=True)).status_code == 200
        second = await waiting[1]
        assert second.status_code == 200 and second.json()["routing"] == "claimed"
        line.wait_s = 0.05  # full again: a new episode waits its time, then 503
        r = await act(entry, "new-4")
        assert r.status_code == 503 and r.json()["error"]["code"] == "full" and line.waiting == 0


# ---- three real nodes, tritonclient ------------------------------------------------------


def waiting_on(node: Node) -> float:
    text = httpx.get(f"{node.url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("affinity_admission_waiting "))
    return float(line.split()[1])


def eventually(check: Any, what: str) -> None:
    for _ in range(600):  # bounded: 600 turns of ~20 ms at most
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"never: {what}")


@pytest.mark.integration
def test_three_real_nodes_admit_new_sequences_in_order(tmp_path: Path) -> None:
    """Three nodes of one device of capacity 1: three running sequences fill the fleet; two
    new ones wait in order at one entry node while the running ones step, each admitted as
    one ends; then a new one that finds no slot within the wait gets 503."""
    redis = RedisServer(tmp_path)
    nodes = [
        Node(
            tmp_path,
            f"q{i}",
            redis.url,
            devices="cpu:1",
            env={"AFFINITY_CLUSTER_SECRET": "s"},
            extra=[
                "--capacity",
                "1",
                "--admission-wait",
                "4",
                "--act-deadline",
                "8",
                "--lease-ttl",
                "5",
            ],
        )
        for i in range(3)
    ]
    obs = th.InferInput("obs", [1, 8], "FP32").set_data_from_numpy(np.zeros((1, 8), np.float32))
    with running(redis, nodes) as c, ThreadPoolExecutor(2) as pool:
        clients = [th.InferenceServerClient(f"{n.host}:{n.port}", network_timeout=30)
                   for n in c.nodes]  # fmt: skip
        entry = c.nodes[0]
        try:
            for k in range(3):
                clients[k].infer(MODEL, [obs], sequence_id=f"run-{k}", sequence_start=True)
            waiting = []
            for n, sequence in enumerate(("new-1", "new-2"), 1):
                client = th.InferenceServerClient(f"{entry.host}:{entry.port}", network_timeout=30)
                waiting.append(pool.submit(client.infer, MODEL, [obs], sequence_id=sequence,
                                           sequence_start=True))  # fmt: skip
                eventually(lambda n=n: waiting_on(entry) == n, f"{sequence} waits")
            for k in range(3):  # running sequences are not delayed by the backlog
                result = clients[(k + 1) % 3].infer(MODEL, [obs], sequence_id=f"run-{k}")
                assert result.get_response()["parameters"]["routing"] == "hit"
            clients[1].infer(MODEL, [obs], sequence_id="run-0", sequence_end=True)
            first = waiting[0].result(timeout=30).get_response()["parameters"]
            assert first["routing"] == "claimed"
            assert not waiting[1].done() and waiting_on(entry) == 1
            clients[2].infer(MODEL, [obs], sequence_id="run-1", sequence_end=True)
            second = waiting[1].result(timeout=30).get_response()["parameters"]
            assert second["routing"] == "claimed" and waiting_on(entry) == 0
            with pytest.raises(InferenceServerException, match="full") as err:
                clients[0].infer(MODEL, [obs], sequence_id="new-3", sequence_start=True)
            assert err.value.status() == "503"
        finally:
            for client in clients:
                client.close()
