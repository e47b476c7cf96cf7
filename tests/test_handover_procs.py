"""Live episode hand-over (issue 35) with real processes: an operator's drain with move
under the unmodified clients of every front door (affinity.Client on /act, tritonclient,
openpi-client), a graceful stop that moves a recurrent state of several MB, and a new
owner paused in the middle of a graceful stop (the move fails: one owner, the reset said).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from affinity import Client, Keys
from node.models import DEMO_MODEL
from tests.models import big_state_policy
from tests.procs import ROOT, Node, RedisServer, free_port, wait_until
from tests.rollout import reference_rollout
from tests.test_cluster import running

pytestmark = [
    pytest.mark.integration,  # openpi-client connects as websockets deprecated, unmodified
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]
KEYS = Keys()


def observations(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def cli(redis_url: str, *args: str) -> str:
    env = {**os.environ, "AFFINITY_REDIS_URL": redis_url}
    done = subprocess.run(
        [sys.executable, "-m", "affinity.cli", *args], cwd=ROOT, env=env, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    return done.stdout


def on_device(redis: RedisServer, episode: str) -> str:
    value = redis.client().get(KEYS.episode(episode))
    return "" if value is None else str(value).split(" ")[0]


def test_a_drain_with_move_carries_every_front_doors_episode_with_its_state(
    tmp_path: Path,
) -> None:
    """Four robots, one per front door, step episodes that a owns; ``affinity drain a/0
    --move`` moves them to b; the clients, none of them ours but the first, see no error
    and no reset, and every reply is the model after the episode's whole history."""
    redis = RedisServer(tmp_path)
    grpc_port = free_port()
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=["--grpc-port", str(grpc_port)])
    b = Node(tmp_path, "b", redis.url, devices="cpu:1", extra=["--grpc-port", str(free_port())])
    doors = ("act", "kserve", "grpc", "openpi")
    names = ("act-robot", "kserve:i:4242", "kserve:s:grpc-robot", "pi-robot")
    with running(redis, [a]):
        obs = {door: observations(i, 8) for i, door in enumerate(doors)}
        got: dict[str, list[np.ndarray]] = {door: [] for door in obs}
        fleet = Client([a.url], raise_on_reset=True)  # a StateReset would be an exception
        triton = th.InferenceServerClient(f"{a.host}:{a.port}")
        triton_grpc = tg.InferenceServerClient(f"{a.host}:{grpc_port}")
        robot = WebsocketClientPolicy(f"ws://{a.host}:{a.port}/?episode_id=pi-robot")

        def steps(i: int) -> None:
            got["act"].append(
                np.asarray(fleet.act("act-robot", {"obs": obs["act"][i]}).outputs["actions"])
            )
            x = th.InferInput("obs", [1, 8], "FP32").set_data_from_numpy(obs["kserve"][i])
            r = triton.infer("demo_policy", [x], sequence_id=4242, sequence_start=i == 0)
            assert r.get_response()["parameters"]["state_reset"] is False
            got["kserve"].append(r.as_numpy("actions"))
            g = tg.InferInput("obs", [1, 8], "FP32")
            g.set_data_from_numpy(obs["grpc"][i])
            rg = triton_grpc.infer("demo_policy", [g], sequence_id="grpc-robot",
                                   sequence_start=i == 0)  # fmt: skip
            params = rg.get_response().parameters
            assert params["state_reset"].bool_param is False
            got["grpc"].append(rg.as_numpy("actions"))
            reply = robot.infer({"obs": obs["openpi"][i][0]})
            assert reply["state_reset"] is False, reply
            got["openpi"].append(reply["actions"])

        try:
            for i in range(3):
                steps(i)
            b.proc.start()
            wait_until(b.ready, 60, "b ready")
            for name in names:
                assert on_device(redis, name) == "a/0"
            out = cli(redis.url, "drain", "a/0", "--move")  # waits for the moves
            assert "draining" in out
            assert f"moved {len(names)} of {len(names)} episodes with their state" in out, out
            wait_until(
                lambda: all(on_device(redis, n) == "b/0" for n in names),
                30,
                "every episode moved to b (at a's next renewal)",
            )
            for i in range(3, 8):  # the same clients, the same connections to a
                steps(i)
        finally:
            fleet.close()
            triton.close()
            triton_grpc.close()
            robot._ws.close()
        for door, history in obs.items():
            want = reference_rollout(DEMO_MODEL, history)
            for i, (g, w) in enumerate(zip(got[door], want, strict=True)):
                np.testing.assert_allclose(
                    np.asarray(g).reshape(w["actions"].shape), w["actions"], rtol=1e-5,
                    err_msg=f"{door} step {i}",
                )  # fmt: skip
        events = [f for _, f in redis.client().xrange(KEYS.events) if f.get("type") == "moved"]
        assert {e["episode"] for e in events} == set(names)
        assert {e["reason"] for e in events} == {"drain"}
        b.stop()


def test_a_graceful_stop_moves_a_state_of_several_megabytes(tmp_path: Path) -> None:
    model = big_state_policy(tmp_path)  # 4 MiB of recurrent state
    redis = RedisServer(tmp_path)
    extra = ["--model", str(model)]
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=extra)
    b = Node(tmp_path, "b", redis.url, devices="cpu:1", extra=extra)
    with running(redis, [a]):
        # the episode is claimed while a is the only node (b's address fails over to a)
        with Client([a.url, b.url], raise_on_reset=True) as fleet:
            for n in range(1, 4):
                step = fleet.act("big", {"obs": np.zeros((1, 8), np.float32)})
                assert (step.node, float(np.asarray(step.outputs["steps"]).item())) == ("a", n)
            b.proc.start()
            wait_until(b.ready, 60, "b ready")
            a.proc.send(signal.SIGTERM)
            assert a.proc.popen is not None and a.proc.popen.wait(60) == 0
            for n in range(4, 7):
                step = fleet.act("big", {"obs": np.zeros((1, 8), np.float32)})
                assert (step.node, float(np.asarray(step.outputs["steps"]).item())) == ("b", n)
        moved = [f for _, f in redis.client().xrange(KEYS.events) if f.get("type") == "moved"]
        assert len(moved) == 1 and int(moved[0]["bytes"]) >= 4 << 20
        b.stop()


def test_a_new_owner_paused_during_a_graceful_stop_leaves_one_owner_and_says_the_reset(
    tmp_path: Path,
) -> None:
    """b, the only place to go, is SIGSTOPped while a stops gracefully: the record cannot
    reach it, the reservation is taken back, the episode is handed over without its state;
    once b runs again the episode's next step there says state_reset, and the copy b may
    have installed meanwhile is never served (it was never committed)."""
    redis = RedisServer(tmp_path)
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=["--drain-timeout", "30"])
    b = Node(tmp_path, "b", redis.url, devices="cpu:1")
    with running(redis, [a]):
        body = {"episode_id": "paused-target", "inputs": {"obs": [[0.0] * 8]}}
        first = httpx.post(a.url + "/act", json=body, timeout=10).json()
        b.proc.start()
        wait_until(b.ready, 60, "b ready")
        b.proc.send(signal.SIGSTOP)
        try:
            a.proc.send(signal.SIGTERM)
            assert a.proc.popen is not None and a.proc.popen.wait(60) == 0
        finally:
            b.proc.send(signal.SIGCONT)
        assert "1 without" in a.proc.log() or "handed over 1 without" in a.proc.log(), a.proc.log()
        value = str(redis.client().get(KEYS.episode("paused-target")))
        assert value.endswith(" moved") and value.split(" ")[1] == str(first["token"])
        r = wait_until(
            lambda: (
                (x := httpx.post(b.url + "/act", json=body, timeout=10)).status_code == 200 and x
            ),
            30,
            "served on b",
        )
        after = r.json()
        assert (after["node"], after["routing"], after["state_reset"]) == ("b", "reassigned", True)
        assert after["seq"] == 1
        b.stop()


def test_affinity_move_to_a_named_device_carries_the_episode_with_its_state(
    tmp_path: Path,
) -> None:
    """``affinity move EP --to c/0`` on a fleet of three: the episode lands on the device
    named (not on b, which has room too), its next steps continue its history through any
    node, and a typo in the target is refused before anything is asked."""
    redis = RedisServer(tmp_path)
    a = Node(tmp_path, "a", redis.url, devices="cpu:1")
    b = Node(tmp_path, "b", redis.url, devices="cpu:1")
    c = Node(tmp_path, "c", redis.url, devices="cpu:1")
    with running(redis, [a]):
        obs = observations(7, 6)
        got: list[np.ndarray] = []
        with Client([a.url], raise_on_reset=True) as fleet:
            for i in range(3):
                got.append(np.asarray(fleet.act("moved-ep", {"obs": obs[i]}).outputs["actions"]))
            for node in (b, c):
                node.proc.start()
            for node in (b, c):
                wait_until(node.ready, 60, f"{node.node_id} ready")
            assert on_device(redis, "moved-ep") == "a/0"
            env = {**os.environ, "AFFINITY_REDIS_URL": redis.url}
            typo = subprocess.run(
                [sys.executable, "-m", "affinity.cli", "move", "moved-ep", "--to", "c/9"],
                cwd=ROOT, env=env, capture_output=True, text=True,
            )  # fmt: skip
            assert typo.returncode != 0 and "c/9" in typo.stderr, typo
            out = cli(redis.url, "move", "moved-ep", "--to", "c/0")
            assert "asked a to move moved-ep to c/0" in out, out
            wait_until(lambda: on_device(redis, "moved-ep") == "c/0", 30, "moved to c/0")
            for i in range(3, 6):  # the client still knows only a: a routes to c
                step = fleet.act("moved-ep", {"obs": obs[i]})
                assert step.node == "c", step
                got.append(np.asarray(step.outputs["actions"]))
        want = reference_rollout(DEMO_MODEL, obs)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(
                g.reshape(w["actions"].shape), w["actions"], rtol=1e-5, err_msg=f"step {i}"
            )
        moved = [f for _, f in redis.client().xrange(KEYS.events) if f.get("type") == "moved"]
        assert [(m["from"], m["to"], m["reason"]) for m in moved] == [("a/0", "c/0", "move")]
        for node in (b, c):
            node.stop()
