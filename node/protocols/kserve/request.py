"""What both KServe front doors (HTTP and gRPC) share: the decoded request, Triton's
sequence ids and parameters, its live-sequence rule, the step a request becomes, and the
model metadata.

**Sequences.** ``sequence_id`` is the episode: a uint64, or a string (Triton's
``sequence(string_id)``); ``0`` and ``""`` (or none) are no sequence: a stateless step.
The episode id keeps the integer ``7`` and the string ``"7"`` apart: ``kserve:i:7`` and
``kserve:s:7``. ``sequence_start`` starts the sequence over; ``sequence_end`` releases it
after the step. A request without ``sequence_start`` for a sequence that is not live is
refused as Triton refuses it, unless ``--kserve-claim-unknown``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from affinity import InvalidArgument, check_episode
from node.policy import PolicyContract, TensorSpec, inputs_from_arrays
from node.protocols.kserve.tensors import NAMES, BadRequest, kind_of
from node.rtc import Ask
from node.service import NodeService
from node.step import Array, Step

__all__ = [
    "EXTENSIONS",
    "MODEL_VERSION",
    "PLATFORM",
    "REQUEST_PARAMETERS",
    "InferRequest",
    "check_custom",
    "episode_of",
    "model_metadata",
    "not_live",
    "service_step",
    "to_step",
]

MODEL_VERSION = "1"
EXTENSIONS = ("binary_tensor_data", "sequence", "sequence(string_id)", "statistics")
PLATFORM = "onnxruntime_onnx"


@dataclass(slots=True)
class InferRequest:
    """One decoded infer request, before the policy's input rule.

    ``sequence`` is the client's ``sequence_id`` (None without a sequence) and ``episode``
    its affinity episode id; ``arrays`` holds each input as declared (its datatype and
    shape); ``outputs`` maps each requested output to whether it goes back binary (None:
    every output, binary when ``binary_output``); ``timeout_s`` is the client's
    ``timeout``, if any; ``execute_steps`` and ``ensemble`` are the client's action-chunk
    overrides (their ranges are the dispatcher's ``mode_for``'s to check)."""

    id: str | None
    sequence: int | str | None
    episode: str | None
    start: bool
    end: bool
    arrays: dict[str, Array]
    outputs: dict[str, bool] | None
    binary_output: bool
    timeout_s: float | None
    execute_steps: int | None = None
    ensemble: str | None = None
    seq: int | None = None
    executed: object = None  # real-time chunking (node/rtc.py), checked by rtc_for
    inference_delay: object = None
    control_hz: object = None


def episode_of(sequence_id: object) -> str | None:
    """The episode id of a ``sequence_id``: ``kserve:i:<n>`` for a uint64 ``n``,
    ``kserve:s:<text>`` for a string, None for ``0``, ``""`` or no id (stateless). Raises
    :class:`BadRequest` for anything else (a bool, a negative or fractional number, a
    string over the episode id limit or with control characters)."""
    if sequence_id is None or sequence_id == 0 or sequence_id == "":
        if isinstance(sequence_id, bool | float):
            raise BadRequest(f"sequence_id {sequence_id!r} must be an unsigned integer or a string")
        return None
    if type(sequence_id) is int:
        if not 0 < sequence_id < 2**64:
            raise BadRequest(f"sequence_id {sequence_id} is not a uint64")
        return f"kserve:i:{sequence_id}"
    if isinstance(sequence_id, str):
        try:
            return check_episode(f"kserve:s:{sequence_id}")
        except InvalidArgument as exc:
            raise BadRequest(f"sequence_id {sequence_id[:64]!r}: {exc.limit}") from None
    raise BadRequest(
        f"sequence_id must be an unsigned integer or a string, not {kind_of(sequence_id)}"
    )


REQUEST_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "timeout", "priority",
     "binary_data_output", "execute_steps", "ensemble", "executed", "inference_delay",
     "control_hz"}
)  # fmt: skip
"""The request parameters the node reads (``priority`` only checked, as Triton does)."""


def check_custom(params: dict[str, Any]) -> None:
    """Refuse what Triton refuses among the parameters: a ``priority`` that is not a
    uint64, and a custom parameter (any other) whose value is not a boolean, a number or a
    string. Other custom parameters are accepted and unused, as a Triton backend that does
    not read them leaves them."""
    priority = params.get("priority")
    if priority is not None and (type(priority) is not int or not 0 <= priority < 2**64):
        raise BadRequest(f"priority {priority!r:.40} must be an unsigned integer")
    for key, value in params.items():
        if key not in REQUEST_PARAMETERS and (value is None or isinstance(value, list | dict)):
            raise BadRequest(
                f"parameter {key[:64]!r} must be a boolean, a number or a string, "
                f"not {kind_of(value)}"
            )


def not_live(sequence: object, model_name: str) -> str:
    """Triton's message for a step without START of a sequence that is not live."""
    return (
        f"inference request for sequence {sequence} to model '{model_name}' must specify the "
        "START flag on the first request of the sequence (the sequence is not live: it never "
        "started, it ended, or it was idle past the episode TTL)"
    )


def to_step(
    contract: PolicyContract,
    request: InferRequest,
    deadline: float,
    returned: Sequence[str] | None = None,
    claim_unknown: bool = False,
    rtc: Ask | None = None,
) -> Step:
    """The internal step of a decoded request: its inputs through the policy's rule
    (``InvalidInput`` when they do not fit the model) and its requested outputs checked
    against ``returned``, the outputs the step will have (:class:`BadRequest`); by default
    every output the model returns (with action-chunk execution: the chunk output only).
    A sequence step without ``sequence_start`` serves only a live sequence unless
    ``claim_unknown`` (``--kserve-claim-unknown``)."""
    if returned is None:
        returned = [spec.name for spec in contract.returned_outputs]
    if request.outputs is not None:
        for name in request.outputs:
            if name not in returned:
                raise BadRequest(f"unknown output {name[:64]!r}; the model returns: "
                                 f"{', '.join(returned)}")  # fmt: skip
    return Step(
        episode=request.episode,
        inputs=inputs_from_arrays(contract, request.arrays),
        deadline=deadline,
        end=request.end,
        restart=request.start,
        execute_steps=request.execute_steps,
        ensemble=request.ensemble,
        seq=request.seq,
        live_only=request.episode is not None and not request.start and not claim_unknown,
        rtc=rtc,
    )


async def service_step(
    service: NodeService,
    request: InferRequest,
    deadline: float,
    name: str | None = None,
    version: str | None = None,
) -> Step:
    """:func:`to_step` for a request to ``service`` (both KServe front doors) for model
    ``name`` (None: the fleet's only one) and ``version`` (None or ``"1"``, the version
    a one-version server has: the episode's own, or the rollout's): outputs checked
    against what its chunk mode returns, ``--kserve-claim-unknown`` applied. Raises
    ``InvalidArgument`` for chunk parameters this model cannot take, ``Refused`` for a
    model no node serves (404)."""
    version = None if version in (None, "", MODEL_VERSION) else version
    chosen, contract = await service.model_for(name, version)
    dispatcher = service.dispatcher.by_model.get(chosen)  # elsewhere: the owner checks
    mode = dispatcher.mode_for(request.execute_steps, request.ensemble) if dispatcher else None
    rtc = service.rtc_for(chosen, request.executed, request.inference_delay, request.control_hz)
    returned = [dispatcher.chunk.output] if dispatcher and mode and dispatcher.chunk else None
    claim_unknown = service.config.kserve_claim_unknown
    step = to_step(contract, request, deadline, returned, claim_unknown, rtc)
    step.model, step.version = chosen, version
    return step


def model_metadata(contract: PolicyContract, name: str, chunk: str | None = None) -> dict[str, Any]:
    """The model metadata of KServe v2: the inputs a client sends and the outputs it gets
    (recurrent state hidden: the node feeds it back), ``-1`` for a variable dimension.
    ``chunk`` names the action-chunk output when the node executes chunks: a step then
    returns that output alone, one action (its time axis dropped)."""

    def tensor(spec: TensorSpec) -> dict[str, Any]:
        return {
            "name": spec.name,
            "datatype": NAMES[spec.dtype],
            "shape": [d if isinstance(d, int) else -1 for d in spec.shape],
        }

    outputs = [tensor(spec) for spec in contract.returned_outputs]
    if chunk is not None:
        (spec,) = (s for s in contract.returned_outputs if s.name == chunk)
        outputs = [tensor(replace(spec, shape=spec.shape[:-2] + spec.shape[-1:]))]

    return {
        "name": name,
        "versions": [MODEL_VERSION],
        "platform": PLATFORM,
        "inputs": [tensor(spec) for spec in contract.observation_inputs],
        "outputs": outputs,
    }
