"""In-process nodes: the real app, real ONNX Runtime sessions on the CPU, fakeredis or a
real Redis, and forwarded requests routed between apps without sockets."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import httpx

from affinity import Settings
from node.app import NodeApp, create_app
from node.config import NodeConfig
from node.devices import discover
from node.dispatcher import Session
from node.errors import ForwardError
from node.forward import INTERNAL_PATH, SECRET_HEADER, Response
from node.models import DEMO_MODEL
from node.service import NodeService
from node.startup import build_service


class Router:
    """The forward pool of in-process nodes: sends each forward to the app whose
    advertise host it names (``down`` hosts are unreachable)."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.AsyncClient] = {}
        self.down: set[str] = set()
        self.secret = ""

    async def post(self, url: str, body: bytes, path: str = INTERNAL_PATH) -> Response:
        host = urlsplit(url).hostname or ""
        if host in self.down or host not in self.apps:
            raise ForwardError(f"cannot connect to {host}", unsent=True)
        resp = await self.apps[host].post(
            path,
            content=body,
            headers={SECRET_HEADER: self.secret, "content-type": "application/msgpack"},
        )
        return Response(resp.status_code, dict(resp.headers), resp.content)

    def close(self) -> None:
        pass


def claim_of(service: NodeService, episode: str) -> tuple[str, int, str, str] | None:
    """The claim (device, token, claim id, ``"name@version"``) of the record ``service``
    holds for ``episode``, if any."""
    record = service.table.get(episode)
    return None if record is None else (record.device, record.token, record.claim, record.model)


@dataclass
class InProcNode:
    app: NodeApp
    client: httpx.AsyncClient

    @property
    def service(self) -> NodeService:
        return self.app.service

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
    router.secret = configs[0].cluster_secret or "" if configs else ""
    nodes = []
    async with AsyncExitStack() as stack:
        for cfg in configs:
            app = create_app(
                build_service(
                    cfg,
                    redis=redis,
                    specs=discover(cfg.devices),
                    session_factory=session_factory,
                    pool=router,
                )
            )
            await stack.enter_async_context(app.api.router.lifespan_context(app.api))
            client = await stack.enter_async_context(
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url=cfg.advertise_url
                )
            )
            router.apps[urlsplit(cfg.advertise_url).hostname or ""] = client
            nodes.append(InProcNode(app, client))
        yield nodes, router


class Gate:
    """A real ORT session whose runs wait for ``go`` when the input's first value is 9."""

    go = threading.Event()
    entered = threading.Event()

    def __init__(self, spec: Any) -> None:
        from node.providers import ProviderSettings, build_session

        self.inner = build_session(DEMO_MODEL, spec, ProviderSettings()).session

    def run(self, names: Any, feed: Any) -> Any:
        if feed["obs"][0][0] == 9:
            Gate.entered.set()
            assert Gate.go.wait(30)
        return self.inner.run(names, dict(feed))
