"""One small exception tree under :class:`AffinityError`.

Each error carries what a person needs to act on it: which episode, which device,
which limit.
"""

from __future__ import annotations

__all__ = [
    "AffinityError",
    "BackendUnavailable",
    "InvalidArgument",
    "NoCapacity",
    "NodeConflict",
    "StaleToken",
    "UnknownDevice",
    "UnknownEpisode",
]


class AffinityError(Exception):
    """Base of every error this library raises on purpose."""


class InvalidArgument(AffinityError, ValueError):
    """A caller-supplied value is out of its allowed range; nothing was written."""

    def __init__(self, field: str, value: object, limit: str) -> None:
        self.field = field
        self.value = value
        self.limit = limit
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid {field} {shown}: {limit}")


class NoCapacity(AffinityError):
    """No device is eligible for a new episode (all full, draining, down or dead)."""

    def __init__(self, episode: str) -> None:
        self.episode = episode
        super().__init__(f"no device has free capacity for episode {episode!r}")


class StaleToken(AffinityError):
    """The caller's fencing token is not the one in Redis; nothing was changed."""

    def __init__(self, episode: str, token: int, current: int, device: str) -> None:
        self.episode = episode
        self.token = token
        self.current = current
        self.device = device
        super().__init__(
            f"episode {episode!r}: token {token} is stale; {device} holds it with token {current}"
        )


class UnknownEpisode(AffinityError, LookupError):
    """No live assignment exists for the episode."""

    def __init__(self, episode: str) -> None:
        self.episode = episode
        super().__init__(f"episode {episode!r} has no live assignment")


class UnknownDevice(AffinityError, LookupError):
    """The device id was never registered."""

    def __init__(self, device: str) -> None:
        self.device = device
        super().__init__(f"device {device!r} is not registered")


class BackendUnavailable(AffinityError):
    """Redis did not answer within the configured timeout and retry budget."""


class NodeConflict(AffinityError):
    """Another live process holds this node id (its lease is current); nothing written."""

    def __init__(self, node: str) -> None:
        self.node = node
        super().__init__(
            f"node id {node!r} is held by another running process with a current lease; "
            "give each process its own --node-id (or wait for the old lease to lapse)"
        )
