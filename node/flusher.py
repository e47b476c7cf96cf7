"""The owner's batched writes to Redis, and what Redis' answers let it keep serving.

The flush is ``affinity/lua/flush.lua``: one round trip, at most once a second, only when
there is something to say. It releases what idled out. It slides the backstop of an
episode stepped since its last slide, once that backstop is less than a lease +
:data:`SLIDE_AHEAD_S` from running out. With the default 300 s idle timeout, that is one
slide every ~5 minutes a stepping episode. An episode Redis answers as lost (another claim
holds it) is dropped.

It is the lease's listener (``node.lease.LeaseListener``). A registration re-asserts what
is held. A renewal brings operators' revocations. Another Redis server makes every record
due.

Hazards: an episode being released in the flush in flight is never served from memory. A
slide that too few replicas acknowledged is not counted (a failover could undo it). A
hand-over's unconfirmed copy is neither slid nor re-asserted: Redis names the old claim
until the commit, so a slide would find it lost (``node/handover.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from affinity import Registry, Settings
from affinity.registry import Held, Registered
from node.episodes import EpisodeTable
from node.metrics import Metrics

__all__ = ["EXPIRY_MARGIN_S", "SLIDE_AHEAD_S", "Flusher"]

log = logging.getLogger("affinity.node")

SLIDE_AHEAD_S = 3.0
"""A stepped episode is slid once its backstop has less than a lease TTL + this left (the
flush runs every second; this leaves room for retries)."""
EXPIRY_MARGIN_S = 1.0
"""Never served from memory within this of its backstop by the owner's clock (drift)."""


class Flusher:
    """The owner's flushes and their bookkeeping (see the module doc)."""

    def __init__(
        self,
        node_id: str,
        table: EpisodeTable,
        registry: Registry,
        metrics: Metrics,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.table = table
        self.registry = registry  # the lease's own pool
        self.metrics = metrics
        self.lease_ttl_s = settings.lease_ttl_s
        self.backstop_s = settings.backstop_ms / 1000
        self.idle_ttl_s = settings.episode_ttl_s
        self.clock = clock
        self.flushed_at = float("-inf")  # send time of the last flush that succeeded
        self.grace_ms = 0  # the fleet's grace period left, as the last script said
        self._slid: dict[str, float] = {}  # episode -> send time of its backstop's last write
        self._idle: list[tuple[str, int]] = []  # dropped here for idleness: to release
        self._releasing: set[str] = set()  # in the flush in flight: never from memory

    # ---- queries -------------------------------------------------------------------------

    def current(self) -> bool:
        """Whether the last flush succeeded less than a lease TTL ago."""
        return self.clock() < self.flushed_at + self.lease_ttl_s

    def fresh(self, episode: str) -> bool:
        """Whether the flushes let ``episode`` be served from memory: the last one is
        current, it is not being released, and its backstop is not near."""
        if episode in self._releasing or not self.current():
            return False
        slid = self._slid.get(episode)  # None: claimed since the last flush, backstop fresh
        # near (flushes failed): Redis answers, and slides it
        return slid is None or self.clock() < slid + self.backstop_s - EXPIRY_MARGIN_S

    def idled(self, episode: str) -> bool:
        """Whether ``episode`` idled out here and its release is not yet flushed."""
        return any(ep == episode for ep, _ in self._idle)

    # ---- the lease's listener ------------------------------------------------------------

    def held(self) -> list[Held]:
        """Every record held here, as re-asserted at a registration."""
        return [Held(ep, r.device, r.token, r.claim, r.model) for ep, r in self.table.owned()]

    def registered(self, held: Sequence[Held], done: Registered, sent: float) -> None:
        lost = self._unchanged(held, done.lost)
        for episode in lost:
            self.table.release(episode, "lost")
        if lost:
            self.metrics.owner_dropped.labels("lost").inc(len(lost))
        self.grace_ms = done.grace_ms
        self.flushed_at = sent  # every backstop of what is held is fresh now
        for h in held:
            self._slid[h.episode] = sent

    def revoked(self, revoked: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        for episode, token in revoked:  # released in Redis by an operator
            if self.table.release(episode, "revoked", token) is not None:
                log.info("episode %r was released in Redis: its state here is dropped", episode)
                self.metrics.owner_dropped.labels("revoked").inc()
        return list(revoked)  # carried out, held or not

    def server_changed(self) -> None:
        self._slid.clear()  # every record is due (and stays due until a flush succeeds)

    def dropped(self) -> None:
        self._slid.clear()
        self._idle.clear()

    def _unchanged(self, sent: Sequence[Held], lost: Sequence[str]) -> list[str]:
        """The episodes of ``lost`` (Redis' answer to ``sent``) whose record here is still
        the claim that was sent: one ended, or claimed anew, meanwhile stays."""
        sent_as = {h.episode: (h.device, h.token, h.claim) for h in sent}
        out = []
        for episode in lost:
            record = self.table.get(episode)
            if record is not None and (record.device, record.token, record.claim) == sent_as.get(
                episode
            ):
                out.append(episode)
        return out

    # ---- the flush -----------------------------------------------------------------------

    async def flush(self, instance: str | None) -> None:
        """Expire idle records here, then release them and slide the backstops in one
        round trip (nothing to say: no round trip) under the lease's registration of
        ``instance`` (None: not registered, nothing is sent). Raises what the registry
        raises; the work is kept for the next flush."""
        sent = self.clock()
        expired = self.table.expire_idle(self.idle_ttl_s)
        if expired:
            self.metrics.owner_dropped.labels("idle").inc(len(expired))
        self._idle.extend(expired)
        records = self.table.owned()  # an unconfirmed copy is never slid (node/handover.py)
        never = float("-inf")
        due = self.backstop_s - self.lease_ttl_s - SLIDE_AHEAD_S
        slide = [
            Held(ep, r.device, r.token, r.claim, r.model)
            for ep, r in records
            if r.last_used > self._slid.get(ep, never) and sent - self._slid.get(ep, never) >= due
        ]
        holding = {ep for ep, _ in self.table.records()}
        idle = [(ep, token) for ep, token in self._idle if ep not in holding]
        if not slide and not idle:
            self.flushed_at = sent
            self._prune(holding)
            return
        if instance is None:
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
        lost = self._unchanged(slide, done.lost)
        if lost:
            self.metrics.owner_dropped.labels("lost").inc(len(lost))
        for episode in lost:
            log.warning(
                "episode %r is no longer this node's in Redis (another claim holds it, or "
                "it was released): its state here is dropped",
                episode,
            )
            self.table.release(episode, "lost")
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
        self._prune({ep for ep, _ in self.table.records()})

    def _prune(self, holding: set[str]) -> None:
        for episode in [ep for ep in self._slid if ep not in holding]:
            del self._slid[episode]
