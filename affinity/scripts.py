"""The Lua scripts (``affinity/lua/*.lua``) and the one way the library calls Redis.

Each script is sent as a header of this deployment's constants, then the script.
``lib.lua`` and ``fleet.lua``, the functions the scripts share, go where a script says
``--@lib`` and ``--@fleet``: a function two scripts need is written there once.
The header holds what one deployment's calls share: fixed key names (from :class:`Keys`),
prefixes of derived keys, the episode TTL, the lease TTL, the events stream's MAXLEN.
Per call, ``KEYS[1]`` is the one key the call is about; ``ARGV`` holds the per-call values.
Passing the fixed keys on every claim cost over a tenth of its round trip on loopback.
The header's values are validated and written as escaped Lua literals.

:func:`evalsha` reloads a script on ``NOSCRIPT`` (a Redis restart, ``SCRIPT FLUSH``).
:func:`bounded` awaits a call under ``redis_deadline_s`` (one timer per event loop).
It maps transport errors and Redis error replies to :class:`BackendUnavailable`.
:class:`RedisApi`, :class:`ScriptCaller` and :class:`EpisodeScriptCaller` are what the
async APIs (``Claims``, ``Registry``, ``Transfers``, ``Inventory``...) hold.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from importlib.resources import files
from typing import Any, TypeVar

from redis.exceptions import NoScriptError, RedisError

from affinity.config import Settings
from affinity.connection import starved
from affinity.errors import BackendUnavailable, PoolExhausted
from affinity.keys import Keys

__all__ = [
    "NAMES",
    "EpisodeScriptCaller",
    "RedisApi",
    "Script",
    "ScriptCaller",
    "Scripts",
    "bounded",
    "evalsha",
    "evalsha_many",
    "evalsha_waited",
    "failure",
    "replicated",
    "replicated_many",
    "scripts_for",
    "source",
]

NAMES = (
    "resolve",
    "lookup",
    "release",
    "handoff",
    "register",
    "renew",
    "leave",
    "deregister",
    "forget",
    "set_state",
    "flush",
    "transfer",
    "restore_rollout",
)

INCLUDED = ("lib", "fleet")  # shared parts, placed where a script says --@lib, --@fleet

# The values scripts store, as Lua patterns:
#   an episode  "<device> <token> <claim id> <model>", "... moved" once handed over
#   a route     "<node> <state> <capacity> <weight> <url>"
VALUE = "^(%S+) (%d+)(.*)$"
ROUTED = "^(%S+) (%S+) (%d+) (%d+) (.*)$"

T = TypeVar("T")


@cache
def source(name: str) -> str:
    """The text of ``affinity/lua/<name>.lua``."""
    return (files("affinity") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def lua_string(value: str) -> str:
    """``value`` as a Lua string literal; anything but plain characters is escaped."""
    plain = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}:/._-^%()$ ")
    return "'" + "".join(c if c in plain else f"\\{b:03d}" for c in value for b in c.encode()) + "'"


def header(keys: Keys, episode_ttl_ms: int, lease_ttl_ms: int, events_maxlen: int) -> str:
    for n in (episode_ttl_ms, lease_ttl_ms, events_maxlen):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"script constants must be positive integers, not {n!r}")
    strings = {
        "PREFIX": keys.prefix,
        "NODES": keys.nodes,
        "RING": keys.ring,
        "FULL": keys.full,
        "ROUTE": keys.route,
        "EVENTS": keys.events,
        "DEVICES": keys.devices,
        "TOKEN": keys.token,
        "MARKER": keys.fleet,
        "LEASES": keys.leases,
        "KNOWN": keys.known_leases,
        "RR": keys.rr,
        "EPISODE_KEY": keys.episode(""),
        "NODE_KEY": keys.node(""),
        "DEVICE_KEY": keys.device(""),
        "LOAD_KEY": keys.load(""),
        "MOVED_KEY": keys.moved(""),
        "REVOKED_KEY": keys.revoked(""),
        "MOVES_KEY": keys.moves(""),
        "TRANSFER_KEY": keys.transfer(""),
        "RING_KEY": keys.ring_prefix,
        "VERSIONS_KEY": keys.versions(""),
        "ROLLOUT_KEY": keys.rollout(""),
        "PICKS_KEY": keys.picks(""),
        "SCORES": keys.scores(""),
        "SCORE_KEY": keys.score_prefix,
        "SCORED": keys.scored,
        "HASHRING": keys.hash_ring(""),
        "HASHRING_KEY": keys.hash_ring_prefix,
        "VIEW": keys.view,
        "VALUE": VALUE,
        "ROUTED": ROUTED,
    }
    numbers = {"TTL": episode_ttl_ms, "LEASE": lease_ttl_ms, "MAXLEN": events_maxlen}
    lines = [f"-- constants of namespace {keys.namespace!r} (affinity/scripts.py)"]
    lines += [f"local {name} = {lua_string(value)}" for name, value in strings.items()]
    lines += [f"local {name} = {value}" for name, value in numbers.items()]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Script:
    name: str
    text: str
    sha: str

    @classmethod
    def build(cls, name: str, head: str) -> Script:
        text = head + source(name)
        for part in INCLUDED:
            marker = f"\n--@{part}\n"
            if text.count(marker) != 1:
                raise ValueError(f"affinity/lua/{name}.lua needs one {marker.strip()} line")
            text = text.replace(marker, "\n" + source(part) + "\n")
        return cls(name, text, hashlib.sha1(text.encode()).hexdigest())


@dataclass(frozen=True)
class Scripts:
    resolve: Script
    lookup: Script
    release: Script
    handoff: Script
    register: Script
    renew: Script
    leave: Script
    deregister: Script
    forget: Script
    set_state: Script
    flush: Script
    transfer: Script
    restore_rollout: Script


@cache
def _scripts(namespace: str, ttl_ms: int, lease_ms: int, maxlen: int) -> Scripts:
    head = header(Keys(namespace), ttl_ms, lease_ms, maxlen)
    return Scripts(**{name: Script.build(name, head) for name in NAMES})


def scripts_for(settings: Settings) -> Scripts:
    """The scripts with ``settings``' constants (built once per distinct constants). The
    scripts' ``TTL`` is the episode backstop (:attr:`Settings.backstop_ms`)."""
    return _scripts(
        settings.namespace, settings.backstop_ms, settings.lease_ttl_ms, settings.events_maxlen
    )


class RedisApi:
    """An async API over one Redis client: it holds the client, the settings and their keys.
    Every call is bounded by ``settings.redis_deadline_s`` (:func:`bounded`) and raises
    :class:`BackendUnavailable` when Redis cannot answer in time."""

    def __init__(self, redis: Any, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self.keys = settings.keys


class ScriptCaller(RedisApi):
    """A :class:`RedisApi` that calls the scripts. ``known_lease_ms`` answers the longest
    lease TTL of the fleet the caller heard of (0: none). A grace period one of its calls
    starts lasts at least that long (``affinity/lua/lib.lua``)."""

    def __init__(
        self, redis: Any, settings: Settings, known_lease_ms: Callable[[], int] = lambda: 0
    ) -> None:
        super().__init__(redis, settings)
        self.known_lease_ms = known_lease_ms
        self.scripts = scripts_for(settings)


class EpisodeScriptCaller(ScriptCaller):
    """A :class:`ScriptCaller` whose every call is about one episode: ``KEYS[1]`` is its
    key."""

    @cached_property
    def _episode_key(self) -> str:
        return self.keys.episode("")

    async def _call(self, script: Script, episode: str, args: Sequence[Any] = ()) -> Any:
        key = self._episode_key + episode
        return await bounded(self.settings, evalsha(self.redis, script, key, args))


async def evalsha(redis: Any, script: Script, key: str, args: Sequence[Any] = ()) -> Any:
    """``EVALSHA`` the script with ``KEYS[1] = key``; load it and call again when Redis
    does not know it."""
    try:
        return await redis.execute_command("EVALSHA", script.sha, 1, key, *args)
    except NoScriptError:
        await redis.script_load(script.text)
        return await redis.execute_command("EVALSHA", script.sha, 1, key, *args)


async def evalsha_many(
    redis: Any,
    script: Script,
    calls: Sequence[tuple[str, Sequence[Any]]],
    wait: tuple[int, int] | None = None,
) -> tuple[list[Any], int | None]:
    """:func:`evalsha` once per ``(key, args)`` of ``calls``, all sent in one round trip (a
    pipeline without MULTI): each call is atomic by itself, exactly as when sent alone, and
    none waits for, fails or undoes another. ``wait`` = ``(replicas, ms)``: followed by
    ``WAIT replicas ms`` on the same connection, in the same round trip.

    Returns the replies in order, an error reply (:class:`ResponseError`) in its call's
    place, and how many replicas acknowledged every write the connection made up to its
    last script (None without ``wait``). A call answered ``NOSCRIPT`` did not run: the
    script is loaded and those calls are sent again, together, with the ``WAIT``. The count
    returned is then the lower of the two rounds' where a call of the first round ran (the
    second round may go out on another connection, and write nothing: its ``WAIT`` need
    not cover the first round's writes), else the second's (the first round's ``WAIT``
    waited on nothing of these calls). Raises what the connection raises."""

    async def send(batch: Sequence[tuple[str, Sequence[Any]]]) -> tuple[list[Any], int | None]:
        pipe = redis.pipeline(transaction=False)
        for key, args in batch:
            pipe.execute_command("EVALSHA", script.sha, 1, key, *args)
        if wait is not None:
            pipe.execute_command("WAIT", *wait)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        if wait is None:
            return replies, None
        acked = replies.pop()
        if isinstance(acked, Exception):
            raise acked
        return replies, int(acked)

    replies, acked = await send(calls)
    unknown = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
    if unknown:
        await redis.script_load(script.text)
        again, second = await send([calls[i] for i in unknown])
        for i, reply in zip(unknown, again, strict=True):
            replies[i] = reply
        ran_before = len(unknown) < len(calls)
        acked = (
            min(acked, second)
            if ran_before and acked is not None and second is not None
            else second
        )
    return replies, acked


async def evalsha_waited(
    redis: Any, script: Script, key: str, args: Sequence[Any], replicas: int, wait_ms: int
) -> tuple[Any, int]:
    """:func:`evalsha`, then ``WAIT replicas wait_ms`` on the same connection, sent together.

    One round trip (:func:`evalsha_many`). Returns the script's reply and how many
    replicas acknowledged every write this connection made up to and including the
    script's. ``WAIT`` waits for the connection's last write, so the caller must only trust the
    count for a script that wrote (every reply a node serves on does)."""
    replies, acked = await evalsha_many(redis, script, [(key, args)], (replicas, wait_ms))
    if isinstance(replies[0], Exception):
        raise replies[0]
    assert acked is not None
    return replies[0], acked


async def replicated(
    settings: Settings, redis: Any, script: Script, key: str, args: Sequence[Any]
) -> tuple[Any, int | None]:
    """One bounded script call that a node serves from memory on afterwards: with
    ``settings.redis_replicas`` (N > 0) it is followed by ``WAIT`` on its connection
    (:func:`evalsha_waited`). Returns the reply and ``None`` when the write is safe to act
    on (N replicas acknowledged it, or N is 0), else how many replicas acknowledged it."""
    n = settings.redis_replicas
    if not n:
        return await bounded(settings, evalsha(redis, script, key, args)), None
    reply, acked = await bounded(
        settings, evalsha_waited(redis, script, key, args, n, settings.redis_wait_ms)
    )
    return reply, (None if acked >= n else acked)


async def replicated_many(
    settings: Settings, redis: Any, script: Script, calls: Sequence[tuple[str, Sequence[Any]]]
) -> tuple[list[Any], int | None]:
    """:func:`replicated` for several calls of one script in one round trip
    (:func:`evalsha_many`, one ``WAIT`` after them all): the replies in order (an error reply
    in its call's place), and ``None`` when the writes are safe to act on, else how many
    replicas acknowledged them."""
    n = settings.redis_replicas
    wait = (n, settings.redis_wait_ms) if n else None
    replies, acked = await bounded(settings, evalsha_many(redis, script, calls, wait))
    return replies, (None if acked is None or acked >= n else acked)


class _Watchdog:
    """Cancels the library calls of one event loop that pass their deadline.

    One timer serves all of them. A timer per call cost about 3 µs, a few per cent of a
    claim."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls: dict[int, tuple[float, asyncio.Task[Any]]] = {}
        self.expired: set[int] = set()
        self.next = 0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf

    def start(self, task: asyncio.Task[Any], deadline: float) -> int:
        self.next += 1
        self.calls[self.next] = (deadline, task)
        if deadline < self.timer_at:
            self._schedule(deadline)
        return self.next

    def stop(self, call: int) -> bool:
        """Forget the call; ``True`` when it was cancelled for passing its deadline."""
        self.calls.pop(call, None)
        if call in self.expired:
            self.expired.discard(call)
            return True
        return False

    def _schedule(self, at: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.timer_at = self.loop.call_at(at, self._check), at

    def _check(self) -> None:
        self.timer, self.timer_at = None, math.inf
        now = self.loop.time()
        later = math.inf
        for call, (deadline, task) in list(self.calls.items()):
            if deadline <= now:
                del self.calls[call]
                self.expired.add(call)
                task.cancel()
            else:
                later = min(later, deadline)
        if later < math.inf:
            self._schedule(later)


_watchdogs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watchdog] = (
    weakref.WeakKeyDictionary()
)


def failure(exc: BaseException) -> str:
    """What a Redis call's transport error or error reply means, in one line.

    A refused connection says so first, whatever redis-py and the event loop wrote around
    it. Nothing listens there: Redis is not running, or the URL's port is wrong."""
    text = str(exc) or type(exc).__name__
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return f"connection refused (is Redis running there?): {text}"
        cause = cause.__cause__ or cause.__context__
    return f"Redis failed or did not answer: {text}"


async def bounded(settings: Settings, call: Awaitable[T]) -> T:
    """Await ``call`` within ``settings.redis_deadline_s``.

    Raises :class:`BackendUnavailable` when the deadline passes, the connection fails, or
    Redis answers with an error: OOM, READONLY after a failover, BUSY, CLUSTERDOWN. For
    the caller the store cannot decide now. Raises :class:`PoolExhausted` (one of those)
    when the deadline passed while the call still waited for a connection of this
    process's pool."""
    loop = asyncio.get_running_loop()
    watchdog = _watchdogs.get(loop)
    if watchdog is None:
        watchdog = _watchdogs[loop] = _Watchdog(loop)
    task = asyncio.current_task()
    assert task is not None
    ticket = watchdog.start(task, loop.time() + settings.redis_deadline_s)
    expired = False
    try:
        result = await call
        # On Python 3.11 redis-py's asyncio.wait_for swallows a cancellation that lands as
        # a send completes (CPython gh-86296): the call then returns after its deadline
        # as if nothing happened. The watchdog's record says whether it fired.
        expired = watchdog.stop(ticket)
        if not expired:
            return result
        task.uncancel()
        raise BackendUnavailable(f"Redis did not answer within {settings.redis_deadline_s}s")
    except asyncio.CancelledError:
        expired = watchdog.stop(ticket)
        if not expired:
            raise
        task.uncancel()
        connections = starved(task)
        if connections is not None:
            raise PoolExhausted(connections, settings.redis_deadline_s) from None
        raise BackendUnavailable(
            f"Redis did not answer within {settings.redis_deadline_s}s"
        ) from None
    except (RedisError, OSError) as exc:
        raise BackendUnavailable(failure(exc)) from exc
    finally:
        if not expired:
            watchdog.stop(ticket)
