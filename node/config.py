"""The node's settings: one frozen object built once by ``affinity-node`` (flags + env)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from affinity import Settings
from node.catalog import ModelSpec
from node.models import DEMO_MODEL
from node.providers import ProviderSettings

__all__ = ["NodeConfig"]


@dataclass(frozen=True)
class NodeConfig:
    """Everything one ``affinity-node`` process needs.

    Times are seconds. ``act_deadline_s`` bounds every step end to end: Redis, the model
    and any forward. ``max_body_bytes`` bounds a request body or websocket message.
    ``max_rows`` bounds the rows (episodes' steps) of one message.
    ``keep_alive_s`` is how long an idle client connection stays open. ``admin_token``
    enables the admin endpoints; they are refused while it is unset. ``cluster_secret``
    authenticates forwarded requests between nodes. ``api_key``, when set, is required
    from clients (``Authorization: Api-Key <key>``, as ``openpi-client`` sends it).
    ``model_name`` is the name KServe v2 clients use (empty: the model file's stem).
    ``models`` are the models the node serves (empty: ``model`` under ``model_name``). The
    first one is ``model``.
    ``kserve_claim_unknown`` starts an unknown KServe sequence on any request instead of
    refusing one without ``sequence_start`` (Triton's rule). ``grpc_port`` serves KServe
    v2 over gRPC on ``host`` (None: off). ``admission_wait_s`` > 0 holds a new episode that
    finds every device full in a backlog that long at most (``node/admission.py``; 0: 503 at
    once). ``control_hz`` is the robots' control rate for real-time chunking's estimates
    (``node/rtc.py``). None: steps must send what the estimates would give. It is also the
    period of a step that names none (``node/timing.py``). ``fleet_view_every_s`` is how often the
    node reads the fleet's view for its ``affinity_fleet_*`` gauges (``node/signals.py``;
    0: never). ``shadow_models`` are candidate versions this node can run as ghost
    episodes beside its live ones (``--shadow-model``; ``node/shadow.py``): loaded on every
    device, never registered, never claimed.
    """

    node_id: str
    advertise_url: str
    settings: Settings = field(default_factory=Settings)
    host: str = "127.0.0.1"
    port: int = 8000
    devices: str = "auto"
    model: Path = DEMO_MODEL
    capacity: int = 64
    weight: int = 1
    act_deadline_s: float = 5.0
    drain_timeout_s: float = 20.0
    max_body_bytes: int = 1 << 24
    max_rows: int = 256
    keep_alive_s: float = 5.0
    admin_token: str | None = None
    api_key: str | None = None
    cluster_secret: str | None = None
    providers: ProviderSettings = field(default_factory=ProviderSettings)
    failure_threshold: int = 3
    max_batch: int | None = None
    batch_delay_us: float = 500.0
    inline_under_us: float = 500.0
    execute_steps: int | None = None
    ensemble: str | None = None
    ensemble_decay: float = 0.01
    control_hz: float | None = None
    placement: str = "round-robin"  # scored | round-robin: how a new episode's device is chosen
    placement_headroom: float = 0.8  # scored: the share of the control period a step may take
    cooldown_s: float = 30.0
    intra_op_threads: int = 1
    embedded_port: int | None = None
    log_level: str = "info"
    log_format: str = "plain"
    access_log: bool = True
    model_name: str = ""
    kserve_claim_unknown: bool = False
    grpc_port: int | None = None
    admission_wait_s: float = 0.0
    models: tuple[ModelSpec, ...] = ()
    fleet_view_every_s: float = 10.0
    record: str | None = None  # --record: where the recorder writes (node/recorder.py)
    shadow_models: tuple[ModelSpec, ...] = ()
    front_doors: int = 1  # --front-doors: HTTP front processes (node/fronts.py); 1: none
    front_hang_s: float = 30.0  # --front-hang-timeout: a front whose loop stopped is killed
    device_workers: str = "thread"  # --device-workers: "process": node/deviceprocs.py

    @property
    def served(self) -> tuple[ModelSpec, ...]:
        """The models this node serves, the first one first (``--model`` in order)."""
        return self.models or (ModelSpec(self.model, self.model_name or self.model.stem),)

    @property
    def renew_every_s(self) -> float:
        return self.settings.lease_ttl_s / 3
