"""One small exception tree under :class:`AffinityError`.

Each error carries what a person needs to act on it: which episode, which device,
which limit.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AffinityError",
    "BackendUnavailable",
    "InvalidArgument",
    "ModelConflict",
    "NoCapacity",
    "NodeConflict",
    "NotReplicated",
    "PoolExhausted",
    "SecretMismatch",
    "StaleToken",
    "UnknownDevice",
    "UnknownEpisode",
    "UnknownField",
    "UnknownModel",
    "UnknownNode",
]


class AffinityError(Exception):
    """Base of every error this library raises on purpose."""


class InvalidArgument(AffinityError, ValueError):
    """A caller-supplied value is out of its allowed range; nothing was written.

    ``field`` names it for programs; the message names ``label`` instead when given (what
    a person set: "lease TTL", not the settings field ``lease_ttl_s``)."""

    def __init__(self, field: str, value: object, limit: str, *, label: str = "") -> None:
        self.field = field
        self.value = value
        self.limit = limit
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid {label or field} {shown}: {limit}")


class UnknownField(InvalidArgument):
    """A request named a field the receiver does not take.

    A typo would otherwise be silently ignored. ``field`` is the name given, ``expected``
    the names it takes."""

    def __init__(self, field: str, expected: Sequence[str]) -> None:
        super().__init__(field, None, f"unknown field; expected: {', '.join(expected)}")
        self.expected = tuple(expected)
        self.args = (f"unknown field {field!r}; expected: {', '.join(expected)}",)


class NoCapacity(AffinityError):
    """No device may take a new episode; nothing was written for it.

    ``reason`` is ``"no_nodes"`` (no node holds a lease: none registered yet, e.g. right
    after Redis restarted empty, or every lease lapsed) or ``"at_capacity"`` (nodes are
    alive, but every device is at capacity, draining, down or leaving) or ``"slo"`` (scored
    placement: every device that qualifies predicts a step time above the episode's control
    period x the headroom).
    """

    REASONS = ("no_nodes", "at_capacity", "slo")

    def __init__(self, episode: str, reason: str = "at_capacity") -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown NoCapacity reason {reason!r}")
        self.episode = episode
        self.reason = reason
        if reason == "no_nodes":
            message = (
                f"no node is registered and alive, so episode {episode!r} cannot be placed "
                "(nodes register at start-up, and again within one renewal period after "
                "Redis lost its data)"
            )
        elif reason == "slo":
            message = (
                f"every device with room predicts a step time above the control period x "
                f"the placement headroom: episode {episode!r} would miss its control period"
            )
        else:
            message = (
                f"every device of the live nodes is at capacity, draining, down or leaving: "
                f"no device for episode {episode!r}"
            )
        super().__init__(message)


class Recovering(AffinityError):
    """The fleet is in its grace period after Redis lost its data (or is new).

    No claim is granted for ``retry_after_s`` more seconds. Meanwhile owners that may still
    serve episodes from memory re-register and re-assert them. Nothing was written for the
    episode."""

    def __init__(self, episode: str, retry_after_s: float) -> None:
        self.episode = episode
        self.retry_after_s = retry_after_s
        super().__init__(
            f"Redis lost its data (or the fleet is new): no episode is claimed for "
            f"{retry_after_s:.1f}s more, while owners re-assert the episodes they serve; "
            f"episode {episode!r} was not placed"
        )


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


class UnknownModel(AffinityError, LookupError):
    """No node serves (or ever registered) the model, or that version of it; ``served``
    names the models the fleet serves when the caller knows them."""

    def __init__(self, model: str, served: Sequence[str] = ()) -> None:
        self.model = model
        self.served = tuple(served)
        known = f"; the fleet serves {', '.join(self.served)}" if self.served else ""
        super().__init__(f"no live node serves model {model!r}{known}")


class ModelConflict(AffinityError):
    """A step names another model or version than the one its episode was claimed with.

    An episode keeps its (name, version) for life. Nothing was changed."""

    def __init__(self, episode: str, held: str, asked: str) -> None:
        self.episode = episode
        self.held = held
        self.asked = asked
        super().__init__(
            f"episode {episode!r} is served with model {held}; this step names {asked} "
            "(an episode keeps its model version: start a new episode for another)"
        )


class UnknownDevice(AffinityError, LookupError):
    """The device id was never registered."""

    def __init__(self, device: str) -> None:
        self.device = device
        super().__init__(f"device {device!r} is not registered")


class UnknownNode(AffinityError, LookupError):
    """Nothing is known about the node id (no record, no device)."""

    def __init__(self, node: str) -> None:
        self.node = node
        super().__init__(f"node {node!r} is not registered")


class BackendUnavailable(AffinityError):
    """Redis did not answer within the configured timeout and retry budget."""


class PoolExhausted(BackendUnavailable):
    """Every connection of this process's Redis pool stayed in use for the whole Redis
    deadline. This process is overloaded; Redis was not asked (a node answers 503 ``busy``).
    """

    def __init__(self, connections: int, deadline_s: float) -> None:
        self.connections = connections
        super().__init__(
            f"all {connections} Redis connections of this process stayed busy for "
            f"{deadline_s}s (overloaded; Redis itself was not asked)"
        )


class NotReplicated(BackendUnavailable):
    """Fewer replicas than ``--redis-replicas`` acknowledged a write within its ``WAIT``
    timeout: a failover could lose it, so its result is not acted on. ``what`` names the
    write (``claim``, ``renewal``, ``registration``, ``flush``); ``acked`` and ``wanted``
    the replicas that acknowledged and that were asked for. A claim made by the write was
    released again, token-checked, as far as Redis answered (best effort). The step that
    asked for it got nothing (503 ``not_replicated``)."""

    WRITES = ("claim", "renewal", "registration", "flush")

    def __init__(
        self, what: str, acked: int, wanted: int, wait_s: float, subject: str = ""
    ) -> None:
        if what not in self.WRITES:
            raise ValueError(f"unknown NotReplicated write {what!r}")
        self.what = what
        self.acked = acked
        self.wanted = wanted
        about = f" of {subject}" if subject else ""
        super().__init__(
            f"the {what}{about} was acknowledged by {acked} of the {wanted} Redis replica(s) "
            f"required (--redis-replicas) within {wait_s}s: a failover could lose it, so it "
            "is not used (check the replicas: INFO replication on the primary)"
        )


class NodeConflict(AffinityError):
    """Another live process holds this node id (its lease is current); nothing written.

    A node that gets it from a renewal has lost its registration to that process: it must
    stop serving at once and exit."""

    def __init__(self, node: str) -> None:
        self.node = node
        super().__init__(
            f"node id {node!r} is held by another running process with a current lease; "
            "give each process its own --node-id (or wait for the old lease to lapse)"
        )


class SecretMismatch(AffinityError):
    """This node's cluster secret is not the fleet's (the digest in Redis differs).

    It must not join, since every step forwarded across it would be refused."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        super().__init__(
            f"AFFINITY_CLUSTER_SECRET does not match the one the fleet in namespace "
            f"{namespace!r} uses: set the same secret on every node (to change it for the "
            f"whole fleet, stop every node and delete the key {{{namespace}}}:secret)"
        )
