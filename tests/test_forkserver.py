"""The fork server of a node's fronts (``node/forkserver.py``, issue 43), with real processes
and no node: it forks a real front per request (a child of its own, sharing the pages it
imported), the core signals it and sees its end and exit code through the server; a front
ends with its server, a server that died is started again at the next spawn, and the
server and its fronts end with their core (``kill -9``), leaving no process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from node.forkserver import Forked, ForkServer, Starting
from node.front import LAG_BOUNDS
from node.fronts import SECRETS, Fronts
from node.hop import Region, SharedLoopBuckets
from tests.procs import alive, wait_until

ROOT = Path(__file__).resolve().parent.parent
SPEC = {
    "api_key": None, "max_body_bytes": 4096, "max_rows": 8, "keep_alive_s": 5.0,
    "close_s": 1.0, "slot_wait_s": 1.0, "access_log": "off", "log_format": "text",
    "log_level": "warning",
}  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "AFFINITY_FRONT_SPEC": json.dumps(SPEC)}


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def smaps(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup``'s kB figures."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


@contextmanager
def front_fds() -> Iterator[tuple[Region, tuple[int, ...]]]:
    """What the core passes a front: a listening socket, a region, two doorbells."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    region = Region.create(4, 4096 + (1 << 16))
    ask = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    answer = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        yield region, (listener.fileno(), region.fd, ask, answer)
    finally:
        listener.close()
        region.close()
        os.close(ask)
        os.close(answer)


async def wait_for(check: Callable[[], object], what: str, timeout: float = 60) -> None:
    """Until ``check()`` holds, the loop running meanwhile (it reads the server's word)."""
    for _ in range(int(timeout / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def ended(front: Forked) -> int:
    await wait_for(lambda: front.poll() is not None, f"front {front.pid} to end")
    assert front.returncode is not None
    return front.returncode


@pytest.mark.anyio
async def test_fronts_are_forked_signalled_and_reaped_through_their_server() -> None:
    server = ForkServer(_env())
    server.start()
    try:
        assert server.process is not None
        assert await server.wait_ready(120), "the fork server did not say it was ready"
        first = server.process.pid
        with front_fds() as (region, fds):
            lag = SharedLoopBuckets(region.mm, LAG_BOUNDS)

            def serving() -> bool:  # its event loop samples its lag into the region
                return lag.samples() > 0

            front = await server.spawn(0, b"\0core".hex(), fds)
            assert parent_of(front.pid) == first  # the server's child, not ours
            await wait_for(serving, "the forked front's event loop running")
            # its imports are the server's pages, shared: little of it is its own
            mem = smaps(front.pid)
            private = mem["Private_Dirty"] + mem["Private_Clean"]
            assert private < mem["Rss"] / 2, mem
            front.send_signal(signal.SIGUSR1)  # a graceful stop: it exits 0
            assert await ended(front) == 0 and front.poll() == 0
            assert front.pid not in server.forked

            killed = await server.spawn(1, b"\0core".hex(), fds)
            killed.kill()
            assert await ended(killed) == -signal.SIGKILL  # the code the server reaped
            killed.kill()  # (once ended, nothing is signalled: its pid may be another's)

            orphan = await server.spawn(2, b"\0core".hex(), fds)
            server.process.kill()  # the server dies: its front ends with it
            assert await ended(orphan) == -signal.SIGKILL
            await wait_for(lambda: not alive(orphan.pid), "the front gone with its server")

            with pytest.raises(Starting):  # started again, not waited for here
                await server.spawn(3, b"\0core".hex(), fds)
            assert server.process.pid != first and server.restarts == 1
            assert await server.wait_ready(120)
            again = await server.spawn(3, b"\0core".hex(), fds)
            assert parent_of(again.pid) == server.process.pid
            again.kill()
            assert await asyncio.to_thread(again.wait, 60) == -signal.SIGKILL  # from a thread
    finally:
        server.close()
        await asyncio.to_thread(server.reap)
    assert server.process is None and not server.forked


def test_the_server_and_its_fronts_end_with_their_core() -> None:
    """``kill -9`` of the process that started the server (the core) leaves neither."""
    code = textwrap.dedent(
        """
        import json, os, socket, sys, time
        import asyncio
        from node.forkserver import ForkServer
        from node.hop import Region
        async def main():
            server = ForkServer(dict(os.environ))
            server.start()
            assert await server.wait_ready(120)
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(16)
            region = Region.create(4, 4096 + (1 << 16))
            fds = (listener.fileno(), region.fd, os.eventfd(0), os.eventfd(0))
            front = await server.spawn(0, b"core".hex(), fds)
            print(json.dumps([server.process.pid, front.pid]), flush=True)
            time.sleep(600)
        asyncio.run(main())
        """
    )
    core = subprocess.Popen([sys.executable, "-c", code], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert core.stdout is not None
        server, front = json.loads(core.stdout.readline())
        assert parent_of(front) == server and parent_of(server) == core.pid
        core.kill()
        core.wait(30)
        wait_until(lambda: not alive(server) and not alive(front), 30, "no process left")
    finally:
        if core.poll() is None:
            core.kill()
            core.wait()
        if core.stdout is not None:
            core.stdout.close()


def test_the_fronts_server_is_started_without_the_node_s_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing of the cluster secret, the admin token or the API key's variable reaches the
    server's environment (the API key a front checks is in its spec), and numpy's BLAS
    starts no thread pool there (a fork copies no lock another thread held)."""
    for name in SECRETS:
        monkeypatch.setenv(name, "s3cret")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    service = type("S", (), {})()
    from node.metrics import Metrics

    service.metrics = Metrics(["a/0"], 8)  # type: ignore[attr-defined]
    service.config = type("C", (), {"front_hang_s": 30.0})()  # type: ignore[attr-defined]
    listener = socket.socket()
    try:
        fronts = Fronts(service, [listener], "core", {"max_body_bytes": 4096, "api_key": "k"})  # type: ignore[arg-type]
    finally:
        listener.close()
    env = fronts.forks.env
    assert not SECRETS & set(env) and "s3cret" not in env.values()
    assert json.loads(env["AFFINITY_FRONT_SPEC"])["api_key"] == "k"
    assert env["OPENBLAS_NUM_THREADS"] == "1"
