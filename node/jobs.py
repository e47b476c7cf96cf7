"""What a device worker is handed: its session, its runs' jobs, the steps on their way.

The session is the one it runs. The jobs and members make up its runs. :class:`Arrivals`
is the node's count of steps on their way; :func:`together` counts the rows of one message
as one until each is on its own way. A module of its own so the dispatcher, the
commit rules and the worker share these types without the worker's code.

Hazard: a job is shared by its caller's event loop and the worker's thread. Read or change
what they share only under ``Job.lock``; ``Arrivals.count`` is changed by the loop only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

__all__ = ["Arrival", "Arrivals", "Job", "Member", "Run", "Session", "together"]

Array = np.ndarray[Any, Any]
T = TypeVar("T")


class Session(Protocol):
    """What a worker needs of a model session (``onnxruntime.InferenceSession``).

    A session may also have ``batch_sizes``, a tuple of the batch sizes it runs best (e.g.
    one captured CUDA graph each): batched runs are then padded to the smallest of them
    that fits, and no run is larger than the largest. A step whose client sent several
    rows runs alone, unpadded.
    """

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[Any]:
        """Run the model; return the outputs in ``output_names`` order."""


class Arrivals:
    """How many steps are on their way through the node (being resolved or checked), for
    every dispatcher of the node. While any is, a device holding a waiting step may wait up
    to ``batch_delay`` for others to join its run. Event loop only (workers read it)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def arrival(self) -> Arrival:
        """Count one step until its ``done()``: the node opens one when a request arrives
        and closes it as the step is handed to a device (or leaves the node)."""
        return Arrival(self)


class Arrival:
    """One step on its way through the node (:meth:`Arrivals.arrival`)."""

    __slots__ = ("_arrivals", "_open")

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals = arrivals
        self._open = True
        arrivals.count += 1

    def done(self) -> None:
        """The step reached a device, left the node or failed; idempotent."""
        if self._open:
            self._open = False
            self._arrivals.count -= 1


async def together(
    arrivals: Arrivals, work: Iterable[Awaitable[T]], *, batch: bool = True
) -> list[T]:
    """Await ``work`` concurrently (the rows of one message), counted as one arrival
    (:class:`Arrivals`) until each has taken its first step. So each row opens its own
    arrival before the message's closes, and a device's worker waits for the message's
    other rows (its batch window) instead of running the first alone, inline, while the
    next is still on its way. ``batch`` False (fewer than two rows served here): no
    arrival, so a lone row still runs inline where it would alone. A cancellation cancels
    them all and returns when they have ended."""
    arrival = arrivals.arrival() if batch else None
    gathered = asyncio.gather(*work)  # each a task, scheduled in order
    try:
        await asyncio.sleep(0)  # every task's first step runs before this one's next
    except asyncio.CancelledError:
        gathered.cancel()
        await asyncio.wait([gathered])
        raise
    finally:
        if arrival is not None:
            arrival.done()
    return await gathered


@dataclass
class Run:
    """One model run in progress; a run that outlives its steps' deadlines counts once."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    active: bool = True
    hang_counted: bool = False


@dataclass(eq=False)
class Job:
    """A step for a model run and the future its caller awaits. ``lock`` guards what the
    caller and the worker share (``abandoned``, ``run``, and what the owner adds)."""

    key: str | None  # one key: one job per run, in arrival order (None: always distinct)
    inputs: dict[str, Array]
    future: asyncio.Future[Any]
    one_row: bool  # every input has a first dimension of 1: it may join a batch
    enqueued: float = field(default_factory=time.perf_counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    run: Run | None = None  # the model run it is part of, while that runs
    queue_s: float = 0.0  # from being queued to its run (worker thread)
    run_s: float = 0.0  # its model run (worker thread)

    def gave_up(self) -> bool:
        # Task.cancel() cancels the awaited future at once but runs the caller's handler
        # (which sets `abandoned`) later; a plain read of the future's state (atomic under
        # the GIL) closes that gap for the worker.
        return self.abandoned or self.future.cancelled()


@dataclass(eq=False)
class Member:
    """A job taken into a model run, with the feed it runs with."""

    job: Job
    feed: dict[str, Array]
