"""The commit rules: how one model's step is admitted and how what its run gave is kept.

A step is admitted against its episode's record. A module of its own because it is the one
bridge between the table (``node/episodes.py``) and the device workers (``node/worker.py``).

``Records.prepare`` and ``Records.commit`` run on a device's worker thread, or on the event
loop's for an inline run. Both take the job's lock, then the table's, in that order.
Hazard: a run is kept only if its record is still the one it read and its claim did not
end. And no drop may have happened since the step began. Otherwise its caller gets no
result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from node import control
from node.chunks import ActionBuffer, ChunkMode, ChunkSpec
from node.contract import PolicyContract
from node.episodes import EpisodeTable
from node.errors import ClaimEnded, ForwardCancelled, NotKept, SeqConflict
from node.jobs import Job, Member
from node.record import Apply, Episode, StepResult, Verdict, advance
from node.recorder import Recorder
from node.rtc import Ask, RtcSpec, Used
from node.worker import DeviceWorker

__all__ = ["Records", "StepJob", "StepMember"]

Array = np.ndarray[Any, Any]


@dataclass(eq=False, kw_only=True)
class StepJob(Job):
    """A step of the episode ``key`` (or a stateless run, ``key`` None) and what it shares
    with its caller, under ``lock``, to agree on whether its state is kept."""

    token: int = 0
    claim: str = ""
    fresh: bool = True
    seq: int | None = None  # the seq the caller expects to be applied (None: not sent)
    origin: str = ""  # the forward it came in (""; not forwarded)
    mode: ChunkMode | None = None
    rtc: Ask | None = None  # real-time chunking: what the step says (RTC models only)
    arrived: float = 0.0  # the dispatcher's clock when the step arrived at the node
    generation: int = 0  # the table's generation when the step began (a drop since: not kept)
    asked: Mapping[str, Array] | None = None  # its inputs when it named its seq (see admit)
    committed: int = 0  # the seq it applied (0: none yet)


@dataclass(eq=False)
class StepMember(Member):
    """A step taken into a model run, with what it read of its episode's record."""

    job: StepJob
    read: Episode | None  # the record it read (kept over only if still current)
    base: Episode | None  # the record it runs on (None: the initial state)
    reset: bool
    rtc: Used | None = None  # real-time chunking: what the step runs with


class Records:
    """One model's side of the episode table, under its lock. A step's admission: a replay,
    an action from its buffer, or the feed of its run. And the keeping of what a run gave.
    ``prepare`` and ``commit`` run on a device's worker thread, or on the event loop's for
    an inline run."""

    def __init__(
        self,
        table: EpisodeTable,
        contract: PolicyContract,
        chunk: ChunkSpec | None,
        rtc: RtcSpec | None,
        control_hz: float | None,
        clock: Callable[[], float],
        model: str,
        recorder: Recorder | None = None,
    ) -> None:
        self.table = table
        self.contract = contract
        self.chunk = chunk
        self.rtc = rtc
        self.control_hz = control_hz
        self.clock = clock
        self.model = model
        self._fed_back = set(contract.state.values())
        self.recorder = recorder  # --record: kept steps go to it (node/recorder.py)

    def answer_at_once(
        self,
        device: str,
        episode: str,
        token: int,
        claim: str,
        fresh: bool,
        seq: int | None,
        origin: str,
        mode: ChunkMode | None,
        asked: Mapping[str, Array] | None,
    ) -> StepResult | None:
        """Admit a step and answer it if :func:`admit`'s verdict holds the answer already,
        without a worker (see :meth:`answer_locked`); None: the step needs a run."""
        with self.table.lock:
            _, verdict = self.table.admit_locked(
                episode, device, token, claim, fresh, seq, origin, asked
            )
            return self.answer_locked(device, episode, verdict, mode, origin, asked)

    def answer_locked(
        self,
        device: str,
        episode: str,
        verdict: Verdict,
        mode: ChunkMode | None,
        origin: str,
        asked: Mapping[str, Array] | None,
    ) -> StepResult | None:
        """The answer :func:`admit`'s ``verdict`` holds already (a replay, or an action from
        the buffer of the record it chose), or None: the step needs a model run."""
        if not isinstance(verdict, Apply):
            self.table.pin_locked(episode)  # delivered now: never undone
            return verdict.result
        if mode is None or verdict.base is None:
            return None
        return self.from_buffer_locked(device, episode, verdict.base, mode, origin, asked)

    def from_buffer_locked(
        self,
        device: str,
        episode: str,
        base: Episode,
        mode: ChunkMode,
        origin: str,
        asked: Mapping[str, Array] | None,
    ) -> StepResult | None:
        """Answer the step from the buffer of ``base``, the episode's current record that
        :func:`admit` chose, or None."""
        if base.buffer is None or base.device != device:
            return None
        action = base.buffer.buffered(mode)
        if action is None:
            return None
        assert self.chunk is not None  # a buffer exists only for a model with a chunk
        outputs = {self.chunk.output: self.chunk.action(action.copy())}
        result = StepResult(outputs, base.doubt, base.seq + 1, "buffer")
        self.table.replace_locked(episode, advance(
            base, device, base.token, base.claim, base.state, base.buffer.served(), result,
            self.clock(), None, origin, base.sent, asked=asked,
        ))  # fmt: skip
        return result

    def prepare(self, dev: DeviceWorker, job: StepJob) -> StepMember | None:
        """Admit the job's step: answer it at once (a replay, or an action from its buffer)
        or say what its run feeds. None: no run."""
        episode = job.key
        result: StepResult | None = None
        error: SeqConflict | ForwardCancelled | ClaimEnded | NotKept | None = None
        table = self.table
        with job.lock, table.lock:
            if job.gave_up():
                return None
            if episode is None:
                feed = {**job.inputs, **self.contract.initial_state()}
                if self.rtc is not None:
                    feed.update(self.rtc.none())
                return StepMember(job, feed, None, None, False)
            try:
                if job.generation != table.generation:
                    raise NotKept(episode)
                st, verdict = table.admit_locked(
                    episode, dev.id, job.token, job.claim, job.fresh, job.seq, job.origin,
                    job.asked,
                )  # fmt: skip
            except (SeqConflict, ForwardCancelled, ClaimEnded, NotKept) as exc:
                error = exc
            else:
                result = self.answer_locked(
                    dev.id, episode, verdict, job.mode, job.origin, job.asked
                )
                if result is None:
                    assert isinstance(verdict, Apply)  # a replay is answered
                    feed, used = self._feed(job, verdict.base, verdict.reset)
                    return StepMember(job, feed, st, verdict.base, verdict.reset, used)
                if isinstance(verdict, Apply):  # from the buffer: undone if its caller leaves
                    job.committed = result.seq
        dev.answer(job.future, result, error)
        return None

    def _feed(
        self, job: StepJob, base: Episode | None, reset: bool
    ) -> tuple[dict[str, Array], Used | None]:
        """What the job's run feeds on ``base`` (None: the initial state), and the
        real-time-chunking values it runs with."""
        state = self.contract.initial_state() if base is None else base.state
        feed = {**job.inputs, **state}
        if base is None:  # the episode's first step, or its first after a reset
            control.started(feed)
        if self.rtc is None:
            return feed, None
        assert job.rtc is not None  # step() gives every job of an RTC model one
        sent = None if base is None or reset else base.sent
        latency = () if base is None else base.latency
        rtc_feed, used = self.rtc.feed(sent, job.rtc, job.arrived, latency, self.control_hz)
        feed.update(rtc_feed)
        return feed, used

    def commit(self, dev: DeviceWorker, m: StepMember, outputs: dict[str, Array]) -> None:
        """Keep the member's new state (if its caller still waits) and answer it."""
        job = m.job
        buffer: ActionBuffer | None = None
        if job.mode is None:
            visible = {k: v for k, v in outputs.items() if k not in self._fed_back}
        else:
            assert self.chunk is not None  # a mode exists only for a model with a chunk
            chunk = self.chunk.chunk_of(outputs[self.chunk.output])
            old = None if m.base is None else m.base.buffer
            buffer, action = (old or ActionBuffer()).after_run(chunk, job.mode)
            visible = {self.chunk.output: self.chunk.action(action)}
        # a step from the initial state is step 1, or the seq its caller named (its first
        # after a reset): a retry of it after its reply was lost is then its replay
        seq = (job.seq or 1) if m.base is None else m.base.seq + 1
        result = StepResult(visible, m.reset, seq, "model", rtc=m.rtc, queue_s=job.queue_s,
                            run_s=job.run_s)  # fmt: skip
        episode = job.key
        if episode is not None:
            new_state = {name: outputs[out] for name, out in self.contract.state.items()}
            now = self.clock()
            sent = None
            if self.rtc is not None:
                assert self.chunk is not None  # an RTC model has a chunk (checked at load)
                sent = (self.chunk.chunk_of(outputs[self.chunk.output]), now)
            table = self.table
            with job.lock, table.lock:
                # keep nothing for a caller that gave up (its router, for a forward whose
                # undo came while it ran), after a drop meanwhile, or when the record it
                # read was released or replaced meanwhile; and then answer no result
                if table.cancelled_locked(job.origin):
                    dev.answer(job.future, None, ForwardCancelled(job.origin))
                    return
                if job.gave_up():
                    return
                new = advance(
                    m.base, dev.id, job.token, job.claim, new_state, buffer, result, now,
                    None if m.base else {n: m.feed[n] for n in self.contract.state},
                    job.origin, sent, model=self.model, asked=job.asked,
                )  # fmt: skip
                if not table.keep_locked(episode, m.read, job.generation, new):
                    lost = job.generation != table.generation
                    why = NotKept(episode) if lost else ClaimEnded(episode, job.claim)
                    dev.answer(job.future, None, why)
                    return
                job.committed = seq
            if self.recorder is not None:  # a reference handed over: no copy, no wait
                self.recorder.offer(self.model, dev.id, episode, job.claim, job.token, seq,
                                    m.reset, job.inputs, visible)  # fmt: skip
        dev.answer(job.future, result, None)
