"""A bounded backlog for new episodes that find every device full (``--admission-wait``).

Triton's sequence batcher holds a new sequence in a backlog until a slot frees. Without one,
a new episode beyond the fleet's capacity gets an immediate 503. With ``--admission-wait
SECONDS``, a claim that answers ``full`` waits here instead. ``full`` means nodes alive,
every device at capacity, draining or down. First come, first served: at most
:data:`LIMIT` waiting on one node. Each waits at most ``wait_s``, and never past its step's
deadline. Then 503 ``full`` with ``Retry-After``, as without a backlog.

Only the head of the line asks Redis again (every :data:`POLL_S`, doubling up to
:data:`MAX_POLL_S`). A slot may free on any node of the fleet, and the claim is the one
authority on whether it did. The others wait for their turn without a Redis command. Only a
claim waits. A running episode's step never reaches the backlog: its resolve is a hit, or
the owner serves it from memory. So running episodes are never delayed by it. The order is
per entry node. A new episode that arrives at another node while this one's line waits may
take a freed slot first. One that arrives here in the instant a slot frees may take it
before the head asks again. The claim itself comes first; the line only orders the retries.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from affinity import NoCapacity

__all__ = ["LIMIT", "MAX_POLL_S", "POLL_S", "Admission"]

LIMIT = 1024
"""New episodes one node holds in its backlog at once; past it, 503 at once."""
POLL_S = 0.02
MAX_POLL_S = 0.25

T = TypeVar("T")


class Admission:
    """The backlog of one node. ``wait_s`` > 0 is how long a new episode may wait;
    ``clock`` is monotonic seconds (the deadline it is compared with uses the same).
    ``affinity_admission_waiting`` shows the line's length (``on_waiting``)."""

    def __init__(
        self,
        wait_s: float,
        *,
        limit: int = LIMIT,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
        on_waiting: Callable[[int], None] | None = None,
    ) -> None:
        if not wait_s > 0:
            raise ValueError(f"admission wait {wait_s}: must be > 0 seconds")
        self.wait_s = wait_s
        self.limit = limit
        self.clock = clock
        self.poll_s = poll_s
        self.on_waiting = on_waiting
        """Called with the line's length whenever it changes (a gauge's ``set``)."""
        self._line: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """New episodes in the backlog now."""
        return len(self._line)

    async def wait(self, episode: str, claim: Callable[[], Awaitable[T]], deadline: float) -> T:
        """Retry ``claim`` in the backlog's order; it raises :class:`NoCapacity` while every
        device is full. Retry until it succeeds, ``wait_s`` has passed or ``deadline`` (on
        ``clock``) comes; then raise the last ``NoCapacity``. A full backlog raises at once. Any
        other error of ``claim`` passes through."""
        if len(self._line) >= self.limit:
            raise NoCapacity(episode)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        self._changed()
        if self._line[0] is turn:
            turn.set_result(None)
        # Time is checked, not enforced by cancelling: a claim must never be interrupted
        # half-way (a cancellation inside the Redis client may be absorbed by its retries).
        end = min(self.clock() + self.wait_s, deadline)
        try:
            if not turn.done():
                await asyncio.wait({turn}, timeout=max(0.0, end - self.clock()))
            if not turn.done():
                raise NoCapacity(episode)
            poll = self.poll_s
            while True:
                try:
                    return await claim()
                except NoCapacity as exc:
                    if exc.reason != "at_capacity":
                        raise
                left = end - self.clock()
                if left <= 0:
                    raise NoCapacity(episode)
                await asyncio.sleep(min(poll, left))
                poll = min(poll * 2, MAX_POLL_S)
        finally:
            self._line.remove(turn)
            self._changed()
            if self._line and not self._line[0].done():
                self._line[0].set_result(None)

    def _changed(self) -> None:
        if self.on_waiting is not None:
            self.on_waiting(len(self._line))
