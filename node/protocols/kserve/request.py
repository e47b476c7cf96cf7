"""What both KServe front doors (HTTP and gRPC) share.

That is Triton's live-sequence rule, the step a request becomes, requests of rows and what
a refusal answers. It is also what a node says of a model: metadata, configuration,
statistics, its one version string. The decoded request, sequence ids and Triton's
parameters are ``body.py``'s (they need no service: a front door process decodes with
them too); this module re-exports them.

**Sequences.** ``sequence_id`` is the episode: a uint64, or a string (Triton's
``sequence(string_id)``); ``0`` and ``""`` (or none) are no sequence: a stateless step.
The episode id keeps the integer ``7`` and the string ``"7"`` apart: ``kserve:i:7`` and
``kserve:s:7``. ``sequence_start`` starts the sequence over; ``sequence_end`` releases it
after the step. A request without ``sequence_start`` for a sequence that is not live is
refused as Triton refuses it, unless ``--kserve-claim-unknown``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from affinity import InvalidArgument, UnknownEpisode
from node import inputs
from node.contract import PolicyContract, TensorSpec
from node.devices import DeviceSpec
from node.errors import (
    BadRequest,
    BodyError,
    InvalidInput,
    NotServed,
    Outcome,
    Refused,
    Unavailable,
    outcome,
)
from node.protocols.kserve.body import (
    REQUEST_PARAMETERS,
    ROW_PARAMETERS,
    InferRequest,
    Row,
    check_custom,
    episode_of,
    rows_of,
    shaped,
    step_parameters,
)
from node.protocols.kserve.tensors import NAMES
from node.rtc import Ask, control_rate
from node.service import NodeService
from node.stats import ModelStats, model_statistics
from node.step import Array, Reply, Step

__all__ = [
    "ANY_VERSION",
    "EXTENSIONS",
    "PLATFORM",
    "REFUSED",
    "REQUEST_PARAMETERS",
    "ROW_PARAMETERS",
    "InferRequest",
    "Row",
    "check_custom",
    "config_of",
    "episode_of",
    "find_model",
    "kserve_outcome",
    "metadata_of",
    "model_config",
    "model_metadata",
    "not_live",
    "requested_version",
    "row_requests",
    "rows_of",
    "serve_rows",
    "served_version",
    "service_step",
    "stack_rows",
    "statistics_of",
    "stats_for",
    "step_parameters",
    "timing_parameters",
    "to_step",
]

ANY_VERSION = "1"
"""Triton's default version: a request naming it (or none) takes the episode's own version,
or the rollout's, unless the fleet registered a version ``"1"`` of the model. Replies,
metadata, statistics and configuration say the registered version (``v2``, or the model
file's hash), never this."""
EXTENSIONS = (
    "binary_tensor_data",
    "sequence",
    "sequence(string_id)",
    "statistics",
    "model_configuration",
)
PLATFORM = "onnxruntime_onnx"
BACKEND = "onnxruntime"


def row_requests(contract: PolicyContract, request: InferRequest) -> list[InferRequest]:
    """One request per row of ``request`` (:attr:`InferRequest.rows`): every input has a
    leading row axis; row i's input is its slice ``[i:i+1]`` for a model with a batch
    axis, else ``[i]``. Raises :class:`BadRequest` for an input without the rows' axis."""
    assert request.rows is not None
    count = len(request.rows)
    for name, array in request.arrays.items():
        if array.ndim == 0 or array.shape[0] != count:
            raise BadRequest(f"input {name[:64]!r} has shape {list(array.shape)}: a request of "
                             f"{count} rows needs a leading axis of {count}")  # fmt: skip
    batch = contract.batch_axis
    return [
        replace(
            request,
            sequence=row.sequence,
            episode=row.episode,
            start=row.start,
            end=row.end,
            seq=row.seq,
            rows=None,
            arrays={n: a[i : i + 1] if batch else a[i] for n, a in request.arrays.items()},
        )
        for i, row in enumerate(request.rows)
    ]


async def serve_rows(
    service: NodeService,
    request: InferRequest,
    deadline: float,
    name: str,
    version: str | None,
    found: tuple[str, PolicyContract],
    door: str,
    served: list[Reply | Exception | None],
    checked: bool = False,
) -> list[Reply | Exception]:
    """Serve a request of rows: each row a step (:func:`service_step`; a row that does not
    make one is that row's error), all through :meth:`node.router.Router.act_rows`.
    ``served`` is filled as rows finish (a door whose client left undoes them).
    ``checked``: a front checked each row's inputs (``node/checks.py``): each row's slice
    is taken as it is."""
    started = time.monotonic()
    steps: list[Step] = []
    results: list[Reply | Exception | None] = []
    for row in row_requests(found[1], request):
        try:
            step = await service_step(service, row, deadline, name, version, found, checked)
        except REFUSED as exc:
            results.append(exc)
            continue
        step.door, step.received = door, started
        steps.append(step)
        results.append(None)
    served.extend([None] * len(steps))
    await service.router.act_rows(steps, served)
    it = iter(served)
    out: list[Reply | Exception] = []
    for r in results:
        got = r if r is not None else next(it)
        out.append(got if got is not None else Unavailable("deadline", "not served"))
    return out


def stack_rows(
    contract: PolicyContract, results: list[Reply | Exception], model_name: str
) -> tuple[dict[str, Array], str, Reply | None]:
    """The outputs of a request of rows along the rows' axis (concatenated along the
    batch axis, else stacked), zeros in a failed row; the ``rows`` parameter (a JSON
    array: each row's facts, or ``{"error": {"status", "code", "message"}}``); and the
    first reply (None: every row failed)."""
    replies = [r for r in results if isinstance(r, Reply)]
    first = replies[0] if replies else None
    facts: list[dict[str, Any]] = []
    for r in results:
        if isinstance(r, Reply):
            facts.append(r.facts())
        else:
            o = outcome(r)
            facts.append({"error": {"status": o.status, "code": o.code, "message": o.message}})
    outputs: dict[str, Array] = {}
    if first is not None:
        for name, like in first.outputs.items():
            parts = [r.outputs[name] if isinstance(r, Reply) else np.zeros_like(like)
                     for r in results]  # fmt: skip
            outputs[name] = np.concatenate(parts) if contract.batch_axis else np.stack(parts)
    return outputs, json.dumps(facts), first


def pending_of(value: object) -> object:
    """A ``pending`` parameter (a string: KServe parameters are scalars) as a list of
    rows, or ``value`` itself for the check to refuse; None when absent."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise BadRequest("parameter pending must be a JSON list of action rows") from None


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
    checked: bool = False,
) -> Step:
    """The internal step of a decoded request.

    Its inputs go through the policy's rule (``InvalidInput`` when they do not fit the
    model). Its requested outputs are checked against ``returned``, the outputs the step
    will have (:class:`BadRequest`). By default that is every output the model returns (with
    action-chunk execution: the chunk output only). A sequence step without
    ``sequence_start`` serves only a live sequence unless ``claim_unknown``
    (``--kserve-claim-unknown``). ``checked``: its inputs were checked and converted by
    this rule already, against ``contract``'s input check, in a front process
    (``node/checks.py``): they are taken as they are."""
    if returned is None:
        returned = [spec.name for spec in contract.returned_outputs]
    if request.outputs is not None:
        for name in request.outputs:
            if name not in returned:
                raise BadRequest(f"unknown output {name[:64]!r}; the model returns: "
                                 f"{', '.join(returned)}")  # fmt: skip
    specs = contract.observation_specs
    if checked:  # (a row's cut of a scalar input, ``a[i]``, is a numpy scalar: an array again)
        feed = {n: a if type(a) is np.ndarray else np.asarray(a) for n, a in request.arrays.items()}
    else:
        if request.arrays.keys() != specs.keys():
            _check_missing(contract, request.arrays)
        feed = inputs.from_arrays(contract, request.arrays)
    return Step(
        episode=request.episode,
        inputs=feed,
        deadline=deadline,
        end=request.end,
        restart=request.start,
        execute_steps=request.execute_steps,
        ensemble=request.ensemble,
        seq=request.seq,
        live_only=request.episode is not None and not request.start and not claim_unknown,
        rtc=rtc,
        control_hz=control_rate(request.control_hz),
        timing=request.timing,
    )


def timing_parameters(reply: Reply) -> dict[str, float]:
    """The split of a step's time as flat reply parameters (``timing_total_ms``, ...)."""
    return {f"timing_{k}": v for k, v in reply.split().items()}


def _check_missing(contract: PolicyContract, arrays: dict[str, Array]) -> None:
    """Raise :class:`BadRequest` naming every input the model takes that ``arrays`` lacks,
    as Triton names them (none missing: the input rule checks the rest)."""
    specs = contract.observation_specs
    missing = [name for name in specs if name not in arrays]
    if missing:
        listed = ", ".join(f"'{n}' ({contract.step_spec(specs[n]).describe()})" for n in missing)
        given = ", ".join(f"'{n[:64]}'" for n in list(arrays)[:8])
        raise BadRequest(
            f"missing required input(s) {listed}: the model takes {len(specs)} inputs, the "
            f"request gives {len(arrays)} [{given}]"
        )


def requested_version(service: NodeService, name: str, version: str | None) -> str | None:
    """The version a request for model ``name`` names: None for none, ``""`` or
    :data:`ANY_VERSION` (unless the fleet registered a version ``"1"`` of ``name``)."""
    if version in (None, ""):
        return None
    if version == ANY_VERSION and ANY_VERSION not in service.catalog.versions(name):
        return None
    return version


async def find_model(
    service: NodeService, name: str, version: str | None
) -> tuple[str, PolicyContract]:
    """The model ``name`` (``version``: see :func:`requested_version`) served by a live node,
    and its contract. Raises :class:`NotServed` with Triton's message."""
    try:
        return await service.model_for(name, requested_version(service, name, version))
    except (Refused, InvalidArgument):
        which = f"'{name[:128]}'" + (f" version {version[:32]}" if version else "")
        fleet = ", ".join(f"'{n}'" for n in service.catalog.served())
        raise NotServed(
            f"Request for unknown model: {which} is not found (this fleet serves {fleet})"
        ) from None


def served_version(service: NodeService, name: str) -> str:
    """The version of ``name`` served here, else the fleet's newest."""
    local = service.models.get(name)
    return local[0].version if local else service.catalog.newest(name)


async def service_step(
    service: NodeService,
    request: InferRequest,
    deadline: float,
    name: str | None = None,
    version: str | None = None,
    found: tuple[str, PolicyContract] | None = None,
    checked: bool = False,
) -> Step:
    """:func:`to_step` for a request to ``service`` (both KServe front doors).

    The request is for model ``name`` (None: the fleet's only one) and ``version`` (see
    :func:`requested_version`). Outputs are checked against what its chunk mode returns,
    with ``--kserve-claim-unknown`` applied. ``found`` is what :func:`find_model` gave for
    them, if the caller asked; ``checked``: a front checked the inputs against that
    model's contract (:func:`to_step`). Raises ``InvalidArgument`` for chunk parameters
    this model cannot take, ``Refused`` for a model no node serves (404)."""
    version = requested_version(service, name or "", version)
    chosen, contract = found or await service.model_for(name, version)
    dispatcher = service.dispatchers.get(chosen)  # elsewhere: the owner checks
    mode, rtc = service.options_for(
        chosen,
        request.execute_steps,
        request.ensemble,
        request.executed,
        request.inference_delay,
        request.control_hz,
        pending_of(request.pending),
    )
    returned = [dispatcher.chunk.output] if dispatcher and mode and dispatcher.chunk else None
    claim_unknown = service.config.kserve_claim_unknown
    step = to_step(contract, request, deadline, returned, claim_unknown, rtc, checked)
    step.model, step.version = chosen, version
    return step


def _returned(contract: PolicyContract, chunk: str | None) -> list[TensorSpec]:
    """The outputs a step returns: with chunk execution (``chunk`` names the chunk output)
    that output alone, one action (its time axis dropped)."""
    if chunk is None:
        return list(contract.returned_outputs)
    (spec,) = (s for s in contract.returned_outputs if s.name == chunk)
    return [replace(spec, shape=spec.shape[:-2] + spec.shape[-1:])]


def _dims(spec: TensorSpec) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in spec.shape]


def model_metadata(
    contract: PolicyContract,
    name: str,
    chunk: str | None = None,
    versions: Sequence[str] = (),
) -> dict[str, Any]:
    """The model metadata of KServe v2: the inputs a client sends and the outputs it gets.

    Recurrent state is hidden: the node feeds it back. ``-1`` stands for a variable
    dimension. ``versions`` are as registered. ``chunk`` names the action-chunk output when the node
    executes chunks."""

    def tensor(spec: TensorSpec) -> dict[str, Any]:
        return {"name": spec.name, "datatype": NAMES[spec.dtype], "shape": _dims(spec)}

    return {
        "name": name,
        "versions": list(versions),
        "platform": PLATFORM,
        "inputs": [tensor(spec) for spec in contract.observation_inputs],
        "outputs": [tensor(spec) for spec in _returned(contract, chunk)],
    }


_CONTROLS = (
    ("START", "CONTROL_SEQUENCE_START"),
    ("END", "CONTROL_SEQUENCE_END"),
    ("READY", "CONTROL_SEQUENCE_READY"),
)


def model_config(
    contract: PolicyContract,
    name: str,
    devices: list[DeviceSpec],
    *,
    max_batch: int,
    batch_delay_us: float,
    idle_s: float,
    capacity: int,
    chunk: str | None = None,
) -> dict[str, Any]:
    """Triton's model configuration (its JSON form) of a model served on ``devices``, for
    tools that read it before they infer (``perf_analyzer``, PyTriton's ``ModelClient``).

    ``max_batch_size`` is 1 for a model with a batch axis, else 0. A client step is one
    row. The node batches steps of different sequences itself, up to ``max_batch`` rows
    waiting at most ``batch_delay_us``: the ``oldest`` strategy's preferred size and delay.
    ``sequence_batching`` lists Triton's control inputs, which a client never sends (the
    sequence travels in request parameters). ``max_candidate_sequences`` is the live
    episodes the devices hold (``capacity`` each). ``max_sequence_idle_microseconds`` is
    ``--episode-ttl``. ``instance_group`` has one instance per device."""
    batched = contract.batch_axis

    def tensor(spec: TensorSpec) -> dict[str, Any]:
        dims = _dims(spec)[1:] if batched else _dims(spec)
        return {"name": spec.name, "data_type": f"TYPE_{NAMES[spec.dtype]}", "dims": dims}

    gpus = [d.ordinal for d in devices if d.kind == "cuda" and d.ordinal is not None]
    cpus = sum(d.kind == "cpu" for d in devices)
    groups: list[dict[str, Any]] = []
    if gpus:
        groups.append({"name": f"{name}_gpu", "kind": "KIND_GPU", "count": 1, "gpus": gpus})
    if cpus:
        groups.append({"name": f"{name}_cpu", "kind": "KIND_CPU", "count": cpus})
    flags = [{"name": n, "control": [{"kind": k, "int32_false_true": [0, 1]}]}
             for n, k in _CONTROLS]  # fmt: skip
    corrid = {"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_UINT64"}
    return {
        "name": name,
        "platform": PLATFORM,
        "backend": BACKEND,
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": 1 if batched else 0,
        "input": [tensor(spec) for spec in contract.observation_inputs],
        "output": [tensor(spec) for spec in _returned(contract, chunk)],
        "sequence_batching": {
            "max_sequence_idle_microseconds": round(idle_s * 1e6),
            "control_input": [*flags, {"name": "CORRID", "control": [corrid]}],
            "oldest": {
                "max_candidate_sequences": capacity * len(devices),
                "preferred_batch_size": [max_batch],
                "max_queue_delay_microseconds": round(batch_delay_us),
            },
        },
        "instance_group": groups,
    }


def _chunk_here(service: NodeService, name: str) -> str | None:
    """The chunk output a step of ``name`` returns alone here (chunk execution), or None."""
    local = service.dispatchers.get(name)
    return local.chunk.output if local and local.chunk and local.chunk_mode else None


def metadata_of(service: NodeService, name: str, contract: PolicyContract) -> dict[str, Any]:
    """:func:`model_metadata` of model ``name`` as this node serves it, with the fleet's
    versions of it."""
    versions = service.catalog.versions(name) or [served_version(service, name)]
    return model_metadata(contract, name, _chunk_here(service, name), versions)


def config_of(service: NodeService, name: str, contract: PolicyContract) -> dict[str, Any]:
    """:func:`model_config` of model ``name`` as this node serves it (another node's model:
    as this node would serve it, with this node's devices and settings)."""
    by_model = service.dispatchers
    local = by_model.get(name) or next(iter(by_model.values()))
    config = service.config
    return model_config(
        contract,
        name,
        service.specs,
        max_batch=local.max_batch,
        batch_delay_us=config.batch_delay_us,
        idle_s=config.settings.episode_ttl_s,
        capacity=config.capacity,
        chunk=_chunk_here(service, name),
    )


def statistics_of(service: NodeService, name: str) -> dict[str, Any]:
    """Triton's statistics of model ``name`` on this node (``node/stats.py``)."""
    stats = service.metrics.model_stats.get(name)
    return model_statistics(stats, name, served_version(service, name))


REFUSED: tuple[type[Exception], ...] = (
    UnknownEpisode, BodyError, BadRequest, InvalidInput, InvalidArgument, Unavailable, Refused
)  # fmt: skip
"""What a KServe door answers with :func:`kserve_outcome` (anything else is a bug: 500)."""


def kserve_outcome(
    service: NodeService,
    model_name: str,
    exc: Exception,
    request: InferRequest | None,
    timeout_s: float | None = None,
) -> Outcome:
    """What a KServe door answers for ``exc`` (:func:`node.errors.outcome`), counted in
    the rejection metric and the model's failures. An invalid request is 400 (413 too
    large, 404 not served) with the bare message; a refused step keeps its status and
    prefixes its code. ``timeout_s``: the request's own timeout, when shorter than
    ``--act-deadline``, which a ``deadline`` names."""
    o = outcome(exc)
    if o.reject_reason is not None:
        service.metrics.rejected.labels(o.reject_reason).inc()
    if isinstance(exc, UnknownEpisode) and request is not None:
        # Triton's rule: a request without START must belong to a live sequence. Redis
        # decides it in the step's own resolve (state this node may hold says nothing about
        # an operator's release, an idle expiry, an END in flight, a Redis restarted empty)
        return replace(o, message=not_live(request.sequence, model_name))
    if not o.invalid and o.status in (500, 503):
        stats_for(service, model_name).failed()
    return shaped(o, timeout_s)


def stats_for(service: NodeService, name: str) -> ModelStats:
    """The statistics that count infer requests for model ``name`` on this node."""
    stats = service.metrics.model_stats.get(name)
    if stats is None:  # a model other nodes serve: requests forwarded from here
        stats = service.metrics.model_stats[name] = ModelStats()
    return stats
