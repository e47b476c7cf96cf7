"""Build the async Redis client from :class:`Settings`, with explicit timeouts and retries.

redis-py 8's defaults retry at two levels that nest. Under a silent partition (packets
dropped, no reset) one command can then hang for about 100 seconds. Here a command gets
``redis_timeout_s`` per socket operation and ``redis_retries`` connection-level retries
with a short capped backoff. Every library call is further bounded by
``redis_deadline_s`` (see :func:`affinity.claims.bounded`).

The pool is bounded (``redis_max_connections``) and blocking. A burst of calls larger
than the pool waits for connections, within the deadline. redis-py's default pool fails
at once there, with "Too many connections". A call that waited its whole deadline for a
connection raises :class:`PoolExhausted` (this process is overloaded), not the error that
blames Redis.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from affinity.config import Settings
from affinity.errors import InvalidArgument, PoolExhausted

__all__ = [
    "SCHEMES",
    "AnyRedis",
    "close",
    "connect",
    "embedded_store",
    "starved",
    "url_problem",
]

log = logging.getLogger("affinity")

AnyRedis = Redis | RedisCluster
SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "redis+sentinel",
    "redis+cluster",
    "redis+cluster+tls",
    "rediss+cluster",
)


def url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as a Redis URL (``None``: nothing), in words a person
    can act on; checked before anything connects."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or not (parts.path if parts.scheme == "unix" else parts.netloc):
        return "must be a URL such as redis://host:6379/0 (schemes: " + ", ".join(SCHEMES) + ")"
    if parts.scheme == "redis+sentinel":  # several host:port, checked when connecting
        return None
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not 0-65535
    except ValueError:
        return "its port must be a number 0-65535"
    return None


_waiting: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
"""Tasks waiting for a connection of a bounded pool (not yet handed one)."""
_starved: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = weakref.WeakKeyDictionary()
"""Tasks cancelled (by their deadline) while still waiting for a pool connection: the
size of that pool."""


def starved(task: asyncio.Task[Any]) -> int | None:
    """The size of the pool ``task`` was waiting on when it was cancelled (and forget it).

    ``None`` if it was not waiting. A size means its deadline was spent on this process's
    own overload, not on Redis."""
    return _starved.pop(task, None)


class _Pool(BlockingConnectionPool):
    """redis-py's blocking pool that tells a wait for a connection from a call to Redis.

    A task counts as waiting from :meth:`get_connection` until the pool hands it a
    connection. It then checks that connection (:meth:`ensure_connection`: connecting,
    when the connection is new). From there on a failure or a deadline is Redis's
    (refused, unreachable, silent), not this process's overload. (redis-py takes the connection
    through ``super().get_available_connection()``, which no override here would see.)"""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        _waiting.add(task)
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except RedisConnectionError as exc:
            if task in _waiting:  # the pool's own timeout: "No connection available."
                raise PoolExhausted(self.max_connections, self.timeout or 0.0) from exc
            raise
        except asyncio.CancelledError:
            if task in _waiting:
                _starved[task] = self.max_connections
            raise
        finally:
            _waiting.discard(task)

    async def ensure_connection(self, connection: Any) -> None:
        task = asyncio.current_task()
        if task is not None:
            _waiting.discard(task)  # handed a connection: from here on Redis is asked
        await super().ensure_connection(connection)


def _client_kwargs(settings: Settings) -> dict[str, Any]:
    return {
        "socket_timeout": settings.redis_timeout_s,
        "socket_connect_timeout": settings.redis_timeout_s,
        "retry": Retry(
            ExponentialWithJitterBackoff(base=0.02, cap=0.2),
            settings.redis_retries,
            (RedisConnectionError, RedisTimeoutError),
        ),
        "health_check_interval": 5,
        "decode_responses": True,
    }


def connect(settings: Settings) -> AnyRedis:
    """An async client for ``settings.redis_url`` (which must not be ``None``)."""
    url = settings.redis_url
    if not url:
        raise InvalidArgument("redis_url", url, "a URL is required here; use embedded_store()")
    kwargs = _client_kwargs(settings)
    scheme = urlsplit(url).scheme
    if scheme == "redis+sentinel":
        return _sentinel(url, kwargs)
    if scheme == "redis+cluster":
        kwargs.pop("health_check_interval")
        return RedisCluster.from_url("redis://" + url.split("://", 1)[1], **kwargs)
    if scheme in ("redis+cluster+tls", "rediss+cluster"):
        kwargs.pop("health_check_interval")
        return RedisCluster.from_url("rediss://" + url.split("://", 1)[1], **kwargs)
    problem = url_problem(url)
    if problem is not None:
        raise InvalidArgument("redis_url", url, problem)
    pool = _Pool.from_url(
        url,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_deadline_s,
        **kwargs,
    )
    return Redis.from_pool(pool)  # the client owns it: aclose() closes it


def _sentinel(url: str, kwargs: dict[str, Any]) -> Redis:
    # redis+sentinel://[:password@]host1:port1,host2:port2/<master>[?db=N]
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    hosts = netloc[-1]
    password = None
    if len(netloc) == 2:
        password = netloc[0].split(":", 1)[-1] or None
    master = parts.path.strip("/")
    if not master:
        raise InvalidArgument("redis_url", url, "sentinel URLs need /<master-name>")
    addresses = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        addresses.append((host or item, int(port) if host else 26379))
    query = dict(parse_qsl(parts.query))
    # The sentinels get the same short timeouts and no retries of their own: redis-py's
    # default policy would spend about a minute on one silently dead sentinel before
    # trying the next.
    sentinel_kwargs = {
        "socket_timeout": kwargs["socket_timeout"],
        "socket_connect_timeout": kwargs["socket_connect_timeout"],
        "retry": Retry(NoBackoff(), 0),
        "password": password,
    }
    # typed from redis-py 8.2 on, untyped before: called through Any for both
    sentinel = cast(Any, Sentinel)(addresses, sentinel_kwargs=sentinel_kwargs)
    client: Redis = sentinel.master_for(
        master, password=password, db=int(query.get("db", 0)), **kwargs
    )
    return client


async def close(client: AnyRedis) -> None:
    """Close ``client`` and, behind Sentinel, the connections to the sentinels too."""
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    await client.aclose()
    if manager is not None:
        for sentinel in manager.sentinels:
            await sentinel.aclose()


def embedded_store(serve_port: int | None = None, host: str = "127.0.0.1") -> Redis:
    """An in-process store (fakeredis with Lua) for a single host without Redis.

    With ``serve_port`` the same store also answers the Redis protocol on
    ``host:serve_port`` so that ``redis-cli -p <port>`` can inspect it.
    """
    import threading

    import fakeredis

    server = fakeredis.FakeServer()
    if serve_port is not None:
        tcp = fakeredis.TcpFakeServer((host, serve_port))
        tcp.fake_server = server
        threading.Thread(target=tcp.serve_forever, name="affinity-embedded", daemon=True).start()
        log.info("embedded store answers the Redis protocol on %s:%d", host, serve_port)
    client: Redis = fakeredis.aioredis.FakeRedis(server=server, decode_responses=True)
    return client
