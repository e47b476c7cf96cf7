"""A policy's tensor contract: what the model takes and returns, which outputs feed which
inputs back, and the sidecar's declarations (``<stem>.affinity.json``).

:func:`load_contract` reads the model's inputs and outputs from ONNX Runtime. It checks the
sidecar against them. Any contradiction stops the node at start-up with the file, the key
and the problem. Inputs named ``state_in.*``, ``control.*`` and ``rtc.*`` are filled by the
node and hidden from clients (:attr:`PolicyContract.observation_inputs`). Shapes are ONNX
Runtime's: a dimension is an ``int``, a symbolic name (``str``) or ``None`` (unknown). The
sidecar's keys, the batch axis and the dtype rule are documented in ``docs/policies.md``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # (imported where a model is read: a front process never loads it)
    import onnxruntime

__all__ = [
    "CONTROL_INPUTS",
    "CONTROL_PREFIX",
    "RTC_DELAY",
    "RTC_INPUTS",
    "RTC_PREFIX",
    "RTC_PREFIX_LEN",
    "RTC_PREFIX_NAME",
    "SIDECAR_KEYS",
    "STATE_IN_PREFIX",
    "STATE_OUT_PREFIX",
    "Array",
    "Dim",
    "InputCheck",
    "PolicyContract",
    "TensorSpec",
    "checking_contract",
    "json_kind",
    "load_contract",
    "sidecar_path",
]

Array = npt.NDArray[Any]
Dim = int | str | None

STATE_IN_PREFIX = "state_in."
CONTROL_PREFIX = "control."
CONTROL_INPUTS = ("control.start", "control.end", "control.ready", "control.corrid")
RTC_PREFIX_NAME = "rtc."
RTC_PREFIX = "rtc.prefix"
RTC_PREFIX_LEN = "rtc.prefix_len"
RTC_DELAY = "rtc.delay"
RTC_INPUTS = (RTC_PREFIX, RTC_PREFIX_LEN, RTC_DELAY)
STATE_OUT_PREFIX = "state_out."
SIDECAR_KEYS = ("state", "chunk", "batch", "observations", "metadata")

# ONNX Runtime's type names of the tensors a policy may take or return, as numpy dtype names.
_DTYPES = {
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(int8)": "int8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(uint8)": "uint8",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
    "tensor(bool)": "bool",
    # string tensors (KServe's BYTES) are numpy object arrays of str, as ONNX Runtime takes
    # and returns them; their values must be UTF-8 text
    "tensor(string)": "object",
}


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: its name, shape and numpy dtype name (e.g. ``float32``)."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:
        """``{"name", "shape", "dtype"}``; symbolic dimensions stay strings, unknown ones null."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    def zeros(self) -> Array:
        """A fresh array of zeros of this spec, symbolic and unknown dimensions taken as 1."""
        shape = tuple(d if isinstance(d, int) else 1 for d in self.shape)
        if self.dtype == "object":  # a string tensor: empty strings
            return np.full(shape, "", dtype=object)
        return np.zeros(shape, self.dtype)

    def describe(self) -> str:
        """E.g. ``float32 [1, 8]``, for error messages."""
        dims = ", ".join("?" if dim is None else str(dim) for dim in self.shape)
        return f"{self.dtype} [{dims}]"


class InputCheck(NamedTuple):
    """What the input rule (``node/inputs.py``'s ``from_json``, ``from_arrays`` and
    ``from_observation``) reads of a contract: each observation input's name, dtype and
    whole shape, in order, the batch axis and the openpi observation map (``doc``, JSON),
    and their digest (``key``). A front process checks a
    client's inputs against the contract :func:`checking_contract` rebuilds from ``doc``,
    and the core trusts that check when ``key`` is its own contract's (``node/front.py``)."""

    key: str
    doc: dict[str, Any]


_HOP_KINDS = frozenset("biuf")
"""The dtype kinds of the inputs a front checks and sends as tensors over the hop."""


@dataclass(frozen=True)
class PolicyContract:
    """What a policy takes and returns, which outputs feed which inputs back, and the
    sidecar's other declarations (``docs/policies.md``)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    state: Mapping[str, str]
    """State input name -> name of the output fed back into it on the next step."""
    chunk: str | None = None
    """The returned output that is an action chunk, ``[batch, H, D]`` (``[H, D]`` without a
    batch axis), or None."""
    batch_axis: bool = False
    """Dimension 0 of every input and output is the batch axis (size 1 per client step)."""
    observations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """The sidecar's observation key -> input entries (see :attr:`observation_map`)."""
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The sidecar's free JSON map for openpi clients (read only)."""
    warmup: Mapping[str, Array] = field(default_factory=lambda: MappingProxyType({}), compare=False)
    """The operator's sample of every observation input, one step each, that the node warms
    the model up (and probes a down device) with: ``<stem>.warmup.npz`` beside the model,
    read by ``node.warmup.with_samples``; empty when none is given."""

    @functools.cached_property
    def observation_inputs(self) -> tuple[TensorSpec, ...]:
        """The inputs the client sends: every input that is not state, control nor rtc."""
        return tuple(
            spec
            for spec in self.inputs
            if spec.name not in self.state
            and not spec.name.startswith((CONTROL_PREFIX, RTC_PREFIX_NAME))
        )

    @functools.cached_property
    def observation_specs(self) -> dict[str, TensorSpec]:
        """:attr:`observation_inputs` by name (read on every step)."""
        return {spec.name: spec for spec in self.observation_inputs}

    @functools.cached_property
    def control_inputs(self) -> tuple[TensorSpec, ...]:
        """The control inputs the node fills (see ``node/control.py``)."""
        return tuple(spec for spec in self.inputs if spec.name.startswith(CONTROL_PREFIX))

    @functools.cached_property
    def rtc_inputs(self) -> tuple[TensorSpec, ...]:
        """The real-time-chunking inputs the node fills (see ``node/rtc.py``)."""
        return tuple(spec for spec in self.inputs if spec.name.startswith(RTC_PREFIX_NAME))

    @functools.cached_property
    def returned_outputs(self) -> tuple[TensorSpec, ...]:
        """The outputs a client gets back: every output not fed back as state."""
        fed_back = set(self.state.values())
        return tuple(spec for spec in self.outputs if spec.name not in fed_back)

    @property
    def observation_map(self) -> dict[str, str]:
        """Every openpi observation key -> the observation input it feeds: the sidecar's
        entries, then each input no entry maps to under its own name."""
        mapped = dict(self.observations)
        targets = set(mapped.values())
        mapped.update({s.name: s.name for s in self.observation_inputs if s.name not in targets})
        return mapped

    @property
    def chunk_shape(self) -> tuple[int, int] | None:
        """``(H, D)`` of the action chunk (horizon, action size), or None without one."""
        if self.chunk is None:
            return None
        *_, horizon, size = next(s for s in self.outputs if s.name == self.chunk).shape
        assert isinstance(horizon, int) and isinstance(size, int)  # checked at load
        return horizon, size

    @property
    def batch_blocker(self) -> str | None:
        """Why the server cannot stack several episodes' steps in one run, or None if it can.

        It can when there is a batch axis and it is dynamic (symbolic or unknown) on every
        input and output.
        """
        if not self.batch_axis:
            return 'the model has no batch axis (see the sidecar\'s "batch")'
        for spec in (*self.inputs, *self.outputs):
            if isinstance(spec.shape[0], int):
                return f"{spec.name} is {spec.describe()}: its batch axis is fixed"
        return None

    @property
    def batchable(self) -> bool:
        """Several episodes' steps can run as one batch (:attr:`batch_blocker` is None)."""
        return self.batch_blocker is None

    def step_spec(self, spec: TensorSpec) -> TensorSpec:
        """``spec`` as one client step holds it: the batch axis (if any) of size 1."""
        if not self.batch_axis:
            return spec
        return _one_row(spec)

    def to_json(self) -> dict[str, Any]:
        """The contract as served by ``GET /model``.

        ``inputs``: the observation inputs a client sends in ``/act``. ``outputs``: the
        outputs it gets back. Both are in the shape of one step (the batch axis as 1).
        ``state``: state input -> output fed back into it (kept by the server, never sent nor
        returned). ``batch_axis``: dimension 0 is the batch axis (openpi observations leave
        it out). ``chunk``: the action-chunk output or null. ``observations``: openpi
        observation key -> input. ``metadata``: the sidecar's map for openpi clients.
        """
        return {
            "inputs": [self.step_spec(spec).to_json() for spec in self.observation_inputs],
            "outputs": [self.step_spec(spec).to_json() for spec in self.returned_outputs],
            "state": dict(self.state),
            "batch_axis": self.batch_axis,
            "chunk": self.chunk,
            "observations": self.observation_map,
            "metadata": dict(self.metadata),
        }

    @functools.cached_property
    def input_check(self) -> InputCheck | None:
        """What a front checks inputs of this contract against (:class:`InputCheck`); None
        when an observation input is a string tensor (the core checks those itself)."""
        specs = self.observation_inputs
        if any(np.dtype(spec.dtype).kind not in _HOP_KINDS for spec in specs):
            return None
        doc = {
            "batch_axis": self.batch_axis,
            "inputs": [[spec.name, spec.dtype, list(spec.shape)] for spec in specs],
            "observations": self.observation_map,
        }
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return InputCheck(hashlib.blake2b(text.encode(), digest_size=8).hexdigest(), doc)

    def initial_state(self) -> dict[str, Array]:
        """Zeros for each state input (see :meth:`TensorSpec.zeros`). Fresh arrays each call."""
        return {spec.name: spec.zeros() for spec in self.inputs if spec.name in self.state}


def checking_contract(doc: object) -> PolicyContract:
    """The contract an :class:`InputCheck`'s ``doc`` describes: its observation inputs and
    openpi observation map, no state, no outputs. ``node/inputs.py`` accepts and converts
    exactly the inputs it accepts and converts for the whole contract (whose state inputs
    a client must not send either: naming one is refused by both, with another message).
    Raises ``ValueError`` for a malformed ``doc``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise ValueError("an input check is a map with a list of inputs")
    batch_axis = doc.get("batch_axis")
    if not isinstance(batch_axis, bool):
        raise ValueError("an input check's batch_axis is true or false")
    specs: list[TensorSpec] = []
    for entry in doc["inputs"]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise ValueError("an input check's input is [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(dtype, str) or _kind(dtype) not in _HOP_KINDS:
            raise ValueError(f"input {name!r}: dtype {dtype!r} is not checked by a front")
        if not isinstance(shape, list) or not all(
            d is None or isinstance(d, str) or (type(d) is int and d >= 0) for d in shape
        ):
            raise ValueError(f"input {name!r}: a shape is a list of sizes, names or nulls")
        if name.startswith((CONTROL_PREFIX, RTC_PREFIX_NAME)):
            raise ValueError(f"input {name!r} is filled by the node, not sent")
        specs.append(TensorSpec(name, tuple(shape), dtype))
    if len({spec.name for spec in specs}) != len(specs):
        raise ValueError("an input check names an input twice")
    if batch_axis and any(not spec.shape for spec in specs):
        raise ValueError("an input check with a batch axis has no scalar input")
    observations = doc.get("observations", {})
    names = {spec.name for spec in specs}
    if not isinstance(observations, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v in names for k, v in observations.items()
    ):
        raise ValueError("an input check's observations map keys to its inputs")
    return PolicyContract(tuple(specs), (), MappingProxyType({}), batch_axis=batch_axis,
                          observations=MappingProxyType(observations))  # fmt: skip


def _kind(dtype: str) -> str:
    """The kind of the numpy dtype named ``dtype`` ("" when numpy knows no such name)."""
    try:
        return np.dtype(dtype).kind
    except TypeError:
        return ""


def sidecar_path(model_path: Path) -> Path:
    """The sidecar of ``model_path``: ``<stem>.affinity.json`` in the same directory."""
    return model_path.with_name(f"{model_path.stem}.affinity.json")


def load_contract(model_path: Path) -> PolicyContract:
    """Read the tensor contract of the model at ``model_path`` with its sidecar's declarations.

    Names, shapes and dtypes come from ONNX Runtime (CPU provider); the rest from the sidecar,
    or defaults (``docs/policies.md``). Raises ``ValueError`` when the sidecar is malformed or
    contradicts the model, or a tensor has a type a policy cannot use. It names the file, the
    sidecar key and the problem.
    """
    session = _cpu_session(model_path)
    inputs = tuple(_spec(arg) for arg in session.get_inputs())
    outputs = tuple(_spec(arg) for arg in session.get_outputs())
    path = sidecar_path(model_path)
    doc = _read_sidecar(path) if path.exists() else {}
    where = str(path) if path.exists() else str(model_path)
    if "state" in doc:
        state = _string_map(doc["state"], where, "state", "each state input name to an output")
        _check_state(state, inputs, outputs, where)
    else:
        state = _by_convention(inputs)
        _check_state(state, inputs, outputs, f"{where} (naming convention)")
    _check_control(inputs, where)
    contract = PolicyContract(inputs=inputs, outputs=outputs, state=MappingProxyType(state))

    batch_axis = _batch_axis(doc.get("batch"), contract, where)
    contract = replace(contract, batch_axis=batch_axis)
    chunk = _chunk(doc["chunk"], contract, where) if "chunk" in doc else _find_chunk(contract)
    observations = _observations(doc.get("observations", {}), contract, where)
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError(f'{where}: "metadata" must be a JSON object, got {json_kind(metadata)}')
    _check_rtc(replace(contract, chunk=chunk), where)
    return replace(
        contract,
        chunk=chunk,
        observations=MappingProxyType(observations),
        metadata=MappingProxyType(metadata),
    )


def _cpu_session(model_path: Path) -> onnxruntime.InferenceSession:
    import onnxruntime  # (here: a front process imports this module, never reads a model)

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(
        str(model_path), options, providers=["CPUExecutionProvider"]
    )


def _spec(arg: Any) -> TensorSpec:
    dtype = _DTYPES.get(arg.type)
    if dtype is None:
        raise ValueError(f"tensor {arg.name!r} has type {arg.type}, which a policy cannot use")
    return TensorSpec(name=arg.name, shape=tuple(arg.shape), dtype=dtype)


# --- the sidecar ---------------------------------------------------------------------------


def _read_sidecar(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    known = ", ".join(SIDECAR_KEYS)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: must be a JSON object with keys among {known}")
    for key in doc:
        if key not in SIDECAR_KEYS:
            raise ValueError(f"{path}: unknown key {key!r}; known keys: {known}")
    return doc


def _string_map(value: object, where: str, key: str, what: str) -> dict[str, str]:
    if not (
        isinstance(value, dict)
        and all(isinstance(k, str) and k and isinstance(v, str) for k, v in value.items())
    ):
        raise ValueError(f'{where}: "{key}" must map {what} name')
    return dict(value)


def _check_control(inputs: Sequence[TensorSpec], where: str) -> None:
    for spec in inputs:
        if not spec.name.startswith(CONTROL_PREFIX):
            continue
        if spec.name not in CONTROL_INPUTS:
            raise ValueError(
                f"{where}: input {spec.name!r}: the control inputs the node fills are "
                f"{', '.join(CONTROL_INPUTS)}"
            )
        if spec.name == "control.corrid":
            if spec.dtype not in ("uint64", "int64", "object"):
                raise ValueError(
                    f"{where}: control.corrid is {spec.dtype}; it must be uint64, int64 or string"
                )
        elif spec.dtype == "object":
            raise ValueError(f"{where}: {spec.name} is a string tensor; it must be numeric")
        sizes = [d for d in spec.shape[1:] if isinstance(d, int)]
        if any(d != 1 for d in sizes):
            raise ValueError(f"{where}: {spec.name} is {spec.describe()}: one value per row")


def _check_rtc(contract: PolicyContract, where: str) -> None:
    specs = {spec.name: spec for spec in contract.rtc_inputs}
    if not specs:
        return
    if set(specs) != set(RTC_INPUTS):
        raise ValueError(
            f"{where}: inputs {', '.join(sorted(specs))}: a real-time-chunking model takes "
            f"all of {', '.join(RTC_INPUTS)} and no other rtc.* input"
        )
    shape = contract.chunk_shape
    if shape is None:
        raise ValueError(
            f'{where}: {RTC_PREFIX} needs an action-chunk output (the sidecar\'s "chunk")'
        )
    prefix = specs[RTC_PREFIX]
    if tuple(prefix.shape[-2:]) != shape or len(prefix.shape) != (3 if contract.batch_axis else 2):
        raise ValueError(
            f"{where}: {RTC_PREFIX} is {prefix.describe()}; it must have the chunk's shape "
            f"{list(shape)} (with the batch axis first, if any)"
        )
    if np.dtype(prefix.dtype).kind != "f":
        raise ValueError(f"{where}: {RTC_PREFIX} is {prefix.dtype}; it must be a float")
    for name in (RTC_PREFIX_LEN, RTC_DELAY):
        spec = specs[name]
        sizes = [d for d in spec.shape[1 if contract.batch_axis else 0 :] if isinstance(d, int)]
        if np.dtype(spec.dtype).kind not in "iu" or any(d != 1 for d in sizes):
            raise ValueError(
                f"{where}: {name} is {spec.describe()}; it must be an integer, one value per row"
            )


def _by_convention(inputs: Sequence[TensorSpec]) -> dict[str, str]:
    return {
        spec.name: STATE_OUT_PREFIX + spec.name.removeprefix(STATE_IN_PREFIX)
        for spec in inputs
        if spec.name.startswith(STATE_IN_PREFIX)
    }


def _check_state(
    state: Mapping[str, str],
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    where: str,
) -> None:
    by_input = {spec.name: spec for spec in inputs}
    by_output = {spec.name: spec for spec in outputs}
    for name, output_name in state.items():
        source = by_input.get(name)
        if source is None:
            raise ValueError(f"{where}: state input {name!r} is not a model input")
        fed = by_output.get(output_name)
        if fed is None:
            raise ValueError(
                f"{where}: state input {name!r} is fed from {output_name!r}, "
                "which is not a model output"
            )
        compatible = len(source.shape) == len(fed.shape) and all(
            a == b or not (isinstance(a, int) and isinstance(b, int))
            for a, b in zip(source.shape, fed.shape, strict=True)
        )
        if source.dtype != fed.dtype or not compatible:
            raise ValueError(
                f"{where}: state input {name!r} is {source.describe()} but output "
                f"{output_name!r} fed into it is {fed.describe()}"
            )


def _batch_axis(declared: object, contract: PolicyContract, where: str) -> bool:
    """The sidecar's ``batch`` checked against the model, or the default when None."""
    if declared is not None and not isinstance(declared, bool):
        raise ValueError(f'{where}: "batch" must be true or false, got {json_kind(declared)}')
    if declared is False:
        return False
    for spec in (*contract.inputs, *contract.outputs):
        first = spec.shape[0] if spec.shape else 0
        if isinstance(first, int) and first != 1:
            if declared is None:
                return False
            raise ValueError(
                f'{where}: "batch" is true but {spec.name} is {spec.describe()}; '
                "a batch axis is dimension 0 of every input and output, symbolic or 1"
            )
    return True


def _is_chunk(contract: PolicyContract, spec: TensorSpec) -> bool:
    rank = 3 if contract.batch_axis else 2
    return (
        len(spec.shape) == rank
        and all(isinstance(d, int) and d >= 1 for d in spec.shape[-2:])
        and np.dtype(spec.dtype).kind == "f"
    )


def _find_chunk(contract: PolicyContract) -> str | None:
    found = [s.name for s in contract.returned_outputs if _is_chunk(contract, s)]
    return found[0] if len(found) == 1 else None


def _chunk(declared: object, contract: PolicyContract, where: str) -> str | None:
    if declared is None:
        return None
    returned = {spec.name: spec for spec in contract.returned_outputs}
    if not isinstance(declared, str) or declared not in returned:
        shown = repr(declared) if isinstance(declared, str) else json_kind(declared)
        raise ValueError(
            f'{where}: "chunk" is {shown}, not an output returned to clients '
            f"({', '.join(returned) or 'none'})"
        )
    spec = returned[declared]
    if not _is_chunk(contract, spec):
        shape = "[batch, H, D]" if contract.batch_axis else "[H, D]"
        raise ValueError(
            f'{where}: "chunk" {declared!r} is {spec.describe()}; an action chunk is a float '
            f"{shape} with fixed H and D"
        )
    return declared


def _observations(value: object, contract: PolicyContract, where: str) -> dict[str, str]:
    entries = _string_map(value, where, "observations", "each observation key to an input")
    inputs = {spec.name for spec in contract.observation_inputs}
    seen: dict[str, str] = {}
    for key, name in entries.items():
        if name not in inputs:
            raise ValueError(
                f'{where}: "observations" maps {key!r} to {name!r}, which is not an '
                f"observation input ({', '.join(sorted(inputs)) or 'none'})"
            )
        if name in seen:
            raise ValueError(
                f'{where}: "observations" maps both {seen[name]!r} and {key!r} to {name!r}'
            )
        seen[name] = key
    for key, name in entries.items():
        if key in inputs and key not in seen:
            raise ValueError(
                f'{where}: "observations" maps {key!r} to {name!r}, but {key!r} is also the '
                f"name of input {key!r}, which no key maps to; map it explicitly"
            )
    return entries


@functools.lru_cache(maxsize=4096)
def _one_row(spec: TensorSpec) -> TensorSpec:
    """``spec`` with a batch axis of 1 (made once per spec: each step asks)."""
    return replace(spec, shape=(1, *spec.shape[1:]))


def json_kind(value: object) -> str:
    """The JSON kind of ``value``, for messages (never the value: it may be huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
