"""A step without an episode: it runs where it arrives, on the next device that is up.

Nothing is claimed, kept or forwarded: no Redis command, no record. A node that does not
serve the step's model refuses it (404 ``unknown_model``).
"""

from __future__ import annotations

from collections.abc import Mapping

from node.control import control_feed
from node.dispatcher import Arrival, MultiGpuDispatcher
from node.errors import Refused, Unavailable
from node.health import DeviceHealth
from node.step import Reply, Step

__all__ = ["Stateless"]


class Stateless:
    """Run stateless steps round-robin over this node's devices that are up."""

    def __init__(
        self,
        node_id: str,
        url: str,
        dispatchers: Mapping[str, MultiGpuDispatcher],
        health: DeviceHealth,
        models: Mapping[str, str],
    ) -> None:
        self.node_id = node_id
        self.url = url
        self.dispatchers = dispatchers
        self.first_model = next(iter(dispatchers))  # a step that names none
        self.health = health
        self.models = models  # name -> "name@version" (for the replies)
        self._rr = 0

    async def run(self, step: Step, arrival: Arrival) -> Reply:
        name = step.model or self.first_model
        dispatcher = self.dispatchers.get(name)
        if dispatcher is None:
            raise Refused(
                404,
                "unknown_model",
                f"node {self.node_id} does not serve model {name!r}: a step without an "
                "episode runs where it arrives (send it to a node that serves the model)",
            )
        up = [d for d in self.health.devices if not self.health.down(d)]
        if not up:
            raise Unavailable("device_down", "every device of this node is down", 5.0)
        device = up[self._rr % len(up)]
        self._rr += 1
        arrival.done()
        inputs = {**step.inputs, **control_feed(dispatcher.contract, None, start=True, end=True)}
        outputs = await dispatcher.run_stateless(device, inputs)
        return Reply(
            outputs, None, device, self.node_id, 0, "stateless", False, False,
            url=self.url, model=self.models.get(name, ""),
        )  # fmt: skip
