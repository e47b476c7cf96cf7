"""Every Redis key affinity uses, built from pure functions of (namespace, ids), and the
check of the ids that go into them (:func:`check_episode`: no Redis client imported, so a
front process validates an episode id without loading one).

No other module writes a key literal. Every key starts with the hash tag
``{<namespace>}``, so they all hash to the same slot. One Lua script may then touch any of
them on Redis Cluster too. Some Lua scripts must derive a key from stored data (the device
named in an assignment). They get :attr:`Keys.prefix` through ``ARGV`` and append the same
suffixes as the methods below (``affinity/lua/lib.lua``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from affinity.errors import InvalidArgument

__all__ = ["MAX_EPISODE_BYTES", "Keys", "check_episode", "check_token"]

MAX_EPISODE_BYTES = 512
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
        hold a lease. A lapsed one stays until a claim or a renewal notices it."""
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
        """String: a keyed digest of the fleet's cluster secret (never the secret).

        The first node that registers sets it. A node whose secret does not match cannot
        join."""
        return self.prefix + "secret"

    def model_ring(self, model: str) -> str:
        """Sorted set: device -> picks/weight, the devices that take new episodes of
        ``model`` (``"name@version"``) now. ``""``: :attr:`ring`, the one ring of a fleet
        whose nodes register no model."""
        return self.ring_prefix + model if model else self.ring

    @property
    def ring_prefix(self) -> str:
        """The start of every model's ring key (for the scripts' header)."""
        return self.prefix + "ring:"

    def versions(self, name: str) -> str:
        """Sorted set: version -> when a node first registered it (ms), for model ``name``
        (the newest takes new episodes unless :meth:`rollout` has weights)."""
        return self.prefix + "versions:" + name

    def rollout(self, name: str) -> str:
        """Hash: version -> weight, the operator's share of new episodes per version of
        model ``name`` (``affinity rollout``); absent: the newest version takes them all."""
        return self.prefix + "rollout:" + name

    def recording(self, name: str) -> str:
        """Hash: version -> the JSON selection of model ``name``'s episodes the fleet
        records (``affinity record``; ``node/recorder.py``); absent: none recorded."""
        return self.prefix + "record:" + name

    @property
    def shadows(self) -> str:
        """Hash: candidate ``"name@version"`` -> ``"<live name@version> <fraction>"``, the
        shadows an operator started (``affinity shadow``), read by owners at each renewal."""
        return self.prefix + "shadows"

    def shadow_stats(self, candidate: str, live: str) -> str:
        """Hash: node id -> JSON of that node's totals of the ghost steps of ``candidate``
        beside ``live`` (both ``"name@version"``), written by the node at each renewal."""
        return self.prefix + "shadow:" + candidate + ">" + live

    def shadow_runners(self, candidate: str) -> str:
        """Sorted set: ``"<node id> <url>"`` -> until when (Unix ms) that node runs the
        candidate ``"name@version"`` (its ``--shadow-model``), written by the node at each
        renewal: where an owner without the candidate sends its ghost steps."""
        return self.prefix + "shadow-runners:" + candidate

    def picks(self, name: str) -> str:
        """Sorted set: version -> picks/weight, the stride scheduling over the weighted
        versions of model ``name`` (reset by every ``affinity rollout``)."""
        return self.prefix + "picks:" + name

    def contract(self, model: str) -> str:
        """String: the input/output contract (JSON, ``GET /models/{name}``) of ``model``
        (``"name@version"``), written by the nodes that serve it."""
        return self.prefix + "contract:" + model

    @property
    def fleet(self) -> str:
        """String: the fleet marker, the end (ms, server time) of the grace period after
        Redis was found to have lost its data ("0": none). Its absence means Redis lost
        its data (or the fleet is new). The first script to notice starts a grace period
        as long as the longest lease a node may hold. No new claim is granted in it
        (``affinity/lua/lib.lua``)."""
        return self.prefix + "fleet"

    @property
    def leases(self) -> str:
        """Sorted set: node id -> its lease TTL (ms), for the nodes that hold a lease.

        The longest is the grace period a loss of Redis data starts (``affinity/lua/fleet.lua``)."""
        return self.prefix + "leases"

    @property
    def known_leases(self) -> str:
        """Sorted set: node id -> the longest lease TTL (ms) that node has heard of.

        No node is granted a lease longer than the shortest of these
        (``affinity/lua/fleet.lua``)."""
        return self.prefix + "leases:known"

    @property
    def view(self) -> str:
        """String, JSON: the fleet's live episodes and capacity per model version.

        One node read them (``Inventory.fleet_view``): ``{"at": ms, "models":
        {"name@version": [live, capacity]}}``. Expires after three of its periods without a
        new read."""
        return self.prefix + "view"

    @property
    def view_reader(self) -> str:
        """String, expires after one period: the node that reads the fleet's load for
        :attr:`view` in this period (``SET NX PX``: one node a period, whichever asks
        first)."""
        return self.prefix + "view:reader"

    def episode(self, episode: str) -> str:
        """String ``"<device> <token> <claim id> <model>"`` with the episode's backstop expiry.

        The expiry is the owner's idle timeout + two lease TTLs + 3 s, slid by the owner in
        batches. Then comes `` revoked`` while an operator's release waits for the owner to
        let go. Or `` moved`` once it let go (handed over; the next resolve reassigns it)."""
        return self.prefix + "episode:" + episode

    def node(self, node: str) -> str:
        """Hash: url, devices, started_at, version, instance, state (up, leaving, down),
        models (``"name@version,..."``), procs (its processes: ``NodeProcesses``, JSON) and
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

    def revoked(self, node: str) -> str:
        """Set: ``"<episode> <token>"`` of the node's assignments someone else released.

        Someone else than the owner released them in Redis (an operator's
        ``affinity release``). They stay until the owner's next renewal reads them and
        drops its records. Expires after two lease TTLs."""
        return self.prefix + "revoked:" + node

    def moves(self, node: str) -> str:
        """Set: the moves an operator asked of the node's episodes (``affinity drain
        --move``: ``@<device>``; ``affinity move``: ``<episode>\\x1f<target>``), until its
        next renewal reads them."""
        return self.prefix + "moves:" + node

    def transfer(self, episode: str) -> str:
        """String ``"<device> <token> <claim id>"``, then `` installed``: a live hand-over's
        reservation of the episode's new claim (``affinity/lua/transfer.lua``).

        Written by the move's *place*, marked ``installed`` by the new owner once it holds
        the copy, deleted by the *commit* (which needs the mark), an *abort*, or the new
        owner dropping its copy (*settle*). Expires with the reserved slot (10 s)."""
        return self.prefix + "transfer:" + episode

    def scores(self, model: str) -> str:
        """Sorted set: device -> predicted step time (ms) / weight, the score index of
        :meth:`model_ring` (``""``: the one ring). Scored placement takes its lowest; each
        renewal republishes it, each claim moves it (``affinity/lua/lib.lua``)."""
        return self.prefix + "score:" + model if model else self.prefix + "score"

    @property
    def score_prefix(self) -> str:
        """The start of every model's score index key (for the scripts' header)."""
        return self.prefix + "score:"

    @property
    def scored(self) -> str:
        """Hash: device -> ``"<expires ms> <step ms> <cost ms>"``, its last published score.

        It expires (not read past ``expires``) with the lease its renewal granted."""
        return self.prefix + "scored"

    def hash_ring(self, model: str) -> str:
        """Sorted set: device -> a 32-bit hash of its id, the devices of :meth:`model_ring`
        on a consistent-hash ring (``""``: the one ring): a re-claim's preferred device."""
        return self.prefix + "hashring:" + model if model else self.prefix + "hashring"

    @property
    def hash_ring_prefix(self) -> str:
        """The start of every model's hash ring key (for the scripts' header)."""
        return self.prefix + "hashring:"

    def episode_pattern(self) -> str:
        """``SCAN MATCH`` pattern of all assignments (for operators, never inside Lua)."""
        return self.prefix + "episode:*"


def check_episode(episode: object) -> str:
    """Return ``episode`` as text, or raise :class:`InvalidArgument`.

    An episode id is a non-empty string of valid UTF-8 of at most 512 bytes without
    control characters (``bytes`` are accepted when they decode strictly).
    """
    if isinstance(episode, bytes):
        try:
            episode = episode.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument("episode id", episode, "must be valid UTF-8") from None
    if not isinstance(episode, str):
        raise InvalidArgument("episode id", episode, "must be a string")
    if not episode:
        raise InvalidArgument("episode id", episode, "must not be empty")
    try:
        size = len(episode.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument("episode id", episode, "must be valid UTF-8") from None
    if _CONTROL.search(episode):
        # they would reach operators' terminals through redis-cli and the CLI
        raise InvalidArgument("episode id", episode, "must not contain control characters")
    if size > MAX_EPISODE_BYTES:
        raise InvalidArgument(
            "episode id", episode, f"is {size} bytes; the limit is {MAX_EPISODE_BYTES} bytes"
        )
    return episode


def check_token(token: object) -> int:
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise InvalidArgument("token", token, "must be a non-negative integer")
    return token
