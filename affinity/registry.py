"""Nodes, devices and their states: register, renew, deregister, drain, list.

A node registers its devices (ids ``<node>/<index>``) and holds a lease it renews every
``lease_ttl/3``; a node whose lease lapsed is dead for the claim script, which moves its
episodes on their next request. Device hashes outlive nodes so that an operator's drain
survives a restart.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple

from affinity.claims import bounded
from affinity.config import Settings
from affinity.errors import InvalidArgument, NodeConflict, UnknownDevice
from affinity.scripts import Scripts

__all__ = [
    "STATES",
    "DeviceRegistration",
    "DeviceStatus",
    "EpisodeRow",
    "NodeStatus",
    "Registry",
    "StateChange",
    "check_node_id",
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

    def __post_init__(self) -> None:
        for name in ("capacity", "weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"device {name}", value, "must be an integer >= 1")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise InvalidArgument("device index", self.index, "must be an integer >= 0")
        if self.kind not in ("cuda", "cpu"):
            raise InvalidArgument("device kind", self.kind, "must be 'cuda' or 'cpu'")

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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NodeStatus:
    node: str
    url: str
    devices: tuple[str, ...]
    alive: bool
    lease_ms: int  # ms left on the lease (negative: lapsed that long ago)
    started_at_ms: int
    version: str

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["devices"] = list(self.devices)
        return d


@dataclass(frozen=True)
class EpisodeRow:
    episode: str
    device: str
    token: int
    ttl_ms: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _now_ms(reply: Sequence[int]) -> int:
    return int(reply[0]) * 1000 + int(reply[1]) // 1000


class Registry:
    """Async registry API over one Redis client."""

    def __init__(self, redis: Any, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self.keys = settings.keys
        self.scripts = Scripts.bind(redis)

    async def register(
        self,
        node: str,
        url: str,
        devices: Sequence[DeviceRegistration],
        version: str = "",
        instance: str = "",
    ) -> int:
        """(Re)register ``node`` and its devices; start its lease. Returns the lease
        deadline (ms, Redis server time). Idempotent.

        ``instance`` identifies the process: while another instance holds a current lease
        on the same node id, nothing is written and :class:`NodeConflict` is raised."""
        check_node_id(node)
        if not devices:
            raise InvalidArgument("devices", [], "a node registers at least one device")
        indexes = [d.index for d in devices]
        if len(set(indexes)) != len(indexes):
            raise InvalidArgument("device indexes", indexes, "must be unique")
        if not url:
            raise InvalidArgument("url", url, "a node needs an advertise URL")
        k = self.keys
        args: list[str | int] = [
            node,
            url,
            self.settings.lease_ttl_ms,
            k.prefix,
            self.settings.events_maxlen,
            version,
        ]
        args.append(instance)
        for d in devices:
            args.extend(d.fields())
        async with bounded(self.settings):
            deadline = int(
                await self.scripts.register(
                    keys=[k.node(node), k.nodes, k.devices, k.events], args=args
                )
            )
        if deadline < 0:
            raise NodeConflict(node)
        return deadline

    async def renew(self, node: str, instance: str = "") -> bool:
        """Extend the lease. ``False`` means the node is no longer registered (its lease
        lapsed, Redis lost its data, or another instance took the id over): it must
        :meth:`register` again."""
        k = self.keys
        async with bounded(self.settings):
            deadline = await self.scripts.renew(
                keys=[k.node(node), k.nodes], args=[node, self.settings.lease_ttl_ms, instance]
            )
        return int(deadline) >= 0

    async def deregister(self, node: str, instance: str = "") -> int:
        """End the lease and release every episode on the node's devices (they move at
        once). Returns how many were released; -1 when another instance holds the node
        id (nothing is touched)."""
        k = self.keys
        async with bounded(self.settings):
            return int(
                await self.scripts.deregister(
                    keys=[k.node(node), k.nodes, k.events],
                    args=[node, k.prefix, self.settings.events_maxlen, instance],
                )
            )

    async def set_state(
        self, device: str, state: str, reason: str = "", only_if: str | None = None
    ) -> StateChange:
        """Ask for a device state; return what it was, whether it changed, what it is now.

        ``only_if`` makes it conditional on the current state. A ``down`` device asked to
        drain stays down and drains when it comes back up; a ``down`` device asked to be
        ``active`` (its probe passed) returns to a drain it had before. Raises
        :class:`UnknownDevice` (nothing written) and :class:`InvalidArgument`.
        """
        if state not in STATES:
            raise InvalidArgument("state", state, f"must be one of {', '.join(STATES)}")
        if only_if is not None and only_if not in STATES:
            raise InvalidArgument("only_if", only_if, f"must be one of {', '.join(STATES)}")
        if not isinstance(device, str) or not device:
            raise InvalidArgument("device", device, "must be a non-empty device id")
        if len(reason) > MAX_REASON:
            raise InvalidArgument("reason", reason, f"must be at most {MAX_REASON} characters")
        k = self.keys
        async with bounded(self.settings):
            reply = await self.scripts.set_state(
                keys=[k.device(device), k.events],
                args=[device, state, reason, self.settings.events_maxlen, only_if or ""],
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
        async with bounded(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            for device in devices:
                pipe.hget(k.device(device), "state")
            replies = await pipe.execute()
        return {d: s or "removed" for d, s in zip(devices, replies, strict=True)}

    async def nodes(self) -> list[NodeStatus]:
        """Every node in the nodes index, alive or lapsed (lapsed ones until reaped)."""
        k = self.keys
        async with bounded(self.settings):
            now = _now_ms(await self.redis.time())
            entries = await self.redis.zrange(k.nodes, 0, -1, withscores=True)
            pipe = self.redis.pipeline(transaction=False)
            for node, _ in entries:
                pipe.hgetall(k.node(node))
            hashes = await pipe.execute()
        out = []
        for (node, deadline), h in zip(entries, hashes, strict=True):
            out.append(
                NodeStatus(
                    node=node,
                    url=h.get("url", ""),
                    devices=tuple(filter(None, h.get("devices", "").split(","))),
                    alive=bool(h) and deadline > now,
                    lease_ms=int(deadline) - now,
                    started_at_ms=int(h.get("started_at", 0)),
                    version=h.get("version", ""),
                )
            )
        return out

    async def devices(self) -> list[DeviceStatus]:
        """Every registered device with its liveness and live load, sorted by id."""
        k = self.keys
        async with bounded(self.settings):
            now = _now_ms(await self.redis.time())
            ids = sorted(await self.redis.smembers(k.devices))
            pipe = self.redis.pipeline(transaction=False)
            for device in ids:
                pipe.hgetall(k.device(device))
                pipe.zcount(k.load(device), now, "+inf")
            replies = await pipe.execute()
            hashes = replies[0::2]
            node_ids = sorted({h.get("node", "") for h in hashes if h})
            pipe = self.redis.pipeline(transaction=False)
            for node in node_ids:
                pipe.zscore(k.nodes, node)
                pipe.exists(k.node(node))
            lease = await pipe.execute()
        alive_nodes = {
            node
            for node, deadline, exists in zip(node_ids, lease[0::2], lease[1::2], strict=True)
            if deadline is not None and deadline > now and exists
        }
        out = []
        for device, h, load in zip(ids, hashes, replies[1::2], strict=True):
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
                    alive=h["node"] in alive_nodes,
                    load=int(load),
                )
            )
        return out

    async def episodes(
        self, device: str | None = None, node: str | None = None
    ) -> list[EpisodeRow]:
        """Live assignments, from the devices' load sets, optionally filtered."""
        k = self.keys
        all_devices = await self.devices()
        chosen = [
            d.device
            for d in all_devices
            if (device is None or d.device == device) and (node is None or d.node == node)
        ]
        if device is not None and not any(d.device == device for d in all_devices):
            raise UnknownDevice(device)
        async with bounded(self.settings):
            now = _now_ms(await self.redis.time())
            pipe = self.redis.pipeline(transaction=False)
            for d in chosen:
                pipe.zrangebyscore(k.load(d), now, "+inf")
            members = await pipe.execute()
            pairs = [(d, ep) for d, eps in zip(chosen, members, strict=True) for ep in eps]
            pipe = self.redis.pipeline(transaction=False)
            for _, ep in pairs:
                pipe.get(k.episode(ep))
                pipe.pttl(k.episode(ep))
            values = await pipe.execute()
        rows = []
        for (d, ep), value, ttl in zip(pairs, values[0::2], values[1::2], strict=True):
            if not value:
                continue
            owner, _, token = value.rpartition(" ")
            if owner == d:
                rows.append(EpisodeRow(episode=ep, device=d, token=int(token), ttl_ms=int(ttl)))
        return rows

    async def events(self, since: str = "-", count: int = 100) -> list[tuple[str, dict[str, str]]]:
        """Up to ``count`` events after ``since`` (a stream id; ``-`` is the start)."""
        k = self.keys
        start = since if since == "-" else f"({since}"
        async with bounded(self.settings):
            reply = await self.redis.xrange(k.events, start, "+", count=count)
        return [(str(i), dict(f)) for i, f in reply]

    async def latest_events(self, count: int) -> tuple[list[tuple[str, dict[str, str]]], str]:
        """The last ``count`` events (oldest first), and the id to follow on from with
        :meth:`wait_events` (``0-0`` for an empty stream; never ``$``, which would miss
        what arrives between two waits)."""
        async with bounded(self.settings):
            reply = await self.redis.xrevrange(self.keys.events, count=max(count, 1))
        newest_first = [(str(i), dict(f)) for i, f in reply]
        cursor = newest_first[0][0] if newest_first else "0-0"
        return newest_first[:count][::-1], cursor

    async def wait_events(self, since: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        """Events after the id ``since``, waiting up to ``block_ms`` for the first one.

        The wait is capped below the socket timeout (``redis_timeout_s``), so a quiet
        stream returns ``[]`` instead of timing out; callers loop."""
        k = self.keys
        block = max(1, min(block_ms, round(self.settings.redis_timeout_s * 1000) - 100))
        async with bounded(self.settings):
            reply = await self.redis.xread({k.events: since}, block=block, count=100)
        if not reply:
            return []
        entries = reply[k.events][0] if isinstance(reply, dict) else reply[0][1]
        return [(str(i), dict(f)) for i, f in entries]
