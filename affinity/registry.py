"""Node lifecycle and device states: register, renew, flush, leave, deregister, forget;
the cluster secret, the fleet marker, drain and undrain.

A node registers its devices (ids ``<node>/<index>``) and holds a lease it renews every
``lease_ttl/3``. A node whose lease lapsed is dead for the claim script. That script
moves its episodes on their next request. The first claim or renewal that sees the lapse
writes its ``node-down`` event. Device hashes outlive nodes, so an operator's drain survives a
restart; a dead node's record stays until it registers again or is forgotten. Hazards: a
renewal answered ``None`` or :class:`NodeConflict` means this process must stop serving;
never call :meth:`Registry.new_fleet` after Redis lost a running fleet's data. The
read-only views are in :mod:`affinity.inventory`, the event stream in
:mod:`affinity.events`, rollouts and contracts in :mod:`affinity.models`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple, NoReturn

from redis.asyncio import RedisCluster
from redis.exceptions import NoPermissionError

from affinity.errors import (
    AffinityError,
    InvalidArgument,
    NodeConflict,
    NotReplicated,
    SecretMismatch,
    UnknownDevice,
    UnknownNode,
)
from affinity.models import MAX_WEIGHT, ModelId
from affinity.scripts import Script, ScriptCaller, bounded, evalsha, replicated

__all__ = [
    "FORK_SERVER_ROLE",
    "MAX_DEVICES_PER_NODE",
    "MAX_FRONTS",
    "MAX_HELPERS",
    "MAX_WEIGHT",
    "ONE_PROCESS",
    "STATES",
    "DeviceRegistration",
    "DeviceScore",
    "FlushResult",
    "Flushed",
    "Held",
    "HeldEpisode",
    "LeaseTerms",
    "MoveRequest",
    "NodeProcess",
    "NodeProcesses",
    "Registered",
    "Registration",
    "Registry",
    "Renewal",
    "StateChange",
    "check_node_id",
    "secret_digest",
]

State = Literal["active", "draining", "down"]
STATES: tuple[State, ...] = ("active", "draining", "down")
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_REASON = 256


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


@dataclass(frozen=True)
class DeviceScore:
    """What a node publishes for one device with room at a renewal (scored placement):
    the step time (ms) a new episode would see there, and how much one more episode adds
    to it (ms). Both finite and >= 0; :meth:`fields` checks them."""

    index: int
    step_ms: float
    cost_ms: float

    def fields(self) -> list[str | int]:
        for what, value in (("step time (ms)", self.step_ms), ("cost (ms)", self.cost_ms)):
            if not 0 <= value < 1e9:  # (NaN fails too)
                raise InvalidArgument(f"device score {what}", value, "must be in [0, 1e9)")
        return [self.index, f"{self.step_ms:.3f}", f"{self.cost_ms:.3f}"]


class StateChange(NamedTuple):
    previous: str
    changed: bool
    state: str  # the state now


class HeldEpisode(NamedTuple):
    """An episode an owner serves from memory: its claim (device, token, claim id, and the
    ``"name@version"`` it was claimed with, ``""`` in a fleet without models)."""

    episode: str
    device: str
    token: int
    claim: str
    model: str = ""


class Registration(NamedTuple):
    """What a registration answered: the lease deadline (ms, server time) and more.

    It also holds the grace period left (ms; 0: none), the re-asserted episodes Redis gives
    to another claim, and the lease terms (:class:`LeaseTerms`)."""

    deadline: int
    grace_ms: int
    lost: list[str]
    terms: LeaseTerms


class LeaseTerms(NamedTuple):
    """The lease a registration or renewal granted, and the fleet's longest lease TTL.

    Both are in ms. The grant is the node's own TTL, shorter while the fleet has not heard
    of it yet. The node passes the longest TTL on as what it knows (``known_lease_ms``)."""

    granted_ms: int
    longest_ms: int


class Renewal(NamedTuple):
    """What a renewal answered: the lease terms, revoked assignments and requested moves.

    ``revoked`` holds the (episode, token) of the node's assignments someone else released
    in Redis that the owner has not carried out. ``moves`` are the moves an operator asked
    of its episodes (:class:`MoveRequest`)."""

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


MAX_FRONTS = 64
"""The most front door processes a node has (``--front-doors``)."""
MAX_DEVICES_PER_NODE = 64
"""The most device worker processes a node describes (``--device-workers process``: one
per device). With :data:`MAX_FRONTS` it bounds the description of a node's processes (at
most ``MAX_FRONTS`` + 1 + ``MAX_DEVICES_PER_NODE`` rows, ~10 KiB)."""
MAX_ROLE = 8
MAX_HELPERS = 4
"""The most helper processes a node describes (``NodeProcesses.helpers``: today one, the
fronts' fork server)."""
FORK_SERVER_ROLE = "forksrv"
"""The role of the fronts' fork server among a node's helpers (``node/forkserver.py``)."""


@dataclass(frozen=True)
class NodeProcess:
    """One process of a node as its registration and renewals publish it.

    ``role`` is ``core`` (the node's own process: with one process it also serves the doors),
    a front's index (``"0"`` ... ``"63"``), or ``dev<index>`` for a device's worker process
    (``"dev0"`` ... ``"dev63"``, ``--device-workers process``). ``since_ms`` is when it
    started (the node's wall clock, ms since the epoch; the core's: when its service was
    built, once its models loaded); ``restarts`` how many times the core restarted that
    front or worker since the core started (0 for the core). ``lag_p99_ms`` is the 99th
    percentile of its event loop's lag over the samples since the node's last renewal, as the
    upper bound of its ``affinity_event_loop_lag_seconds`` bucket (ms): ``None`` when it
    sampled nothing since, and always for a worker (it has no event loop), ``math.inf`` past
    the largest bound (2.5 s)."""

    role: str
    pid: int
    since_ms: int
    restarts: int = 0
    lag_p99_ms: float | None = None

    @property
    def is_worker(self) -> bool:
        """Whether it is a device's worker process (role ``dev<index>``)."""
        return self.role.startswith("dev")

    def to_json(self) -> dict[str, Any]:
        """Its fields; the lag is left out when there was no sample, ``null`` past the
        largest bound (JSON has no infinity)."""
        out: dict[str, Any] = {
            "role": self.role,
            "pid": self.pid,
            "since_ms": self.since_ms,
            "restarts": self.restarts,
        }
        if self.lag_p99_ms is not None:
            out["lag_p99_ms"] = None if math.isinf(self.lag_p99_ms) else self.lag_p99_ms
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> NodeProcess:
        lag = doc.get("lag_p99_ms", 0.0)
        return cls(
            role=str(doc["role"]),
            pid=int(doc["pid"]),
            since_ms=int(doc["since_ms"]),
            restarts=int(doc.get("restarts", 0)),
            lag_p99_ms=None if "lag_p99_ms" not in doc else math.inf if lag is None else float(lag),
        )


@dataclass(frozen=True)
class NodeProcesses:
    """A node's shape and its processes, published in its record (``procs`` field of
    ``Keys.node``) at its registration and each renewal: ``fronts`` is ``--front-doors``
    (1: the core serves the doors itself), ``workers`` the device worker processes (one per
    device with ``--device-workers process``; 0: the devices run in the core's threads),
    ``processes`` those running (the core first, then each front and each worker running
    now; one waiting to be restarted is not listed). ``helpers``: the processes running
    that serve none of the doors nor a device: the fronts' fork server (role
    :data:`FORK_SERVER_ROLE`, with ``--front-doors`` above 1), its restarts counted. They
    are a JSON key of their own, so that a reader of an older version, which counts
    ``processes`` as the core, fronts and workers, counts them right. A record without it (a
    node of an older version) reads as :data:`ONE_PROCESS`; one without ``workers`` as 0,
    without ``helpers`` as none."""

    fronts: int = 1
    processes: tuple[NodeProcess, ...] = ()
    workers: int = 0
    helpers: tuple[NodeProcess, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.fronts, bool) or not 1 <= self.fronts <= MAX_FRONTS:
            raise InvalidArgument("fronts", self.fronts, f"must be 1 to {MAX_FRONTS}")
        if isinstance(self.workers, bool) or not 0 <= self.workers <= MAX_DEVICES_PER_NODE:
            raise InvalidArgument("workers", self.workers, f"must be 0 to {MAX_DEVICES_PER_NODE}")
        # the core, its fronts (none apart from it with one door), its device workers
        most = (1 if self.fronts == 1 else self.fronts + 1) + self.workers
        if len(self.processes) > most:
            raise InvalidArgument("processes", len(self.processes), f"at most {most}")
        if len(self.helpers) > MAX_HELPERS:
            raise InvalidArgument("helpers", len(self.helpers), f"at most {MAX_HELPERS}")
        for p in (*self.processes, *self.helpers):
            if not p.role or len(p.role) > MAX_ROLE:
                raise InvalidArgument("process role", p.role, f"1 to {MAX_ROLE} characters")

    @property
    def restarts(self) -> int:
        """Restarts of the fronts, the device workers and the helpers, all together."""
        return sum(p.restarts for p in (*self.processes, *self.helpers))

    @property
    def fronts_down(self) -> int:
        """Fronts not running now (waiting for their restart, or just starting); 0 with one
        door, or when no process is listed (a record of an older version: nothing known)."""
        if self.fronts == 1 or not self.processes:
            return 0
        running = sum(1 for p in self.processes if p.role != "core" and not p.is_worker)
        return max(0, self.fronts - running)

    @property
    def workers_down(self) -> int:
        """Device workers not running now; 0 when no process is listed."""
        if not self.processes:
            return 0
        return max(0, self.workers - sum(1 for p in self.processes if p.is_worker))

    def to_json(self) -> dict[str, Any]:
        """``fronts`` and ``processes``; ``workers`` and ``helpers`` only when there are
        some, so a reader of an older version sees the record it knows."""
        out: dict[str, Any] = {"fronts": self.fronts}
        if self.workers:
            out["workers"] = self.workers
        out["processes"] = [p.to_json() for p in self.processes]
        if self.helpers:
            out["helpers"] = [p.to_json() for p in self.helpers]
        return out

    def encode(self) -> str:
        """The record's ``procs`` field: :meth:`to_json` as compact JSON."""
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def decode(cls, text: str | None) -> NodeProcesses:
        """The ``procs`` field read back. Missing (a node of an older version) or not
        readable: :data:`ONE_PROCESS`, what such a node is. Without ``workers`` or
        ``helpers``: none. The helpers are what a reader need not understand (a later
        version's may be more, or of roles longer than this one's): those past
        :data:`MAX_HELPERS` or not readable are left out, never the record."""
        if not text:
            return ONE_PROCESS
        try:
            doc = json.loads(text)
            shape = cls(
                int(doc["fronts"]),
                tuple(map(NodeProcess.from_json, doc["processes"])),
                int(doc.get("workers", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError, AffinityError):
            return ONE_PROCESS
        helpers = doc.get("helpers", [])
        kept: list[NodeProcess] = []
        for item in helpers if isinstance(helpers, list) else []:
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                helper = NodeProcess.from_json(item)
                if helper.role and len(helper.role) <= MAX_ROLE and len(kept) < MAX_HELPERS:
                    kept.append(helper)
        return replace(shape, helpers=tuple(kept))


ONE_PROCESS = NodeProcesses()
"""What a record without processes reads as: one process, nothing more known."""


class FlushResult(NamedTuple):
    """What an owner's flush answered: the grace period left (ms) and the lost episodes.

    ``replicated`` says whether its slides may be relied on. ``False``: fewer replicas than
    ``--redis-replicas`` acknowledged them, so a failover could undo them."""

    grace_ms: int
    lost: list[str]
    replicated: bool = True


# The old names of the three result types, kept for one release.
Held = HeldEpisode
Registered = Registration
Flushed = FlushResult


class Registry(ScriptCaller):
    """Async registry API over one Redis client. Every call is bounded by
    ``settings.redis_deadline_s`` and raises :class:`BackendUnavailable` when Redis cannot
    answer in time. ``known_lease_ms`` answers the longest lease TTL of the fleet the
    caller heard of (a node's last :class:`LeaseTerms`; 0: none). A grace period one of
    its calls starts lasts at least that long (``affinity/lua/lib.lua``)."""

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
        episodes: Sequence[HeldEpisode] = (),
        processes: NodeProcesses | None = None,
    ) -> Registration:
        """(Re)register ``node`` and its devices; start its lease. Idempotent.

        ``episodes`` are the ones this process still serves from memory. (It re-registers within
        its own lease after Redis lost its data.) Each is re-asserted in the same script. It is
        written again when missing, with its model, and counted in its device's load. Those
        Redis gives to another claim, or whose model the node no longer serves, come back in
        :attr:`Registration.lost`. A missing fleet marker starts the grace period
        (``Keys.fleet``), reported in :attr:`Registration.grace_ms`.

        ``models`` maps each (name, version) every device serves to its contract. The contract
        is JSON text, stored under :meth:`Keys.contract` for routers that do not serve it. New
        episodes of a model are claimed only on devices that serve it. Without models the
        devices take every episode (the one ring of a fleet that serves one policy).

        Each device's ``state`` (``down`` when the node's crash tracker has it down) is
        registered as given; an operator's drain survives. Devices of this node id that are not
        in ``devices`` are removed. ``instance`` identifies the process: while another instance
        holds a current lease on the same node id, nothing is written and :class:`NodeConflict`
        is raised. With ``settings.redis_replicas`` a registration that re-asserts ``episodes``
        is followed by ``WAIT`` on its connection. It raises :class:`NotReplicated` when fewer
        replicas acknowledged it; nothing it re-asserted may be served on then. One without
        episodes is not waited for. Nothing is served on it alone: every claim on its devices
        comes after it and is waited for.

        ``processes`` is the node's shape and processes, kept in its record for operators
        (None: none kept, the record reads as one process); each renewal publishes it
        anew."""
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
            processes.encode() if processes is not None else "",
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
        return Registration(int(reply[0]), int(reply[1]), [str(e) for e in reply[4:]], terms)

    def _short(self, what: str, acked: int, node: str) -> NoReturn:
        raise NotReplicated(
            what, acked, self.settings.redis_replicas, self.settings.redis_wait_s, f"node {node}"
        )

    async def flush(
        self,
        node: str,
        instance: str,
        slide: Sequence[HeldEpisode],
        idle: Sequence[tuple[str, int]],
    ) -> FlushResult | None:
        """One owner's batch (``affinity/lua/flush.lua``): slide some expiries, release others.

        It slides the backstop expiry of the episodes in ``slide``. Those Redis gives to
        another claim, or lost outside a grace period, come back in :attr:`FlushResult.lost`.
        It releases, token-checked, the ``idle`` ones (episode, token) the owner ended.

        None (nothing written) when this instance holds no current lease on ``node``: renew
        first. With ``settings.redis_replicas`` a flush that slides is followed by ``WAIT`` on
        its connection. :attr:`FlushResult.replicated` says whether enough replicas
        acknowledged it. The owner must not count on slides they did not."""
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
        return FlushResult(int(reply[0]), [str(e) for e in reply[1:]], short is None)

    async def new_fleet(self) -> bool:
        """Declare that no owner serves any episode of this namespace (a new fleet).

        This is for a new fleet on an empty Redis: its first claims need not wait for the
        grace period an empty Redis otherwise gets. (Redis cannot tell a new fleet from one
        that lost its data.) Never call it after Redis lost the data of a running fleet.
        False when the marker was there already (nothing written)."""
        return bool(await bounded(self.settings, self.redis.set(self.keys.fleet, "0", nx=True)))

    async def check_secret(self, secret: str | None) -> None:
        """Join the fleet's cluster secret. One atomic ``SET NX GET``.

        The first node to call this (in a namespace, or after Redis lost its data) records
        :func:`secret_digest` of its secret. Any later caller with a different one gets
        :class:`SecretMismatch` (nothing written)."""
        digest = secret_digest(self.settings.namespace, secret)
        stored = await bounded(
            self.settings, self.redis.set(self.keys.secret, digest, nx=True, get=True)
        )
        if isinstance(stored, bytes):
            stored = stored.decode()
        if stored is not None and not hmac.compare_digest(stored, digest):
            raise SecretMismatch(self.settings.namespace)

    async def renew(
        self,
        node: str,
        instance: str = "",
        done: Sequence[tuple[str, int]] = (),
        scores: Sequence[DeviceScore] = (),
        processes: NodeProcesses | None = None,
    ) -> Renewal | None:
        """Extend the lease. None means the node holds no lease any more (it lapsed, it
        deregistered, or Redis lost its data): it must :meth:`register` again.

        The answer holds the lease granted: count the lease from it, not from the node's
        own TTL. It also holds the (episode, token) of the node's assignments someone else
        (an operator) released in Redis. The owner drops their records and says so in
        ``done`` at its next call. That makes each one's next resolve a reassignment.

        Raises :class:`NodeConflict` when another instance holds the node id with a current
        lease. This process has then lost its registration and must stop serving and exit.
        Raises :class:`NotReplicated` when fewer replicas than ``settings.redis_replicas``
        acknowledged the renewal; the lease must not be counted from it.

        ``scores`` publishes each device's predicted step time for scored placement (one
        per device with room; a device not named keeps its last until it expires with
        this lease). ``processes`` replaces the node's shape and processes in its record
        (None: left as they are); it rides this call, no command more."""
        args = [
            instance,
            self.known_lease_ms(),
            processes.encode() if processes is not None else "",
            len(scores),
        ]
        for score in scores:
            args += score.fields()
        args += [f"{episode} {token}" for episode, token in done]
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
        failover). None where it cannot be told (Redis Cluster, a store without it)."""
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
        drain stays down and drains when it comes back up. A ``down`` device asked to be
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
