"""The one input rule: a client's inputs, as JSON, binary arrays or an openpi observation,
checked against a :class:`PolicyContract` and turned into the model's arrays.

Every front door calls one of :func:`from_json`, :func:`from_arrays` and
:func:`from_observation`. Each raises :class:`InvalidInput`, and nothing else, for any value
a client can send. So a bad input is always the client's 4xx and never a device failure.
Sizes are checked against the contract before anything is allocated, and recursion stops
at the model's declared rank. One dtype rule for arrays: the model's dtype passes as is. A
float input takes finite floats and integers within its range. An integer input takes
integers within its range and never floats (a float image's scale is unknown). A bool
input takes bools only. ``docs/policies.md`` is the manual.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

import numpy as np

from node.contract import Array, PolicyContract, TensorSpec, json_kind
from node.errors import InvalidInput, StaleCheck

__all__ = [
    "MAX_OBSERVATION_DEPTH",
    "Checked",
    "ObservationInputs",
    "checked_of",
    "from_arrays",
    "from_json",
    "from_observation",
    "observation_grows",
    "outputs_unbatched",
    "taught",
    "trusted",
]

MAX_OBSERVATION_DEPTH = 8
"""How deeply an openpi observation's maps may nest."""
_OBS = "observation"  # the root of openpi observations in InvalidInput messages


class ObservationInputs(NamedTuple):
    """What :func:`from_observation` made of one openpi observation."""

    inputs: dict[str, Array]
    """One array per observation input, in the model's shape (batch axis of size 1)."""
    ignored: tuple[str, ...]
    """The flattened observation keys the model does not take, sorted (e.g. ``prompt``)."""


def from_json(contract: PolicyContract, raw: object) -> dict[str, Array]:
    """Validate a client's decoded ``inputs`` JSON and return one array per observation input.

    ``raw`` must be an object holding every observation input and nothing else: no unknown
    names, no state inputs. Each value is a nested list of exactly the declared shape. The
    batch axis is exactly 1; other symbolic dimensions are any size >= 1, the same for every
    sibling. Its numbers must be castable to the declared dtype. That is finite and in range
    for floats, integral and in range for ints, ``true``/``false`` for bool (booleans are not
    numbers). Raises :class:`InvalidInput`, and nothing else, for any JSON value.
    """
    return {
        spec.name: _parse_array(contract.step_spec(spec), value, contract.batch_axis)
        for spec, value in _named_inputs(contract, raw)
    }


def from_arrays(contract: PolicyContract, arrays: object) -> dict[str, Array]:
    """Validate decoded binary inputs (msgpack ``/act``, KServe) named by model input.

    ``arrays`` must be a map holding every observation input and nothing else (as
    :func:`from_json`). Each value is a numpy array (or numpy scalar) of exactly the model's
    shape for one step: batch axis of size 1, other symbolic dimensions any size >= 1. Its
    dtype must be one the module doc's rule converts to the model's. A nested list of
    numbers is parsed as in :func:`from_json`. Returns C-contiguous arrays of the model's
    dtypes (the given array itself when nothing needed converting). Raises
    :class:`InvalidInput`, and nothing else, for any value. Allocates nothing beyond the
    arrays' own sizes.
    """
    return {
        spec.name: _to_input(contract.step_spec(spec), value, contract.batch_axis)
        for spec, value in _named_inputs(contract, arrays)
    }


def from_observation(contract: PolicyContract, observation: object) -> ObservationInputs:
    """Turn one openpi observation into the model's inputs, as openpi clients send it.

    ``observation`` is a map, possibly nested (``{"state": .., "images": {"cam_high": ..},
    "prompt": ".."}``); nested keys flatten with ``/`` (``images/cam_high``), up to
    :data:`MAX_OBSERVATION_DEPTH` levels. Each key of :attr:`PolicyContract.observation_map`
    must be present, holding the input's value *unbatched*. That is the model's shape
    without the batch axis (``float64[8]`` for a ``float32 [batch, 8]`` input), converted by
    the module doc's dtype rule. The batch axis (size 1) is added here. Without a batch axis
    the value has the model's whole shape. Keys the model does not take are returned in
    ``ignored``, never touched. Raises :class:`InvalidInput`, and nothing else, for a missing
    key, a wrong shape or dtype, a key given twice (nested and flat), or a non-map
    observation. The error's root is ``observation``, its ``field`` the observation key; ``""``
    when several are missing, every one named.
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


def observation_grows(contract: PolicyContract, observation: object) -> bool:
    """Whether an array of ``observation`` would take more bytes converted by
    :func:`from_observation` than it came in (uint8 pixels to a float input): decided from
    the dtypes alone, before any conversion. False for an observation the rule refuses
    (it says what is wrong)."""
    try:
        flat = _flatten(observation)
    except InvalidInput:
        return False
    by_name = {spec.name: spec for spec in contract.observation_inputs}
    for key, name in contract.observation_map.items():
        value = flat.get(key)
        if isinstance(value, np.ndarray) and _dtype(by_name[name].dtype).itemsize > value.itemsize:
            return True
    return False


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


# --- client values -------------------------------------------------------------------------


def _named_inputs(contract: PolicyContract, raw: object) -> list[tuple[TensorSpec, object]]:
    """Each observation input with its value in ``raw``, once ``raw`` names exactly them."""
    if not isinstance(raw, dict):
        raise InvalidInput("", f"must be an object of input name -> array, got {json_kind(raw)}")
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
            "", f"must be a map of key -> value, got {json_kind(observation)}", root=_OBS
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
    converted = np.ascontiguousarray(array, dtype=spec.dtype)
    return converted.reshape(()) if array.ndim == 0 else converted  # (it makes a 0-d array 1-d)


def _shape_problem(spec: TensorSpec, shape: tuple[int, ...], batch: bool) -> str | None:
    if len(shape) != len(spec.shape):
        return _got(spec, shape)
    for axis, (size, declared) in enumerate(zip(shape, spec.shape, strict=True)):
        if axis == 0 and batch and size != 1:
            why = "dimension 0 is the batch axis, send exactly one sample per step"
            return f"{_got(spec, shape)}: {why}"
        if isinstance(declared, int) and size != declared:
            return _got(spec, shape)
        if not isinstance(declared, int) and size < 1:
            return f"{_got(spec, shape)}: dimension {axis} needs at least 1"
    return None


def _got(spec: TensorSpec, shape: tuple[int, ...]) -> str:
    return f"has shape {list(shape)}; expected {spec.describe()}"


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
    if array.size == 0:
        return None
    if source.kind == "f":  # (to a float input only, as checked above)
        peak = float(np.abs(array).max())  # one pass: a NaN or an infinity makes it one
        if not math.isfinite(peak):  # which value, named (rare: a bad request)
            finite = np.isfinite(array).reshape(-1)
            at = int(np.argmin(finite))
            return f"{_where(array.shape, at)} is {array.reshape(-1)[at]}; must be finite"
        if source != target and peak > float(np.finfo(target).max):
            return f"is {source} with values beyond the range of {target.name}"
        return None
    if source == target or np.can_cast(source, target, "safe"):
        return None  # every value of the source's type fits (int32 to int64, to float64)
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


def _parse_array(spec: TensorSpec, value: object, batch: bool) -> Array:
    sizes: list[int | None] = [None] * len(spec.shape)
    leaves: list[object] = []
    _collect(spec, value, (), sizes, leaves, batch)
    # A dimension left unseen lies below a declared 0: the array is empty whatever its size.
    if None in sizes:
        shape = tuple(0 if size is None else size for size in sizes)
    else:  # every dimension seen (no generator a step)
        shape = tuple(cast(list[int], sizes))
    dtype = _dtype(spec.dtype)
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
                spec.name, f"{_where(shape, at)} must be a number, got {json_kind(leaf)}"
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
    """The array of ``leaves`` when every one is valid for ``dtype``. It is checked with one
    pass over their types and numpy's reductions; a camera image is 150,000 numbers.
    ``None`` when any is not, for the element-by-element checks to say which."""
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
    if not isinstance(value, list):
        raise InvalidInput(
            spec.name,
            f"{_Where(path)} must be a list (expected {spec.describe()}), got {json_kind(value)}",
        )
    declared = spec.shape[depth]
    if depth == 0 and batch and len(value) != 1:
        raise InvalidInput(
            spec.name,
            f"{_Where(path)} has {len(value)} elements; dimension 0 of {spec.describe()} is the "
            "batch axis, send exactly one sample per step",
        )
    if isinstance(declared, int) and len(value) != declared:
        raise InvalidInput(
            spec.name,
            f"{_Where(path)} has {len(value)} elements, dimension {depth} of "
            f"{spec.describe()} needs {declared}",
        )
    if not value and not isinstance(declared, int):
        raise InvalidInput(
            spec.name, f"{_Where(path)} is empty; dimension {depth} needs at least 1"
        )
    seen = sizes[depth]
    if seen is not None and seen != len(value):
        raise InvalidInput(
            spec.name,
            f"{_Where(path)} has {len(value)} elements but its siblings have {seen} (ragged)",
        )
    sizes[depth] = len(value)
    if depth == len(spec.shape) - 1:
        leaves.extend(value)  # the innermost list: its items are leaves, checked by the caller
        return
    for index, item in enumerate(value):
        _collect(spec, item, (*path, index), sizes, leaves, batch)


@functools.lru_cache(maxsize=64)
def _dtype(name: str) -> np.dtype[Any]:
    """``np.dtype(name)``, made once per name (~0.3 µs a step, each step parses its inputs)."""
    return np.dtype(name)


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


# ---- a front's word on the inputs it checked (issue 43: node/checks.py) ------------------


@dataclass
class Checked:
    """A front process's word on one step's inputs (``node/checks.py``): the key of the
    input check (``PolicyContract.input_check``) it holds for the step's model (None:
    none), and whether it checked the inputs against it (``ok``: they come as that check
    converted them, every one a tensor). :func:`trusted` trusts the check when the key is
    that of the contract the step's model resolves to, and sets ``lesson`` (the model as
    the front names it, and this node's check of it, or None: none) when it is not."""

    key: str | None
    ok: bool
    lesson: tuple[object, Any] | None = None


def checked_of(meta: Mapping[str, Any]) -> Checked:
    """The front's word on a step's inputs as the hop carried it: the input check's key it
    holds for the step's model (``ck``), and whether it checked them (``ok``)."""
    key = meta.get("ck")
    return Checked(key if isinstance(key, str) else None, meta.get("ok") is True)


def trusted(checked: Checked, model: object, contract: PolicyContract, raw: object) -> bool:
    """Whether ``raw`` are inputs a front checked against ``contract``'s input check (its
    word, ``checked``), to be taken as they are; sets its ``lesson`` (``model``: the name
    the front knows the check by) when the check it holds is not that one, and raises
    :class:`StaleCheck` when it checked them against another: before anything of the
    request changed anything, the front sends it again unchecked."""
    mine = contract.input_check
    if checked.key != (None if mine is None else mine.key):
        checked.lesson = (model, mine)
        if checked.ok:
            raise StaleCheck()
        return False
    return checked.ok and type(raw) is dict


def taught(reply: dict[str, Any], checks: Sequence[Checked | None]) -> dict[str, Any]:
    """``reply`` with what the front should know of the checks of its steps' models
    (``chk``: ``[model, key, doc]`` each, key and doc None for a model it must not check),
    where the check it holds is not the one the step's model resolved to here."""
    lessons = []
    for checked in checks:
        if checked is not None and checked.lesson is not None:
            model, check = checked.lesson
            lessons.append([model, None, None] if check is None else [model, *check])
    if lessons:
        reply["chk"] = lessons
    return reply
