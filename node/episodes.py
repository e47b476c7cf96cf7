"""What the owner remembers about its episodes: one :class:`Episode` record per episode, in
one node-wide :class:`EpisodeTable` (an episode has a record in at most one model).

A record holds the claim it serves (device, token, the claim id Redis issued with the
token, the model ``name@version``), the number of steps applied under that claim
(``seq``), the recurrent state and action buffer those steps left, the chunk and
latencies real-time chunking reads, the last step's reply (replayed to a retry) and the
record before the last step (``previous``: restored when that step is undone).

Why this is hard: steps run on device threads while the event loop ends, releases,
expires and drops records. A step reads its record when its run starts and keeps its
result only if, when it finishes, the record is still the one it read, its claim was not
ended meanwhile, and no drop (a fence, a new registration) happened since the step began
(:attr:`EpisodeTable.generation`). A claim whose record left the table is remembered as
ended (bounded), so a step of it still queued never re-creates the record; an episode
whose record this node dropped without its client ending it is remembered too, so the
next claim of it here says ``state_reset``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from node.chunks import ActionBuffer
from node.errors import ClaimEnded, ForwardCancelled, NotKept, SeqConflict
from node.rtc import LATENCY_WINDOW, Used

__all__ = [
    "REMEMBERED",
    "Apply",
    "ClaimEnded",
    "Episode",
    "EpisodeTable",
    "ForwardCancelled",
    "NotKept",
    "Replay",
    "SeqConflict",
    "StepResult",
    "Verdict",
    "admit",
    "advance",
    "undone",
]

Array = np.ndarray[Any, Any]

REMEMBERED = 65_536
"""How many ended claims, dropped episodes and given-up forwards the table remembers each
(the oldest is forgotten first)."""

DropReason = Literal["end", "idle", "lost", "revoked", "fenced", "registered", "handed"]
"""Why a record left the table. ``end`` (the client ended or restarted the episode) is the
only one after which the episode's next claim here starts clean without ``state_reset``."""


@dataclass(frozen=True, slots=True)
class StepResult:
    outputs: dict[str, Array]
    """Every model output not fed back as state; with chunk execution, only the chunk
    output, holding this step's one action (see :mod:`node.chunks`)."""
    state_reset: bool
    seq: int  # the step's number under its claim: 1, 2, … (the owner's count)
    source: Literal["model", "buffer"] = "model"  # "buffer": answered without a model run
    replayed: bool = False  # the stored reply of a step already applied (no model run)
    rtc: Used | None = None  # real-time chunking: what the step ran with (node/rtc.py)
    queue_s: float = 0.0  # its wait for its device before the model run (seconds)
    run_s: float = 0.0  # the model run it was part of (seconds; 0: no run)


@dataclass(slots=True)
class Episode:
    """What the owner remembers about one episode (see the module doc). Records are not
    changed once current, except that the one a step replaces loses its ``previous``, a
    step's latency is added once its reply is on its way, and ``pinned``/``doubt``."""

    device: str
    token: int
    claim: str  # the claim id Redis issued with the token ("" from an older fleet)
    state: dict[str, Array]
    last_used: float
    seq: int  # steps applied under this claim; 0: claimed, nothing applied yet
    buffer: ActionBuffer | None  # None: chunk execution off, or nothing buffered
    reply: StepResult | None = None  # the result of step ``seq`` (None when seq is 0)
    previous: Episode | None = None  # the record before step ``seq``; restored by undo
    origin: str = ""  # the forward that applied step ``seq`` ("" when not forwarded)
    doubt: bool = (
        False  # its history is unknown (an undo came too late): the next step starts clean
    )
    sent: tuple[Array, float] | None = None  # RTC: the [H, D] chunk last sent, and when
    latency: tuple[float, ...] = ()  # RTC: the latest step latencies (seconds), oldest first
    pinned: bool = False  # step ``seq``'s reply was replayed to a retry: never undone
    model: str = ""  # "name@version" of the claim ("": a fleet without models)
    asked: Mapping[str, Array] | None = None
    """The inputs of step ``seq`` when it named its ``seq``: such a step is held for its
    caller's retry (never undone), and a retry must repeat these inputs to be replayed."""
    confirmed: bool = True
    """False for a record a hand-over installed before Redis moved the claim here: never
    served from memory until a step Redis routed here (or the old owner) confirms it."""

    def holds(self, device: str, token: int, claim: str) -> bool:
        """Whether this record serves the claim (device, token, claim id)."""
        return self.device == device and self.token == token and self.claim == claim


@dataclass(frozen=True, slots=True)
class Apply:
    """Run the step from ``base`` (None: the initial state); ``reset``: say state_reset."""

    base: Episode | None
    reset: bool


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer ``result``, the stored reply of the step already applied."""

    result: StepResult


Verdict = Apply | Replay


def same_inputs(a: Mapping[str, Array], b: Mapping[str, Array]) -> bool:
    """Whether two steps' inputs are the same request (names, shapes, dtypes, values)."""
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y):
            return False
    return True


def admit(
    episode: str,
    record: Episode | None,
    device: str,
    token: int,
    claim: str,
    fresh: bool,
    seq: int | None,
    asked: Mapping[str, Array] | None = None,
    dropped: bool = False,
) -> Verdict:
    """Decide a step against the episode's record.

    A step of the record's claim applies on it when it names no ``seq`` or the next one
    (from the initial state, said, when the record is in doubt: ``state_reset`` always
    means the state started over), and replays the stored reply when it names the one
    applied with the same inputs
    (``asked``); any other ``seq`` raises :class:`SeqConflict`. Any other step starts
    clean: a fresh claim, or one Redis confirmed that this node does not hold. It says
    ``state_reset`` unless it is the claim's first step (``seq`` 1, or no ``seq`` and a
    fresh claim) of an episode this node did not drop (``dropped``). A step of another
    claim than the record's that is not fresh and older (a smaller token) raises
    :class:`ClaimEnded`: it would replace a newer claim's record."""
    if record is not None and not fresh and record.holds(device, token, claim):
        if seq is None or seq == record.seq + 1:
            if record.doubt:  # its history is unknown (a late undo): start clean, say so
                return Apply(None, True)
            return Apply(record, False)
        if seq == record.seq and record.reply is not None:
            if (
                record.asked is not None
                and asked is not None
                and not same_inputs(record.asked, asked)
            ):
                raise SeqConflict(episode, record.seq, seq, other=True)
            return Replay(replace(record.reply, replayed=True))
        raise SeqConflict(episode, record.seq, seq)
    if record is not None and not fresh and token < record.token:
        raise ClaimEnded(episode, claim)
    if seq is not None:
        return Apply(None, seq != 1 or dropped)
    return Apply(None, record is not None or not fresh or dropped)


def advance(
    base: Episode | None,
    device: str,
    token: int,
    claim: str,
    state: dict[str, Array],
    buffer: ActionBuffer | None,
    result: StepResult,
    now: float,
    initial: dict[str, Array] | None,
    origin: str,
    sent: tuple[Array, float] | None = None,
    *,
    model: str = "",
    asked: Mapping[str, Array] | None = None,
) -> Episode:
    """The record after ``result`` was applied on ``base`` (None: from ``initial``, the
    initial state; a reset's initial record keeps ``doubt``, so a retry after an undo
    still says ``state_reset``); ``sent``: the chunk the step sent and when (RTC models).
    Call it holding the table's lock: ``base``, the current record, loses its
    ``previous``."""
    if base is None:
        assert initial is not None
        base = Episode(device, token, claim, initial, now, 0, None, doubt=result.state_reset,
                       model=model)  # fmt: skip
    else:
        base.previous = None
        base.doubt = False
    return Episode(device, token, claim, state, now, result.seq, buffer, result, base, origin,
                   sent=sent, latency=base.latency, model=model or base.model,
                   asked=asked)  # fmt: skip


def undone(record: Episode, seq: int | None, origin: str | None) -> Episode | None:
    """The record once step ``seq`` (or the step applied by forward ``origin``) is undone:
    its previous record, or ``record`` marked in doubt when a later step was applied
    meanwhile (the next step says ``state_reset``). None: nothing to undo (the step was
    never applied, was undone already, named its ``seq`` (held for its caller's retry),
    or its reply was replayed to a retry, which delivered it)."""
    matches = record.seq == seq if origin is None else (origin != "" and record.origin == origin)
    if matches and (record.pinned or record.asked is not None):
        return None  # delivered by a replay, or held for the retry its seq makes safe
    if matches and record.previous is not None:
        if record.doubt:  # an earlier step could not be undone: the one before is in doubt too
            record.previous.doubt = True
        return record.previous
    if matches and record.seq > 0:
        record.doubt = True  # handed over without the record before it: the next step says so
        return record
    if seq is not None and record.seq > seq and origin is None:
        record.doubt = True  # in place: steps that read this record still commit on it
        return record
    return None


class _Bounded(OrderedDict[str, str]):
    """Keys remembered up to :data:`REMEMBERED`, the oldest forgotten first."""

    def remember(self, key: str, value: str = "") -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > REMEMBERED:
            self.popitem(last=False)


class _BoundedTo(OrderedDict[str, tuple[str, str, int]]):
    """Episode -> (URL, device, token) of where its record went, the oldest forgotten."""

    def remember(self, key: str, value: tuple[str, str, int]) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > REMEMBERED:
            self.popitem(last=False)


class EpisodeTable:
    """The owner's memory, node-wide (see the module doc).

    The records and what the table remembers are guarded by :attr:`lock`, taken by the
    device threads and the event loop; methods ending in ``_locked`` expect it held. The
    in-flight counts (:meth:`enter`, :meth:`leave`, :meth:`wait_idle`) are the event
    loop's only."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.generation = 0
        """Bumped by :meth:`drop_all`: a step that began before keeps nothing."""
        self._records: dict[str, Episode] = {}
        self._live: dict[str, set[str]] = {}  # device -> episodes with a record on it
        self._ended = _Bounded()  # claim ids whose record left the table
        # "<episode> <token>" released while a step of it was in flight but before any
        # record of it existed (its claim id unknown here): until those steps are done
        self._ended_early: set[str] = set()
        self._dropped = _Bounded()  # episode -> why: dropped here, not ended by its client
        self._cancelled = _Bounded()  # forwards whose router gave up before they applied
        self._applied = _Bounded()  # forwards applied here: origin -> episode
        self._in_flight: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self._moving: dict[str, asyncio.Event] = {}  # episodes being handed over (loop only)
        self._moved = _BoundedTo()  # episode -> where its record went: late undos follow it

    # ---- reads -------------------------------------------------------------------------

    def get(self, episode: str) -> Episode | None:
        """The record of ``episode`` held here, if any."""
        with self.lock:
            return self._records.get(episode)

    def records(self) -> list[tuple[str, Episode]]:
        """A snapshot of every (episode, record) held here."""
        with self.lock:
            return list(self._records.items())

    def __len__(self) -> int:
        return len(self._records)

    def holds(self, episode: str, device: str, token: int, claim: str) -> bool:
        """Whether the record of ``episode`` serves this claim."""
        with self.lock:
            record = self._records.get(episode)
            return record is not None and record.holds(device, token, claim)

    def live(self, device: str) -> int:
        """How many records are on ``device``."""
        with self.lock:
            return len(self._live.get(device, ()))

    def dropped(self, episode: str) -> str | None:
        """Why this node dropped the record of ``episode`` (its next claim here says
        ``state_reset``), or None."""
        with self.lock:
            return self._dropped.get(episode)

    def state_of(self, episode: str) -> dict[str, Array] | None:
        """A copy of the recurrent state held here for ``episode``, if any."""
        with self.lock:
            record = self._records.get(episode)
            return None if record is None else {k: v.copy() for k, v in record.state.items()}

    # ---- the rules, for the dispatchers --------------------------------------------------

    def admit_locked(
        self,
        episode: str,
        device: str,
        token: int,
        claim: str,
        fresh: bool,
        seq: int | None,
        origin: str,
        asked: Mapping[str, Array] | None,
    ) -> tuple[Episode | None, Verdict]:
        """The record a step reads and the :func:`admit` verdict on it. Raises
        :class:`ForwardCancelled` (its router gave up first), :class:`ClaimEnded` (its claim
        ended here) and :class:`SeqConflict`."""
        if origin and origin in self._cancelled:
            raise ForwardCancelled(origin)
        if (claim and claim in self._ended) or f"{episode} {token}" in self._ended_early:
            raise ClaimEnded(episode, claim)
        record = self._records.get(episode)
        dropped = episode in self._dropped
        return record, admit(episode, record, device, token, claim, fresh, seq, asked, dropped)

    def keep_locked(
        self, episode: str, read: Episode | None, generation: int, new: Episode
    ) -> bool:
        """Make ``new`` the record of ``episode`` if nothing changed since the step read
        ``read`` at ``generation``: no drop, the same record, its claim not ended. A record
        of another claim it replaces is remembered as ended. False: nothing kept."""
        if generation != self.generation or self._records.get(episode) is not read:
            return False
        if (new.claim and new.claim in self._ended) or f"{episode} {new.token}" in (
            self._ended_early
        ):
            return False
        if read is not None and read.claim != new.claim:
            self._ended.remember(read.claim)
        if read is not None and read.device != new.device:
            self._live.get(read.device, set()).discard(episode)
        self._records[episode] = new
        self._live.setdefault(new.device, set()).add(episode)
        self._dropped.pop(episode, None)
        if new.origin:
            self._applied.remember(new.origin, episode)
        return True

    def replace_locked(self, episode: str, new: Episode) -> None:
        """Make ``new`` (the same claim, one step on: a buffered action) the record."""
        self._records[episode] = new
        if new.origin:
            self._applied.remember(new.origin, episode)

    def observed(self, episode: str, seq: int, seconds: float) -> None:
        """Add step ``seq``'s latency (arrival to reply) to the record, for the delay
        estimate of real-time chunking (nothing when the record moved on)."""
        with self.lock:
            record = self._records.get(episode)
            if record is not None and record.seq == seq:
                record.latency = (*record.latency[1 - LATENCY_WINDOW :], seconds)

    def pin_locked(self, episode: str) -> None:
        """The current record's reply was replayed: it is delivered, never undone."""
        self._records[episode].pinned = True

    # ---- hand-over ---------------------------------------------------------------------

    def install(self, episode: str, record: Episode) -> None:
        """Install a record a hand-over brought (unconfirmed: see :attr:`Episode.confirmed`);
        a record of another claim it replaces is remembered as ended."""
        with self.lock:
            old = self._records.get(episode)
            if old is not None:
                self._forget_locked(episode, old, "end")
            self._records[episode] = record
            self._live.setdefault(record.device, set()).add(episode)
            self._dropped.pop(episode, None)

    def confirm(self, episode: str, claim: str) -> bool:
        """Redis moved the claim here (the old owner said so): serve it from memory."""
        with self.lock:
            record = self._records.get(episode)
            if record is None or record.claim != claim:
                return False
            record.confirmed = True
            return True

    def moved(self, episode: str, token: int, to: tuple[str, str, int]) -> Episode | None:
        """The record went to ``to`` (URL, device, token): drop it here (its claim ended)
        and remember where it went, so that a late undo follows it."""
        record = self.release(episode, "handed", token)
        self._moved.remember(episode, to)
        return record

    def moved_to(self, episode: str) -> tuple[str, str, int] | None:
        return self._moved.get(episode)

    def begin_move(self, episode: str) -> bool:
        """Mark ``episode`` as being handed over (its new steps wait, :meth:`wait_moved`);
        False when a hand-over of it is under way already."""
        if episode in self._moving:
            return False
        self._moving[episode] = asyncio.Event()
        return True

    def end_move(self, episode: str) -> None:
        event = self._moving.pop(episode, None)
        if event is not None:
            event.set()

    def moving(self, episode: str) -> bool:
        return episode in self._moving

    async def wait_moved(self, episode: str) -> None:
        """Return once no hand-over of ``episode`` is under way (bound it with a timeout)."""
        event = self._moving.get(episode)
        if event is not None:
            await event.wait()

    # ---- letting go ------------------------------------------------------------------------

    def release(self, episode: str, reason: DropReason, token: int | None = None) -> Episode | None:
        """Drop the record of ``episode`` (only if it serves ``token``, when given) and
        remember its claim as ended; the dropped record, or None. With no record yet but a
        step of ``episode`` in flight (its claim's first), that step keeps nothing either."""
        with self.lock:
            record = self._records.get(episode)
            if record is None and token is not None and episode in self._in_flight:
                self._ended_early.add(f"{episode} {token}")
            if record is None or (token is not None and record.token != token):
                return None
            self._forget_locked(episode, record, reason)
            return record

    def expire_idle(self, idle_s: float) -> list[tuple[str, int]]:
        """Drop the records idle for longer than ``idle_s`` (none with a step in flight);
        their (episode, token), for the owner to release in Redis."""
        cutoff = self.clock() - idle_s
        with self.lock:
            stale = [
                (ep, record)
                for ep, record in self._records.items()
                if record.last_used < cutoff and ep not in self._in_flight
            ]
            for ep, record in stale:
                self._forget_locked(ep, record, "idle")
        return [(ep, record.token) for ep, record in stale]

    def drop_all(self, reason: DropReason) -> int:
        """Drop every record (a fence, a new registration); steps that began before keep
        nothing (the generation). The claims are not remembered as ended: Redis may confirm
        one again to the new registration, whose step then starts clean (``state_reset``).
        Returns how many."""
        with self.lock:
            records = list(self._records.items())
            for ep, record in records:
                self._forget_locked(ep, record, reason, ended=False)
            self.generation += 1
            return len(records)

    def _forget_locked(
        self, episode: str, record: Episode, reason: DropReason, *, ended: bool = True
    ) -> None:
        del self._records[episode]
        self._live.get(record.device, set()).discard(episode)
        if record.claim and ended:
            self._ended.remember(record.claim, reason)
        if reason == "end":
            self._dropped.pop(episode, None)
        else:
            self._dropped.remember(episode, reason)

    def undo(self, episode: str, seq: int | None = None, origin: str | None = None) -> bool:
        """Undo step ``seq`` of ``episode`` (or the step forward ``origin`` applied), whose
        reply did not reach a live caller (see :func:`undone`). A forward applied with
        later steps on top (its router was paused while the client went on through
        another node) leaves the record in doubt: the next step says ``state_reset``. A
        forward not applied yet is remembered as given up: it never applies. True when
        something changed."""
        with self.lock:
            record = self._records.get(episode)
            back = None if record is None else undone(record, seq, origin)
            if back is not None:
                self._records[episode] = back
                if record is not None and record.origin and back is not record:
                    self._applied.pop(record.origin, None)  # no longer applied
            elif origin and record is not None and self._applied.get(origin) == episode:
                if record.origin != origin:  # applied, and later steps went on top of it
                    record.doubt = True  # (its reply reached nobody): the next step says so
                    return True
            elif origin and (record is None or record.origin != origin):
                self._cancelled.remember(origin)
        return back is not None

    def cancelled_locked(self, origin: str) -> bool:
        """Whether forward ``origin``'s router gave up on it before it applied."""
        return bool(origin) and origin in self._cancelled

    # ---- steps in flight (event loop only) ---------------------------------------------

    def enter(self, episode: str) -> None:
        """A step of ``episode`` is on its way to a device, its caller waiting."""
        self._in_flight[episode] = self._in_flight.get(episode, 0) + 1

    def leave(self, episode: str) -> None:
        """That step ended (answered, or given up by its caller: it keeps nothing then)."""
        left = self._in_flight[episode] - 1
        if left:
            self._in_flight[episode] = left
            return
        del self._in_flight[episode]
        if self._ended_early:
            with self.lock:
                self._ended_early = {e for e in self._ended_early if e.split(" ")[0] != episode}
        idle = self._idle.pop(episode, None)
        if idle is not None:
            idle.set()

    def in_flight(self, episode: str) -> bool:
        """True while a step of ``episode`` is queued or running and counts."""
        return episode in self._in_flight

    async def wait_idle(self, episode: str) -> None:
        """Return once no step of ``episode`` is in flight; after that its record changes
        only through a new step. Unbounded: bound it with a timeout."""
        while episode in self._in_flight:
            idle = self._idle.get(episode)
            if idle is None:
                idle = self._idle[episode] = asyncio.Event()
            await idle.wait()
