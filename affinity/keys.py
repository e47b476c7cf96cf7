"""Every Redis key affinity uses, built from pure functions of (namespace, ids).

No other module writes a key literal. Every key starts with the hash tag
``{<namespace>}`` so that one Lua script may touch any of them on Redis Cluster too:
they all hash to the same slot. Lua scripts that must derive a key from stored data
(the device named in an assignment) get :attr:`Keys.prefix` through ``ARGV`` and append
the same suffixes as the methods below (``affinity/lua/lib.lua``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Keys"]


@dataclass(frozen=True)
class Keys:
    """Key builder for one namespace (default ``affinity``)."""

    namespace: str = "affinity"

    def __post_init__(self) -> None:
        ns = self.namespace
        if not ns or any(c in ns for c in "{}: \t\r\n") or len(ns) > 64:
            raise ValueError(
                f"namespace {ns!r} must be 1-64 characters without braces, colons or whitespace"
            )

    @property
    def prefix(self) -> str:
        """``{<namespace>}:``, the start of every key."""
        return "{" + self.namespace + "}:"

    @property
    def rr(self) -> str:
        """String counter: assignments made (claims and reassignments), ``INCR``ed by each.
        It does not choose the device (the ring does)."""
        return self.prefix + "rr"

    @property
    def token(self) -> str:
        """String: the last fencing token handed out."""
        return self.prefix + "token"

    @property
    def nodes(self) -> str:
        """Sorted set: node id -> lease deadline (Redis server time, ms), for the nodes that
        hold a lease; a lapsed one stays until a claim or a renewal notices it."""
        return self.prefix + "nodes"

    @property
    def ring(self) -> str:
        """Sorted set: device -> picks/weight, the devices that take new episodes now."""
        return self.prefix + "ring"

    @property
    def full(self) -> str:
        """Sorted set: device -> earliest idle deadline (ms) of an enrolled device at capacity."""
        return self.prefix + "full"

    @property
    def route(self) -> str:
        """Hash: device -> ``"node state capacity weight url"`` for devices listed by a
        node that holds a lease (what the claim and the hit read)."""
        return self.prefix + "route"

    @property
    def devices(self) -> str:
        """Set: every device id ever registered (index for listing; see docs/redis.md)."""
        return self.prefix + "devices"

    @property
    def events(self) -> str:
        """Stream, capped: claim, reassign, release, expire, drain, ... events."""
        return self.prefix + "events"

    @property
    def secret(self) -> str:
        """String: a keyed digest of the fleet's cluster secret (never the secret), set by
        the first node that registers; a node whose secret does not match cannot join."""
        return self.prefix + "secret"

    @property
    def fleet(self) -> str:
        """String: the fleet marker, the end (ms, server time) of the grace period after
        Redis was found to have lost its data ("0": none). Its absence means Redis lost
        its data (or the fleet is new): the first script to notice starts a grace period
        of one lease TTL in which no new claim is granted (``affinity/lua/lib.lua``)."""
        return self.prefix + "fleet"

    def episode(self, episode: str) -> str:
        """String ``"<device> <token> <claim id>"`` with the episode's backstop expiry
        (the owner's idle timeout + two lease TTLs + 3 s, slid by the owner in batches)."""
        return self.prefix + "episode:" + episode

    def node(self, node: str) -> str:
        """Hash: url, devices, started_at, version, instance, state (up, leaving, down), and
        lease (its deadline, once it lapsed). Kept after a crash until the node registers
        again or an operator forgets it."""
        return self.prefix + "node:" + node

    def device(self, device: str) -> str:
        """Hash: node, index, kind, name, uuid, arch, memory, capacity, weight, state, reason."""
        return self.prefix + "device:" + device

    def load(self, device: str) -> str:
        """Sorted set: episode -> idle deadline (ms); live load = members not yet past it."""
        return self.prefix + "load:" + device

    def moved(self, device: str) -> str:
        """Sorted set: episode -> idle deadline (ms) of the episodes handed over from the
        device by a graceful stop, until claimed anew or idle (for listing only)."""
        return self.prefix + "moved:" + device

    def episode_pattern(self) -> str:
        """``SCAN MATCH`` pattern of all assignments (for operators, never inside Lua)."""
        return self.prefix + "episode:*"
