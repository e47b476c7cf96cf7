"""The owner's authority over its episodes: serve them from memory, tell Redis in batches.

Redis decides who owns an episode, once, in the claim; the owner decides each step
(DESIGN.md, "Ownership and steps"). A step of an episode whose record this node holds (a
claim Redis confirmed for this process, see ``node/routing.py``) is served from memory,
with no Redis command, while:

- this instance's lease is valid by its own conservative clock (``Membership.authority``:
  counted from the send time of the renewal that succeeded, less a drift allowance;
  checked before the model runs and again after, in ``Routing._serve``), and
- its last flush succeeded less than one lease TTL ago (:meth:`Ownership.current`), and
  Redis' backstop expiry of the episode (``Settings.backstop_ms`` from the send time of the
  last write that set it) is more than :data:`EXPIRY_MARGIN_S` ahead by this clock.

Records exist only under the registration that confirmed them: a node that fences itself
or registers anew drops them (``Membership``), except that one re-registering within its
own lease after Redis lost its data re-asserts them in the same script.

The flush (``affinity/lua/flush.lua``, one round trip, at most once a second, only when
there is something to say) ends at the owner what the owner ends: episodes idle past the
idle timeout are dropped here and released in Redis, token-checked, freeing their load
slot (a slot may stay taken until the flush, never the reverse); and it slides the
backstop of an episode stepped since its last slide once that backstop is less than one
lease TTL + :data:`SLIDE_AHEAD_S` from running out (and of a new record at its first
flush): with the default 300 s idle timeout, a stepping episode costs one slide (three
commands inside the flush script) every ~5 minutes, not one per lease TTL. A flush that
cannot reach Redis is retried each second; if Redis stays away the lease lapses first
(the backstop outlasts the lease), and an episode whose backstop is near anyway is
resolved through Redis again (:meth:`Ownership.serving`), never served past it.
An episode Redis answers as lost (another claim holds it; an operator released it) is
dropped here at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from affinity import Assignment, Registry
from affinity.registry import Held
from node.catalog import Dispatchers

__all__ = ["EXPIRY_MARGIN_S", "SLIDE_AHEAD_S", "Ownership"]

log = logging.getLogger("affinity.node")

SLIDE_AHEAD_S = 3.0
"""A stepped episode is slid once its backstop has less than a lease TTL + this left (the
flush runs every second; this leaves room for retries)."""
EXPIRY_MARGIN_S = 1.0
"""Never served from memory within this of its backstop by the owner's clock (drift)."""


class Ownership:
    """Serve-from-memory checks and the owner's flush (see the module doc)."""

    def __init__(
        self,
        node_id: str,
        url: str,
        lease_ttl_s: float,
        backstop_s: float,
        registry: Registry,
        dispatcher: Dispatchers,
        clock: Callable[[], float] = time.monotonic,
        dropped: Callable[[str, int], None] = lambda reason, n: None,
    ) -> None:
        self.node_id = node_id
        self.url = url
        self.lease_ttl_s = lease_ttl_s
        self.backstop_s = backstop_s
        self.registry = registry
        self.dispatcher = dispatcher
        self.clock = clock
        self.dropped = dropped  # (reason, how many): affinity_owner_dropped_total
        self.flushed_at = float("-inf")  # send time of the last flush that succeeded
        self.grace_ms = 0  # the fleet's grace period left, as the last script said
        self._slid: dict[str, float] = {}  # episode -> send time of the last write of its backstop
        self._idle: list[tuple[str, int]] = []  # dropped here for idleness: to release
        self._releasing: set[str] = set()  # in the flush in flight: never from memory

    def current(self) -> bool:
        """Whether the last flush succeeded less than a lease TTL ago."""
        return self.clock() < self.flushed_at + self.lease_ttl_s

    def serving(self, episode: str, instance: str) -> Assignment | None:
        """The assignment to serve ``episode`` from memory, or None (ask Redis): it needs a
        record held here, a current flush and a device that is not down. The caller checks
        the lease (``Membership.authority``) and that the step names the record's model
        (``"name@version"``: the assignment's ``model``)."""
        claim = self.dispatcher.claim_of(episode)
        if claim is None or episode in self._releasing or not self.current():
            return None
        slid = self._slid.get(episode)  # None: claimed since the last flush, backstop fresh
        if slid is not None and self.clock() >= slid + self.backstop_s - EXPIRY_MARGIN_S:
            return None  # its backstop is near (flushes failed): Redis answers, and slides it
        device, token, claim_id, model = claim
        if self.dispatcher.tracker(device).down:
            return None  # Redis moves it: the resolve says reassigned
        return Assignment(
            episode, "hit", device, token, self.node_id, self.url, None, claim_id, instance, model
        )

    def unchanged(self, sent: Sequence[Held], lost: Sequence[str]) -> list[str]:
        """The episodes of ``lost`` (Redis' answer to ``sent``) whose record here is still
        the claim that was sent: one ended, or claimed anew, meanwhile is not the claim
        Redis judged, and stays."""
        sent_as = {h.episode: (h.device, h.token, h.claim) for h in sent}
        out = []
        for episode in lost:
            claim = self.dispatcher.claim_of(episode)
            if claim is not None and claim[:3] == sent_as.get(episode):
                out.append(episode)
        return out

    def asserted(self, episodes: list[str], sent: float) -> None:
        """``episodes``' backstops were written by a script sent at ``sent`` (re-asserted
        by a registration)."""
        for episode in episodes:
            self._slid[episode] = sent

    def check_all(self) -> None:
        """Have the next flush slide every record held here (Redis may have lost writes:
        each one it lost, or gives to another claim, is answered as lost and dropped)."""
        self._slid.clear()  # every record is due (and stays due until a flush succeeds)

    def drop(self) -> None:
        """Forget what was slid (every record was dropped: fenced, registered anew)."""
        self._slid.clear()
        self._idle.clear()

    async def flush(self, instance: str, registered: bool) -> None:
        """Expire idle records here, then release them and slide the backstops in one
        round trip (nothing to say: no round trip). Raises what the registry raises; the
        work is kept for the next flush."""
        sent = self.clock()
        expired = self.dispatcher.expire_idle()
        if expired:
            self.dropped("idle", len(expired))
        self._idle.extend(expired)
        held = self.dispatcher.held()
        never = float("-inf")
        due = self.backstop_s - self.lease_ttl_s - SLIDE_AHEAD_S
        slide = [
            h
            for h, used in held
            if used > self._slid.get(h.episode, never)
            and sent - self._slid.get(h.episode, never) >= due
        ]
        holding = {h.episode for h, _ in held}
        idle = [(ep, token) for ep, token in self._idle if ep not in holding]
        if not slide and not idle:
            self.flushed_at = sent
            self._prune(holding)
            return
        if not registered:
            return
        self._releasing = {ep for ep, _ in idle}
        try:
            done = await self.registry.flush(self.node_id, instance, slide, idle)
        finally:
            self._releasing = set()
        if done is None:
            return  # no current lease here: the renewal registers again
        released = {ep for ep, _ in idle}
        self._idle = [item for item in self._idle if item[0] not in released]
        for episode in released:
            if self.dispatcher.claim_of(episode) is not None:
                self.dispatcher.release(episode)  # stepped again meanwhile: resolve anew
        lost = self.unchanged(slide, done.lost)
        if lost:
            self.dropped("lost", len(lost))
        for episode in lost:
            log.warning(
                "episode %r is no longer this node's in Redis (another claim holds it, or "
                "it was released): its state here is dropped",
                episode,
            )
            self.dispatcher.release(episode)
        self.grace_ms = done.grace_ms
        if not done.replicated:  # a failover could undo the slides: not done, sent again
            log.warning(
                "flush of node %s: fewer Redis replicas than --redis-replicas acknowledged "
                "its slides; they are sent again at the next flush",
                self.node_id,
            )
            return
        for h in slide:
            self._slid[h.episode] = sent
        self.flushed_at = sent
        self._prune({h.episode for h, _ in self.dispatcher.held()})

    def _prune(self, holding: set[str]) -> None:
        for episode in [ep for ep in self._slid if ep not in holding]:
            del self._slid[episode]
