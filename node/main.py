"""``affinity-node``: discover devices, build one session per device, register, serve.

Every flag also reads an ``AFFINITY_*`` environment variable (the flag wins). Without
``--redis`` / ``AFFINITY_REDIS_URL`` the node runs on an embedded in-process store
(single host only), optionally answering the Redis protocol on ``--embedded-port``.

Exit codes: 0 after a graceful stop (SIGTERM: episodes handed over, deregistered), 2 for a
usage or configuration error (one line naming the flag; every flag is checked before
anything starts), 3 when Redis cannot be reached at start-up, 4 when another running
process holds this node id, 5 when GPUs are found that CUDA cannot run, 6 when the node
cannot listen on --host/--port (checked before it registers).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import select
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn
from urllib.parse import urlsplit

import uvicorn
from prometheus_client import Histogram
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from affinity import BackendUnavailable, ModelId, NodeConflict, Settings, connect, embedded_store
from affinity.config import ENV_VARS, MAX_REPLICAS
from affinity.connection import url_problem
from affinity.errors import InvalidArgument, SecretMismatch
from affinity.registry import MAX_WEIGHT, check_node_id
from node import warmup
from node.accesslog import JsonFormatter
from node.app import create_app
from node.asgi import CONNECTION
from node.binding import BoundSession
from node.catalog import ModelSpec, parse_model_arg
from node.chunks import ENSEMBLES
from node.config import NodeConfig
from node.devices import DeviceSpec, discover, pin_pci_bus_order
from node.dispatcher import Arrivals, MultiGpuDispatcher, Session
from node.episodes import EpisodeTable
from node.fleet import Fleet
from node.forward import Poster
from node.lease import EXIT_CONFLICT, VERSION
from node.metrics import Metrics
from node.policy import PolicyContract, load_contract
from node.providers import CPU, GpuUnavailable, ProviderSettings, build_session, require_cuda
from node.service import NodeService
from node.stats import ModelStats

__all__ = ["build_service", "main", "parse_args"]

log = logging.getLogger("affinity.node")
CUDA_GRAPH_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
EXIT_USAGE = 2
EXIT_REDIS = 3
EXIT_NO_GPU = 5
"""Exit status when --devices names GPUs (or auto finds some) that CUDA cannot run."""
EXIT_LISTEN = 6
"""Exit status when the node cannot listen on --host/--port (it has not registered)."""
LOG_LEVELS = ("debug", "info", "warning", "error")


HELP = """\
Serve a policy on this host's devices as one node of an affinity fleet: episodes stick to
one device across hosts, with Redis as the source of truth. Every flag also reads the
environment variable named in its help (the flag wins). Without --redis the node runs on an
embedded single-host store.

Exit codes: 0 after a graceful stop (SIGTERM: episodes handed over, deregistered), 2 for a
usage or configuration error (one line naming the flag), 3 when Redis cannot be reached at
start-up, 4 when another running process holds this node id, 5 when GPUs are found that
CUDA cannot run (one line naming the missing library), 6 when the node cannot listen on
--host/--port or --grpc-port (checked before it registers)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the flag (no usage dump), exit code 2."""
        self.exit(EXIT_USAGE, f"affinity-node: {message} (see affinity-node --help)\n")


class StartupError(Exception):
    """A configuration the node cannot start with; the message names the flag and the fix."""


@dataclass(frozen=True)
class _Flag:
    name: str
    env: str
    default: Any
    help: str
    kind: Callable[[str], Any] = str
    low: float | None = None  # the lowest value allowed (with high: inclusive)
    high: float | None = None
    positive: bool = False  # seconds: more than 0

    @property
    def bounds(self) -> str:
        """The allowed values for ``--help`` (empty: any value of the kind)."""
        if self.low is not None and self.high is not None:
            return f"{self.low}-{self.high}; "
        return "more than 0; " if self.positive else ""

    def problem(self, value: Any) -> str | None:
        """What is wrong with a converted value (``None``: nothing)."""
        if self.low is not None and self.high is not None and not self.low <= value <= self.high:
            return f"must be {self.low}-{self.high}"
        if self.positive and not value > 0:
            return "must be more than 0 seconds"
        return None


_FLAGS = (
    _Flag("--redis", "AFFINITY_REDIS_URL", None,
          "Redis URL: redis://, rediss://, unix://, redis+sentinel://, redis+cluster:// "
          "(none: the embedded single-host store)"),
    _Flag("--namespace", "AFFINITY_NAMESPACE", "affinity", "prefix of every Redis key"),
    _Flag("--redis-replicas", "AFFINITY_REDIS_REPLICAS", 0,
          "replicas that must acknowledge (WAIT) every claim, renewal and slide before the "
          "node serves on it (0: no WAIT; needs --redis, not Redis Cluster)", int,
          low=0, high=MAX_REPLICAS),
    _Flag("--redis-wait", "AFFINITY_REDIS_WAIT", 0.1,
          "seconds a write waits for --redis-replicas acknowledgements (at most half of "
          "AFFINITY_REDIS_TIMEOUT)", float, positive=True),
    _Flag("--node-id", "AFFINITY_NODE_ID", None, "this node's id (none: the host name)"),
    _Flag("--host", "AFFINITY_HOST", "127.0.0.1", "address to listen on"),
    _Flag("--port", "AFFINITY_PORT", 8000, "port to listen on", int, low=1, high=65535),
    _Flag("--advertise-url", "AFFINITY_ADVERTISE_URL", None,
          "URL other nodes forward to (none: http://<host>:<port>)"),
    _Flag("--devices", "AFFINITY_DEVICES", "auto",
          "auto | cpu:N | GPU indices or UUIDs such as 0,2"),
    _Flag("--model", "AFFINITY_MODEL", "demo",
          "ONNX policy: a packaged name (demo, vla-demo) or a file, as [NAME=]FILE[@VERSION]; "
          "give it once per model the node serves (env: comma-separated)"),
    _Flag("--model-name", "AFFINITY_MODEL_NAME", None,
          "the model's name for KServe v2 clients (none: the model file's stem)"),
    _Flag("--capacity", "AFFINITY_CAPACITY", 64, "live episodes per device", int,
          low=1, high=1_000_000),
    _Flag("--weight", "AFFINITY_WEIGHT", 1, "share of new episodes per device", int,
          low=1, high=MAX_WEIGHT),
    _Flag("--episode-ttl", "AFFINITY_EPISODE_TTL", 300.0,
          "seconds idle before an episode's owner ends it", float, positive=True),
    _Flag("--lease-ttl", "AFFINITY_LEASE_TTL", 10.0,
          "seconds of the node's lease (renewed every third)", float, positive=True),
    _Flag("--act-deadline", "AFFINITY_ACT_DEADLINE", 5.0,
          "seconds within which every step answers", float, positive=True),
    _Flag("--drain-timeout", "AFFINITY_DRAIN_TIMEOUT", 20.0,
          "seconds: the most a graceful stop (SIGTERM) spends handing episodes over before "
          "it deregisters", float, positive=True),
    _Flag("--max-body-bytes", "AFFINITY_MAX_BODY_BYTES", 1 << 24,
          "bytes of one request body or websocket message", int, low=1, high=1 << 31),
    _Flag("--keep-alive", "AFFINITY_KEEP_ALIVE", 5.0,
          "seconds an idle client connection is kept open", float, positive=True),
    _Flag("--trt-cache", "AFFINITY_TRT_CACHE", "~/.cache/affinity/trt",
          "TensorRT engine cache root", Path),
    _Flag("--max-batch", "AFFINITY_MAX_BATCH", None,
          "steps of different episodes per model run (none: 8 when the model's batch axis "
          "is dynamic, else 1; 1 turns batching off)", int, low=1, high=4096),
    _Flag("--batch-delay", "AFFINITY_BATCH_DELAY", 500.0,
          "microseconds a device waits for more steps once one waits (only while another "
          "recently active episode may send one)", float, low=0, high=60_000_000),
    _Flag("--inline-under", "AFFINITY_INLINE_UNDER", 500.0,
          "microseconds: a device whose model runs take less on average runs a step on the "
          "event loop when nothing else is running (no thread hand-off); 0 turns it off",
          float, low=0, high=1_000_000),
    _Flag("--execute-steps", "AFFINITY_EXECUTE_STEPS", None,
          "action-chunk execution: run the policy every k steps, serve the buffer between "
          "(none: every step runs the model)", int, low=1, high=4096),
    _Flag("--ensemble", "AFFINITY_ENSEMBLE", "none",
          "none | exp: temporal ensembling of overlapping chunks (ACT)"),
    _Flag("--ensemble-decay", "AFFINITY_ENSEMBLE_DECAY", 0.01,
          "m in ACT's weights w_i = exp(-m*i), oldest prediction first", float,
          low=0, high=1000),
    _Flag("--control-hz", "AFFINITY_CONTROL_HZ", None,
          "the robots' control rate, for real-time chunking's estimates of executed and "
          "inference_delay when a step does not send them (none: steps send them or "
          "control_hz)", float, low=0.001, high=10_000),
    _Flag("--failure-threshold", "AFFINITY_FAILURE_THRESHOLD", 3,
          "consecutive model failures before a device goes down", int, low=1, high=1_000_000),
    _Flag("--cooldown", "AFFINITY_COOLDOWN", 30.0,
          "seconds a down device waits before its probe", float, low=0, high=86_400),
    _Flag("--embedded-port", "AFFINITY_EMBEDDED_PORT", None,
          "with the embedded store: also answer the Redis protocol on this port", int,
          low=1, high=65535),
    _Flag("--admission-wait", "AFFINITY_ADMISSION_WAIT", 0.0,
          "seconds a new episode that finds every device full waits in a first-come backlog "
          "for a slot (within --act-deadline; 0: 503 at once)", float),
    _Flag("--fleet-view-every", "AFFINITY_FLEET_VIEW_EVERY", 10.0,
          "seconds between reads of the fleet's load per model version for the "
          "affinity_fleet_* gauges (one node of the fleet reads the devices each period, "
          "the others its result; 0: off)", float, low=0, high=3600),
    _Flag("--grpc-port", "AFFINITY_GRPC_PORT", None,
          "also serve KServe v2 over gRPC (Triton's GRPCInferenceService) on this port "
          "(none: off)", int, low=1, high=65535),
    _Flag("--api-key", "AFFINITY_API_KEY", None,
          "when set, clients must send Authorization: Api-Key <key> (openpi-client's api_key)"),
    _Flag("--log-level", "AFFINITY_LOG_LEVEL", "info", "debug | info | warning | error"),
    _Flag("--log-format", "AFFINITY_LOG_FORMAT", "plain", "plain | json (every log line)"),
    _Flag("--access-log", "AFFINITY_ACCESS_LOG", "on", "on | off: one line per request"),
)  # fmt: skip
_SWITCHES = (
    ("--tensorrt", "AFFINITY_TENSORRT", "put TensorRT first on GPUs"),
    ("--cuda-graph", "AFFINITY_CUDA_GRAPH", "capture one CUDA graph per device"),
    (
        "--kserve-claim-unknown",
        "AFFINITY_KSERVE_CLAIM_UNKNOWN",
        "KServe: a request for an unknown sequence starts it (Triton refuses it)",
    ),
)


def both(
    first: Callable[[str, float], None], second: Callable[[str, float], None]
) -> Callable[[str, float], None]:
    """A dispatcher hook that calls ``first``, then ``second``."""

    def call(device: str, value: float) -> None:
        first(device, value)
        second(device, value)

    return call


def per_device(histogram: Histogram) -> Callable[[str, float], None]:
    """``observe(device, value)`` on ``histogram``'s child of that device, each child made
    once (``labels()`` takes a lock each call; this runs once per step)."""
    children: dict[str, Any] = {}

    def observe(device: str, value: float) -> None:
        child = children.get(device)
        if child is None:
            child = children.setdefault(device, histogram.labels(device))
        child.observe(value)

    return observe


def _is_on(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes", "on")


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> NodeConfig:
    """The node's configuration from flags and ``AFFINITY_*`` variables (flags win).

    Exits with code 2 and one line naming the flag on a bad value."""
    env = os.environ if env is None else env
    p = _Parser(
        prog="affinity-node",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"affinity-node {VERSION}")
    for f in _FLAGS:
        raw = env.get(f.env)
        default = f.default if raw is None or raw == "" else raw
        p.add_argument(
            f.name,
            **(
                {"action": "append", "default": None}
                if f.name == "--model"
                else {"default": default}
            ),
            help=f"{f.help} ({f.bounds}default: "
            f"{f.default if f.default is not None else 'none'}; env {f.env})",
        )
    for name, var, text in _SWITCHES:
        p.add_argument(name, action="store_true", default=_is_on(env.get(var)),
                       help=f"{text} (default: off; env {var}=1)")  # fmt: skip
    a = p.parse_args(argv)
    values: dict[str, Any] = {}
    for f in _FLAGS:
        key = f.name[2:].replace("-", "_")
        value = getattr(a, key)
        if key == "model":  # repeatable; the environment's is comma-separated
            value = value or (env.get(f.env) or f.default).split(",")
        if isinstance(value, str) and f.kind is not str:
            try:
                value = f.kind(value)
            except ValueError:
                p.error(f"{f.name} {value!r}: must be {f.kind.__name__} (env {f.env})")
        values[key] = value
        if value is None:
            continue
        problem = f.problem(value)
        if problem is not None:
            p.error(f"{f.name} {value}: {problem} (env {f.env})")
    for name, allowed in (
        ("ensemble", ENSEMBLES),
        ("log_format", ("plain", "json")),
        ("access_log", ("on", "off")),
        ("log_level", LOG_LEVELS),
    ):
        values[name] = values[name].lower()
        if values[name] not in allowed:
            flag = _flag(name)
            p.error(f"{flag.name} {values[name]!r}: must be one of {', '.join(allowed)} "
                    f"(env {flag.env})")  # fmt: skip
    wait = values["admission_wait"]
    if not 0 <= wait < values["act_deadline"]:
        p.error(f"--admission-wait {wait}: must be >= 0 and less than --act-deadline "
                "(env AFFINITY_ADMISSION_WAIT)")  # fmt: skip
    if values["redis"]:
        problem = url_problem(values["redis"])
        if problem is not None:
            p.error(f"--redis {values['redis']!r}: {problem} (env AFFINITY_REDIS_URL)")
    node_id = values["node_id"] or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:128]
    try:
        check_node_id(node_id)
    except InvalidArgument as exc:
        p.error(f"--node-id {node_id!r}: {exc.limit} (env AFFINITY_NODE_ID)")
    host = values["host"]
    given = values["advertise_url"]
    if given and (urlsplit(given).scheme not in ("http", "https") or not urlsplit(given).netloc):
        p.error(f"--advertise-url {given!r}: must be a URL such as http://host:8000 "
                "(env AFFINITY_ADVERTISE_URL)")  # fmt: skip
    advertise = given or (
        f"http://{host if host != '0.0.0.0' else socket.gethostname()}:{values['port']}"
    )
    if values["grpc_port"] is not None and values["grpc_port"] == values["port"]:
        p.error(f"--grpc-port {values['grpc_port']}: must differ from --port, where the "
                "node serves HTTP (env AFFINITY_GRPC_PORT)")  # fmt: skip
    given_models = values["model"]
    if values["model_name"] and len(given_models) > 1:
        p.error("--model-name: only with one --model; name each model as NAME=FILE instead")
    models = []
    for text in given_models:
        try:
            models.append(parse_model_arg(text, values["model_name"]))
        except ValueError as exc:  # InvalidArgument included
            p.error(f"--model {text!r}: {getattr(exc, 'limit', exc)} (env AFFINITY_MODEL)")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        p.error(f"--model: the names {', '.join(names)} repeat; name each model as NAME=FILE")
    model = models[0].path
    model_name = models[0].name
    try:
        settings = Settings.from_env(
            env,
            redis_url=values["redis"],
            namespace=values["namespace"],
            episode_ttl_s=values["episode_ttl"],
            lease_ttl_s=values["lease_ttl"],
            redis_replicas=values["redis_replicas"],
            redis_wait_s=values["redis_wait"],
        )
        return NodeConfig(
            node_id=node_id,
            advertise_url=advertise.rstrip("/"),
            settings=settings,
            host=host,
            port=values["port"],
            devices=values["devices"],
            model=model,
            capacity=values["capacity"],
            weight=values["weight"],
            act_deadline_s=values["act_deadline"],
            drain_timeout_s=values["drain_timeout"],
            max_body_bytes=values["max_body_bytes"],
            keep_alive_s=values["keep_alive"],
            admin_token=env.get("AFFINITY_ADMIN_TOKEN") or None,
            api_key=values["api_key"] or None,
            cluster_secret=env.get("AFFINITY_CLUSTER_SECRET") or None,
            providers=ProviderSettings(
                tensorrt=a.tensorrt, trt_cache_root=values["trt_cache"], cuda_graph=a.cuda_graph
            ),
            failure_threshold=values["failure_threshold"],
            max_batch=values["max_batch"],
            batch_delay_us=values["batch_delay"],
            inline_under_us=values["inline_under"],
            execute_steps=values["execute_steps"],
            ensemble=None if values["ensemble"] == "none" else values["ensemble"],
            ensemble_decay=values["ensemble_decay"],
            control_hz=values["control_hz"],
            cooldown_s=values["cooldown"],
            embedded_port=values["embedded_port"],
            log_level=values["log_level"],
            log_format=values["log_format"],
            access_log=values["access_log"] == "on",
            model_name=model_name,
            models=tuple(models),
            kserve_claim_unknown=a.kserve_claim_unknown,
            grpc_port=values["grpc_port"],
            admission_wait_s=values["admission_wait"],
            fleet_view_every_s=values["fleet_view_every"],
        )
    except ValueError as exc:  # InvalidArgument included: it names the setting
        p.error(flag_message(exc))
        raise  # unreachable: p.error exits


def _flag(key: str) -> _Flag:
    """The flag of a configuration key (``lease_ttl`` or ``lease_ttl_s``: ``--lease-ttl``)."""
    name = "--" + key.removesuffix("_s").replace("_", "-")
    return next(f for f in _FLAGS if f.name == name)


def flag_message(exc: ValueError) -> str:
    """``exc``'s message naming the flag or variable a person sets, never a field of the
    code (``invalid execute_steps 5``: ``--execute-steps 5``)."""
    if isinstance(exc, InvalidArgument):
        if any(f.name == "--" + exc.field.removesuffix("_s").replace("_", "-") for f in _FLAGS):
            flag = _flag(exc.field)
            return f"{flag.name} {exc.value!r}: {exc.limit} (env {flag.env})"
        if exc.field in ENV_VARS:
            return f"{ENV_VARS[exc.field]}={exc.value!r}: {exc.limit}"
    return str(exc)


def build_service(
    config: NodeConfig,
    redis: Any | None = None,
    specs: list[DeviceSpec] | None = None,
    session_factory: Callable[[DeviceSpec], tuple[Session, str]] | None = None,
    pool: Poster | None = None,
) -> Callable[[], Awaitable[NodeService]]:
    """The start-up of a node, as a factory for :func:`node.app.create_app`.

    ``redis`` defaults to a client for ``config.settings`` (or the embedded store);
    ``session_factory(spec)`` returns (session, provider really used) and defaults to
    ONNX Runtime with the device's provider plan; ``pool`` carries forwards to owners
    (tests route them in-process). Raises :class:`StartupError` for a
    device list or model the node cannot use.
    """

    async def factory() -> NodeService:
        pin_pci_bus_order(os.environ)
        try:
            devices = specs if specs is not None else discover(config.devices)
        except ValueError as exc:
            # discover()'s messages start with "devices <spec>:", which names the flag
            raise StartupError(f"--{exc}") from None
        require_cuda(devices)  # GpuUnavailable: GPUs named, or found, that CUDA cannot run
        served: dict[str, tuple[ModelSpec, ModelId, PolicyContract]] = {}
        for m in config.served:
            try:
                contract = load_contract(m.path)
            except (ValueError, OSError) as exc:
                raise StartupError(f"--model {m.path}: {exc}") from None
            except Exception as exc:  # ONNX Runtime's own errors: a file it cannot load
                raise StartupError(
                    f"--model {m.path}: not a model ONNX Runtime can load: {_one_line(exc)}"
                ) from None
            try:
                served[m.name] = (m, m.identity(), warmup.with_samples(m.path, contract))
            except (ValueError, OSError) as exc:
                raise StartupError(f"--model {m.name}: warm-up samples: {exc}") from None

        def ort_session(
            m: ModelSpec, contract: PolicyContract, spec: DeviceSpec
        ) -> tuple[Session, str]:
            built = build_session(
                m.path, spec, config.providers, intra_op_threads=config.intra_op_threads
            )
            if not (config.providers.cuda_graph and built.active in CUDA_GRAPH_PROVIDERS):
                return built.session, built.active
            # captured by dispatcher.warm_up(), on the device's worker thread
            return BoundSession(built.session, contract, "cuda", spec.ordinal or 0), built.active

        # one session per model per device, made here: a model that does not fit beside
        # the others stops the node at start-up, naming the model and the device
        sessions: dict[tuple[str, str], Session] = {}
        providers: dict[int, str] = {}
        active: dict[tuple[str, str], str] = {}  # the provider each session runs on
        for i, (name, (m, _, contract)) in enumerate(served.items()):
            for spec in devices:
                try:
                    if session_factory is not None and i == 0:
                        session, provider = session_factory(spec)
                    else:
                        session, provider = ort_session(m, contract, spec)
                except Exception as exc:
                    raise StartupError(
                        f"--model {name}: no session on device {spec.index} ({spec.name}) "
                        f"beside the {i} model(s) before it: {exc}"
                    ) from exc
                sessions[(name, f"{config.node_id}/{spec.index}")] = session
                active[(name, f"{config.node_id}/{spec.index}")] = provider
                providers.setdefault(spec.index, provider)

        def dispatchers(
            ids: list[str],
            on_transition: Callable[[str, str, str], None],
            metrics: Metrics,
            table: EpisodeTable,
            arrivals: Arrivals,
        ) -> dict[str, MultiGpuDispatcher]:
            return {
                name: MultiGpuDispatcher(
                    ids,
                    lambda device, name=name: sessions[(name, device)],  # type: ignore[misc]
                    contract,
                    failure_threshold=config.failure_threshold,
                    cooldown_s=config.cooldown_s,
                    on_transition=on_transition,
                    max_batch=config.max_batch,
                    batch_delay_us=config.batch_delay_us,
                    inline_under_us=config.inline_under_us,
                    inline_devices=[  # CPU sessions only (see MultiGpuDispatcher._inline)
                        d for (n, d), p in active.items() if n == name and p == CPU
                    ],
                    execute_steps=config.execute_steps,
                    ensemble=config.ensemble,
                    ensemble_decay=config.ensemble_decay,
                    control_hz=config.control_hz,
                    on_batch=both(
                        per_device(metrics.batch_size),
                        metrics.model_stats.setdefault(name, ModelStats()).ran,
                    ),
                    on_queue_wait=both(
                        per_device(metrics.queue_wait), metrics.model_stats[name].queued
                    ),
                    table=table,
                    arrivals=arrivals,
                    model=str(mid),
                )
                for name, (_, mid, contract) in served.items()
            }

        client = redis
        if client is None:
            if config.settings.redis_url:
                client = connect(config.settings)
            else:
                log.warning(
                    "no Redis URL given: using the embedded in-process store (single host only)"
                )
                client = embedded_store(config.embedded_port)
        try:
            service = NodeService(
                config,
                client,
                devices,
                providers,
                dispatchers,
                next(iter(served.values()))[2],
                owns_redis=redis is None,
                pool=pool,
                models={name: (mid, contract) for name, (_, mid, contract) in served.items()},
            )
        except ValueError as exc:  # batching or chunk settings this model cannot take
            raise StartupError(flag_message(exc)) from None
        warm = [
            str(mid)
            for name, (m, mid, contract) in served.items()
            if await _warm_up(name, m, contract, service.dispatchers[name])
        ]
        graphs = sum(isinstance(s, BoundSession) for s in sessions.values())
        if warm:
            log.info(
                "%d device(s) warmed up on their workers with %s, %d CUDA graph(s)",
                len(devices), ", ".join(warm), graphs,
            )  # fmt: skip
        return service

    return factory


async def _warm_up(
    name: str, model: ModelSpec, contract: PolicyContract, dispatcher: MultiGpuDispatcher
) -> bool:
    """Warm ``dispatcher``'s devices up with what ``node.warmup`` allows; ``False`` (and one
    info line) when nothing may be fed. Raises :class:`StartupError` naming the model and
    the inputs when a run fails."""
    samples = warmup.samples_path(model.path)
    unfed = warmup.unfed(contract)
    if unfed:
        log.info(
            "model %s is not warmed up: %s %s string input%s with no sample to feed "
            "(give one in %s; docs/policies.md#warm-up)",
            name, ", ".join(unfed), "is a" if len(unfed) == 1 else "are",
            "" if len(unfed) == 1 else "s", samples,
        )  # fmt: skip
        return False
    try:
        await dispatcher.warm_up()
    except Exception as exc:
        zeros = warmup.made_up(contract)
        fed = (
            f"zeros for {', '.join(zeros)} (no sample; give one in {samples})"
            if zeros
            else f"the samples of {samples}"
        )
        raise StartupError(
            f"--model {name}: the warm-up run failed on {fed}: {_one_line(exc)} "
            "(docs/policies.md#warm-up)"
        ) from None
    return True


def _one_line(exc: BaseException) -> str:
    """``exc`` as ``Type: message`` on one line."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class _OneWriteTransport:
    """A connection's transport that sends a response's status line and headers together
    with what follows them: uvicorn writes the head and the body of a reply as two
    ``write`` calls, so two TCP segments, and the client wakes up twice for one reply
    (``tritonclient.http`` in lockstep, steps to a node that writes once and to one that
    writes twice taking turns: p50 0.58 ms vs 1.05 ms). The head is held until the next
    write (the body, in the same send of a plain reply) or the end of the loop iteration
    (a streamed body), whichever comes first; every other call goes to the transport."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head, self._head = self._head, None
        if head is not None:
            self._transport.writelines((head, data))
        elif data.startswith(b"HTTP/"):
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
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


class _KeepAliveProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol, except that:

    - an idle keep-alive connection whose client has already sent its next request is not
      closed: after the process was paused (or the loop was busy) past the keep-alive
      timeout, the timer fires before the queued request is read, and closing would drop
      a request the client cannot know the fate of. Such a request is read and answered
      instead (503 ``fenced`` if the lease lapsed);
    - a reply's head and body leave in one write (:class:`_OneWriteTransport`);
    - every request's scope carries it as :data:`~node.asgi.CONNECTION`: whether the
      client has closed the connection by now (:meth:`peer_closed`: one ``poll(2)``
      instead of two turns of the event loop) and whether other requests are being served
      (:meth:`serving_others`), for ``node.asgi.while_connected``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_OneWriteTransport(transport, self.loop))  # type: ignore[arg-type]
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
        if fd >= 0 and select.select([fd], [], [], 0)[0]:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()


class _Server(uvicorn.Server):
    """uvicorn's server with the node's graceful stop: the first SIGTERM/SIGINT makes the
    node leave the fleet while it still listens (episodes handed over, deregistered, no
    more renewals), then uvicorn closes the listener and drains; a second one forces."""

    def __init__(self, config: uvicorn.Config, service: NodeService, fleet: Fleet) -> None:
        super().__init__(config)
        self.service = service
        self.fleet = fleet
        self.leave_requested = False
        self.leaving: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.leave_requested or self.should_exit:
            self.fleet.close()  # a graceful stop waits for open responses: streams never end
            super().handle_exit(sig, frame)
        else:
            self.leave_requested = True  # picked up by on_tick, on the event loop

    async def on_tick(self, counter: int) -> bool:
        if self.leave_requested and self.leaving is None:
            log.info("node %s leaving the fleet (signal)", self.service.node_id)
            self.leaving = asyncio.create_task(self.service.owner.leave())
        if self.leaving is not None and self.leaving.done():
            self.should_exit = True
        if self.service.lease.conflict is not None:
            self.should_exit = True
        if self.should_exit:
            self.fleet.close()  # a graceful stop waits for open responses: streams never end
        return await super().on_tick(counter)


def bind(host: str, port: int) -> socket.socket:
    """The node's listening socket, bound (not yet listening) before anything registers:
    a node that could not serve must never advertise itself. Raises ``OSError``."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


async def _serve(config: NodeConfig, held: _HeldLines | None = None) -> int:
    ports = {"--host/--port": config.port}
    if config.grpc_port is not None:
        ports["--grpc-port"] = config.grpc_port
    socks: list[socket.socket] = []
    for flag, port in ports.items():
        try:
            socks.append(bind(config.host, port))
        except OSError as exc:
            for sock in socks:
                sock.close()
            print(f"affinity-node: cannot listen on {config.host}:{port} ({flag}): "
                  f"{exc.strerror or exc}", file=sys.stderr)  # fmt: skip
            return EXIT_LISTEN
    with socks[0]:
        return await _serve_on(config, socks[0], socks[1] if len(socks) > 1 else None, held)


async def _register(config: NodeConfig, service: NodeService) -> int | None:
    """Start the service (register, lease); None, or the exit code with its one line said."""
    try:
        await service.start()
    except BackendUnavailable as exc:
        print(
            f"affinity-node: cannot reach Redis at {_safe_url(config)} (--redis): {exc}",
            file=sys.stderr,
        )
        await service.stop()
        return EXIT_REDIS
    except NodeConflict as exc:
        print(f"affinity-node: {exc}", file=sys.stderr)
        await service.stop()
        return EXIT_CONFLICT
    except SecretMismatch as exc:
        print(f"affinity-node: {exc}", file=sys.stderr)
        await service.stop()
        return EXIT_USAGE
    return None


async def _serve_on(
    config: NodeConfig,
    sock: socket.socket,
    grpc_sock: socket.socket | None = None,
    held: _HeldLines | None = None,
) -> int:
    """Start the node on ``sock`` (bound) and serve until it stops; ``grpc_sock`` holds
    ``--grpc-port`` (bound, exclusively) until gRPC's own listener takes it over."""
    try:
        try:
            service = await build_service(config)()
        except StartupError as exc:
            print(f"affinity-node: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except GpuUnavailable as exc:
            print(f"affinity-node: {exc}", file=sys.stderr)
            return EXIT_NO_GPU
        grpc_server = None
        if grpc_sock is not None:  # bound before registering, like the HTTP listener
            from node.protocols.kserve import grpc  # grpcio loads only where gRPC is served

            assert config.grpc_port is not None
            # gRPC binds its own listener (without SO_REUSEPORT: grpc.so_reuseport 0); the
            # port was held exclusively until here, and is handed over now
            grpc_sock.close()
            try:
                grpc_server = await grpc.start(service, config.host, config.grpc_port)
            except RuntimeError as exc:
                print(f"affinity-node: cannot listen on {config.host}:{config.grpc_port} "
                      f"(--grpc-port): {exc}", file=sys.stderr)  # fmt: skip
                await service.stop()
                return EXIT_LISTEN
        if held is not None:
            held.registering()
        code = await _register(config, service)
        if code is not None:
            if grpc_server is not None:
                await grpc_server.stop(0)
            return code
    finally:
        if grpc_sock is not None:
            grpc_sock.close()
    if held is not None:
        held.serving()  # it serves: the lines held since it started are written now

    async def started() -> NodeService:
        return service

    app = create_app(started, access_log=config.access_log, log_json=config.log_format == "json")
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            http=_KeepAliveProtocol,
            ws="websockets-sansio",
            ws_max_size=config.max_body_bytes,
            log_level="warning",
            access_log=False,  # node/accesslog.py writes the node's own, with the step's facts
            proxy_headers=False,
            server_header=False,
            timeout_keep_alive=max(1, round(config.keep_alive_s)),
            timeout_graceful_shutdown=int(config.act_deadline_s) + 5,
            lifespan="on",
        ),
        service,
        app.state.fleet,
    )
    try:
        await server.serve(sockets=[sock])
    finally:
        if grpc_server is not None:
            await grpc_server.stop(1.0)
    return EXIT_CONFLICT if service.lease.conflict is not None else 0


def _safe_url(config: NodeConfig) -> str:
    url = config.settings.redis_url or "the embedded store"
    return re.sub(r"//[^@/]*@", "//***@", url)


class _HeldLines(logging.Handler):
    """The node's log handler while it starts: what it says before it serves is held, and
    written once it serves (:meth:`serving`); a node that cannot start prints its one
    error line and nothing else. While it builds its sessions every line below ERROR is
    held; once it registers (:meth:`registering`), warnings go out at once, so that a wait
    for another process's lease on the node id says so while it waits."""

    def __init__(self, target: logging.Handler) -> None:
        super().__init__()
        self.target = target
        self.below = logging.ERROR  # records below this level are held
        self.held: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < self.below:
            self.held.append(record)
        else:
            self.target.handle(record)

    def registering(self) -> None:
        self.below = logging.WARNING

    def serving(self) -> None:
        """Write the held lines, and every line from now on."""
        self.below = logging.NOTSET
        held, self.held = self.held, []
        for record in held:
            self.target.handle(record)


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if config.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    held = _HeldLines(handler)
    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.INFO),
                        handlers=[held])  # fmt: skip
    import uvloop

    code = uvloop.run(_serve(config, held))
    # a graceful stop on a signal ends the way the signal would (uvicorn re-raises it)
    sys.exit(code)


if __name__ == "__main__":
    main()
