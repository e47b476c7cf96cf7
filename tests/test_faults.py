"""Availability under faults with real processes on loopback: a graceful stop hands its
episodes over at once while steps are in flight; a paused node answers the requests it
received instead of dropping them; two processes never keep one node id."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from affinity import Keys
from tests.models import slow_policy
from tests.procs import Node, RedisServer, wait_until
from tests.rollout import reference_rollout
from tests.test_cluster import running

pytestmark = [pytest.mark.integration, pytest.mark.shapes]

KEYS = Keys()
SECRET = {"AFFINITY_CLUSTER_SECRET": "s"}


def test_sigterm_moves_every_episode_with_its_state_while_steps_are_in_flight(
    tmp_path: Path,
) -> None:
    model = slow_policy(tmp_path / "model")  # tens of ms per run: steps are in flight
    redis = RedisServer(tmp_path)
    extra = ["--model", str(model), "--lease-ttl", "2", "--act-deadline", "20"]
    a = Node(tmp_path, "a", redis.url, devices="cpu:2", env=SECRET, extra=extra)
    b = Node(tmp_path, "b", redis.url, devices="cpu:2", env=SECRET, extra=extra)
    rng = np.random.default_rng(5)
    episodes = {f"g{i}": [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(12)]
                for i in range(16)}  # fmt: skip
    replies: dict[str, list[dict[str, Any]]] = {ep: [] for ep in episodes}
    failures: list[str] = []
    stop_sent = threading.Event()

    async def drive(ep: str, steps: range, url: str) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            for i in steps:
                body: dict[str, Any] = {
                    "episode_id": ep,
                    "inputs": {"obs": episodes[ep][i].tolist()},
                }
                if replies[ep]:
                    body["token"] = replies[ep][-1]["token"]
                r = await client.post(url + "/act", json=body)
                if r.status_code != 200:
                    failures.append(f"{ep} step {i}: {r.status_code} {r.text}")
                    return
                replies[ep].append(r.json())
                # once every episode is under way (claimed: a new episode arriving as a
                # node leaves is another case), while the other episodes' steps run
                if i >= 6 and not stop_sent.is_set() and all(replies.values()):
                    stop_sent.set()
                    a.proc.send(signal.SIGTERM)

    with running(redis, [a, b]):
        # every step enters at b: it forwards to a, and must keep getting answers while a leaves
        async def all_of_them() -> None:
            await asyncio.gather(*(drive(ep, range(12), b.url) for ep in episodes))

        asyncio.run(all_of_them())
        assert a.proc.popen is not None
        assert a.proc.popen.wait(timeout=30) == 0  # a graceful stop exits 0
        assert not failures, failures
        r = redis.client()
        assert r.zscore(KEYS.nodes, "a") is None
        for key in r.scan_iter(KEYS.episode("*")):
            assert not r.get(key).startswith("a/"), key
    moved = 0
    for ep, got in replies.items():
        devices = [x["device"] for x in got]
        if not devices[0].startswith("a/"):
            assert len(set(devices)) == 1 and not any(x["state_reset"] for x in got), ep
            continue
        moved += 1
        switch = next(i for i, d in enumerate(devices) if not d.startswith("a/"))
        # handed over with its state (issue 35): no reset, sticky on b, and every reply
        # the model after all of the episode's steps, as if it had never moved
        assert not any(x["state_reset"] for x in got), ep
        assert len(set(devices[switch:])) == 1
        ref = reference_rollout(Path(tmp_path / "model" / "slow_policy.onnx"), episodes[ep])
        for x, want in zip(got, ref, strict=True):
            np.testing.assert_allclose(
                x["outputs"]["actions"], want["actions"], rtol=1e-4, atol=1e-6
            )
    assert moved > 0
    log = a.proc.log()
    assert "left: moved" in log and "with their state" in log


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (head and Content-Length body) from ``sock``; what came
    before the connection closed if it closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_paused_node_answers_what_it_received_instead_of_dropping_it(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    node = Node(tmp_path, "z", redis.url, devices="cpu:1",
                extra=["--lease-ttl", "1", "--keep-alive", "1"])  # fmt: skip
    with running(redis, [node]):
        # one keep-alive connection, used once, then idle while the node is paused past
        # both its keep-alive timeout and its lease
        with socket.create_connection((node.host, node.port), timeout=30) as sock:
            request = (
                b"POST /act HTTP/1.1\r\nHost: z\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s"
            )
            body = b'{"episode_id": "p", "inputs": {"obs": [[0,0,0,0,0,0,0,0]]}}'
            sock.sendall(request % (len(body), body))
            assert b" 200 " in read_response(sock).split(b"\r\n", 1)[0]
            node.proc.send(signal.SIGSTOP)
            try:
                sock.sendall(request % (len(body), body))  # queued while paused
                time.sleep(2.5)  # the fault itself: longer than keep-alive and lease
            finally:
                node.proc.send(signal.SIGCONT)
            answer = read_response(sock)
        status = answer.split(b"\r\n", 1)[0]
        assert answer, "the queued request was dropped (connection closed without an answer)"
        assert b" 503 " in status or b" 200 " in status, answer[:200]
        if b" 503 " in status:
            assert b"retry-after" in answer.lower() and b"fenced" in answer


def test_two_processes_never_keep_one_node_id_after_redis_restarts_empty(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path).start()
    extra = ["--lease-ttl", "2"]
    first = Node(tmp_path, "twin", redis.url, devices="cpu:1", extra=extra)
    second = Node(tmp_path, "twin", redis.url, devices="cpu:1", extra=extra)
    try:
        first.start()
        second.proc.start()  # waits: the id is leased by the first
        wait_until(lambda: "held by another process" in second.proc.log(), 30, "second waits")
        redis.restart()  # empty: whichever registers first holds the id from now on
        procs = [first.proc.popen, second.proc.popen]
        assert all(p is not None for p in procs)
        wait_until(lambda: any(p.poll() is not None for p in procs), 60, "one of them exits")
        gone = next(n for n, p in zip((first, second), procs, strict=True) if p.poll() is not None)
        kept = second if gone is first else first
        assert gone.proc.popen is not None and gone.proc.popen.returncode == 4
        assert "held by another" in gone.proc.log()
        # the one that stayed holds the registration, and serves
        wait_until(kept.ready, 30, "the other serves")
        assert redis.client().hget(KEYS.node("twin"), "url") == kept.url
        for _ in range(30):  # a new claim waits for the grace period after the restart
            r = httpx.post(
                kept.url + "/act", json={"episode_id": "t", "inputs": {"obs": [[0] * 8]}}
            )
            if r.status_code != 503 or r.json()["error"]["code"] != "recovering":
                break
            time.sleep(float(r.headers["retry-after"]))
        assert r.status_code == 200
    finally:
        first.stop()
        second.stop()
        redis.stop()


def test_an_openpi_handshake_redis_fails_to_answer_is_503_redis_before_the_upgrade(
    tmp_path: Path,
) -> None:
    """A handshake whose model's contract must be read from Redis, Redis gone: refused
    before the upgrade as the HTTP doors refuse a step then (503 ``redis``, Retry-After),
    in every shape; not a bare 500 (one process) nor a 403 (a front's close), which a
    robot's client reads as a bad key and stops retrying."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    redis = RedisServer(tmp_path)
    other = Node(tmp_path, "o", redis.url, devices="cpu:1", extra=["--model", "vla-demo"])
    node = Node(tmp_path, "n", redis.url, devices="cpu:1")
    try:
        redis.start()
        other.start()
        node.start()
        # the node learns that the fleet serves vla_demo (its contract not yet read)
        r = httpx.post(node.url + "/act", json={"episode_id": "e", "model": "vla_demo@none",
                                                "inputs": {"obs": [[0.0] * 8]}})  # fmt: skip
        assert r.status_code == 404 and "vla_demo" in r.json()["error"]["message"], r.text
        redis.stop()
        with pytest.raises(InvalidStatus) as refused:
            connect(node.url.replace("http", "ws", 1) + "/?model=vla_demo", open_timeout=30)
        response = refused.value.response
        assert response.status_code == 503, (response.status_code, response.body)
        assert response.headers.get("retry-after") == "1"
        assert b'"code":"redis"' in bytes(response.body or b"")
    finally:
        node.stop()
        other.stop()
        redis.stop()
