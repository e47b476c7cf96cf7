"""Read-only views of the fleet for operators, the fleet page and the autoscaler: nodes,
devices, models, live episodes, and the fleet's load per model version.

Nothing here decides: the claim script and the owners do. Nothing here writes but the
fleet view (:meth:`Inventory.fleet_view`), which one node a period caches for the others. Each
view is a few pipelined reads (no Lua, no MULTI), so it may mix instants a few ms apart. A
row may describe an episode that expired a moment later. Liveness is judged by the Redis
server's clock (``TIME``), not the caller's. ``episodes`` reads the devices' load sets, so
its cost grows with the number of devices asked about.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from affinity.config import backstop_beyond_idle_ms
from affinity.errors import UnknownDevice, UnknownNode
from affinity.models import ModelId
from affinity.registry import ONE_PROCESS, NodeProcesses
from affinity.scripts import RedisApi, bounded

__all__ = [
    "DeviceStatus",
    "EpisodeRow",
    "FleetView",
    "Inventory",
    "ModelLoad",
    "ModelStatus",
    "NodeStatus",
]


class _Row:
    """A view's row: :meth:`to_json` gives its fields, tuples as lists."""

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}


@dataclass(frozen=True)
class DeviceStatus(_Row):
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
    score: float | None = None  # its published step time (ms): scored placement; None: none


@dataclass(frozen=True)
class NodeStatus(_Row):
    node: str
    url: str
    devices: tuple[str, ...]
    alive: bool
    state: str  # up | leaving | down (its lease lapsed) | left (it deregistered)
    lease_ms: int  # ms left on the lease (negative: lapsed that long ago)
    started_at_ms: int
    version: str
    models: tuple[str, ...] = ()  # "name@version" on every one of its devices
    # its shape and processes as its last registration or renewal published them (issue
    # 43); a node of an older version publishes none and reads as one process
    processes: NodeProcesses = ONE_PROCESS

    def to_json(self) -> dict[str, Any]:
        """Its fields, the processes flattened in: ``fronts`` (1: one process) and
        ``processes`` (a list: role, pid, since_ms, restarts, lag_p99_ms); ``workers`` and
        ``helpers`` (the fronts' fork server: role, pid, since_ms, restarts) when there are
        some."""
        out = super().to_json()
        out.update(self.processes.to_json())
        return out


@dataclass(frozen=True)
class ModelStatus(_Row):
    """One registered (name, version): who serves it and what share of new episodes of
    its name it takes."""

    name: str
    version: str
    registered_at_ms: int  # when a node first registered it
    weight: int | None  # the operator's rollout weight; None: no weights for this name
    newest: bool  # the newest registered version of its name
    nodes: tuple[str, ...]  # the live nodes that serve it
    devices: int  # their devices


@dataclass(frozen=True)
class EpisodeRow(_Row):
    episode: str
    device: str
    token: int
    ttl_ms: int  # ms left on its backstop: Redis drops it then if nobody slid it
    moved: bool = False  # handed over by a graceful stop: its next step is reassigned
    model: str = ""  # "name@version" it was claimed with ("": its node registered none)
    idle_ms: int = 0  # ms until its owner ends it if no step comes (Inventory.idle_left)


def _node_state(recorded: str, leased: bool) -> str:
    """``left`` for a node that deregistered, ``down`` for one whose lease lapsed.

    Else what it recorded (``up``, ``leaving``). A node that left keeps its record until it
    registers again or is forgotten."""
    if recorded == "left":
        return "left"
    return recorded if leased else "down"


class ModelLoad(NamedTuple):
    """One model version's share of the fleet, on the devices that may take a new episode.

    Those devices are listed by a live node that serves the model and is up (not leaving),
    and are active. A
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


def _now_ms(reply: Sequence[int]) -> int:
    return int(reply[0]) * 1000 + int(reply[1]) // 1000


class Inventory(RedisApi):
    """Read-only views over one Redis client (a :class:`RedisApi`: every call bounded)."""

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
                    processes=NodeProcesses.decode(h.get("procs")),
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
        pipe.hgetall(k.scored)
        *replies, scored = await pipe.execute()
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
                    score=_score(scored.get(device), now),
                )
            )
        return out

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

    async def idle_left(self, node: str, ttl_ms: int) -> int:
        """When the owner ``node`` ends an episode whose backstop has ``ttl_ms`` left if no
        step comes (ms from now, >= 0). The backstop runs two of the owner's lease TTLs +
        3 s past its idle timeout, counted from the claim or the owner's last slide. So it
        is exact for an episode not stepped since its claim. A stepping one's owner slides
        about once an idle timeout: it may be off by up to that. The lease TTL is the
        node's own (``leases``), else this caller's."""
        score = await bounded(self.settings, self.redis.zscore(self.keys.leases, node))
        return self._idle_ms(ttl_ms, score)

    def _idle_ms(self, ttl_ms: int, lease_ms: float | None) -> int:
        lease = int(lease_ms) if lease_ms else self.settings.lease_ttl_ms
        return max(0, ttl_ms - backstop_beyond_idle_ms(lease))

    async def served_by(self, target: str) -> tuple[str, ...]:
        """The models (``"name@version"``) that ``target`` serves, as its node registered
        them: a device (``node/index``) serves its node's. Raises :class:`UnknownDevice` or
        :class:`UnknownNode` when ``target`` is not registered."""
        return await bounded(self.settings, self._served_by(target))

    async def _served_by(self, target: str) -> tuple[str, ...]:
        k = self.keys
        node = target
        if "/" in target:
            node = await self.redis.hget(k.device(target), "node")
            if node is None:
                raise UnknownDevice(target)
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(k.node(node))
        pipe.hget(k.node(node), "models")
        exists, models = await pipe.execute()
        if not exists:
            raise UnknownNode(node)
        return tuple(filter(None, (models or "").split(",")))

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
        pipe.zrange(k.leases, 0, -1, withscores=True)
        for d in chosen:
            pipe.zrangebyscore(k.load(d), now, "+inf")
            pipe.zrangebyscore(k.moved(d), now, "+inf")
        leases, *members = await pipe.execute()
        lease_of = dict(leases)
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
                idle = self._idle_ms(int(ttl), lease_of.get(d.split("/", 1)[0]))
                rows.append(EpisodeRow(ep, d, int(token), int(ttl), was_moved, model, idle))
        return rows

    async def fleet_view(self, node: str, every_ms: int) -> FleetView | None:
        """The fleet's live episodes and capacity per model version (:class:`ModelLoad`),
        read at most ``every_ms`` ago by some node of the fleet. One call a period from
        each node costs three commands (``SET NX PX``, ``GET``, ``TIME``). The first caller
        of a period (``node``, the reader) also reads the fleet and writes the result for
        the others. That read (:meth:`fleet_load`) costs one command per listed device and
        live node, plus two. So the cost grows with nodes + devices, not nodes x devices.
        None: no read
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
        """:class:`ModelLoad` of every model version a live, up node serves, sorted.

        It is read now: the route, the live nodes, each of their records and each listed
        device's live load."""

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


def _score(published: str | None, now_ms: int) -> float | None:
    """A device's published step time (ms) from ``Keys.scored``; None: none, or expired."""
    if not published:
        return None
    expires, step, _ = published.split(" ")
    return float(step) if int(expires) > now_ms else None
