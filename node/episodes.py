"""What the owner remembers about its episodes, and the rule that decides a step.

One node-wide :class:`EpisodeTable` holds :class:`~node.record.Episode` records. An
episode has a record in at most one model. :func:`admit` is the rule that decides a step
against its record.

Why this is hard: steps run on device threads while the event loop ends, releases,
expires and drops records. A step reads its record when its run starts. It keeps its
result only if three things hold when it finishes. The record is still the one it read.
Its claim was not ended meanwhile. No drop (a fence, a new registration) happened since
the step began (:attr:`EpisodeTable.generation`). A claim whose record left the table is
remembered as ended (bounded). So a step of it still queued never re-creates the record.
An episode whose record this node dropped without its client ending it is remembered too.
So the next claim of it here says ``state_reset``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Literal, TypeVar

import numpy as np

from node.errors import ClaimEnded, ForwardCancelled, SeqConflict
from node.record import (
    Apply,
    Episode,
    Replay,
    StepResult,
    Verdict,
    advance,
    is_hosted,
    same_inputs,
    undone,
)
from node.rtc import LATENCY_WINDOW

__all__ = [
    "REMEMBERED",
    "Apply",
    "Episode",
    "EpisodeTable",
    "Replay",
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

ENDED_EARLY_S = 120.0
"""How long a claim released before its first record existed here stays refused. Its
first step reaches its device within that step's deadline (seconds), far below this."""

DropReason = Literal["end", "idle", "lost", "revoked", "fenced", "registered", "handed"]
"""Why a record left the table. ``end`` (the client ended or restarted the episode) is the
only one after which the episode's next claim here starts clean without ``state_reset``."""


def _gone(record: Episode) -> bool:
    """Whether ``record``'s state was held by a device's worker process that has died since
    (``node.deviceprocs.RemoteState.stale``): a step that read the record just before its
    node dropped the device's records kept it as the process died."""
    return any(getattr(v, "stale", False) for v in record.state.values())


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

    A step of the record's claim applies on it when it names no ``seq`` or the next one.
    When the record is in doubt it applies from the initial state, said: ``state_reset``
    always means the state started over. It replays the stored reply when it names the one
    applied with the same inputs (``asked``). Any other ``seq`` raises :class:`SeqConflict`.
    Any other step starts clean: a fresh claim, or one Redis confirmed that this node does
    not hold. It says ``state_reset`` unless it is the claim's first step (``seq`` 1, or no
    ``seq`` and a fresh claim) of an episode this node did not drop (``dropped``). A step of
    another claim than the record's that is not fresh and older (a smaller token) raises
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


_V = TypeVar("_V")


class _Bounded(OrderedDict[str, _V]):
    """Keys remembered with a value up to :data:`REMEMBERED`, the oldest forgotten first."""

    def remember(self, key: str, value: _V) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > REMEMBERED:
            self.popitem(last=False)


class EpisodeTable:
    """The owner's memory, node-wide (see the module doc).

    The records and what the table remembers are guarded by :attr:`lock`. The device
    threads and the event loop take it. Methods ending in ``_locked`` expect it held. The
    in-flight counts (:meth:`enter`, :meth:`leave`, :meth:`wait_idle`) are the event
    loop's only."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.generation = 0
        """Bumped by :meth:`drop_all`: a step that began before keeps nothing."""
        self._records: dict[str, Episode] = {}
        # episode -> a copy a hand-over installed, unconfirmed: not a record (never served,
        # slid, re-asserted, handed on or ended) until proof that Redis moved the claim
        self._copies: dict[str, Episode] = {}
        self._live: dict[str, set[str]] = {}  # device -> episodes with a record on it
        self._ended: _Bounded[str] = _Bounded()  # claim ids whose record left the table
        # "<episode> <token>" released before any record of its claim existed here (its
        # claim id unknown): the claim's first step may still be in flight, or not yet
        # arrived (claimed in Redis, its step on its way), until this clock time
        self._ended_early: dict[str, float] = {}
        # episode -> why: dropped here, not ended by its client
        self._dropped: _Bounded[str] = _Bounded()
        # forwards whose router gave up before they applied
        self._cancelled: _Bounded[str] = _Bounded()
        self._applied: _Bounded[str] = _Bounded()  # forwards applied here: origin -> episode
        self._in_flight: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self._moving: dict[str, asyncio.Event] = {}  # episodes being handed over (loop only)
        # episode -> where its record went (URL, device, token): late undos follow it
        self._moved: _Bounded[tuple[str, str, int]] = _Bounded()

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
            if record is None:
                return None
            state = dict(record.state)
        # (np.array: a state on the device, --cuda-graph, or in a device's worker process,
        # is read back; the latter is a round trip: not from the event loop)
        return {k: np.array(v, copy=True) for k, v in state.items()}

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
        if (claim and claim in self._ended) or self._ended_early_locked(episode, token):
            raise ClaimEnded(episode, claim)
        record = self._records.get(episode)
        if record is not None and _gone(record):  # its state died with a worker process
            self._forget_locked(episode, record, "lost", ended=False)
            record = None
        copy = self._copies.get(episode)
        if copy is not None and not fresh and copy.holds(device, token, claim):
            record = self._promote_locked(episode, copy)  # Redis routed its claim here
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
        if (new.claim and new.claim in self._ended) or self._ended_early_locked(episode, new.token):
            return False
        if read is not None and read.claim != new.claim:
            self._ended.remember(read.claim, "")
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

    def install(self, episode: str, record: Episode, *, beside: bool = False) -> bool:
        """Hold a copy a hand-over brought (unconfirmed: see :attr:`Episode.confirmed`),
        apart from the records: it replaces only another copy (whose reservation the new
        one's replaced in Redis: it can never be committed). ``beside``: a move between two
        devices of this node, whose live record stays until the commit. Else a live record
        held here refuses it: False, nothing changed."""
        with self.lock:
            if episode in self._records and not beside:
                return False
            record.confirmed = False
            self._copies[episode] = record
            if record.origin:  # an undo of the forward that applied its last step follows it
                self._applied.remember(record.origin, episode)
            return True

    def confirm(self, episode: str, claim: str) -> bool:
        """Redis moved the claim here (the old owner said so, or Redis answered the new
        owner's settle): the copy becomes the record, served from memory."""
        with self.lock:
            copy = self._copies.get(episode)
            if copy is not None and copy.claim == claim:
                self._promote_locked(episode, copy)
                return True
            record = self._records.get(episode)
            return record is not None and record.claim == claim

    def _promote_locked(self, episode: str, copy: Episode) -> Episode:
        del self._copies[episode]
        old = self._records.get(episode)
        if old is not None:  # the claim it moved from (a move between devices of this node)
            self._forget_locked(episode, old, "handed")
        copy.confirmed = True
        self._records[episode] = copy
        self._live.setdefault(copy.device, set()).add(episode)
        self._dropped.pop(episode, None)
        return copy

    def drop_copy(self, episode: str, claim: str) -> bool:
        """Drop the copy of ``episode`` for ``claim`` (its commit can never happen now);
        nothing is remembered as ended: it never was a claim here."""
        with self.lock:
            copy = self._copies.get(episode)
            if copy is None or copy.claim != claim:
                return False
            del self._copies[episode]
            return True

    def copy_of(self, episode: str) -> Episode | None:
        """The unconfirmed copy of ``episode`` held here, if any."""
        with self.lock:
            return self._copies.get(episode)

    def copies(self) -> list[tuple[str, Episode]]:
        """The unconfirmed copies held here (installed by a hand-over, not yet committed)."""
        with self.lock:
            return list(self._copies.items())

    def owned(self) -> list[tuple[str, Episode]]:
        """The records held here: this node's (a copy is not one)."""
        with self.lock:
            return list(self._records.items())

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
        self._moved.pop(episode, None)  # where an earlier move took it: no longer there
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
            if record is None and token is not None:
                self._end_early_locked(f"{episode} {token}")
            if record is None or (token is not None and record.token != token):
                return None
            self._forget_locked(episode, record, reason)
            return record

    def _end_early_locked(self, key: str) -> None:
        # Why: a router claims in Redis, then sends the claim's first step here. An end
        # that reads Redis in between finds no record to drop; the step must keep none.
        now = self.clock()
        self._ended_early.pop(key, None)
        self._ended_early[key] = now + ENDED_EARLY_S
        while self._ended_early:  # oldest first: all share one horizon
            first = next(iter(self._ended_early))
            if self._ended_early[first] > now and len(self._ended_early) <= REMEMBERED:
                break
            del self._ended_early[first]

    def _ended_early_locked(self, episode: str, token: int) -> bool:
        if not self._ended_early:  # the usual case: no key to build (every step asks)
            return False
        until = self._ended_early.get(f"{episode} {token}")
        return until is not None and until > self.clock()

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
            # the copies too: a commit that lands later finds no record here, and the
            # claim's next step here says state_reset
            self._copies.clear()
            self.generation += 1
            return len(records)

    def drop_device(self, device: str, reason: DropReason) -> int:
        """Drop the records of ``device``'s episodes whose state its worker process held
        (it died with them): each one's next step here starts clean and says
        ``state_reset``; the claims stand (Redis moves them while the device is down). A
        record whose state is host arrays (a hand-over's, not stepped here yet) stays.
        Returns how many."""
        with self.lock:
            dropped = [
                (ep, record)
                for ep, record in self._records.items()
                if record.device == device and not is_hosted(record)
            ]
            for ep, record in dropped:
                self._forget_locked(ep, record, reason, ended=False)
            return len(dropped)

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

    def undo(
        self, episode: str, seq: int | None = None, origin: str | None = None, doubt: bool = False
    ) -> bool:
        """Undo step ``seq`` of ``episode`` (or the step forward ``origin`` applied), whose
        reply did not reach a live caller, or may have (``doubt``: see :func:`undone`). A
        forward may be applied with later steps on top: its router was paused while the
        client went on through another node. That leaves the record in doubt: the next step
        says ``state_reset``. A forward not applied yet is remembered as given up: it never
        applies. True when something changed."""
        with self.lock:
            record = self._records.get(episode)
            held = self._records
            copy = self._copies.get(episode)
            if copy is not None and record is None:  # it followed the record's move here
                record, held = copy, self._copies
            back = None if record is None else undone(record, seq, origin, doubt)
            if back is not None:
                held[episode] = back
                if record is not None and record.origin and back is not record:
                    self._applied.pop(record.origin, None)  # no longer applied
            elif origin and record is not None and self._applied.get(origin) == episode:
                if record.origin != origin:  # applied, and later steps went on top of it
                    record.doubt = True  # (its reply reached nobody): the next step says so
                    return True
            elif origin and (record is None or record.origin != origin):
                self._cancelled.remember(origin, "")
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
        idle = self._idle.pop(episode, None)
        if idle is not None:
            idle.set()

    def in_flight(self, episode: str) -> bool:
        """True while a step of ``episode`` is queued or running and counts."""
        return episode in self._in_flight

    def stepping_episodes(self) -> list[str]:
        """The episodes a step of which is queued or running and counts."""
        return list(self._in_flight)

    def stepping(self) -> bool:
        """True while a step of any episode is queued or running and counts."""
        return bool(self._in_flight)

    async def wait_idle(self, episode: str) -> None:
        """Return once no step of ``episode`` is in flight; after that its record changes
        only through a new step. Unbounded: bound it with a timeout."""
        while episode in self._in_flight:
            idle = self._idle.get(episode)
            if idle is None:
                idle = self._idle[episode] = asyncio.Event()
            await idle.wait()
