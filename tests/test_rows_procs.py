"""Many episodes' steps in one message (issue 44) with real processes: the owner of some
rows paused (SIGSTOP) and then killed (SIGKILL) while a message of rows goes through
another node. Only that owner's rows answer their error, saying what happened; the
others are served, in order; once the dead owner's lease lapsed its rows move and say
``state_reset``."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import Node, RedisServer
from tests.test_cluster import running

pytestmark = [pytest.mark.integration, pytest.mark.shapes]
OBS = [[0.0] * 8]


def rows(url: str, episodes: list[str], timeout: float = 60) -> list[dict[str, Any]]:
    body = {"steps": [{"episode_id": e, "inputs": {"obs": OBS}} for e in episodes]}
    r = httpx.post(url + "/act", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    got: list[dict[str, Any]] = r.json()["steps"]
    assert len(got) == len(episodes)
    return got


def test_a_paused_then_killed_owner_fails_only_its_rows(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    # the lease (6 s) outlives a paused or killed phase (about --act-deadline, 2 s) on an idle
    # machine; on a busy one p2's lease may lapse within a phase, and then its rows move
    # and say state_reset instead of failing: both are right, neither is served by p2
    extra = ["--lease-ttl", "6", "--act-deadline", "2"]
    nodes = [Node(tmp_path, f"p{i}", redis.url, devices="cpu:1", extra=extra) for i in range(3)]
    with running(redis, nodes) as c:
        entry = c.node("p0").url
        episodes = [f"pk-{i}" for i in range(9)]
        first = rows(entry, episodes)
        where = {r["episode_id"]: r["node"] for r in first}
        assert all("error" not in r for r in first), first
        assert "p2" in where.values() and len(set(where.values())) >= 2, where
        moved: set[str] = set()  # p2's rows served elsewhere once its lease lapsed

        def p2_row(r: dict[str, Any], e: str, failed: Callable[[dict[str, Any]], bool]) -> None:
            if "error" in r:
                assert e not in moved and failed(r["error"]), r
            else:  # its lease lapsed: moved, never silently
                assert r["node"] != "p2", r
                assert r["state_reset"] or e in moved, r
                moved.add(e)

        c.node("p2").proc.send(signal.SIGSTOP)  # paused: its rows time out, alone
        try:
            got = rows(entry, episodes)
        finally:
            c.node("p2").proc.send(signal.SIGCONT)
        for r, e in zip(got, episodes, strict=True):
            if where[e] == "p2":
                p2_row(r, e, lambda err: err["status"] == 503 and "p2" in err["message"])
            else:
                assert r["seq"] == 2 and r["node"] == where[e], r
        c.node("p2").stop(signal.SIGKILL)  # killed: refused connections, then its lease lapses
        got = rows(entry, episodes)
        for r, e in zip(got, episodes, strict=True):
            if where[e] == "p2":
                p2_row(
                    r, e, lambda err: err["status"] == 503 and err["code"] == "owner_unreachable"
                )
            else:
                assert r["node"] == where[e] and not r["state_reset"], r
        deadline = time.monotonic() + 60  # the lease lapses (6 s): its rows move, reset
        while True:
            got = rows(entry, episodes)
            for r, e in zip(got, episodes, strict=True):
                if where[e] == "p2" and "error" not in r:
                    p2_row(r, e, lambda err: False)  # its first serve elsewhere says reset
            if all("error" not in r for r in got) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        for r, e in zip(got, episodes, strict=True):
            assert "error" not in r, r
            if where[e] == "p2":
                p2_row(r, e, lambda err: False)


@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")
def test_the_unmodified_clients_send_rows_over_the_wire(tmp_path: Path) -> None:
    """``tritonclient.http``, ``tritonclient.grpc`` and ``openpi-client`` (unmodified)
    against a real node: four robots in one request (``episode_ids`` in ``parameters``, or
    in the observation), the actions stacked along the row axis, each row's facts in
    ``rows``."""
    import json

    import numpy as np
    import tritonclient.grpc as tg
    import tritonclient.http as th

    from tests.procs import free_port

    redis = RedisServer(tmp_path)
    port = free_port()
    node = Node(tmp_path, "t0", redis.url, devices="cpu:1", extra=["--grpc-port", str(port)])
    with running(redis, [node]):
        obs = np.stack([np.full(8, i, np.float32) for i in range(4)])
        ids = ["t-0", "t-1", "t-2", "t-3"]
        http = th.InferenceServerClient(node.url[len("http://") :])
        tensor = th.InferInput("obs", [4, 8], "FP32").set_data_from_numpy(obs)
        params = {"episode_ids": json.dumps(ids), "sequence_starts": json.dumps([True] * 4)}
        result = http.infer("demo_policy", [tensor], parameters=params)
        actions = result.as_numpy("actions")
        rows = json.loads(result.get_response()["parameters"]["rows"])
        assert actions.shape[0] == 4 and [r["seq"] for r in rows] == [1, 1, 1, 1], rows
        grpc = tg.InferenceServerClient(f"127.0.0.1:{port}")
        tensor = tg.InferInput("obs", [4, 8], "FP32").set_data_from_numpy(obs)
        result = grpc.infer("demo_policy", [tensor], parameters={"episode_ids": json.dumps(ids)})
        rows = json.loads(result.get_response().parameters["rows"].string_param)
        assert [r["seq"] for r in rows] == [2, 2, 2, 2], rows
        assert [r["routing"] for r in rows] == ["hit"] * 4
        assert result.as_numpy("actions").shape == actions.shape
        grpc.close()
        http.close()
        from openpi_client.websocket_client_policy import WebsocketClientPolicy

        policy = WebsocketClientPolicy(host=node.host, port=node.port)
        reply = policy.infer({"obs": obs.astype(np.float64), "episode_ids": ids})
        # openpi's episode ids are the ids themselves (KServe's are kserve:s:<id>)
        assert [r["episode_id"] for r in reply["rows"]] == ids
        assert [r["seq"] for r in reply["rows"]] == [1, 1, 1, 1], reply["rows"]
        assert reply["actions"].shape[0] == 4
