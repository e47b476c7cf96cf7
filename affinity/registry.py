"""Nodes, devices and their states: register, renew, leave, deregister, forget, drain,
list.

A node registers its devices (ids ``<node>/<index>``) and holds a lease it renews every
``lease_ttl/3``; a node whose lease lapsed is dead for the claim script, which moves its
episodes on their next request, and the first claim or renewal that sees the lapse writes
its ``node-down`` event. Device hashes outlive nodes so that an operator's drain survives
a restart; a dead node's record stays until it registers again or is forgotten.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple, NoReturn

from redis.asyncio import RedisCluster
from redis.exceptions import NoPermissionError

from affinity.config import Settings
from affinity.errors import (
    InvalidArgument,
    NodeConflict,
    NotReplicated,
    SecretMismatch,
    UnknownDevice,
    UnknownModel,
    UnknownNode,
)
from affinity.models import ModelId, check_model_part
from affinity.scripts import Script, bounded, evalsha, replicated, scripts_for

__all__ = [
    "STATES",
    "DeviceRegistration",
    "DeviceStatus",
    "EpisodeRow",
    "FleetView",
    "Flushed",
    "Held",
    "LeaseTerms",
    "ModelLoad",
    "MoveRequest",
    "NodeStatus",
    "Registered",
    "Registry",
    "Renewal",
    "StateChange",
    "check_node_id",
    "event_json",
    "secret_digest",
]

State = Literal["active", "draining", "down"]
STATES: tuple[State, ...] = ("active", "draining", "down")
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_REASON = 256
MAX_WEIGHT = 1000  # keeps the ring's picks/weight scores exact in a double (see lib.lua)


def check_node_id(node: object) -> str:
    """A node id is 1-128 characters of letters, digits, ``.``, ``_`` and ``-``."""
    if not isinstance(node, str) or not _NODE_ID.match(node):
        raise InvalidArgument(
            "node id", node, "must be 1-128 characters of letters, digits, '.', '_' or '-'"
        )
    return node


def secret_digest(namespace: str, secret: str | None) -> str:
    """What Redis keeps of a fleet's cluster secret: HMAC-SHA256 keyed with the secret over
    the namespace (``none`` for a fleet without one). It tells equal secrets from unequal
    ones and gives nothing away that would let anyone forge a forward."""
    if not secret:
        return "none"
    message = b"affinity cluster secret " + namespace.encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class DeviceRegistration:
    """What a node says about one of its devices when it registers."""

    index: int
    kind: str  # "cuda" or "cpu"
    name: str
    uuid: str
    arch: str
    memory_mb: int
    capacity: int = 1
    weight: int = 1
    provider: str = ""  # the ONNX Runtime provider the device's session really uses
    state: str = "active"  # "down" when the node's crash tracker has it down
    reason: str = ""  # why it is down

    def __post_init__(self) -> None:
        for name in ("capacity", "weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"device {name}", value, "must be an integer >= 1")
        if self.weight > MAX_WEIGHT:
            raise InvalidArgument("device weight", self.weight, f"must be <= {MAX_WEIGHT}")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise InvalidArgument("device index", self.index, "must be an integer >= 0")
        if self.kind not in ("cuda", "cpu"):
            raise InvalidArgument("device kind", self.kind, "must be 'cuda' or 'cpu'")
        if self.state not in ("active", "down"):
            raise InvalidArgument("device state", self.state, "must be 'active' or 'down'")
        if len(self.reason) > MAX_REASON:
            raise InvalidArgument("reason", self.reason, f"must be at most {MAX_REASON} characters")

    def fields(self) -> list[str | int]:
        return [
            self.index,
            self.kind,
            self.name,
            self.uuid,
            self.arch,
            self.memory_mb,
            self.capacity,
            self.weight,
            self.provider,
            self.state,
            self.reason,
        ]


class StateChange(NamedTuple):
    previous: str
    changed: bool
    state: str  # the state now


@dataclass(frozen=True)
class DeviceStatus:
    device: str
    node: str
    index: int
    kind: str
    name: str
    uuid: str
    arch: str
    memory_mb: int
    capacity: int
    weight: int
    provider: str
    state: str
    reason: str
    alive: bool
    load: int
    models: tuple[str, ...] = ()  # "name@version" its node serves on it

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["models"] = list(self.models)
        return d


@dataclass(frozen=True)
class NodeStatus:
    node: str
    url: str
    devices: tuple[str, ...]
    alive: bool
    state: str  # up | leaving | down (its lease lapsed) | left (it deregistered)
    lease_ms: int  # ms left on the lease (negative: lapsed that long ago)
    started_at_ms: int
    version: str
    models: tuple[str, ...] = ()  # "name@version" on every one of its devices

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["devices"] = list(self.devices)
        d["models"] = list(self.models)
        return d


@dataclass(frozen=True)
class ModelStatus:
    """One registered (name, version): who serves it and what share of new episodes of
    its name it takes."""

    name: str
    version: str
    registered_at_ms: int  # when a node first registered it
    weight: int | None  # the operator's rollout weight; None: no weights for this name
    newest: bool  # the newest registered version of its name
    nodes: tuple[str, ...]  # the live nodes that serve it
    devices: int  # their devices

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["nodes"] = list(self.nodes)
        return d


class ModelLoad(NamedTuple):
    """One model version's share of the fleet, on the devices that may take a new episode
    of it: listed by a live node that serves it and is up (not leaving), and active. A
    device's capacity and live episodes count for every model its node serves (capacity is
    the device's, whatever the model)."""

    model: str  # "name@version"
    live: int
    capacity: int

    @property
    def saturation(self) -> float:
        """Live episodes over capacity; 1.0 when no device may take a new episode of it."""
        return min(1.0, self.live / self.capacity) if self.capacity else 1.0


class FleetView(NamedTuple):
    """The fleet's load per model version as one node read it at ``at_ms`` (server time),
    and the server time when it was fetched (``now_ms``)."""

    at_ms: int
    now_ms: int
    models: tuple[ModelLoad, ...]


@dataclass(frozen=True)
class EpisodeRow:
    episode: str
    device: str
    token: int
    ttl_ms: int
    moved: bool = False  # handed over by a graceful stop: its next step is reassigned
    model: str = ""  # "name@version" it was claimed with ("": its node registered none)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _node_state(recorded: str, leased: bool) -> str:
    """``left`` for a node that deregistered (its record kept until it registers again or
    is forgotten), ``down`` for one whose lease lapsed, else what it recorded (``up``,
    ``leaving``)."""
    if recorded == "left":
        return "left"
    return recorded if leased else "down"


EVENT_NUMBERS = ("token", "count", "handed_over", "lease")
"""Event fields that hold numbers (the stream holds every field as a string)."""


def event_json(event_id: str, fields: Mapping[str, str]) -> dict[str, object]:
    """An event as JSON, as the CLI prints it and ``/events/stream`` sends it: its id, its
    fields, :data:`EVENT_NUMBERS` as numbers."""
    out: dict[str, object] = {"id": event_id, **fields}
    for name in EVENT_NUMBERS:
        value = fields.get(name)
        if value is not None and value.isdigit():
            out[name] = int(value)
    return out


def _now_ms(reply: Sequence[int]) -> int:
    return int(reply[0]) * 1000 + int(reply[1]) // 1000


class Held(NamedTuple):
    """An episode an owner serves from memory: its claim (device, token, claim id, and the
    ``"name@version"`` it was claimed with, ``""`` in a fleet without models)."""

    episode: str
    device: str
    token: int
    claim: str
    model: str = ""


class Registered(NamedTuple):
    """What a registration answered: the lease deadline (ms, server time), the grace
    period left (ms; 0: none), the re-asserted episodes Redis gives to another claim, and
    the lease terms (:class:`LeaseTerms`)."""

    deadline: int
    grace_ms: int
    lost: list[str]
    terms: LeaseTerms


class LeaseTerms(NamedTuple):
    """The lease a registration or renewal granted (ms: the node's own TTL, shorter while
    the fleet has not heard of it yet) and the longest lease TTL of the fleet (ms), which
    the node passes on as what it knows (``known_lease_ms``)."""

    granted_ms: int
    longest_ms: int


class Renewal(NamedTuple):
    """What a renewal answered: the lease terms, the (episode, token) of the node's
    assignments someone else released in Redis that the owner has not carried out, and the
    moves an operator asked of its episodes (:class:`MoveRequest`)."""

    terms: LeaseTerms
    revoked: list[tuple[str, int]]
    moves: tuple[MoveRequest, ...] = ()


class MoveRequest(NamedTuple):
    """An operator's move: every episode of ``device`` (``affinity drain --move``), or one
    ``episode`` (``affinity move``) to ``target`` (a node, a device, or "" for any)."""

    device: str = ""
    episode: str = ""
    target: str = ""

    def encode(self) -> str:
        return "@" + self.device if self.device else f"{self.episode}\x1f{self.target}"

    @classmethod
    def decode(cls, text: str) -> MoveRequest:
        if text.startswith("@"):
            return cls(device=text[1:])
        episode, _, target = text.partition("\x1f")
        return cls(episode=episode, target=target)


class Flushed(NamedTuple):
    """What an owner's flush answered: the grace period left (ms), the lost episodes, and
    whether its slides may be relied on (``False``: fewer replicas than
    ``--redis-replicas`` acknowledged them, so a failover could undo them)."""

    grace_ms: int
    lost: list[str]
    replicated: bool = True


class Registry:
    """Async registry API over one Redis client. Every call is bounded by
    ``settings.redis_deadline_s`` and raises :class:`BackendUnavailable` when Redis cannot
    answer in time. ``known_lease_ms`` answers the longest lease TTL of the fleet the
    caller heard of (a node's last :class:`LeaseTerms`; 0: none): a grace period one of
    its calls starts lasts at least that long (``affinity/lua/lib.lua``)."""

    def __init__(
        self, redis: Any, settings: Settings, known_lease_ms: Callable[[], int] = lambda: 0
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.known_lease_ms = known_lease_ms
        self.keys = settings.keys
        self.scripts = scripts_for(settings)

    async def _call(self, script: Script, key: str, args: Sequence[Any]) -> Any:
        return await bounded(self.settings, evalsha(self.redis, script, key, args))

    async def register(
        self,
        node: str,
        url: str,
        devices: Sequence[DeviceRegistration],
        version: str = "",
        instance: str = "",
        models: Mapping[ModelId, str] | None = None,
        episodes: Sequence[Held] = (),
    ) -> Registered:
        """(Re)register ``node`` and its devices; start its lease. Idempotent.

        ``episodes`` are the ones this process still serves from memory (it re-registers
        within its own lease after Redis lost its data): each is re-asserted in the same
        script (written again when missing, with its model, counted in its device's load);
        those Redis gives to another claim, or whose model the node no longer serves, come
        back in :attr:`Registered.lost`. A missing fleet marker starts the grace period
        (``Keys.fleet``), reported in :attr:`Registered.grace_ms`.

        ``models`` maps each (name, version) every device serves to its contract (JSON
        text, stored under :meth:`Keys.contract` for routers that do not serve it): new
        episodes of a model are claimed only on devices that serve it. Without models the
        devices take every episode (the one ring of a fleet that serves one policy).

        Each device's ``state`` (``down`` when the node's crash tracker has it down) is
        registered as given; an operator's drain survives. Devices of this node id that
        are not in ``devices`` are removed. ``instance`` identifies the process: while
        another instance holds a current lease on the same node id, nothing is written and
        :class:`NodeConflict` is raised. With ``settings.redis_replicas`` a registration that
        re-asserts ``episodes`` is followed by ``WAIT`` on its connection and raises
        :class:`NotReplicated` when fewer replicas acknowledged it (nothing it re-asserted
        may be served on); one without episodes is not waited for (nothing is served on
        it alone: every claim on its devices comes after it and is waited for)."""
        check_node_id(node)
        if not devices:
            raise InvalidArgument("devices", [], "a node registers at least one device")
        indexes = [d.index for d in devices]
        if len(set(indexes)) != len(indexes):
            raise InvalidArgument("device indexes", indexes, "must be unique")
        if not url or any(c.isspace() for c in url):
            raise InvalidArgument("url", url, "a node needs an advertise URL without spaces")
        served = dict(models or {})
        names = [m.name for m in served]
        if len(set(names)) != len(names):
            raise InvalidArgument("models", sorted(map(str, served)), "one version per name")
        if served:
            pipe = self.redis.pipeline(transaction=False)
            for m, contract in served.items():
                pipe.set(self.keys.contract(str(m)), contract)
            await bounded(self.settings, pipe.execute())
        args: list[str | int] = [
            url,
            version,
            instance,
            ",".join(sorted(map(str, served))),
            self.known_lease_ms(),
            len(devices),
        ]
        for d in devices:
            args.extend(d.fields())
        for held in episodes:
            args.extend((held.episode, held.device, str(held.token), held.claim, held.model))
        key = self.keys.node(node)
        if not episodes:  # nothing served on it: the claims after it carry it to the replicas
            reply, short = await self._call(self.scripts.register, key, args), None
        else:
            reply, short = await replicated(self.settings, self.redis, self.scripts.register,
                                            key, args)  # fmt: skip
        if int(reply[0]) < 0:
            raise NodeConflict(node)
        if short is not None:
            self._short("registration", short, node)
        terms = LeaseTerms(int(reply[2]), int(reply[3]))
        return Registered(int(reply[0]), int(reply[1]), [str(e) for e in reply[4:]], terms)

    def _short(self, what: str, acked: int, node: str) -> NoReturn:
        raise NotReplicated(
            what, acked, self.settings.redis_replicas, self.settings.redis_wait_s, f"node {node}"
        )

    async def flush(
        self, node: str, instance: str, slide: Sequence[Held], idle: Sequence[tuple[str, int]]
    ) -> Flushed | None:
        """One owner's batch (``affinity/lua/flush.lua``): slide the backstop expiry of the
        episodes in ``slide`` (those Redis gives to another claim, or lost outside a grace
        period, come back in :attr:`Flushed.lost`) and release, token-checked, the
        ``idle`` ones (episode, token) the owner ended. None (nothing written) when this
        instance holds no current lease on ``node``: renew first. With
        ``settings.redis_replicas`` a flush that slides is followed by ``WAIT`` on its
        connection; :attr:`Flushed.replicated` says whether enough replicas acknowledged
        it (the owner must not count on slides they did not)."""
        args: list[str | int] = [instance, self.known_lease_ms(), len(slide)]
        for held in slide:
            args.extend((held.episode, held.device, str(held.token), held.claim, held.model))
        for episode, token in idle:
            args.extend((episode, str(token)))
        key = self.keys.node(node)
        if not slide:  # releases only: one a failover undoes keeps a slot taken, never more
            reply, short = await self._call(self.scripts.flush, key, args), None
        else:
            reply, short = await replicated(self.settings, self.redis, self.scripts.flush,
                                            key, args)  # fmt: skip
        if int(reply[0]) < 0:
            return None
        return Flushed(int(reply[0]), [str(e) for e in reply[1:]], short is None)

    async def new_fleet(self) -> bool:
        """Declare that no owner serves any episode of this namespace (a new fleet on an
        empty Redis), so its first claims need not wait for the grace period an empty
        Redis otherwise gets (it cannot tell a new fleet from one that lost its data).
        Never call it after Redis lost the data of a running fleet. False when the marker
        was there already (nothing written)."""
        return bool(await bounded(self.settings, self.redis.set(self.keys.fleet, "0", nx=True)))

    async def check_secret(self, secret: str | None) -> None:
        """Join the fleet's cluster secret: the first node to call this (in a namespace, or
        after Redis lost its data) records :func:`secret_digest` of its secret; any later
        caller with a different one gets :class:`SecretMismatch` (nothing written). One
        atomic ``SET NX GET``."""
        digest = secret_digest(self.settings.namespace, secret)
        stored = await bounded(
            self.settings, self.redis.set(self.keys.secret, digest, nx=True, get=True)
        )
        if isinstance(stored, bytes):
            stored = stored.decode()
        if stored is not None and not hmac.compare_digest(stored, digest):
            raise SecretMismatch(self.settings.namespace)

    async def renew(
        self, node: str, instance: str = "", done: Sequence[tuple[str, int]] = ()
    ) -> Renewal | None:
        """Extend the lease. None means the node holds no lease any more (it lapsed, it
        deregistered, or Redis lost its data): it must :meth:`register` again.

        The answer holds the lease granted (count the lease from it, not from the node's
        own TTL) and the (episode, token) of the node's assignments someone else released
        in Redis (an operator): the owner drops their records and says so in ``done`` at
        its next call, which makes each one's next resolve a reassignment.

        Raises :class:`NodeConflict` when another instance holds the node id with a current
        lease: this process has lost its registration and must stop serving and exit; and
        :class:`NotReplicated` when fewer replicas than ``settings.redis_replicas``
        acknowledged the renewal (the lease must not be counted from it)."""
        args = (
            instance,
            self.known_lease_ms(),
            *(f"{episode} {token}" for episode, token in done),
        )
        reply, short = await replicated(
            self.settings, self.redis, self.scripts.renew, self.keys.node(node), args
        )
        if int(reply[0]) == -2:
            raise NodeConflict(node)
        if int(reply[0]) < 0:
            return None
        if short is not None:
            self._short("renewal", short, node)
        n = int(reply[3])
        revoked = []
        for item in reply[4 : 4 + n]:
            episode, _, token = str(item).rpartition(" ")
            revoked.append((episode, int(token)))
        moves = tuple(MoveRequest.decode(str(item)) for item in reply[4 + n :])
        return Renewal(LeaseTerms(int(reply[1]), int(reply[2])), revoked, moves)

    async def request_move(self, node: str, move: MoveRequest) -> None:
        """Ask ``node`` to move episodes with their state (carried out at its next
        renewal, a third of its lease at most). Kept two minutes at most."""
        key = self.keys.moves(node)
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(key, move.encode())
        pipe.pexpire(key, 120_000)
        await bounded(self.settings, pipe.execute())

    async def server_id(self) -> str | None:
        """The ``run_id`` of the Redis server answering (another one after a restart or a
        failover), or None where it cannot be told (Redis Cluster, a store without it)."""
        if isinstance(self.redis, RedisCluster):
            return None
        try:
            info = await bounded(self.settings, self.redis.info("server"))
        except NoPermissionError:  # an ACL user without +info: cannot be told
            return None
        run_id = info.get("run_id") if isinstance(info, dict) else None
        return str(run_id) if run_id else None

    async def leave(self, node: str, instance: str = "") -> int:
        """Begin a graceful stop: the node's devices take no new episodes; the episodes
        they hold stay until handed over (:meth:`Claims.handoff`) or :meth:`deregister`.
        Keep renewing the lease meanwhile. Returns how many devices stopped taking
        episodes (0 when the node is not registered). Raises :class:`NodeConflict`."""
        reply = int(await self._call(self.scripts.leave, self.keys.node(node), (instance,)))
        if reply < 0:
            raise NodeConflict(node)
        return reply

    async def deregister(self, node: str, instance: str = "") -> int:
        """End the lease. Every episode still on the node's devices is handed over: its next
        resolve says ``reassigned`` (so its client is told its state was reset). Returns
        how many were handed over. Raises :class:`NodeConflict` (nothing touched) when
        another instance holds the node id."""
        reply = int(await self._call(self.scripts.deregister, self.keys.node(node), (instance,)))
        if reply < 0:
            raise NodeConflict(node)
        return reply

    async def forget(self, node: str) -> None:
        """Remove what is known about a dead node: its record and its devices (their
        drains too). Raises :class:`UnknownNode` when nothing is known, and
        :class:`InvalidArgument` (nothing written) while the node holds a current lease."""
        check_node_id(node)
        reply = int(await self._call(self.scripts.forget, self.keys.node(node), ()))
        if reply == 0:
            raise UnknownNode(node)
        if reply < 0:
            raise InvalidArgument(
                "node", node, "holds a current lease; stop it first (forget is for dead nodes)"
            )

    async def set_state(
        self, device: str, state: str, reason: str = "", only_if: str | None = None
    ) -> StateChange:
        """Ask for a device state; return what it was, whether it changed, what it is now.

        ``only_if`` makes it conditional on the current state. A ``down`` device asked to
        drain stays down and drains when it comes back up; a ``down`` device asked to be
        ``active`` (its probe passed) returns to a drain it had before. The device stops
        or starts taking new episodes at once. Raises :class:`UnknownDevice` (nothing
        written) and :class:`InvalidArgument`.
        """
        if state not in STATES:
            raise InvalidArgument("state", state, f"must be one of {', '.join(STATES)}")
        if only_if is not None and only_if not in STATES:
            raise InvalidArgument("only_if", only_if, f"must be one of {', '.join(STATES)}")
        if not isinstance(device, str) or not device:
            raise InvalidArgument("device", device, "must be a non-empty device id")
        if len(reason) > MAX_REASON:
            raise InvalidArgument("reason", reason, f"must be at most {MAX_REASON} characters")
        reply = await self._call(
            self.scripts.set_state, self.keys.device(device), (state, reason, only_if or "")
        )
        if not reply:
            raise UnknownDevice(device)
        return StateChange(str(reply[0]), reply[1] == "1", str(reply[2]))

    async def drain(self, device: str, reason: str = "") -> StateChange:
        """Stop new episodes on ``device``; its episodes stay."""
        return await self.set_state(device, "draining", reason)

    async def undrain(self, device: str) -> StateChange:
        """Let a draining ``device`` take new episodes again.

        A device that is not draining is left alone (a ``down`` device comes back through
        its node's probe, not through an operator's undrain)."""
        return await self.set_state(device, "active", "", only_if="draining")

    async def states(self, devices: Sequence[str]) -> dict[str, str]:
        """The current state of each of ``devices`` (``removed`` when its hash is gone)."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        for device in devices:
            pipe.hget(k.device(device), "state")
        replies = await bounded(self.settings, pipe.execute())
        return {d: s or "removed" for d, s in zip(devices, replies, strict=True)}

    async def empty(self) -> bool:
        """True when no node and no device was ever registered in this namespace (or
        Redis lost them)."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(k.devices, k.nodes)
        (count,) = await bounded(self.settings, pipe.execute())
        return int(count) == 0

    async def nodes(self) -> list[NodeStatus]:
        """Every node known: those holding a lease, and dead ones (their record stays
        until they register again or are forgotten), sorted by id."""
        return await bounded(self.settings, self._nodes())

    async def _nodes(self) -> list[NodeStatus]:
        k = self.keys
        now = _now_ms(await self.redis.time())
        leases = dict(await self.redis.zrange(k.nodes, 0, -1, withscores=True))
        ids = sorted(
            set(leases) | {d.split("/", 1)[0] for d in await self.redis.smembers(k.devices)}
        )
        pipe = self.redis.pipeline(transaction=False)
        for node in ids:
            pipe.hgetall(k.node(node))
        hashes = await pipe.execute()
        out = []
        for node, h in zip(ids, hashes, strict=True):
            if not h:
                continue
            deadline = leases.get(node)
            if deadline is None:
                deadline = float(h.get("lease") or 0)
            out.append(
                NodeStatus(
                    node=node,
                    url=h.get("url", ""),
                    devices=tuple(filter(None, h.get("devices", "").split(","))),
                    alive=node in leases and deadline > now,
                    state=_node_state(h.get("state", "up"), deadline > now),
                    lease_ms=int(deadline) - now,
                    started_at_ms=int(h.get("started_at", 0)),
                    version=h.get("version", ""),
                    models=tuple(filter(None, h.get("models", "").split(","))),
                )
            )
        return out

    async def devices(self) -> list[DeviceStatus]:
        """Every registered device with its liveness and live load, sorted by id."""
        return await bounded(self.settings, self._devices())

    async def _devices(self) -> list[DeviceStatus]:
        k = self.keys
        now = _now_ms(await self.redis.time())
        ids = sorted(await self.redis.smembers(k.devices))
        pipe = self.redis.pipeline(transaction=False)
        for device in ids:
            pipe.hgetall(k.device(device))
            pipe.zcount(k.load(device), now, "+inf")
            pipe.hexists(k.route, device)
        replies = await pipe.execute()
        hashes = replies[0::3]
        nodes = sorted({h["node"] for h in hashes if h})
        pipe = self.redis.pipeline(transaction=False)
        for node in nodes:
            pipe.hget(k.node(node), "models")
        served = {
            n: tuple(filter(None, (m or "").split(",")))
            for n, m in zip(nodes, await pipe.execute(), strict=True)
        }
        alive_nodes = {
            node
            for node, deadline in await self.redis.zrange(k.nodes, 0, -1, withscores=True)
            if deadline > now
        }
        out = []
        for device, h, load, listed in zip(ids, hashes, replies[1::3], replies[2::3], strict=True):
            if not h:
                continue
            out.append(
                DeviceStatus(
                    device=device,
                    node=h["node"],
                    index=int(h["index"]),
                    kind=h["kind"],
                    name=h["name"],
                    uuid=h["uuid"],
                    arch=h["arch"],
                    memory_mb=int(h["memory"]),
                    capacity=int(h["capacity"]),
                    weight=int(h["weight"]),
                    provider=h.get("provider", ""),
                    state=h["state"],
                    reason=h.get("reason", ""),
                    alive=bool(listed) and h["node"] in alive_nodes,
                    load=int(load),
                    models=served.get(h["node"], ()),
                )
            )
        return out

    async def fleet_view(self, node: str, every_ms: int) -> FleetView | None:
        """The fleet's live episodes and capacity per model version (:class:`ModelLoad`),
        read at most ``every_ms`` ago by some node of the fleet. One call a period from
        each node costs three commands (``SET NX PX``, ``GET``, ``TIME``); the first caller
        of a period (``node``, the reader) also reads the fleet (:meth:`fleet_load`: one
        command per listed device and live node, plus two) and writes the result for the
        others, so the cost grows with nodes + devices, not nodes x devices. None: no read
        yet (the reader of this period has not written it), or the last one is older than
        three periods."""
        return await bounded(self.settings, self._fleet_view(node, every_ms))

    async def _fleet_view(self, node: str, every_ms: int) -> FleetView | None:
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(k.view_reader, node, nx=True, px=every_ms)
        pipe.get(k.view)
        pipe.time()
        reader, stored, now = await pipe.execute()
        now_ms = _now_ms(now)
        if reader:
            models = await self._fleet_load(now_ms)
            doc = {"at": now_ms, "models": {m.model: [m.live, m.capacity] for m in models}}
            await self.redis.set(k.view, json.dumps(doc, separators=(",", ":")), px=3 * every_ms)
            return FleetView(now_ms, now_ms, tuple(models))
        if stored is None:
            return None
        doc = json.loads(stored)
        at = int(doc["at"])
        if now_ms - at > 3 * every_ms:
            return None
        loads = (ModelLoad(m, int(v[0]), int(v[1])) for m, v in doc["models"].items())
        return FleetView(at, now_ms, tuple(loads))

    async def fleet_load(self) -> list[ModelLoad]:
        """:class:`ModelLoad` of every model version a live, up node serves, sorted (read
        now: the route, the live nodes, each of their records and each listed device's live
        load)."""

        async def read() -> list[ModelLoad]:
            return await self._fleet_load(_now_ms(await self.redis.time()))

        return await bounded(self.settings, read())

    async def _fleet_load(self, now_ms: int) -> list[ModelLoad]:
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(k.route)
        pipe.zrangebyscore(k.nodes, f"({now_ms}", "+inf")
        route, alive = await pipe.execute()
        nodes = sorted(alive)
        listed = sorted(
            (device, fields[0], int(fields[2]))
            for device, value in route.items()
            if (fields := value.split(" ", 4))[0] in alive and fields[1] == "active"
        )
        pipe = self.redis.pipeline(transaction=False)
        for n in nodes:
            pipe.hmget(k.node(n), "state", "models")
        for device, _, _ in listed:
            pipe.zcount(k.load(device), now_ms, "+inf")
        replies = await pipe.execute()
        served: dict[str, tuple[str, ...]] = {}
        live: dict[str, int] = {}
        capacity: dict[str, int] = {}
        for n, (state, models) in zip(nodes, replies[: len(nodes)], strict=True):
            if state == "up":
                served[n] = tuple(filter(None, (models or "").split(",")))
                for m in served[n]:
                    live.setdefault(m, 0)
                    capacity.setdefault(m, 0)
        for (_, n, cap), load in zip(listed, replies[len(nodes) :], strict=True):
            for m in served.get(n, ()):
                live[m] += int(load)
                capacity[m] += cap
        return [ModelLoad(m, live[m], capacity[m]) for m in sorted(live)]

    async def models(self) -> list[ModelStatus]:
        """Every (name, version) registered by a node known now (alive or not), with the
        live nodes that serve it, sorted by name then registration (oldest first)."""
        return await bounded(self.settings, self._models())

    async def _models(self) -> list[ModelStatus]:
        k = self.keys
        serving: dict[str, list[str]] = {}
        devices: dict[str, int] = {}
        for n in await self._nodes():
            for m in n.models:
                serving.setdefault(m, [])
                devices.setdefault(m, 0)
                if n.alive:
                    serving[m].append(n.node)
                    devices[m] += len(n.devices)
        names = sorted({ModelId.parse(m).name for m in serving})
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.zrange(k.versions(name), 0, -1, withscores=True)
            pipe.hgetall(k.rollout(name))
        replies = await pipe.execute()
        out = []
        for name, versions, weights in zip(names, replies[0::2], replies[1::2], strict=True):
            newest = versions[-1][0] if versions else ""
            for version, at in versions:
                m = f"{name}@{version}"
                if m not in serving:
                    continue
                w = weights.get(version)
                out.append(
                    ModelStatus(
                        name=name,
                        version=version,
                        registered_at_ms=int(at),
                        weight=(int(w) if w is not None else 0) if weights else None,
                        newest=version == newest,
                        nodes=tuple(serving[m]),
                        devices=devices[m],
                    )
                )
        return out

    async def contract(self, model: ModelId) -> str | None:
        """The contract (JSON text) a node registered for ``model``, or None."""
        value = await bounded(self.settings, self.redis.get(self.keys.contract(str(model))))
        return value.decode() if isinstance(value, bytes) else value

    async def rollout(self, name: str, version: str, weight: int) -> None:
        """Give ``version`` of model ``name`` ``weight`` shares of its new episodes (0:
        none). Once a name has weights, only its versions of weight > 0 take new
        episodes, by exact weighted round-robin from now on; running episodes keep
        theirs. Raises :class:`UnknownModel` for a version no node registered,
        :class:`InvalidArgument` for a bad name, version or weight."""
        check_model_part("name", name)
        check_model_part("version", version)
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= MAX_WEIGHT:
            raise InvalidArgument("rollout weight", weight, f"must be an integer 0-{MAX_WEIGHT}")
        k = self.keys

        async def write() -> None:
            if await self.redis.zscore(k.versions(name), version) is None:
                raise UnknownModel(f"{name}@{version}")
            pipe = self.redis.pipeline(transaction=False)  # no MULTI: the ACL of docs/security.md
            pipe.hset(k.rollout(name), version, weight)
            pipe.delete(k.picks(name))
            pipe.xadd(
                k.events,
                {"type": "rollout", "model": name, "version": version, "weight": str(weight)},
                maxlen=self.settings.events_maxlen,
                approximate=True,
            )
            await pipe.execute()

        await bounded(self.settings, write())

    async def clear_rollout(self, name: str) -> bool:
        """Drop the weights of model ``name``: its newest registered version takes every
        new episode again. ``True`` when it had weights."""
        check_model_part("name", name)
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)  # no MULTI: the ACL of docs/security.md
        pipe.delete(k.rollout(name))
        pipe.delete(k.picks(name))
        pipe.xadd(
            k.events,
            {"type": "rollout", "model": name, "version": "", "weight": ""},
            maxlen=self.settings.events_maxlen,
            approximate=True,
        )
        had, _, _ = await bounded(self.settings, pipe.execute())
        return bool(had)

    async def episodes(
        self, device: str | None = None, node: str | None = None
    ) -> list[EpisodeRow]:
        """Live assignments, from the devices' load sets, and those handed over by a graceful
        stop and not yet claimed anew (``moved``), optionally filtered. With
        ``device`` it reads that device's load set only (at most its capacity of members).
        Raises :class:`UnknownDevice` for a device that is not registered and
        :class:`UnknownNode` for a ``node`` with no record and no device."""
        return await bounded(self.settings, self._episodes(device, node))

    async def _episodes(self, device: str | None, node: str | None) -> list[EpisodeRow]:
        k = self.keys
        if device is not None:
            if not await self.redis.exists(k.device(device)):
                raise UnknownDevice(device)
            chosen = [device]
        else:
            chosen = sorted(await self.redis.smembers(k.devices))
        if node is not None:
            chosen = [d for d in chosen if d.split("/", 1)[0] == node]
            if not chosen and not await self.redis.exists(k.node(node)):
                raise UnknownNode(node)
        now = _now_ms(await self.redis.time())
        pipe = self.redis.pipeline(transaction=False)
        for d in chosen:
            pipe.zrangebyscore(k.load(d), now, "+inf")
            pipe.zrangebyscore(k.moved(d), now, "+inf")
        members = await pipe.execute()
        # (device, episode, listed as handed over): a handed-over entry counts only while
        # the value still says so (not once the episode was claimed anew, even on d)
        pairs = [
            (d, ep, was_moved)
            for d, live, moved in zip(chosen, members[0::2], members[1::2], strict=True)
            for eps, was_moved in ((live, False), (moved, True))
            for ep in eps
        ]
        pipe = self.redis.pipeline(transaction=False)
        for _, ep, _ in pairs:
            pipe.get(k.episode(ep))
            pipe.pttl(k.episode(ep))
        values = await pipe.execute()
        rows = []
        for (d, ep, was_moved), value, ttl in zip(pairs, values[0::2], values[1::2], strict=True):
            if not value:
                continue
            # "<device> <token> <claim id>[ <model>][ moved]"
            owner, token, *rest = value.split(" ")
            if owner == d and ("moved" in rest) == was_moved:
                model = next((r for r in rest if "@" in r), "")
                rows.append(EpisodeRow(ep, d, int(token), int(ttl), was_moved, model))
        return rows

    async def events(self, since: str = "-", count: int = 100) -> list[tuple[str, dict[str, str]]]:
        """Up to ``count`` events after ``since`` (a stream id; ``-`` is the start)."""
        start = since if since == "-" else f"({since}"
        reply = await bounded(
            self.settings, self.redis.xrange(self.keys.events, start, "+", count=count)
        )
        return [(str(i), dict(f)) for i, f in reply]

    async def latest_events(self, count: int) -> tuple[list[tuple[str, dict[str, str]]], str]:
        """The last ``count`` events (oldest first), and the id to follow on from with
        :meth:`wait_events` (``0-0`` for an empty stream; never ``$``, which would miss
        what arrives between two waits)."""
        reply = await bounded(
            self.settings, self.redis.xrevrange(self.keys.events, count=max(count, 1))
        )
        newest_first = [(str(i), dict(f)) for i, f in reply]
        cursor = newest_first[0][0] if newest_first else "0-0"
        return newest_first[:count][::-1], cursor

    async def wait_events(self, since: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        """Events after the id ``since``, waiting up to ``block_ms`` for the first one.

        The wait is capped below the socket timeout (``redis_timeout_s``), so a quiet
        stream returns ``[]`` instead of timing out; callers loop."""
        k = self.keys
        block = max(1, min(block_ms, round(self.settings.redis_timeout_s * 1000) - 100))
        reply = await bounded(
            self.settings, self.redis.xread({k.events: since}, block=block, count=100)
        )
        if not reply:
            return []
        entries = reply[k.events][0] if isinstance(reply, dict) else reply[0][1]
        return [(str(i), dict(f)) for i, f in entries]
