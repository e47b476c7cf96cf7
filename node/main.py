"""``affinity-node``: discover devices, build one session per device, register, serve.

Every flag also reads an ``AFFINITY_*`` environment variable (the flag wins). Without
``--redis`` / ``AFFINITY_REDIS_URL`` the node runs on an embedded in-process store
(single host only), optionally answering the Redis protocol on ``--embedded-port``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import uvicorn

from affinity import Settings, connect, embedded_store
from node.app import create_app
from node.binding import BoundSession
from node.config import NodeConfig
from node.devices import DeviceSpec, discover, pin_pci_bus_order
from node.dispatcher import MultiGpuDispatcher, Session
from node.policy import DEMO_MODEL, load_contract
from node.providers import GpuUnavailable, ProviderSettings, build_session, require_cuda
from node.service import NodeService

__all__ = ["build_service", "main", "parse_args"]

log = logging.getLogger("affinity.node")
CUDA_GRAPH_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def _env_default(env: Mapping[str, str], name: str, default: Any = None) -> Any:
    value = env.get(name)
    return default if value is None or value == "" else value


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").lower() in ("1", "true", "yes", "on")


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> NodeConfig:
    env = os.environ if env is None else env

    def e(name: str, default: Any = None) -> Any:
        return _env_default(env, name, default)

    p = argparse.ArgumentParser(prog="affinity-node", description=__doc__)
    p.add_argument(
        "--redis",
        default=e("AFFINITY_REDIS_URL"),
        help="Redis URL (redis://, rediss://, unix://, redis+sentinel://, "
        "redis+cluster://); none: the embedded single-host store",
    )
    p.add_argument("--namespace", default=e("AFFINITY_NAMESPACE", "affinity"))
    p.add_argument("--node-id", default=e("AFFINITY_NODE_ID"), help="default: the host name")
    p.add_argument("--host", default=e("AFFINITY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(e("AFFINITY_PORT", 8000)))
    p.add_argument(
        "--advertise-url",
        default=e("AFFINITY_ADVERTISE_URL"),
        help="URL other nodes forward to (default: http://<host>:<port>)",
    )
    p.add_argument(
        "--devices",
        default=e("AFFINITY_DEVICES", "auto"),
        help="auto | cpu:N | GPU indices such as 0,2",
    )
    p.add_argument("--model", type=Path, default=Path(e("AFFINITY_MODEL", str(DEMO_MODEL))))
    p.add_argument(
        "--capacity",
        type=int,
        default=int(e("AFFINITY_CAPACITY", 64)),
        help="live episodes per device",
    )
    p.add_argument("--weight", type=int, default=int(e("AFFINITY_WEIGHT", 1)))
    p.add_argument(
        "--episode-ttl",
        type=float,
        default=float(e("AFFINITY_EPISODE_TTL", 300)),
        help="idle seconds before an episode's assignment expires",
    )
    p.add_argument("--lease-ttl", type=float, default=float(e("AFFINITY_LEASE_TTL", 10)))
    p.add_argument("--act-deadline", type=float, default=float(e("AFFINITY_ACT_DEADLINE", 5)))
    p.add_argument("--max-body-bytes", type=int, default=int(e("AFFINITY_MAX_BODY_BYTES", 1 << 20)))
    p.add_argument("--tensorrt", action="store_true", default=_flag(env, "AFFINITY_TENSORRT"))
    p.add_argument(
        "--trt-cache", type=Path, default=Path(e("AFFINITY_TRT_CACHE", "~/.cache/affinity/trt"))
    )
    p.add_argument("--cuda-graph", action="store_true", default=_flag(env, "AFFINITY_CUDA_GRAPH"))
    p.add_argument("--failure-threshold", type=int, default=int(e("AFFINITY_FAILURE_THRESHOLD", 3)))
    p.add_argument("--cooldown", type=float, default=float(e("AFFINITY_COOLDOWN", 30)))
    p.add_argument(
        "--embedded-port",
        type=int,
        default=int(e("AFFINITY_EMBEDDED_PORT")) if e("AFFINITY_EMBEDDED_PORT") else None,
        help="with the embedded store: also answer the Redis protocol on this port",
    )
    p.add_argument("--log-level", default=e("AFFINITY_LOG_LEVEL", "info"))
    a = p.parse_args(argv)
    node_id = a.node_id or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:128]
    advertise = (
        a.advertise_url
        or f"http://{a.host if a.host != '0.0.0.0' else socket.gethostname()}:{a.port}"
    )
    try:
        settings = Settings.from_env(
            env,
            redis_url=a.redis,
            namespace=a.namespace,
            episode_ttl_s=a.episode_ttl,
            lease_ttl_s=a.lease_ttl,
        )
        return NodeConfig(
            node_id=node_id,
            advertise_url=advertise.rstrip("/"),
            settings=settings,
            host=a.host,
            port=a.port,
            devices=a.devices,
            model=a.model,
            capacity=a.capacity,
            weight=a.weight,
            act_deadline_s=a.act_deadline,
            max_body_bytes=a.max_body_bytes,
            admin_token=e("AFFINITY_ADMIN_TOKEN"),
            cluster_secret=e("AFFINITY_CLUSTER_SECRET"),
            providers=ProviderSettings(
                tensorrt=a.tensorrt, trt_cache_root=a.trt_cache, cuda_graph=a.cuda_graph
            ),
            failure_threshold=a.failure_threshold,
            cooldown_s=a.cooldown,
            embedded_port=a.embedded_port,
        )
    except ValueError as exc:
        p.error(str(exc))
        raise  # unreachable: p.error exits


def build_service(
    config: NodeConfig,
    redis: Any | None = None,
    specs: list[DeviceSpec] | None = None,
    session_factory: Callable[[DeviceSpec], tuple[Session, str]] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Callable[[], Awaitable[NodeService]]:
    """The start-up of a node, as a factory for :func:`node.app.create_app`.

    ``redis`` defaults to a client for ``config.settings`` (or the embedded store);
    ``session_factory(spec)`` returns (session, provider really used) and defaults to
    ONNX Runtime with the device's provider plan; ``transport`` carries forwarded
    requests (tests route them in-process).
    """

    async def factory() -> NodeService:
        client = redis
        if client is None:
            if config.settings.redis_url:
                client = connect(config.settings)
            else:
                log.warning(
                    "no Redis URL given: using the embedded in-process store (single host only)"
                )
                client = embedded_store(config.embedded_port)
        env = os.environ
        pin_pci_bus_order(env)
        devices = specs if specs is not None else discover(config.devices)
        contract = load_contract(config.model)

        def ort_session(spec: DeviceSpec) -> tuple[Session, str]:
            built = build_session(
                config.model, spec, config.providers, intra_op_threads=config.intra_op_threads
            )
            if not (config.providers.cuda_graph and built.active in CUDA_GRAPH_PROVIDERS):
                return built.session, built.active
            # captured by dispatcher.warm_up(), on the device's worker thread
            return BoundSession(built.session, contract, "cuda", spec.ordinal or 0), built.active

        make = session_factory or ort_session
        sessions: dict[str, Session] = {}
        providers: dict[int, str] = {}
        for spec in devices:
            session, provider = make(spec)
            sessions[f"{config.node_id}/{spec.index}"] = session
            providers[spec.index] = provider

        def dispatcher(
            ids: list[str], on_transition: Callable[[str, str, str], None]
        ) -> MultiGpuDispatcher:
            return MultiGpuDispatcher(
                ids,
                sessions.__getitem__,
                contract,
                idle_ttl_s=config.settings.episode_ttl_s,
                failure_threshold=config.failure_threshold,
                cooldown_s=config.cooldown_s,
                on_transition=on_transition,
            )

        service = NodeService(
            config,
            client,
            devices,
            providers,
            dispatcher,
            contract,
            transport=transport,
            owns_redis=redis is None,
        )
        await service.dispatcher.warm_up()
        graphs = sum(isinstance(s, BoundSession) for s in sessions.values())
        log.info("%d device(s) warmed up on their workers, %d CUDA graph(s)", len(sessions), graphs)
        return service

    return factory


EXIT_NO_GPU = 4
"""Exit status when --devices names GPUs (or auto finds some) that CUDA cannot run."""


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(
        level=config_level(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    pin_pci_bus_order(os.environ)
    try:
        specs = discover(config.devices)
        require_cuda(specs)
    except (ValueError, GpuUnavailable) as exc:
        print(f"affinity-node: {exc}", file=sys.stderr)
        sys.exit(EXIT_NO_GPU if isinstance(exc, GpuUnavailable) else 2)
    app = create_app(build_service(config, specs=specs))

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # a graceful stop waits for open responses; an event stream never ends
            app.state.fleet.close()
            super().handle_exit(sig, frame)

    Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=int(config.act_deadline_s) + 5,
            access_log=False,
        )
    ).run()


def config_level() -> int:
    return getattr(logging, os.environ.get("AFFINITY_LOG_LEVEL", "info").upper(), logging.INFO)


if __name__ == "__main__":
    main()
