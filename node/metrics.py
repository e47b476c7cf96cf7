"""Prometheus metrics of one node, with bounded and documented label values.

``LABELS`` is the contract: every label value a series may carry. ``device`` values are
this node's device ids (bounded by its GPUs). ``build`` values are this process's own
(:data:`BUILD`: one value each). ``model`` values are the names and versions the fleet's
nodes registered. They are set by operators, never by a client: a step's model is checked
against the registry before anything is counted. ``served`` values are the
``"name@version"`` the fleet's nodes registered. No episode id is ever a label. The
registry also carries prometheus-client's ``process_*`` series (CPU seconds, resident
memory, open file descriptors, start time; on Linux).
docs/metrics.md lists the same names and values; a test checks both ways.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

import onnxruntime
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from affinity import __version__
from node.stats import ModelStats

__all__ = ["BUILD", "DOORS", "LABELS", "PARTS", "LoopHistogram", "Metrics"]

BUILD = {"version": __version__, "onnxruntime": onnxruntime.__version__}
"""The ``affinity_build_info`` labels: this package's version and ONNX Runtime's."""

ROUTING = (
    "hit",
    "claimed",
    "reassigned",
    "stateless",
    "full",
    "no_nodes",
    "unavailable",
    "failed",
)
PATHS = ("local", "forwarded")
STATES = ("active", "draining", "down")
TRANSITIONS = ("down", "up")
FORWARD = ("ok", "refused", "unreachable")
REJECTED = ("bad_input", "too_large", "malformed", "unauthorized", "forbidden")
DOORS = ("act", "kserve_http", "kserve_grpc", "openpi")
"""The front doors a step may come in by (``Step.door``)."""
FRONTS_ONLY = frozenset(
    {
        "affinity_front_restarts_total",
        "affinity_front_replies_parked",
        "affinity_device_worker_restarts_total",
        "affinity_device_worker_states",
        "affinity_device_worker_state_bytes",
    }
)
"""Families a node drives only with ``--front-doors`` above 1 or ``--device-workers process``
(driven by those processes' tests)."""
PARTS = ("queue", "run", "forward")
"""The parts of a step's time ``affinity_step_part_seconds`` splits out."""
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.0125, 0.02, 0.025, 0.0333, 0.05, 0.1,
                0.2, 0.5, 1, 2.5)  # fmt: skip
"""Step times (seconds), with a bound at the usual control periods (100 Hz to 10 Hz)."""

# metric name -> {label: allowed values}; "device" means this node's device ids.
LABELS: dict[str, dict[str, tuple[str, ...] | str]] = {
    "affinity_routing_total": {"result": ROUTING},
    "affinity_act_seconds": {"path": PATHS},
    "affinity_event_loop_lag_seconds": {"front": "front"},
    "affinity_front_restarts_total": {},
    "affinity_front_replies_parked": {"front": "front"},
    "affinity_device_worker_restarts_total": {"device": "device"},
    "affinity_device_worker_states": {"device": "device"},
    "affinity_device_worker_state_bytes": {"device": "device"},
    "affinity_record_frames_total": {"outcome": ("queued", "dropped", "written")},
    "affinity_live_episodes": {"device": "device"},
    "affinity_worker_queue_depth": {"device": "device"},
    "affinity_device_state": {"device": "device", "state": STATES},
    "affinity_crash_transitions_total": {"device": "device", "to": TRANSITIONS},
    "affinity_degraded_requests_total": {},
    "affinity_model_failures_total": {"device": "device"},
    "affinity_forwarded_total": {"result": FORWARD},
    "affinity_rejected_requests_total": {"reason": REJECTED},
    "affinity_fenced": {},
    "affinity_lease_renewals_total": {"result": ("ok", "reregistered", "failed")},
    "affinity_owner_dropped_total": {"reason": ("idle", "lost", "revoked", "refused")},
    "affinity_batch_size": {"device": "device"},
    "affinity_queue_wait_seconds": {"device": "device"},
    "affinity_device_capacity": {"device": "device"},
    "affinity_admission_waiting": {},
    "affinity_placement_slo_total": {},
    "affinity_moves_total": {
        "reason": ("drain", "stop", "move"),
        "outcome": ("moved", "reset", "kept"),
    },
    "affinity_move_seconds": {},
    "affinity_move_bytes": {},
    "affinity_build_info": {"version": "build", "onnxruntime": "build"},
    "affinity_log_lines_dropped_total": {},
    "affinity_model_claims_total": {
        "model": "model",
        "version": "model",
        "result": ("claimed", "reassigned"),
    },
    "affinity_step_seconds": {"model": "served", "door": DOORS},
    "affinity_step_part_seconds": {"model": "served", "part": PARTS},
    "affinity_deadline_miss_total": {"model": "served", "door": DOORS},
    "affinity_control_period_seconds": {"model": "served"},
    "affinity_fleet_saturation": {"model": "served"},
    "affinity_fleet_live_episodes": {"model": "served"},
    "affinity_fleet_capacity": {"model": "served"},
}


class LoopBuckets:
    """One labelled child of a :class:`LoopHistogram`: plain counts, no lock."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()  # exported as ``_created``, as prometheus-client does

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value


class LoopHistogram:
    """A histogram whose each child is observed by one thread at a time: the event loop's
    (each step, at the node it came in by), or a device's run, which holds the device. A
    child's buckets are plain integers. So an observation costs a bisection and two
    additions (prometheus-client's ``Histogram`` takes two locks, ~1 µs). Two writers of
    one child at once could lose a count. A scrape from another thread may read a child
    between its count and its sum: never a lost count. Exported like any histogram, its
    family declared before any child exists."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], LoopBuckets] = {}
        registry.register(self)

    def attach(self, values: tuple[str, ...], child: object) -> None:
        """Export ``child`` (a :class:`LoopBuckets`, or what reads another process' counts:
        ``counts``, ``sum`` and ``created``) as the child of ``values``."""
        self._children[values] = child  # type: ignore[assignment]

    def labels(self, *values: str) -> LoopBuckets:
        child = self._children.get(values)
        if child is None:
            child = self._children.setdefault(values, LoopBuckets(self.bounds))
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for values, child in list(self._children.items()):
            total, buckets = 0, []
            for le, count in zip(les, list(child.counts), strict=True):
                total += count
                buckets.append((le, float(total)))
            family.add_metric(list(values), buckets, child.sum)
            labels = dict(zip(self.labelnames, values, strict=True))
            family.samples.append(Sample(self.name + "_created", labels, child.created))
        yield family


class _BeforeRead:
    """The registry's first collector: it runs its hooks before any series is read."""

    def __init__(self) -> None:
        self.hooks: list[Callable[[], None]] = []

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        for hook in self.hooks:
            hook()
        return []


class Metrics:
    """The node's series, on a registry of its own (several apps may share a process)."""

    def __init__(self, devices: list[str], capacity: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._before_read = _BeforeRead()
        self.registry.register(self._before_read)  # first: read before every series
        self.model_stats: dict[str, ModelStats] = {}
        """Model name -> Triton's statistics of that model on this node (``node/stats.py``)."""
        r = self.registry
        self.routing = Counter(
            "affinity_routing_total",
            "Steps by outcome: served (hit, claimed, reassigned, stateless), refused for "
            "capacity (full, no_nodes), any other 503 (unavailable), or a model failure.",
            ["result"],
            registry=r,
        )
        self.act_seconds = LoopHistogram(  # observed on the event loop at every step
            "affinity_act_seconds",
            "Latency of served /act requests (seconds), by path.",
            ["path"],
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            r,
        )
        self.loop_lag = LoopHistogram(  # observed on the event loop (node/looplag.py)
            "affinity_event_loop_lag_seconds",
            "How late the event loop of the process serving the doors ran a timer that was "
            "due (seconds, sampled 50 times a second): its saturation, by front.",
            ["front"],
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            r,
        )
        self.front_restarts = Counter(
            "affinity_front_restarts_total",
            "Front door processes (--front-doors) restarted after they died.",
            registry=r,
        )
        self.replies_parked = Gauge(
            "affinity_front_replies_parked",
            "Replies a front door process is handing to clients that read slowly, moved off "
            "its hop slots to tickets (--front-doors above 1); read at each scrape.",
            ["front"],
            registry=r,
        )
        self.device_worker_restarts = Counter(
            "affinity_device_worker_restarts_total",
            "Device worker processes (--device-workers process) restarted after they died.",
            ["device"],
            registry=r,
        )
        self.worker_states = Gauge(
            "affinity_device_worker_states",
            "Episode states held by the device's worker process (--device-workers process), "
            "every model's, as it says; read at each scrape.",
            ["device"],
            registry=r,
        )
        self.worker_state_bytes = Gauge(
            "affinity_device_worker_state_bytes",
            "Bytes of the episode states held by the device's worker process (host or GPU "
            "memory), as it says; read at each scrape.",
            ["device"],
            registry=r,
        )
        self.live = Gauge(
            "affinity_live_episodes",
            "Episodes with state on this device.",
            ["device"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "affinity_worker_queue_depth",
            "Jobs waiting for this device's worker, every model's, the run in progress not "
            "counted; read at each scrape and each upkeep.",
            ["device"],
            registry=r,
        )
        self.device_state = Gauge(
            "affinity_device_state",
            "1 for the device's current state, else 0.",
            ["device", "state"],
            registry=r,
        )
        self.transitions = Counter(
            "affinity_crash_transitions_total",
            "Crash-tracker transitions, by target state.",
            ["device", "to"],
            registry=r,
        )
        self.degraded = Counter(
            "affinity_degraded_requests_total",
            "Requests routed by session_id because episode_id was missing.",
            registry=r,
        )
        self.model_failures = Counter(
            "affinity_model_failures_total",
            "Model runs that raised, by device.",
            ["device"],
            registry=r,
        )
        self.forwarded = Counter(
            "affinity_forwarded_total",
            "/act requests forwarded to the owning node, by result.",
            ["result"],
            registry=r,
        )
        self.rejected = Counter(
            "affinity_rejected_requests_total",
            "Requests refused with a 4xx, by reason.",
            ["reason"],
            registry=r,
        )
        self.fenced = Gauge(
            "affinity_fenced",
            "1 while this node has fenced itself (lease not renewed).",
            registry=r,
        )
        self.renewals = Counter(
            "affinity_lease_renewals_total",
            "Lease renewal attempts, by result.",
            ["result"],
            registry=r,
        )
        self.recorded = Counter(
            "affinity_record_frames_total",
            "Steps of recorded episodes (--record): queued for the writer, dropped (the "
            "writer was behind, or a part could not be written), written to a segment.",
            ["outcome"],
            registry=r,
        )
        self.owner_dropped = Counter(
            "affinity_owner_dropped_total",
            "Episodes the owner stopped serving from memory, by why: idle (its idle "
            "timeout), lost (Redis holds another claim or none: a failover, a restart, an "
            "operator), revoked (an operator released it in Redis).",
            ["reason"],
            registry=r,
        )
        for reason in LABELS["affinity_owner_dropped_total"]["reason"]:
            self.owner_dropped.labels(reason)  # at 0 from the start: increase() sees the first
        self.moves = Counter(
            "affinity_moves_total",
            "Live hand-overs this node made as the old owner, by why (drain: an operator's "
            "drain --move; stop: a graceful stop; move: affinity move) and what came of it "
            "(moved: with its state; reset: nothing could take it, or the transfer failed "
            "before its commit, so handed over without its state; kept: not moved).",
            ["reason", "outcome"],
            registry=r,
        )
        self.move_seconds = Histogram(
            "affinity_move_seconds",
            "How long a live hand-over took at the old owner, from the moment its steps "
            "started to wait to the commit.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.move_bytes = Histogram(
            "affinity_move_bytes",
            "The tensor bytes of each record a live hand-over moved (state, buffer, reply, "
            "the last chunk sent, a held step's inputs).",
            buckets=(256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20),
            registry=r,
        )
        # observed at every model run by the run's thread, which holds the device (a
        # device's child has one writer at a time): the lock-free kind too
        self.batch_size = LoopHistogram(
            "affinity_batch_size",
            "Steps per model run (1: unbatched), by device.",
            ["device"],
            (1, 2, 3, 4, 5, 6, 7, 8),
            r,
        )
        self.queue_wait = LoopHistogram(
            "affinity_queue_wait_seconds",
            "Time a step waited on its device before its model run began (seconds).",
            ["device"],
            (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            r,
        )
        self.capacity = Gauge(
            "affinity_device_capacity",
            "Live episodes the device may hold (--capacity), as registered.",
            ["device"],
            registry=r,
        )
        self.admission_waiting = Gauge(
            "affinity_admission_waiting",
            "New episodes waiting in this node's admission backlog (--admission-wait).",
            registry=r,
        )
        self.build_info = Gauge(
            "affinity_build_info",
            "1, labelled with this node's version and ONNX Runtime's.",
            list(BUILD),
            registry=r,
        )
        self.build_info.labels(**BUILD).set(1)
        ProcessCollector(registry=r)
        self.log_dropped = Counter(
            "affinity_log_lines_dropped_total",
            "Access-log lines dropped because the log stream could not take them "
            "(e.g. a broken pipe to a log shipper that died).",
            registry=r,
        )
        self.placement_slo = Counter(
            "affinity_placement_slo_total",
            "New episodes refused with slo: every device that could take them predicted a "
            "step time above their control period x --placement-headroom.",
            registry=r,
        )
        self.model_claims = Counter(
            "affinity_model_claims_total",
            "New assignments this node obtained (claimed, reassigned), by the model name and "
            "version they took (the rollout's choice).",
            ["model", "version", "result"],
            registry=r,
        )
        # observed on the event loop at every step: the lock-free kind
        self.step_seconds = LoopHistogram(
            "affinity_step_seconds",
            "Time of a served step at the node it came in by, from its request to its reply "
            "(seconds), by the model version that served it and the front door.",
            ["model", "door"],
            STEP_BUCKETS,
            r,
        )
        self.step_parts = LoopHistogram(
            "affinity_step_part_seconds",
            "The parts of a served step's time (seconds), counted where it came in: its wait "
            "on its device (queue), its model run (run), what forwarding it to its owner "
            "added (forward).",
            ["model", "part"],
            STEP_BUCKETS,
            r,
        )
        self.deadline_misses = Counter(
            "affinity_deadline_miss_total",
            "Served steps whose time at the node they came in by exceeded their control "
            "period (the step's control_hz, else --control-hz).",
            ["model", "door"],
            registry=r,
        )
        self.control_period = Gauge(
            "affinity_control_period_seconds",
            "The control period of the latest step of the model that had one (seconds).",
            ["model"],
            registry=r,
        )
        self.fleet_saturation = Gauge(
            "affinity_fleet_saturation",
            "The fleet's live episodes over its capacity on the devices that may take a new "
            "episode of the model version (1: none may); the same value on every node.",
            ["model"],
            registry=r,
        )
        self.fleet_live = Gauge(
            "affinity_fleet_live_episodes",
            "The fleet's live episodes on the devices that may take a new episode of the "
            "model version; the same value on every node.",
            ["model"],
            registry=r,
        )
        self.fleet_capacity = Gauge(
            "affinity_fleet_capacity",
            "The fleet's capacity (episodes) on the devices that may take a new episode of "
            "the model version; the same value on every node.",
            ["model"],
            registry=r,
        )
        for device in devices:
            self.live.labels(device).set(0)
            self.queue_depth.labels(device).set(0)
            self.capacity.labels(device).set(capacity)
            self.set_state(device, "active")

    def before_read(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` before every read of the registry (a scrape), on the reader's
        thread, before any series is read: to count what was noted but not yet counted."""
        self._before_read.hooks.append(hook)

    def set_state(self, device: str, state: str) -> None:
        for s in STATES:
            self.device_state.labels(device, s).set(1 if s == state else 0)
