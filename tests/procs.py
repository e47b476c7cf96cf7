"""Real processes for integration tests: redis-server and affinity-node on loopback.

Every process is started in its own session and killed (with its group) at teardown,
even when the test fails.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from affinity.keys import Keys
from node.hop import ASKED, DELIVERING, FREE, TAKEN, TICKETS, Region

ROOT = Path(__file__).resolve().parent.parent


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now that this process has not handed out before: the kernel gives a
    closed port out again, so two asked in a row (a node's HTTP and gRPC ports) could be
    the same one."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port this process has not handed out already")


def _where(field: int, value: int) -> list[int]:
    """The processes whose /proc/<pid>/stat field ``field`` (counted after the command's
    name: 1 the parent, 2 the process group) is ``value`` now."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[field]) == value:
                found.append(int(entry))
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now (from /proc)."""
    return _where(1, pid)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tcp_inodes(port: int, state: str, *, remote: bool = False, unread: bool = False) -> set[str]:
    """The inodes of this host's TCP sockets in ``state`` on ``port`` (see :func:`tcp_sockets`)."""
    column = 2 if remote else 1
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[column].rsplit(":", 1)[1], 16) != port or fields[3] != state:
                    continue
                if unread and int(fields[4].split(":")[1], 16) == 0:  # tx_queue:rx_queue
                    continue
                inodes.add(fields[9])
    return inodes


def unread_at(port: int) -> int:
    """How many connections to this host's server on ``port`` hold bytes it has not read,
    whichever of its processes holds them, or none yet (still in the listener's queue):
    a request sent to a server that is paused."""
    return len(_tcp_inodes(port, "01", unread=True))


def tcp_sockets(
    pid: int, port: int, state: str, *, remote: bool = False, unread: bool = False
) -> int:
    """How many TCP sockets process ``pid`` holds in ``state`` (/proc/net/tcp's code:
    ``"01"`` established, ``"0A"`` listening) whose local port (the remote one with
    ``remote``: a client's connections to a server on ``port``) is ``port``; with
    ``unread``, only those with bytes received that the process has not read yet."""
    inodes = _tcp_inodes(port, state, remote=remote, unread=unread)
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            held += target.startswith("socket:[") and target[8:-1] in inodes
    return held


def connections(pid: int, port: int) -> int:
    """How many established TCP connections to ``port`` process ``pid`` holds (a server's)."""
    return tcp_sockets(pid, port, "01")


def queued(pid: int, port: int) -> int:
    """How many of :func:`connections` hold a request process ``pid`` has not read yet (it
    is paused, say)."""
    return tcp_sockets(pid, port, "01", unread=True)


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket on ``port``."""
    return tcp_sockets(pid, port, "0A") > 0


def _argv(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def _runs_module(pid: int, module: bytes) -> bool:
    """Whether process ``pid`` is ``python -m module``."""
    with contextlib.suppress(OSError):
        argv = _argv(pid)
        return module in argv and argv[argv.index(module) - 1] == b"-m"
    return False


def _spec_of(pid: int) -> dict[str, Any]:
    """Device worker process ``pid``'s spec (``AFFINITY_DEVICE_SPEC``, node/deviceprocs.py)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            if item.startswith(b"AFFINITY_DEVICE_SPEC="):
                spec: dict[str, Any] = json.loads(item.split(b"=", 1)[1])
                return spec
    raise ValueError(f"process {pid} has no AFFINITY_DEVICE_SPEC")


@contextlib.contextmanager
def region_of(pid: int) -> Iterator[Region]:
    """The hop region (``node/hop.py``) of front process ``pid`` (to the core), or of device
    worker process ``pid`` (from the core), opened through /proc."""
    if _runs_module(pid, b"node.deviceproc"):
        region_fd = int(_spec_of(pid)["region"])
    else:  # a front forked by its node's fork server holds one region: its hop's memfd
        region_fd = min(
            int(fd)
            for fd in os.listdir(f"/proc/{pid}/fd")
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:affinity-front")
        )
    region = Region.open(os.open(f"/proc/{pid}/fd/{region_fd}", os.O_RDWR))
    try:
        yield region
    finally:
        region.close()


def on_the_hop(front: int) -> list[int]:
    """The slots of front process ``front``'s hop to the core that are in use now (asked,
    taken or answered, not yet read back)."""
    return [k for k, state in enumerate(hop_states(front)) if state != FREE]


@contextlib.contextmanager
def held_mid_step(
    fronts: Callable[[], list[int]], port: int, core: int, timeout: float = 30
) -> Iterator[int]:
    """The front holding the one client connection to ``port``, once the core has taken
    that client's step off the front's hop (it runs), with the core paused (:func:`pause`):
    the step stays mid-run for the block, however quick the model or busy the machine (no
    guess at how long a step takes). The core goes on when the block ends."""
    found: list[int] = []

    def taken() -> bool:
        for pid in fronts():
            with contextlib.suppress(OSError, ValueError):
                if connections(pid, port) == 1 and TAKEN in hop_states(pid):
                    found[:] = [pid]
                    return True
        return False

    wait_until(taken, timeout, "a front whose client's step the core runs", interval=0.002)
    pause(core)
    try:
        assert TAKEN in hop_states(found[0]), "the core answered before it could be paused"
        yield found[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)


def handing_over(fronts: Callable[[], list[int]]) -> int | None:
    """The front whose hop holds a reply it is handing to its client (a slot DELIVERING:
    the write under way, or a ticket DELIVERING: bytes of it left in the front's buffer,
    its slot freed), if any."""
    for pid in fronts():
        with contextlib.suppress(OSError, ValueError):
            if DELIVERING in hop_states(pid) or DELIVERING in hop_tickets(pid):
                return pid
    return None


def hop_tickets(front: int) -> list[int]:
    """The states of the tickets of front process ``front``'s hop that are not FREE: the
    replies it is handing over off their slots (``node.hop.PARK``), or whose failed
    hand-over it is telling the core about."""
    with region_of(front) as region:
        return [s for s, _ in (region.ticket(t) for t in range(TICKETS)) if s != FREE]


def slow_link(host: str, port: int) -> socket.socket:
    """A client's socket on a link that carries nothing back: connected with a small
    receive buffer, and never read (a reply bigger than the kernel's buffers stays in part
    in its server's)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    sock.connect((host, port))
    return sock


def hop_states(front: int) -> list[int]:
    """The state of each slot of front process ``front``'s hop to the core."""
    with region_of(front) as region:
        return [region.state(k) for k in range(region.slots)]


def fronts_of(core: int) -> list[int]:
    """The live front processes started by the node process ``core``, and their fork
    server, wherever they are now (one outliving its core is reparented: each runs the
    server's command line, ``python -m node.forkserver CORE_PID FD``, which names its
    core)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            at = argv.index(b"node.forkserver") if b"node.forkserver" in argv else -1
            ours = (
                at > 0 and argv[at - 1] == b"-m" and argv[at + 1 : at + 2] == [str(core).encode()]
            )
            if ours and alive(int(entry)):
                found.append(int(entry))
    return found


def device_workers(core: int) -> dict[int, int]:
    """The live device worker processes of node process ``core`` (:func:`workers_of`), by
    the index of their device (read from the spec the core gave each)."""
    found = {}
    for pid in workers_of(core):
        with contextlib.suppress(OSError, ValueError):
            found[int(_spec_of(pid)["device"]["index"])] = pid
    return found


def workers_of(core: int) -> list[int]:
    """The live device worker processes (``python -m node.deviceproc``) started by the node
    process ``core``, wherever they are now: one outliving its core is reparented, and
    names its core in its spec (``AFFINITY_DEVICE_SPEC``'s ``parent``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _runs_module(int(entry), b"node.deviceproc"):
            with contextlib.suppress(OSError, ValueError):
                if _spec_of(int(entry))["parent"] == core and alive(int(entry)):
                    found.append(int(entry))
    return found


def asked_of(worker: int) -> list[int]:
    """The slots of device worker process ``worker``'s hop holding a run the core asked for
    and the worker has not answered yet."""
    with region_of(worker) as region:
        return [k for k in range(region.slots) if region.state(k) == ASKED]


def worker_mid_step(worker: int, timeout: float = 30) -> None:
    """Wait (bounded) until a run is asked of device worker process ``worker`` and not
    answered: a step is in it. The caller has paused it (SIGSTOP) first, so that a step that
    reaches it stays there, however quick the model: no guess at how long a run takes."""
    wait_until(lambda: asked_of(worker), timeout, f"a run in worker {worker}", interval=0.01)


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (or the process is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # that thread ended meanwhile
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def group_of(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    return _where(2, pgid)


def pause(*pids: int, timeout: float = 30) -> None:
    """SIGSTOP each of ``pids`` and wait (bounded) until every thread of each has stopped.
    The signal only starts a stop: one thread takes it and then tells the others, so a
    thread already woken (by a doorbell, say) can run on, and answer a step, until the
    kernel next runs that first thread; on a busy machine that is milliseconds. A test whose
    premise is "the process is frozen now" waits for it."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: all(stopped(p) for p in pids), timeout, f"{pids} stopped", interval=0.002)


def wait_until(check, timeout: float, what: str, interval: float = 0.05):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last})")


_REAPER = r"""
import os, signal, sys
groups = {}
for line in sys.stdin:  # "PID START": a process group its test process started
    pid, start = line.split()
    groups[int(pid)] = start
# the end of the pipe: the test process is gone, whether it exited or was killed
for pid, start in groups.items():
    try:
        with open(f"/proc/{pid}/stat") as f:
            now = f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        continue  # its leader is gone (stopped by its test): nothing of ours to kill
    if now == start:  # (the same process, not another that took its number since)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
"""
_reaper: subprocess.Popen[bytes] | None = None
_reaper_lock = threading.Lock()


def _reap_with_us(pid: int) -> None:
    """Have process group ``pid`` killed when this test process ends however it ends, a
    SIGKILL from outside included (a CI timeout, a tool's): a reaper process, started
    once, kills every group it was told of whose leader still runs once its pipe from this
    process closes. (``atexit`` and the fixtures stop them on an ordinary end; with
    SIGKILL nothing of this process runs, and nodes, their fronts and redis-servers were
    left running, eating the machine's cores.)"""
    global _reaper
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return  # (it ended already)
    with _reaper_lock:
        if _reaper is None or _reaper.poll() is not None:
            _reaper = subprocess.Popen([sys.executable, "-c", _REAPER], stdin=subprocess.PIPE,
                                       start_new_session=True)  # fmt: skip
        assert _reaper.stdin is not None
        with contextlib.suppress(OSError):
            _reaper.stdin.write(f"{pid} {start}\n".encode())
            _reaper.stdin.flush()


class Proc:
    def __init__(self, argv: list[str], env: dict[str, str] | None, log: Path) -> None:
        self.argv = argv
        self.env = env
        self.log_path = log
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        out = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        self.popen = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
        out.close()
        _reap_with_us(self.popen.pid)

    def send(self, sig: int) -> None:
        """``sig`` to the process and its children (its process group); a SIGSTOP returns
        once every one of them has stopped (:func:`pause`)."""
        assert self.popen is not None
        os.killpg(self.popen.pid, sig)
        if sig == signal.SIGSTOP:
            pgid = self.popen.pid
            wait_until(lambda: all(stopped(p) for p in group_of(pgid)), 30,
                       f"process group {pgid} stopped", interval=0.002)  # fmt: skip

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 10) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
            if sig == signal.SIGSTOP:
                return
            os.killpg(self.popen.pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


class RedisServer:
    """A throwaway redis-server without persistence on a free loopback port."""

    def __init__(
        self,
        tmp: Path,
        host: str = "127.0.0.1",
        extra: list[str] | None = None,
        netns: str | None = None,
    ):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (bash .ci/run installs it)", pytrace=False)
        self.host = host
        self.namespaces: tuple[str, ...] = ("affinity",)  # marked as new fleets by start()
        self.port = 6379 if netns else free_port(host)
        self.url = f"redis://{host}:{self.port}/0"
        self.proc = Proc(
            [
                *(["ip", "netns", "exec", netns] if netns else []),
                binary,
                "--port",
                str(self.port),
                "--bind",
                host,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp),
                "--protected-mode",
                "no",
                *(extra or []),
            ],
            None,
            tmp / f"redis-{self.port}.log",
        )

    def start(self, new_fleet: bool = True) -> RedisServer:
        """Start the server; ``new_fleet`` marks it as a new fleet's (no grace period for
        its first claims, see ``Registry.new_fleet``), which a restart does not."""
        self.proc.start()
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1)
        wait_until(client.ping, 10, f"redis-server on {self.port}")
        if new_fleet:
            for namespace in self.namespaces:
                client.set(Keys(namespace).fleet, "0", nx=True)
        client.close()
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, decode_responses=True, socket_timeout=2)

    def restart(self) -> None:
        """Kill and start again, empty: Redis lost its data (the grace period follows)."""
        self.proc.stop(signal.SIGKILL)
        self.start(new_fleet=False)

    def stop(self) -> None:
        self.proc.stop(signal.SIGKILL)


FLEET_SECRET = "tests-cluster-secret"
"""The cluster secret of :class:`Node` processes that name none."""

SHAPES: dict[str, list[str]] = {
    "one": [],
    "fronts2": ["--front-doors", "2"],
    "fronts2-workers": ["--front-doors", "2", "--device-workers", "process"],
}
"""The shapes of a node the process tests run in (issue 43): the id a test shows, and the
flags that make it: one process; a core and two front processes; and a core, two fronts
and a worker process per device (the sessions out of the core, ``node/deviceprocs.py``)."""
SHAPE: list[str] = []
"""The flags of :data:`SHAPES` that every :class:`Node` made from now on gets (but a flag
its ``extra`` names: it keeps its own). ``tests/conftest.py``'s ``node_shape`` fixture sets
it for the modules marked ``shapes``: each of their tests runs once per entry of
:data:`SHAPES`."""


def flag(argv: list[str], name: str, default: str) -> str:
    """The value ``argv`` gives flag ``name`` (its last), else ``default``."""
    at = len(argv) - 1 - argv[::-1].index(name) if name in argv else -1
    return argv[at + 1] if at >= 0 else default


def traits(flags: list[str]) -> set[str]:
    """What a node started with ``flags`` has that a test may be about: ``"fronts"`` (front
    processes: ``--front-doors`` above 1), ``"workers"`` (a worker process per device,
    ``--device-workers process``). A test marked ``shapes("fronts")`` runs in the shapes
    that have every trait it names."""
    has = set()
    if int(flag(flags, "--front-doors", "1")) > 1:
        has.add("fronts")
    if flag(flags, "--device-workers", "thread") == "process":
        has.add("workers")
    return has


class Node:
    """One ``affinity-node`` process."""

    def __init__(
        self,
        tmp: Path,
        node_id: str,
        redis_url: str,
        *,
        devices: str = "cpu:2",
        host: str = "127.0.0.1",
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        netns: str | None = None,
    ) -> None:
        self.node_id = node_id
        self.host = host
        extra = list(extra or [])
        for at in range(0, len(SHAPE), 2):
            if SHAPE[at] not in extra:
                extra += SHAPE[at : at + 2]
        self.front_doors = int(flag(extra, "--front-doors", "1"))
        self.device_workers = flag(extra, "--device-workers", "thread") == "process"
        """Whether each device's sessions run in a worker process of its own (:meth:`workers`)."""
        self.port = 8000 if netns else free_port(host)
        self.url = f"http://{host}:{self.port}"
        # a node on Redis refuses to start without a cluster secret (docs/security.md):
        # the tests' nodes share one unless a test gives its own
        full_env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "AFFINITY_CLUSTER_SECRET": FLEET_SECRET,
            **(env or {}),
        }
        self.proc = Proc(
            [
                *(["ip", "netns", "exec", netns] if netns else []),
                sys.executable,
                "-m",
                "node.server",
                "--redis",
                redis_url,
                "--node-id",
                node_id,
                "--host",
                host,
                "--port",
                str(self.port),
                "--advertise-url",
                self.url,
                "--devices",
                devices,
                *extra,
            ],
            full_env,
            tmp / f"node-{node_id}.log",
        )

    def start(self, timeout: float = 30) -> Node:
        self.proc.start()
        try:
            # a node with fronts, or device workers, starts more interpreters before it is ready
            more = (self.front_doors > 1) + self.device_workers
            wait_until(self.ready, timeout * (1 + more), f"node {self.node_id} ready")
        except AssertionError:
            raise AssertionError(f"node {self.node_id} did not start:\n{self.proc.log()}") from None
        return self

    def fronts(self) -> list[int]:
        """The pids of the node's front processes now (the children of its fork server,
        its process' child running ``node.forkserver``; none with ``--front-doors 1``)."""
        return [
            pid
            for server in self._children(b"node.forkserver")
            for pid in children(server)
            if alive(pid)
        ]

    def fork_server(self) -> int | None:
        """The pid of the node's fronts' fork server now (its process' child running
        ``node.forkserver``); None without one (``--front-doors 1``), or between two."""
        servers = self._children(b"node.forkserver")
        return servers[0] if servers else None

    def workers(self) -> list[int]:
        """The pids of the node's device worker processes now (its process' children running
        ``node.deviceproc``; none but with ``--device-workers process``). A node is ready
        only once each has opened its sessions (``node/startup.py``): no wait is needed."""
        return self._children(b"node.deviceproc")

    def _children(self, module: bytes) -> list[int]:
        if self.proc.popen is None or self.proc.popen.poll() is not None:
            return []
        return [
            pid for pid in children(self.proc.popen.pid) if alive(pid) and _runs_module(pid, module)
        ]

    def wait_fronts(self, timeout: float = 30) -> list[int]:
        """The node's fronts, once all ``front_doors`` of them run (none with one process)."""
        want = self.front_doors if self.front_doors > 1 else 0
        found: list[int] = []

        def all_up() -> bool:
            found[:] = self.fronts()
            return len(found) == want

        wait_until(all_up, timeout, f"{want} fronts of node {self.node_id}")
        return found

    def pid(self) -> int:
        """The node's process (the core, with fronts) of its latest start."""
        assert self.proc.popen is not None
        return self.proc.popen.pid

    def ready(self) -> bool:
        assert self.proc.popen is not None
        if self.proc.popen.poll() is not None:
            raise AssertionError(f"node {self.node_id} exited:\n{self.proc.log()}")
        return httpx.get(self.url + "/readyz", timeout=1).status_code == 200

    def stop(self, sig: int = signal.SIGKILL) -> None:
        self.proc.stop(sig)


_TMPDIRS: list[Path] = []


def tmpdir() -> Path:
    """A new ``affinity-test-*`` folder in the temporary directory, removed with the others
    when the test session ends (:func:`remove_tmpdirs`)."""
    path = Path(tempfile.mkdtemp(prefix="affinity-test-"))
    _TMPDIRS.append(path)
    return path


def remove_tmpdirs() -> None:
    """Remove every folder :func:`tmpdir` made (tests/conftest.py calls it when the session
    finishes, passed or failed; and at exit). Issue 42 item 9: a run left them all."""
    while _TMPDIRS:
        shutil.rmtree(_TMPDIRS.pop(), ignore_errors=True)


atexit.register(remove_tmpdirs)  # before any server's stop is registered: runs after it


class Forwarder:
    """A loopback TCP forwarder in the test process: clients connect to ``port`` and reach
    whatever ``target`` port it points at now. :meth:`point` re-points it and cuts every
    open connection, as a failover does to the clients of the old primary (they reconnect
    and reach the new one). ``delay_s`` (settable at any time) holds every chunk that long
    in each direction, in order: a slow link (a round trip takes twice that longer)."""

    def __init__(self, target: int, host: str = "127.0.0.1", delay_s: float = 0.0) -> None:
        self.host = host
        self.target = target
        self.delay_s = delay_s
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._listener = socket.create_server((host, 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="forwarder", daemon=True).start()

    def point(self, target: int) -> None:
        with self._lock:
            self.target = target
            cut, self._open = self._open, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.point(self.target)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((self.host, self.target), timeout=2)
            except OSError:
                client.close()  # nothing listens there (the old primary is dead)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        held: queue.Queue[tuple[float, bytes]] = queue.Queue()
        threading.Thread(target=self._send, args=(held, dst), daemon=True).start()
        try:
            while data := src.recv(65536):
                held.put((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        held.put((0.0, b""))  # then close both, once what is held went out

    @staticmethod
    def _send(held: queue.Queue[tuple[float, bytes]], dst: socket.socket) -> None:
        try:
            while True:
                due, data = held.get()
                if not data:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)


def deaf(pid: int) -> bool:
    """Whether ``pid`` blocks SIGINT and SIGTERM (its ``SigBlk`` in /proc): a front or a
    device worker, born so (``node.hop.deaf_children``)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("SigBlk:"))
    mask = int(line.split()[1], 16)
    return all(mask & (1 << (s - 1)) for s in (signal.SIGINT, signal.SIGTERM))


def metrics(node: Node) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of ``node``'s ``/metrics``, by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(node.url + "/metrics", timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
