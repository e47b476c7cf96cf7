"""What the owner remembers about an episode: one :class:`Episode` record per episode.

A record holds the claim it serves (device, token and the claim id Redis issued with the
token), the number of steps applied under that claim (``seq``: 1, 2, …), the recurrent
state and the action buffer those steps left, the chunk the last model run sent and the
latest step latencies (real-time chunking, ``node/rtc.py``), the last step's result
(replayed to a retry that names the step already applied) and the record before the last
step (``previous``: restored when the last step's reply did not reach a live caller).

A step builds the next record from references (the new state is the model's output, the
previous record is the old object), so keeping the previous state and the last reply
costs no copy per step, only the memory of one more state and one more reply per
episode. Records are not changed once current, except that the one a step replaces loses
its own ``previous`` (a record's ``previous`` never has a ``previous`` of its own) and
that a step's latency is added to its record once its reply is on its way; they
are plain slotted objects because one is made on every step.

The rules here are pure functions of a record and a step; the dispatcher applies them
under its lock, in each episode's arrival order (``node/dispatcher.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from node.chunks import ActionBuffer
from node.rtc import Used

__all__ = ["Episode", "SeqConflict", "StepResult", "admit", "advance", "undone"]

Array = np.ndarray[Any, Any]


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


@dataclass(slots=True)
class Episode:
    """What the owner remembers about one episode (see the module doc)."""

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
    doubt: bool = False  # an undo came too late: the next step says state_reset
    sent: tuple[Array, float] | None = None  # RTC: the [H, D] chunk last sent, and when
    latency: tuple[float, ...] = ()  # RTC: the latest step latencies (seconds), oldest first
    pinned: bool = False  # step ``seq``'s reply was replayed to a retry: never undone

    def holds(self, device: str, token: int, claim: str) -> bool:
        """Whether this record serves the claim (device, token, claim id)."""
        return self.device == device and self.token == token and self.claim == claim


class SeqConflict(Exception):
    """A step's ``seq`` is neither the next one nor the one already applied (409); nothing
    changed. ``current`` is the last applied step's ``seq``."""

    def __init__(self, episode: str, current: int, sent: int) -> None:
        self.current = current
        super().__init__(
            f"episode {episode!r} has applied step {current}; seq {sent} is neither the "
            f"next ({current + 1}) nor the last (a retry)"
        )


Admission = tuple[Literal["apply"], "Episode | None", bool] | tuple[Literal["replay"], StepResult]


def admit(
    episode: str,
    record: Episode | None,
    device: str,
    token: int,
    claim: str,
    fresh: bool,
    seq: int | None,
) -> Admission:
    """Decide a step against the episode's record: ``("apply", base, reset)`` runs the step
    from ``base`` (None: the initial state) and says ``reset`` (its state started over);
    ``("replay", result)`` answers the stored reply of the step already applied. Raises
    :class:`SeqConflict` for any other ``seq`` of a record that serves the claim.

    A fresh claim starts clean even over a record under the same token number (a token
    re-issued after a lossy failover names a new claim). Without a record of the claim,
    the step starts clean; it is a reset unless it is the claim's first step (``seq`` 1,
    or no ``seq`` and a fresh claim)."""
    if record is not None and not fresh and record.holds(device, token, claim):
        if seq is None or seq == record.seq + 1:
            return "apply", record, record.doubt
        if seq == record.seq and record.reply is not None:
            return "replay", replace(record.reply, replayed=True)
        raise SeqConflict(episode, record.seq, seq)
    if seq is not None:
        return "apply", None, seq != 1
    return "apply", None, record is not None or not fresh


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
) -> Episode:
    """The record after ``result`` was applied on ``base`` (None: from ``initial``, the
    initial state); ``sent``: the chunk the step sent and when (RTC models), else None.
    Call it holding the lock that guards the current records: ``base``, the current
    record, loses its own ``previous``."""
    if base is None:
        assert initial is not None
        base = Episode(device, token, claim, initial, now, 0, None)
    else:
        base.previous = None
        base.doubt = False
    return Episode(device, token, claim, state, now, result.seq, buffer, result, base, origin,
                   sent=sent, latency=base.latency)  # fmt: skip


def undone(record: Episode, seq: int | None, origin: str | None) -> Episode | None:
    """The record once step ``seq`` (or the step applied by forward ``origin``) is undone:
    its previous record, or ``record`` marked in doubt when a later step was applied
    meanwhile (the next step says ``state_reset``). None: nothing to undo (the step was
    never applied, was undone already, or its reply was replayed to a retry, which
    delivered it)."""
    matches = record.seq == seq if origin is None else (origin != "" and record.origin == origin)
    if matches and record.pinned:
        return None  # a retry got its reply replayed: the step counts, whatever befell the first
    if matches and record.previous is not None:
        if record.doubt:  # an earlier step could not be undone: the one before is in doubt too
            record.previous.doubt = True
        return record.previous
    if seq is not None and record.seq > seq and origin is None:
        record.doubt = True  # in place: steps that read this record still commit on it
        return record
    return None
