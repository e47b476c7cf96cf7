"""The recorder in a real ``affinity-node`` process (issue 45): ``affinity record`` turns it
on through Redis, and a node killed (SIGKILL) mid-episode leaves its segment readable up
to the last part it finished: a prefix of the steps its robot sent, nothing half-written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from affinity.dataset import read_episodes
from node.catalog import file_version
from node.models import DEMO_MODEL
from tests.procs import Node, RedisServer, wait_until
from tests.test_cluster import running

pytestmark = [pytest.mark.integration, pytest.mark.shapes]
pytest.importorskip("pyarrow", reason="the record extra (pyarrow) is not installed")


def segment_frames(root: Path, episode: str) -> int:
    """Frames the node wrote of ``episode`` so far (its segment.json), 0 before any."""
    for meta in root.glob("segments/*/*/*/segment.json"):
        doc = json.loads(meta.read_text())
        if doc["episode"] == episode:
            return int(doc["frames"])
    return 0


def test_a_node_killed_mid_episode_leaves_what_it_finished_readable(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    out = tmp_path / "rec"
    a = Node(tmp_path, "a", redis.url, devices="cpu:1",
             extra=["--lease-ttl", "3", "--record", str(out)])  # fmt: skip
    rng = np.random.default_rng(45)
    sent = [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(40)]
    with running(redis, [a]), httpx.Client(timeout=10) as client:
        name_version = f"{DEMO_MODEL.stem}@{file_version(DEMO_MODEL)}"  # the default --model

        def record(*args: str) -> subprocess.CompletedProcess[str]:
            argv = [sys.executable, "-m", "affinity.cli", "--redis", redis.url, "record", *args]
            return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                  env={**os.environ})  # fmt: skip

        assert record(name_version, "--fraction", "2").returncode == 2  # not 0-1
        assert record("demo_policy@nosuch").returncode == 1  # no node serves it
        key = "{affinity}:record:" + DEMO_MODEL.stem
        assert record(name_version, "--episodes", "x,y").returncode == 0
        named = json.loads(redis.client().hget(key, file_version(DEMO_MODEL)))
        assert (named["mode"], named["episodes"]) == ("named", ["x", "y"])
        assert record(name_version, "--off").returncode == 0
        assert redis.client().hget(key, file_version(DEMO_MODEL)) is None
        cli = record(name_version)
        assert cli.returncode == 0, cli.stdout + cli.stderr
        n = 0

        def probe_recorded() -> bool:  # the node reads the selection at its next renewal
            nonlocal n
            n += 1
            body = {"episode_id": "probe", "inputs": {"obs": sent[0].tolist()}}
            assert client.post(a.url + "/act", json=body).status_code == 200
            return segment_frames(out, "probe") > 0

        wait_until(probe_recorded, 30, "the node records the selected model", interval=0.2)
        for i in range(20):
            body = {"episode_id": "killed", "inputs": {"obs": sent[i].tolist()}}
            assert client.post(a.url + "/act", json=body).status_code == 200
        wait_until(lambda: segment_frames(out, "killed") == 20, 30, "the first 20 written")
        for i in range(20, 40):
            body = {"episode_id": "killed", "inputs": {"obs": sent[i].tolist()}}
            assert client.post(a.url + "/act", json=body).status_code == 200
        a.stop(signal.SIGKILL)  # mid-episode, with steps still waiting for their part
    _, episodes, _ = read_episodes(str(out))
    killed = next(e for e in episodes if e.episode == "killed")
    seqs = [row["seq"] for row in killed.rows]
    assert 20 <= len(seqs) <= 40 and seqs == list(range(1, len(seqs) + 1))
    for i, x in enumerate(killed.inputs["obs"]):
        np.testing.assert_array_equal(x, sent[i])
