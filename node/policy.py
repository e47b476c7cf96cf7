"""Policy I/O: the model's tensor contract, client input validation, and a reference rollout.

A policy is an ONNX model. Its inputs are of two kinds:

* observation inputs, which the client sends with every step;
* state inputs, which the server keeps per episode: each is fed, on the next step, from one
  output of the previous step, and starts as zeros;
* control inputs, Triton's sequence-batcher controls, named ``control.start``,
  ``control.end``, ``control.ready`` and ``control.corrid``: filled by the node on every
  step (``node/control.py``), hidden from clients like state. Any other ``control.*`` name
  is refused at load.

**The sidecar.** A JSON object next to the model, named ``<model stem>.affinity.json``
(``demo_policy.onnx`` -> ``demo_policy.affinity.json``); every key is optional, no other key
is allowed, and a model without a sidecar gets every default::

    {
      "state": {"state_in.hidden": "state_out.hidden"},
      "chunk": "actions",
      "batch": true,
      "observations": {"observation/image": "image"},
      "metadata": {"reset_pose": [0, 0, 0]}
    }

* ``state``: each state input -> the output fed back into it (``{}`` declares a stateless
  model). Default, the naming convention: every input named ``state_in.X`` is state, fed from
  the output ``state_out.X``. Either way each state input and its output must exist with the
  same dtype and compatible shapes.
* ``chunk``: the output that is an action chunk (``[batch, H, D]``, or ``[H, D]`` without a
  batch axis; fixed ``H`` and ``D``, a float dtype), or ``null`` for none. Default: the one
  returned output of that shape, if exactly one has it.
* ``batch``: whether the first dimension of every input and output is the batch axis. It must
  then be symbolic, unknown or 1 on every tensor. Default: true exactly when that holds. A
  client always sends one sample per step, so the batch axis takes size 1 from clients (a
  client sending 3 samples gets :class:`InvalidInput`); the server stacks the steps of several
  episodes along it when every first dimension is dynamic (:attr:`PolicyContract.batchable`).
* ``observations``: openpi observation key -> observation input, for clients that send
  observations under their own names (``"observation/image"``); an input no key maps to is
  looked up under its own name.
* ``metadata``: any JSON object, handed to openpi clients when they connect.

**Shapes** are ONNX Runtime's: a dimension is an ``int``, a symbolic name (``str``) or
``None`` (unknown). A symbolic or unknown dimension other than the batch axis accepts any size
>= 1 from a client; every one is 1 in the initial state.

**Dtypes.** Binary arrays (msgpack ``/act``, openpi, KServe) are converted to the model's
dtype by one rule (:func:`inputs_from_arrays`, :func:`inputs_from_observation`): the same
dtype passes as is; a float input takes floats and integers (``float64`` state -> ``float32``),
finite and within the input's range; an integer input takes integers within its range (a
``uint8`` image stays ``uint8``; ``int64`` values 0-255 become ``uint8``) and never floats,
since a float image's scale (0-1 or 0-255) is not known; a bool input takes bools only, and
bools are not numbers. Anything else is :class:`InvalidInput`.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt
import onnxruntime

Array = npt.NDArray[Any]
Dim = int | str | None

MODELS_DIR = Path(__file__).parent / "models"
DEMO_MODEL: Path = MODELS_DIR / "demo_policy.onnx"
"""The packaged demo policy (see ``node/models/build_demo.py``)."""
VLA_DEMO_MODEL: Path = MODELS_DIR / "vla_demo.onnx"
"""The packaged camera-sized demo policy (see ``node/models/build_vla.py``)."""
DROID_DEMO_MODEL: Path = MODELS_DIR / "droid_demo.onnx"
"""The camera-sized demo policy for openpi's DROID observations (``build_vla.py``)."""
ALOHA_DEMO_MODEL: Path = MODELS_DIR / "aloha_demo.onnx"
"""The camera-sized demo policy for openpi's ALOHA observations (``build_vla.py``)."""
RTC_DEMO_MODEL: Path = MODELS_DIR / "rtc_demo.onnx"
"""The camera-sized demo policy with real-time chunking's inputs (``build_rtc.py``)."""
PACKAGED_MODELS: Mapping[str, Path] = MappingProxyType(
    {
        "demo": DEMO_MODEL,
        "vla-demo": VLA_DEMO_MODEL,
        "droid-demo": DROID_DEMO_MODEL,
        "aloha-demo": ALOHA_DEMO_MODEL,
        "rtc-demo": RTC_DEMO_MODEL,
    }
)
"""The names :func:`resolve_model` accepts besides a path."""

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
MAX_OBSERVATION_DEPTH = 8
"""How deeply an openpi observation's maps may nest."""
_OBS = "observation"  # the root of openpi observations in InvalidInput messages

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


@dataclass(frozen=True)
class PolicyContract:
    """What a policy takes and returns, which outputs feed which inputs back, and the
    sidecar's other declarations (see the module doc)."""

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

        ``inputs``: the observation inputs a client sends in ``/act``, ``outputs``: the
        outputs it gets back, both in the shape of one step (the batch axis as 1);
        ``state``: state input -> output fed back into it (kept by the server, never sent nor
        returned); ``batch_axis``: dimension 0 is the batch axis (openpi observations leave
        it out); ``chunk``: the action-chunk output or null; ``observations``: openpi
        observation key -> input; ``metadata``: the sidecar's map for openpi clients.
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

    def initial_state(self) -> dict[str, Array]:
        """Zeros for each state input (see :meth:`TensorSpec.zeros`). Fresh arrays each call."""
        return {spec.name: spec.zeros() for spec in self.inputs if spec.name in self.state}


class InvalidInput(ValueError):
    """A client's inputs are unusable; ``field`` names the input or observation key ("" for
    the whole object), ``problem`` says what is wrong; ``str()`` is ``<root>.<field>:
    <problem>``, ``root`` being ``inputs`` (``/act``, KServe) or ``observation`` (openpi)."""

    def __init__(self, field: str, problem: str, *, root: str = "inputs") -> None:
        self.field = field
        self.problem = problem
        shown = field if len(field) <= 64 else field[:64] + "..."
        super().__init__(f"{root}.{shown}: {problem}" if field else f"{root}: {problem}")


class ObservationInputs(NamedTuple):
    """What :func:`inputs_from_observation` made of one openpi observation."""

    inputs: dict[str, Array]
    """One array per observation input, in the model's shape (batch axis of size 1)."""
    ignored: tuple[str, ...]
    """The flattened observation keys the model does not take, sorted (e.g. ``prompt``)."""


def resolve_model(name_or_path: str | Path) -> Path:
    """The model file that ``--model`` names: a packaged name (``demo``, ``vla-demo``; see
    :data:`PACKAGED_MODELS`) or a path to an existing file (``./demo`` for a file of that
    name). Raises ``ValueError`` naming both choices when it is neither."""
    packaged = PACKAGED_MODELS.get(str(name_or_path))
    if packaged is not None:
        return packaged
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(
            f"model {str(name_or_path)!r}: not a packaged model "
            f"({', '.join(PACKAGED_MODELS)}) nor an existing file"
        )
    return path


def sidecar_path(model_path: Path) -> Path:
    """The sidecar of ``model_path``: ``<stem>.affinity.json`` in the same directory."""
    return model_path.with_name(f"{model_path.stem}.affinity.json")


def load_contract(model_path: Path) -> PolicyContract:
    """Read the tensor contract of the model at ``model_path`` with its sidecar's declarations.

    Names, shapes and dtypes come from ONNX Runtime (CPU provider); the rest from the sidecar,
    or defaults (see module doc). Raises ``ValueError`` naming the file, the sidecar key and
    the problem when the sidecar is malformed or contradicts the model, or a tensor has a type
    a policy cannot use.
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
        raise ValueError(f'{where}: "metadata" must be a JSON object, got {_kind(metadata)}')
    _check_rtc(replace(contract, chunk=chunk), where)
    return replace(
        contract,
        chunk=chunk,
        observations=MappingProxyType(observations),
        metadata=MappingProxyType(metadata),
    )


def parse_inputs(contract: PolicyContract, raw: object) -> dict[str, Array]:
    """Validate a client's decoded ``inputs`` JSON and return one array per observation input.

    ``raw`` must be an object holding every observation input and nothing else (no unknown
    names, no state inputs); each value a nested list of exactly the declared shape (the batch
    axis: exactly 1; other symbolic dimensions: any size >= 1, the same for every sibling), of
    numbers castable to the declared dtype: finite and in range for floats, integral and in
    range for ints, ``true``/``false`` for bool (booleans are not numbers). Raises
    :class:`InvalidInput`, and nothing else, for any JSON value.
    """
    return {
        spec.name: _parse_array(contract.step_spec(spec), value, contract.batch_axis)
        for spec, value in _named_inputs(contract, raw)
    }


def inputs_from_arrays(contract: PolicyContract, arrays: object) -> dict[str, Array]:
    """Validate decoded binary inputs (msgpack ``/act``, KServe) named by model input.

    ``arrays`` must be a map holding every observation input and nothing else (as
    :func:`parse_inputs`), each value a numpy array (or numpy scalar) of exactly the model's
    shape for one step (batch axis of size 1, other symbolic dimensions any size >= 1), of a
    dtype the module doc's rule converts to the model's; a nested list of numbers is parsed
    as in :func:`parse_inputs`. Returns C-contiguous arrays of the model's dtypes (the given
    array itself when nothing needed converting). Raises :class:`InvalidInput`, and nothing
    else, for any value; allocates nothing beyond the arrays' own sizes.
    """
    return {
        spec.name: _to_input(contract.step_spec(spec), value, contract.batch_axis)
        for spec, value in _named_inputs(contract, arrays)
    }


def inputs_from_observation(contract: PolicyContract, observation: object) -> ObservationInputs:
    """Turn one openpi observation into the model's inputs, as openpi clients send it.

    ``observation`` is a map, possibly nested (``{"state": .., "images": {"cam_high": ..},
    "prompt": ".."}``); nested keys flatten with ``/`` (``images/cam_high``), up to
    :data:`MAX_OBSERVATION_DEPTH` levels. Each key of :attr:`PolicyContract.observation_map`
    must be present, holding the input's value *unbatched*: the model's shape without the
    batch axis (``float64[8]`` for a ``float32 [batch, 8]`` input), converted by the module
    doc's dtype rule; the batch axis (size 1) is added here. Without a batch axis the value
    has the model's whole shape. Keys the model does not take are returned in ``ignored``,
    never touched. Raises :class:`InvalidInput` (root ``observation``, ``field`` the
    observation key; ``""`` when several are missing, every one named), and nothing else,
    for a missing key, a wrong shape or dtype, a key
    given twice (nested and flat), or a non-map observation.
    """
    flat = _flatten(observation)
    by_name = {spec.name: spec for spec in contract.observation_inputs}
    missing = {
        key: _unbatched(contract, by_name[name]).describe()
        for key, name in contract.observation_map.items()
        if key not in flat
    }
    if len(missing) == 1:
        [(key, expected)] = missing.items()
        raise InvalidInput(key, f"missing; expected {expected}", root=_OBS)
    if missing:
        listed = ", ".join(f"{key} ({expected})" for key, expected in missing.items())
        raise InvalidInput("", f"missing {len(missing)} keys: {listed}", root=_OBS)
    inputs: dict[str, Array] = {}
    for key, name in contract.observation_map.items():
        spec = by_name[name]
        value = _to_input(_unbatched(contract, spec), flat[key], False, key=key, root=_OBS)
        inputs[name] = value[np.newaxis] if contract.batch_axis else value
    ignored = tuple(sorted(key for key in flat if key not in contract.observation_map))
    return ObservationInputs(inputs, ignored)


def outputs_unbatched(contract: PolicyContract, outputs: Mapping[str, Array]) -> dict[str, Array]:
    """``outputs`` of one step with the batch axis removed (``actions`` ``[1, H, D]`` ->
    ``[H, D]``), as openpi clients expect them; unchanged without a batch axis. Raises
    ``ValueError`` when an array's first dimension is not 1 (a server bug, not a client's)."""
    if not contract.batch_axis:
        return dict(outputs)
    unbatched: dict[str, Array] = {}
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != 1:
            raise ValueError(f"output {name!r} has shape {list(array.shape)}; expected [1, ...]")
        unbatched[name] = array[0]
    return unbatched


def reference_rollout(
    model_path: Path, observations: Sequence[Array | Mapping[str, Array]]
) -> list[dict[str, Array]]:
    """Run the model on the CPU over ``observations``, feeding state back; one dict per step.

    ``observations[t]`` holds the observation inputs at step ``t`` by name, in the model's
    shape (cast to its dtypes), or is the value of the only observation input of a model that
    has one. State starts from :meth:`PolicyContract.initial_state`. Each dict maps every
    output name to its array. This is what a served episode must reproduce.
    """
    contract = load_contract(model_path)
    observed = {spec.name: spec.dtype for spec in contract.observation_inputs}
    session = _cpu_session(model_path)
    names = [spec.name for spec in contract.outputs]
    state = contract.initial_state()
    steps: list[dict[str, Array]] = []
    for observation in observations:
        if not isinstance(observation, Mapping):
            if len(observed) != 1:
                raise ValueError(
                    f"{model_path}: takes {list(observed)}; give each step as a map of them"
                )
            observation = {next(iter(observed)): observation}
        if set(observation) != set(observed):
            raise ValueError(f"{model_path}: takes {list(observed)}, got {list(observation)}")
        feeds = {name: np.asarray(observation[name], dtype=dt) for name, dt in observed.items()}
        outputs = dict(zip(names, session.run(names, {**feeds, **state}), strict=True))
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
        raise ValueError(f'{where}: "batch" must be true or false, got {_kind(declared)}')
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
        shown = repr(declared) if isinstance(declared, str) else _kind(declared)
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


# --- client values -------------------------------------------------------------------------


def _named_inputs(contract: PolicyContract, raw: object) -> list[tuple[TensorSpec, object]]:
    """Each observation input with its value in ``raw``, once ``raw`` names exactly them."""
    if not isinstance(raw, dict):
        raise InvalidInput("", f"must be an object of input name -> array, got {_kind(raw)}")
    expected = contract.observation_specs
    for key in raw:
        name = str(key)
        if name in contract.state:
            raise InvalidInput(name, "is recurrent state kept by the server; do not send it")
        if not isinstance(key, str) or key not in expected:
            raise InvalidInput(name, f"unknown input; expected: {', '.join(expected) or 'none'}")
    for spec in expected.values():
        if spec.name not in raw:
            raise InvalidInput(
                spec.name, f"missing; expected {contract.step_spec(spec).describe()}"
            )
    return [(spec, raw[spec.name]) for spec in expected.values()]


def _unbatched(contract: PolicyContract, spec: TensorSpec) -> TensorSpec:
    return replace(spec, shape=spec.shape[1:]) if contract.batch_axis else spec


def _flatten(observation: object) -> dict[str, object]:
    if not isinstance(observation, dict):
        raise InvalidInput(
            "", f"must be a map of key -> value, got {_kind(observation)}", root=_OBS
        )
    flat: dict[str, object] = {}

    def walk(node: dict[Any, Any], prefix: str, depth: int) -> None:
        for key, value in node.items():
            if not isinstance(key, str):
                raise InvalidInput(prefix + repr(key)[:64], "keys must be strings", root=_OBS)
            name = prefix + key
            if isinstance(value, dict):
                if depth == MAX_OBSERVATION_DEPTH:
                    raise InvalidInput(
                        name, f"nested deeper than {MAX_OBSERVATION_DEPTH} maps", root=_OBS
                    )
                walk(value, name + "/", depth + 1)
            elif name in flat:
                raise InvalidInput(name, "given twice (nested and flat)", root=_OBS)
            else:
                flat[name] = value

    walk(observation, "", 1)
    return flat


def _to_input(
    spec: TensorSpec, value: object, batch: bool, *, key: str | None = None, root: str = "inputs"
) -> Array:
    """``value`` (numpy array or scalar, or nested lists) as an array of ``spec``.

    ``spec`` has the shape the value must have (batch axis already 1 when ``batch``);
    ``key`` names the value in messages (default the spec's name).
    """
    field_name = spec.name if key is None else key
    if not isinstance(value, np.ndarray | np.generic):
        try:
            return _parse_array(spec, value, batch)
        except InvalidInput as exc:
            raise InvalidInput(field_name, exc.problem, root=root) from None
    array = np.asarray(value)
    problem = _shape_problem(spec, array.shape, batch) or _dtype_problem(spec, array)
    if problem:
        raise InvalidInput(field_name, problem, root=root)
    return np.ascontiguousarray(array, dtype=spec.dtype)


def _shape_problem(spec: TensorSpec, shape: tuple[int, ...], batch: bool) -> str | None:
    got = f"has shape {list(shape)}; expected {spec.describe()}"
    if len(shape) != len(spec.shape):
        return got
    for axis, (size, declared) in enumerate(zip(shape, spec.shape, strict=True)):
        if axis == 0 and batch and size != 1:
            return f"{got}: dimension 0 is the batch axis, send exactly one sample per step"
        if isinstance(declared, int) and size != declared:
            return got
        if not isinstance(declared, int) and size < 1:
            return f"{got}: dimension {axis} needs at least 1"
    return None


def _dtype_problem(spec: TensorSpec, array: Array) -> str | None:
    source, target = array.dtype, np.dtype(spec.dtype)
    if target.kind == "O":  # a string input: str values (numpy str or object arrays of str)
        if source.kind == "U" or (
            source.kind == "O" and all(isinstance(v, str) for v in array.reshape(-1))
        ):
            return None
        return f"is {source}; {spec.name} takes strings only"
    if target.kind == "b":
        return None if source.kind == "b" else f"is {source}; {spec.name} takes bool only"
    if source.kind not in ("iu" if target.kind in "iu" else "iuf"):
        why = " (send 0-255 integers, not floats)" if source.kind == "f" else ""
        return f"is {source}; {spec.name} takes {target.name}{why}"
    if source.kind == "f":
        finite = np.isfinite(array).reshape(-1)
        if not finite.all():
            at = int(np.argmin(finite))
            return f"{_where(array.shape, at)} is {array.reshape(-1)[at]}; must be finite"
    if array.size == 0 or source == target:
        return None
    low, high = array.min(), array.max()
    if target.kind == "f":
        limit = float(np.finfo(target).max)
        if float(low) < -limit or float(high) > limit:
            return f"is {source} with values beyond the range of {target.name}"
    else:
        info = np.iinfo(target)
        if int(low) < info.min or int(high) > info.max:
            return f"is {source} with values outside {info.min}..{info.max} ({target.name})"
    return None


@functools.lru_cache(maxsize=4096)
def _one_row(spec: TensorSpec) -> TensorSpec:
    """``spec`` with a batch axis of 1 (made once per spec: each step asks)."""
    return replace(spec, shape=(1, *spec.shape[1:]))


def _parse_array(spec: TensorSpec, value: object, batch: bool) -> Array:
    sizes: list[int | None] = [None] * len(spec.shape)
    leaves: list[object] = []
    _collect(spec, value, (), sizes, leaves, batch)
    # A dimension left unseen lies below a declared 0: the array is empty whatever its size.
    shape = tuple(0 if size is None else size for size in sizes)
    dtype = np.dtype(spec.dtype)
    if dtype.kind == "O":  # a string input
        for at, leaf in enumerate(leaves):
            if not isinstance(leaf, str):
                raise InvalidInput(spec.name, f"{_where(shape, at)} must be a string")
        strings = np.empty(len(leaves), dtype=object)
        strings[:] = leaves
        return strings.reshape(shape)
    fast = _vectorised(leaves, dtype, shape)
    if fast is not None:
        return fast
    # something is wrong: the element-by-element checks below name the first bad one
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


_SMALL = 64
"""Up to this many numbers, :func:`_vectorised` checks them in Python (faster there)."""
_FLOAT_MAX = {np.dtype(n): float(np.finfo(n).max) for n in (np.float16, np.float32, np.float64)}
_BOOLS, _INTS, _NUMBERS = frozenset({bool}), frozenset({int}), frozenset({int, float})


def _vectorised(leaves: list[object], dtype: np.dtype[Any], shape: tuple[int, ...]) -> Array | None:
    """The array of ``leaves`` when every one is valid for ``dtype``, checked with one pass
    over their types and numpy's reductions (a camera image is 150,000 numbers); ``None``
    when any is not, for the element-by-element checks to say which."""
    kinds = set(map(type, leaves))
    if dtype.kind == "b":
        return np.array(leaves, dtype=dtype).reshape(shape) if kinds <= _BOOLS else None
    if not kinds <= (_INTS if dtype.kind in "iu" else _NUMBERS):
        return None  # bools, strings, lists..., and floats for an integer input
    if not leaves:
        return np.zeros(shape, dtype)
    limit = _FLOAT_MAX.get(dtype)
    if limit is not None and len(leaves) <= _SMALL:
        # a robot's state vector: one Python pass costs less than numpy's reductions
        for leaf in cast(list[float], leaves):
            if not -limit <= leaf <= limit:  # NaN fails both; so do infinities
                return None
        return np.array(leaves, dtype=dtype).reshape(shape)
    if dtype.kind in "iu":
        info, ints = np.iinfo(dtype), cast(list[int], leaves)
        ok = info.min <= min(ints) and max(ints) <= info.max
        return np.array(ints, dtype=dtype).reshape(shape) if ok else None
    try:
        wide = np.array(leaves, dtype=np.float64)
    except OverflowError:  # an integer beyond float64
        return None
    if not np.isfinite(wide).all() or float(np.abs(wide).max()) > float(np.finfo(dtype).max):
        return None
    return wide.astype(dtype).reshape(shape)


def _collect(
    spec: TensorSpec,
    value: object,
    path: tuple[int, ...],
    sizes: list[int | None],
    leaves: list[object],
    batch: bool,
) -> None:
    """Append the leaves of ``value`` to ``leaves``, checking it has ``spec``'s shape.

    Recursion stops at the declared rank, so its depth is bounded by the model, not the client.
    """
    depth = len(path)
    if depth == len(spec.shape):
        leaves.append(value)
        return
    where = _Where(path)
    if not isinstance(value, list):
        raise InvalidInput(
            spec.name,
            f"{where} must be a list (expected {spec.describe()}), got {_kind(value)}",
        )
    declared = spec.shape[depth]
    if depth == 0 and batch and len(value) != 1:
        raise InvalidInput(
            spec.name,
            f"{where} has {len(value)} elements; dimension 0 of {spec.describe()} is the "
            "batch axis, send exactly one sample per step",
        )
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
    if depth == len(spec.shape) - 1:
        leaves.extend(value)  # the innermost list: its items are leaves, checked by the caller
        return
    for index, item in enumerate(value):
        _collect(spec, item, (*path, index), sizes, leaves, batch)


class _Where:
    """The position ``[i][j]...`` of a nested list, spelt out only for an error message."""

    __slots__ = ("path",)

    def __init__(self, path: tuple[int, ...]) -> None:
        self.path = path

    def __str__(self) -> str:
        return "".join(f"[{i}]" for i in self.path) or "value"


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
