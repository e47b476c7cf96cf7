"""Calling the node's ASGI app in process, as ``bench/path.py`` and ``bench/kserve_path.py``
do: the app on one CPU device, one request straight into it, the connection probe.

No sockets and no HTTP parsing: what is measured is the app's own work per request.
The probe is a real socket pair, so the close check costs the node's ``poll(2)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from affinity import Settings
from node.app import NodeApp, create_app
from node.config import NodeConfig
from node.startup import build_service


class Connection:
    """What the node's HTTP protocol tells a request (``node.asgi.Connection``), over a
    real socket pair: the close check costs the same ``poll(2)``."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.poll = select.poll()
        self.poll.register(self.ours.fileno(), select.POLLRDHUP)

    def peer_closed(self) -> bool:
        return bool(self.poll.poll(0))

    def serving_others(self) -> bool:
        return False


@contextlib.asynccontextmanager
async def running_node(**config: Any) -> AsyncIterator[NodeApp]:
    """The node's app, started, on one CPU device with room for 1000 episodes, on the
    embedded store; ``config`` overrides :class:`NodeConfig` fields (``settings`` too). Its
    access log goes to /dev/null."""
    config = {"settings": Settings(lease_ttl_s=30), "capacity": 1000, **config}
    node = NodeConfig(node_id="path", advertise_url="http://path.test", devices="cpu:1")
    app = create_app(build_service(replace(node, **config)))
    with open(os.devnull, "w") as app.access.stream:
        async with app.api.router.lifespan_context(app.api):
            yield app


async def post(
    app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]], connection: Connection
) -> None:
    """One ``POST path`` into ``app``; raises ``RuntimeError`` unless it answers 200."""
    sent = False
    out: list[Any] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.get_running_loop().create_future()  # open until the reply
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        out.append(message)

    scope = {
        "type": "http", "method": "POST", "path": path, "http_version": "1.1",
        "scheme": "http", "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5555),
        "server": ("127.0.0.1", 8000), "asgi": {"version": "3.0"}, "state": {},
        "headers": [(b"host", b"127.0.0.1:8000"), *headers,
                    (b"content-length", str(len(body)).encode())],
        "affinity.connection": connection,
    }  # fmt: skip
    await app(scope, receive, send)
    if out[0]["status"] != 200:
        raise RuntimeError(f"{out[0]['status']}: {out[-1].get('body', b'')[:300]!r}")
