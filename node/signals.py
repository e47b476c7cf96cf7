"""The fleet's autoscaling signals, as every node exports them.

They say how full the devices that may take a new episode of each model version are
(``affinity_fleet_saturation``, ``affinity_fleet_live_episodes``,
``affinity_fleet_capacity``).

A fleet-level figure must not come in N different copies from N nodes. Each node exports
the one view of the fleet that Redis holds (``Inventory.fleet_view``). One node a period
(whichever asks first) reads the devices and writes the result. Every node exports what
was written. So all nodes show the same value (at most one period apart), and a query takes
``max()`` of them. No node holds a role: when the reader of a period dies, the next period
has another one. A view older than three periods (Redis unreachable, no reader) is not
exported at all. A failed read keeps the last view until then. The series disappear, so a
scaler sees no answer rather than a stale one.
Model versions no live node serves any more disappear too; the label values are the
``name@version`` the fleet's nodes registered.

Every node's own figures are not here. Its admission backlog
(``affinity_admission_waiting``) and the claims it refused for capacity
(``affinity_routing_total{result="full"}``) are distinct on each node. A query sums them
(``docs/metrics.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from affinity import AffinityError, Inventory
from affinity.inventory import FleetView
from node.metrics import Metrics

__all__ = ["FleetSignals"]

log = logging.getLogger("affinity.node")


class FleetSignals:
    """Export the fleet's view every ``every_s`` seconds (see the module doc)."""

    def __init__(
        self,
        node_id: str,
        inventory: Inventory,
        metrics: Metrics,
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.clock = clock
        self.inventory = inventory
        self.metrics = metrics
        self.every_s = every_s
        self.view: FleetView | None = None
        self._kept_until = float("-inf")  # the last view is exported until then at most
        self._exported: set[str] = set()  # the model versions with fleet series now
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="affinity-fleet-signals")

    async def stop(self) -> None:
        """End the loop. The event ends it even when a cancellation landing in a Redis call
        is swallowed (redis-py on Python 3.11, gh-86296: see ``affinity.scripts.bounded``)."""
        if self._task is not None:
            self._stopping.set()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.every_s)

    async def refresh(self) -> None:
        """Read the fleet's view (one node of the fleet reads the devices each period) and
        export it; a view that cannot be had is not exported."""
        try:
            view = await self.inventory.fleet_view(self.node_id, round(self.every_s * 1000))
        except AffinityError as exc:
            log.debug("fleet view of node %s: %s", self.node_id, exc)
            if self.clock() < self._kept_until:
                return  # the last view stands for now
            view = None
        if view is not None:
            # as old as Redis says, kept until three periods old by this node's clock
            age_s = (view.now_ms - view.at_ms) / 1000
            self._kept_until = self.clock() + 3 * self.every_s - age_s
        self.export(view)

    def export(self, view: FleetView | None) -> None:
        """Set the fleet gauges to ``view``; None takes every fleet series out."""
        self.view = view
        models = {m.model: m for m in view.models} if view is not None else {}
        gauges = (self.metrics.fleet_saturation, self.metrics.fleet_live,
                  self.metrics.fleet_capacity)  # fmt: skip
        for model in self._exported - set(models):
            for gauge in gauges:
                gauge.remove(model)
        for m in models.values():
            self.metrics.fleet_saturation.labels(m.model).set(m.saturation)
            self.metrics.fleet_live.labels(m.model).set(m.live)
            self.metrics.fleet_capacity.labels(m.model).set(m.capacity)
        self._exported = set(models)
