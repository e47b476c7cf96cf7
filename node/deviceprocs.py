"""Each device's model sessions in a worker process of its own (``--device-workers process``,
issue 43's third slice): the core's side.

With the default (``thread``) every session runs in the node's process, on its device's
worker thread (``node/worker.py``). With ``process``, the core starts one worker process per
device (``node/deviceproc.py``), which opens every model's session on that device (the live
models' and the shadow candidates'), captures its CUDA graphs and loads its TensorRT engines.
The core keeps everything else: the episodes and their state, the batch window, the owner's
rules, the crash trackers. A device's thread hands each run to its process through a
:class:`RemoteSession`, which is the ``Session`` the worker thread runs (``node/jobs.py``):
the feed is written raw, once, into the model's slot of the device's hop region (a
``memfd``, ``node/hop.py``), an ``eventfd`` rings the process, and the thread waits on the
answer's ``eventfd`` and on the process's ``pidfd`` together, so a process that dies ends
the run at once (:class:`~node.errors.WorkerGone`), never a wait for a deadline.

What it buys: a device's fault is its process's. A run that segfaults ONNX Runtime, or a
CUDA error that poisons its context for good (an illegal address is sticky: every later
call in that process fails), takes down that device's process, not the node with every
episode of every device. The core marks the device down at once (the episodes on it
move at their next step, ``reassigned`` with ``state_reset``, as for a device its crash
tracker took down), restarts the process (0.1 s, doubling to 5 s while it keeps dying),
warms the new one up and brings the device back up. The sessions' own threads (ONNX
Runtime's) and their Python around each run leave the core's GIL.

What it costs: one hop per model run (a batch is one run), and each process's own copy of
ONNX Runtime and the model in memory.

**Each episode's recurrent state lives in the worker process** (issue 43's fourth slice). A
run's state outputs stay there, held by id (``node.deviceproc._States``; on a GPU with
``--cuda-graph`` as a ``DeviceTensor`` that never leaves the device); the core's record of
the episode holds a :class:`RemoteState` handle instead of arrays, and the next run names
it. So a run carries the step's inputs and the client's outputs, never the state: a
recurrent state of megabytes crosses no hop. A handle the core lets go of (the record
replaced, dropped, its step undone) is freed with the process's next request. The rules
do not change: a step reads its record's handle as its run starts, and keeps its new one
only under the owner's rules; an undone step goes back to the handle before it, which the
process still holds. A batch of several episodes sends their handles and the process
stacks their states (``RUN_ROWS``), as the threads stack host arrays. A hand-over reads
the state back to the host (``GET``, off the event loop: ``node.transfer.on_host``). A
process that dies takes its episodes' states with it: the node drops their records at
once (their next steps say ``state_reset``, as the device was down anyway), and a handle
of the dead process named in a run fails it (:class:`~node.errors.StateLost`).

**The node's lease, in every worker process** (issue 43: one authority per node, every
process sees its lease). Every 50 ms, and at once when the lease changes, the core writes
into each process's control block the instant its loop ran, until when its lease lets it
serve, and its lease generation (``EpisodeTable.generation``, bumped when the node dropped
every record: a fence, a registration anew); each live model's request names the
generation too (``g``). A process keeps each live state under the generation its request
named, and drops every state of an earlier one as soon as it hears of a later one, a model
idle or not: a fenced node holds no episode's state in any process (a shadow candidate's
ghosts, in a table no fence drops, keep theirs). A run that would continue a held state
once the lease has run out, as the core last said, is refused there
(:class:`~node.errors.WorkerFenced`, a 503 ``fenced``; not the device's failure). The
states a core lets go of while their model is idle are freed by a request of their own
after :data:`IDLE_FREE_S`. Each process says what it holds (states, bytes) in its control
block: ``affinity_device_worker_states`` and ``affinity_device_worker_state_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from node.deviceproc import FREE, GET, RUN, RUN_ROWS
from node.devices import DeviceSpec
from node.errors import HopError, StateLost, WorkerFenced, WorkerGone, WorkerRunError
from node.hop import ASKED, Array, Region, contiguous, deaf_children, lift, lower, readable
from node.procs import NO_LAG, Running
from node.providers import ProviderSettings

__all__ = [
    "BACKOFF_S",
    "SLOT_HEADROOM",
    "DeviceModel",
    "DeviceProcs",
    "RemoteSession",
    "RemoteState",
]

log = logging.getLogger("affinity.node")

BACKOFF_S = (0.1, 5.0)
"""A dead worker process is restarted after the first, doubling up to the second."""
SLOT_HEADROOM = 16 << 20
"""Bytes of a model's slot beyond its batch of request bodies (the state, the outputs)."""
START_S = 600.0
"""How long a worker process may take to open its sessions (TensorRT builds its engines on
a GPU's first start: minutes) before the core gives up on it."""
STOP_S = 5.0
CANDIDATE_HANG = (10.0, 60.0)
"""A shadow candidate's run is hung past this many times the node's hang bound, and never
before the second's seconds: it is off the step path (a slower candidate is what a shadow
measures), and killing its process for it resets every live episode of the device. A
wedged device hangs the live model's runs too, which the live bound catches."""
TELL_S = 0.05
"""How often the core tells each worker process the node's lease (its end, its generation)."""
WARM_HANG_S = 60.0
"""The hang bound of a restarted process's warm-up runs, whatever a shorter
``--act-deadline`` says: the first runs of a fresh process on a GPU capture its CUDA graphs
and autotune its kernels (seconds), and killing it for that would restart it forever. The
device is down meanwhile: no step waits on them."""
LOOK_S = 0.25
"""The most a look of the hang watch counts beyond its period: a look that came late (the
node paused or slow as a whole) judges no worker for the time it missed."""
IDLE_FREE_S = 1.0
"""A model asked nothing for this long has the states its core let go of freed by a request
of their own (``FREE``), rather than at its next run."""
_ONE = (1).to_bytes(8, "little")
_LOST = "was restarted: this episode's state was held by the process before it"
_SECRETS = ("AFFINITY_CLUSTER_SECRET", "AFFINITY_API_KEY", "AFFINITY_ADMIN_TOKEN")
"""What a worker process is never given: it serves no client and joins no fleet."""


def _none() -> int:
    """No lease generation (a session no lease follows)."""
    return 0


def _never() -> int | None:
    """A lease never told (not supervised yet)."""
    return None


@dataclass(frozen=True)
class DeviceModel:
    """One model a worker process opens: its key (a live model's name, or a candidate's
    ``name@version``), its file, ONNX Runtime's intra-op threads, whether ``--cuda-graph``
    applies to it (the live models; candidates run plain), and how many steps a run holds
    at most (its slot's size)."""

    key: str
    path: str
    threads: int
    graph: bool
    max_batch: int
    state: tuple[str, ...] = ()
    """Its state outputs (fed back as the next step's state): held by the process."""
    live: bool = True
    """A live model's (its states follow the node's lease generation), not a shadow
    candidate's (its ghosts' table is one no fence drops)."""


class _Channel:
    """One model's end of a worker process's hop, as the core holds it."""

    __slots__ = ("answer", "ask", "gen", "pidfd", "poll", "ran", "region", "slot")

    def __init__(
        self, region: Region, slot: int, ask: int, answer: int, pidfd: int, gen: int
    ) -> None:
        self.gen = gen  # the process's incarnation (RemoteSession.gen)
        self.region = region
        self.slot = slot
        self.ask = ask
        self.answer = answer
        self.pidfd = pidfd
        self.poll = select.poll()
        self.poll.register(answer, select.POLLIN)
        self.poll.register(pidfd, select.POLLIN)
        self.ran = False
        """Whether a run of its model on this process has answered. After a recycle (no
        warm-up) the first, its probe's, is held to :data:`WARM_HANG_S`, as a warm-up is:
        a fresh GPU process captures graphs, builds or loads engines, autotunes."""


class RemoteState:
    """An episode's state held by a worker process (see the module doc): its session, the
    process's incarnation, its id there, and its dtype and shape (which batching groups
    steps by). ``np.asarray`` reads it back (a hop round trip, blocking: off the event
    loop). Freed in the process once the core drops it."""

    __slots__ = ("dtype", "gen", "id", "session", "shape")

    def __init__(
        self, session: RemoteSession, gen: int, id: int, dtype: str, shape: Sequence[int]
    ) -> None:
        self.session = session
        self.gen = gen
        self.id = id
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def stale(self) -> bool:
        """Whether the process that held it has died (the state is gone)."""
        return self.gen != self.session.gen

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Array:
        host = self.session.fetch([self])[0]
        return host if dtype is None else host.astype(dtype, copy=False)

    def __del__(self) -> None:
        self.session.frees.append((self.gen, self.id))  # (deque: any thread)


class RemoteSession:
    """A model's session in its device's worker process, run from the device's worker
    thread (``node.jobs.Session``). ``batch_sizes`` are the process's session's (a CUDA
    graph's fixed batch), as it said once it opened it. One thread runs it at a time (its
    device's, for its model); the supervisor swaps its channel when the process is
    restarted."""

    def __init__(self, key: str, device: str, state: Sequence[str] = (), live: bool = True) -> None:
        self.key = key
        self.device = device
        self.live = live
        """A live model's session, not a shadow candidate's (:data:`CANDIDATE_HANG`)."""
        self.state = frozenset(state)
        """The model's state outputs: held by the process, a :class:`RemoteState` here."""
        self.channel: _Channel | None = None
        self.gen = 0  # the process's incarnation (its restarts), which handles carry
        self.frees: deque[tuple[int, int]] = deque()  # handles dropped: (gen, id)
        self.generation: Callable[[], int] = _none
        """The node's lease generation now (the supervisor sets it): named in each request."""
        self.asked = 0.0  # when it last asked the process anything (time.monotonic)
        self.freeing = False  # a request of frees alone is on its way (free_idle)
        self.batch_sizes: tuple[int, ...] = ()
        self.lock = threading.Lock()  # held by a run, and by the supervisor retiring it
        self.since: float | None = None
        """When the run in progress was handed to the process (``time.monotonic``; None:
        none is): the supervisor's watch for a hung process reads it."""
        self.waiter: asyncio.Future[None] | None = None  # a run awaited from the loop

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[Any]:
        with self.lock:
            channel, names = self._send(output_names, input_feed)
            self._wait(channel)
            return self._received(channel, names)

    def run_rows(
        self, output_names: Sequence[str], feeds: Sequence[Mapping[str, Any]], size: int
    ) -> list[dict[str, Any]]:
        """One run of several steps' ``feeds``, stacked by the process along the first
        axis and padded to ``size`` (their states are held there): each step's outputs."""
        with self.lock:
            channel = self._channel()
            rows, arrays = [], []
            for feed in feeds:
                names, handles, values, carried = self._split(feed)
                row: dict[str, Any] = {"n": names, "h": handles}
                if carried:
                    row["x"] = carried
                rows.append(row)
                arrays += values
            names = list(output_names)
            meta = {"rows": rows, "size": size, "o": names, "k": self._kept(names),
                    "f": self._freed(), "g": self.generation()}  # fmt: skip
            self._ask(channel, RUN_ROWS, meta, arrays)
            self._wait(channel)
            said, values = self._answer(channel)
            kept = set(self._kept(names))
            strings = {n: lower(v, []) for n, v in (said.get("x") or {}).items()}
            shown = [n for n in names if n not in kept and n not in strings]
            out = []
            for i, handles in enumerate(said["h"]):
                got: dict[str, Any] = {
                    n: v[i : i + 1].copy() for n, v in zip(shown, values, strict=True)
                }
                for n, v in strings.items():
                    got[n] = v[i : i + 1].copy()
                for n, h in handles.items():
                    got[n] = RemoteState(self, channel.gen, *h)
                out.append({n: got[n] for n in names})
            return out

    def fetch(self, states: Sequence[RemoteState]) -> list[Array]:
        """The host arrays of ``states`` (a round trip to the process; blocking)."""
        with self.lock:
            channel = self._channel()
            if any(s.gen != channel.gen for s in states):
                raise StateLost(self.device, _LOST)
            self._ask(channel, GET, {"s": [s.id for s in states], "f": self._freed()}, [])
            self._wait(channel)
            return self._answer(channel)[1]

    def free_idle(self) -> None:
        """Free in the process the states the core let go of (a request of its own, for a
        model asked nothing lately; blocking: off the event loop). A run under way, or a
        process restarting, leaves them for its next request."""
        try:
            if not self.lock.acquire(blocking=False):
                return
            try:
                channel = self.channel
                if channel is None:  # restarting: the new process holds none of them
                    return
                ids = self._freed()
                if not ids:
                    return
                self._ask(channel, FREE, {"f": ids, "g": self.generation()}, [])
                self._wait(channel)
                self._answer(channel)
            finally:
                self.lock.release()
        except (WorkerGone, WorkerRunError) as exc:  # died meanwhile: its supervisor sees
            log.debug("device %s: freeing %s's states: %s", self.device, self.key, exc)
        finally:
            self.freeing = False

    def _wait(self, channel: _Channel) -> None:
        """Until the process answers (under :attr:`lock`); :class:`WorkerGone` if it dies."""
        try:
            while True:
                ready = {fd for fd, _ in channel.poll.poll()}
                if channel.answer in ready:  # answered, even if it died just after
                    return
                if channel.pidfd in ready:
                    raise WorkerGone(self.device, "died during the run")
        finally:
            self.since = None

    async def run_from_loop(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]
    ) -> list[Any]:
        """:meth:`run` from the event loop, which goes on meanwhile: the answer's doorbell
        is watched by the loop; the process's death is told by the supervisor
        (:meth:`gone`), which watches its ``pidfd``. A run cancelled before its answer
        leaves an answer on its way into the slot: the process is killed (and restarted)
        rather than reused."""
        if not self.lock.acquire(blocking=False):  # a restart's retirement, or a state read
            if self.channel is None:
                raise WorkerGone(self.device, "is restarting")
            # a hand-over reading a state back (a round trip): wait for it off the loop
            return await asyncio.to_thread(self.run, output_names, input_feed)
        try:
            channel, names = self._send(output_names, input_feed)
            loop = asyncio.get_running_loop()
            waiter = self.waiter = loop.create_future()
            loop.add_reader(channel.answer, _wake, waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(channel.pidfd, signal.SIGKILL)
                raise
            finally:
                loop.remove_reader(channel.answer)
                self.waiter = None
                self.since = None
            if channel.answer not in {fd for fd, _ in channel.poll.poll(0)}:
                raise WorkerGone(self.device, "died during the run")
            return self._received(channel, names)
        finally:
            self.lock.release()

    def gone(self) -> None:
        """The process died (the supervisor, on the loop): a run awaited from the loop ends."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _channel(self) -> _Channel:
        """The live process's channel; :class:`WorkerGone` while it restarts, and from its
        death on (its incarnation passed: ``gen``), before the supervisor retired it: a run
        sent there would wait for an answer nobody writes, holding :attr:`lock`."""
        channel = self.channel
        if channel is None or channel.gen != self.gen:
            raise WorkerGone(self.device, "is restarting")
        return channel

    def _split(
        self, feed: Mapping[str, Any]
    ) -> tuple[list[str], dict[str, int], list[Array], dict[str, Any]]:
        """A feed's host arrays (names, values), its states held by the process (their
        ids by name), and its string tensors (an ONNX string input: an object array of
        ``str`` or ``bytes``), carried by value in the header (``x``; ``hop.lift``), since a
        slot holds raw numbers only. Raises :class:`StateLost` for a state an earlier
        process held."""
        names, handles, values, carried = [], {}, [], {}
        for name, value in feed.items():
            if isinstance(value, RemoteState):
                if value.session is not self or value.gen != self.gen:
                    raise StateLost(self.device, _LOST)
                handles[name] = value.id
                continue
            array = np.asarray(value)
            if array.dtype.hasobject:
                carried[name] = lift(array, [])
            else:
                names.append(name)
                values.append(contiguous(array))
        return names, handles, values, carried

    def _kept(self, names: Sequence[str] | None) -> list[str]:
        """The outputs of ``names`` the process keeps (the model's state outputs)."""
        return [] if names is None else [n for n in names if n in self.state]

    def _freed(self) -> list[int]:
        """The ids of this process's states the core let go of since the last request."""
        ids = []
        while self.frees:
            gen, i = self.frees.popleft()
            if gen == self.gen:
                ids.append(i)
        return ids

    def _ask(self, channel: _Channel, kind: int, meta: dict[str, Any], arrays: list[Array]) -> None:
        try:
            channel.region.write(channel.slot, ASKED, kind, meta, arrays)
        except HopError as exc:  # bigger than --max-body-bytes allows a batch
            self.frees.extend((channel.gen, i) for i in meta.get("f") or ())  # (next time)
            raise WorkerRunError(f"the run does not fit its slot: {exc}") from None
        self.since = self.asked = time.monotonic()
        os.write(channel.ask, _ONE)

    def _send(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]
    ) -> tuple[_Channel, list[str] | None]:
        """Write the run into the slot and ring (under :attr:`lock`); the channel used and
        the outputs asked."""
        channel = self._channel()
        names, handles, arrays, carried = self._split(input_feed)
        outputs = None if output_names is None else list(output_names)
        meta = {"n": names, "h": handles, "o": outputs, "k": self._kept(outputs),
                "f": self._freed(), "g": self.generation()}  # fmt: skip
        if carried:
            meta["x"] = carried
        self._ask(channel, RUN, meta, arrays)
        return channel, outputs

    def _answer(self, channel: _Channel) -> tuple[dict[str, Any], list[Array]]:
        """The answer in the slot, its doorbell drained (under :attr:`lock`)."""
        os.read(channel.answer, 8)
        channel.ran = True  # (an error too: the process answers, its first run is over)
        _, said, values = channel.region.read(channel.slot, copy=True)
        if "e" in said:
            if said.get("lost"):
                raise StateLost(self.device, f"was restarted: {said['e']}")
            if said.get("fenced"):
                raise WorkerFenced(self.device, f"refused the run: {said['e']}")
            raise WorkerRunError(str(said["e"]))
        return said, values

    def _received(self, channel: _Channel, names: list[str] | None) -> list[Any]:
        """A run's outputs, in ``names`` order: the states held by the process as handles."""
        said, values = self._answer(channel)
        handles = said.get("h") or {}
        carried = said.get("x") or {}
        if not handles and not carried:
            return values
        shown = iter(values)
        keys = names if names is not None else [str(i) for i in range(len(values) + len(carried))]
        return [
            RemoteState(self, channel.gen, *handles[k]) if k in handles
            else lower(carried[k], []) if k in carried
            else next(shown)
            for k in keys
        ]  # fmt: skip


@dataclass
class _Worker:
    """One device's worker process as the supervisor knows it."""

    spec: DeviceSpec
    process: subprocess.Popen[bytes] | None = None
    region: Region | None = None
    fds: list[int] = field(default_factory=list)  # every descriptor of its hop, and its pidfd
    pidfd: int = -1
    restarts: int = 0  # in a row (the backoff's): 0 again once it ran a while
    restarted: int = 0  # since the core started (node/procs.py)
    hold: bool = False  # recycled (its device went down): up again at its probe, not at once
    recycled: bool = False  # restarted so: each model's first run (its probe's) has WARM_HANG_S
    warming: bool = False  # a restarted process's warm-up runs (WARM_HANG_S)
    started: float = 0.0
    since_ms: int = 0


class DeviceProcs:
    """A worker process per device of ``specs``, each opening ``models``; their
    :class:`RemoteSession` by (model key, device id) in :attr:`sessions`.

    :meth:`start` starts them and waits until each has opened its sessions (raises
    ``RuntimeError`` naming the device and the model that failed). :meth:`supervise`
    watches them on the running loop: a process that dies calls ``lost(device id, why)``
    at once, is restarted, and once the new one has opened its sessions ``back(device
    id)`` is awaited (the node warms it up and brings the device up). :meth:`stop` ends
    them. ``restarted`` is called once per restart (a metric). A process whose run has
    gone on for ``hang_s`` (the node's ``--act-deadline``: no step waits longer) is hung:
    it is killed, and restarted as one that died. A shadow candidate's run has a longer
    bound (:data:`CANDIDATE_HANG`)."""

    def __init__(
        self,
        node_id: str,
        specs: Sequence[DeviceSpec],
        models: Sequence[DeviceModel],
        providers: ProviderSettings,
        *,
        max_body_bytes: int,
        hang_s: float = 5.0,
        log_level: str = "info",
        log_format: str = "plain",
    ) -> None:
        self.node_id = node_id
        self.models = list(models)
        self.providers = providers
        self.slot_size = max(m.max_batch for m in self.models) * max_body_bytes + SLOT_HEADROOM
        self.log = (log_level, log_format)
        self.hang_s = hang_s
        self.workers = {self.device_id(s): _Worker(s) for s in specs}
        self.sessions: dict[tuple[str, str], RemoteSession] = {
            (m.key, device): RemoteSession(m.key, device, m.state, m.live)
            for device in self.workers
            for m in self.models
        }
        self.active: dict[tuple[str, str], str] = {}
        """(model key, device id) -> the provider ONNX Runtime runs it on."""
        self.stopping = False
        self._lost: Callable[[str, str], None] | None = None
        self._back: Callable[[str], Awaitable[None]] | None = None
        self._restarted: Callable[[str], None] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lease: Callable[[], int | None] = _never
        self._generation: Callable[[], int] = _none
        self._watched: dict[tuple[str, str], tuple[float, float]] = {}
        """The hang watch's count per session: the run it saw (its ``since``) and how long
        it has seen it go on, each look counting at most :data:`LOOK_S` more than its
        period (a late look, the node paused as a whole, counts nothing it missed)."""

    def device_id(self, spec: DeviceSpec) -> str:
        return f"{self.node_id}/{spec.index}"

    # ---- start ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker process and wait until each has opened its sessions, one
        device after another (CUDA graphs and TensorRT builds are not raced)."""
        for device, worker in self.workers.items():
            error = await self._spawn(device, worker)
            if error is not None:
                await self.stop()
                raise RuntimeError(f"device {worker.spec.index} ({worker.spec.name}): {error}")

    async def _spawn(self, device: str, worker: _Worker) -> str | None:
        """Start ``worker``'s process and wait for its hello; None when it opened every
        session (its channels are in place), else why it did not. Never raises (a restart
        that could not make a descriptor, or a hello it cannot read, is tried again): what
        it made is closed, a process it started killed and reaped."""
        try:
            return await self._spawn_once(device, worker)
        except Exception as exc:
            log.exception("device %s: starting its worker process failed", device)
            process = worker.process
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                await asyncio.to_thread(process.wait)
            self._close(worker)
            worker.process = None
            return f"its worker process could not be started: {type(exc).__name__}: {exc}"

    async def _spawn_once(self, device: str, worker: _Worker) -> str | None:
        # what it makes is the worker's at once, so that a failure midway closes it
        region = worker.region = Region.create(len(self.models), self.slot_size)
        region.tell_generation(self._generation())  # (before its first request)
        fds = worker.fds = [region.fd]
        pairs = []
        for _ in self.models:
            ask = os.eventfd(0, os.EFD_CLOEXEC)
            fds.append(ask)
            answer = os.eventfd(0, os.EFD_CLOEXEC)
            fds.append(answer)
            pairs.append((ask, answer))
        hello_r, hello_w = os.pipe()
        spec = {
            "parent": os.getpid(),
            "device": asdict(worker.spec),
            "providers": {**asdict(self.providers), "trt_cache_root": str(
                self.providers.trt_cache_root)},
            "models": [
                {"key": m.key, "path": m.path, "threads": m.threads, "graph": m.graph,
                 "live": m.live, "fds": pair}
                for m, pair in zip(self.models, pairs, strict=True)
            ],
            "region": region.fd,
            "hello": hello_w,
            "log_level": self.log[0],
            "log_format": self.log[1],
        }  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in _SECRETS}
        env["AFFINITY_DEVICE_SPEC"] = json.dumps(spec)
        try:
            with deaf_children():  # SIGINT and SIGTERM are the core's (node/hop.py)
                process = subprocess.Popen(
                    [sys.executable, "-m", "node.deviceproc"], pass_fds=(*fds, hello_w), env=env
                )
        except OSError as exc:
            os.close(hello_r)
            self._close(worker)
            return f"cannot start its worker process: {exc}"
        except BaseException:  # (anything else: ``_spawn`` cleans the worker up)
            os.close(hello_r)
            raise
        finally:
            os.close(hello_w)  # (the child's copy is its own; closed once, here)
        worker.process = process
        try:
            worker.pidfd = os.pidfd_open(process.pid)
        except BaseException:
            os.close(hello_r)
            raise
        worker.started, worker.since_ms = time.monotonic(), int(time.time() * 1000)
        said = await asyncio.to_thread(_hello, hello_r, START_S)  # (closes hello_r)
        if "models" not in said:
            process.kill()
            await asyncio.to_thread(process.wait)
            self._close(worker)
            return str(said.get("error") or "its worker process exited before its sessions opened")
        # read whole before any session takes a channel (a hello it cannot read raises)
        opened = [(tuple(h["batch_sizes"]), str(h["provider"])) for h in said["models"]]
        if len(opened) != len(self.models):
            raise ValueError(f"its hello names {len(opened)} sessions, not {len(self.models)}")
        for k, (m, (ask, answer), (sizes, provider)) in enumerate(
            zip(self.models, pairs, opened, strict=True)
        ):
            session = self.sessions[(m.key, device)]
            session.batch_sizes = sizes
            self.active[(m.key, device)] = provider
            session.gen += 1  # a new process: it holds none of the states before it
            session.channel = _Channel(region, k, ask, answer, worker.pidfd, session.gen)
        log.info("device %s: worker process %d opened %d session(s)",
                 device, process.pid, len(self.models))  # fmt: skip
        return None

    def _close(self, worker: _Worker) -> None:
        for fd in (*worker.fds, worker.pidfd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if worker.region is not None:
            worker.region.mm.close()
        worker.fds, worker.pidfd, worker.region = [], -1, None

    # ---- supervision -----------------------------------------------------------------------

    def supervise(
        self,
        lost: Callable[[str, str], None],
        back: Callable[[str], Awaitable[None]],
        restarted: Callable[[str], None],
        lease: Callable[[], int | None] | None = None,
        generation: Callable[[], int] = _none,
    ) -> None:
        """Watch every worker process from the running loop (see the class doc). ``lease``:
        until when the node's lease lets it serve (``Lease.serves_until_ns``), and
        ``generation``: its lease generation (``EpisodeTable.generation``), told to every
        process every :data:`TELL_S` and by :meth:`tell` (see the module doc); the live
        models' requests name the generation."""
        self._lost, self._back, self._restarted = lost, back, restarted
        loop = self._loop = asyncio.get_running_loop()
        for device, worker in self.workers.items():
            if worker.pidfd >= 0:
                loop.add_reader(worker.pidfd, self._died, device, worker, worker.pidfd)
        self._track(self._watch_hangs())
        if lease is not None:
            self._lease, self._generation = lease, generation
            live = {m.key for m in self.models if m.live}
            for (key, _), session in self.sessions.items():
                if key in live:
                    session.generation = generation
            self._track(self._tell_every())

    def tell(self) -> None:
        """Tell every worker process the node's lease now (every :data:`TELL_S`, and at
        once when the lease changes: a renewal, a fence, a registration), and free an idle
        model's states the core let go of."""
        if self._lease is _never or self.stopping:  # (not supervised yet, or stopped)
            return
        until, generation = self._lease(), self._generation()
        now = time.monotonic_ns()
        for worker in self.workers.values():
            region = worker.region
            if region is not None:
                region.tell_generation(generation)
                # None: the node left (it routes its stragglers' steps, serves none of its
                # own): run out for a worker, which serves only this node's episodes
                region.tell(now, 0 if until is None else until)
        later = time.monotonic() - IDLE_FREE_S
        for session in self.sessions.values():
            if session.channel is None:  # restarting: the new process holds none of them
                continue
            if session.frees and not session.freeing and session.asked < later:
                session.freeing = True
                self._track(asyncio.to_thread(session.free_idle))

    async def _tell_every(self) -> None:
        while not self.stopping:
            try:
                self.tell()
            except Exception:  # never the end of the telling
                log.exception("telling the worker processes the lease failed")
            await asyncio.sleep(TELL_S)

    def held(self, device: str) -> tuple[int, int]:
        """The states ``device``'s worker process holds, and their bytes, as it says."""
        region = self.workers[device].region
        return (0, 0) if region is None else region.held()

    async def _watch_hangs(self) -> None:
        """Kill a process whose run has outlived ``hang_s``: a wedged GPU (or a process
        stopped for good) is recovered by a restart, where a thread would stay stuck."""
        every = min(1.0, self.hang_s / 4)
        looked = time.monotonic()
        while not self.stopping:
            await asyncio.sleep(every)
            now = time.monotonic()
            credit, looked = min(now - looked, every + LOOK_S), now
            for (key, device), session in self.sessions.items():
                since = session.since
                worker = self.workers[device]
                process = worker.process
                bound = self.hang_bound(session)
                channel = session.channel
                if worker.warming or (worker.recycled and channel is not None and not channel.ran):
                    bound = max(bound, WARM_HANG_S)  # a fresh process's first runs: captures,
                    # engines, autotuning (a warm-up's; after a recycle, its probe's)
                if since is None or process is None:
                    self._watched.pop((key, device), None)
                    continue
                seen, gone_on = self._watched.get((key, device), (None, 0.0))
                gone_on = gone_on + credit if seen == since else min(now - since, credit)
                self._watched[(key, device)] = (since, gone_on)
                if gone_on < bound:
                    continue
                if channel is not None and readable(channel.answer):
                    continue  # answered, not yet read (the node itself was late)
                if process.poll() is None and channel is not None:
                    log.error(
                        "device %s: a run of %s has gone on for %.1f s (%s %g s): "
                        "its worker process %d is hung, killed and restarted",
                        device, key, gone_on,
                        "--act-deadline" if session.live else "a shadow candidate's bound", bound,
                        process.pid,
                    )  # fmt: skip
                    process.kill()
                    session.since = None  # once: its death is seen through its pidfd

    def hang_bound(self, session: RemoteSession) -> float:
        """How long a run of ``session`` goes on before its process counts as hung."""
        if not session.live:
            return max(CANDIDATE_HANG[0] * self.hang_s, CANDIDATE_HANG[1])
        return self.hang_s

    def recycle_threadsafe(self, device: str, reason: str) -> None:
        """``device`` went down by its runs' failures (any thread): its worker process is
        restarted, since a CUDA error can leave a process's context failing every call for
        good (an illegal address is sticky). The device stays down until its probe passes
        (the crash tracker's cool-down holds, as with threads); its probe then runs on the
        new process. A process already gone is left to its restart."""
        loop = self._loop
        if loop is not None and not self.stopping:
            loop.call_soon_threadsafe(self._recycle, device, reason)

    def _recycle(self, device: str, reason: str) -> None:
        worker = self.workers.get(device)
        process = None if worker is None else worker.process
        if self.stopping or worker is None or process is None or process.poll() is not None:
            return
        if worker.hold:  # another model's failures recycled it already: once per death
            return
        log.warning("device %s is down (%s): its worker process %d is restarted; the device "
                    "comes back at its probe", device, reason, process.pid)  # fmt: skip
        worker.hold = True
        process.kill()

    def _died(self, device: str, worker: _Worker, pidfd: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(pidfd)
        if self.stopping or worker.pidfd != pidfd:
            return
        process = worker.process
        assert process is not None
        code = process.wait()
        why = f"exited with {code}" if code >= 0 else f"was killed by {_signal_name(-code)}"
        log.error("device %s: its worker process %d %s", device, process.pid, why)
        for (_, d), session in self.sessions.items():
            if d == device:
                session.gen += 1  # the states it held are gone: their handles are stale
                session.gone()
        if self._lost is not None:  # down at once: its episodes move at their next step
            self._lost(device, f"its worker process {why}")
        self._track(self._restart(device, worker))

    def _track(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, device: str, worker: _Worker) -> None:
        # the runs on the dead process end at once (its pidfd is readable): retire its
        # channels once they have, then its hop
        await asyncio.to_thread(self._retire, device)
        self._close(worker)
        worker.process = None
        hold, worker.hold = worker.hold, False
        worker.recycled = hold  # (no warm-up: the probe is the new process's first run)
        while not self.stopping:
            worker.restarts += 1
            ran = time.monotonic() - worker.started
            backoff = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** min(worker.restarts - 1, 6))
            if ran > 10 * BACKOFF_S[1]:
                worker.restarts, backoff = 1, BACKOFF_S[0]
            await asyncio.sleep(backoff)
            if self.stopping:
                return
            worker.restarted += 1
            if self._restarted is not None:
                self._restarted(device)
            error = await self._spawn(device, worker)
            if error is None:
                break
            log.error("device %s: its restarted worker process failed: %s", device, error)
        if self.stopping:
            return
        loop = asyncio.get_running_loop()
        loop.add_reader(worker.pidfd, self._died, device, worker, worker.pidfd)
        if hold:  # recycled after failures: up at its probe, after the cool-down
            log.info("device %s: its worker process was restarted; the device comes back at "
                     "its probe", device)  # fmt: skip
            return
        if self._back is not None:
            worker.warming = True
            try:
                await self._back(device)
            except Exception:  # the device stays down: its probe tries again
                log.exception("device %s: bringing it back after its restart failed", device)
            finally:
                worker.warming = False

    def _retire(self, device: str) -> None:
        for (_, d), session in self.sessions.items():
            if d == device:
                with session.lock:
                    session.channel = None

    def running(self) -> list[Running]:
        """Each worker process running now (``node/procs.py``): ``dev<index>``."""
        return [
            Running(f"dev{w.spec.index}", w.process.pid, w.since_ms, w.restarted, NO_LAG)
            for w in self.workers.values()
            if w.process is not None and w.process.poll() is None
        ]

    def helpers(self) -> list[Running]:
        """None: the workers are started by the core itself."""
        return []

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers.values() if w.process is not None]

    # ---- stop ------------------------------------------------------------------------------

    async def stop(self, timeout_s: float = STOP_S) -> None:
        """End every worker process (SIGUSR1, SIGKILL past ``timeout_s``). Call it once the
        devices' threads have stopped asking."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        loop = asyncio.get_running_loop()
        for worker in self.workers.values():
            if worker.pidfd >= 0:
                loop.remove_reader(worker.pidfd)
            if worker.process is not None and worker.process.poll() is None:
                worker.process.send_signal(signal.SIGUSR1)
        for session in self.sessions.values():  # nobody watches the pidfds now: a run
            session.gone()  # awaited from the loop ends (failed) before its channel closes
        await asyncio.sleep(0)
        until = time.monotonic() + timeout_s
        for worker in self.workers.values():
            process = worker.process
            if process is not None:
                while process.poll() is None and time.monotonic() < until:
                    await asyncio.sleep(0.02)
                if process.poll() is None:
                    process.kill()
                    await asyncio.to_thread(process.wait)  # (a GPU context's teardown)
            for session in self.sessions.values():
                if session.channel is not None and session.channel.pidfd == worker.pidfd:
                    # a state read still in it (a late hand-over) ends first: its process
                    # is gone, so its wait does (bounded all the same; off the loop)
                    held = await asyncio.to_thread(session.lock.acquire, timeout=timeout_s)
                    session.channel = None
                    if held:
                        session.lock.release()
            self._close(worker)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _hello(fd: int, timeout_s: float) -> dict[str, Any]:
    """The worker process's hello line (its pipe closes with it: ``{}`` then)."""
    with os.fdopen(fd, "rb") as pipe:
        if not readable(fd, timeout_s):
            return {"error": f"its sessions did not open within {timeout_s:g} s"}
        line = pipe.readline()
    if not line:
        return {}
    try:
        said = json.loads(line)
    except ValueError:
        return {"error": "its worker process said something unreadable"}
    return said if isinstance(said, dict) else {}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
