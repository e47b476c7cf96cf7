"""What a router has seen of the other nodes it forwards to, logged once per change.

While an owner is down and its lease is still alive, its episodes get 503s (never a second
owner). The access log then shows only 503 lines. :class:`PeerHealth` writes one warning
when a forward to an owner first fails, and one when that owner answers again. It writes
one when its lease lapsed (an episode it held is claimed anew elsewhere). Not one per
request.
"""

from __future__ import annotations

import logging

from affinity import Assignment

__all__ = ["PeerHealth"]

log = logging.getLogger("affinity.node")


class PeerHealth:
    """The owners this router could not reach, with how many forwards failed since."""

    def __init__(self) -> None:
        self.unreachable: dict[str, int] = {}

    def failed(self, node: str, url: str, reason: object) -> None:
        """A forward to ``node`` got no answer."""
        failures = self.unreachable.get(node, 0)
        self.unreachable[node] = failures + 1
        if failures == 0:
            log.warning(
                "owner %s (%s) is unreachable: %s; its episodes get 503 until it answers "
                "or its lease lapses",
                node,
                url,
                reason,
            )

    def answered(self, node: str) -> None:
        """``node`` answered a forward (whatever the status)."""
        failures = self.unreachable.pop(node, None)
        if failures is not None:
            log.warning("owner %s answers again (%d forward(s) failed meanwhile)", node, failures)

    def resolved(self, assignment: Assignment) -> None:
        """What a resolve said; a reassignment away from an unreachable owner means its
        lease lapsed (or it was marked down)."""
        if assignment.status != "reassigned" or not assignment.previous:
            return
        node = assignment.previous.split("/", 1)[0]
        failures = self.unreachable.pop(node, None)
        if failures is not None:
            log.warning(
                "owner %s lost its episodes (lease lapsed or device down): they are claimed "
                "anew, e.g. %s on %s (%d forward(s) failed meanwhile)",
                node,
                assignment.episode,
                assignment.device,
                failures,
            )
