"""Settings: one frozen object, read once at start-up, passed down explicitly."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import urlsplit

from affinity.errors import InvalidArgument
from affinity.keys import Keys

__all__ = ["ENV_VARS", "MAX_REPLICAS", "Settings", "backstop_beyond_idle_ms"]

MAX_REPLICAS = 64
"""The most replicas a write may be made to wait for."""

ENV_VARS = {
    "redis_url": "AFFINITY_REDIS_URL",
    "namespace": "AFFINITY_NAMESPACE",
    "episode_ttl_s": "AFFINITY_EPISODE_TTL",
    "lease_ttl_s": "AFFINITY_LEASE_TTL",
    "events_maxlen": "AFFINITY_EVENTS_MAXLEN",
    "redis_timeout_s": "AFFINITY_REDIS_TIMEOUT",
    "redis_retries": "AFFINITY_REDIS_RETRIES",
    "redis_deadline_s": "AFFINITY_REDIS_DEADLINE",
    "redis_max_connections": "AFFINITY_REDIS_MAX_CONNECTIONS",
    "redis_replicas": "AFFINITY_REDIS_REPLICAS",
    "redis_wait_s": "AFFINITY_REDIS_WAIT",
}
"""The environment variable :meth:`Settings.from_env` reads for each setting."""

_LABELS = {
    "episode_ttl_s": "episode TTL",
    "lease_ttl_s": "lease TTL",
    "events_maxlen": "event stream length",
    "redis_timeout_s": "Redis timeout",
    "redis_retries": "Redis retries",
    "redis_deadline_s": "Redis deadline",
    "redis_max_connections": "Redis connection pool size",
    "redis_replicas": "Redis replicas",
    "redis_wait_s": "Redis replica wait",
}
"""What the messages call each setting (a person sets a flag or a variable, not a field)."""


def backstop_beyond_idle_ms(lease_ttl_ms: int) -> int:
    """How much longer than its owner's idle timeout Redis keeps an assignment it wrote or
    slid last (ms): two lease TTLs of that owner + 3 s (:attr:`Settings.backstop_ms`)."""
    return 2 * lease_ttl_ms + 3000


@dataclass(frozen=True)
class Settings:
    """Everything the library needs to reach Redis and apply the claim protocol.

    ``redis_url`` accepts ``redis://``, ``rediss://`` (TLS; ``ssl_*`` query parameters
    pass through to redis-py), ``unix://``, ``redis+sentinel://h1:p1,h2:p2/<master>`` and
    ``redis+cluster://host:port``. ``None`` means the embedded single-host store.

    Times are seconds (floats allowed; Redis gets milliseconds). ``redis_timeout_s`` bounds
    one socket operation. ``redis_retries`` is the whole retry budget of one command
    (connection-level only; nothing nests). ``redis_deadline_s`` bounds one library call
    end to end, whatever the network does. ``redis_max_connections`` bounds the
    client's connection pool; a call that finds every connection busy waits for one
    (within its deadline) instead of failing.

    ``redis_replicas`` > 0 makes every write a node then serves from memory on wait for
    that many replicas to acknowledge it. Such writes are a claim, a renewal, a re-assert
    and a flush's slides. Each waits on its own connection (``WAIT``, at most
    ``redis_wait_s``, which must be at most half of ``redis_timeout_s``). One fewer
    replicas acknowledged is not acted on (:class:`~affinity.errors.NotReplicated`). It
    needs a Redis server or Sentinel: the embedded store has no replicas, and on Redis
    Cluster it is refused.
    """

    redis_url: str | None = None
    namespace: str = "affinity"
    episode_ttl_s: float = 300.0
    lease_ttl_s: float = 10.0
    events_maxlen: int = 10_000
    redis_timeout_s: float = 0.5
    redis_retries: int = 2
    redis_deadline_s: float = 2.0
    redis_max_connections: int = 128
    redis_replicas: int = 0
    redis_wait_s: float = 0.1

    def __post_init__(self) -> None:
        Keys(self.namespace)  # validates the namespace
        for name in ("episode_ttl_s", "lease_ttl_s", "redis_timeout_s", "redis_deadline_s"):
            value = getattr(self, name)
            if not value > 0.001:
                raise InvalidArgument(
                    name, value, "must be more than 0.001 seconds", label=_LABELS[name]
                )
        if self.events_maxlen < 1:
            raise InvalidArgument(
                "events_maxlen", self.events_maxlen, "must be >= 1", label=_LABELS["events_maxlen"]
            )
        if self.redis_retries < 0:
            raise InvalidArgument(
                "redis_retries", self.redis_retries, "must be >= 0", label=_LABELS["redis_retries"]
            )
        if self.redis_max_connections < 1:
            raise InvalidArgument(
                "redis_max_connections",
                self.redis_max_connections,
                "must be >= 1",
                label=_LABELS["redis_max_connections"],
            )
        self._check_replicas()

    def _check_replicas(self) -> None:
        n = self.redis_replicas
        label = _LABELS["redis_replicas"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_REPLICAS:
            raise InvalidArgument(
                "redis_replicas", n, f"must be an integer 0-{MAX_REPLICAS}", label=label
            )
        if not n:
            return
        if not self.redis_url:
            raise InvalidArgument(
                "redis_replicas",
                n,
                "needs a Redis server (--redis): the embedded store has no replicas",
                label=label,
            )
        if "cluster" in urlsplit(self.redis_url).scheme:
            raise InvalidArgument(
                "redis_replicas",
                n,
                "is not supported on Redis Cluster (WAIT would have to run on the shard's "
                "own connection): use a primary with replicas, behind Sentinel "
                "(redis+sentinel://)",
                label=label,
            )
        wait = self.redis_wait_s
        if not 0.001 <= wait <= self.redis_timeout_s / 2:
            raise InvalidArgument(
                "redis_wait_s",
                wait,
                f"must be 0.001 seconds to half the Redis timeout ({self.redis_timeout_s}s, "
                "AFFINITY_REDIS_TIMEOUT), so a socket never times out while WAIT waits",
                label=_LABELS["redis_wait_s"],
            )

    @property
    def redis_wait_ms(self) -> int:
        """The ``WAIT`` timeout in milliseconds (never 0, which would wait for ever)."""
        return max(1, round(self.redis_wait_s * 1000))

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace)

    @property
    def episode_ttl_ms(self) -> int:
        return max(1, round(self.episode_ttl_s * 1000))

    @property
    def lease_ttl_ms(self) -> int:
        return max(1, round(self.lease_ttl_s * 1000))

    @property
    def backstop_ms(self) -> int:
        """How long Redis keeps an assignment nobody slid (ms): the owner's idle timeout
        (``episode_ttl_s``) + two lease TTLs + 3 s. The owner serves its episodes from
        memory and slides this in batches (``node/ownership.py``). It slides once less than
        a lease TTL + 3 s of it is left, and only for episodes stepped since. So Redis never
        expires an episode its owner still serves. The owner drops an idle one at its idle
        timeout (checked each second) and releases it in its next flush (<= 1 s)."""
        return self.episode_ttl_ms + backstop_beyond_idle_ms(self.lease_ttl_ms)

    @classmethod
    def from_url(cls, url: str | None, **overrides: Any) -> Settings:
        """Settings for ``url`` with the given fields overridden."""
        return cls(redis_url=url or None, **overrides)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``AFFINITY_*`` variables; ``overrides`` win over the environment."""
        env = os.environ if env is None else env
        kwargs: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for name, var in ENV_VARS.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            kind = types[name]
            try:
                if kind == "float":
                    kwargs[name] = float(raw)
                elif kind == "int":
                    kwargs[name] = int(raw)
                else:
                    kwargs[name] = raw
            except ValueError:
                raise InvalidArgument(var, raw, f"must be a number ({kind})") from None
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)

    def with_(self, **changes: Any) -> Settings:
        """A copy with some fields changed."""
        return replace(self, **changes)
