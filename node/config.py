"""The node's settings: one frozen object built once by ``affinity-node`` (flags + env)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from affinity import Settings
from node.policy import DEMO_MODEL
from node.providers import ProviderSettings

__all__ = ["NodeConfig"]


@dataclass(frozen=True)
class NodeConfig:
    """Everything one ``affinity-node`` process needs.

    Times are seconds. ``act_deadline_s`` bounds every ``/act`` end to end (Redis, the
    model and any forward); ``max_body_bytes`` bounds a request body. ``admin_token``
    enables the admin endpoints (they are refused while it is unset); ``cluster_secret``
    authenticates forwarded requests between nodes.
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
    max_body_bytes: int = 1 << 20
    admin_token: str | None = None
    cluster_secret: str | None = None
    providers: ProviderSettings = field(default_factory=ProviderSettings)
    failure_threshold: int = 3
    cooldown_s: float = 30.0
    intra_op_threads: int = 1
    embedded_port: int | None = None

    @property
    def renew_every_s(self) -> float:
        return self.settings.lease_ttl_s / 3
