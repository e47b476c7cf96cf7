"""affinity.transport.Transport against a scripted HTTP/1.1 server on loopback."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from affinity.transport import Transport

TIMEOUT = {"timeout": httpx.Timeout(10).as_dict()}


class Scripted:
    """A server that answers each request with the next scripted reply (raw bytes) and
    closes the connection after a reply marked so; it records what it was sent."""

    def __init__(self, replies: list[tuple[bytes, bool]]) -> None:
        self.replies = list(replies)
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.connections = 0
        self.closed = threading.Event()  # set after each close of a connection
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.replies:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(10)
                buffer = b""
                while self.replies:
                    while b"\r\n\r\n" not in buffer:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        buffer += chunk
                    if b"\r\n\r\n" not in buffer:
                        break  # the client closed this connection
                    head, _, buffer = buffer.partition(b"\r\n\r\n")
                    length = next(
                        (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                         if line.lower().startswith(b"content-length:")),
                        0,
                    )  # fmt: skip
                    while len(buffer) < length:
                        buffer += conn.recv(65536)
                    self.requests.append((head, buffer[:length]))
                    buffer = buffer[length:]
                    reply, close = self.replies.pop(0)
                    conn.sendall(reply)
                    if close:
                        break
            self.closed.set()

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # wakes a pending accept (Linux)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(10)


@pytest.fixture
def transport() -> Iterator[Transport]:
    t = Transport()
    yield t
    t.close()


def post(transport: Transport, url: str, body: bytes = b"hello") -> httpx.Response:
    request = httpx.Request("POST", url + "/act", content=body, extensions=TIMEOUT)
    response = transport.handle_request(request)
    response.read()
    return response


def ok(body: bytes, *headers: bytes) -> bytes:
    head = b"".join(h + b"\r\n" for h in headers)
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), head, body)


def test_a_request_goes_as_sent_and_the_connection_is_kept(transport: Transport) -> None:
    server = Scripted([(ok(b"one", b"X-Affinity-Url: http://b"), False), (ok(b"two"), False)])
    try:
        image = bytes(range(256)) * 1200  # camera-sized: many segments, one read
        first = post(transport, server.url, image)
        second = post(transport, server.url, b"")
    finally:
        server.stop()
    assert (first.status_code, first.content, second.content) == (200, b"one", b"two")
    assert first.headers["x-affinity-url"] == "http://b"
    assert server.connections == 1  # keep-alive: the second step reused the socket
    head, body = server.requests[0]
    assert head.startswith(b"POST /act HTTP/1.1\r\n") and b"\r\nHost: 127.0.0.1:" in head
    assert body == image and server.requests[1][1] == b""


def test_chunked_and_close_framed_replies(transport: Transport) -> None:
    chunked = (
        b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n"
        b"Retry-After: 2\r\n\r\n4;ext=1\r\nbusy\r\n3\r\n!!!\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    to_close = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"
    informational = b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"again")
    server = Scripted([(chunked, False), (to_close, True), (informational, False)])
    try:
        busy = post(transport, server.url)
        whole = post(transport, server.url)
        assert server.closed.wait(10)
        again = post(transport, server.url)
    finally:
        server.stop()
    assert (busy.status_code, busy.content, busy.headers["retry-after"]) == (503, b"busy!!!", "2")
    assert whole.content == b"all of it"
    assert again.content == b"again" and server.connections == 2


def test_a_connection_the_server_closed_while_idle_is_not_reused(transport: Transport) -> None:
    # keep-alive expiry: the server drops an idle connection (uvicorn after 5 s)
    server = Scripted([(ok(b"one"), True), (ok(b"two"), False)])
    try:
        assert post(transport, server.url).content == b"one"
        assert server.closed.wait(10)
        assert post(transport, server.url).content == b"two"
    finally:
        server.stop()
    assert server.connections == 2


@pytest.mark.parametrize(
    "reply",
    [
        b"SMTP 220 hello\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n" * 9 + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    ],
)
def test_a_malformed_or_cut_reply_is_a_protocol_error(transport: Transport, reply: bytes) -> None:
    server = Scripted([(reply, True)])
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            post(transport, server.url)
    finally:
        server.stop()


def test_transport_errors_are_httpx_errors(transport: Transport) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        request = httpx.Request("POST", url, content=b"x", extensions={"timeout": {"read": 0.05}})
        with pytest.raises(httpx.ReadTimeout):
            transport.handle_request(request)
    with pytest.raises(httpx.ConnectError):  # nothing listens there now
        post(transport, url)


def test_a_header_with_a_newline_is_refused_before_sending(transport: Transport) -> None:
    server = Scripted([(ok(b"never"), True)])
    try:
        request = httpx.Request(
            "POST", server.url, headers={"Authorization": "Api-Key k\r\nX-Evil: 1"},
            extensions=TIMEOUT,
        )  # fmt: skip
        with pytest.raises(httpx.LocalProtocolError):
            transport.handle_request(request)
        assert server.requests == []
    finally:
        server.stop()
