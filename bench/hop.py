"""The front → worker hop that issue 43 plans (front doors in several processes, each
device's episodes in one worker process), measured alone, beside the two hops a node could
use instead, in one run and in alternating rounds:

- ``shm``: the inputs written once into a shared-memory slot, an ``eventfd`` doorbell each
  way; the front waits on its doorbell in its event loop (``add_reader``), the worker
  blocks on its own in a thread of another process (where a device's runs live);
- ``socket``: the same bytes framed over a Unix socket pair, read by an asyncio stream on the
  front's loop (what a ZMQ or pipe hop costs a Python front);
- ``thread``: today's hand-off inside one process, from the event loop to a worker thread
  and back (``call_soon_threadsafe``), with no copy at all;
- ``node``: ``node/hop.py`` as a front uses it (``--front-doors``): ``FrontHop.call`` with a
  step's small msgpack header and the payload as one tensor, answered by a ``CoreHop`` on
  the event loop of another process (a task per request, the inputs copied out, a reply
  of one header and an 8-byte tensor written back); the core's CPU per round trip too.

Each round trip carries the payload to the worker, which reads one byte of it and answers
8 bytes. Figures: p50 and p99 of the round trip, and the front process' CPU per round trip
(``time.process_time`` of the front alone; the worker's own CPU is not the front's).
Linux only (``os.eventfd``).

Usage: python -m bench.hop [--rounds 5] [--trips 5000]
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import uvloop

from bench.common import median, options, pct, report
from node.hop import ACT, NOTE, CoreHop, FrontHop, Region

SIZES = {"1 KiB": 1024, "294 KiB": 294 * 1024}  # a state vector; a 224x224x3 camera frame, 294 KiB
HEADER = 8  # the slot's first bytes: the payload's length
GOALS = {("1 KiB", "p50_us"): 15.0, ("1 KiB", "p99_us"): 50.0, ("294 KiB", "p50_us"): 30.0}
"""Issue 43's goals for the hop alone (µs)."""


def _shm_worker(name: str, ask: int, answer: int) -> None:
    """The worker's side: wait on the doorbell, read the slot, answer in place."""
    shm = shared_memory.SharedMemory(name=name)
    view = shm.buf
    try:
        while True:
            os.eventfd_read(ask)
            n = struct.unpack_from("<I", view, 0)[0]
            if n == 0:
                return
            struct.pack_into("<I", view, 4, view[HEADER + n - 1])  # reads what was written
            os.eventfd_write(answer, 1)
    finally:
        del view
        shm.close()


def _socket_worker(sock: socket.socket) -> None:
    with sock:
        while True:
            head = sock.recv(4, socket.MSG_WAITALL)
            if len(head) < 4 or (n := struct.unpack("<I", head)[0]) == 0:
                return
            body = sock.recv(n, socket.MSG_WAITALL)
            sock.sendall(struct.pack("<II", n, body[-1]))


Trip = Callable[[bytes], Awaitable[None]]


async def _timed(
    trip: Trip, payload: bytes, trips: int, other: Callable[[], Awaitable[float]] | None = None
) -> dict[str, float]:
    """p50, p99 and the front's CPU of a round trip; with ``other`` (the other process'
    CPU seconds so far), that process' CPU per round trip too."""
    for _ in range(200):  # warm
        await trip(payload)
    lat = []
    other0 = await other() if other is not None else 0.0
    cpu0 = time.process_time()
    for _ in range(trips):
        t = time.perf_counter()
        await trip(payload)
        lat.append(time.perf_counter() - t)
    cpu = (time.process_time() - cpu0) / trips
    figures = {"p50_us": pct(lat, 50) * 1e6, "p99_us": pct(lat, 99) * 1e6, "cpu_us": cpu * 1e6}
    if other is not None:
        figures["other_cpu_us"] = (await other() - other0) / trips * 1e6
    return figures


class Shm:
    """A front's slot in shared memory with a doorbell each way, and its worker process."""

    def __init__(self, size: int) -> None:
        self.shm = shared_memory.SharedMemory(create=True, size=HEADER + size)
        self.ask, self.answer = os.eventfd(0), os.eventfd(0)
        self.pid = os.fork()
        if self.pid == 0:  # the worker
            try:
                _shm_worker(self.shm.name, self.ask, self.answer)
            finally:
                os._exit(0)
        self.waiting: asyncio.Future[None] | None = None
        asyncio.get_running_loop().add_reader(self.answer, self._rung)

    def _rung(self) -> None:
        os.eventfd_read(self.answer)
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(None)

    async def trip(self, payload: bytes) -> None:
        view = self.shm.buf
        view[HEADER : HEADER + len(payload)] = payload  # written once, where the worker reads
        struct.pack_into("<I", view, 0, len(payload))
        self.waiting = asyncio.get_running_loop().create_future()
        os.eventfd_write(self.ask, 1)
        await self.waiting

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.answer)
        struct.pack_into("<I", self.shm.buf, 0, 0)
        os.eventfd_write(self.ask, 1)
        os.waitpid(self.pid, 0)
        for fd in (self.ask, self.answer):
            os.close(fd)
        self.shm.close()
        self.shm.unlink()


class Socket:
    """A Unix socket pair, the worker in another process, the front on asyncio streams."""

    async def open(self) -> Socket:
        front, worker = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            front.close()
            try:
                _socket_worker(worker)
            finally:
                os._exit(0)
        worker.close()
        self.reader, self.writer = await asyncio.open_unix_connection(sock=front)
        return self

    async def trip(self, payload: bytes) -> None:
        self.writer.write(struct.pack("<I", len(payload)))
        self.writer.write(payload)
        await self.reader.readexactly(8)

    async def close(self) -> None:
        self.writer.write(struct.pack("<I", 0))
        await self.writer.drain()
        self.writer.close()
        os.waitpid(self.pid, 0)


class Thread:
    """Today's hand-off: the loop puts the step on a worker thread's queue, the thread
    answers with ``call_soon_threadsafe``."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.jobs: queue.SimpleQueue[tuple[bytes, asyncio.Future[int]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            payload, done = job
            self.loop.call_soon_threadsafe(done.set_result, payload[-1])

    async def trip(self, payload: bytes) -> None:
        done: asyncio.Future[int] = self.loop.create_future()
        self.jobs.put((payload, done))
        await done

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class NodeHop:
    """``node/hop.py``: this process' ``FrontHop``, a ``CoreHop`` in a process of its own
    (``python -m bench.hop core ...``), as a node's front and core."""

    def __init__(self, size: int) -> None:
        self.region = Region.create(32, size + 4096)  # as a node's front has (node/fronts.py)
        ask = os.eventfd(0, os.EFD_NONBLOCK)
        answer = os.eventfd(0, os.EFD_NONBLOCK)
        fds = (self.region.fd, ask, answer)
        self.core = subprocess.Popen(
            [sys.executable, "-m", "bench.hop", "core", *map(str, fds)], pass_fds=fds
        )
        self.front = FrontHop(self.region, ask, answer)
        self.meta = {"doc": {"episode_id": "robot-1", "seq": 1}, "in": [["n", "obs"]]}

    async def trip(self, payload: bytes) -> None:
        tensor = np.frombuffer(payload, dtype=np.uint8)
        await self.front.call(ACT, dict(self.meta), [tensor], lambda *_: None)

    async def core_cpu(self) -> float:
        """The core process' CPU seconds so far (``time.process_time`` there)."""
        cpu: float = await self.front.call(NOTE, {"cpu": True}, [], lambda _k, m, _v: m["cpu"])
        return cpu

    async def close(self) -> None:
        await self.front.call(NOTE, {"stop": True}, [], lambda *_: None)
        self.core.wait()
        asyncio.get_running_loop().remove_reader(self.front.answer)
        self.region.close()


async def _core(region_fd: int, ask: int, answer: int) -> None:
    """The core's end for :class:`NodeHop`: reads one byte of the payload, answers 8."""
    stop = asyncio.get_running_loop().create_future()

    async def handler(
        kind: int, meta: dict[str, Any], arrays: list[Any], slot: int
    ) -> tuple[dict[str, Any], list[Any]]:
        if meta.get("stop"):
            stop.set_result(None)
            return {}, []
        if meta.get("cpu"):
            return {"cpu": time.process_time()}, []
        return {"facts": {"seq": 1}, "names": ["actions"]}, [np.full(2, arrays[0][-1], np.int32)]

    async def undelivered(kept: Any) -> None:
        pass

    CoreHop(Region.open(region_fd), ask, answer, handler, undelivered, undelivered).start()
    await stop
    await asyncio.sleep(0.01)  # the answer to the stop leaves


async def _round(size: int, trips: int) -> dict[str, dict[str, float]]:
    payload = os.urandom(size)
    shm, sock, thread, node = Shm(size), await Socket().open(), Thread(), NodeHop(size)
    try:
        return {
            "shm": await _timed(shm.trip, payload, trips),
            "socket": await _timed(sock.trip, payload, trips),
            "thread": await _timed(thread.trip, payload, trips),
            "node": await _timed(node.trip, payload, trips, node.core_cpu),
        }
    finally:
        shm.close()
        await sock.close()
        thread.close()
        await node.close()


def main() -> None:
    if sys.argv[1:2] == ["core"]:  # NodeHop's other process
        uvloop.run(_core(*(int(fd) for fd in sys.argv[2:5])))
        return
    args = options(rounds=5, trips=5000)
    figures: list[dict[str, Any]] = []
    for label, size in SIZES.items():
        rounds = [uvloop.run(_round(size, args.trips)) for _ in range(args.rounds)]

        def med(hop: str, what: str, rounds: list[dict[str, dict[str, float]]] = rounds) -> float:
            return median([r[hop][what] for r in rounds])

        for what, name in (("p50_us", "p50"), ("p99_us", "p99"), ("cpu_us", "front CPU")):
            shm, sock, thread = med("shm", what), med("socket", what), med("thread", what)
            goal = GOALS.get((label, what))
            figures.append(
                {
                    "figure": f"{label}: {name} of a round trip, shm (socket, thread)",
                    "result": f"{shm:.1f} µs ({sock:.1f} µs: {shm / sock:.2f}x; "
                    f"{thread:.1f} µs: {shm / thread:.2f}x)",
                    "goal": f"≤ {goal:g} µs" if goal else "reported",
                    "ok": goal is None or shm <= goal,
                }
            )
            node = med("node", what)
            figures.append(
                {
                    "figure": f"{label}: {name} of a round trip, node/hop.py (front to core)",
                    "result": f"{node:.1f} µs ({node / shm:.2f}x the bare shm hop)",
                    "goal": f"≤ {goal:g} µs" if goal else "reported",
                    "ok": goal is None or node <= goal,
                }
            )
        figures.append(
            {
                "figure": f"{label}: core CPU of a round trip, node/hop.py",
                "result": f"{med('node', 'other_cpu_us'):.1f} µs",
                "goal": "reported",
                "ok": True,
            }
        )
    report("hop", figures, {"rounds": args.rounds, "trips": args.trips, "cores": os.cpu_count()})


if __name__ == "__main__":
    main()
