"""The sync client's HTTP/1.1 transport: plain ``http://`` on keep-alive sockets.

httpx's default transport (httpcore over h11) spends about a millisecond of the client's
CPU on each request on a small machine. It spends more with a camera-sized body. For a
robot stepping a policy in lockstep that is most of what separates ``POST /act`` from
openpi's websocket.

:class:`Transport` does what the client needs and no more. It sends one request at a time
per connection and keeps idle connections per origin (checked for a close by the server
before reuse). It sets ``TCP_NODELAY`` and writes bodies from the caller's bytes without a
copy. Responses are framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the
connection's close. Any other scheme (``https://``) goes to httpx's own transport.

Errors are httpx's, all ``httpx.TransportError``: ``ConnectError``/``ConnectTimeout``,
``WriteError``/``WriteTimeout`` and ``ReadError``/``ReadTimeout``. Also
``RemoteProtocolError`` (a malformed reply, or the server closing before it). Also
``LocalProtocolError`` (a header holding CR or LF, refused before anything is sent).
httpx's timeouts (``request.extensions["timeout"]``) apply to connecting, writing and each
read.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import httpx

__all__ = ["Transport"]

_MAX_HEAD = 64 * 1024  # a reply's status line and headers
_MAX_IDLE = 8  # idle connections kept per origin
_MAX_INFORMATIONAL = 8  # 1xx replies skipped before the final one
_READ = 64 * 1024

Origin = tuple[bytes, int]


class _Connection:
    """One socket and the bytes read past the last reply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def alive(self) -> bool:
        """Whether an idle connection can carry a request: nothing arrived on it (a
        server that closed it, or sent what no request asked for, makes it readable)."""
        if self.buffer:
            return False
        try:
            self.sock.setblocking(False)
            try:
                self.sock.recv(1, socket.MSG_PEEK)  # b"" (closed) or unasked-for bytes
            finally:
                self.sock.setblocking(True)
        except BlockingIOError:
            return True
        except OSError:
            pass
        return False

    def fill(self, request: httpx.Request) -> None:
        """Read more of the reply into the buffer; EOF is an error."""
        try:
            chunk = self.sock.recv(_READ)
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc), request=request) from exc
        if not chunk:
            raise httpx.RemoteProtocolError(
                "server disconnected without sending a complete response", request=request
            )
        self.buffer += chunk

    def take(self, n: int, request: httpx.Request) -> bytes:
        while len(self.buffer) < n:
            self.fill(request)
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    def line(self, request: httpx.Request, limit: int = _MAX_HEAD) -> bytes:
        """One CRLF-terminated line, without its CRLF."""
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > limit:
                raise httpx.RemoteProtocolError("response line too long", request=request)
            self.fill(request)
        return self.take(end + 2, request)[:-2]

    def close(self) -> None:
        self.sock.close()


def _timeouts(request: httpx.Request) -> dict[str, float | None]:
    timeout: dict[str, float | None] = request.extensions.get("timeout", {})
    return timeout


def _head(request: httpx.Request) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    lines.extend(b"%s: %s" % pair for pair in request.headers.raw)
    head = b"\r\n".join(lines)
    if head.count(b"\n") != len(lines) - 1 or head.count(b"\r") != len(lines) - 1:
        # a CR or LF inside a header (an API key pasted with its newline) would split it
        raise httpx.LocalProtocolError("a request header holds a CR or LF", request=request)
    return head + b"\r\n\r\n"


def _chunked(request: httpx.Request) -> bool:
    return str(request.headers.get("transfer-encoding", "")).lower() == "chunked"


def _read_head(
    conn: _Connection, request: httpx.Request
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, HTTP version) of the final (non-1xx) reply."""
    for _ in range(_MAX_INFORMATIONAL + 1):
        status_line = conn.line(request)
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise httpx.RemoteProtocolError(
                f"malformed status line {status_line[:80]!r}", request=request
            )
        headers: list[tuple[bytes, bytes]] = []
        size = len(status_line)
        while line := conn.line(request):
            size += len(line)
            if size > _MAX_HEAD:
                raise httpx.RemoteProtocolError("response headers too long", request=request)
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise httpx.RemoteProtocolError(
                    f"malformed header line {line[:80]!r}", request=request
                )
            headers.append((name, value.strip()))
        if not 100 <= int(code) < 200:
            return int(code), headers, version
    raise httpx.RemoteProtocolError("too many informational (1xx) replies", request=request)


def _read_chunked(conn: _Connection, request: httpx.Request) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = conn.line(request).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise httpx.RemoteProtocolError(
                f"malformed chunk size {size_line[:40]!r}", request=request
            ) from None
        if size == 0:
            while conn.line(request):  # trailers, up to the empty line
                pass
            return b"".join(parts)
        parts.append(conn.take(size, request))
        if conn.take(2, request) != b"\r\n":
            raise httpx.RemoteProtocolError("chunk not followed by CRLF", request=request)


def _read_to_close(conn: _Connection, request: httpx.Request) -> bytes:
    while True:
        try:
            conn.fill(request)
        except httpx.RemoteProtocolError:  # the close is the end of this body
            data = bytes(conn.buffer)
            conn.buffer.clear()
            return data


def _exchange(
    conn: _Connection, request: httpx.Request, body: bytes
) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
    """Send ``request`` on ``conn`` and read its reply: (status, headers, body, whether
    the connection can carry another request)."""
    timeout = _timeouts(request)
    if _chunked(request):
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    try:
        conn.sock.settimeout(timeout.get("write"))
        conn.sock.sendall(_head(request))
        if body:
            conn.sock.sendall(body)
    except TimeoutError as exc:
        raise httpx.WriteTimeout(str(exc) or "timed out", request=request) from exc
    except OSError as exc:
        raise httpx.WriteError(str(exc), request=request) from exc
    conn.sock.settimeout(timeout.get("read"))
    status, headers, version = _read_head(conn, request)
    fields = {name.lower(): value for name, value in headers}
    reusable = version == b"HTTP/1.1" and fields.get(b"connection", b"").lower() != b"close"
    if request.method == "HEAD" or status in (204, 304):
        return status, headers, b"", reusable
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        return status, headers, _read_chunked(conn, request), reusable
    if b"content-length" in fields:
        length = fields[b"content-length"]
        if not length.isdigit():
            raise httpx.RemoteProtocolError(f"bad Content-Length {length[:40]!r}", request=request)
        return status, headers, conn.take(int(length), request), reusable
    return status, headers, _read_to_close(conn, request), False


class Transport(httpx.BaseTransport):
    """An ``httpx`` transport for plain ``http://`` (see the module doc); thread-safe."""

    def __init__(self) -> None:
        self._idle: dict[Origin, list[_Connection]] = {}
        self._lock = threading.Lock()
        self._fallback: httpx.HTTPTransport | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            with self._lock:
                if self._fallback is None:
                    self._fallback = httpx.HTTPTransport()
            return self._fallback.handle_request(request)
        origin = (request.url.raw_host, request.url.port or 80)
        body = request.read()
        conn = self._connection(origin, request)
        try:
            status, headers, content, reusable = _exchange(conn, request, body)
        except BaseException:
            conn.close()
            raise
        if reusable:
            self._release(origin, conn)
        else:
            conn.close()
        extensions: dict[str, Any] = {"http_version": b"HTTP/1.1"}
        return httpx.Response(
            status, headers=headers, stream=httpx.ByteStream(content), extensions=extensions
        )

    def _connection(self, origin: Origin, request: httpx.Request) -> _Connection:
        while True:
            with self._lock:
                idle = self._idle.get(origin)
                conn = idle.pop() if idle else None
            if conn is None:
                break
            if conn.alive():
                return conn
            conn.close()
        timeout = _timeouts(request).get("connect")
        host = origin[0].decode("ascii")
        try:
            sock = socket.create_connection((host, origin[1]), timeout=timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(sock)

    def _release(self, origin: Origin, conn: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            if len(idle) < _MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            fallback, self._fallback = self._fallback, None
        for conn in conns:
            conn.close()
        if fallback is not None:
            fallback.close()
