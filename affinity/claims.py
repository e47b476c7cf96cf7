"""Episode claims: resolve (hit / claim / reassign), lookup, release.

Argument building and reply parsing are plain functions; :class:`Claims` is the thin
async shell the node and the CLI share.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import RedisError

from affinity.config import Settings
from affinity.errors import (
    BackendUnavailable,
    InvalidArgument,
    NoCapacity,
    StaleToken,
    UnknownEpisode,
)
from affinity.scripts import Scripts

__all__ = [
    "MAX_EPISODE_BYTES",
    "Assignment",
    "Claims",
    "EpisodeInfo",
    "bounded",
    "check_episode",
]

MAX_EPISODE_BYTES = 512

Status = Literal["hit", "claimed", "reassigned"]


@dataclass(frozen=True)
class Assignment:
    """Where an episode lives now, as decided by one ``resolve``."""

    episode: str
    status: Status
    device: str
    token: int
    node: str
    url: str
    previous: str | None  # the device it was taken from ("reassigned" only)


@dataclass(frozen=True)
class EpisodeInfo:
    """A read-only view of an assignment (``lookup``)."""

    episode: str
    device: str
    token: int
    ttl_ms: int
    node: str
    url: str
    state: str  # the device's state, or "removed" when its hash is gone
    alive: bool  # the owner's lease is current

    def to_json(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode,
            "device": self.device,
            "token": self.token,
            "ttl_ms": self.ttl_ms,
            "node": self.node,
            "url": self.url,
            "state": self.state,
            "alive": self.alive,
        }


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
    if any(c < " " or c == "\x7f" for c in episode):
        # they would reach operators' terminals through redis-cli and the CLI
        raise InvalidArgument("episode id", episode, "must not contain control characters")
    if size > MAX_EPISODE_BYTES:
        raise InvalidArgument(
            "episode id", episode, f"is {size} bytes; the limit is {MAX_EPISODE_BYTES} bytes"
        )
    return episode


@asynccontextmanager
async def bounded(settings: Settings) -> AsyncIterator[None]:
    """Bound one library call by ``redis_deadline_s``; map transport errors and Redis
    error replies to :class:`BackendUnavailable`."""
    try:
        async with asyncio.timeout(settings.redis_deadline_s):
            yield
    except (TimeoutError, RedisError, OSError) as exc:
        # RedisError covers error replies too (OOM, READONLY after a failover, BUSY,
        # CLUSTERDOWN): for the caller the store cannot decide now
        raise BackendUnavailable(
            f"Redis did not answer within {settings.redis_deadline_s}s: {exc or type(exc).__name__}"
        ) from exc


def parse_resolution(episode: str, reply: Sequence[Any]) -> Assignment:
    status, device, token, node, url, previous = (str(x) for x in reply)
    if status == "full":
        raise NoCapacity(episode)
    if status not in ("hit", "claimed", "reassigned"):
        raise ValueError(f"unexpected resolve reply {reply!r}")
    return Assignment(
        episode=episode,
        status=status,  # type: ignore[arg-type]
        device=device,
        token=int(token),
        node=node,
        url=url,
        previous=previous or None,
    )


def parse_lookup(episode: str, reply: Sequence[Any]) -> EpisodeInfo | None:
    if not reply:
        return None
    device, token, ttl, node, url, state, alive = reply
    return EpisodeInfo(
        episode=episode,
        device=str(device),
        token=int(token),
        ttl_ms=int(ttl),
        node=str(node),
        url=str(url),
        state=str(state),
        alive=str(alive) == "1",
    )


class Claims:
    """Async claim API over one Redis client. Safe to share between tasks."""

    def __init__(self, redis: Any, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self.keys = settings.keys
        self.scripts = Scripts.bind(redis)

    async def resolve(self, episode: str) -> Assignment:
        """Find or make the episode's assignment in one atomic round trip.

        ``hit`` slides the idle TTL; ``claimed``/``reassigned`` write a new assignment
        with a new fencing token. Raises :class:`NoCapacity` (nothing written),
        :class:`InvalidArgument`, :class:`BackendUnavailable`.
        """
        episode = check_episode(episode)
        k = self.keys
        async with bounded(self.settings):
            reply = await self.scripts.resolve(
                keys=[k.episode(episode), k.rr, k.token, k.nodes, k.events],
                args=[episode, self.settings.episode_ttl_ms, k.prefix, self.settings.events_maxlen],
            )
        return parse_resolution(episode, reply)

    async def lookup(self, episode: str) -> EpisodeInfo | None:
        """The episode's assignment without touching it, or ``None``."""
        episode = check_episode(episode)
        k = self.keys
        async with bounded(self.settings):
            reply = await self.scripts.lookup(keys=[k.episode(episode), k.nodes], args=[k.prefix])
        return parse_lookup(episode, reply)

    async def release(self, episode: str, token: int, reason: str = "end") -> str:
        """Delete the assignment if ``token`` still holds it; return the device it was on.

        Idempotent per token. Raises :class:`StaleToken` (nothing changed) when another
        token holds the episode, :class:`UnknownEpisode` when nothing does.
        """
        episode = check_episode(episode)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidArgument("token", token, "must be a non-negative integer")
        k = self.keys
        async with bounded(self.settings):
            reply = await self.scripts.release(
                keys=[k.episode(episode), k.events],
                args=[episode, str(token), k.prefix, self.settings.events_maxlen, reason],
            )
        if reply[0] == "missing":
            raise UnknownEpisode(episode)
        if reply[0] == "stale":
            raise StaleToken(episode, token, int(reply[2]), str(reply[1]))
        return str(reply[1])
