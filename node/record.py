"""One episode's record (:class:`Episode`), a step's result and verdict, and the pure rules
that advance and undo a record. A module of its own because these rules need no table,
lock or clock: they are tested alone and the hand-over ships the same records.

Hazard: records are shared with device threads. Change them only as :func:`advance` and
:func:`undone` do, holding the table's lock (``node/episodes.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from node.chunks import ActionBuffer
from node.rtc import Used

__all__ = [
    "Apply",
    "Episode",
    "Replay",
    "StepResult",
    "Verdict",
    "advance",
    "is_hosted",
    "same_inputs",
    "undone",
]

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
    queue_s: float = 0.0  # its wait for its device before the model run (seconds)
    run_s: float = 0.0  # the model run it was part of (seconds; 0: no run)


@dataclass(slots=True)
class Episode:
    """What the owner remembers about one episode (see the module doc). Records are not
    changed once current, with three exceptions. The one a step replaces loses its
    ``previous``. A step's latency is added once its reply is on its way. And
    ``pinned``/``doubt``."""

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
    """False for a copy a hand-over installed before Redis moved the claim here, held
    apart from the records (``EpisodeTable.copy_of``): never served from memory until a
    step Redis routed here, the old owner or the new owner's settle confirms it."""

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


def is_hosted(record: Episode) -> bool:
    """Whether ``record``'s state is host arrays (the usual case): not kept on a device
    (``--cuda-graph``) nor by a device's worker process (``--device-workers process``)."""
    return all(isinstance(v, np.ndarray) for v in record.state.values())


def same_inputs(a: Mapping[str, Array], b: Mapping[str, Array]) -> bool:
    """Whether two steps' inputs are the same request (names, shapes, dtypes, values)."""
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y):
            return False
    return True


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
    """The record after ``result`` was applied on ``base``. None: from ``initial``, the
    initial state. A reset's initial record keeps ``doubt``, so a retry after an undo
    still says ``state_reset``. ``sent``: the chunk the step sent and when (RTC models).
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


def undone(
    record: Episode, seq: int | None, origin: str | None, doubt: bool = False
) -> Episode | None:
    """The record once step ``seq`` (or the step applied by forward ``origin``) is undone.
    That is its previous record, or ``record`` marked in doubt when a later step was
    applied meanwhile (the next step says ``state_reset``). None: nothing to undo. The step
    was never applied or was undone already. Or it named its ``seq`` (held for its
    caller's retry). Or its reply was replayed to a retry, which delivered it. ``doubt``:
    whether the reply reached its client is unknown (a front died while handing it over),
    so the previous record is in doubt too: the next step starts clean and says so."""
    matches = record.seq == seq if origin is None else (origin != "" and record.origin == origin)
    if matches and (record.pinned or record.asked is not None):
        return None  # delivered by a replay, or held for the retry its seq makes safe
    if matches and record.previous is not None:
        if record.doubt or doubt:  # an earlier step could not be undone, or this one may
            record.previous.doubt = True  # have reached its client: the one before is in doubt
        return record.previous
    if matches and record.seq > 0:
        record.doubt = True  # handed over without the record before it: the next step says so
        return record
    if seq is not None and record.seq > seq and origin is None:
        record.doubt = True  # in place: steps that read this record still commit on it
        return record
    return None
