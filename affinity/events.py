"""The deployment's event stream (a capped Redis stream, ``Keys.events``): read, follow.

Claims, releases, drains, lease lapses and rollouts write to it (the Lua scripts and
:class:`affinity.models.Models`); this module only reads. The stream is capped, so a
reader that falls behind may miss events: ``/events/stream`` tells its clients with a
``gap`` event. A follower resumes from the last id it saw, never from ``$``.
"""

from __future__ import annotations

from collections.abc import Mapping

from affinity.scripts import RedisApi, bounded

__all__ = ["EVENT_NUMBERS", "Event", "EventStream", "event_json"]

Event = tuple[str, dict[str, str]]
"""One event: its stream id and its fields (every value a string)."""

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


class EventStream(RedisApi):
    """Reads of the event stream over one Redis client (a :class:`RedisApi`: every call
    bounded)."""

    @property
    def key(self) -> str:
        return self.keys.events

    async def events(self, since: str = "-", count: int = 100) -> list[Event]:
        """Up to ``count`` events after ``since`` (a stream id; ``-`` is the start)."""
        start = since if since == "-" else f"({since}"
        reply = await bounded(self.settings, self.redis.xrange(self.key, start, "+", count=count))
        return [(str(i), dict(f)) for i, f in reply]

    async def latest(self, count: int) -> tuple[list[Event], str]:
        """The last ``count`` events (oldest first), and the id to follow on from.

        Follow on with :meth:`wait`. The id is ``0-0`` for an empty stream. It is never
        ``$``, which would miss what arrives between two waits."""
        reply = await bounded(self.settings, self.redis.xrevrange(self.key, count=max(count, 1)))
        newest_first = [(str(i), dict(f)) for i, f in reply]
        cursor = newest_first[0][0] if newest_first else "0-0"
        return newest_first[:count][::-1], cursor

    async def wait(self, since: str, block_ms: int) -> list[Event]:
        """Events after the id ``since``, waiting up to ``block_ms`` for the first one.

        The wait is capped below the socket timeout (``redis_timeout_s``), so a quiet
        stream returns ``[]`` instead of timing out; callers loop."""
        block = max(1, min(block_ms, round(self.settings.redis_timeout_s * 1000) - 100))
        reply = await bounded(
            self.settings, self.redis.xread({self.key: since}, block=block, count=100)
        )
        if not reply:
            return []
        entries = reply[self.key][0] if isinstance(reply, dict) else reply[0][1]
        return [(str(i), dict(f)) for i, f in entries]
