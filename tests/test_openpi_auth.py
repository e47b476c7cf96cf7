"""Issue 36 item 12: openpi's websocket without the API key is refused before the upgrade
with 401 and the project's JSON error body (as docs/protocols.md says of every front door),
and writes an access line; it used to be a bare 403 with an empty body and no line."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import websockets.exceptions
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from tests.procs import Node, RedisServer, tmpdir, wait_until

pytestmark = [
    pytest.mark.integration,
    # openpi-client 0.1.2 calls websockets' connect() outside a with block
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]


@pytest.fixture(scope="module")
def keyed() -> Iterator[Node]:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    node = Node(tmp, "keyed-ws", server.url, devices="cpu:1", extra=["--api-key", "k3y"]).start()
    yield node
    node.stop()
    server.stop()


def handshake(node: Node, extra: str) -> tuple[str, dict[str, str], bytes]:
    """A websocket upgrade request as openpi-client sends it: status line, headers, body."""
    with socket.create_connection((node.host, node.port), timeout=10) as sock:
        sock.sendall(
            (
                "GET /?episode_id=auth-1 HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                f"Sec-WebSocket-Version: 13\r\n{extra}\r\n"
            ).encode()
        )
        data = b""
        while chunk := sock.recv(65536):  # the node closes after a refusal
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return status, headers, body


@pytest.mark.parametrize("auth", ["", "Authorization: Api-Key wrong\r\n", "Authorization: x\r\n"])
def test_a_websocket_without_the_key_is_401_with_the_json_error(keyed: Node, auth: str) -> None:
    status, headers, body = handshake(keyed, auth)
    assert status.startswith("HTTP/1.1 401 "), status
    assert headers["content-type"] == "application/json"
    assert headers["www-authenticate"] == "Api-Key"
    error = json.loads(body)["error"]
    assert error["code"] == "unauthorized" and "Api-Key" in error["message"]


def test_a_refused_websocket_writes_an_access_line(keyed: Node) -> None:
    before = keyed.proc.log().count('"WS /" 401')
    handshake(keyed, "")
    wait_until(lambda: keyed.proc.log().count('"WS /" 401') > before, 10, "the access line")


def test_openpi_client_is_told_401_and_connects_with_the_key(keyed: Node) -> None:
    url = f"ws://{keyed.host}:{keyed.port}/?episode_id=auth-2"
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        WebsocketClientPolicy(url, api_key="wrong")
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "unauthorized"
    policy = WebsocketClientPolicy(url, api_key="k3y")
    try:
        assert policy.get_server_metadata()["affinity"]["episode_id"] == "auth-2"
    finally:
        policy._ws.close()
