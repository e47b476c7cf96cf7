"""``MultiGpuDispatcher``: one model's steps on the node's devices.

A step is admitted against its episode's record. A retry of the step already applied gets
its reply again. A step the action buffer holds is answered from it. Any other step goes
to its device's worker (``node/worker.py``: the queue, batches, inline runs). The worker
keeps a run only by the commit rules of ``node/commit.py``. No HTTP, no Redis: sessions
come from an injectable factory, so the rules are tested with fakes and no GPU.

Hazard: a caller cancelled mid-run. Its step is undone, unless it named its ``seq``: then it
runs on and keeps its result for the caller's retry. ``docs/internals.md`` tells the path.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from affinity.errors import InvalidArgument
from node import warmup
from node.chunks import ChunkMode, find_chunk
from node.commit import Records, StepJob
from node.contract import PolicyContract
from node.crashes import CrashTracker
from node.episodes import EpisodeTable
from node.errors import DeviceDown, NotKept
from node.jobs import Arrival, Arrivals, Session
from node.record import StepResult
from node.rtc import Ask, control_rate, rtc_of
from node.worker import DEFAULT_BATCH_DELAY_US, DeviceWorker, WorkerHooks, batch_limit

if TYPE_CHECKING:
    from affinity.claims import Assignment
    from node.recorder import Recorder
    from node.step import Step

__all__ = [  # the worker's and health's names too, for the imports made before the split
    "Arrival",
    "Arrivals",
    "BatchSettings",
    "ChunkSettings",
    "CrashSettings",
    "MultiGpuDispatcher",
    "Session",
    "WorkerHooks",
]

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class CrashSettings:
    """When a device's crash tracker takes it down (``failure_threshold`` failed runs in a
    row) and for how long (``cooldown_s``) before a probe: :class:`node.crashes.CrashTracker`."""

    failure_threshold: int = 3
    cooldown_s: float = 30.0


@dataclass(frozen=True)
class BatchSettings:
    """The workers' batching (:class:`node.worker.DeviceWorker`). ``max_batch`` (None:
    ``MAX_DEFAULT_BATCH`` when the model allows batching; 1: off), ``batch_delay_us``, and
    ``inline_under_us`` for the ``inline_devices`` only (0: never inline)."""

    max_batch: int | None = None
    batch_delay_us: float = DEFAULT_BATCH_DELAY_US
    inline_under_us: float = 0.0
    inline_devices: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ChunkSettings:
    """The node's chunk-execution mode (:mod:`node.chunks`; ``execute_steps`` and
    ``ensemble`` both None or ``"none"``: off), and its control rate (``--control-hz``, for
    real-time chunking: :mod:`node.rtc`)."""

    execute_steps: int | None = None
    ensemble: str | None = None
    ensemble_decay: float = 0.01
    control_hz: float | None = None


class MultiGpuDispatcher:
    """Routes one model's steps to its per-device workers and keeps per-episode state.

    ``devices`` are device ids (``<node>/<index>``); ``session_factory(device_id)`` builds
    the device's session (called once per device, in the constructor). ``crashes``,
    ``batching``, ``chunks`` and ``hooks``: the settings above and the workers'
    :class:`~node.worker.WorkerHooks`. ``recorder`` is handed each kept step (``--record``;
    None: off). ``table`` and ``arrivals`` are the node's, shared by all its models (None:
    this dispatcher's own). ``clock`` is a monotonic clock in seconds. Use from one asyncio
    event loop. Raises ``ValueError`` for a bad setting.
    """

    def __init__(
        self,
        devices: Sequence[str],
        session_factory: Callable[[str], Session],
        contract: PolicyContract,
        *,
        crashes: CrashSettings = CrashSettings(),
        batching: BatchSettings = BatchSettings(),
        chunks: ChunkSettings = ChunkSettings(),
        hooks: WorkerHooks | None = None,
        recorder: Recorder | None = None,
        table: EpisodeTable | None = None,
        arrivals: Arrivals | None = None,
        clock: Callable[[], float] = time.monotonic,
        model: str = "",
    ) -> None:
        if not devices:
            raise ValueError("a dispatcher needs at least one device")
        if crashes.failure_threshold < 1:
            raise ValueError(f"failure_threshold={crashes.failure_threshold}: must be >= 1")
        max_batch, delay_us = batching.max_batch, batching.batch_delay_us
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"batch size limit {max_batch}: must be >= 1 (steps per model run)")
        if not (math.isfinite(delay_us) and delay_us >= 0):
            raise ValueError(f"batch_delay_us={delay_us}: must be a finite number >= 0")
        if not 0 <= batching.inline_under_us <= 1_000_000:
            raise ValueError(f"inline_under_us must be 0-1000000, not {batching.inline_under_us}")
        self.contract = contract
        self.clock = clock
        self.chunk, self._no_chunk = find_chunk(contract)
        self.rtc = rtc_of(contract)
        """The model's real-time-chunking inputs (None: it has none; ``node/rtc.py``)."""
        self.control_hz = chunks.control_hz
        self.ensemble_decay = chunks.ensemble_decay
        self.chunk_mode: ChunkMode | None = None
        """The node's chunk-execution mode (None: off)."""
        if chunks.execute_steps is not None or chunks.ensemble not in (None, "none"):
            self.chunk_mode = self.mode_for(chunks.execute_steps, chunks.ensemble)
        self.max_batch, self.batching_off = batch_limit(contract.batch_blocker, max_batch, model)
        self.table = table if table is not None else EpisodeTable(clock)
        """The node's episode records, shared by the dispatchers of all its models."""
        self.arrivals = arrivals if arrivals is not None else Arrivals()
        self._records = Records(
            self.table, contract, self.chunk, self.rtc, chunks.control_hz, clock, model, recorder
        )
        self._outputs = [o.name for o in contract.outputs]
        self._devices: dict[str, DeviceWorker] = {}
        for device in devices:
            inline = device in batching.inline_devices
            self._devices[device] = DeviceWorker(
                device,
                session_factory(device),
                CrashTracker(crashes.failure_threshold, crashes.cooldown_s, clock),
                outputs=self._outputs,
                prepare=self._records.prepare,
                commit=self._records.commit,
                max_batch=self.max_batch,
                batch_delay_s=delay_us / 1e6,
                arrivals=self.arrivals,
                peers=self._devices,
                inline_under_s=batching.inline_under_us / 1e6 if inline else 0.0,
                hooks=hooks or WorkerHooks(),
            )
        for dev in self._devices.values():
            dev.start()

    # ---- inspection ------------------------------------------------------------------

    def failed(
        self, assignment: Assignment, inputs: Mapping[str, Array], seq: int | None, code: str
    ) -> None:
        """Tell the recorder (``--record``) that a step under ``assignment`` failed with
        ``code`` (a 5xx) and was not kept; ``inputs``: what it ran with (no copy)."""
        recorder = self._records.recorder
        if recorder is None or not assignment.episode:
            return
        if seq is None:  # the one it would have applied: after the episode's record
            record = self.table.get(assignment.episode)
            seq = 1 if record is None else record.seq + 1
        recorder.failed(self.model, assignment.device, assignment.episode, assignment.claim,
                        assignment.token, seq, code, inputs)  # fmt: skip

    @property
    def model(self) -> str:
        """``name@version`` of the model (its records' claims); "" where none is given."""
        return self._records.model

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    def tracker(self, device: str) -> CrashTracker:
        return self._device(device).tracker

    def live_episodes(self, device: str) -> int:
        """How many episode records (of any model) are on ``device``."""
        self._device(device)
        return self.table.live(device)

    def queued(self, device: str) -> int:
        """How many jobs wait on ``device``'s worker, the one running not counted (a ghost
        step is queued only when there are none: ``node/shadow.py``)."""
        return len(self._device(device).pending)

    def arrival(self) -> Arrival:
        """Count one step on its way through the node (:meth:`Arrivals.arrival`)."""
        return self.arrivals.arrival()

    def _device(self, device: str) -> DeviceWorker:
        try:
            return self._devices[device]
        except KeyError:
            raise KeyError(f"device {device!r} is not served by this dispatcher") from None

    # ---- steps -----------------------------------------------------------------------

    def mode_for(self, execute_steps: object = None, ensemble: object = None) -> ChunkMode | None:
        """The chunk mode of a step with these overrides (None: off).

        With neither override, the node's mode. An override replaces the node's mode for
        the step. ``execute_steps=k`` alone is execute-k without ensembling.
        ``ensemble="exp"`` alone ensembles (the model runs every step). ``"none"`` alone is
        execute-1. Raises :class:`affinity.InvalidArgument` for k outside 1..H, a
        non-integer k, an unknown ensemble mode or ensembling with k > 1. Also for any
        override when the model has no action chunk.
        """
        if execute_steps is None and ensemble is None:
            return self.chunk_mode
        return ChunkMode.checked(
            self.chunk, self._no_chunk, execute_steps, ensemble, self.ensemble_decay
        )

    def rtc_for(
        self,
        executed: object = None,
        inference_delay: object = None,
        control_hz: object = None,
        pending: object = None,
    ) -> Ask | None:
        """A step's real-time-chunking values, checked (None for a model without ``rtc.*``
        inputs). Raises :class:`affinity.InvalidArgument` naming the bad one, or
        ``executed``, ``inference_delay`` or ``pending`` given to a model without them (see
        :meth:`node.rtc.RtcSpec.ask`; any model's step may name its ``control_hz``)."""
        if self.rtc is None:
            if executed is not None or inference_delay is not None or pending is not None:
                given = {"executed": executed, "inference_delay": inference_delay,
                         "pending": pending}  # fmt: skip
                for name, value in given.items():
                    if value is not None:
                        shown = "(array)" if name == "pending" else value
                        raise InvalidArgument(name, shown, "this model takes no rtc.* inputs")
            control_rate(control_hz)
            return None
        return self.rtc.ask(executed, inference_delay, control_hz, self.control_hz, pending)

    def observed(self, episode: str, seq: int, seconds: float) -> None:
        """Add the latency of step ``seq`` of ``episode`` (arrival to reply, seconds) to its
        record, which the delay estimate reads (RTC models only)."""
        if self.rtc is not None:
            self.table.observed(episode, seq, seconds)

    async def step(
        self,
        step: Step,
        assignment: Assignment,
        *,
        inputs: Mapping[str, Array] | None = None,
        generation: int | None = None,
    ) -> StepResult:
        """Run ``step`` under ``assignment`` (its episode, device, token and claim id), by
        the rules of :func:`node.episodes.admit`; return its result.

        A fresh claim (status ``claimed``) expects no state anywhere. ``inputs``: the
        step's inputs with the caller's control values (None: ``step.inputs``).
        ``generation``: the table's when the step began (None: now; a drop since keeps
        nothing). Of the step: ``seq`` is the number the caller expects to be applied. A
        retry of the one applied, with the same inputs, gets its stored reply, no model
        run. Any other mismatch raises :class:`SeqConflict` and changes nothing.
        ``origin`` is the forward it came in (:meth:`EpisodeTable.undo`). ``deadline``:
        past it a cancelled step's run counts as hung. ``execute_steps`` and ``ensemble``
        (:meth:`mode_for`); ``rtc`` (:meth:`rtc_for`; None: estimate both); ``arrived``
        (None: now).

        Raises :class:`ModelFailure` (counted), :class:`DeviceDown`, :class:`ClaimEnded`
        (the claim ended here first), :class:`NotKept` (the records were dropped),
        :class:`ForwardCancelled`, and :class:`affinity.InvalidArgument` for a bad override
        (before anything changes). A cancelled step keeps nothing, unless it named its
        ``seq``: that one runs on and keeps its result for the caller's retry.
        """
        episode, device = assignment.episode, assignment.device
        token, claim = assignment.token, assignment.claim
        fresh = assignment.status == "claimed"
        seq, origin = step.seq, step.origin
        dev = self._device(device)
        table = self.table
        current = table.generation
        if generation is not None and generation != current:
            raise NotKept(episode)
        mode = self.mode_for(step.execute_steps, step.ensemble)
        rtc = step.rtc
        if self.rtc is not None and rtc is None:
            rtc = self.rtc_for()
        if dev.tracker.down:
            raise DeviceDown(device)
        feed = dict(step.inputs if inputs is None else inputs)
        asked = feed if seq is not None else None
        if not fresh and (seq is not None or mode is not None) and not table.in_flight(episode):
            # a replay or a buffered action, perhaps, with nothing of this episode on the
            # worker: its record cannot change under us
            answered = self._records.answer_at_once(
                device, episode, token, claim, fresh, seq, origin, mode, asked
            )
            if answered is not None:
                return answered
        one_row = all(a.ndim >= 1 and a.shape[0] == 1 for a in feed.values())
        future = asyncio.get_running_loop().create_future()
        arrived = self.clock() if step.arrived is None else step.arrived
        job = StepJob(episode, feed, future, one_row, token=token, claim=claim, fresh=fresh,
                    seq=seq, origin=origin, mode=mode, rtc=rtc, arrived=arrived,
                    generation=current, asked=asked)  # fmt: skip
        table.enter(episode)
        held = False
        try:
            if not dev.run_inline(job):
                dev.put(job)
            # a step that named its seq runs on for the caller's retry, even if it gives up
            result: StepResult = await (job.future if seq is None else asyncio.shield(job.future))
            return result
        except asyncio.CancelledError:
            held = self._handle_cancel(dev, job, episode, step.deadline)
            raise
        finally:
            if not held:
                table.leave(episode)

    def _handle_cancel(
        self, dev: DeviceWorker, job: StepJob, episode: str, deadline: float
    ) -> bool:
        """The caller of ``job`` was cancelled. A run still going at its ``deadline`` counts
        as hung. What it applied is undone, unless it named its seq. Then it runs on and
        keeps its result for the caller's retry (True: held)."""
        committed = 0
        with job.lock:
            run = job.run
            if job.seq is None:
                job.abandoned = True
                committed = job.committed
        if run is not None and time.monotonic() >= deadline:
            dev.count_hang(run)
        if job.seq is not None:
            job.future.add_done_callback(functools.partial(_held_done, self.table, episode))
            return True
        if committed:
            self.table.undo(episode, committed)
        return False

    def undo(self, episode: str, seq: int | None = None, origin: str | None = None) -> bool:
        """:meth:`EpisodeTable.undo` (the node's records, whichever model)."""
        return self.table.undo(episode, seq, origin)

    async def run_stateless(self, device: str, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """One run from the initial state, keeping nothing (requests without any id)."""
        dev = self._device(device)
        if dev.tracker.down:
            raise DeviceDown(device)
        feed = dict(inputs)
        one_row = all(a.ndim >= 1 and a.shape[0] == 1 for a in feed.values())
        future = asyncio.get_running_loop().create_future()
        dev.put(StepJob(None, feed, future, one_row))
        result: StepResult = await future
        return result.outputs

    # ---- the devices' health ---------------------------------------------------------

    async def probe(self) -> list[str]:
        """Probe every down device whose cool-down has passed (:func:`warmup.probe`).

        Returns the devices that came back up."""
        return [dev.id for dev in self._devices.values() if await warmup.probe(dev, self.contract)]

    def lost(self, device: str, reason: str) -> None:
        """``device``'s sessions are gone (its worker process died): down at once."""
        self._device(device).go_down(reason)

    async def restored(self, device: str) -> None:
        """``device``'s sessions are back (a new worker process): warm it up on its thread
        (:func:`warmup.warm_up`, capturing its CUDA graphs again), then up. Raises what the
        warm-up raised (the device stays down; its probe tries again after the cool-down)."""
        dev = self._device(device)
        await warmup.warm_up(dev, self.contract)
        dev.count_success()

    async def warm_up(self) -> None:
        """Warm every device up on its own worker thread, one device after another, before
        serving (:func:`warmup.warm_up`). Raises what a run raised (nothing is counted: the
        node stops)."""
        for dev in self._devices.values():
            await warmup.warm_up(dev, self.contract)

    def close(self) -> None:
        for dev in self._devices.values():
            dev.put(None)
        for dev in self._devices.values():
            if dev.thread is not None:
                dev.thread.join(timeout=30)


def _held_done(table: EpisodeTable, episode: str, future: asyncio.Future[Any]) -> None:
    """A step held for its caller's retry ended: it no longer counts as in flight."""
    if not future.cancelled():
        future.exception()  # retrieved: nobody else awaits it
    table.leave(episode)
