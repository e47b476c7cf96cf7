"""How late the node's event loop runs what is due: ``affinity_event_loop_lag_seconds``.

Every request the node serves passes through one asyncio loop (its doors, the router, the
owner's bookkeeping; model runs are on the devices' threads). When that loop is saturated,
every step waits for it before its device even sees it, and no per-device metric shows why.
A timer due every :data:`EVERY_S` measures how late it fires, the way Node.js'
``monitorEventLoopDelay`` and uvloop-based servers do: an idle loop fires within its timer
resolution (≲ 1 ms), a loop busy with N ready callbacks fires after all of them, and a
callback that blocks (a slow synchronous call) shows up as one long lag. Sampling at 50 Hz
costs ~50 loop turns a second, nothing per step.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["EVERY_S", "watch_loop_lag"]

EVERY_S = 0.02
"""How often the loop's lateness is sampled (seconds)."""


class Observer(Protocol):
    def observe(self, value: float) -> None: ...


async def watch_loop_lag(into: Observer, every_s: float = EVERY_S) -> None:
    """Observe into ``into``, every ``every_s``, how many seconds after its due time a timer
    of this loop fired; runs until cancelled."""
    clock = time.perf_counter
    while True:
        due = clock() + every_s
        await asyncio.sleep(every_s)
        into.observe(max(0.0, clock() - due))
