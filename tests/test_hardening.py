"""Hardening round 3 (issue 23): access control on everything that reads or changes
episodes, cross-site refusal, log lines a client cannot forge, and a log stream that
breaks without taking the node with it. Real ``affinity-node`` processes where a
client meets the behaviour over the wire."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import fakeredis
import httpx
import numpy as np
import orjson
import pytest

from affinity import BackendUnavailable, Inventory, PoolExhausted, Settings, connect
from affinity.scripts import bounded
from node.accesslog import AccessLog, escape
from tests.inproc import cluster, config
from tests.procs import ROOT, Node, RedisServer, free_port, tmpdir, wait_until

OBS = {"obs": [[0.1] * 8]}


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


# ---- item 2: log injection ---------------------------------------------------------------


def test_escape_leaves_plain_text_and_escapes_what_could_forge_a_line() -> None:
    assert escape("/episodes/ep-42") == "/episodes/ep-42"
    assert escape("a\nb\rc\x00d\x1b[31m") == "a\\x0ab\\x0dc\\x00d\\x1b[31m"
    assert escape('say "hi" \\ now') == 'say \\"hi\\" \\\\ now'
    assert escape("x\u2028y\x85z") == "x\\u2028y\\x85z"
    assert escape("ünïcode") == "ünïcode"


@pytest.mark.anyio
async def test_a_request_cannot_write_a_line_or_a_nul_into_the_plain_access_log() -> None:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a")]) as (nodes, _):
        node = nodes[0]
        log = node.app.access
        log.stream = io.StringIO()
        forged = "x%0A2026-12-01%2000:00:00,000%20INFO%20affinity.node:%20FORGED%00%22"
        await node.client.get("/episodes/" + forged)
        await node.act(episode_id="ep\u2028two", inputs=OBS)
        log.flush()
        text = log.stream.getvalue()
        lines = text.splitlines()
        assert len(lines) == 2, text
        assert "\x00" not in text and "\u2028" not in text
        assert (
            lines[0].count('"') - lines[0].count('\\"') == 2
            and "\\x0a2026-12-01" in lines[0]
            and "\\x00" in lines[0]
        )
        assert "episode=ep\\u2028two" in lines[1]


# ---- item 6: a broken log stream -----------------------------------------------------------


class BrokenPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_lines_that_cannot_be_written_are_dropped_and_counted_not_kept() -> None:
    dropped: list[int] = []
    log = AccessLog(stream=BrokenPipe(), on_drop=dropped.append)
    scope = {"method": "GET", "path": "/healthz", "client": ("127.0.0.1", 1)}
    for _ in range(600):
        log.write(scope, 200, 0.001)  # no loop: every line is flushed (and fails) at once
    assert sum(dropped) == 600 and log._waiting == []
    log.stream = io.StringIO()
    log.write(scope, 200, 0.001)
    assert log.stream.getvalue().count("\n") == 1  # nothing old comes back


@pytest.mark.integration
def test_a_node_whose_stderr_reader_died_keeps_serving_and_counts_the_dropped_lines() -> None:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.server", "--redis", server.url, "--node-id", "pipe",
         "--port", str(port), "--devices", "cpu:1"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        env={**os.environ, "AFFINITY_CLUSTER_SECRET": "s"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/readyz", timeout=1).status_code == 200, 60, "ready")
        assert proc.stderr is not None
        proc.stderr.close()  # the log shipper died: every write now fails with EPIPE
        with httpx.Client(timeout=10) as c:
            for _ in range(700):  # past MAX_WAITING twice over
                assert c.get(url + "/healthz").status_code == 200
            wait_until(
                lambda: (
                    metric(c.get(url + "/metrics").text, "affinity_log_lines_dropped_total") >= 700
                ),
                10,
                "the dropped lines counted",
            )
            assert c.get(url + "/healthz").status_code == 200
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)
        server.stop()


# ---- item 1: access control and cross-site refusal ------------------------------------------


@pytest.fixture(scope="module")
def keyed() -> Any:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    node = Node(
        tmp, "keyed", server.url, devices="cpu:1", extra=["--api-key", "k3y"],
        env={"AFFINITY_ADMIN_TOKEN": "adm1n"},
    ).start()  # fmt: skip
    yield node
    node.stop()
    server.stop()


KEY = {"Authorization": "Api-Key k3y"}
ADMIN = {"Authorization": "Bearer adm1n"}


@pytest.mark.integration
def test_with_an_api_key_nothing_reads_or_changes_episodes_without_it(keyed: Node) -> None:
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        r = c.post("/act", json={"episode_id": "robot-1", "inputs": OBS}, headers=KEY)
        assert r.status_code == 200, r.text
        token = r.json()["token"]
        for method, path in [
            ("POST", "/episodes/robot-1/end"),
            ("GET", "/episodes/robot-1"),
            ("GET", "/devices"),
            ("GET", "/nodes"),
            ("GET", "/events/stream"),
        ]:
            for headers in ({}, {"Authorization": "Api-Key wrong"}, {"Authorization": "Bearer x"}):
                r = c.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json()["error"]["code"] == "unauthorized"
        # nothing changed: the robot's next step is still a hit on its state
        r = c.post(
            "/act", json={"episode_id": "robot-1", "inputs": OBS, "token": token}, headers=KEY
        )
        assert r.json()["routing"] == "hit", r.text
        # the client and the admin may read and end
        assert c.get("/episodes/robot-1", headers=KEY).json()["device"] == "keyed/0"
        assert c.get("/devices", headers=ADMIN).status_code == 200
        assert c.get("/nodes", headers=KEY).status_code == 200
        with c.stream("GET", "/events/stream?backlog=1", headers=KEY) as s:
            assert s.status_code == 200
        assert c.post("/episodes/robot-1/end", headers=ADMIN).json()["released"] is True
        # health, readiness and metrics stay open (no episode in them, nothing changes)
        for path in ("/healthz", "/readyz", "/metrics", "/model"):
            assert c.get(path).status_code == 200, path


@pytest.mark.anyio
async def test_the_admin_api_of_a_keyed_node_without_an_admin_token_is_403_for_everyone() -> None:
    """Issue 41 item 9: on an ``--api-key`` node without ``AFFINITY_ADMIN_TOKEN`` the
    admin's bearer met the client key check first: 401 ``WWW-Authenticate: Api-Key``
    (send a key, which then got 403). docs/security.md says 403 while the variable is
    unset, as on a node without a key: the admin API is off, no credential helps. Run
    against the code before: 401."""
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    for cfg in (config("a", api_key="k"), config("a")):
        async with cluster(redis, [cfg]) as ([a], _):
            for headers in ({}, {"Authorization": "Bearer ops"}, {"Authorization": "Api-Key k"}):
                r = await a.client.post("/devices/a/0/drain", headers=headers)
                assert r.status_code == 403, (cfg.api_key, headers, r.text)
                assert r.json()["error"]["code"] == "admin_disabled"
                assert "AFFINITY_ADMIN_TOKEN" in r.json()["error"]["message"]
                assert "www-authenticate" not in r.headers
            assert await a.service.registry.states(["a/0"]) == {"a/0": "active"}  # unchanged
    # with the token set, a wrong bearer is 401 with the admin's challenge, not Api-Key
    async with cluster(redis, [config("a", api_key="k", admin_token="adm")]) as ([a], _):
        r = await a.client.post("/devices/a/0/drain", headers={"Authorization": "Bearer x"})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), r.text
        r = await a.client.post("/devices/a/0/drain", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200 and r.json()["state"] == "draining", r.text
        # the other protected paths still want the client's key (or the admin's)
        assert (await a.client.get("/devices")).status_code == 401


@pytest.mark.integration
def test_state_changing_requests_from_another_site_are_refused(keyed: Node) -> None:
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        r = c.post("/act", json={"episode_id": "robot-2", "inputs": OBS}, headers=KEY)
        assert r.status_code == 200
        host = keyed.url.split("://", 1)[1]
        for headers in (
            {"Origin": "https://evil.example"},
            {"Origin": "null"},
            {"Sec-Fetch-Site": "cross-site", "Origin": f"http://{host}"},
            {"Sec-Fetch-Site": "same-site"},
        ):
            for path in ("/episodes/robot-2/end", "/devices/keyed/0/drain", "/act"):
                auth = ADMIN if "drain" in path else KEY
                body = {"episode_id": "robot-2", "inputs": OBS}
                r = c.post(path, headers={**auth, **headers}, json=body)
                assert r.status_code == 403, (path, headers, r.text)
                assert r.json()["error"]["code"] == "cross_site"
        assert c.get("/episodes/robot-2", headers=KEY).status_code == 200  # still assigned
        same = {"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
        assert c.post("/episodes/robot-2/end", headers={**KEY, **same}).status_code == 200


# ---- item 3: the cluster secret -------------------------------------------------------------


@pytest.mark.integration
def test_a_node_on_redis_without_a_cluster_secret_refuses_to_start() -> None:
    """Issue 41 item 4: without the secret anyone who reached a node's port installed and
    confirmed a forged record through ``/internal/move``; the node only warned. Now it
    exits 2 with one line before it touches Redis; the embedded store (no peers) needs
    none. Run against the code before: it started (and served)."""
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "node.server", "--redis", server.url, "--node-id", "open",
             "--port", str(free_port()), "--devices", "cpu:1"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "AFFINITY_CLUSTER_SECRET is unset" in lines[0], out.stderr
        assert not server.client().exists("{affinity}:node:open")  # it never registered
    finally:
        server.stop()
    from node.cli import parse_args

    assert parse_args(["--devices", "cpu:1"], env={}).cluster_secret is None  # embedded: fine
    secret = {"AFFINITY_CLUSTER_SECRET": "k", "AFFINITY_REDIS_URL": "redis://h"}
    assert parse_args([], env=secret).cluster_secret == "k"


@pytest.mark.integration
def test_a_node_with_another_cluster_secret_cannot_join_and_a_router_answers_503() -> None:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    a = Node(tmp, "sa", server.url, devices="cpu:1", env={"AFFINITY_CLUSTER_SECRET": "one"})
    a.start()
    try:
        assert server.client().get("{affinity}:secret") not in (None, "one", b"one")
        wrong = subprocess.run(
            [sys.executable, "-m", "node.server", "--redis", server.url, "--node-id", "sb",
             "--port", str(free_port()), "--devices", "cpu:1"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "AFFINITY_CLUSTER_SECRET": "two"},
        )  # fmt: skip
        assert wrong.returncode == 2, wrong.stderr
        lines = [line for line in wrong.stderr.splitlines() if line.startswith("affinity-node")]
        assert len(lines) == 1 and "AFFINITY_CLUSTER_SECRET" in lines[0], wrong.stderr
        assert not server.client().exists("{affinity}:node:sb")  # it never registered
        # Had it joined anyway (the digest deleted by hand), a step it forwards is the
        # fleet's fault, not the client's: 503, not 403
        server.client().delete("{affinity}:secret")
        b = Node(tmp, "sb", server.url, devices="cpu:1", env={"AFFINITY_CLUSTER_SECRET": "two"})
        b.start()
        try:
            with httpx.Client(timeout=10) as c:
                for i in range(20):
                    r = c.post(a.url + "/act", json={"episode_id": f"e{i}", "inputs": OBS})
                    assert r.status_code == 200, r.text
                    if r.json()["node"] == "sa":
                        break
                r = c.post(b.url + "/act", json={"episode_id": f"e{i}", "inputs": OBS})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "bad_secret" and "Retry-After" in r.headers
        finally:
            b.stop()
    finally:
        a.stop()
        server.stop()


# ---- item 7: deadlines that hold on Python 3.11 -------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("timeout_us", [1, 100])
async def test_a_kserve_timeout_of_microseconds_is_never_served_late(
    redis: Any, timeout_us: int
) -> None:
    from tests.test_kserve import INFER, request_body

    obs = np.zeros((1, 8), np.float32)
    async with cluster(redis, [config("a", devices="cpu:1")]) as (nodes, _):
        for i in range(5):
            body, headers = request_body(
                obs, sequence_id=f"t{i}", sequence_start=True, timeout=timeout_us
            )
            r = await nodes[0].client.post(INFER, content=body, headers=headers)
            assert r.status_code == 503, r.text
            assert f"the request's timeout of {timeout_us} µs" in r.json()["error"], r.text


@pytest.mark.anyio
async def test_a_redis_call_whose_cancellation_was_swallowed_still_fails_its_deadline() -> None:

    async def swallows() -> str:  # what asyncio.wait_for does on 3.11 (gh-86296)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1)
        return "late"

    with pytest.raises(BackendUnavailable, match=r"did not answer within 0\.01s"):
        await bounded(Settings(redis_deadline_s=0.01), swallows())
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def swallowing(entered: asyncio.Event) -> None:
    """A Redis call into which a cancellation lands and is swallowed (redis-py's
    asyncio.wait_for on Python 3.11, gh-86296): the caller's task goes on as if nothing was
    asked of it."""
    entered.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(3600)


@pytest.mark.anyio
async def test_a_node_stops_though_the_cancellation_of_its_loops_was_swallowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lease's renewal loop and the maintenance loop are cancelled while in a Redis call
    that swallows it: each ends anyway (its flag), the node stops, and the lease is not
    renewed after the node left. Before, the loop went on renewing the lease of a node
    that had left, and the stop waited for it forever (a CI run hung on it)."""
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a")]) as ([a], _):
        service = a.service
        renewing, flushing = asyncio.Event(), asyncio.Event()
        renewals = 0
        original = service.lease.renew_once

        async def renew_once() -> None:
            nonlocal renewals
            renewals += 1
            if renewals == 1:
                await swallowing(renewing)
            else:
                await original()

        monkeypatch.setattr(service.lease, "renew_once", renew_once)
        flushes = 0
        flush = service.owner.flush

        async def flush_once() -> None:  # the first swallows; the next ones are real
            nonlocal flushes
            flushes += 1
            await (swallowing(flushing) if flushes == 1 else flush())

        monkeypatch.setattr(service.owner, "flush", flush_once)
        service.lease.renew_soon()
        await asyncio.wait_for(renewing.wait(), 30)
        await asyncio.wait_for(flushing.wait(), 30)  # the maintenance loop's, once a second
        stopping = asyncio.ensure_future(service.stop())
        await asyncio.wait({stopping}, timeout=60)  # (not wait_for: stop() would swallow it)
        assert stopping.done(), "the stop waits for a loop that goes on"
        assert renewals == 1  # none after the swallowed one: it had left
        assert service.lease._task is None and service._maintenance is not None
        assert service._maintenance.done()


# ---- items 4 and 5: Redis connections under a burst ------------------------------------------


async def burst(
    url: str, requests: list[bytes]
) -> tuple[list[tuple[int, bytes]], list[asyncio.StreamWriter]]:
    """Send every request on a connection of its own, all at once: (status, head) of
    each reply, and the connections (still open: close them)."""
    host, port = url.removeprefix("http://").split(":")

    async def one(raw: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(raw)
        await writer.drain()
        return reader, writer

    conns = await asyncio.gather(*(one(raw) for raw in requests))
    out = []
    for reader, _ in conns:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
        out.append((int(head.split(b" ", 2)[1]), head))
    return out, [writer for _, writer in conns]


async def statuses_of(url: str, requests: list[bytes]) -> list[int]:
    replies, writers = await burst(url, requests)
    for writer in writers:
        writer.close()
    return [status for status, _ in replies]


def get(path: str, headers: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{headers}\r\n".encode()


def post_act(episode: str) -> bytes:
    body = orjson.dumps({"episode_id": episode, "inputs": OBS})
    return (
        f"POST /act HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


@pytest.mark.integration
@pytest.mark.shapes  # (with fronts: the hop's slots, the pass-on)
def test_concurrent_event_streams_stop_at_the_limit_and_never_starve_the_lease() -> None:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    node = Node(tmp, "sse", server.url, devices="cpu:1", extra=["--lease-ttl", "3"]).start()
    try:

        async def scenario() -> None:
            replies, streams = await burst(node.url, [get("/events/stream?backlog=0")] * 60)
            statuses = [status for status, _ in replies]
            assert statuses.count(200) == 32 and statuses.count(503) == 28, statuses
            assert all(b"retry-after: 2" in head.lower() for s, head in replies if s == 503)
            # while the 32 streams hold their connections, steps and renewals go on
            with httpx.Client(timeout=10) as c:
                for i in range(10):
                    r = c.post(node.url + "/act", json={"episode_id": f"s{i}", "inputs": OBS})
                    assert r.status_code == 200, r.text
                renewed = metric_with(c.get(node.url + "/metrics").text, 'result="ok"')
                wait_until(
                    lambda: (
                        metric_with(c.get(node.url + "/metrics").text, 'result="ok"') > renewed + 1
                    ),
                    10,
                    "two more lease renewals",
                )
                text = c.get(node.url + "/metrics").text
                assert metric_with(text, 'result="failed"') == 0
                assert metric(text, "affinity_fenced") == 0
            assert await statuses_of(node.url, [get("/events/stream")]) == [503]  # still full
            for writer in streams:
                writer.close()

        asyncio.run(scenario())
        # once the streams are gone their slots are free again
        wait_until(
            lambda: asyncio.run(statuses_of(node.url, [get("/events/stream")])) == [200],
            10,
            "a free stream slot",
        )
    finally:
        node.stop()
        server.stop()


def metric_with(text: str, label: str) -> float:
    name = "affinity_lease_renewals_total"
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.split()[-1])
    return 0.0


@pytest.mark.integration
@pytest.mark.shapes  # (with fronts: the hop's slots, the pass-on)
def test_a_burst_of_400_new_episodes_gets_no_spurious_503() -> None:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    node = Node(
        tmp, "burst", server.url, devices="cpu:2",
        extra=["--capacity", "1000", "--act-deadline", "120"],
    ).start()  # fmt: skip
    try:
        statuses = asyncio.run(statuses_of(node.url, [post_act(f"b{i}") for i in range(400)]))
        assert statuses == [200] * 400, {s: statuses.count(s) for s in set(statuses)}
        assert server.client().dbsize() >= 400  # every episode claimed
    finally:
        node.stop()
        server.stop()


@pytest.mark.anyio
async def test_a_wait_for_a_pool_connection_past_the_deadline_is_busy_not_redis() -> None:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    # a deadline a busy machine's connect and ping stay within (the waits below last it)
    settings = Settings(redis_url=server.url, redis_max_connections=1, redis_deadline_s=1.0)
    client = connect(settings)
    try:
        assert await bounded(settings, client.ping())
        held = await client.connection_pool.get_connection()  # the pool's only connection
        with pytest.raises(PoolExhausted, match="all 1 Redis connections"):
            await bounded(settings, client.ping())
        await client.connection_pool.release(held)
        assert await bounded(settings, client.ping())  # free again: Redis is asked
        server.proc.send(signal.SIGSTOP)  # Redis itself silent: that one is Redis's
        try:
            with pytest.raises(BackendUnavailable) as caught:
                await bounded(settings, client.ping())
            assert not isinstance(caught.value, PoolExhausted)
        finally:
            server.proc.send(signal.SIGCONT)
    finally:
        await client.aclose()
        server.stop()


@pytest.mark.integration
def test_an_overloaded_node_answers_busy_with_retry_after_not_redis() -> None:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    node = Node(
        tmp, "small", server.url, devices="cpu:1",
        extra=["--capacity", "100", "--lease-ttl", "20"],
        env={"AFFINITY_REDIS_MAX_CONNECTIONS": "2", "AFFINITY_REDIS_DEADLINE": "0.5"},
    ).start()  # fmt: skip
    try:
        with httpx.Client(timeout=10) as c:
            warm = c.post(node.url + "/act", json={"episode_id": "w", "inputs": OBS})
            assert warm.status_code == 200, warm.text

        async def many() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=40)
            async with httpx.AsyncClient(timeout=30, limits=limits) as c:
                return await asyncio.gather(
                    *(
                        c.post(node.url + "/act", json={"episode_id": f"o{i}", "inputs": OBS})
                        for i in range(20)
                    )
                )

        server.proc.send(signal.SIGSTOP)  # the node's 2 connections hang in a call
        try:
            replies = asyncio.run(many())
        finally:
            server.proc.send(signal.SIGCONT)
        codes = [r.json()["error"]["code"] for r in replies]
        assert all(r.status_code == 503 for r in replies), codes
        assert set(codes) <= {"busy", "redis"}, codes
        busy = [r for r in replies if r.json()["error"]["code"] == "busy"]
        assert busy, codes
        assert all(r.headers["retry-after"] == "1" for r in busy)
        assert all("Redis itself was not asked" in r.json()["error"]["message"] for r in busy)
    finally:
        node.stop()
        server.stop()


# ---- item 9: inputs for another model are the client's, not a crash ----------------------------


@pytest.mark.integration
def test_inputs_that_do_not_fit_the_owners_model_are_4xx_and_never_take_its_device_down() -> None:
    """A node of another model joins a fleet of demo nodes (issue 24's motivating case): a
    step that names no model is 422 naming both, demo steps land only on the demo node, and
    demo inputs sent to the other model are the client's error on every node."""
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    demo = Node(tmp, "demo", server.url, devices="cpu:1").start()
    other = Node(tmp, "vla", server.url, devices="cpu:1", extra=["--model", "vla-demo"]).start()
    try:
        with httpx.Client(timeout=30) as c:
            r = c.post(demo.url + "/act", json={"episode_id": "none", "inputs": OBS})
            assert r.status_code == 422 and r.json()["error"]["code"] == "model_required"
            assert "demo_policy" in r.text and "vla_demo" in r.text
            for i in range(8):
                body = {"episode_id": f"m{i}", "model": "demo_policy", "inputs": OBS}
                r = c.post(demo.url + "/act", json=body)
                assert r.status_code == 200 and r.json()["node"] == "demo", r.text
            for node in (demo, other):
                for i in range(4):  # more than --failure-threshold (3)
                    body = {"episode_id": f"v{i}", "model": "vla_demo", "inputs": OBS}
                    r = c.post(node.url + "/act", json=body)
                    assert r.status_code == 422, r.text
                    assert r.json()["error"]["code"] == "bad_input" and "image" in r.text
            devices = {
                d["device"]: d["state"] for d in c.get(demo.url + "/devices").json()["devices"]
            }
            assert devices == {"demo/0": "active", "vla/0": "active"}, devices
            local = c.get(other.url + "/devices").json()["devices"]
            assert [d["local"]["consecutive_failures"] for d in local if "local" in d] == [0]
    finally:
        other.stop()
        demo.stop()
        server.stop()


@pytest.mark.integration
def test_a_websocket_from_another_site_is_refused(keyed: Node) -> None:
    def handshake(extra: str) -> bytes:
        with socket.create_connection((keyed.host, keyed.port), timeout=10) as sock:
            sock.sendall(
                (
                    "GET / HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                    f"Authorization: Api-Key k3y\r\n{extra}\r\n"
                ).encode()
            )
            return sock.recv(4096).split(b"\r\n", 1)[0]

    assert b" 403 " in handshake("Origin: https://evil.example\r\n")
    assert b" 101 " in handshake("")


@pytest.mark.anyio
async def test_every_operator_endpoint_answers_a_redis_failure_with_one_handler() -> None:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a")]) as (nodes, _):
        node = nodes[0]
        service = node.service
        calls = [
            ("GET", "/nodes"),
            ("GET", "/devices"),
            ("GET", "/episodes/ep-1"),
            ("POST", "/episodes/ep-1/end"),
        ]
        for failure, code in (
            (BackendUnavailable("Redis did not answer within 2.0s"), "redis"),
            (PoolExhausted(128, 2.0), "busy"),
        ):

            async def fail(*args: object, exc: Exception = failure, **kwargs: object) -> None:
                raise exc

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(Inventory, "nodes", fail)
                mp.setattr(Inventory, "devices", fail)
                mp.setattr(service.claims, "lookup", fail)
                for method, path in calls:
                    r = await node.client.request(
                        method, path, headers={"X-Requested-With": "test"}
                    )
                    assert r.status_code == 503, (path, r.text)
                    assert r.json()["error"]["code"] == code, (path, r.text)
                    assert r.headers["retry-after"] == "1"


def test_readiness_checks_take_descriptors_past_1023() -> None:
    """A node holding a thousand robots' connections has descriptors past 1023, which
    ``select.select`` refuses (``ValueError``): the keep-alive check of an idle connection
    (``node/httpproto.py``), the worker processes' hello and doorbells
    (``node/deviceprocs.py``) poll instead (``hop.readable``), at any number. Each is
    driven itself, not only the helper."""
    import resource
    from types import SimpleNamespace

    from node import deviceprocs, httpproto
    from node.hop import readable

    def kept_alive(fd: int) -> bool:  # the keep-alive check itself: kept (data) or closed
        proto = httpproto.KeepAliveProtocol.__new__(httpproto.KeepAliveProtocol)
        later: list[Any] = []
        closed: list[bool] = []
        proto.transport = SimpleNamespace(  # type: ignore[assignment]
            get_extra_info=lambda name: SimpleNamespace(fileno=lambda: fd),
            is_closing=lambda: False, close=lambda: closed.append(True),
        )  # fmt: skip
        proto.loop = SimpleNamespace(call_later=lambda *a: later.append(a))  # type: ignore[assignment]
        proto.timeout_keep_alive = 5.0
        proto.timeout_keep_alive_handler()
        assert bool(later) != bool(closed)
        return bool(later)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    high = 1500
    if hard != resource.RLIM_INFINITY and hard <= high:
        pytest.skip(f"this machine allows {hard} descriptors")
    if soft != resource.RLIM_INFINITY and soft <= high:
        resource.setrlimit(resource.RLIMIT_NOFILE, (high + 1, hard))
    a, b = socket.socketpair()
    try:
        for check in (readable, kept_alive):
            os.dup2(a.fileno(), high)
            try:
                assert not check(high)
                b.send(b"x")
                assert check(high)
            finally:
                os.close(high)
            a.recv(16)
        r, w = os.pipe()  # a worker's hello read through a descriptor past 1023
        os.dup2(r, high)
        os.close(r)
        with os.fdopen(w, "wb") as pipe:
            pipe.write(b'{"models": []}\n')
        assert deviceprocs._hello(high, 5.0) == {"models": []}  # (closes it)
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
