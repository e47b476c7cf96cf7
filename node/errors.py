"""Every node-side exception, and the one table of what a client sees for each.

The hierarchy (``ValueError`` subclasses are a client's bad values)::

    Exception
    ├── Unavailable          503 + Retry-After: cannot serve now, try again
    ├── Refused              a refusal with its own status (403, 404, 409, 421, 422, 500)
    ├── BodyError            413 too large, 400 malformed: refused before decoding
    ├── ClientGone           the client left mid-request: nobody gets an answer
    ├── AmbiguousModel       422: several models served and the step named none
    ├── StepRefused          the owner answers it as refusal(exc): Unavailable or Refused
    │   ├── SeqConflict      409: a step's seq is neither the next nor a retry
    │   ├── ClaimEnded       409: the step's claim ended here before it was kept
    │   ├── NotKept          503: the node dropped its records while the step ran
    │   ├── ForwardCancelled 503: the forwarding router gave up on the step
    │   ├── ModelFailure     500: the model session raised (503: its worker process died)
    │   └── DeviceDown       503: the device waits for a probe after crashes
    ├── ForwardError         503: the owner could not be reached
    ├── AdminRefused         401/403: an admin route without the admin's token
    ├── WorkerGone           a device's worker process died or is restarting (a failed run)
    │   └── StateLost        a run names a state its worker process no longer holds
    │       └── WorkerFenced the worker process refused to serve a state: the lease ran out
    ├── RuntimeError
    │   └── WorkerRunError   a run that raised in a device's worker process (a failed run)
    ├── OSError
    │   └── ForkServerStarting the fronts' fork server is (re)starting: a front's start waits
    ├── GpuUnavailable       start-up only: the node exits (no status)
    │   ├── CudaUnavailable
    │   └── CudaGraphUnavailable
    ├── ValueError
    │   ├── InvalidInput     422 (KServe 400): inputs that do not fit the model
    │   ├── BadRequest       400: a KServe body or message that is not v2
    │   └── TransferError    422: a hand-over record this node cannot install
    │       └── ModelNotServed 421: the record's name@version is not served here
    └── LookupError
        └── NotServed        404: no live node serves the model a KServe request names

:func:`outcome` maps any of them (and ``affinity``'s errors) to an :class:`Outcome`; each
front door renders that in its own wire shape. Adding a failure mode touches ``_TABLE``.

Kept elsewhere on purpose (never answered as they are): ``node/router.py``'s ``_NotSent``,
``_Stale`` and ``_LetGo`` (each an :class:`Unavailable`), ``node/protocols/kserve/messages.py``'s
``Abort`` (an outcome already rendered as a gRPC status, for both gRPC doors; this module
imports no grpcio), ``node/startup.py``'s
``StartupError`` (an exit code) and ``node/deviceproc.py``'s ``_Lost`` and ``_Fenced`` (a
device worker process's own: it answers the core, which raises :class:`StateLost` or
:class:`WorkerFenced`). Hazard: this module
is a leaf; importing anything from ``node`` makes a cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from affinity import (
    AffinityError,
    BackendUnavailable,
    InvalidArgument,
    ModelConflict,
    NoCapacity,
    NotReplicated,
    PoolExhausted,
    Recovering,
    UnknownEpisode,
    UnknownModel,
)
from affinity.wire import WireError

__all__ = [
    "PRIVATE",
    "AdminRefused",
    "AmbiguousModel",
    "BadRequest",
    "BodyError",
    "ClaimEnded",
    "ClientGone",
    "CoreLapsed",
    "CudaGraphUnavailable",
    "CudaUnavailable",
    "DeviceDown",
    "ForkServerStarting",
    "ForwardCancelled",
    "ForwardError",
    "GpuUnavailable",
    "HopError",
    "HopFull",
    "InvalidInput",
    "ModelFailure",
    "ModelNotServed",
    "NotKept",
    "NotServed",
    "Outcome",
    "Refused",
    "SeqConflict",
    "StaleCheck",
    "StateLost",
    "StepRefused",
    "TransferError",
    "Unavailable",
    "Uncarried",
    "Undelivered",
    "WorkerFenced",
    "WorkerGone",
    "WorkerRunError",
    "outcome",
    "refusal",
]

PRIVATE = frozenset({"_NotSent", "_Stale", "_LetGo", "_Lost", "_Fenced", "Abort", "StartupError"})
"""Exception classes defined outside this module on purpose (see the module doc)."""


# ---- the step's own refusals -------------------------------------------------------------


class Unavailable(Exception):
    """The step cannot be decided or served now; answer 503 with ``Retry-After``.

    ``reason`` is a short code from a fixed set (documented in docs/protocols.md): ``fenced``,
    ``leaving``, ``redis``, ``busy``, ``full``, ``no_nodes``, ``owner_unreachable``,
    ``owner_refused``, ``deadline``, ``device_down``, ``recovering``, ``not_replicated``,
    ``slo`` (scored placement: every device would miss the new episode's control period).
    """

    def __init__(self, reason: str, message: str, retry_after: float = 1.0) -> None:
        self.reason = reason
        self.retry_after = retry_after
        super().__init__(message)


class Refused(Exception):
    """A request refused for what it is: a forward the owner will not serve, or a model
    failure (500). The owner refuses 403 bad secret, 409 stale token or moved, 421 not the
    owner."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(message)


# ---- requests refused at the door ----------------------------------------------------------


class BodyError(Exception):
    """A request body refused before it was decoded (413 too large, 400 malformed)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(message)


class ClientGone(Exception):
    """The client's connection closed while its request was served. ``result`` is what the
    work returned when it finished before the close was seen (None: it was cancelled)."""

    def __init__(self, result: object = None) -> None:
        self.result = result
        super().__init__("the client closed its connection")


class HopError(Exception):
    """A front door's shared-memory slot that cannot be used (``node/hop.py``): a request
    too big for a slot (the front answers 413), or a slot's content the core cannot read
    (answered 400 ``malformed``)."""


class Uncarried(HopError):
    """A request whose header the hop cannot carry (msgpack has no integer past 64 bits):
    the front passes its body to the core whole, which answers it as one process does."""


class StaleCheck(Exception):
    """A front checked a step's inputs against an input check that is no longer its
    model's (a rollout to a version of other inputs: ``node/inputs.py``'s
    ``Checked``): raised before anything of the request has changed anything, and answered
    to the front (never to a client) so that it sends the request again, unchecked."""


class HopFull(Exception):
    """Every slot of a front door's hop is in flight: the step is refused 503 ``busy``, or,
    when it waited for a slot until its deadline passed (its own timeout, or the node's
    ``--act-deadline``, which ``deadline_s`` names), 503 ``deadline``, in the words one
    process says for a step whose deadline passed while it queued."""

    def __init__(self, deadline_s: float | None = None) -> None:
        super().__init__()
        self.deadline_s = deadline_s

    def refusal(self) -> Unavailable:
        """The refusal a door answers: ``busy``, or ``deadline``."""
        if self.deadline_s is not None:
            return Unavailable("deadline", f"no answer within {self.deadline_s}s", 1.0)
        return Unavailable("busy", "this front door has every step of its hop in flight", 1.0)


class CoreLapsed(Unavailable):
    """A front door's core is stuck (paused, or its loop blocked) past its lease: the front
    answers the step 503 ``fenced`` itself, so that the client tries another node at once
    instead of waiting on a core that would refuse it anyway (``node.hop.Region.lapsed``)."""

    def __init__(self) -> None:
        super().__init__(
            "fenced",
            "this node's lease ran out and its process has not run since (paused or hung); "
            "ask another node",
            1.0,
        )


class Undelivered(Exception):
    """A front door's client had left when its reply came over the hop: the core was told,
    and undoes the step as for a client of its own that left."""


class InvalidInput(ValueError):
    """A client's inputs are unusable. ``field`` names the input or observation key ("" for
    the whole object). ``problem`` says what is wrong. ``str()`` is ``<root>.<field>:
    <problem>``, ``root`` being ``inputs`` (``/act``, KServe) or ``observation`` (openpi)."""

    def __init__(self, field: str, problem: str, *, root: str = "inputs") -> None:
        self.field = field
        self.problem = problem
        shown = field if len(field) <= 64 else field[:64] + "..."
        super().__init__(f"{root}.{shown}: {problem}" if field else f"{root}: {problem}")


class BadRequest(ValueError):
    """A request this protocol refuses with 400. ``reason`` is the rejection metric's label:
    ``malformed`` for a body that is not a v2 request, ``bad_input`` for a bad value."""

    def __init__(self, message: str, reason: str = "bad_input") -> None:
        self.reason = reason
        super().__init__(message)


class NotServed(LookupError):
    """No live node serves the model (or version) a request names: 404, ``NOT_FOUND``."""


class AmbiguousModel(Exception):
    """A step named no model while the fleet serves several (a 422 naming them)."""

    def __init__(self, served: Sequence[str]) -> None:
        self.served = tuple(served)
        super().__init__(
            f"this fleet serves several models ({', '.join(self.served)}): the step must "
            'name one (KServe: /v2/models/{name}/infer, /act: "model", openpi: ?model=)'
        )


class AdminRefused(Exception):
    """A request to an admin route without the admin's token: 401 (with ``challenge``,
    the ``WWW-Authenticate`` value) or 403."""

    def __init__(self, status: int, code: str, message: str, challenge: str | None = None):
        self.status = status
        self.code = code
        self.challenge = challenge
        super().__init__(message)


# ---- the owner's table of episodes -------------------------------------------------------


class StepRefused(Exception):
    """A step its record or its device refused. The owner answers it as :func:`outcome`
    says (:func:`refusal`); a new kind is a subclass and a row of ``_TABLE``."""


class SeqConflict(StepRefused):
    """A step's ``seq`` is neither the next one nor a retry of the one applied (409);
    nothing changed. ``current`` is the last applied step's ``seq``."""

    def __init__(self, episode: str, current: int, sent: int, *, other: bool = False) -> None:
        self.current = current
        why = (
            f"episode {episode!r} applied step {current} with other inputs: a retry repeats "
            f"its step; the next step is seq {current + 1}"
            if other
            else f"episode {episode!r} has applied step {current}; seq {sent} is neither the "
            f"next ({current + 1}) nor the last (a retry)"
        )
        super().__init__(why)


class ClaimEnded(StepRefused):
    """The step's claim ended here (its episode was ended, released, expired or claimed
    anew) before the step was kept. Nothing was applied; its router asks Redis again."""

    def __init__(self, episode: str, claim: str) -> None:
        self.episode = episode
        super().__init__(
            f"episode {episode!r}: claim {claim or '(none)'} ended on this node before "
            "the step was kept"
        )


class NotKept(StepRefused):
    """The node dropped its records while the step ran (it fenced itself, or registered
    anew): the result was not kept, so it must not be answered."""

    def __init__(self, episode: str) -> None:
        super().__init__(
            f"episode {episode!r}: this node dropped its episodes while the step ran "
            "(its lease lapsed, or it registered anew); nothing was kept"
        )


class ForwardCancelled(StepRefused):
    """The router that forwarded this step gave up on it and said so. Its undo reached this
    node before the step itself, or while it ran. The step is not applied."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        super().__init__(f"the router gave up on forward {origin!r} before it was applied")


# ---- between nodes -------------------------------------------------------------------------


class ForwardError(Exception):
    """The owner could not be reached, or answered something that is not HTTP.
    ``unsent``: the request never left (no connection), so the step cannot have run."""

    def __init__(self, message: str, *, unsent: bool = False) -> None:
        self.unsent = unsent
        super().__init__(message)


class TransferError(ValueError):
    """A hand-over message this node cannot install; the message says why."""


class ModelNotServed(TransferError):
    """A hand-over's record names a ``name@version`` this node does not serve."""


# ---- devices -------------------------------------------------------------------------------


class ModelFailure(StepRefused):
    """The model session raised while running a step; the device's crash count went up.
    ``gone``: its device's worker process died during the run (:class:`WorkerGone`): the
    node's fault, not the model's, and over at once (the step is moved at its retry), so a
    503 to retry, where a model that raised is a 500."""

    def __init__(self, device: str, cause: BaseException) -> None:
        self.device = device
        self.gone = isinstance(cause, WorkerGone)
        super().__init__(f"model failed on {device}: {type(cause).__name__}: {cause}")


class DeviceDown(StepRefused):
    """The device is marked down by its crash tracker and is waiting for a probe."""

    def __init__(self, device: str) -> None:
        self.device = device
        super().__init__(f"device {device} is down after repeated model failures")


class ForkServerStarting(OSError):
    """The fronts' fork server (``node/forkserver.py``) is starting, or starting again after
    it died: a front's start is tried again shortly (its imports take a second or so).
    Never answered to a client."""


class WorkerGone(Exception):
    """A device's worker process (``--device-workers process``, ``node/deviceprocs.py``)
    died during a run, or is being restarted: the run failed, and the device is down until
    its new worker process is up."""

    def __init__(self, device: str, why: str) -> None:
        self.device = device
        super().__init__(f"the worker process of device {device} {why}")


class StateLost(WorkerGone):
    """A run names an episode's state that a device's worker process held before it was
    restarted: the state is gone with it (the node drops such records as the process dies;
    this is a step that read its record just before). Answered as a run the process died
    in; the episode's next step starts clean and says ``state_reset``."""


class WorkerFenced(StateLost):
    """A device's worker process refused a run that would continue an episode's state it
    holds: the node's lease had run out, as the core last told it. Not the device's
    failure; the step is answered 503 ``fenced`` (:class:`NotKept`), as the core's own
    check would have."""


class WorkerRunError(RuntimeError):
    """A run that raised in a device's worker process; ``str()`` is the error there, as
    ``Type: message`` (counted as the device's failure, as a session of the core's own)."""


class GpuUnavailable(Exception):
    """A device of this node is a GPU, and ONNX Runtime cannot serve it there.

    ``str()`` is one line saying why and what to do; ``affinity-node`` prints it and exits.
    """


class CudaUnavailable(GpuUnavailable):
    """CUDA cannot load or start. ``library`` names the missing library when that is why."""

    def __init__(self, message: str, library: str | None = None) -> None:
        self.library = library
        super().__init__(message)


class CudaGraphUnavailable(GpuUnavailable):
    """``--cuda-graph`` was asked for, and ONNX Runtime cannot capture this model on CUDA."""


# ---- the table -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a client sees for a failure, before a front door gives it its wire shape."""

    status: int
    """The HTTP status, as ``POST /act`` answers it."""
    code: str
    """The error code (``{"error": {"code"}}``; openpi and KServe prefix messages with it)."""
    message: str
    retry_after: float | None = None
    """Seconds the client should wait (503 only); sent as whole seconds, at least 1."""
    reject_reason: str | None = None
    """The ``affinity_rejected_requests_total`` label this refusal counts under, if any."""
    field: str | None = None
    """The request field at fault, for ``/act``'s error body."""
    invalid: bool = False
    """The request itself is bad and nothing ran: KServe's 400 with the bare message,
    openpi's "bad observation"."""

    @property
    def retry_header(self) -> str:
        """``Retry-After``'s value: whole seconds, at least 1."""
        return str(max(1, round(self.retry_after or 1)))


def _bad_input(status: int, exc: Exception, field: str | None = None) -> Outcome:
    return Outcome(status, "bad_input", str(exc), None, "bad_input", field, invalid=True)


def _unavailable(code: str, retry_after: float = 1.0) -> Callable[[Any], Outcome]:
    return lambda exc: Outcome(503, code, str(exc), retry_after)


_TABLE: dict[type[BaseException], Callable[[Any], Outcome]] = {
    Unavailable: lambda e: Outcome(503, e.reason, str(e), e.retry_after),
    Refused: lambda e: Outcome(
        e.status, e.reason, str(e), reject_reason="forbidden" if e.status == 403 else None
    ),
    BodyError: lambda e: Outcome(e.status, e.reason, str(e), reject_reason=e.reason, invalid=True),
    BadRequest: lambda e: Outcome(400, e.reason, str(e), reject_reason=e.reason, invalid=True),
    WireError: lambda e: Outcome(400, "malformed", str(e), reject_reason="malformed", invalid=True),
    InvalidInput: lambda e: _bad_input(422, e, f"inputs.{e.field}".rstrip(".")),
    InvalidArgument: lambda e: _bad_input(422, e, e.field.replace(" ", "_")),
    UnknownEpisode: lambda e: _bad_input(400, e),  # KServe's not-live sequence
    NotServed: lambda e: Outcome(404, "unknown_model", str(e), invalid=True),
    AmbiguousModel: lambda e: Outcome(422, "model_required", str(e)),
    AdminRefused: lambda e: Outcome(
        e.status, e.code, str(e), reject_reason="forbidden" if e.status == 403 else "unauthorized"
    ),
    ClientGone: lambda e: Outcome(499, "client_gone", str(e)),
    SeqConflict: lambda e: Outcome(409, "seq_conflict", str(e)),
    ClaimEnded: lambda e: Outcome(409, "ended", str(e)),
    NotKept: _unavailable("fenced"),
    ForwardCancelled: _unavailable("deadline"),
    ForwardError: _unavailable("owner_unreachable"),
    ModelNotServed: lambda e: Outcome(421, "not_owner", str(e)),
    TransferError: lambda e: Outcome(422, "bad_record", str(e)),
    ModelFailure: lambda e: (
        Outcome(503, "model_failure", str(e), 1.0)
        if e.gone
        else Outcome(500, "model_failure", str(e))
    ),
    DeviceDown: _unavailable("device_down", 5.0),
    ModelConflict: lambda e: Outcome(409, "model_conflict", str(e)),
    UnknownModel: lambda e: Outcome(404, "unknown_model", str(e)),
    NoCapacity: lambda e: (
        Outcome(503, "no_nodes", str(e), 1.0)
        if e.reason == "no_nodes"
        # slo: the scores move at the next renewals (a third of a lease)
        else Outcome(503, "slo", str(e), 2.0)
        if e.reason == "slo"
        else Outcome(503, "full", str(e), 2.0)
    ),
    Recovering: lambda e: Outcome(503, "recovering", str(e), max(1.0, e.retry_after_s)),
    PoolExhausted: _unavailable("busy"),
    NotReplicated: _unavailable("not_replicated"),  # nobody serves it: retry once caught up
    BackendUnavailable: _unavailable("redis"),
    AffinityError: _unavailable("affinity"),
}
"""Each exception class (or its nearest base in the table) -> its outcome."""


def refusal(exc: BaseException) -> Unavailable | Refused:
    """``exc`` as the step's error: :class:`Unavailable` for a 503, else :class:`Refused`."""
    o = outcome(exc)
    if o.status == 503:
        return Unavailable(o.code, o.message, 1.0 if o.retry_after is None else o.retry_after)
    return Refused(o.status, o.code, o.message)


def outcome(exc: BaseException) -> Outcome:
    """What the client sees for ``exc``: the entry of its class, or of its nearest base
    class in the table; anything else is a 500 ``internal``."""
    for kind in type(exc).__mro__:
        make = _TABLE.get(kind)
        if make is not None:
            return make(exc)
    return Outcome(500, "internal", f"internal error: {type(exc).__name__}: {exc}"[:300])
