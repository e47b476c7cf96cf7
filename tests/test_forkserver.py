"""The fork server of a node's fronts (``node/forkserver.py``, issue 43), with real processes
and no node: it forks a real front per request (a child of its own, sharing the pages it
imported), the core signals it and sees its end and exit code through the server; a front
ends with its server, a server that died is started again at the next spawn, and the
server and its fronts end with their core (``kill -9``), leaving no process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from node import forkserver
from node.errors import ForkServerStarting
from node.forkserver import Forked, ForkServer
from node.front import LAG_BOUNDS
from node.fronts import SECRETS, fork_server
from node.hop import Region, SharedLoopBuckets
from tests.procs import alive, children, wait_until

ROOT = Path(__file__).resolve().parent.parent
SPEC = {
    "api_key": None, "max_body_bytes": 4096, "max_rows": 8, "keep_alive_s": 5.0,
    "close_s": 1.0, "slot_wait_s": 1.0, "access_log": "off", "log_format": "text",
    "log_level": "warning",
}  # fmt: skip


CORE = textwrap.dedent(
    """
    import asyncio, json, os, socket, time
    from node.forkserver import ForkServer
    SPEC = json.loads(os.environ["SPEC"])
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
    """
)
"""A core's script up to its fork server ready and a front's descriptors made (``fds``):
the rest of ``main`` is appended (its lines indented by four), then ``asyncio.run(main())``."""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "SPEC": json.dumps(SPEC)}


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

            front = await server.spawn(0, b"\0core".hex(), fds, SPEC)
            assert parent_of(front.pid) == first  # the server's child, not ours
            await wait_for(serving, "the forked front's event loop running")
            # its imports are the server's pages, shared: little of it is its own
            mem = smaps(front.pid)
            private = mem["Private_Dirty"] + mem["Private_Clean"]
            assert private < mem["Rss"] / 2, mem
            front.send_signal(signal.SIGUSR1)  # a graceful stop: it exits 0
            assert await ended(front) == 0 and front.poll() == 0
            assert front.pid not in server.forked

            killed = await server.spawn(1, b"\0core".hex(), fds, SPEC)
            killed.kill()
            assert await ended(killed) == -signal.SIGKILL  # the code the server reaped
            killed.kill()  # (once ended, nothing is signalled: its pid may be another's)

            orphan = await server.spawn(2, b"\0core".hex(), fds, SPEC)
            unpolled = await server.spawn(3, b"\0core".hex(), fds, SPEC)
            server.process.kill()  # the server dies: its fronts end with it
            assert await ended(orphan) == -signal.SIGKILL
            await wait_for(lambda: not alive(orphan.pid), "the front gone with its server")
            await wait_for(lambda: not alive(unpolled.pid), "the other gone with its server")

            with pytest.raises(ForkServerStarting):  # started again, not waited for here
                await server.spawn(3, b"\0core".hex(), fds, SPEC)
            assert server.process.pid != first and server.restarts == 1
            # a front of the dead server, first looked at once a new one runs, has ended
            assert await ended(unpolled) == -signal.SIGKILL
            assert await server.wait_ready(120)
            again = await server.spawn(3, b"\0core".hex(), fds, SPEC)
            assert parent_of(again.pid) == server.process.pid
            again.kill()
            assert await asyncio.to_thread(again.wait, 60) == -signal.SIGKILL  # from a thread
    finally:
        server.close()
        await asyncio.to_thread(server.reap)
    assert server.process is None and not server.forked
    with front_fds() as (_, fds), pytest.raises(OSError) as refused:
        await server.spawn(9, b"\0core".hex(), fds, SPEC)
    assert not isinstance(refused.value, ForkServerStarting)  # closed: never started again
    assert server.process is None and server.sock is None


@pytest.mark.anyio
async def test_a_server_stuck_in_its_imports_or_whose_pidfd_cannot_be_received_is_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server not ready within ``READY_S`` of its start is killed (and started again by
    the next ask), never waited on forever; a front whose pidfd the core could not receive
    (no descriptor left) is never left running unwatched: its server is killed, and it
    with it."""
    monkeypatch.setattr(forkserver, "READY_S", 0.5)
    server = ForkServer(_env())
    server.start()
    padding: list[int] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        assert server.process is not None
        stuck = server.process.pid
        os.kill(stuck, signal.SIGSTOP)  # (in its imports, as far as the core can tell)
        with front_fds() as (_, fds):
            with pytest.raises(ForkServerStarting):
                await server.spawn(0, b"\0core".hex(), fds, SPEC)
            await asyncio.sleep(0.6)
            with pytest.raises(OSError, match="not ready"):
                await server.spawn(0, b"\0core".hex(), fds, SPEC)
            await wait_for(lambda: not alive(stuck), "the stuck server killed")
            with pytest.raises(ForkServerStarting):  # started again
                await server.spawn(0, b"\0core".hex(), fds, SPEC)
            monkeypatch.setattr(forkserver, "READY_S", 120.0)
            assert await server.wait_ready(120)
            second = server.process.pid

            top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
            with contextlib.suppress(OSError):  # every number below the limit taken
                for _ in range(top + 1):
                    padding.append(os.open("/dev/null", os.O_RDONLY))
            with pytest.raises(OSError, match="no descriptor left"):
                await server.spawn(1, b"\0core".hex(), fds, SPEC)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            await wait_for(lambda: not alive(second), "the server of the unwatched front killed")
            await wait_for(lambda: not live_children(second), "its front gone with it")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in padding:
            os.close(fd)
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.close()
        await asyncio.to_thread(server.reap)


def test_the_server_and_its_fronts_end_with_their_core() -> None:
    """``kill -9`` of the process that started the server (the core) leaves neither."""
    code = CORE + textwrap.dedent(
        """
            front = await server.spawn(0, b"core".hex(), fds, SPEC)
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
    server's environment (the API key a front checks is in its settings, sent with each
    ask), and numpy's BLAS starts no thread pool there whatever the environment says (a
    fork copies no lock another thread held)."""
    for name in SECRETS:
        monkeypatch.setenv(name, "s3cret")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "8")
    env = fork_server(grpc=False).env
    assert not SECRETS & set(env) and "s3cret" not in env.values()
    assert env["OPENBLAS_NUM_THREADS"] == "1"


@pytest.mark.anyio
async def test_what_the_server_says_is_read_whatever_the_loop_and_the_descriptors() -> None:
    """A front that ends at once, its answer and its exit read together (the core's loop
    busy meanwhile), is seen to end with its code; a front's pidfd numbered past 1023 is
    watched all the same; a front whose end its server does not say (paused) is taken
    as ended after ``UNSAID_S`` (code -1); each process holds what it should and nothing
    more (the server no front's descriptors, a front no pidfd nor the server's socket);
    and an ask given up (cancelled) has its late front killed, never served through."""
    loop = asyncio.get_running_loop()
    server = ForkServer(_env())
    server.start()
    padding: list[int] = []
    try:
        assert server.process is not None and await server.wait_ready(120)
        with front_fds() as (region, fds):
            bad = (fds[0], fds[2], fds[2], fds[3])  # an eventfd for a region: it exits 1
            loop.call_soon(time.sleep, 1.0)  # (the loop blocked once the ask is sent)
            crashed = await server.spawn(0, b"\0core".hex(), bad, SPEC)
            assert await ended(crashed) == 1

            alive_fronts = [await server.spawn(k, b"\0core".hex(), fds, SPEC) for k in (1, 2)]
            lag = SharedLoopBuckets(region.mm, LAG_BOUNDS)
            await wait_for(lambda: lag.samples() > 0, "a front's event loop running")
            held = fd_links(server.process.pid)
            assert not [t for t in held if t.startswith("/memfd:") or "eventfd" in t], held
            assert held.count("anon_inode:[pidfd]") == 2, held  # its two fronts alive
            for front in alive_fronts:
                links = fd_links(front.pid)
                assert "anon_inode:[pidfd]" not in links, links  # no brother's
                assert sum(t.startswith("/memfd:") for t in links) <= 2, links  # its region
                assert set(links).isdisjoint(fd_links_of_kind(server.process.pid, "socket")), (
                    "a front holds the server's socket"
                )

            while not padding or padding[-1] < 1100:  # the next pidfds past 1023
                padding.append(os.open("/dev/null", os.O_RDONLY))
            high = await server.spawn(3, b"\0core".hex(), fds, SPEC)
            assert high.pidfd > 1023

            os.kill(server.process.pid, signal.SIGSTOP)  # paused: it reaps and says nothing
            try:
                alive_fronts[0].kill()
                assert await ended(alive_fronts[0]) == -1  # seen on its pidfd alone
                asking = asyncio.create_task(server.spawn(4, b"\0core".hex(), fds, SPEC))
                await asyncio.sleep(0.2)  # (asked: the paused server forks nothing yet)
                asking.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asking
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            given_up = await server.spawn(5, b"\0core".hex(), fds, SPEC)  # its own answer
            others = {f.pid for f in (*alive_fronts, high, given_up)}
            await wait_for(lambda: set(live_children(server.process.pid)) <= others,
                           "the front of the ask given up killed")  # fmt: skip
            server.process.kill()  # a front whose pidfd is past 1023 ends with its server
            assert await ended(high) == -signal.SIGKILL
    finally:
        for fd in padding:
            os.close(fd)
        server.close()
        await asyncio.to_thread(server.reap)


def test_a_front_names_its_server_as_known_before_the_fork() -> None:
    """The front's parent pid is the server's as the server knew it before forking, never
    ``getppid()`` in the child: a server dead by then makes that another process (init),
    and the front would live on past it."""
    code = textwrap.dedent(
        """
        import socket, sys
        from node import forkserver, front
        front.main = lambda argv: print(" ".join(argv), flush=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        forkserver._front({"index": 7, "core": "00", "spec": {}}, [3, 4, 5, 6], theirs, [], 424242)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["7", "3", "4", "5", "6", "424242", "00"]


def fd_links(pid: int) -> list[str]:
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return links


def fd_links_of_kind(pid: int, kind: str) -> set[str]:
    return {t for t in fd_links(pid) if t.startswith(kind)}


def live_children(pid: int) -> list[int]:
    return [c for c in children(pid) if alive(c)]


def test_a_core_that_is_pid_1_reaps_the_fronts_that_died_with_their_server() -> None:
    """In a container without an init the core is PID 1: the fronts that die with their
    server are reparented to it, and were left as zombies (the server reaped them before).
    The core reaps those it knows (their pids, held as zombies until then), nothing else.
    Run as PID 1 of a new PID namespace (``unshare``: root)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to run a process as PID 1 of a new namespace")
    code = CORE + textwrap.dedent(
        """
            assert os.getpid() == 1
            fronts = [await server.spawn(k, b"core".hex(), fds, SPEC) for k in range(3)]
            server.process.kill()
            for _ in range(6000):
                if all(f.poll() is not None for f in fronts):
                    break
                await asyncio.sleep(0.01)
            print("codes", *[f.returncode for f in fronts], flush=True)
            zombies = []
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    with open(f"/proc/{entry}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            zombies.append(int(entry))
            print("zombies", *zombies, flush=True)
        asyncio.run(main())
        """
    )
    done = subprocess.run([unshare, "--fork", "--pid", "--mount-proc", sys.executable, "-c",
                           code], env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    if (
        done.returncode != 0
        and "unshare" in done.stderr
        and "Operation not permitted" in done.stderr
    ):
        pytest.skip(f"no new PID namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    lines = dict(
        line.split(" ", 1) if " " in line else (line, "") for line in done.stdout.splitlines()
    )
    assert lines["codes"].split() == ["-9", "-9", "-9"], done.stdout
    assert lines["zombies"] == "", done.stdout
