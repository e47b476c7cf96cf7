"""The fork server of a node's front doors (``--front-doors N`` > 1, issue 43): one process,
child of the core, that imports what a front runs once and forks every front the core asks
for (:class:`ForkServer` is the core's side; :func:`main` the process).

Why: a front started as ``python -m node.front`` imported numpy, uvicorn, httpx (and
grpcio) for itself, 43-45 MiB of PSS a front, so two fronts cost 2.2x a node of one
process in memory. Forked, a front shares those pages with the server and with every
other front (copy-on-write; ``gc.freeze`` before the first fork keeps the collector from
writing to them), and a front that died is back in milliseconds, not after its imports.

The process tree: core -> fork server -> fronts. The server dies with the core
(``PR_SET_PDEATHSIG``), a front with the server, so ``kill -9`` of the core leaves no
process. The server starts single-threaded (``OPENBLAS_NUM_THREADS=1``: numpy's BLAS starts
no pool), so a fork copies no lock another thread held. It is born, like the fronts, with
SIGINT and SIGTERM blocked (``hop.deaf_children``) and without the node's secrets in its
environment; each ask carries the front's settings (its ``AFFINITY_FRONT_SPEC``), so the
core starts the server before its own start (models, registration), and its imports run
meanwhile.

The wire (one ``SOCK_SEQPACKET`` socket pair: a message each, descriptors beside it):
the server says ``{"ready": pid}`` once imported; the core asks ``{"n": ask, "index": k,
"core": hex, "spec": settings}`` with the front's four descriptors (listener, region, ask and answer
doorbells); the server answers ``{"n": ask, "pid": p}`` with the front's pidfd (or
``{"n": ask, "error": text}``: no fork), and says ``{"exit": p, "code": c}`` when it has
reaped a front. The core signals a front through its pidfd (never a pid another process
may have taken) and sees its end there.

Run by the core as ``python -m node.forkserver CORE_PID SOCKET_FD [grpc]`` (``grpc``: the
fronts serve gRPC, and grpcio is loaded for them).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import gc
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from node.errors import ForkServerStarting
from node.hop import deaf_children, die_with_parent

__all__ = ["ForkServer", "Forked"]

log = logging.getLogger("affinity.node")

READY_S = 60.0
"""How long a (re)started server may take to import before it is taken as stuck and
killed (its first start: ``Fronts.start`` fails the node's start after as long)."""
SPAWN_S = 10.0
"""How long the core waits for a front's pid from a ready server (a fork: milliseconds);
past it the server is taken as hung, killed, and started again."""
MAX_FDS = 8
"""The most descriptors a message carries (a front takes four)."""
UNSAID_S = 1.0
"""How long a front whose pidfd shows its end may wait for its server's word on its exit
code (the server paused, hung) before it is taken as ended all the same (code -1)."""


def _send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors beside it; None at the other end's close."""
    fds = array.array("i")
    space = socket.CMSG_SPACE(MAX_FDS * fds.itemsize)
    data, ancdata, flags, _ = sock.recvmsg(1 << 16, space, socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    message: dict[str, Any] = json.loads(data)
    if flags & socket.MSG_CTRUNC:  # (no descriptor left here: the kernel dropped some)
        message["truncated"] = True
    return message, list(fds)


class Forked:
    """A front forked by the server: what the supervisor needs of a ``subprocess.Popen``
    (``pid``, ``returncode``, :meth:`poll`, :meth:`wait`, :meth:`kill`,
    :meth:`send_signal`). It is the server's child, not the core's: its end is seen on
    its pidfd, its exit code comes from the server, which reaps it."""

    def __init__(self, origin: subprocess.Popen[bytes], pid: int, pidfd: int) -> None:
        self.origin = origin  # the server that forked it (a later one knows nothing of it)
        self.pid = pid
        self.pidfd = pidfd
        self.returncode: int | None = None
        self._gone: float | None = None  # when its pidfd first said it ended, unreported
        self._lock = threading.Lock()  # (ended from the loop, or from a thread's wait)

    def poll(self) -> int | None:
        """Its exit code once the server said it (the core's loop reads what it says),
        else None. A front that ended with its server (``PR_SET_PDEATHSIG``: nobody left
        to reap it and say how) is -9; one whose end its pidfd has shown for
        :data:`UNSAID_S` while its server said nothing (paused, hung) is -1: ended, its
        code unknown."""
        if self.returncode is not None:
            return self.returncode
        if not self._ended():
            return None
        if self.origin.poll() is not None:
            self._end(-signal.SIGKILL)
            if os.getpid() == 1:  # (a container without an init: the orphan is ours, a
                # zombie until reaped; as init's child its pid stays its own until then)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, os.WNOHANG)
        elif self._gone is None:
            self._gone = time.monotonic()
        elif time.monotonic() - self._gone > UNSAID_S:
            self._end(-1)
        return self.returncode

    def _ended(self) -> bool:
        """Whether the process has ended (its pidfd readable; ``poll``, any descriptor
        number)."""
        with self._lock:
            if self.returncode is not None:
                return True
            watch = select.poll()
            watch.register(self.pidfd, select.POLLIN)
            return bool(watch.poll(0))

    def _end(self, code: int) -> None:
        with self._lock:
            if self.returncode is None:
                self.returncode = code
                os.close(self.pidfd)

    def wait(self, timeout: float | None = None) -> int:
        """Block until it ended and its code is known (``subprocess.TimeoutExpired``
        past ``timeout``); from a thread: the core's loop reads the server's word."""
        until = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if until is not None and time.monotonic() >= until:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:  # (once ended its pidfd is closed, its number maybe another's)
            if self.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self.pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The core's side of the fork server, on the core's event loop: starts it
    (:meth:`start`), asks it for fronts (:meth:`spawn`, one at a time), reads what it says
    as it comes (readiness, fronts forked and reaped), stops it (:meth:`close`). A server
    that died is started again by the next :meth:`spawn`, which raises
    :class:`~node.errors.ForkServerStarting` meanwhile."""

    def __init__(self, env: dict[str, str], grpc: bool = False) -> None:
        self.env = {**env, "OPENBLAS_NUM_THREADS": "1"}  # (a front does no linear algebra)
        self.grpc = grpc  # fronts serve gRPC: the server loads grpcio for them
        self.closed = False  # by :meth:`close`: never started again
        self.started = 0.0  # when the server was last started (monotonic)
        self.since_ms = 0  # and on the wall clock, ms since the epoch (published)
        self.process: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.ready: asyncio.Future[None] | None = None
        self.forked: dict[int, Forked] = {}  # pid -> its front, until the server reaps it
        self.restarts = 0
        self._asked = 0  # the number of the last ask (each answer names its ask's)
        self._answer: asyncio.Future[Forked] | None = None
        self._asking = asyncio.Lock()  # one spawn at a time

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the server (its imports are awaited with :meth:`wait_ready`)."""
        if self.closed:
            raise OSError("the front fork server was closed")
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [sys.executable, "-m", "node.forkserver", str(os.getpid()), str(theirs.fileno())]
            argv += ["grpc"] if self.grpc else []
            with deaf_children():  # SIGINT and SIGTERM are the core's (node/hop.py)
                self.process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=self.env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock, self.ready = ours, loop.create_future()
        self.started, self.since_ms = time.monotonic(), int(time.time() * 1000)
        loop.add_reader(ours.fileno(), self._read)
        log.info("front fork server started (pid %d)", self.process.pid)

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the server said it is ready (its imports done) within ``timeout``."""
        if self.ready is None:
            return False
        with contextlib.suppress(TimeoutError, OSError):
            await asyncio.wait_for(asyncio.shield(self.ready), timeout)
        return self.ready.done() and self.ready.exception() is None

    def _read(self) -> None:
        """What the server said, read as it comes (the loop's reader). A front is taken in
        as its answer is read, before anything the server said after it (its exit)."""
        while self.sock is not None:
            try:
                message, fds = _recv(self.sock)
            except BlockingIOError:
                return
            except OSError:
                message, fds = None, []
            if message is None:  # the server is gone: the fronts it forked end with it
                self._lost()
                return
            if "ready" in message:
                if self.ready is not None and not self.ready.done():
                    self.ready.set_result(None)
            elif "exit" in message:
                front = self.forked.pop(int(message["exit"]), None)
                if front is not None:
                    front._end(int(message["code"]))
            elif "pid" in message and (not fds or message.get("truncated")):
                # (its pidfd dropped: no descriptor left here) a front nobody could watch:
                # the server is killed, and that front with it; started again next time
                if self.process is not None:
                    self.process.kill()
                if self._answer is not None and not self._answer.done():
                    self._answer.set_exception(OSError("no descriptor left for a front's pidfd"))
                    self._answer.exception()
            elif "pid" in message and self.process is not None:
                front = Forked(self.process, int(message["pid"]), fds.pop(0))
                self.forked[front.pid] = front
                waiting = self._answer
                if message.get("n") == self._asked and waiting is not None and not waiting.done():
                    waiting.set_result(front)
                else:  # the answer to an ask given up (cancelled): nobody serves through it
                    front.kill()
            elif (
                self._answer is not None
                and not self._answer.done()
                and message.get("n") == self._asked
            ):  # it could not fork
                self._answer.set_exception(OSError(str(message.get("error", message))))
                self._answer.exception()  # (retrieved: its waiter may be gone)
            for fd in fds:  # (nothing else comes with descriptors)
                os.close(fd)

    def _lost(self) -> None:
        """The server's end is closed (it died, or :meth:`close`): a spawn waiting fails."""
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        for waiting in (self.ready, self._answer):
            if waiting is not None and not waiting.done():
                waiting.set_exception(OSError("the front fork server is gone"))
                waiting.exception()  # (retrieved: nobody may be waiting on it)

    async def spawn(
        self, index: int, core_hex: str, fds: tuple[int, ...], spec: dict[str, Any]
    ) -> Forked:
        """Fork front ``index`` with ``fds`` (listener, region, ask, answer; they stay
        open here: the caller closes its own) and its settings ``spec``. Raises
        :class:`~node.errors.ForkServerStarting` while the server starts (a dead one is
        started again), ``OSError`` when it could not fork, did not answer in
        :data:`SPAWN_S` or was not ready in :data:`READY_S` (then it is killed: hung), or
        was closed."""
        async with self._asking:
            if self.closed:
                raise OSError("the front fork server was closed")
            if not self.alive() or self.sock is None:
                if self.process is not None:
                    self.restarts += 1
                    if self.process.poll() is None:  # (its end of the pair closed, or lost)
                        self.process.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.process.wait(5)
                    log.warning("front fork server (pid %d) exited with %s; starting it again",
                                self.process.pid, self.process.returncode)  # fmt: skip
                    self.process = None
                self._lost()
                for front in list(self.forked.values()):  # (each sees its own end too,
                    if front._ended():  # Forked.poll; one already gone is let go here)
                        front._end(-signal.SIGKILL)
                self.forked.clear()
                self.start()
                raise ForkServerStarting("the front fork server is starting")
            assert self.ready is not None and self.process is not None
            if not self.ready.done():
                if time.monotonic() - self.started > READY_S:
                    self.process.kill()  # stuck in its imports: started again next time
                    log.error("front fork server (pid %d) was not ready in %.0f s; killed",
                              self.process.pid, READY_S)  # fmt: skip
                    raise OSError(f"the front fork server was not ready in {READY_S:.0f} s")
                raise ForkServerStarting("the front fork server is starting")
            self._asked += 1
            self._answer = answer = asyncio.get_running_loop().create_future()
            try:
                ask = {"n": self._asked, "index": index, "core": core_hex, "spec": spec}
                _send(self.sock, ask, fds)
                return await asyncio.wait_for(answer, SPAWN_S)
            except TimeoutError:
                self.process.kill()  # hung: its fronts end with it; started again next time
                raise OSError(f"the front fork server did not answer in {SPAWN_S:.0f} s") from None
            finally:
                self._answer = None

    def close(self) -> None:
        """Stop the server, from the loop (its fronts, if any still ran, end with it):
        its end closed, it exits; :meth:`reap` waits for it. It is never started again."""
        self.closed = True
        self._lost()
        for front in list(self.forked.values()):
            front.kill()

    def reap(self, timeout: float = 5.0) -> None:
        """Wait for the closed server to exit (SIGKILL past ``timeout``), from a thread."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for front in list(self.forked.values()):
            front._end(-signal.SIGKILL)
        self.forked.clear()


def _preload(grpc: bool = False) -> None:
    """Import what a front runs, so that each fork finds it loaded: its modules, and what
    its start loads lazily (httpx's transport: httpcore, h11, certifi, trio where it is
    installed; uvicorn's lifespan; ``ctypes.util``, which ``die_with_parent`` needs)."""
    import ctypes.util  # noqa: F401

    import httpx
    import uvicorn.lifespan.on  # noqa: F401
    import uvloop  # noqa: F401

    import node.front  # noqa: F401

    # (made and dropped: no connection, nothing to close; its imports stay)
    httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds="\0affinity-preload"))
    if grpc:
        from node.protocols.kserve import grpc_front  # noqa: F401


def _front(
    request: dict[str, Any], fds: list[int], sock: socket.socket, others: list[int], server: int
) -> None:
    """Front ``request["index"]`` in the forked child of ``server`` (its pid, known before
    the fork: a server that died since would make ``getppid`` another's): never returns."""
    code = 1
    try:
        sock.close()
        for fd in others:  # (the pidfds of its brothers)
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ["AFFINITY_FRONT_SPEC"] = json.dumps(request["spec"])  # (front.main's)
        from node import front

        argv = [str(request["index"]), *map(str, fds), str(server), str(request["core"])]
        front.main(argv)
        code = 0
    except SystemExit as exc:  # (as the interpreter would: None is 0, a text said and 1)
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(core: int, sock: socket.socket, grpc: bool = False) -> None:
    """The server's loop: fork a front per request, reap each that ends and say so;
    return when the core closes its end."""
    _preload(grpc)
    gc.collect()
    gc.freeze()  # what is loaded now stays untouched by the collector in every fork
    _send(sock, {"ready": os.getpid()})
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    children: dict[int, int] = {}  # pidfd -> pid
    me = os.getpid()
    while True:
        for fd, _ in poller.poll():
            if fd != sock.fileno():
                pid = children.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            try:
                request, fds = _recv(sock)
            except OSError:
                request, fds = None, []
            if request is None:
                return
            try:
                pid = os.fork()
            except OSError as exc:
                for got in fds:
                    os.close(got)
                _send(sock, {"n": request.get("n"), "error": f"{type(exc).__name__}: {exc}"})
                continue
            if pid == 0:
                _front(request, fds, sock, list(children), me)
            for got in fds:
                os.close(got)
            try:
                pidfd = os.pidfd_open(pid)
            except OSError as exc:  # (no descriptor left) a front nobody could watch: gone
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                _send(sock, {"n": request.get("n"), "error": f"{type(exc).__name__}: {exc}"})
                continue
            children[pidfd] = pid
            poller.register(pidfd, select.POLLIN)
            _send(sock, {"n": request.get("n"), "pid": pid}, (pidfd,))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    die_with_parent(int(args[0]))
    sock = socket.socket(fileno=int(args[1]))
    try:
        serve(int(args[0]), sock, "grpc" in args[2:])
    except (BrokenPipeError, ConnectionResetError):  # the core closed its end: it stops
        return
    except Exception:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
