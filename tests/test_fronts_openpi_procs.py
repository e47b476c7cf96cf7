"""openpi's websocket through ``--front-doors 2`` (issue 43), real processes and the
unmodified ``openpi-client``: the fronts decode and encode every frame and each step
crosses the hop, the node's process (the core) applies it with the same rules as its own
door (``node/protocols/openpi.py``): sticky steps equal to the reference rollout, frames of
rows, openpi's errors, 401, the connection's own episode ended when it closes (or when its
front dies), a front killed mid-step costing only the connection (a retry with ``seq``
gets the kept reply, the step applied once); and the core never sees a websocket."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets.exceptions
import websockets.sync.client
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from affinity import Keys
from tests.models import counter_policy
from tests.procs import (
    Node,
    RedisServer,
    connections,
    handing_over,
    held_mid_step,
    slow_link,
    wait_until,
)
from tests.test_fronts_procs import embedded, fronts
from tests.test_openpi import libero, replay

pytestmark = [
    pytest.mark.integration,
    # openpi-client connects without a context manager (websockets 17.1 deprecated that)
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]

KEYS = Keys()


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("fronts-openpi-redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Node]:
    tmp: Path = tmp_path_factory.mktemp("fronts-openpi")
    extra = ["--front-doors", "2", "--model", "vla-demo", "--act-deadline", "8"]
    n = Node(tmp, "fo", redis.url, devices="cpu:1", extra=extra)
    try:
        n.start(timeout=60)
        wait_until(lambda: len(fronts(n)) == 2, 30, "two fronts")
        yield n
    finally:
        n.stop()


def client(node: Node, query: str = "", api_key: str | None = None) -> WebsocketClientPolicy:
    return WebsocketClientPolicy(f"ws://{node.host}:{node.port}/{query}", api_key=api_key)


def metric(node: Node, line: str) -> float:
    text = httpx.get(node.url + "/metrics", timeout=10).text
    found = [li for li in text.splitlines() if li.startswith(line + " ")]
    return float(found[0].split()[-1]) if found else 0.0


def test_sticky_steps_through_either_front_equal_the_reference_rollout(node: Node) -> None:
    obs = libero(11, 8)
    want = replay(obs)
    replies = []
    for i, o in enumerate(obs):  # a new connection each step: either front takes it
        policy = client(node, "?episode_id=fo-sticky")
        meta = policy.get_server_metadata()
        assert meta["affinity"]["episode_id"] == "fo-sticky"
        assert meta["affinity"]["node"] == node.node_id and meta["action_horizon"] == 10
        assert meta["affinity"]["policy"]["inputs"]
        replies.append(policy.infer({**o, "seq": i + 1, "timing": i == 3}))
        policy._ws.close()
    assert len({r["device"] for r in replies}) == 1
    assert [r["routing"] for r in replies] == ["claimed"] + ["hit"] * 7
    assert [r["seq"] for r in replies] == list(range(1, 9))
    assert not any(r["state_reset"] or r["replayed"] for r in replies)
    for got, expected in zip(replies, want, strict=True):
        assert got["actions"].shape == (10, 7) and got["actions"].dtype == np.float32
        np.testing.assert_allclose(got["actions"], expected, rtol=1e-4, atol=1e-5)
        assert got["server_timing"]["infer_ms"] > 0 and "infer_ms" in got["policy_timing"]
    assert "timing" in replies[3] and "timing" not in replies[2]
    # one connection: the token echoed, the previous step's total time reported
    policy = client(node, "?episode_id=fo-sticky")
    more = [policy.infer(o) for o in libero(12, 2)]
    policy._ws.close()
    assert [r["routing"] for r in more] == ["hit", "hit"] and not more[1]["state_reset"]
    assert "prev_total_ms" in more[1]["server_timing"]
    assert "prev_total_ms" not in more[0]["server_timing"]


def test_the_core_never_sees_a_websocket(node: Node) -> None:
    """The core's Unix socket (the fronts pass other paths to it) answers HTTP but does
    not upgrade a websocket: every openpi frame was decoded in a front."""
    assert node.proc.popen is not None
    core = node.proc.popen.pid
    with open("/proc/net/unix") as f:
        names = [line.split()[-1] for line in f.readlines()[1:]]
    name = next(n for n in names if n.startswith(f"@affinity-core-{core}-"))

    def ask(request: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect("\0" + name[1:])
            sock.sendall(request.encode())
            return sock.recv(65536).decode("latin-1").split("\r\n", 1)[0]

    assert ask("GET /healthz HTTP/1.1\r\nHost: core\r\nConnection: close\r\n\r\n").startswith(
        "HTTP/1.1 200"
    )
    upgrade = ask(
        "GET /?episode_id=x HTTP/1.1\r\nHost: core\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    )
    assert not upgrade.startswith("HTTP/1.1 101"), upgrade
    # while steps through the fronts are served
    policy = client(node, "?episode_id=fo-core")
    assert policy.infer(libero(13, 1)[0])["routing"] == "claimed"
    policy._ws.close()


def test_a_frame_of_rows_is_answered_with_rows(node: Node) -> None:
    obs = libero(14, 3)
    frame: dict[str, Any] = {
        key: np.stack([o[key] for o in obs]) for key in obs[0] if key != "prompt"
    }
    frame["prompt"] = "put the bowl on the plate"  # one value: every row's
    frame["episode_ids"] = ["fo-rows-0", "fo-rows-1", "fo-rows-2"]
    policy = client(node)
    got = policy.infer(frame)
    assert got["actions"].shape == (3, 10, 7)
    assert [r["episode_id"] for r in got["rows"]] == frame["episode_ids"]
    assert all(r["routing"] == "claimed" for r in got["rows"])
    for i, o in enumerate(obs):
        np.testing.assert_allclose(got["actions"][i], replay([o])[0], rtol=1e-4, atol=1e-5)
    # an id in two rows is the frame's error: openpi's, the connection closed
    frame["episode_ids"] = ["fo-rows-0", "fo-rows-0", "fo-rows-2"]
    with pytest.raises(RuntimeError, match="fo-rows-0"):
        policy.infer(frame)


def test_a_bad_observation_is_the_clients_runtime_error(node: Node, redis: RedisServer) -> None:
    before = metric(node, 'affinity_rejected_requests_total{reason="bad_input"}')
    lines = node.proc.log().count('"WS /" 422 ')
    policy = client(node, "?episode_id=fo-bad")
    bad = libero(15, 1)[0]
    bad["observation/image"] = bad["observation/image"][:100]
    with pytest.raises(RuntimeError, match=r"bad observation: .*observation/image"):
        policy.infer(bad)
    with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
        policy._ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
    assert redis.client().get(KEYS.episode("fo-bad")) is None  # nothing was claimed
    assert metric(node, 'affinity_rejected_requests_total{reason="bad_input"}') == before + 1
    wait_until(lambda: node.proc.log().count('"WS /" 422 ') == lines + 1, 10,
               "the refused step's access line")  # fmt: skip
    # a frame that is not msgpack: refused in the front, counted by the core
    policy = client(node, "?episode_id=fo-bad")
    policy._ws.send(b"\xc1")
    assert policy._ws.recv(timeout=10).startswith("bad observation: ")
    # an unknown query key: the metadata, then the error as the first reply
    typo = client(node, "?episode=fo-typo")
    with pytest.raises(RuntimeError, match="bad query: unknown key 'episode'"):
        typo.infer(libero(15, 1)[0])
    assert redis.client().get(KEYS.episode("fo-typo")) is None
    # a malformed ?episode_id= (empty): closed before the handshake completes, counted
    counted = metric(node, 'affinity_rejected_requests_total{reason="bad_input"}')
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        client(node, "?episode_id=")
    assert refused.value.response.status_code == 403
    assert metric(node, 'affinity_rejected_requests_total{reason="bad_input"}') == counted + 1


def test_each_step_writes_one_access_line(node: Node) -> None:
    policy = client(node, "?episode_id=fo-logged")
    replies = [policy.infer(o) for o in libero(16, 3)]
    policy._ws.close()
    device = replies[0]["device"]

    def lines() -> list[str]:
        return [li for li in node.proc.log().splitlines() if "episode=fo-logged " in li
                or li.endswith("episode=fo-logged")]  # fmt: skip

    wait_until(lambda: len(lines()) == 3, 10, "three access lines")
    for line, routing in zip(lines(), ["claimed", "hit", "hit"], strict=True):
        assert '"WS /" 200 ' in line, line
        assert line.endswith(f"ms episode=fo-logged device={device} routing={routing}"), line


def test_a_connections_own_episode_ends_when_it_closes_or_its_front_dies(
    node: Node, redis: RedisServer
) -> None:
    r = redis.client()
    policy = client(node)
    first = policy.infer(libero(17, 1)[0])
    own = first["episode_id"]
    assert own.startswith("ws-") and first["routing"] == "claimed"
    assert r.get(KEYS.episode(own)) is not None
    again = policy.infer(libero(17, 2)[1])
    assert again["episode_id"] == own and again["routing"] == "hit"
    policy._ws.close()
    wait_until(lambda: r.get(KEYS.episode(own)) is None, 10, "the episode released on close")
    # the front holding the connection dies: the core ends the episode as for a close
    policy = client(node)
    own = policy.infer(libero(18, 1)[0])["episode_id"]
    assert r.get(KEYS.episode(own)) is not None
    holder = max(fronts(node), key=lambda pid: connections(pid, node.port))
    assert connections(holder, node.port) == 1
    os.kill(holder, signal.SIGKILL)
    wait_until(lambda: r.get(KEYS.episode(own)) is None, 10, "the episode released")
    wait_until(lambda: len(fronts(node)) == 2 and holder not in fronts(node), 30, "a new front")


def test_a_websocket_without_the_key_is_401_in_the_front(tmp_path: Path) -> None:
    node = embedded(tmp_path, "fk", env={"AFFINITY_API_KEY": "k3y"}).start(timeout=60)
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            client(node, "?episode_id=fk-1", api_key="wrong")
        assert refused.value.response.status_code == 401
        body = json.loads(refused.value.response.body)
        assert body["error"]["code"] == "unauthorized"
        assert refused.value.response.headers["www-authenticate"] == "Api-Key"
        policy = client(node, "?episode_id=fk-1", api_key="k3y")
        assert policy.get_server_metadata()["affinity"]["episode_id"] == "fk-1"
        got = policy.infer({"obs": np.zeros(8, np.float32)})
        assert got["routing"] == "claimed" and got["actions"].shape[0] > 0
        policy._ws.close()
        wait_until(lambda: '"WS /" 401' in node.proc.log(), 10, "the refusal's access line")
        assert metric(node, 'affinity_rejected_requests_total{reason="unauthorized"}') == 1
    finally:
        node.stop()


def test_a_front_killed_mid_step_loses_no_step_and_applies_none_twice(tmp_path: Path) -> None:
    """The front holding a robot's connection is killed while the core runs its step (a
    slow model): the connection goes. The robot reconnects (another front, or the new one)
    and retries with the same ``seq``: it gets the kept reply, and the episode counted that
    step once."""
    node = embedded(tmp_path, "fm", model=counter_policy(tmp_path, repeats=400, width=512))
    node.proc.argv += ["--act-deadline", "60"]  # a slow model on a busy machine
    node.start(timeout=60)
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")

        def step(policy: WebsocketClientPolicy, seq: int) -> dict[str, Any]:
            reply: dict[str, Any] = policy.infer({"obs": np.zeros(8, np.float32), "seq": seq})
            return reply

        def count(reply: dict[str, Any]) -> int:
            return int(np.asarray(reply["count"]).reshape(-1)[0])

        policy = client(node, "?episode_id=fm-slow")
        first = step(policy, 1)
        assert count(first) == 1 and first["seq"] == 1
        lost: list[BaseException] = []

        def second() -> None:
            try:
                step(policy, 2)
            except websockets.exceptions.ConnectionClosed as exc:
                lost.append(exc)

        sender = threading.Thread(target=second)
        sender.start()
        with held_mid_step(lambda: fronts(node), node.port, node.pid()) as holder:
            assert sender.is_alive(), "the step was answered before its front could be killed"
            os.kill(holder, signal.SIGKILL)  # the core paused: the step still runs
        sender.join(60)
        assert lost, "the robot should have lost its connection with its front"
        retry = None
        for _ in range(100):  # the other front, or the new one once it is up
            try:
                again = client(node, "?episode_id=fm-slow")
                retry = step(again, 2)
                break
            except (OSError, websockets.exceptions.WebSocketException, RuntimeError):
                time.sleep(0.1)
        assert retry is not None
        assert retry["replayed"] and count(retry) == 2 and not retry["state_reset"], retry
        third = step(again, 3)
        assert count(third) == 3 and not third["replayed"]
        again._ws.close()
    finally:
        node.stop()


def test_a_step_whose_robot_left_mid_step_is_held_for_its_retry(tmp_path: Path) -> None:
    """The robot closes its connection while the core runs its step (a slow model): the
    front sees the close, and the core, told the reply was not delivered, holds the step
    its ``seq`` named. The robot's retry on a new connection gets that kept reply: applied
    once, never twice, never from a reset."""
    node = embedded(tmp_path, "fl", model=counter_policy(tmp_path, repeats=400, width=512))
    node.proc.argv += ["--act-deadline", "60"]  # a slow model on a busy machine
    node.start(timeout=60)
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
        url = f"ws://{node.host}:{node.port}/?episode_id=fl-left"
        policy = client(node, "?episode_id=fl-left")
        first = policy.infer({"obs": np.zeros(8, np.float32), "seq": 1})
        assert int(np.asarray(first["count"]).reshape(-1)[0]) == 1
        policy._ws.close()
        with websockets.sync.client.connect(url, max_size=None) as ws:
            ws.recv(timeout=10)  # the metadata
            ws.send(msgpack_numpy.packb({"obs": np.zeros(8, np.float32), "seq": 2}))
            with held_mid_step(lambda: fronts(node), node.port, node.pid()):
                ws.close()  # the robot leaves while the core runs its step

        # the front saw the robot leave mid-step (its access line says 499, and the episode)
        def left() -> bool:
            return any('"WS /" 499 ' in line and "episode=fl-left " in line
                       for line in node.proc.log().splitlines())  # fmt: skip

        wait_until(left, 10, "the left step's access line")
        retry = None
        for _ in range(100):  # until the left step has run (a step in flight is refused)
            again = client(node, "?episode_id=fl-left")
            try:
                retry = again.infer({"obs": np.zeros(8, np.float32), "seq": 2})
                break
            except RuntimeError:
                time.sleep(0.1)
        assert retry is not None
        assert retry["replayed"] and not retry["state_reset"], retry
        assert int(np.asarray(retry["count"]).reshape(-1)[0]) == 2
        third = again.infer({"obs": np.zeros(8, np.float32), "seq": 3})
        assert int(np.asarray(third["count"]).reshape(-1)[0]) == 3 and not third["replayed"]
        again._ws.close()
    finally:
        node.stop()


def slow_robot(node: Node, query: str, observation: dict[str, Any]) -> socket.socket:
    """A robot on a link that carries nothing back: a websocket opened by hand (a client
    library reads in the background) on a socket with a small receive buffer, one
    observation sent, nothing ever read."""
    sock = slow_link(node.host, node.port)
    key = base64.b64encode(os.urandom(16))
    sock.sendall(b"GET /" + query.encode() + b" HTTP/1.1\r\nHost: robot\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Key: " + key +
                 b"\r\nSec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)  # (the metadata frame after it is left unread)
    assert head.startswith(b"HTTP/1.1 101"), head
    payload = msgpack_numpy.packb(observation)
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    length = (
        bytes([0x80 | len(payload)])
        if len(payload) < 126
        else b"\xfe" + len(payload).to_bytes(2, "big")
    )
    sock.sendall(b"\x82" + length + mask + masked)  # one binary frame, masked as a client's
    return sock


def test_a_front_dead_with_a_reply_in_its_buffer_leaves_that_step_in_doubt(tmp_path: Path) -> None:
    """A robot on a slow link: its step's reply (12 MB) fills the kernel's socket buffers
    and the rest waits in its front's own buffer, so the slot says DELIVERING. The front is
    killed then. Whether the robot got that step is unknown to the core: the episode's next
    step starts clean and says ``state_reset`` (DESIGN rule 6), never a silent continuation
    from the step before. (Before, the slot was freed once the reply was in the front's
    buffer: the step stood with its reply gone with the process.)"""
    node = embedded(tmp_path, "fd", model=counter_policy(tmp_path, wide=3 << 20))
    node.start(timeout=60)

    def count(reply: dict[str, Any]) -> int:
        return int(np.asarray(reply["count"]).reshape(-1)[0])

    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
        policy = client(node, "?episode_id=fd-slow")
        assert count(policy.infer({"obs": np.zeros(8, np.float32)})) == 1
        policy._ws.close()
        # the first step's slot is freed once its front has seen the reply leave
        wait_until(lambda: handing_over(lambda: fronts(node)) is None, 30, "the reply sent")
        robot = slow_robot(node, "?episode_id=fd-slow", {"obs": np.ones(8, np.float32)})
        try:
            holder = wait_until(lambda: handing_over(lambda: fronts(node)), 60,
                                "a front handing the step's reply over", interval=0.01)  # fmt: skip
            os.kill(holder, signal.SIGKILL)
        finally:
            robot.close()
        after = None
        for _ in range(100):  # the other front, or the new one once it is up
            try:
                again = client(node, "?episode_id=fd-slow")
                after = again.infer({"obs": np.zeros(8, np.float32)})
                break
            except (OSError, websockets.exceptions.WebSocketException, RuntimeError):
                time.sleep(0.1)
        assert after is not None
        later = again.infer({"obs": np.zeros(8, np.float32)})
        # in doubt before the next step ran: it starts clean and says so; or the next step
        # ran on top of it before the core saw its front die (guarantees.md: only
        # state_reset can say so): the one after says it
        seen = [(count(r), bool(r["state_reset"])) for r in (after, later)]
        assert seen in ([(1, True), (2, False)], [(3, False), (1, True)]), seen
        again._ws.close()
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("answer", "status", "code", "closed"),
    [
        ("full", 503, "deadline", False),  # no slot within --act-deadline: never sent
        ("lapsed", 503, "fenced", False),  # the core stuck past its lease: never sent
        ("unreadable", 500, "internal", True),  # sent: the core may have opened it
        ({"err": [503, "redis", "Redis did not answer", None, 1.0]}, 503, "redis", False),
        ({"err": [500, "internal", "a bug", None, None]}, 500, "internal", True),
    ],
)
def test_a_fronts_handshake_refused_before_the_upgrade_says_why(
    answer: Any, status: int, code: str, closed: bool
) -> None:
    """A front refuses an openpi handshake it cannot open as `/act` refuses a step: the
    status, the JSON error body and ``Retry-After`` on a 503, before the upgrade (never a
    close, which a client reads as 403: a bad key); an open that may have reached the core
    is closed there too."""
    import asyncio

    from node.errors import CoreLapsed, HopError, HopFull
    from node.front import FrontApp
    from node.hop import WS_CLOSE, WS_OPEN

    asked: list[int] = []

    class Hop:
        async def call(self, kind: int, meta: Any, arrays: Any, use: Any, **kw: Any) -> Any:
            asked.append(kind)
            if kind == WS_CLOSE:
                return None
            if answer == "full":
                raise HopFull(5.0)
            if answer == "lapsed":
                raise CoreLapsed()
            if answer == "unreadable":
                raise HopError("bad reply")
            return use(kind, answer, [])

    async def run() -> list[dict[str, Any]]:
        hop: Any = Hop()
        app = FrontApp(hop, "/nonexistent.sock", {"max_body_bytes": 1 << 20, "max_rows": 8})
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "websocket.connect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "websocket", "path": "/", "query_string": b"", "headers": [],
                 "extensions": {"websocket.http.response": {}}}  # fmt: skip
        await app.openpi(scope, receive, send)
        await asyncio.gather(*app._closing)
        await app.client.aclose()
        return sent

    sent = asyncio.run(run())
    assert [m["type"] for m in sent] == ["websocket.http.response.start",
                                         "websocket.http.response.body"]  # fmt: skip
    assert sent[0]["status"] == status
    headers = dict(sent[0]["headers"])
    assert headers.get(b"retry-after") == (b"1" if status == 503 else None)
    assert json.loads(sent[1]["body"])["error"]["code"] == code
    assert asked == ([WS_OPEN, WS_CLOSE] if closed else [WS_OPEN])


@pytest.mark.parametrize("close_while", ["running", "handing"])
def test_a_fronts_step_whose_robot_closes_mid_hand_over_is_not_cancelled(close_while: str) -> None:
    """A front watches an openpi connection while its step runs: a close seen then cancels
    the call (the core undoes the step: ``ClientGone``). Once the reply is being handed
    over, a close cancels nothing: the send fails and says that nothing went (undone, not
    put in doubt as a cancelled hand-over would be, whose next step says ``state_reset``)."""
    import asyncio

    from node.errors import Undelivered
    from node.front import FrontApp, _Names
    from node.hop import WS_STEP

    ended: list[str] = []

    async def run() -> tuple[bool, list[str]]:
        closed = asyncio.Event()

        class Hop:
            slot_wait_s = None

            async def call(self, kind: int, meta: Any, arrays: Any, use: Any, **kw: Any) -> Any:
                assert kind == WS_STEP
                try:
                    await asyncio.sleep(0.05)  # past WATCH_AFTER_S: the watch's receive waits
                    if close_while == "running":
                        closed.set()
                        await asyncio.sleep(1)  # cancelled here
                    closed.set()  # the close comes as the reply is handed over
                    if not await kw["deliver"]({"body": b"reply"}, None):
                        ended.append("undelivered")
                        raise Undelivered()
                    ended.append("delivered")
                except asyncio.CancelledError:
                    ended.append("cancelled")
                    raise
                return {}

        hop: Any = Hop()
        app = FrontApp(hop, "/nonexistent.sock", {"max_body_bytes": 1 << 20, "max_rows": 8})

        async def receive() -> dict[str, Any]:
            await closed.wait()
            return {"type": "websocket.disconnect", "code": 1000}

        async def send(message: dict[str, Any]) -> None:  # the robot has gone
            raise RuntimeError("Unexpected ASGI message 'websocket.send', after sending "
                               "'websocket.close'")  # fmt: skip

        scope = {"type": "websocket", "path": "/", "query_string": b"", "headers": []}
        frame = {"type": "websocket.receive", "bytes": msgpack_numpy.packb({"x": 1.0})}
        early: list[Any] = []
        go_on, _ = await app._step(scope, receive, send, _Names(0, None, "ws-0"), frame,
                                   None, early)  # fmt: skip
        for future in early:
            future.cancel()
        await app.client.aclose()
        return go_on, ended

    go_on, said = asyncio.run(run())
    assert not go_on
    assert said == (["cancelled"] if close_while == "running" else ["undelivered"])
