"""KServe v2 tensors: datatypes, ``BYTES``, JSON and binary tensors of an HTTP body, and
inflating a compressed body.

Every declared size is checked before anything is allocated: header length against the
body, ``binary_data_size`` against the shape and datatype and against the bytes that
follow, element counts. Binary inputs are read-only views of the body. ``BYTES`` tensors are
Triton's elements of a 4-byte little-endian length and that many bytes, whose text must be
UTF-8 (ONNX Runtime takes ``str``). ``BF16`` is refused (numpy has no bfloat16).
"""

from __future__ import annotations

import math
import sys
import zlib
from typing import Any

import numpy as np

from node.errors import BadRequest, BodyError

__all__ = [
    "DATATYPES",
    "DATATYPE_OF",
    "MAX_RANK",
    "MAX_TENSORS",
    "NAMES",
    "STRINGS",
    "Array",
    "as_object",
    "body_inputs",
    "bytes_elements",
    "inflate",
    "kind_of",
    "serialize_bytes",
    "tensor_bytes",
]

Array = np.ndarray[Any, Any]
"""A tensor (``node.step``'s, not imported: it loads ONNX Runtime, which a front has not)."""
MAX_RANK = 32
MAX_TENSORS = 256
"""Inputs or outputs one request may name (a policy has a handful)."""

DATATYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(code)
    for name, code in (
        ("BOOL", "|b1"),
        ("UINT8", "|u1"),
        ("UINT16", "<u2"),
        ("UINT32", "<u4"),
        ("UINT64", "<u8"),
        ("INT8", "|i1"),
        ("INT16", "<i2"),
        ("INT32", "<i4"),
        ("INT64", "<i8"),
        ("FP16", "<f2"),
        ("FP32", "<f4"),
        ("FP64", "<f8"),
    )
}
"""KServe datatype -> the little-endian numpy dtype of its binary form."""
NAMES = {dtype.name: name for name, dtype in DATATYPES.items()} | {"object": "BYTES"}
"""numpy dtype name (``float32``) -> KServe datatype (a string tensor, ``object``: BYTES)."""
STRINGS = np.dtype(object)
"""BYTES: an object array of str (a model's string tensor; values must be UTF-8)."""
DATATYPE_OF: dict[np.dtype[Any], str] = {dtype: name for name, dtype in DATATYPES.items()} | {
    STRINGS: "BYTES"
}
"""numpy dtype -> KServe datatype, for replies (``dtype.name`` costs ~3 µs a call)."""
_NATIVE_LITTLE = sys.byteorder == "little"
REFUSED_TYPES = ("BF16",)


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    wbits = {"gzip": 31, "deflate": 15, "identity": 0}.get(encoding)
    if wbits is None:
        raise BadRequest(f"Content-Encoding {encoding[:32]!r} is not supported (gzip, deflate)")
    if wbits == 0:
        return body
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BadRequest(f"the {encoding} body does not inflate: {exc}", "malformed") from None
    if len(out) > limit:
        raise BodyError(413, "too_large", f"the inflated body exceeds the limit of {limit} bytes")
    if not inflater.eof or inflater.unused_data:
        raise BadRequest(f"the {encoding} body is truncated or has trailing bytes", "malformed")
    return out


def body_inputs(raw: object, body: bytes, json_end: int, max_elements: int) -> dict[str, Array]:
    """The input tensors ``raw`` (the request's ``inputs``) declares, binary ones read from
    ``body`` after ``json_end``. Raises :class:`BadRequest`. None or an empty list is no
    input: the policy's input rule then names each one missing."""
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise BadRequest(f"inputs must be a list of tensors, not {kind_of(raw)}")
    if len(raw) > MAX_TENSORS:
        raise BadRequest(f"{len(raw)} inputs; the limit is {MAX_TENSORS}")
    binary = len(body) - json_end
    planned: list[_Planned] = []
    names: set[str] = set()
    offset = 0
    # every size is checked against the body before any array exists
    for i, tensor in enumerate(raw):
        if not isinstance(tensor, dict):
            raise BadRequest(f"inputs[{i}] must be an object")
        name = tensor.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"inputs[{i}].name must be a string")
        if name in names:
            raise BadRequest(f"input {name[:64]!r} is given twice")
        names.add(name)
        dtype = _datatype(tensor.get("datatype"), name)
        shape = _shape(tensor.get("shape"), name)
        count = math.prod(shape)  # Python ints: no overflow, whatever was declared
        if count > max_elements:
            raise BadRequest(
                f"input {name[:64]!r} of shape {shape} has {count} elements; the limit is "
                f"{max_elements}"
            )
        params = as_object(tensor.get("parameters"), f"input {name[:64]!r} parameters")
        if any(key.startswith("shared_memory") for key in params):
            raise BadRequest(f"input {name[:64]!r}: shared memory is not supported")
        size = params.get("binary_data_size")
        has_data = "data" in tensor
        if size is None:
            if not has_data:
                raise BadRequest(f"input {name[:64]!r} has neither data nor binary_data_size")
            planned.append((name, dtype, shape, None, tensor["data"]))
            continue
        if has_data:
            raise BadRequest(f"input {name[:64]!r} has both data and binary_data_size")
        need = count * dtype.itemsize
        if dtype == STRINGS:  # each element: a 4-byte length, then that many bytes
            need = max(4 * count, size) if type(size) is int else 4 * count
        if type(size) is not int or size != need:
            raise BadRequest(
                f"input {name[:64]!r}: binary_data_size {size!r:.24} disagrees with shape "
                f"{shape} of {NAMES[dtype.name]}, which is {need} bytes"
            )
        if offset + size > binary:
            raise BadRequest(
                f"input {name[:64]!r}: {size} bytes at offset {offset} of the binary data, "
                f"but only {binary} bytes follow the JSON header",
                "malformed",
            )
        planned.append((name, dtype, shape, (json_end + offset, json_end + offset + size), None))
        offset += size
    if offset != binary:
        raise BadRequest(
            f"{binary} bytes follow the JSON header but the inputs declare {offset}", "malformed"
        )
    return _arrays(planned, body)


_Planned = tuple[str, np.dtype[Any], list[int], tuple[int, int] | None, object]
"""An input whose sizes were checked: name, dtype, shape, its span of the body (binary)
or None, and its JSON ``data``."""


def _arrays(planned: list[_Planned], body: bytes) -> dict[str, Array]:
    arrays: dict[str, Array] = {}
    for name, dtype, shape, at, data in planned:
        if at is None:
            arrays[name] = _from_json(name, data, dtype, shape)
        elif dtype == STRINGS:
            arrays[name] = bytes_elements(name, memoryview(body)[at[0] : at[1]], shape)
        else:
            arrays[name] = _from_binary(name, body, at[0], dtype, shape)
    return arrays


def bytes_elements(name: str, data: bytes | memoryview, shape: list[int]) -> Array:
    """The BYTES tensor of ``shape`` in ``data``: each element a 4-byte little-endian length
    and that many bytes of UTF-8, filling ``data`` exactly. Raises :class:`BadRequest` for a
    length that runs past the data, trailing bytes or text that is not UTF-8. The object
    array it allocates has at most ``len(data) / 4`` elements (checked first)."""
    view = memoryview(data)
    count = math.prod(shape)
    if 4 * count > len(view):
        raise BadRequest(f"input {name[:64]!r}: {len(view)} bytes cannot hold {count} BYTES "
                         "elements (4-byte lengths)")  # fmt: skip
    out = np.empty(count, dtype=object)
    at = 0
    for i in range(count):
        if at + 4 > len(view):
            raise BadRequest(f"input {name[:64]!r}: BYTES element {i} has no length")
        size = int.from_bytes(view[at : at + 4], "little")
        at += 4
        if at + size > len(view):
            raise BadRequest(
                f"input {name[:64]!r}: BYTES element {i} declares {size} bytes, but "
                f"{len(view) - at} follow"
            )
        try:
            out[i] = str(view[at : at + size], "utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"input {name[:64]!r}: BYTES element {i} is not UTF-8") from None
        at += size
    if at != len(view):
        raise BadRequest(f"input {name[:64]!r}: {len(view) - at} bytes after the BYTES elements")
    return out.reshape(shape)


def serialize_bytes(array: Array) -> bytes:
    """A string tensor in BYTES' binary form (a 4-byte little-endian length per element)."""
    parts = []
    for value in np.asarray(array).reshape(-1).tolist():
        raw = value if isinstance(value, bytes) else str(value).encode()
        parts += [len(raw).to_bytes(4, "little"), raw]
    return b"".join(parts)


def _from_binary(name: str, body: bytes, at: int, dtype: np.dtype[Any], shape: list[int]) -> Array:
    array = np.frombuffer(body, dtype=dtype, count=math.prod(shape), offset=at).reshape(shape)
    if dtype.kind == "b" and array.size and array.view(np.uint8).max() > 1:
        raise BadRequest(f"input {name[:64]!r}: BOOL bytes must be 0 or 1")
    return array


def _from_json(name: str, data: object, dtype: np.dtype[Any], shape: list[int]) -> Array:
    flat = _flatten(name, data, shape)
    kinds = set(map(type, flat))
    shown = f"input {name[:64]!r}"
    if dtype == STRINGS:
        if kinds - {str}:
            raise BadRequest(f"{shown}: BYTES data must be strings")
        strings = np.empty(len(flat), dtype=object)
        strings[:] = flat
        return strings.reshape(shape)
    if dtype.kind == "b":
        if kinds - {bool}:
            raise BadRequest(f"{shown}: BOOL data must be true or false")
        return np.array(flat, dtype=dtype).reshape(shape)
    allowed = {int} if dtype.kind in "iu" else {int, float}
    if kinds - allowed:
        what = "integers" if dtype.kind in "iu" else "numbers"
        raise BadRequest(f"{shown}: {NAMES[dtype.name]} data must be {what}")
    if not flat:
        return np.zeros(shape, dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if min(flat) < info.min or max(flat) > info.max:
            raise BadRequest(f"{shown}: data outside {info.min}..{info.max}")
        return np.array(flat, dtype=dtype).reshape(shape)
    try:
        wide = np.array(flat, dtype=np.float64)
    except OverflowError:
        raise BadRequest(f"{shown}: a number is too large") from None
    limit = float(np.finfo(dtype).max)
    if not np.isfinite(wide).all() or np.abs(wide).max() > limit:
        raise BadRequest(f"{shown}: data beyond the range of {dtype.name}")
    return wide.astype(dtype).reshape(shape)


def _flatten(name: str, data: object, shape: list[int]) -> list[Any]:
    """``data`` as a flat row-major list: given flat, or nested exactly as ``shape``."""
    shown = f"input {name[:64]!r}"
    if not isinstance(data, list):
        raise BadRequest(f"{shown}: data must be a list, not {kind_of(data)}")
    count = math.prod(shape)
    if len(shape) <= 1 or not data or type(data[0]) is not list:
        if len(data) != count:
            raise BadRequest(f"{shown}: {len(data)} values for shape {shape} ({count} values)")
        return data
    level: list[Any] = [data]
    for size in shape:
        items: list[Any] = []
        for item in level:
            if type(item) is not list or len(item) != size:
                raise BadRequest(f"{shown}: data is nested, but not as shape {shape}")
            items.extend(item)
        level = items
    return level


def _datatype(value: object, name: str) -> np.dtype[Any]:
    if isinstance(value, str) and value in DATATYPES:
        return DATATYPES[value]
    if value == "BYTES":
        return STRINGS
    if value in REFUSED_TYPES:
        raise BadRequest(f"input {name[:64]!r}: datatype {value} is not supported")
    raise BadRequest(
        f"input {name[:64]!r}: unknown datatype {value!r:.24}; expected one of "
        f"{', '.join(DATATYPES)}, BYTES"
    )


def _shape(value: object, name: str) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_RANK
        or not all(type(d) is int and d >= 0 for d in value)
    ):
        raise BadRequest(
            f"input {name[:64]!r}: shape {value!r:.80} must be a list of at most {MAX_RANK} "
            "non-negative integers"
        )
    return value


def as_object(value: object, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be an object, not {kind_of(value)}")
    return value


def kind_of(value: object) -> str:
    """The JSON kind of ``value``, for messages (never the value: it may be huge)."""
    if value is None:
        return "null"
    kinds = ((bool, "a boolean"), (int | float, "a number"), (str, "a string"),
             (list, "a list"), (dict, "an object"))  # fmt: skip
    return next((name for t, name in kinds if isinstance(value, t)), type(value).__name__)


def tensor_bytes(array: Array) -> bytes:
    """A tensor's binary form: BYTES elements, or the raw little-endian row-major bytes."""
    dtype = array.dtype
    if dtype.kind == "O":
        return serialize_bytes(array)
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and not _NATIVE_LITTLE):
        array = array.astype(dtype.newbyteorder("<"))
    return array.tobytes()  # row-major whatever the array's layout
