"""node/forward.py: the keep-alive pool against real sockets on loopback, and the forward's
msgpack body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import numpy as np
import pytest

from affinity import wire
from node.errors import ForwardError
from node.forward import Forward, ForwardPool, decode_reply, encode_reply
from node.rtc import Ask
from node.step import Reply, Step
from tests.procs import free_port

pytestmark = pytest.mark.anyio

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]


@asynccontextmanager
async def server(respond: Handler) -> AsyncIterator[dict[str, int]]:
    """A raw HTTP/1.1 server on loopback; ``respond(body, writer)`` answers one request
    and says whether to keep the connection open. Yields counters."""
    seen = {"connections": 0, "requests": 0}

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                seen["requests"] += 1
                if not await respond(body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    port = free_port()
    srv = await asyncio.start_server(on_connection, "127.0.0.1", port)
    seen["port"] = port
    try:
        yield seen
    finally:
        srv.close()
        await srv.wait_closed()


def answer(writer: asyncio.StreamWriter, body: bytes, extra: str = "") -> None:
    writer.write(f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body)


async def echo(body: bytes, writer: asyncio.StreamWriter) -> bool:
    answer(writer, body)
    return True


async def test_connections_are_reused_and_bodies_arrive_whole() -> None:
    async with server(echo) as seen:
        pool = ForwardPool("k")
        url = f"http://127.0.0.1:{seen['port']}"
        for i in range(20):
            body = bytes([i]) * (i * 5000)  # up to ~95 kB, over several TCP segments
            r = await pool.post(url, body)
            assert (r.status, r.body) == (200, body)
        assert seen["connections"] == 1
        got = await asyncio.gather(*(pool.post(url, b"x%d" % i) for i in range(10)))
        assert [r.body for r in got] == [b"x%d" % i for i in range(10)]
        assert seen["connections"] <= 10
        pool.close()


async def test_a_reused_connection_closed_before_any_answer_is_retried_once() -> None:
    per_connection: dict[int, int] = {}

    async def drop_second(body: bytes, writer: asyncio.StreamWriter) -> bool:
        n = per_connection[id(writer)] = per_connection.get(id(writer), 0) + 1
        if n == 2:
            return False  # closed without a byte of answer, as a keep-alive timeout does
        answer(writer, body)
        return True

    async with server(drop_second) as seen:
        pool = ForwardPool("k")
        url = f"http://127.0.0.1:{seen['port']}"
        assert (await pool.post(url, b"a")).body == b"a"
        assert (await pool.post(url, b"b")).body == b"b"  # dropped once, retried on a new one
        assert seen["requests"] == 3 and seen["connections"] == 2
        pool.close()


async def test_connection_close_is_honoured() -> None:
    async def closing(body: bytes, writer: asyncio.StreamWriter) -> bool:
        answer(writer, body, "connection: close\r\n")
        return False

    async with server(closing) as seen:
        pool = ForwardPool("k")
        url = f"http://127.0.0.1:{seen['port']}"
        for i in range(3):
            assert (await pool.post(url, b"%d" % i)).body == b"%d" % i
        assert seen["connections"] == 3
        pool.close()


async def test_a_broken_answer_is_not_retried() -> None:
    async def half(body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        return False

    async with server(half) as seen:
        pool = ForwardPool("k")
        with pytest.raises(ForwardError, match="after"):
            await pool.post(f"http://127.0.0.1:{seen['port']}", b"x")
        assert seen["requests"] == 1  # the step may have run: never sent twice
        pool.close()


async def test_unreachable_owner_and_cancellation() -> None:
    pool = ForwardPool("k")
    with pytest.raises(ForwardError, match="cannot connect"):
        await pool.post(f"http://127.0.0.1:{free_port()}", b"x")
    with pytest.raises(ForwardError, match="http"):
        await pool.post("ftp://somewhere", b"x")

    release = asyncio.Event()

    async def slow(body: bytes, writer: asyncio.StreamWriter) -> bool:
        await release.wait()
        answer(writer, body)
        return True

    async with server(slow) as seen:
        url = f"http://127.0.0.1:{seen['port']}"
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await pool.post(url, b"late")
        release.set()
        # the cancelled request's connection is not reused for the next one
        assert (await pool.post(url, b"next")).body == b"next"
        assert seen["connections"] == 2
    pool.close()


def test_forward_and_reply_bodies_round_trip() -> None:
    step = Step(
        episode="ep/1",
        inputs={"obs": np.arange(8, dtype=np.float32).reshape(1, 8)},
        deadline=0.0,
        end=True,
        degraded=True,
        client_token=7,
        execute_steps=3,
    )
    fwd = Forward(step, token=2**62, device="a/0", routing="hit", budget_s=1.25)
    back = Forward.decode(fwd.encode())
    np.testing.assert_array_equal(back.step.inputs["obs"], step.inputs["obs"])
    assert (back.episode, back.token, back.device, back.routing, back.step.end) == (
        "ep/1",
        2**62,
        "a/0",
        "hit",
        True,
    )
    assert (back.budget_s, back.step.degraded, back.step.client_token, back.step.execute_steps) == (
        1.25,
        True,
        7,
        3,
    )
    for broken in [b"\x90", Forward.encode(fwd)[:-3], b"\x81\xa1x\x01"]:
        with pytest.raises(ValueError):
            Forward.decode(broken)

    reply = Reply({"a": np.ones((1, 4, 2), np.float32)}, "e", "a/0", "a", 5, "hit", True, False)
    got = decode_reply(encode_reply(reply))
    np.testing.assert_array_equal(got.outputs["a"], reply.outputs["a"])
    assert got.facts() == reply.facts()


OLD_KEYS = {
    "episode_id", "token", "device", "routing", "inputs", "budget_ms", "end", "degraded",
    "client_token", "execute_steps", "ensemble", "seq", "origin", "undo", "claim", "instance",
    "model", "rtc", "elapsed_ms", "restart", "release", "client_claim",
}  # fmt: skip


def test_a_forward_carries_the_step_whole_under_the_old_keys() -> None:
    """The step travels field by field, under the msgpack keys an older node reads and
    writes: a forward of each kind decodes on both sides."""
    step = Step("ep", {"obs": np.zeros((1, 8), np.float32)}, 0.0, end=True, client_token=3,
                degraded=True, restart=True, execute_steps=2, ensemble="avg", seq=5,
                origin="ab12", rtc=Ask(1, 2, 50.0, None), client_claim="c1",
                model="ignored", door="kserve", control_hz=50.0)  # fmt: skip
    fwd = Forward(step, 7, "a/0", "claimed", 0.5, claim="c2", instance="i", model="m@v1",
                  elapsed_s=0.25)  # fmt: skip
    doc = wire.decode(fwd.encode())
    assert doc.keys() == OLD_KEYS
    assert doc["episode_id"] == "ep" and doc["rtc"] == [1, 2, 50.0, None]
    assert (doc["budget_ms"], doc["elapsed_ms"], doc["seq"], doc["origin"]) == (500, 250, 5, "ab12")
    back = Forward.decode(fwd.encode())
    got = back.step
    assert (got.episode, got.end, got.client_token, got.degraded, got.restart) == (
        "ep", True, 3, True, True)  # fmt: skip
    assert (got.execute_steps, got.ensemble, got.seq, got.origin, got.client_claim) == (
        2, "avg", 5, "ab12", "c1")  # fmt: skip
    assert got.rtc == Ask(1, 2, 50.0, None) and (got.model, got.version) == ("m", "v1")
    assert (got.door, got.control_hz) == ("act", None)  # the router's own: not sent
    assert (back.token, back.device, back.routing, back.claim, back.instance) == (
        7, "a/0", "claimed", "c2", "i")  # fmt: skip
    # what an older node sends (its own literal map, fewer keys) still decodes
    old = {"episode_id": "ep", "token": 1, "device": "a/0", "routing": "hit", "inputs": {},
           "budget_ms": 100, "undo": True, "origin": "ff", "seq": 4,
           "rtc": [1, 2, None]}  # fmt: skip
    undo = Forward.decode(wire.encode(old))
    assert undo.undo and (undo.step.origin, undo.step.seq, undo.step.rtc) == (
        "ff",
        4,
        Ask(1, 2, None),
    )
    about = Forward.decode(
        Forward.about("ep", 1, "a/0", 0.5, origin="ff", seq=4, undo=True).encode()
    )
    assert about.undo and not about.release and (about.step.origin, about.step.seq) == ("ff", 4)
    assert not about.doubt and "doubt" not in wire.decode(about.encode())  # (older nodes' map)
    doubted = Forward.decode(
        Forward.about("ep", 1, "a/0", 0.5, origin="ff", undo=True, doubt=True).encode()
    )
    assert doubted.undo and doubted.doubt  # a reply that may have reached its client
