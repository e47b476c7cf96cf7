"""A node's start-up: devices, one session per (model, device), dispatchers, Redis, warm-up.

A configuration the node cannot serve fails here, before it registers: ``StartupError``
names the flag, ``GpuUnavailable`` the missing CUDA library. Sessions are made here, not
lazily: a model that does not fit beside the others stops the node, never a step.
Hazard: CUDA graphs are captured by the warm-up on each device's worker thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from affinity import ModelId, connect, embedded_store
from node import warmup
from node.binding import BoundSession
from node.catalog import ModelSpec
from node.cli import flag_message
from node.config import NodeConfig
from node.contract import PolicyContract, load_contract
from node.deviceprocs import DeviceModel, DeviceProcs, RemoteSession
from node.devices import DeviceSpec, discover, pin_pci_bus_order
from node.dispatcher import (
    Arrivals,
    BatchSettings,
    ChunkSettings,
    CrashSettings,
    MultiGpuDispatcher,
    Session,
    WorkerHooks,
)
from node.episodes import EpisodeTable
from node.forward import Poster
from node.metrics import LoopHistogram, Metrics
from node.providers import CPU, build_session, require_cuda
from node.recorder import Recorder
from node.service import CandidateFactory, DispatcherFactory, NodeService
from node.stats import ModelStats
from node.worker import MAX_DEFAULT_BATCH

__all__ = ["StartupError", "build_service"]

log = logging.getLogger("affinity.node")
CUDA_GRAPH_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")

Served = dict[str, tuple[ModelSpec, ModelId, PolicyContract]]
"""Each model the node serves, by name: as given, its identity, its contract."""
Key = tuple[str, str]
"""(model name, device id)."""


class StartupError(Exception):
    """A configuration the node cannot start with; the message names the flag and the fix."""


def build_service(
    config: NodeConfig,
    redis: Any | None = None,
    specs: list[DeviceSpec] | None = None,
    session_factory: Callable[[DeviceSpec], tuple[Session, str]] | None = None,
    pool: Poster | None = None,
) -> Callable[[], Awaitable[NodeService]]:
    """The start-up of a node, as a factory for :func:`node.app.create_app`.

    ``redis`` defaults to a client for ``config.settings`` (or the embedded store).
    ``session_factory(spec)`` returns (session, provider really used). It defaults to
    ONNX Runtime with the device's provider plan. ``pool`` carries forwards to owners
    (tests route them in-process). Raises :class:`StartupError` for a device list or model
    the node cannot use.
    """

    async def factory() -> NodeService:
        pin_pci_bus_order(os.environ)
        devices = _devices(config, specs)
        served = _served(config)
        procs = await _device_procs(config, served, devices, session_factory)
        try:
            return await _build(procs, devices, served)
        except BaseException:
            if procs is not None:
                await procs.stop()
            raise

    async def _build(
        procs: DeviceProcs | None, devices: list[DeviceSpec], served: Served
    ) -> NodeService:
        if procs is None:
            sessions, active, providers = _sessions(config, served, devices, session_factory)
        else:
            sessions, active = dict(procs.sessions), dict(procs.active)
            providers = {}
            for spec in devices:
                providers.setdefault(spec.index, active[(config.served[0].name,
                                                         procs.device_id(spec))])  # fmt: skip
        client = redis if redis is not None else _redis_client(config)
        candidates = _candidates(config, devices, procs)
        try:
            service = NodeService(
                config,
                client,
                devices,
                providers,
                _dispatchers(config, served, sessions, active, remote=procs is not None),
                next(iter(served.values()))[2],
                owns_redis=redis is None,
                pool=pool,
                models={name: (mid, contract) for name, (_, mid, contract) in served.items()},
                candidates=candidates,
                device_procs=procs,
            )
        except ValueError as exc:  # batching or chunk settings this model cannot take
            raise StartupError(flag_message(exc)) from None
        warm = [
            str(mid)
            for name, (m, mid, contract) in served.items()
            if await _warm_up(name, m, contract, service.dispatchers[name])
        ]
        graphs = sum(
            isinstance(s, BoundSession) or (isinstance(s, RemoteSession) and bool(s.batch_sizes))
            for s in sessions.values()
        )
        if warm:
            log.info(
                "%d device(s) warmed up on their workers with %s, %d CUDA graph(s)",
                len(devices), ", ".join(warm), graphs,
            )  # fmt: skip
        return service

    return factory


async def _device_procs(
    config: NodeConfig,
    served: Served,
    devices: list[DeviceSpec],
    session_factory: Callable[[DeviceSpec], tuple[Session, str]] | None,
) -> DeviceProcs | None:
    """With ``--device-workers process``: a worker process per device, started, each with
    every model's session open (the live models', then the shadow candidates'). None with
    ``thread``. Raises :class:`StartupError` naming the device and the model that failed."""
    if config.device_workers != "process":
        return None
    if session_factory is not None:
        raise StartupError(
            "--device-workers process: the worker processes open their own sessions "
            "(no session factory)"
        )
    batch = config.max_batch or MAX_DEFAULT_BATCH

    def state(contract: PolicyContract) -> tuple[str, ...]:  # its state outputs: held there
        return tuple(contract.state.values())

    models = [
        DeviceModel(name, str(m.path), config.intra_op_threads, True, batch, state(contract))
        for name, (m, _, contract) in served.items()
    ] + [
        DeviceModel(str(m.identity()), str(m.path), 1, False, batch,
                    state(load_contract(m.path)), live=False)
        for m in config.shadow_models
    ]  # fmt: skip
    procs = DeviceProcs(
        config.node_id, devices, models, config.providers,
        max_body_bytes=config.max_body_bytes, hang_s=config.act_deadline_s,
        log_level=config.log_level,
        log_format=config.log_format,
    )  # fmt: skip
    try:
        await procs.start()
    except RuntimeError as exc:
        raise StartupError(f"--device-workers process: {exc}") from None
    return procs


def _devices(config: NodeConfig, specs: list[DeviceSpec] | None) -> list[DeviceSpec]:
    """``specs``, or the devices ``--devices`` names; raises ``GpuUnavailable`` for GPUs
    that CUDA cannot run."""
    try:
        devices = specs if specs is not None else discover(config.devices)
    except ValueError as exc:
        # discover()'s messages start with "devices <spec>:", which names the flag
        raise StartupError(f"--{exc}") from None
    require_cuda(devices)  # GpuUnavailable: GPUs named, or found, that CUDA cannot run
    return devices


def _served(config: NodeConfig) -> Served:
    """Each model of ``--model`` loaded: its contract, with its warm-up samples."""
    served: Served = {}
    for m in config.served:
        try:
            contract = load_contract(m.path)
        except (ValueError, OSError) as exc:  # its message names the file at fault already
            said = str(exc).removeprefix(f"{m.path}: ")
            raise StartupError(f"--model {m.path}: {said}") from None
        except Exception as exc:  # ONNX Runtime's own errors: a file it cannot load
            raise StartupError(
                f"--model {m.path}: not a model ONNX Runtime can load: {_one_line(exc)}"
            ) from None
        try:
            served[m.name] = (m, m.identity(), warmup.with_samples(m.path, contract))
        except (ValueError, OSError) as exc:
            raise StartupError(f"--model {m.name}: warm-up samples: {exc}") from None
    return served


def _sessions(
    config: NodeConfig,
    served: Served,
    devices: list[DeviceSpec],
    session_factory: Callable[[DeviceSpec], tuple[Session, str]] | None,
) -> tuple[dict[Key, Session], dict[Key, str], dict[int, str]]:
    """One session per model per device (``session_factory`` makes the first model's),
    the provider each runs on, and each device's provider (its first model's)."""

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

    # made here: a model that does not fit beside the others stops the node at start-up,
    # naming the model and the device
    sessions: dict[Key, Session] = {}
    active: dict[Key, str] = {}
    providers: dict[int, str] = {}
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
    return sessions, active, providers


def _dispatchers(
    config: NodeConfig,
    served: Served,
    sessions: Mapping[Key, Session],
    active: dict[Key, str],
    *,
    remote: bool = False,
) -> DispatcherFactory:
    """What :class:`NodeService` calls to make one dispatcher per model, on ``sessions``.
    ``remote``: the sessions are worker processes' (``node/deviceprocs.py``)."""
    crashes, batching, chunks = _step_settings(config)

    def dispatchers(
        ids: list[str],
        hooks: WorkerHooks,
        metrics: Metrics,
        table: EpisodeTable,
        arrivals: Arrivals,
        recorder: Recorder | None,
    ) -> dict[str, MultiGpuDispatcher]:
        return {
            name: MultiGpuDispatcher(
                ids,
                lambda device, name=name: sessions[(name, device)],  # type: ignore[misc]
                contract,
                crashes=crashes,
                batching=replace(
                    batching,
                    inline_under_us=config.inline_under_us,
                    inline_devices=frozenset(  # CPU sessions only (see DeviceWorker.run_inline),
                        # any device's in a worker process (run from the loop, not waited on)
                        d
                        for (n, d), p in active.items()
                        if n == name and (p == CPU or remote)
                    ),
                ),
                chunks=chunks,
                hooks=replace(
                    hooks,
                    on_batch=both(
                        per_device(metrics.batch_size),
                        metrics.model_stats.setdefault(name, ModelStats()).ran,
                    ),
                    on_queue_wait=both(
                        per_device(metrics.queue_wait), metrics.model_stats[name].queued
                    ),
                ),
                recorder=recorder,
                table=table,
                arrivals=arrivals,
                model=str(mid),
            )
            for name, (_, mid, contract) in served.items()
        }

    return dispatchers


def _step_settings(config: NodeConfig) -> tuple[CrashSettings, BatchSettings, ChunkSettings]:
    """What every dispatcher takes from the flags alike, live or candidate: crash tracking,
    batching (never inline: the live models add theirs), action chunks and the control
    rate."""
    return (
        CrashSettings(config.failure_threshold, config.cooldown_s),
        BatchSettings(config.max_batch, config.batch_delay_us),
        ChunkSettings(
            config.execute_steps, config.ensemble, config.ensemble_decay, config.control_hz
        ),
    )


def _candidates(
    config: NodeConfig, devices: list[DeviceSpec], procs: DeviceProcs | None
) -> CandidateFactory | None:
    """The dispatchers of ``--shadow-model``: one ONNX Runtime session per device each, on
    one intra-op thread (a ghost's run never takes the live runs' cores), on the ghost
    table, never run inline on the event loop (``node/shadow.py``). With ``procs``, the
    sessions are its worker processes'."""
    if not config.shadow_models:
        return None
    sessions: dict[Key, Session] = {}
    contracts: dict[str, PolicyContract] = {}
    for m in config.shadow_models:
        mid = str(m.identity())
        try:
            contracts[mid] = load_contract(m.path)
            for spec in devices:
                device = f"{config.node_id}/{spec.index}"
                if procs is not None:
                    sessions[(mid, device)] = procs.sessions[(mid, device)]
                    continue
                built = build_session(m.path, spec, config.providers, intra_op_threads=1)
                sessions[(mid, device)] = built.session
        except Exception as exc:
            raise StartupError(f"--shadow-model {m.path}: {_one_line(exc)}") from None

    crashes, batching, chunks = _step_settings(config)

    def candidates(ids: list[str], table: EpisodeTable) -> dict[str, MultiGpuDispatcher]:
        return {
            mid: MultiGpuDispatcher(
                ids,
                lambda device, mid=mid: sessions[(mid, device)],  # type: ignore[misc]
                contract,
                crashes=crashes,
                batching=batching,
                chunks=chunks,
                table=table,
                model=mid,
            )
            for mid, contract in contracts.items()
        }

    return candidates


def _redis_client(config: NodeConfig) -> Any:
    """A client for ``--redis``, or the embedded store when none is given."""
    if config.settings.redis_url:
        return connect(config.settings)
    log.warning("no Redis URL given: using the embedded in-process store (single host only)")
    return embedded_store(config.embedded_port)


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
        control = warmup.control_values(contract)
        if control:  # the node's own values: the input at fault may be one of them
            fed += f" and the node's control inputs {', '.join(control)}"
        raise StartupError(
            f"--model {name}: the warm-up run failed on {fed}: {_one_line(exc)} "
            "(docs/policies.md#warm-up)"
        ) from None
    return True


def _one_line(exc: BaseException) -> str:
    """``exc`` as ``Type: message`` on one line."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def both(
    first: Callable[[str, float], None], second: Callable[[str, float], None]
) -> Callable[[str, float], None]:
    """A dispatcher hook that calls ``first``, then ``second``."""

    def call(device: str, value: float) -> None:
        first(device, value)
        second(device, value)

    return call


def per_device(histogram: LoopHistogram) -> Callable[[str, float], None]:
    """``observe(device, value)`` on ``histogram``'s child of that device, each child made
    once (this runs once per step)."""
    children: dict[str, Any] = {}

    def observe(device: str, value: float) -> None:
        child = children.get(device)
        if child is None:
            child = children.setdefault(device, histogram.labels(device))
        child.observe(value)

    return observe
