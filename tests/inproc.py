"""In-process nodes: the real app, real ONNX Runtime sessions on the CPU, fakeredis or a
real Redis, and forwarded requests routed between apps without sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI

from affinity import Settings
from node.app import create_app
from node.config import NodeConfig
from node.devices import discover
from node.dispatcher import Session
from node.main import build_service
from node.service import NodeService


class Router(httpx.AsyncBaseTransport):
    """Sends each request to the in-process app whose advertise host it names."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}
        self.down: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down or host not in self.apps:
            raise httpx.ConnectError(f"{host} unreachable", request=request)
        return await self.apps[host].handle_async_request(request)


@dataclass
class InProcNode:
    app: FastAPI
    client: httpx.AsyncClient

    @property
    def service(self) -> NodeService:
        return self.app.state.service  # type: ignore[no-any-return]

    async def act(self, **body: Any) -> httpx.Response:
        return await self.client.post("/act", json=body)


def config(node_id: str, **kw: Any) -> NodeConfig:
    settings = kw.pop("settings", Settings(lease_ttl_s=10, episode_ttl_s=60))
    return replace(
        NodeConfig(
            node_id=node_id,
            advertise_url=f"http://{node_id}.test",
            settings=settings,
            devices="cpu:2",
            capacity=16,
        ),
        **kw,
    )


@asynccontextmanager
async def cluster(
    redis: Any,
    configs: list[NodeConfig],
    session_factory: Callable[[Any], tuple[Session, str]] | None = None,
) -> AsyncIterator[tuple[list[InProcNode], Router]]:
    router = Router()
    nodes = []
    async with AsyncExitStack() as stack:
        for cfg in configs:
            app = create_app(
                build_service(
                    cfg,
                    redis=redis,
                    specs=discover(cfg.devices),
                    session_factory=session_factory,
                    transport=router,
                )
            )
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
            router.apps[urlsplit(cfg.advertise_url).hostname or ""] = transport
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url=cfg.advertise_url)
            )
            nodes.append(InProcNode(app, client))
        yield nodes, router
