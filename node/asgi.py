"""Plain ASGI helpers for the node's hot endpoints (no framework on the request path)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Protocol, TypeVar

import orjson
from prometheus_client import Counter

from node.errors import BodyError, ClientGone, outcome

__all__ = [
    "CONNECTION",
    "Connection",
    "Receive",
    "Scope",
    "Send",
    "cancel_when_gone",
    "cross_site",
    "error_body",
    "header",
    "header_values",
    "io_seen",
    "read_body",
    "respond",
    "respond_error",
    "respond_gone",
    "while_connected",
]

T = TypeVar("T")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


CONNECTION = "affinity.connection"
"""Scope key of an HTTP request's :class:`Connection`, which the node's HTTP server puts in
every request's scope (``node/server.py``). Other servers (tests' ASGI transports) leave it
out; :func:`while_connected` then reads ``receive()`` after :func:`io_seen`. A front's
websocket protocol puts itself under the same key for what its replies need alone (how
much of a frame is still in its buffer: ``node.front.drained_of``); it is no
:class:`Connection`, and no websocket scope reaches :func:`while_connected`."""


class Connection(Protocol):
    """What the server tells a request about its connection, without a loop turn."""

    def peer_closed(self) -> bool:
        """Whether the client has closed the connection by now, as the kernel knows it."""

    def serving_others(self) -> bool:
        """Whether the server is serving other requests at this moment."""


WATCH_AFTER_S = 0.01
"""A step still running after this long gets a task watching its connection; a quicker one
only has its connection checked once it finished (no task per step)."""


async def while_connected(
    receive: Receive, work: Awaitable[T], connection: Connection | None = None
) -> T:
    """Await ``work`` (in this task) while the client's connection stays open; call it
    once the request body has been read. A close cancels ``work`` and raises
    :class:`ClientGone`. So does a close seen the moment ``work`` finished, with its
    result, so that the caller can undo what no one will receive.

    Work that ends within :data:`WATCH_AFTER_S` is not watched while it runs. Its
    connection is checked once, when it finished, which costs no task. It is checked by
    ``connection`` (the scope's :data:`CONNECTION`) where the server gives one. Else by
    ``receive()`` after :func:`io_seen` (:func:`_closed_now`). Longer work gets a task
    awaiting ``receive()``, so that a close cancels it at once.

    While the server serves other requests, a finished step yields once before its reply
    (one loop turn). The others' steps run first and the replies leave together. So each
    loop iteration reads and answers more requests: ``bench.act`` went from 86% to 110% of
    the minimal app's throughput under ``wrk -c16`` in one run. A request served alone (a
    robot in lockstep) does not wait for it."""
    watch: asyncio.Future[Any] | None = None

    def start(gone: Callable[[], None]) -> None:
        nonlocal watch
        watch = asyncio.ensure_future(receive())
        watch.add_done_callback(lambda done: None if done.cancelled() else gone())

    try:
        result = await cancel_when_gone(work, start)
    finally:
        if watch is None:
            seen = None
        else:
            seen = watch.done() and not watch.cancelled()
            watch.cancel()
    if seen is None:
        if connection is not None:
            if connection.serving_others():
                await asyncio.sleep(0)
            seen = connection.peer_closed()
        else:
            await io_seen()
            seen = _closed_now(receive)
    if seen:  # closed as the work finished: its callback had not run yet
        raise ClientGone(result)
    return result


async def cancel_when_gone(work: Awaitable[T], start: Callable[[Callable[[], None]], None]) -> T:
    """Await ``work`` (in this task); after :data:`WATCH_AFTER_S` call ``start(gone)``,
    which arranges to call ``gone()`` when the client is seen gone. ``gone()`` while
    ``work`` runs cancels it, and this raises :class:`ClientGone`; later it does nothing."""
    task = asyncio.current_task()
    assert task is not None
    running, cancelled = True, False

    def gone() -> None:
        nonlocal cancelled
        if running and not cancelled:
            cancelled = True
            task.cancel()

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, start, gone)
    try:
        return await work
    except asyncio.CancelledError:
        if not cancelled:
            raise
        task.uncancel()
        raise ClientGone() from None
    finally:
        running = False
        timer.cancel()


async def io_seen() -> None:
    """Let the loop read what its sockets already hold. A close that came with a request
    is seen after this even when the work never suspended (a quick run on the event loop,
    ``MultiGpuDispatcher._inline``). Two turns. In the first the loop polls the sockets;
    the server reads the FIN and schedules its ``connection_lost``. In the second that
    callback runs, before this task resumes."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def _closed_now(receive: Receive) -> bool:
    """Whether ``receive()`` answers ``http.disconnect`` without waiting: run its coroutine
    up to its first suspension and close it there. A server's ``receive`` returns at once
    once the connection closed (uvicorn, httpx's ASGI transport). One that is not a plain
    coroutine is awaited in a task, as long work is."""
    probe = receive()
    send = getattr(probe, "send", None)
    if send is None:  # not a coroutine: nothing to step through without a task
        asyncio.ensure_future(probe).cancel()
        return False
    try:
        send(None)  # suspended: the connection is open (the future it waits on is dropped)
    except StopIteration as done:
        return isinstance(done.value, dict) and done.value.get("type") == "http.disconnect"
    finally:
        probe.close()  # type: ignore[attr-defined]
    return False


def cross_site(scope: Scope) -> bool:
    """Whether a browser sent this request on behalf of another site. Its
    ``Sec-Fetch-Site`` is neither ``same-origin`` nor ``none`` (typed in). Or, from a
    browser that does not send that, its ``Origin`` is not this ``Host``. Clients that are
    not browsers send neither and pass."""
    fetch_site = origin = host = None
    for key, value in scope["headers"]:
        if key == b"sec-fetch-site":
            fetch_site = value
        elif key == b"origin":
            origin = value
        elif key == b"host":
            host = value
    if fetch_site is not None:
        return fetch_site not in (b"same-origin", b"none")
    if origin is None:
        return False
    netloc = origin.partition(b"://")[2]
    return not netloc or host is None or netloc.lower() != host.lower()


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case bytes), decoded as latin-1."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def header_values(scope: Scope, names: tuple[bytes, ...]) -> list[str | None]:
    """:func:`header` of each of ``names``, in one pass over the request's headers."""
    found: list[str | None] = [None] * len(names)
    for key, value in scope["headers"]:
        if key in names:
            at = names.index(key)
            if found[at] is None:
                found[at] = str(value.decode("latin-1"))
    return found


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; raises :class:`BodyError` (413) past ``limit`` bytes,
    checked against ``Content-Length`` before reading and against what arrives."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, "too_large", f"body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BodyError(400, "malformed", "the client went away before sending its body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyError(413, "too_large", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def error_body(code: str, message: str, field: str | None = None) -> bytes:
    """The project's error shape: ``{"error": {"code", "message", "field"?}}``."""
    err: dict[str, str] = {"code": code, "message": message}
    if field is not None:
        err["field"] = field
    return orjson.dumps({"error": err})


async def respond_error(send: Send, exc: BaseException, rejected: Counter | None = None) -> None:
    """Answer ``exc`` as :func:`node.errors.outcome` maps it, in the project's error shape
    (with ``Retry-After`` on a 503); count it in ``rejected`` under its label, if any."""
    o = outcome(exc)
    if rejected is not None and o.reject_reason is not None:
        rejected.labels(o.reject_reason).inc()
    headers = [] if o.retry_after is None else [(b"retry-after", o.retry_header.encode())]
    await respond(send, o.status, error_body(o.code, o.message, o.field), headers=headers)


async def respond_gone(send: Send) -> None:
    """Close the exchange of a request whose client left (:class:`ClientGone`): 499
    ``client_gone`` (nginx's "client closed request"), which nobody reads. The server
    drops it if it has seen the close already. Else it goes to a socket the client shut.
    Hazard: returning without a response instead made uvicorn log ``ASGI callable
    returned without starting response`` at ERROR and write a 500, when the probe
    (:data:`CONNECTION`) saw the close before the server's read did, and the access
    line said 500."""
    await respond_error(send, ClientGone())
