"""What a node remembers of its models' rollouts, to put them back after Redis lost its data.

Runs in the node's main process, after each lease renewal. Redis holds each model name's
versions with their first registration (the newest takes new episodes while there are no
weights) and the operator's weights (``affinity rollout``). Redis restarted empty loses
both: the versions come back as their nodes re-register, the last one "newest", and the
weights not at all, so a 3:1 canary's new episodes would go to whichever version
re-registered last. Each node keeps what it last read for the models it serves; after the
loss, at its first renewal (within the grace period an empty Redis gets, in which no claim
is granted), it puts that back (``affinity/lua/restore_rollout.lua``). Redis decides that
data was lost, never the node, so an operator's ``rollout --clear`` is never undone. A
loss that no running node saw (every node restarted with it) is not restored: the
``rollout-restore`` event is then missing and the runbook says to run the rollout again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from affinity.models import Models, Rollout

__all__ = ["RolloutMemory"]

log = logging.getLogger("affinity.node")


class RolloutMemory:
    """The rollouts of ``names`` as this node last read them (see the module doc)."""

    def __init__(self, models: Models, names: Sequence[str]) -> None:
        self.models = models
        self.names = tuple(dict.fromkeys(names))
        self.last: dict[str, Rollout] = {}

    async def sync(self) -> None:
        """Put back what Redis lost of what was read last, then read again. Raises
        ``AffinityError`` when Redis does not answer (the next renewal tries again)."""
        for name, rollout in self.last.items():
            if not rollout.versions:
                continue
            moved, weighted = await self.models.restore(name, rollout)
            if moved or weighted:
                weights = ", ".join(f"{v}={w}" for v, w in rollout.weights.items())
                log.warning(
                    "Redis lost model %s's rollout: put back as this node last read it "
                    "(%d version(s) back in their order; weights %s)",
                    name,
                    moved,
                    weights if weighted else "none put back",
                )
        self.last = await self.models.rollouts(self.names)
