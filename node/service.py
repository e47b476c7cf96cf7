"""One node, composed: its episode table, its models' dispatchers, the lease, the owner,
the router, the devices' health.

Each piece answers one question in its own module:

- ``episodes.py``: what the owner remembers.
- ``lease.py``: is this node alive; fencing.
- ``owner.py``: may I serve, and serve; let go; flush.
- ``router.py``: find the owner, forward once.
- ``health.py``: device crashes and probes.
- ``forward.py``: the connection pool to owners.

The wire protocols are in ``node/protocols/``. This class builds them from the
configuration and starts and stops them in order, and runs the node's maintenance loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from affinity import (
    AffinityError,
    Claims,
    DeviceRegistration,
    Inventory,
    ModelId,
    Registry,
    UnknownModel,
    close,
    connect,
)
from affinity.dataset import Selection
from affinity.models import Models
from affinity.registry import DeviceScore, MoveRequest
from affinity.shadows import Shadows
from node.catalog import Catalog, contract_record
from node.chunks import ChunkMode
from node.config import NodeConfig
from node.contract import PolicyContract
from node.deviceprocs import WARM_HANG_S, DeviceProcs
from node.devices import DeviceSpec
from node.dispatcher import MultiGpuDispatcher, WorkerHooks
from node.episodes import EpisodeTable
from node.errors import AmbiguousModel, refusal
from node.fleet import MAX_STREAMS
from node.flusher import Flusher
from node.forward import ForwardPool, Poster
from node.handover import MOVES_AT_ONCE
from node.health import DeviceHealth
from node.jobs import Arrival, Arrivals
from node.lease import Lease
from node.looplag import watch_loop_lag
from node.metrics import Metrics
from node.owner import Owner
from node.placement import StepTimes
from node.procs import Processes
from node.recorder import Recorder
from node.rollouts import RolloutMemory
from node.router import Router
from node.rtc import Ask
from node.shadow import ShadowRunner, sync_quietly
from node.signals import FleetSignals
from node.step import Reply, Step

__all__ = ["NodeService"]

log = logging.getLogger("affinity.node")
LEASE_CONNECTIONS = 4 + MOVES_AT_ONCE
"""Connections of the lease's own pool: renewals never wait behind client requests, nor
behind the hand-overs that may run at once (each holds one while it asks Redis)."""

DispatcherFactory = Callable[
    [list[str], WorkerHooks, Metrics, EpisodeTable, Arrivals, Recorder | None],
    dict[str, MultiGpuDispatcher],
]
"""(device ids, the workers' hooks, metrics for the batching hooks, the node's episode
table, its arrivals, its recorder) -> model name -> its dispatcher (the first model
first)."""

CandidateFactory = Callable[[list[str], EpisodeTable], dict[str, MultiGpuDispatcher]]
"""(device ids, the ghost table) -> candidate ``"name@version"`` -> its dispatcher
(``--shadow-model``, ``node/shadow.py``)."""


class NodeService:
    """One node: built once at start-up (``node.startup.build_service``), started and stopped
    by the app's lifespan."""

    def __init__(
        self,
        config: NodeConfig,
        redis: Any,
        specs: list[DeviceSpec],
        providers: Mapping[int, str],
        dispatcher_factory: DispatcherFactory,
        contract: PolicyContract,
        clock: Callable[[], float] = time.monotonic,
        owns_redis: bool = False,
        pool: Poster | None = None,
        models: Mapping[str, tuple[ModelId, PolicyContract]] | None = None,
        candidates: CandidateFactory | None = None,
        device_procs: DeviceProcs | None = None,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.redis = redis
        self.owns_redis = owns_redis  # close it at stop (it was made for this node)
        self.table = EpisodeTable(clock)
        self.claims = Claims(redis, config.settings, self._known_lease_ms)
        self.registry = Registry(redis, config.settings, self._known_lease_ms)
        # Pools that nothing a client does can exhaust: the lease's (renewals, registration,
        # hand-overs) and the event streams' (each holds a connection in a blocking read).
        self.lease_redis = self._own_client(LEASE_CONNECTIONS)
        self.stream_redis = self._own_client(MAX_STREAMS)
        self.stream_registry = Registry(self.stream_redis, config.settings)
        self.contract = contract  # the first model's (the node's only one, usually)
        # name -> (name@version, contract) of each model served here, the first one first
        self.models: dict[str, tuple[ModelId, PolicyContract]] = dict(
            models or {config.served[0].name: (config.served[0].identity(), contract)}
        )
        self.catalog = Catalog(self.models, self.registry, clock)
        self.clock = clock
        self.specs = specs
        self.providers = dict(providers)
        self.device_ids = [f"{config.node_id}/{s.index}" for s in specs]
        self.metrics = Metrics(self.device_ids, config.capacity)
        # --device-workers process: each device's sessions in a worker process of its own
        self.device_procs = device_procs
        if device_procs is not None:
            self.metrics.before_read(self._worker_states)
        self.recorder = self._recorder()
        # the workers report crash transitions to the health and their runs' times to
        # scored placement (self._ran: the step times are made from the dispatchers' limits)
        hooks = WorkerHooks(on_transition=self._on_transition, on_run=self._ran)
        self.dispatchers = dispatcher_factory(
            self.device_ids, hooks, self.metrics, self.table, Arrivals(), self.recorder
        )
        if self.recorder is not None:  # (not before: a model the flags refuse stops here)
            self.recorder.start()
        # scored placement's step times, measured here, published at each renewal
        self.step_times = StepTimes(
            max((getattr(d, "max_batch", 1) for d in self.dispatchers.values()), default=1)
        )
        lease_registry = Registry(self.lease_redis, config.settings, self._known_lease_ms)
        self.health = DeviceHealth(self.dispatchers, lease_registry, self.metrics)
        # the owner's batched writes (on the lease's own pool); what the lease lets it keep
        flusher = Flusher(self.node_id, self.table, lease_registry, self.metrics,
                          config.settings, clock)  # fmt: skip
        # the process serving the doors is front 0; with --front-doors N > 1 the fronts are
        # 0..N-1 (their samples read from their hop, node/fronts.py) and this one the core
        self._lag_label = "0" if config.front_doors <= 1 else "core"
        lag = self.metrics.loop_lag
        # this node's processes, published with its lease (the fronts join when they start)
        self.processes = Processes(
            config.front_doors,
            lag.labels(self._lag_label),
            lag.bounds,
            workers=len(specs) if device_procs is not None else 0,
        )
        if device_procs is not None:  # published from the registration on
            self.processes.watch(device_procs)
        self.lease = Lease(
            config,
            lease_registry,
            self.table,
            self.metrics,
            self.registrations,
            clock,
            models={m: contract_record(c) for m, c in self.models.values()},
            on_renewed=self._renewed,  # device states made to agree, rollouts remembered
            scores=self._scores,  # scored placement's, published at each renewal
            listener=flusher,
            on_moves=self._moves_requested,  # the owner's hand-overs, which need the lease
            processes=self.processes.describe,
            # its device worker processes told at once (not at their next 50 ms)
            on_change=device_procs.tell if device_procs is not None else None,
        )
        self.rollouts = RolloutMemory(
            Models(self.lease_redis, config.settings), [mid.name for mid, _ in self.models.values()]
        )
        self.pool: Poster = pool or ForwardPool(config.cluster_secret)
        self.started = False
        self._warned: set[str] = set()
        ghosts = EpisodeTable(clock)  # the ghost episodes' records, apart from the live ones
        self.shadow = ShadowRunner(
            self.node_id,
            self.table,
            ghosts,
            self.dispatchers,
            candidates(self.device_ids, ghosts) if candidates is not None else {},
            Shadows(self.lease_redis, config.settings),
            self.metrics.registry,
            clock=clock,
            recorder=self.recorder,
            url=config.advertise_url,
            pool=self.pool,
            idle_s=config.settings.episode_ttl_s,
        )
        self.owner = Owner(
            config,
            self.table,
            self.dispatchers,
            self.lease,
            self.health,
            self.claims,
            Claims(self.lease_redis, config.settings, self._known_lease_ms),
            flusher,
            self.metrics,
            self.pool,
            clock,
            restart=self._restart_here,
            shadow=self.shadow,
        )
        self.router = Router(
            config,
            self.claims,
            self.dispatchers,
            self.lease,
            self.owner,
            self.health,
            self.metrics,
            self.pool,
            clock,
            catalog=self.catalog,
        )
        self._maintenance: asyncio.Task[None] | None = None
        self._probing: asyncio.Task[None] | None = None  # a round of probes under way
        self._stopping = asyncio.Event()  # stop() began: the maintenance loop ends
        self._loop_lag: asyncio.Task[None] | None = None
        every = config.fleet_view_every_s
        fleet = Inventory(lease_registry.redis, config.settings)  # the lease's own pool
        self.signals = FleetSignals(self.node_id, fleet, self.metrics, every, clock)

    async def _restart_here(self, step: Step, arrival: Arrival) -> Reply:
        """A restart forwarded to the owner: it claims anew through the router."""
        return await self.router.restart_here(step, arrival)

    def _known_lease_ms(self) -> int:
        lease: Lease | None = getattr(self, "lease", None)
        return lease.known_ms() if lease is not None else self.config.settings.lease_ttl_ms

    def _own_client(self, connections: int) -> Any:
        """A client with a pool of its own of ``connections``, when this node made its
        Redis client from a URL; else (a client handed in, the embedded store) that one."""
        if self.owns_redis and self.config.settings.redis_url:
            return connect(self.config.settings.with_(redis_max_connections=connections))
        return self.redis

    @property
    def instance(self) -> str:
        """This process's instance id (tells it from another with the same node id)."""
        return self.lease.instance

    def _on_transition(self, device: str, to: str, reason: str) -> None:
        self.health.on_transition_threadsafe(device, to, reason)
        if to == "down" and self.device_procs is not None:  # a fresh process for its probe
            self.device_procs.recycle_threadsafe(device, reason)

    def _worker_states(self) -> None:
        """The states each device's worker process says it holds, into the gauges (at a
        scrape)."""
        assert self.device_procs is not None
        for device in self.device_procs.workers:
            states, nbytes = self.device_procs.held(device)
            self.metrics.worker_states.labels(device).set(states)
            self.metrics.worker_state_bytes.labels(device).set(nbytes)

    def _device_lost(self, device: str, reason: str) -> None:
        """``device``'s worker process died: down at once for every model (live and
        shadow candidates): its episodes move at their next step. Their states died with
        it (the process held them): their records are dropped, so that none is served
        again from memory once the device is back (each one's next step here says
        ``state_reset``)."""
        for dispatcher in (*self.dispatchers.values(), *self.shadow.candidates.values()):
            dispatcher.lost(device, reason)
        self.shadow.lost(device)
        dropped = self.table.drop_device(device, "lost")
        if dropped:
            self.metrics.owner_dropped.labels("lost").inc(dropped)
            log.warning("device %s: %d episode state(s) went with its worker process; their "
                        "next steps start clean (state_reset)", device, dropped)  # fmt: skip

    async def _device_back(self, device: str) -> None:
        """``device``'s new worker process has opened its sessions: warm each model up on
        it, then the device is up again."""
        for dispatcher in (*self.dispatchers.values(), *self.shadow.candidates.values()):
            await dispatcher.restored(device)
        log.info("device %s is back after its worker process was restarted", device)

    def _device_restarted(self, device: str) -> None:
        self.metrics.device_worker_restarts.labels(device).inc()

    def _ran(self, device: str, run: tuple[int, float]) -> None:
        self.step_times.ran(device, run)

    def _moves_requested(self, moves: Sequence[MoveRequest]) -> None:
        self.owner.handovers.move_requested(moves)

    def registrations(self) -> list[DeviceRegistration]:
        """What this node registers: each device with the state its crash tracker holds."""
        out = []
        for s in self.specs:
            tracker = self.health.tracker(f"{self.node_id}/{s.index}")
            out.append(
                DeviceRegistration(
                    index=s.index,
                    kind=s.kind,
                    name=s.name,
                    uuid=s.uuid,
                    arch=s.arch,
                    memory_mb=s.memory_mb,
                    capacity=self.config.capacity,
                    weight=self.config.weight,
                    provider=self.providers.get(s.index, ""),
                    state="down" if tracker.down else "active",
                    reason=tracker.last_error[:256] if tracker.down else "",
                )
            )
        return out

    def _scores(self) -> list[DeviceScore]:
        """Each device's score for scored placement, published at each renewal: one per
        device with room that its crash tracker has up."""
        up = [
            (s.index, f"{self.node_id}/{s.index}")
            for s in self.specs
            if not self.health.down(f"{self.node_id}/{s.index}")
        ]
        return self.step_times.scores(up, self.table.live, self.config.capacity)

    async def _renewed(self) -> None:
        """After each lease renewal: Redis' device states made to agree, and the rollouts
        of the models served here remembered (put back after Redis lost them)."""
        with contextlib.suppress(AffinityError):
            await self.health.reconcile()
        await self.rollouts.sync()
        if self.recorder is not None:
            await self._read_recordings()
        await sync_quietly(self.shadow)

    def _recorder(self) -> Recorder | None:
        """The recorder of ``--record`` (None: off), handed every model's kept steps; not
        started yet."""
        if not self.config.record:
            return None
        recorded = self.metrics.recorded
        recorder = Recorder(
            self.config.record,
            self.config.node_id,
            on_count=lambda outcome, n: recorded.labels(outcome).inc(n),
        )
        return recorder

    async def _read_recordings(self) -> None:
        """The fleet's recording selections of the models served here (``affinity record``),
        read after each renewal; steps read the recorder's copy, never Redis."""
        assert self.recorder is not None
        names = {mid.name: str(mid) for mid, _ in self.models.values()}
        read = await Models(self.lease_redis, self.config.settings).recordings(list(names))
        chosen = {}
        for name, versions in read.items():
            for version, text in versions.items():
                try:
                    chosen[f"{name}@{version}"] = Selection.from_json(text)
                except ValueError:
                    log.warning("model %s@%s: unreadable recording selection %r",
                                name, version, text)  # fmt: skip
        self.recorder.select(chosen)

    async def start(self) -> None:
        """Register and start the lease; idempotent (``affinity-node`` starts the service
        before uvicorn, so start-up errors exit with one line, then the app's lifespan)."""
        if self.started:
            return
        self.started = True
        if not self.config.cluster_secret and self.config.settings.redis_url:
            log.warning(
                "AFFINITY_CLUSTER_SECRET is unset: forwarded requests between nodes are "
                "not authenticated"
            )
        if not self.config.settings.redis_url:
            # the embedded store is this process's own and new: nobody else can be serving
            # its episodes, so the grace period an empty Redis gets does not apply
            await self.registry.new_fleet()
        self.health.start()
        if self.device_procs is not None:
            self.device_procs.supervise(self._device_lost, self._device_back,
                                        self._device_restarted, self.lease.serves_until_ns,
                                        lambda: self.table.generation)  # fmt: skip
        await self.lease.start()
        self._maintenance = asyncio.create_task(self._maintain(), name="affinity-maintenance")
        self._loop_lag = asyncio.create_task(
            watch_loop_lag(self.metrics.loop_lag.labels(self._lag_label)), name="affinity-loop-lag"
        )
        if self.config.fleet_view_every_s:
            self.signals.start()

    async def _maintain(self) -> None:
        """Once a second: fence a lapsed lease, flush the owner's batch, check the records
        of devices back up after they went down, settle the copies
        of moves left unconfirmed, start a round of probes of the down devices (beside it:
        :meth:`_probe_round`), refresh the gauges."""
        every = min(1.0, self.config.renew_every_s)
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), every)
            if self._stopping.is_set():  # (stop()'s cancellation may have been swallowed)
                return
            try:
                self.lease.fence()
                try:
                    await self.owner.flush()
                    await self.owner.recheck()  # the records of devices back up
                except AffinityError as exc:  # kept for the next flush
                    log.warning("flush of node %s failed: %s", self.node_id, exc)
                await self.owner.mover.settle()  # copies whose move was not confirmed
                if (self._probing is None or self._probing.done()) and not self._stopping.is_set():
                    self._probing = asyncio.create_task(self._probe_round(), name="affinity-probes")
                self.owner.refresh_gauges()
            except Exception:
                log.exception("maintenance of node %s failed", self.node_id)

    async def _probe_round(self) -> None:
        """One round of probes (:meth:`probe`), in a task of its own: a probe waits for its
        device's run, which the upkeep (a fence, a flush) must never wait for, and a new
        round begins only once this one ended, so a slow probe is not asked again behind
        itself. A device's first run after its worker process was recycled (a graph capture,
        an engine loaded: :data:`~node.deviceprocs.WARM_HANG_S`) may take that long; past it
        the round is given up (its run goes on on the device's thread, bounded there)."""
        try:
            async with asyncio.timeout(max(self.config.act_deadline_s, WARM_HANG_S)):
                await self.probe()
        except Exception:  # includes a probe that hangs past its bound
            log.exception("probing the down devices of node %s failed", self.node_id)

    async def probe(self) -> None:
        """Probe the down devices whose cool-down has passed: the live models' and the
        shadow candidates' (``--shadow-model``) alike. Raises what a probe raised."""
        for device in await self.health.probe():
            log.info("device %s passed its probe", device)
        for candidate, device in await self.shadow.probe():
            log.info("device %s passed its probe for shadow candidate %s", device, candidate)

    async def stop(self) -> None:
        """Leave the fleet (hand episodes over, deregister) if not done yet, then release
        the devices and connections."""
        await self.owner.leave()
        await self.signals.stop()
        # the event ends the maintenance loop even when the cancellation lands in a Redis
        # call and is swallowed there (Python 3.11: see Lease.end)
        self._stopping.set()
        for task in (self._maintenance, self._loop_lag):
            await _ended(task)
        await _ended(self._probing)  # (read once the upkeep that starts it has ended)
        self.health.close()
        if self.recorder is not None:
            self.recorder.close()
        self.shadow.close()
        if self.device_procs is not None:  # once the devices' threads have ended
            await self.device_procs.stop()
        self.pool.close()
        if self.owns_redis:
            clients = (self.redis, self.lease_redis, self.stream_redis)
            for client in {id(c): c for c in clients}.values():
                await close(client)

    async def model_for(
        self, name: str | None, version: str | None = None
    ) -> tuple[str, PolicyContract]:
        """The model a step is for and the contract its inputs are checked against:
        ``name`` (None: the fleet's only model) and ``version`` (None: the episode's own
        or the rollout's). Raises :class:`Refused` 422 ``model_required`` when there is no
        name while the fleet serves several; it names them. Raises 404 ``unknown_model``
        when no live node serves it. Raises ``InvalidArgument`` for a malformed name or
        version."""
        try:
            chosen = await self.catalog.choose(name, version)
            return chosen, await self.catalog.contract(chosen, version)
        except (AmbiguousModel, UnknownModel) as exc:
            raise refusal(exc) from None

    def options_for(
        self,
        name: str | None,
        execute_steps: object = None,
        ensemble: object = None,
        executed: object = None,
        delay: object = None,
        control_hz: object = None,
        pending: object = None,
    ) -> tuple[ChunkMode | None, Ask | None]:
        """A step's options for model ``name`` (None: the node's first), as every front door
        takes them: its chunk mode (``MultiGpuDispatcher.mode_for``) and its real-time-
        chunking values (``rtc_for``). Checked here when this node serves the model
        (``InvalidArgument`` names the field); else the mode is None and the values are
        passed on, for the owner to check."""
        local = self.dispatchers.get(name or next(iter(self.models)))
        if local is not None:
            mode = local.mode_for(execute_steps, ensemble)
            return mode, local.rtc_for(executed, delay, control_hz, pending)
        if executed is None and delay is None and control_hz is None and pending is None:
            return None, None
        return None, Ask(executed, delay, control_hz, pending)  # type: ignore[arg-type]

    def serving(self) -> bool:
        """Whether this node serves now: its lease is valid and it is not leaving."""
        return self.lease.may_serve()

    def client_allowed(self, authorization: str | None) -> bool:
        """Whether a client may use the node: always without ``--api-key``, else only with
        ``Authorization: Api-Key <key>`` (compared in constant time)."""
        expected = self.config.api_key
        if not expected:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        return scheme.lower() == "api-key" and hmac.compare_digest(
            key.strip().encode(), expected.encode()
        )

    def reader_allowed(self, authorization: str | None) -> bool:
        """Whether a request may read or change episodes: a client
        (:meth:`client_allowed`) or the admin (``Authorization: Bearer <admin token>``)."""
        if self.client_allowed(authorization):
            return True
        expected = self.config.admin_token
        scheme, _, token = (authorization or "").partition(" ")
        return (
            bool(expected)
            and scheme.lower() == "bearer"
            and hmac.compare_digest(token.strip().encode(), (expected or "").encode())
        )

    def warn_once(self, key: str, message: str, *args: object) -> None:
        """Log a warning the first time ``key`` is seen in this process."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


async def _ended(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (if any) and wait for its end."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
