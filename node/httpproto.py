"""The node's HTTP protocol: uvicorn's httptools protocol, subclassed (keep-alive, one write per
reply, the connection probe). Used by the node's process and by its front door processes
(``node/front.py``), so it imports nothing heavy. Hazard: a uvicorn upgrade is checked
against it."""

from __future__ import annotations

import asyncio
import select
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from node.asgi import CONNECTION
from node.hop import readable

__all__ = ["KeepAliveProtocol", "OneWriteTransport"]


class OneWriteTransport:
    """A connection's transport that sends a response's status line and headers together
    with what follows them. uvicorn writes the head and the body of a reply as two
    ``write`` calls, so two TCP segments, and the client wakes up twice for one reply.
    Measured with ``tritonclient.http`` in lockstep, steps to a node that writes once and
    to one that writes twice taking turns: p50 0.58 ms vs 1.05 ms. The head is held until
    the next write or the end of the loop iteration, whichever comes first. The next write
    is the body, in the same send of a plain reply; the loop's end serves a streamed body.
    :attr:`late` says a write reached the transport once it was closing (the event loop may
    drop it: a front's ``drained`` then cannot say it was sent). Every other call goes to
    the transport."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        self.late = False

    def write(self, data: bytes) -> None:
        if self._transport.is_closing():
            self.late = True
        head, self._head = self._head, None
        if head is not None:
            self._transport.writelines((head, data))
        elif data.startswith(b"HTTP/"):
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        if self._head is not None and self._transport.is_closing():
            self.late = True
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class KeepAliveProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol, except that:

    - an idle keep-alive connection whose client has already sent its next request is not
      closed. The process may be paused (or the loop busy) past the keep-alive timeout.
      Then the timer fires before the queued request is read. Closing would drop a request
      the client cannot know the fate of. Such a request is read and answered instead (503
      ``fenced`` if the lease lapsed).
    - a reply's head and body leave in one write (:class:`OneWriteTransport`).
    - every request's scope carries it as :data:`~node.asgi.CONNECTION`, for
      ``node.asgi.while_connected``. It says whether the client has closed the connection
      by now (:meth:`peer_closed`: one ``poll(2)`` instead of two turns of the event loop).
      It says whether other requests are being served (:meth:`serving_others`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(OneWriteTransport(transport, self.loop))  # type: ignore[arg-type]
        sock = transport.get_extra_info("socket")
        self._hangup: select.poll | None = None
        if sock is not None and sock.fileno() >= 0:
            self._hangup = select.poll()
            self._hangup.register(sock.fileno(), select.POLLRDHUP)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CONNECTION] = self  # type: ignore[literal-required]

    def peer_closed(self) -> bool:
        """Whether the client has closed (or reset) the connection, as the kernel knows it
        now, even before the event loop read it: POLLRDHUP (its FIN), POLLHUP or POLLERR.
        The socket is polled only while the transport is open, so the descriptor is this
        connection's."""
        if self.cycle is None or self.cycle.disconnected or self.transport.is_closing():
            return True
        if self._hangup is None:
            return False
        return bool(self._hangup.poll(0))

    def serving_others(self) -> bool:
        """Whether the server runs other requests' tasks now (every connection's)."""
        return len(self.tasks) > 1

    def timeout_keep_alive_handler(self) -> None:
        sock = self.transport.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        if fd >= 0 and readable(fd):
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()
