"""affinity: episode-sticky GPU placement backed by Redis.

``Claims`` decides where an episode lives (one atomic Lua round trip). ``Registry``
keeps nodes, devices and their states. ``Inventory`` lists them for operators.
``EventStream`` reads the event log. ``Models`` keeps rollout weights and contracts.
``Keys`` names every Redis key.
"""

from affinity.claims import (
    Assignment,
    Claims,
    EpisodeInfo,
    Released,
    ResolveRequest,
    check_episode,
)
from affinity.client import (
    AsyncClient,
    Client,
    ClientError,
    RequestRefused,
    ServiceUnavailable,
    StateReset,
    Step,
    StepReply,
)
from affinity.config import Settings
from affinity.connection import close, connect, embedded_store
from affinity.errors import (
    AffinityError,
    BackendUnavailable,
    InvalidArgument,
    ModelConflict,
    NoCapacity,
    NodeConflict,
    NotReplicated,
    PoolExhausted,
    Recovering,
    StaleToken,
    UnknownDevice,
    UnknownEpisode,
    UnknownField,
    UnknownModel,
    UnknownNode,
)
from affinity.events import EventStream
from affinity.inventory import DeviceStatus, Inventory, ModelStatus, NodeStatus
from affinity.keys import Keys
from affinity.models import ModelId, Models
from affinity.registry import DeviceRegistration, Registry

__version__ = "0.2.0"

__all__ = [
    "AffinityError",
    "Assignment",
    "AsyncClient",
    "BackendUnavailable",
    "Claims",
    "Client",
    "ClientError",
    "DeviceRegistration",
    "DeviceStatus",
    "EpisodeInfo",
    "EventStream",
    "InvalidArgument",
    "Inventory",
    "Keys",
    "ModelConflict",
    "ModelId",
    "ModelStatus",
    "Models",
    "NoCapacity",
    "NodeConflict",
    "NodeStatus",
    "NotReplicated",
    "PoolExhausted",
    "Recovering",
    "Registry",
    "Released",
    "RequestRefused",
    "ResolveRequest",
    "ServiceUnavailable",
    "Settings",
    "StaleToken",
    "StateReset",
    "Step",
    "StepReply",
    "UnknownDevice",
    "UnknownEpisode",
    "UnknownField",
    "UnknownModel",
    "UnknownNode",
    "check_episode",
    "close",
    "connect",
    "embedded_store",
]
