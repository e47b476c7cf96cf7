"""Policy I/O: the model's tensor contract, client input validation, and a reference rollout.

A policy is an ONNX model. Its inputs are of two kinds:

* observation inputs, which the client sends with every ``/act`` call;
* state inputs, which the server keeps per episode: each is fed, on the next step, from one
  output of the previous step, and starts as zeros.

Which input is state, and which output feeds it, comes from a sidecar file next to the model,
named ``<model stem>.affinity.json`` (``demo_policy.onnx`` -> ``demo_policy.affinity.json``)::

    {"state": {"state_in.hidden": "state_out.hidden"}}

mapping each state input to the output fed back into it (``{"state": {}}`` declares a
stateless model). Without a sidecar a naming convention applies: every input named
``state_in.X`` is state, fed from the output ``state_out.X``. Either way each state input and
its output must exist with the same dtype and compatible shapes, or loading fails.

Shapes are ONNX Runtime's: a dimension is an ``int``, a symbolic name (``str``) or ``None``
(unknown); the last two accept any size >= 1 from a client and are 1 in initial state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime

Array = npt.NDArray[Any]
Dim = int | str | None

DEMO_MODEL: Path = Path(__file__).parent / "models" / "demo_policy.onnx"
"""The packaged demo policy (see ``node/models/build_demo.py``)."""

STATE_IN_PREFIX = "state_in."
STATE_OUT_PREFIX = "state_out."

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
        return np.zeros(tuple(d if isinstance(d, int) else 1 for d in self.shape), self.dtype)

    def describe(self) -> str:
        """E.g. ``float32 [1, 8]``, for error messages."""
        dims = ", ".join("?" if dim is None else str(dim) for dim in self.shape)
        return f"{self.dtype} [{dims}]"


@dataclass(frozen=True)
class PolicyContract:
    """What a policy takes and returns, and which outputs feed which inputs back."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    state: Mapping[str, str]
    """State input name -> name of the output fed back into it on the next step."""

    @property
    def observation_inputs(self) -> tuple[TensorSpec, ...]:
        """The inputs the client sends: every input that is not state."""
        return tuple(spec for spec in self.inputs if spec.name not in self.state)

    @property
    def returned_outputs(self) -> tuple[TensorSpec, ...]:
        """The outputs a client gets back: every output not fed back as state."""
        fed_back = set(self.state.values())
        return tuple(spec for spec in self.outputs if spec.name not in fed_back)

    def to_json(self) -> dict[str, Any]:
        """The contract as served by ``GET /model``.

        ``inputs``: the observation inputs a client sends in ``/act``; ``outputs``: the
        outputs it gets back; ``state``: state input -> output fed back into it (kept by the
        server, never sent nor returned).
        """
        return {
            "inputs": [spec.to_json() for spec in self.observation_inputs],
            "outputs": [spec.to_json() for spec in self.returned_outputs],
            "state": dict(self.state),
        }

    def initial_state(self) -> dict[str, Array]:
        """Zeros for each state input (see :meth:`TensorSpec.zeros`). Fresh arrays each call."""
        return {spec.name: spec.zeros() for spec in self.inputs if spec.name in self.state}


class InvalidInput(ValueError):
    """A client's ``inputs`` are unusable; ``field`` names the input ("" for the whole object)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        shown = field if len(field) <= 64 else field[:64] + "..."
        super().__init__(f"inputs.{shown}: {problem}" if field else f"inputs: {problem}")


def sidecar_path(model_path: Path) -> Path:
    """The sidecar of ``model_path``: ``<stem>.affinity.json`` in the same directory."""
    return model_path.with_name(f"{model_path.stem}.affinity.json")


def load_contract(model_path: Path) -> PolicyContract:
    """Read the tensor contract of the model at ``model_path``, with its state mapping.

    Names, shapes and dtypes come from ONNX Runtime (CPU provider); the state mapping from the
    sidecar or, without one, the naming convention (see module doc). Raises ``ValueError``
    naming the problem when the sidecar is malformed, a tensor has a type a policy cannot use,
    or a state input or its output is missing or does not match in dtype or shape.
    """
    session = _cpu_session(model_path)
    inputs = tuple(_spec(arg) for arg in session.get_inputs())
    outputs = tuple(_spec(arg) for arg in session.get_outputs())
    sidecar = sidecar_path(model_path)
    if sidecar.exists():
        state, where = _read_sidecar(sidecar), str(sidecar)
    else:
        state, where = _by_convention(inputs), f"{model_path} (naming convention)"
    _check_state(state, inputs, outputs, where)
    return PolicyContract(inputs=inputs, outputs=outputs, state=MappingProxyType(state))


def parse_inputs(contract: PolicyContract, raw: object) -> dict[str, Array]:
    """Validate a client's decoded ``inputs`` JSON and return one array per observation input.

    ``raw`` must be an object holding every observation input and nothing else (no unknown
    names, no state inputs); each value a nested list of exactly the declared shape (symbolic
    dimensions: any size >= 1, the same for every sibling), of numbers castable to the declared
    dtype: finite and in range for floats, integral and in range for ints, ``true``/``false``
    for bool (booleans are not numbers). Raises :class:`InvalidInput`, and nothing else, for any
    JSON value.
    """
    if not isinstance(raw, dict):
        raise InvalidInput("", f"must be an object of input name -> array, got {_kind(raw)}")
    expected = {spec.name: spec for spec in contract.observation_inputs}
    for key in raw:
        name = str(key)
        if name in contract.state:
            raise InvalidInput(name, "is recurrent state kept by the server; do not send it")
        if not isinstance(key, str) or key not in expected:
            raise InvalidInput(name, f"unknown input; expected: {', '.join(expected) or 'none'}")
    for spec in expected.values():
        if spec.name not in raw:
            raise InvalidInput(spec.name, f"missing; expected {spec.describe()}")
    return {spec.name: _parse_array(spec, raw[spec.name]) for spec in expected.values()}


def reference_rollout(model_path: Path, observations: Sequence[Array]) -> list[dict[str, Array]]:
    """Run the model on the CPU over ``observations``, feeding state back; one dict per step.

    The model must have exactly one observation input; ``observations[t]`` is its value at step
    ``t`` (cast to its dtype). State starts from :meth:`PolicyContract.initial_state`. Each
    dict maps every output name to its array. This is what a served episode must reproduce.
    """
    contract = load_contract(model_path)
    if len(contract.observation_inputs) != 1:
        names = [spec.name for spec in contract.observation_inputs]
        raise ValueError(f"{model_path}: needs exactly one observation input, has {names}")
    observed = contract.observation_inputs[0]
    session = _cpu_session(model_path)
    names = [spec.name for spec in contract.outputs]
    state = contract.initial_state()
    steps: list[dict[str, Array]] = []
    for observation in observations:
        feeds = {observed.name: np.asarray(observation, dtype=observed.dtype), **state}
        outputs = dict(zip(names, session.run(names, feeds), strict=True))
        steps.append(outputs)
        state = {name: outputs[output] for name, output in contract.state.items()}
    return steps


def _cpu_session(model_path: Path) -> onnxruntime.InferenceSession:
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


def _read_sidecar(path: Path) -> dict[str, str]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or set(doc) != {"state"}:
        raise ValueError(f'{path}: must be an object with exactly one key, "state"')
    state = doc["state"]
    if not isinstance(state, dict) or not all(isinstance(v, str) for v in state.values()):
        raise ValueError(f'{path}: "state" must map each state input name to an output name')
    return dict(state)


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


def _parse_array(spec: TensorSpec, value: object) -> Array:
    sizes: list[int | None] = [None] * len(spec.shape)
    leaves: list[object] = []
    _collect(spec, value, (), sizes, leaves)
    # A dimension left unseen lies below a declared 0: the array is empty whatever its size.
    shape = tuple(0 if size is None else size for size in sizes)
    dtype = np.dtype(spec.dtype)
    if dtype == np.bool_:
        for at, leaf in enumerate(leaves):
            if not isinstance(leaf, bool):
                raise InvalidInput(spec.name, f"{_where(shape, at)} must be true or false")
        return np.array(leaves, dtype=dtype).reshape(shape)
    numbers: list[int | float] = []
    for at, leaf in enumerate(leaves):
        if isinstance(leaf, bool) or not isinstance(leaf, int | float):
            raise InvalidInput(
                spec.name, f"{_where(shape, at)} must be a number, got {_kind(leaf)}"
            )
        if isinstance(leaf, float) and not math.isfinite(leaf):
            raise InvalidInput(spec.name, f"{_where(shape, at)} is {leaf}; must be finite")
        numbers.append(leaf)
    if dtype.kind == "f":
        limit = float(np.finfo(dtype).max)
        for at, number in enumerate(numbers):
            if abs(number) > limit:
                raise InvalidInput(spec.name, f"{_where(shape, at)} is out of range for {dtype}")
        return np.array(numbers, dtype=np.float64).astype(dtype).reshape(shape)
    info = np.iinfo(dtype)
    for at, number in enumerate(numbers):
        if isinstance(number, float) and not number.is_integer():
            raise InvalidInput(spec.name, f"{_where(shape, at)} must be an integer for {dtype}")
        if not info.min <= number <= info.max:
            raise InvalidInput(spec.name, f"{_where(shape, at)} is out of range for {dtype}")
    return np.array([int(number) for number in numbers], dtype=dtype).reshape(shape)


def _collect(
    spec: TensorSpec,
    value: object,
    path: tuple[int, ...],
    sizes: list[int | None],
    leaves: list[object],
) -> None:
    """Append the leaves of ``value`` to ``leaves``, checking it has ``spec``'s shape.

    Recursion stops at the declared rank, so its depth is bounded by the model, not the client.
    """
    depth = len(path)
    if depth == len(spec.shape):
        leaves.append(value)
        return
    where = "".join(f"[{i}]" for i in path) or "value"
    if not isinstance(value, list):
        raise InvalidInput(
            spec.name,
            f"{where} must be a list (expected {spec.describe()}), got {_kind(value)}",
        )
    declared = spec.shape[depth]
    if isinstance(declared, int) and len(value) != declared:
        raise InvalidInput(
            spec.name,
            f"{where} has {len(value)} elements, dimension {depth} of "
            f"{spec.describe()} needs {declared}",
        )
    if not value and not isinstance(declared, int):
        raise InvalidInput(spec.name, f"{where} is empty; dimension {depth} needs at least 1")
    seen = sizes[depth]
    if seen is not None and seen != len(value):
        raise InvalidInput(
            spec.name, f"{where} has {len(value)} elements but its siblings have {seen} (ragged)"
        )
    sizes[depth] = len(value)
    for index, item in enumerate(value):
        _collect(spec, item, (*path, index), sizes, leaves)


def _where(shape: tuple[int, ...], flat_index: int) -> str:
    if not shape:
        return "value"
    return "".join(f"[{int(i)}]" for i in np.unravel_index(flat_index, shape))


def _kind(value: object) -> str:
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
