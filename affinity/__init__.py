"""affinity: episode-sticky GPU placement backed by Redis.

``Claims`` decides where an episode lives (one atomic Lua round trip). ``Registry``
keeps nodes, devices and their states. ``Inventory`` lists them for operators.
``EventStream`` reads the event log. ``Models`` keeps rollout weights and contracts.
``Keys`` names every Redis key.

The names below are loaded on first use (PEP 562): ``import affinity`` alone, or a
submodule (``affinity.errors``, ``affinity.wire``), loads nothing else, so a process that
needs only the errors (a node's front door or device worker) does not load redis-py and
httpx (~1 s of start-up and ~18 MiB each).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from affinity.claims import (
        Assignment,
        Claims,
        EpisodeInfo,
        Released,
        ResolveRequest,
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
    from affinity.keys import Keys, check_episode
    from affinity.models import ModelId, Models
    from affinity.registry import DeviceRegistration, Registry

__version__ = "0.2.0"

_WHERE = {
    "AffinityError": "errors",
    "Assignment": "claims",
    "AsyncClient": "client",
    "BackendUnavailable": "errors",
    "Claims": "claims",
    "Client": "client",
    "ClientError": "client",
    "DeviceRegistration": "registry",
    "DeviceStatus": "inventory",
    "EpisodeInfo": "claims",
    "EventStream": "events",
    "InvalidArgument": "errors",
    "Inventory": "inventory",
    "Keys": "keys",
    "ModelConflict": "errors",
    "ModelId": "models",
    "ModelStatus": "inventory",
    "Models": "models",
    "NoCapacity": "errors",
    "NodeConflict": "errors",
    "NodeStatus": "inventory",
    "NotReplicated": "errors",
    "PoolExhausted": "errors",
    "Recovering": "errors",
    "Registry": "registry",
    "Released": "claims",
    "RequestRefused": "client",
    "ResolveRequest": "claims",
    "ServiceUnavailable": "client",
    "Settings": "config",
    "StaleToken": "errors",
    "StateReset": "client",
    "Step": "client",
    "StepReply": "client",
    "UnknownDevice": "errors",
    "UnknownEpisode": "errors",
    "UnknownField": "errors",
    "UnknownModel": "errors",
    "UnknownNode": "errors",
    "check_episode": "keys",
    "close": "connection",
    "connect": "connection",
    "embedded_store": "connection",
}
"""Each public name -> the submodule that defines it."""

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


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'affinity' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"affinity.{module}"), name)
    globals()[name] = value  # once: later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
