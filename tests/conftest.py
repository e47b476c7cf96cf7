"""Shared fixtures: one test body, two backends (fakeredis and a real redis-server).

The real server is this test session's own: a throwaway ``redis-server`` on a free
loopback port, started on first use and killed when the session ends, so two test runs
on one machine never share (or flush) each other's data, and nothing touches 6379.
``AFFINITY_TEST_REDIS_URL`` points the tests at another server instead (its database is
flushed). When no ``redis-server`` can be started, tests that need it FAIL with a
message: they never skip silently.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fakeredis
import pytest
import redis
import redis.asyncio
from redis.asyncio.connection import AbstractConnection

from affinity import Claims, DeviceRegistration, Keys, Registry, Settings
from affinity.events import EventStream
from affinity.inventory import Inventory
from affinity.models import Models

BACKENDS = ["fake", "real"]
_session_redis: list[Any] = []  # this session's RedisServer, started on first use


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test of a module marked ``shapes`` runs once per shape of a node
    (``tests/procs.py``'s ``SHAPES``: ``[one]``, ``[fronts2]``, ``[fronts2-workers]``), every
    ``Node`` it starts in that shape. The module's tests are grouped by shape (module scope),
    so a module's own fixture that starts nodes (it asks for ``node_shape``) starts them once per
    shape. A test marked ``shapes("fronts")`` runs in the shapes that have every trait it
    names alone (``tests/procs.py``'s ``traits``: ``"fronts"``, ``"workers"``; it is about
    them). ``AFFINITY_TEST_SHAPES`` (comma-separated) runs only the shapes it names."""
    marker = metafunc.definition.get_closest_marker("shapes")
    if marker is not None:
        from tests.procs import SHAPES, traits

        wanted = set(marker.args)
        if wanted - {"fronts", "workers"}:
            raise pytest.UsageError(f"{metafunc.definition.nodeid}: no trait {sorted(wanted)}")
        names = [n for n in SHAPES if wanted <= traits(SHAPES[n])]
        chosen = os.environ.get("AFFINITY_TEST_SHAPES")  # e.g. "one": a quicker local run
        unknown = set(chosen.split(",") if chosen else []) - set(SHAPES)
        if unknown:
            raise pytest.UsageError(f"AFFINITY_TEST_SHAPES: no shape {sorted(unknown)}")
        if chosen:
            names = [n for n in names if n in chosen.split(",")]
        metafunc.parametrize("node_shape", names, ids=names, indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def node_shape(request: pytest.FixtureRequest) -> Iterator[str]:
    """The shape of the nodes this module's tests start (``tests/procs.py``'s ``SHAPE`` set
    to its flags): ``"one"`` but in a module marked ``shapes`` (:func:`pytest_generate_tests`),
    or with ``AFFINITY_TEST_SHAPE`` set: the shape every other module's nodes start in (e.g.
    ``fronts2-workers``, to run the whole suite in the multi-process shape)."""
    from tests import procs

    default = os.environ.get("AFFINITY_TEST_SHAPE") or "one"
    if default not in procs.SHAPES:
        raise pytest.UsageError(f"AFFINITY_TEST_SHAPE: no shape {default!r}")
    name = str(getattr(request, "param", default))
    procs.SHAPE = list(procs.SHAPES[name])
    try:
        yield name
    finally:
        procs.SHAPE = []


def require_real_redis() -> str:
    """The URL of this session's real Redis (started here on first use)."""
    url = os.environ.get("AFFINITY_TEST_REDIS_URL")
    if not url:
        if not _session_redis:
            from tests.procs import RedisServer, tmpdir

            server = RedisServer(tmpdir()).start()
            _session_redis.append(server)
            atexit.register(server.stop)
        url = _session_redis[0].url
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.fail(f"real Redis at {url} does not answer ({exc})", pytrace=False)
    return str(url)


@pytest.fixture(scope="session", autouse=True)
def _stop_session_redis() -> Iterator[None]:
    yield
    while _session_redis:
        _session_redis.pop().stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the ``affinity-test-*`` folders the session made (tests/procs.py ``tmpdir``),
    whatever its outcome (tests/procs.py removes them at exit too, for a session cut
    short). The session's Redis goes first: it writes in its folder."""
    from tests.procs import remove_tmpdirs

    while _session_redis:
        _session_redis.pop().stop()
    remove_tmpdirs()


def new_fleet(r: Any, namespace: str = "affinity") -> Any:
    """Mark a flushed Redis as a new fleet's (``Registry.new_fleet``: its first claims do not
    wait for the grace period an empty Redis gets); returns what ``SET`` returns (awaitable
    on an async client)."""
    return r.set(Keys(namespace).fleet, "0", nx=True)


@pytest.fixture
def real_redis_url() -> Iterator[str]:
    url = require_real_redis()
    r = redis.Redis.from_url(url)
    r.flushdb()
    new_fleet(r)
    yield url
    r.flushdb()
    r.close()


async def place(claims: Claims, episodes: Sequence[str]) -> dict[str, tuple[str, int]]:
    """Claim each of ``episodes``; episode -> (device, token)."""
    placed = {}
    for episode in episodes:
        a = await claims.resolve(episode)
        placed[episode] = (a.device, a.token)
    return placed


def cpu_devices(
    count: int = 2,
    *,
    capacity: int = 100,
    weights: Sequence[int] | None = None,
    uuid_prefix: str = "u",
) -> list[DeviceRegistration]:
    """CPU stand-in devices 0..count-1 (``weights`` sets count when given)."""
    weights = list(weights) if weights is not None else [1] * count
    return [
        DeviceRegistration(
            index=i,
            kind="cpu",
            name="cpu",
            uuid=f"{uuid_prefix}-cpu-{i}",
            arch="cpu",
            memory_mb=0,
            capacity=capacity,
            weight=w,
            provider="CPUExecutionProvider",
        )
        for i, w in enumerate(weights)
    ]


@dataclass
class Env:
    redis: Any
    settings: Settings
    claims: Claims
    registry: Registry

    @property
    def keys(self):  # type: ignore[no-untyped-def]
        return self.settings.keys

    @property
    def inventory(self) -> Inventory:
        return Inventory(self.redis, self.settings)

    @property
    def events(self) -> EventStream:
        return EventStream(self.redis, self.settings)

    @property
    def models(self) -> Models:
        return Models(self.redis, self.settings)

    async def node(self, node: str, n: int = 2, capacity: int = 100, weight: int = 1) -> list[str]:
        devices = cpu_devices(n, capacity=capacity, weights=[weight] * n, uuid_prefix=node)
        await self.registry.register(node, f"http://{node}.test:8000", devices, version="t")
        return [f"{node}/{i}" for i in range(n)]

    async def lapse(self, node: str) -> None:
        """What a lapsed lease looks like: the deadline in the past (nobody noticed yet)."""
        await self.redis.zadd(self.keys.nodes, {node: 1})

    async def expire(self, episode: str) -> None:
        """What an idle TTL running out looks like for one episode: the key gone, its
        load-set deadline (and a full device's earliest deadline) in the past."""
        value = await self.redis.get(self.keys.episode(episode))
        device = value.split(" ")[0]
        await self.redis.delete(self.keys.episode(episode))
        await self.redis.zadd(self.keys.load(device), {episode: 1})
        await self.redis.zadd(self.keys.full, {device: 1}, xx=True)

    async def snapshot(self) -> dict[str, Any]:
        """The whole keyspace, for 'nothing was written' assertions (stream ids included)."""
        out: dict[str, Any] = {}
        for key in sorted(await self.redis.keys("*")):
            kind = await self.redis.type(key)
            if kind == "string":
                out[key] = await self.redis.get(key)
            elif kind == "hash":
                out[key] = await self.redis.hgetall(key)
            elif kind == "zset":
                out[key] = await self.redis.zrange(key, 0, -1, withscores=True)
            elif kind == "set":
                out[key] = sorted(await self.redis.smembers(key))
            elif kind == "stream":
                out[key] = await self.redis.xrange(key)
            else:
                raise AssertionError(f"unexpected type {kind} for {key}")
        return out


async def make_client(backend: str) -> Any:
    """A client on an empty Redis of ``backend`` marked as a new fleet's (:func:`new_fleet`)."""
    if backend == "fake":
        client = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    else:
        client = redis.asyncio.Redis.from_url(require_real_redis(), decode_responses=True)
        await client.flushdb()
    await new_fleet(client)
    return client


@pytest.fixture(params=BACKENDS)
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    client = await make_client(request.param)
    settings = Settings(redis_url=None, episode_ttl_s=60, lease_ttl_s=10)
    yield Env(client, settings, Claims(client, settings), Registry(client, settings))
    if request.param == "real":
        await client.flushdb()
    await client.aclose()


@pytest.fixture(name="redis", params=BACKENDS)
async def redis_client(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """An async client on fakeredis, then on this session's real Redis (flushed after)."""
    client = await make_client(request.param)
    yield client
    if request.param == "real":
        await client.flushdb()
    await client.aclose()


class RoundTrips:
    """The writes a client's connections make to Redis: each is one round trip (a
    pipeline's commands go in one write). ``carrying(sha)``: those that call that script."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def carrying(self, sha: str) -> int:
        return sum(sha.encode() in w for w in self.writes)


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> Iterator[RoundTrips]:
    """Count every write of every async connection (fakeredis' and redis-py's alike)."""
    seen = RoundTrips()
    send = AbstractConnection.send_packed_command

    async def counted(self: AbstractConnection, command: Any, *args: Any, **kw: Any) -> None:
        parts = [command] if isinstance(command, bytes | str) else list(command)
        seen.writes.append(b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in parts))
        await send(self, parts if len(parts) > 1 else parts[0], *args, **kw)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    yield seen
