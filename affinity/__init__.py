"""affinity: episode-sticky GPU placement backed by Redis.

``Claims`` decides where an episode lives (one atomic Lua round trip); ``Registry``
keeps nodes, devices and their states; ``Keys`` names every Redis key.
"""

from affinity.claims import Assignment, Claims, EpisodeInfo, Released, check_episode
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
from affinity.keys import Keys
from affinity.models import ModelId
from affinity.registry import (
    DeviceRegistration,
    DeviceStatus,
    ModelStatus,
    NodeStatus,
    Registry,
)

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
    "InvalidArgument",
    "Keys",
    "ModelConflict",
    "ModelId",
    "ModelStatus",
    "NoCapacity",
    "NodeConflict",
    "NodeStatus",
    "NotReplicated",
    "PoolExhausted",
    "Recovering",
    "Registry",
    "Released",
    "RequestRefused",
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
