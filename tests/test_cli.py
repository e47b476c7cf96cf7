"""The ``affinity`` command line against a throwaway redis-server holding known nodes,
devices and assignments (in process with capsys, and as real subprocesses)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import redis
import redis.asyncio

from affinity import Claims, DeviceRegistration, Keys, ModelId, Registry, Settings
from affinity.cli import Context, DrainMoves, follow_moves, main, moves_summary, processes_cell
from affinity.events import EventStream
from affinity.inventory import Inventory
from affinity.models import Models
from affinity.registry import NodeProcess, NodeProcesses
from tests.conftest import place
from tests.procs import ROOT, RedisServer, free_port, wait_until

pytestmark = pytest.mark.integration

KEYS = Keys()
SETTINGS = Settings(episode_ttl_s=300, lease_ttl_s=60)
EPISODES = [f"ep-{i}" for i in range(1, 7)]
DEVICE_HEADERS = [
    "DEVICE",
    "NODE",
    "KIND",
    "NAME",
    "STATE",
    "ALIVE",
    "LIVE/CAP",
    "WEIGHT",
    "SCORE_MS",
    "PROVIDER",
    "MODELS",
    "REASON",
]


@dataclass
class Deployment:
    server: RedisServer
    url: str
    placed: dict[str, tuple[str, int]]  # episode -> (device, token)


def devices(node: str, kind: str, n: int, capacity: int) -> list[DeviceRegistration]:
    gpu = kind == "cuda"
    return [
        DeviceRegistration(
            index=i,
            kind=kind,
            name="NVIDIA H200" if gpu else "cpu",
            uuid=f"{node}-{i}",
            arch="sm_90" if gpu else "cpu",
            memory_mb=143_771 if gpu else 0,
            capacity=capacity,
            provider="CUDAExecutionProvider" if gpu else "CPUExecutionProvider",
        )
        for i in range(n)
    ]


async def populate(url: str, namespace: str = "affinity") -> dict[str, tuple[str, int]]:
    """Nodes gpu-a (2 cuda devices) and cpu-b (2 cpu devices) alive, gone-c lapsed;
    six episodes claimed round-robin over the four live devices."""
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    settings = SETTINGS.with_(redis_url=url, namespace=namespace)
    registry, claims = Registry(client, settings), Claims(client, settings)
    try:
        await registry.new_fleet()
        await registry.register("gone-c", "http://gone-c:8000", devices("gone-c", "cpu", 1, 4))
        await client.zadd(settings.keys.nodes, {"gone-c": 1})  # its lease lapsed
        await registry.register("gpu-a", "http://gpu-a:8000", devices("gpu-a", "cuda", 2, 4))
        await registry.register("cpu-b", "http://cpu-b:8000", devices("cpu-b", "cpu", 2, 8))
        return await place(claims, EPISODES)
    finally:
        await client.aclose()


async def claim(url: str, *episodes: str) -> None:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    claims = Claims(client, SETTINGS.with_(redis_url=url))
    try:
        for ep in episodes:
            await claims.resolve(ep)
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def dep(server: RedisServer) -> Deployment:
    server.client().flushall()
    return Deployment(server, server.url, asyncio.run(populate(server.url)))


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli(dep: Deployment, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, "--redis", dep.url, *argv)


def parse_table(text: str, headers: list[str]) -> list[dict[str, str]]:
    lines = text.rstrip("\n").split("\n")
    head = lines[0]
    starts = [head.index(h) for h in headers]
    assert starts == sorted(starts), head
    bounds = [*starts[1:], None]
    return [
        {h: line[a:b].strip() for h, a, b in zip(headers, starts, bounds, strict=True)}
        for line in lines[1:]
    ]


def subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


# -- devices, nodes -------------------------------------------------------------------------


def test_devices_table(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(dep, capsys, "devices")
    assert (code, err) == (0, "")
    rows = {r["DEVICE"]: r for r in parse_table(out, DEVICE_HEADERS)}
    assert sorted(rows) == ["cpu-b/0", "cpu-b/1", "gone-c/0", "gpu-a/0", "gpu-a/1"]
    load = Counter(device for device, _ in dep.placed.values())
    for device, row in rows.items():
        cap = "8" if device.startswith("cpu-b") else "4"
        live = "-" if device == "gone-c/0" else load[device]  # a dead node's load is stale
        assert row["LIVE/CAP"] == f"{live}/{cap}"
        assert row["STATE"] == "active"
        assert row["WEIGHT"] == "1"
        assert row["ALIVE"] == ("no" if device == "gone-c/0" else "yes")
    assert rows["gpu-a/1"]["NAME"] == "NVIDIA H200"
    assert rows["gpu-a/1"]["KIND"] == "cuda"
    assert rows["gpu-a/1"]["PROVIDER"] == "CUDAExecutionProvider"
    assert rows["cpu-b/0"]["NODE"] == "cpu-b"
    assert sum(load[d] for d in rows) == len(EPISODES)


def test_devices_show_their_published_scores(
    dep: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    r = redis.Redis.from_url(dep.url, decode_responses=True)
    far = int(time.time() * 1000) + 3_600_000  # (Redis server time: the same host's clock)
    r.hset(KEYS.scored, mapping={"cpu-b/0": f"{far} 12.500 1.000", "cpu-b/1": "1 9.000 1.000"})
    try:
        code, out, _ = cli(dep, capsys, "devices")
        rows = {row["DEVICE"]: row for row in parse_table(out, DEVICE_HEADERS)}
        assert code == 0 and rows["cpu-b/0"]["SCORE_MS"] == "12.5"
        assert rows["cpu-b/1"]["SCORE_MS"] == "-"  # expired: its node stopped publishing
        assert rows["gpu-a/0"]["SCORE_MS"] == "-"
        code, out, _ = cli(dep, capsys, "devices", "--json")
        scores = {d["device"]: d["score"] for d in json.loads(out)}
        assert scores["cpu-b/0"] == 12.5 and scores["cpu-b/1"] is None
    finally:
        r.delete(KEYS.scored)
        r.close()


def test_json_before_and_after_the_subcommand(
    dep: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    code, after, _ = cli(dep, capsys, "devices", "--json")
    assert code == 0
    code, before, _ = run_cli(capsys, "--json", "--redis", dep.url, "devices")
    assert code == 0
    listed = json.loads(after)
    assert json.loads(before) == listed
    assert [d["device"] for d in listed] == ["cpu-b/0", "cpu-b/1", "gone-c/0", "gpu-a/0", "gpu-a/1"]
    first = listed[0]
    assert set(first) >= {"device", "node", "kind", "name", "state", "alive", "load", "capacity"}
    assert first["alive"] is True and first["capacity"] == 8
    # a global option after the subcommand, too
    code, again, _ = run_cli(capsys, "devices", "--redis", dep.url, "--json")
    assert code == 0 and json.loads(again) == listed


def test_nodes(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(dep, capsys, "nodes")
    assert (code, err) == (0, "")
    headers = ["NODE", "URL", "STATE", "ALIVE", "LEASE LEFT", "PROCESSES", "DEVICES"]
    rows = {r["NODE"]: r for r in parse_table(out, headers)}
    assert rows["gpu-a"]["PROCESSES"] == "1"  # it published none: one process
    assert sorted(rows) == ["cpu-b", "gone-c", "gpu-a"]
    assert rows["gpu-a"]["URL"] == "http://gpu-a:8000"
    assert rows["gpu-a"]["DEVICES"] == "gpu-a/0,gpu-a/1"
    assert rows["gpu-a"]["ALIVE"] == "yes" and rows["gone-c"]["ALIVE"] == "no"
    assert (rows["gpu-a"]["STATE"], rows["gone-c"]["STATE"]) == ("up", "down")
    assert 0 < float(rows["gpu-a"]["LEASE LEFT"].rstrip("s")) <= 60
    assert float(rows["gone-c"]["LEASE LEFT"].rstrip("s")) < 0
    # what is known about the dead node stays visible
    assert rows["gone-c"]["URL"] == "http://gone-c:8000"
    assert rows["gone-c"]["DEVICES"] == "gone-c/0"

    code, out, _ = cli(dep, capsys, "nodes", "--json")
    assert code == 0
    nodes = {n["node"]: n for n in json.loads(out)}
    assert nodes["cpu-b"]["devices"] == ["cpu-b/0", "cpu-b/1"]
    assert nodes["cpu-b"]["alive"] is True and nodes["gone-c"]["alive"] is False
    assert 0 < nodes["cpu-b"]["lease_ms"] <= 60_000
    assert (nodes["cpu-b"]["fronts"], nodes["cpu-b"]["processes"]) == (1, [])


def test_nodes_show_their_processes(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43: a node with front door processes says so in its column, with what is wrong
    (a front not running now, restarts); ``--processes`` gives a row per process, the
    fronts' fork server (a helper) last."""
    four = NodeProcesses(4, (
        NodeProcess("core", 4101, 1_795_983_839_120, 0, 1.0),
        NodeProcess("0", 4187, 1_795_983_840_310, 0, 2.5),
        NodeProcess("1", 5213, 1_795_984_521_775, 1, math.inf),
        NodeProcess("3", 4190, 1_795_983_840_340),
    ), helpers=(NodeProcess("forksrv", 4120, 1_795_983_839_200, 1),))  # fmt: skip
    # one door, a worker process per device (--device-workers process): dev1 not running now
    workers = NodeProcesses(1, (
        NodeProcess("core", 77, 1_795_983_839_000, 0, 1.0),
        NodeProcess("dev0", 78, 1_795_983_839_500, 2),
    ), 2)  # fmt: skip
    asyncio.run(renew_with(dep.url, {"gpu-a": four, "cpu-b": workers}))
    code, out, _ = cli(dep, capsys, "nodes")
    assert code == 0
    headers = ["NODE", "URL", "STATE", "ALIVE", "LEASE LEFT", "PROCESSES", "DEVICES"]
    rows = {r["NODE"]: r["PROCESSES"] for r in parse_table(out, headers)}
    assert rows == {
        "gpu-a": "core+4 fronts, 1 down, 2 restarts",  # front 1's, the fork server's
        "cpu-b": "core+2 device workers, 1 down, 2 restarts",
        "gone-c": "1",
    }
    code, out, _ = cli(dep, capsys, "nodes", "--processes")
    assert code == 0
    listed = parse_table(out, ["NODE", "PROCESS", "PID", "SINCE", "RESTARTS", "LAG P99"])
    assert [(r["NODE"], r["PROCESS"], r["PID"], r["RESTARTS"], r["LAG P99"]) for r in listed] == [
        ("cpu-b", "core", "77", "0", "1ms"),
        ("cpu-b", "dev0", "78", "2", "-"),  # a worker has no event loop: no lag
        ("gpu-a", "core", "4101", "0", "1ms"),
        ("gpu-a", "0", "4187", "0", "2.5ms"),
        ("gpu-a", "1", "5213", "1", ">2500ms"),
        ("gpu-a", "3", "4190", "0", "-"),
        ("gpu-a", "forksrv", "4120", "1", "-"),  # no loop lag read from it
    ]
    assert listed[3]["SINCE"] == "2026-11-29T20:24:00.310Z"  # UTC, to the ms
    code, out, _ = cli(dep, capsys, "nodes", "--json")
    nodes = {n["node"]: n for n in json.loads(out)}
    assert nodes["gpu-a"]["fronts"] == 4 and "workers" not in nodes["gpu-a"]
    assert [p["pid"] for p in nodes["gpu-a"]["helpers"]] == [4120] and "helpers" not in nodes[
        "cpu-b"
    ]
    assert (nodes["cpu-b"]["fronts"], nodes["cpu-b"]["workers"]) == (1, 2)
    assert nodes["cpu-b"]["processes"][1] == {
        "role": "dev0", "pid": 78, "since_ms": 1_795_983_839_500, "restarts": 2
    }  # fmt: skip
    assert [p["pid"] for p in nodes["gpu-a"]["processes"]] == [4101, 4187, 5213, 4190]
    assert nodes["gpu-a"]["processes"][2]["lag_p99_ms"] is None  # past 2.5 s
    assert "lag_p99_ms" not in nodes["gpu-a"]["processes"][3]  # no sample since


def test_the_processes_cell_in_each_shape() -> None:
    """One process; fronts; device workers; both (what is down then said of each kind)."""
    core = NodeProcess("core", 1, 0)
    fronts = [NodeProcess(str(k), 10 + k, 0) for k in range(4)]
    workers = [NodeProcess(f"dev{k}", 20 + k, 0) for k in range(2)]
    assert processes_cell(NodeProcesses(1, (core,))) == "1"
    assert processes_cell(NodeProcesses(4, (core, *fronts))) == "core+4 fronts"
    assert processes_cell(NodeProcesses(1, (core, *workers), 2)) == "core+2 device workers"
    assert processes_cell(NodeProcesses(1, (core, workers[0]), 1)) == "core+1 device worker"
    both = NodeProcesses(4, (core, *fronts, *workers), 2)
    assert processes_cell(both) == "core+4 fronts+2 device workers"
    a_worker_down = replace(both, processes=(core, *fronts, replace(workers[1], restarts=1)))
    assert (
        processes_cell(a_worker_down) == "core+4 fronts+2 device workers, 1 worker down, 1 restart"
    )
    all_down = NodeProcesses(4, (core, fronts[0]), 2)
    assert (
        processes_cell(all_down) == "core+4 fronts+2 device workers, 3 fronts down, 2 workers down"
    )
    assert processes_cell(NodeProcesses(4, (), 2)) == "core+4 fronts+2 device workers"  # unknown


async def renew_with(url: str, published: dict[str, NodeProcesses]) -> None:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    try:
        registry = Registry(client, SETTINGS.with_(redis_url=url))
        for node, processes in published.items():
            assert await registry.renew(node, processes=processes) is not None
    finally:
        await client.aclose()


def test_namespace_and_env_defaults(
    dep: Deployment, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(populate(dep.url, namespace="other"))
    dep.server.client().delete(Keys("other").device("cpu-b/1"))
    code, out, _ = cli(dep, capsys, "--namespace", "other", "devices", "--json")
    assert code == 0
    assert len(json.loads(out)) == 4  # its own keys only: cpu-b/1 removed there, not here
    monkeypatch.setenv("AFFINITY_REDIS_URL", dep.url)
    monkeypatch.setenv("AFFINITY_NAMESPACE", "other")
    code, out, _ = run_cli(capsys, "devices", "--json")
    assert code == 0 and len(json.loads(out)) == 4
    code, out, _ = run_cli(capsys, "devices", "--json", "--namespace", "affinity")
    assert code == 0 and len(json.loads(out)) == 5


# -- episodes, show, release ----------------------------------------------------------------


def test_episodes(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(dep, capsys, "episodes")
    assert (code, err) == (0, "")
    headers = ["EPISODE", "DEVICE", "TOKEN", "IDLE END", "BACKSTOP", "MOVED", "MODEL"]
    rows = parse_table(out, headers)
    assert {r["MOVED"] for r in rows} == {"no"}
    assert {r["EPISODE"]: (r["DEVICE"], int(r["TOKEN"])) for r in rows} == dep.placed
    # issue 42 item 10: when the owner ends an idle episode (its idle timeout after the
    # claim), not Redis' backstop two lease TTLs + 3 s later (shown beside it)
    beyond = (SETTINGS.backstop_ms - SETTINGS.episode_ttl_ms) / 1000
    for r in rows:
        idle, backstop = (float(r[h].rstrip("s")) for h in ("IDLE END", "BACKSTOP"))
        assert 0 < idle <= SETTINGS.episode_ttl_s < backstop <= SETTINGS.backstop_ms / 1000
        assert abs(backstop - beyond - idle) < 0.11, r  # rounded to 0.1 s each

    code, out, _ = cli(dep, capsys, "episodes", "--device", "gpu-a/0", "--json")
    assert code == 0
    on_a0 = {ep for ep, (d, _) in dep.placed.items() if d == "gpu-a/0"}
    listed = json.loads(out)
    assert on_a0 and {r["episode"] for r in listed} == on_a0
    assert all(r["device"] == "gpu-a/0" and 0 < r["ttl_ms"] <= SETTINGS.backstop_ms for r in listed)
    beyond_ms = SETTINGS.backstop_ms - SETTINGS.episode_ttl_ms
    assert all(r["idle_ms"] == r["ttl_ms"] - beyond_ms for r in listed), listed

    code, out, _ = cli(dep, capsys, "--json", "episodes", "--node", "cpu-b")
    assert code == 0
    on_b = {ep for ep, (d, _) in dep.placed.items() if d.startswith("cpu-b/")}
    assert {r["episode"] for r in json.loads(out)} == on_b

    code, out, err = cli(dep, capsys, "episodes", "--device", "nope/9")
    assert code == 1 and out == ""
    assert err == "affinity: device 'nope/9' is not registered\n"
    code, out, err = cli(dep, capsys, "episodes", "--node", "nope")
    assert (code, out, err) == (1, "", "affinity: node 'nope' is not registered\n")


def test_show(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    device, token = dep.placed["ep-1"]
    code, out, err = cli(dep, capsys, "show", "ep-1")
    assert (code, err) == (0, "")
    fields = dict(line.split(":", 1) for line in out.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    assert fields["device"] == device
    assert fields["node"] == device.split("/")[0]
    assert fields["token"] == str(token)
    assert fields["alive"] == "yes"
    assert fields["state"] == "active"
    idle = float(fields["idle end"].split()[1].rstrip("s"))
    backstop = float(fields["backstop"].split()[1].rstrip("s"))
    assert 0 < idle <= SETTINGS.episode_ttl_s < backstop <= SETTINGS.backstop_ms / 1000
    assert "its owner ends it" in fields["idle end"] and "Redis drops it" in fields["backstop"]

    code, out, _ = cli(dep, capsys, "show", "ep-1", "--json")
    assert code == 0
    shown = json.loads(out)
    assert (shown["episode"], shown["device"], shown["token"]) == ("ep-1", device, token)
    assert shown["moved"] is False and fields["moved"] == "no"
    assert shown["alive"] is True and 0 < shown["ttl_ms"] <= SETTINGS.backstop_ms
    assert shown["idle_ms"] == shown["ttl_ms"] - (SETTINGS.backstop_ms - SETTINGS.episode_ttl_ms)

    code, out, err = cli(dep, capsys, "show", "ep-missing")
    assert (code, out) == (1, "")
    assert err == "affinity: episode 'ep-missing' has no live assignment\n"


def test_release(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """The owner (gpu-a or cpu-b) holds a live lease and may serve the episode from memory:
    the release revokes it, and the owner lets go at its next renewal (said so); with no
    live owner it is gone at once."""
    device, token = dep.placed["ep-2"]
    owner = device.split("/")[0]
    code, out, err = cli(dep, capsys, "release", "ep-2")
    assert (code, err) == (0, "")
    assert out == (
        f"released ep-2 from {device} (token {token}): its owner {owner} drops it at its next "
        "lease renewal; its next step then starts afresh (state_reset)\n"
    )
    assert dep.server.client().get(KEYS.episode("ep-2")).endswith(" revoked")
    code, out, _ = cli(dep, capsys, "show", "ep-2")
    assert code == 0 and "revoked:  yes" in out

    code, out, _ = cli(dep, capsys, "events", "--count", "1", "--json")
    event = json.loads(out)
    assert event["type"] == "revoke" and event["episode"] == "ep-2"
    assert (event["device"], event["token"], event["reason"]) == (device, token, "operator")

    code, out, _ = cli(dep, capsys, "release", "ep-2", "--json")  # again: the same answer
    assert code == 0 and json.loads(out)["pending_owner"] is True

    device3, token3 = dep.placed["ep-3"]
    dep.server.client().zadd(KEYS.nodes, {device3.split("/")[0]: 1})  # its owner's lease lapsed
    code, out, _ = cli(dep, capsys, "--json", "release", "ep-3")
    assert code == 0
    assert json.loads(out) == {
        "episode": "ep-3",
        "device": device3,
        "token": token3,
        "released": True,
        "pending_owner": False,
    }
    assert dep.server.client().get(KEYS.episode("ep-3")) is None
    assert cli(dep, capsys, "show", "ep-3")[0] == 1


# -- drain, undrain -------------------------------------------------------------------------


def test_drain_then_devices_shows_draining(
    dep: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(dep, capsys, "drain", "gpu-a/1", "--reason", "fan failure")
    assert (code, out, err) == (0, "gpu-a/1: active -> draining\n", "")
    code, out, _ = cli(dep, capsys, "devices")
    rows = {r["DEVICE"]: r for r in parse_table(out, DEVICE_HEADERS)}
    assert rows["gpu-a/1"]["STATE"] == "draining"
    assert rows["gpu-a/1"]["REASON"] == "fan failure"
    assert rows["gpu-a/0"]["STATE"] == "active"
    # its episodes stay where they are
    kept = {ep for ep, (d, _) in dep.placed.items() if d == "gpu-a/1"}
    code, out, _ = cli(dep, capsys, "episodes", "--device", "gpu-a/1", "--json")
    assert {r["episode"] for r in json.loads(out)} == kept

    code, out, _ = cli(dep, capsys, "events", "--count", "1")
    assert out.split(" ")[2] == "drain"
    assert "device=gpu-a/1" in out and "reason='fan failure'" in out

    code, out, _ = cli(dep, capsys, "undrain", "gpu-a/1", "--json")
    assert code == 0
    assert json.loads(out) == {"device": "gpu-a/1", "state": "active", "previous": "draining"}
    code, out, _ = cli(dep, capsys, "devices", "--json")
    assert {d["device"]: d["state"] for d in json.loads(out)}["gpu-a/1"] == "active"


def test_drain_unknown_device(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("drain", "undrain"):
        code, out, err = cli(dep, capsys, command, "gpu-z/0")
        assert (code, out) == (1, "")
        assert err == "affinity: device 'gpu-z/0' is not registered\n"
    assert dep.server.client().exists(KEYS.device("gpu-z/0")) == 0


def test_drain_several_devices_at_once(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """A node's devices drain together (and a move is asked of their node for each); a typo
    among them drains none."""
    code, out, err = cli(dep, capsys, "drain", "gpu-a/0", "gpu-z/0")
    assert (code, out) == (1, "")
    assert err == "affinity: device 'gpu-z/0' is not registered\n"
    code, out, _ = cli(dep, capsys, "devices", "--json")
    assert {d["device"]: d["state"] for d in json.loads(out)}["gpu-a/0"] == "active"

    code, out, err = cli(dep, capsys, "drain", "gpu-a/0", "gpu-a/1", "--move", "--wait", "0")
    assert (code, err) == (0, "")
    assert out == "gpu-a/0: active -> draining\ngpu-a/1: active -> draining\n"
    asked = dep.server.client().smembers(KEYS.moves("gpu-a"))
    assert asked == {"@gpu-a/0", "@gpu-a/1"}
    code, out, _ = cli(dep, capsys, "undrain", "gpu-a/0", "gpu-a/1")
    assert (code, out) == (0, "gpu-a/0: draining -> active\ngpu-a/1: draining -> active\n")


def test_drain_move_says_which_episodes_did_not_move(
    dep: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 42 item 3: ``drain --move`` waits for the moves and its summary names what
    stayed (here no node runs, so nothing moves: each is named, exit 1)."""
    on_a0 = sorted(ep for ep, (device, _) in dep.placed.items() if device == "gpu-a/0")
    assert on_a0
    code, out, err = cli(dep, capsys, "drain", "gpu-a/0", "--move", "--wait", "1")
    assert (code, err) == (1, "")
    lines = out.splitlines()
    assert lines[:2] == [
        "gpu-a/0: active -> draining",
        f"moved 0 of {len(on_a0)} episodes with their state",
    ]
    assert lines[2].startswith(f"{len(on_a0)} not moved within 1 s (is the node up?")
    assert lines[2].endswith(", ".join(on_a0))
    code, out, _ = cli(dep, capsys, "undrain", "gpu-a/0")
    assert code == 0


def test_drain_move_summary_reads_moved_kept_and_ended_events(
    dep: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    """The events a drain's moves write (``moved``, ``move-kept``) become the summary; an
    episode no longer on the drained devices without a move left them otherwise; events of
    other devices are not counted; one still on them with no event is still waiting."""
    on_a = sorted(ep for ep, (d, _) in dep.placed.items() if d in ("gpu-a/0", "gpu-a/1"))
    assert len(on_a) >= 3, dep.placed
    moved, kept, waiting = on_a[0], on_a[1], on_a[2]
    where = {ep: d for ep, (d, _) in dep.placed.items()}
    db = dep.server.client()
    for fields in (
        {"type": "moved", "episode": moved, "from": where[moved], "to": "cpu-b/0"},
        {"type": "moved", "episode": waiting, "from": "cpu-b/1", "to": "cpu-b/0"},  # not drained
        {
            "type": "move-kept",
            "episode": kept,
            "device": where[kept],
            "reason": "drain",
            "why": "none",
        },
    ):
        db.xadd(KEYS.events, fields)

    async def follow() -> DrainMoves:
        client = redis.asyncio.Redis.from_url(dep.url, decode_responses=True)
        s = SETTINGS.with_(redis_url=dep.url)
        try:
            ctx = Context(
                Registry(client, s), Inventory(client, s), EventStream(client, s),
                Models(client, s), Claims(client, s), False, sys.stdout, dep.url,
            )  # fmt: skip
            asked = {moved, kept, waiting, "gone-1"}  # gone-1: no longer on the devices
            return await follow_moves(ctx, asked, {"gpu-a/0", "gpu-a/1"}, "0-0", 2)
        finally:
            await client.aclose()

    moves = asyncio.run(follow())
    assert moves.moved == {moved: "cpu-b/0"}
    assert moves.kept == {kept: "none"}
    assert moves.ended == ["gone-1"] and moves.waiting == [waiting]
    assert moves_summary(moves, 4, 2).splitlines() == [
        "moved 1 of 4 episodes with their state",
        "1 left the devices otherwise (ended, expired or claimed anew)",
        f"kept {kept} where it is: no other device serving its model has room",
        f"1 not moved within 2 s (is the node up? affinity events shows a later move): {waiting}",
    ]


# -- events ---------------------------------------------------------------------------------


def test_events(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(dep, capsys, "events", "--since", "-", "--count", "100")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    # gone-c up, its lapse noticed by the next registration, 2 node-up, one claim each
    assert [line.split(" ")[2] for line in lines] == [
        "node-up",
        "node-down",
        "node-up",
        "node-up",
    ] + ["claim"] * len(EPISODES)
    assert "node=gone-c" in lines[1] and "reason='lease lapsed'" in lines[1]
    ids = [line.split(" ")[0] for line in lines]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    device, token = dep.placed["ep-1"]
    first_claim = lines[4].split(" ")
    assert "episode=ep-1" in first_claim and f"device={device}" in first_claim
    assert f"token={token}" in first_claim and not any(p.endswith("=") for p in first_claim)
    assert not any(p.startswith("from=") for p in first_claim)  # a first claim: none before
    written = int(ids[4].split("-")[0]) / 1000
    assert first_claim[1] == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(written)) + (
        f".{int(ids[4].split('-')[0]) % 1000:03d}Z"
    )

    code, out, _ = cli(dep, capsys, "events", "--json")  # the latest 20: all 10 here
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["id"] for e in events] == ids
    assert [e["episode"] for e in events[4:]] == EPISODES
    assert [e["token"] for e in events[4:]] == [dep.placed[ep][1] for ep in EPISODES]
    assert events[1]["lease"] == 1  # numbers in JSON, like the tokens

    code, out, _ = cli(dep, capsys, "events", "--count", "2", "--json")
    assert [json.loads(line)["episode"] for line in out.splitlines()] == EPISODES[-2:]

    code, out, _ = cli(dep, capsys, "events", "--since", ids[4], "--count", "2")
    assert [line.split(" ")[0] for line in out.splitlines()] == ids[5:7]


def test_one_json_vocabulary(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """An episode id is ``episode`` in every JSON the CLI prints; tokens are numbers."""
    rows = json.loads(cli(dep, capsys, "episodes", "--json")[1])
    shown = json.loads(cli(dep, capsys, "show", "ep-4", "--json")[1])
    released = json.loads(cli(dep, capsys, "release", "ep-4", "--json")[1])
    _, out, _ = cli(dep, capsys, "events", "--count", "3", "--json")
    events = [json.loads(line) for line in out.splitlines()]
    for obj in [*rows, shown, released, *events]:
        assert "episode_id" not in obj
        if "episode" in obj:
            assert isinstance(obj["token"], int), obj


# -- dead nodes, forget, an empty Redis ------------------------------------------------------


def test_a_dead_nodes_devices_show_no_load(
    dep: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36 item 14: ``affinity devices`` showed the load of a crashed node's devices
    as if it were live; its episodes move on their next step, so none is shown."""
    held = Counter(device for device, _ in dep.placed.values() if device.startswith("cpu-b"))
    assert sum(held.values()) > 0
    lapse = redis.Redis.from_url(dep.url)
    lapse.zadd(KEYS.nodes, {"cpu-b": 1})  # its lease lapsed: it crashed
    lapse.close()
    code, out, _ = cli(dep, capsys, "devices")
    rows = {r["DEVICE"]: r for r in parse_table(out, DEVICE_HEADERS)}
    assert code == 0
    assert [rows[d]["LIVE/CAP"] for d in ("cpu-b/0", "cpu-b/1")] == ["-/8", "-/8"]
    assert rows["cpu-b/0"]["ALIVE"] == "no"
    listed = {d["device"]: d for d in json.loads(cli(dep, capsys, "devices", "--json")[1])}
    assert listed["cpu-b/0"]["load"] is None and listed["cpu-b/0"]["alive"] is False
    assert isinstance(listed["gpu-a/0"]["load"], int)


async def register_models(url: str) -> None:
    """Node m-a serves demo_policy v1 and vla_demo v1; m-b served demo_policy v2 and
    crashed (its lease lapsed)."""
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    registry = Registry(client, SETTINGS.with_(redis_url=url))
    try:
        await registry.new_fleet()
        served = {ModelId("demo_policy", "v1"): "{}", ModelId("vla_demo", "v1"): "{}"}
        await registry.register("m-a", "http://m-a:8000", devices("m-a", "cpu", 1, 4),
                                models=served)  # fmt: skip
        await registry.register("m-b", "http://m-b:8000", devices("m-b", "cpu", 1, 4),
                                models={ModelId("demo_policy", "v2"): "{}"})  # fmt: skip
        await client.zadd(KEYS.nodes, {"m-b": 1})
    finally:
        await client.aclose()


def test_rollout_of_what_no_node_serves_is_an_error_naming_what_is_served(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36 item 14: a version no live node serves was accepted (exit 0) while an
    unknown model was exit 1; both are exit 1 now, naming what the fleet serves."""
    server.client().flushall()
    asyncio.run(register_models(server.url))
    served = "the fleet serves demo_policy@v1, vla_demo@v1"
    for argv, model in (
        (["rollout", "demo_policy", "v2", "1"], "demo_policy@v2"),  # registered, its node dead
        (["rollout", "demo_policy", "v9", "1"], "demo_policy@v9"),  # never registered
        (["rollout", "nosuch", "v1", "1"], "nosuch"),
        (["rollout", "nosuch"], "nosuch"),
    ):
        code, out, err = run_cli(capsys, "--redis", server.url, *argv)
        assert (code, out) == (1, ""), (argv, err)
        assert err == f"affinity: no live node serves model {model!r}; {served}\n", argv
    assert not server.client().exists(KEYS.rollout("demo_policy"))
    code, out, err = run_cli(capsys, "--redis", server.url, "rollout", "demo_policy", "v1", "3")
    assert (code, err) == (0, "") and "demo_policy  v1" in out


def test_move_to_a_target_that_serves_another_model_is_refused(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 42 item 2: ``affinity move EP --to TARGET`` with a target that does not serve
    the episode's model was accepted (exit 0) and the owner then found no room. It is
    refused at once, exit 1, naming what the target serves; nothing is asked."""
    server.client().flushall()
    asyncio.run(register_models(server.url))

    async def setup() -> None:
        client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
        settings = SETTINGS.with_(redis_url=server.url)
        try:
            await Registry(client, settings).register(
                "m-c", "http://m-c:8000", devices("m-c", "cpu", 1, 4),
                models={ModelId("demo_policy", "v2"): "{}"},
            )  # fmt: skip
            a = await Claims(client, settings).resolve("ep-m", model="demo_policy", version="v1")
            assert a.device == "m-a/0"
            await Registry(client, settings).register(
                "m-d", "http://m-d:8000", devices("m-d", "cpu", 1, 4),
                models={ModelId("demo_policy", "v1"): "{}"},
            )  # fmt: skip
        finally:
            await client.aclose()

    asyncio.run(setup())
    for target in ("m-c", "m-c/0"):
        code, out, err = run_cli(capsys, "--redis", server.url, "move", "ep-m", "--to", target)
        assert (code, out) == (1, ""), err
        assert err == (
            f"affinity: {target} does not serve demo_policy@v1, the model of episode 'ep-m': "
            "it serves demo_policy@v2 (affinity models shows who serves it)\n"
        )
    assert not server.client().exists(KEYS.moves("m-a"))
    code, out, err = run_cli(capsys, "--redis", server.url, "move", "ep-m", "--to", "m-c/7")
    assert (code, out, err) == (1, "", "affinity: device 'm-c/7' is not registered\n")
    code, out, err = run_cli(capsys, "--redis", server.url, "move", "ep-m", "--to", "m-d/0")
    assert (code, err) == (0, "") and "asked m-a to move ep-m to m-d/0" in out
    assert server.client().smembers(KEYS.moves("m-a")) == {"ep-m\x1fm-d/0"}


def test_forget(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(dep, capsys, "forget", "gone-c")
    assert (code, out, err) == (0, "forgot node gone-c and its devices\n", "")
    code, out, _ = cli(dep, capsys, "nodes", "--json")
    assert [n["node"] for n in json.loads(out)] == ["cpu-b", "gpu-a"]
    code, out, _ = cli(dep, capsys, "devices", "--json")
    assert "gone-c/0" not in [d["device"] for d in json.loads(out)]
    code, out, err = cli(dep, capsys, "forget", "gone-c")
    assert (code, out, err) == (1, "", "affinity: node 'gone-c' is not registered\n")
    code, out, err = cli(dep, capsys, "forget", "gpu-a")
    assert (code, out) == (2, "") and "current lease" in err and err.count("\n") == 1


def test_an_empty_redis_says_no_node_is_registered(
    dep: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    dep.server.client().flushall()
    for argv in (
        ["devices"],
        ["nodes", "--json"],
        ["episodes"],
        ["show", "ep-1"],
        ["drain", "gpu-a/0"],
        ["episodes", "--device", "gpu-a/0"],
    ):
        code, out, err = cli(dep, capsys, *argv)
        assert (code, out) == (1, ""), argv
        assert err.startswith(
            f"affinity: no node is registered in namespace 'affinity' at {dep.url}."
        ), err
        assert "--embedded-port" in err and err.count("\n") == 1


def test_events_follow_backlog_bounded(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(dep, capsys, "events", "--since", "-", "--json")
    ids = [json.loads(line)["id"] for line in out.splitlines()]
    code, out, _ = cli(
        dep, capsys, "events", "--follow", "--since", ids[2], "--count", "1", "--max-events", "3"
    )
    assert code == 0
    assert [line.split(" ")[0] for line in out.splitlines()] == ids[3:6]


def blocked_in_xread(server: RedisServer) -> bool:
    return any(c.get("cmd") == "xread" for c in server.client().client_list())


def start_follower(dep: Deployment, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "affinity.cli", "--redis", dep.url, "events", "--follow", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        cwd=ROOT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def test_events_follow_sees_a_concurrent_claim(dep: Deployment) -> None:
    proc = start_follower(dep, "--count", "0", "--max-events", "2", "--json")
    try:
        # The follower is waiting in XREAD from the stream's current end...
        wait_until(lambda: blocked_in_xread(dep.server), 15, "the follower to block in XREAD")
        asyncio.run(claim(dep.url, "ep-new-1", "ep-new-2"))
        out, err = proc.communicate(timeout=15)
    finally:
        stop(proc)
    assert (proc.returncode, err) == (0, "")
    events = [json.loads(line) for line in out.splitlines()]
    # ...so it prints exactly the two new claims, none of the history.
    assert [(e["type"], e["episode"]) for e in events] == [
        ("claim", "ep-new-1"),
        ("claim", "ep-new-2"),
    ]


def test_events_follow_stops_on_ctrl_c(dep: Deployment) -> None:
    proc = start_follower(dep, "--count", "2")
    try:
        wait_until(lambda: blocked_in_xread(dep.server), 15, "the follower to block in XREAD")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        stop(proc)
    assert proc.returncode == 0
    assert err == ""
    assert [line.split(" ")[2] for line in out.splitlines()] == ["claim", "claim"]


def test_events_follow_exits_3_when_redis_goes_away(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    dep = Deployment(server, server.url, {})
    proc = start_follower(dep)
    try:
        wait_until(lambda: blocked_in_xread(server), 15, "the follower to block in XREAD")
        server.stop()
        out, err = proc.communicate(timeout=15)
    finally:
        stop(proc)
        server.stop()
    assert (proc.returncode, out) == (3, "")
    assert err.startswith(f"affinity: cannot reach Redis at {server.url}: ")
    assert err.count("\n") == 1


# -- exit codes and the installed script ----------------------------------------------------


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        [],
        ["bogus"],
        ["show"],
        ["events", "--count", "-1"],
        ["events", "--since", "yesterday"],
        ["drain"],
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, argv
        assert "usage: affinity" in err and out == ""
    # values the library refuses are usage errors too, with one line
    code, _, err = run_cli(capsys, "--namespace", "a:b", "devices")
    assert code == 2 and err.startswith("affinity: namespace") and err.count("\n") == 1
    code, _, err = run_cli(capsys, "--redis", "http://127.0.0.1:1", "devices")
    assert code == 2 and "must be a URL such as redis://" in err and err.count("\n") == 1
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "exit codes" in out


def test_version_and_help_for_every_argument(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 42 item 13: ``--version``; every positional argument has help; ``--move``
    says when the move happens (at the next lease renewal, not now)."""
    from affinity import __version__
    from affinity.cli import build_parser

    code, out, _ = run_cli(capsys, "--version")
    assert (code, out) == (0, f"affinity {__version__}\n")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            assert action.help, f"affinity {name}: {action.dest} has no help"
    code, out, _ = run_cli(capsys, "drain", "--help")
    text = " ".join(out.split())
    assert code == 0 and not re.search(r"\bnow\b", text), text
    assert "at each node's next lease renewal" in text
    code, out, _ = run_cli(capsys, "move", "--help")
    assert code == 0 and "at its owner's next lease renewal" in " ".join(out.split())


def test_unreachable_redis_exits_3_fast(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    for argv in (["devices"], ["show", "ep-1"], ["events", "--follow"], ["drain", "x/0"]):
        code, out, err = run_cli(capsys, "--redis", url, *argv)
        assert (code, out) == (3, ""), argv
        # the refusal itself is reported (at once), not a deadline that ran out waiting
        assert err.startswith(f"affinity: cannot reach Redis at {url}: connection refused")
        assert err.count("\n") == 1 and "Traceback" not in err


def test_password_is_not_shown(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://ops:hunter2@127.0.0.1:{free_port()}/0"
    code, _, err = run_cli(capsys, "--redis", url, "nodes")
    assert code == 3
    assert "hunter2" not in err and "ops:***@127.0.0.1" in err


def test_installed_script(dep: Deployment, tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "affinity"
    assert script.exists(), f"{script} missing: pip install -e . installs the console script"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(script), *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=subprocess_env(),
        )

    done = run("--redis", dep.url, "devices", "--json")
    assert (done.returncode, done.stderr) == (0, "")
    assert len(json.loads(done.stdout)) == 5

    missing = run("--redis", dep.url, "show", "nope")
    assert (missing.returncode, missing.stdout) == (1, "")

    dead = f"redis://127.0.0.1:{free_port()}/0"
    down = run("--redis", dead, "nodes")
    assert down.returncode == 3
    assert down.stderr.startswith(f"affinity: cannot reach Redis at {dead}: ")
    assert down.stderr.count("\n") == 1 and "Traceback" not in down.stderr

    usage = run("nodes", "--bogus")
    assert usage.returncode == 2 and "usage:" in usage.stderr
