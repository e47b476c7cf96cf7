"""Shadows: a candidate version runs beside a live one on live inputs, never answering.

An operator starts one with ``affinity shadow NAME@CANDIDATE --of NAME@LIVE`` (Redis keeps
it in :attr:`Keys.shadows`, like a rollout's weights). Each owner reads the shadows at its
lease renewal, never per step, and runs the chosen live episodes' inputs through the
candidate as *ghost* episodes (``node/shadow.py``). Each node writes its totals per
(candidate, live) pair to :meth:`Keys.shadow_stats` at the same renewal, one field per
node. ``affinity shadow status`` adds them up.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from affinity.errors import InvalidArgument
from affinity.models import ModelId
from affinity.scripts import RedisApi, bounded

__all__ = ["PairTotals", "Shadow", "Shadows", "selected", "status"]


@dataclass(frozen=True)
class Shadow:
    """One shadow: ``candidate`` runs beside ``live`` (same name) for ``fraction`` of the
    live version's episodes."""

    candidate: ModelId
    live: ModelId
    fraction: float = 1.0
    stopped: bool = False  # stopped by an operator: no ghosts; its figures stay

    @classmethod
    def checked(cls, candidate: str, live: str, fraction: object = 1.0) -> Shadow:
        """A shadow from what an operator typed; raises :class:`InvalidArgument`."""
        cand, of = ModelId.parse(candidate), ModelId.parse(live)
        if cand.name != of.name:
            raise InvalidArgument("--of", live, f"must be a version of {cand.name}")
        if cand == of:
            raise InvalidArgument("--of", live, "a version cannot shadow itself")
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not (math.isfinite(fraction) and 0 < fraction <= 1)
        ):
            raise InvalidArgument("--fraction", fraction, "must be a number in (0, 1]")
        return cls(cand, of, float(fraction))

    def value(self) -> str:
        return f"{self.live} {self.fraction!r}" + (" stopped" if self.stopped else "")

    @classmethod
    def parse(cls, candidate: str, value: str) -> Shadow:
        """A shadow as Redis holds it; raises ``InvalidArgument`` or ``ValueError``."""
        live, fraction, *rest = value.split(" ")
        shadow = cls.checked(candidate, live, float(fraction))
        return replace(shadow, stopped=rest == ["stopped"])


def selected(episode: str, fraction: float) -> bool:
    """Whether ``episode`` is among ``fraction`` of the episodes: the same answer on every
    node, at every step (the first 8 bytes of a BLAKE2b hash of its id against the
    fraction)."""
    if fraction >= 1:
        return True
    h = int.from_bytes(hashlib.blake2b(episode.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


@dataclass
class PairTotals:
    """The ghost steps of one (candidate, live) pair: compared, skipped (by reason),
    restarts, and the divergence of the candidate's actions from the live ones. Ghosts
    that ran from their live episode's start and never restarted (*continuous*) are kept
    apart from the restarted ones (``restarted_*``): a reset candidate's figures never mix
    with a continuing one's."""

    compared: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    max_abs: float = 0.0
    l2_max: float = 0.0
    max_abs_dims: list[float] = field(default_factory=list)
    restarted_compared: int = 0
    restarted_max_abs: float = 0.0

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "skipped": self.skipped_total,
            "skipped_by": dict(self.skipped),
            "restarts": self.restarts,
            "max_abs": self.max_abs,
            "l2_max": self.l2_max,
            "max_abs_dims": list(self.max_abs_dims),
            "restarted_compared": self.restarted_compared,
            "restarted_max_abs": self.restarted_max_abs,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PairTotals:
        return cls(
            int(doc["compared"]),
            {str(k): int(v) for k, v in dict(doc.get("skipped_by", {})).items()},
            int(doc.get("restarts", 0)),
            float(doc["max_abs"]),
            float(doc.get("l2_max", 0.0)),
            [float(x) for x in doc.get("max_abs_dims", [])],
            int(doc.get("restarted_compared", 0)),
            float(doc.get("restarted_max_abs", 0.0)),
        )

    def add(self, other: PairTotals) -> None:
        """Add ``other``'s counts in; keep the larger divergences."""
        self.compared += other.compared
        for reason, n in other.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        self.restarts += other.restarts
        self.max_abs = max(self.max_abs, other.max_abs)
        self.l2_max = max(self.l2_max, other.l2_max)
        self.max_abs_dims = _wider(self.max_abs_dims, other.max_abs_dims)
        self.restarted_compared += other.restarted_compared
        self.restarted_max_abs = max(self.restarted_max_abs, other.restarted_max_abs)


def _wider(a: list[float], b: list[float]) -> list[float]:
    n = max(len(a), len(b))
    return [max(a[i] if i < len(a) else 0.0, b[i] if i < len(b) else 0.0) for i in range(n)]


class Shadows(RedisApi):
    """The shadows Redis keeps and the nodes' totals, over one Redis client; every call is
    bounded."""

    async def start(self, shadow: Shadow) -> None:
        """Start (or change) ``shadow``: owners pick it up at their next renewal."""
        await bounded(
            self.settings,
            self.redis.hset(self.keys.shadows, str(shadow.candidate), shadow.value()),
        )

    async def stop(self, candidate: str) -> Shadow | None:
        """Stop the shadow of ``candidate``: owners free its ghosts at their next renewal.
        Its figures stay (``affinity shadow status`` shows it stopped). None: there was
        none."""
        ModelId.parse(candidate)
        shadow = (await self.all()).get(candidate)
        if shadow is None:
            return None
        stopped = replace(shadow, stopped=True)
        await bounded(self.settings, self.redis.hset(self.keys.shadows, candidate, stopped.value()))
        return stopped

    async def all(self) -> dict[str, Shadow]:
        """Every shadow, by candidate ``"name@version"`` (a malformed entry is skipped)."""
        raw = await bounded(self.settings, self.redis.hgetall(self.keys.shadows))
        out = {}
        for k, v in raw.items():
            key, value = _text(k), _text(v)
            try:
                out[key] = Shadow.parse(key, value)
            except ValueError:  # InvalidArgument is one: an entry no command wrote
                continue
        return out

    async def restore(self, shadows: Mapping[str, Shadow]) -> int:
        """Put back ``shadows`` (by candidate) that Redis no longer holds (after it lost its
        data: ``affinity shadow stop`` marks, never deletes). Read, then written: commands
        a namespace-restricted ACL user has (``docs/security.md``); a shadow an operator
        starts in between may be overwritten by the one remembered. Returns how many were
        put back."""
        held = await self.all()
        missing = {c: s for c, s in shadows.items() if c not in held}
        if missing:
            await bounded(
                self.settings,
                self.redis.hset(
                    self.keys.shadows, mapping={c: s.value() for c, s in missing.items()}
                ),
            )
        return len(missing)

    async def publish(self, node: str, totals: Mapping[tuple[str, str], PairTotals]) -> None:
        """Write this node's totals of each (candidate, live) pair, one pipeline."""
        if not totals:
            return
        pipe = self.redis.pipeline(transaction=False)
        for (candidate, live), t in totals.items():
            pipe.hset(self.keys.shadow_stats(candidate, live), node, json.dumps(t.to_json()))
        await bounded(self.settings, pipe.execute())

    async def advertise(
        self, node: str, url: str, candidates: list[str], now_ms: int, ttl_ms: int
    ) -> None:
        """Say this node runs ``candidates`` (``--shadow-model``) until ``now_ms + ttl_ms``
        (the lease's time: a node gone drops out), one pipeline; the expired go."""
        if not candidates:
            return
        pipe = self.redis.pipeline(transaction=False)
        for candidate in candidates:
            key = self.keys.shadow_runners(candidate)
            pipe.zadd(key, {f"{node} {url}": now_ms + ttl_ms})
            pipe.zremrangebyscore(key, "-inf", now_ms)
        await bounded(self.settings, pipe.execute())

    async def runners(self, candidates: list[str], now_ms: int) -> dict[str, dict[str, str]]:
        """The nodes running each of ``candidates`` now: candidate -> node id -> its URL."""
        pipe = self.redis.pipeline(transaction=False)
        for candidate in candidates:
            pipe.zrangebyscore(self.keys.shadow_runners(candidate), now_ms, "+inf")
        replies = await bounded(self.settings, pipe.execute())
        out: dict[str, dict[str, str]] = {}
        for candidate, members in zip(candidates, replies, strict=True):
            nodes = out[candidate] = {}
            for member in members:
                node, _, url = _text(member).partition(" ")
                if url:
                    nodes[node] = url
        return out

    async def totals(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], PairTotals]:
        """The fleet's totals of each pair: every node's added up."""
        pipe = self.redis.pipeline(transaction=False)
        for candidate, live in pairs:
            pipe.hgetall(self.keys.shadow_stats(candidate, live))
        replies = await bounded(self.settings, pipe.execute())
        out = {}
        for pair, per_node in zip(pairs, replies, strict=True):
            total = PairTotals()
            for raw in per_node.values():
                try:
                    total.add(PairTotals.from_json(json.loads(_text(raw))))
                except (ValueError, KeyError, TypeError):
                    continue
            out[pair] = total
        return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def status(shadows: Shadows) -> list[dict[str, Any]]:
    """Every shadow with the fleet's figures (``affinity shadow status --json``, the fleet
    page's ``/shadows``): candidate, live, fraction, state (``on``, ``stopped``) and
    :meth:`PairTotals.to_json`."""
    active = await shadows.all()
    pairs = [(c, str(s.live)) for c, s in sorted(active.items())]
    totals = await shadows.totals(pairs)
    return [
        {
            "candidate": candidate,
            "live": live,
            "fraction": active[candidate].fraction,
            "state": "stopped" if active[candidate].stopped else "on",
            **totals[(candidate, live)].to_json(),
        }
        for candidate, live in pairs
    ]
