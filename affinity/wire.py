"""msgpack with numpy arrays, in openpi's encoding, for every binary path of the node.

An array travels as a map with **bytes** keys, the way ``openpi-client``'s
``msgpack_numpy`` writes it::

    {b"__ndarray__": True, b"data": <C-order bytes>, b"dtype": "<f4", b"shape": [1, 8]}

and a numpy scalar as ``{b"__npgeneric__": True, b"data": 1.5, b"dtype": "<f8"}``. A
string tensor (a model's ``tensor(string)``, KServe's BYTES: an object array of ``str``)
travels the same way with ``b"dtype": "|O"`` and ``b"data"`` a list of its strings in C
order (an affinity extension: openpi's ``msgpack_numpy`` has no string arrays). The
same encoding carries msgpack ``POST /act`` (both ways: :class:`affinity.Client` speaks it
by default), the openpi websocket and node-to-node forwarding, so an image is never turned
into a JSON list between hosts.

Decoding untrusted input: msgpack itself refuses lengths longer than the message and
nesting deeper than its stack; here an array's declared shape is checked against its
dtype, its data length and ``max_elements`` before anything is allocated, and the array is
a read-only view of the message's bytes (no copy). Anything malformed raises
:class:`WireError` — and nothing else — naming what was wrong.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

__all__ = ["MAX_ELEMENTS", "WireError", "decode", "encode"]

MAX_ELEMENTS = 1 << 28
"""Elements of one decoded array, whatever the body limit allows (about 1 GiB of f32)."""

# numeric and bool dtypes only: object, void, complex and datetime arrays never decode
_KINDS = frozenset("biuf")


class WireError(ValueError):
    """A msgpack message that cannot be decoded; the message says where and why."""


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "O":
            strings = obj.reshape(-1).tolist()
            if not all(isinstance(v, str) for v in strings):
                raise TypeError("cannot encode an object array that does not hold only str")
            return {b"__ndarray__": True, b"data": strings, b"dtype": "|O",
                    b"shape": list(obj.shape)}  # fmt: skip
        if obj.dtype.kind not in _KINDS:
            raise TypeError(f"cannot encode a {obj.dtype} array")
        data = np.ascontiguousarray(obj)
        return {
            b"__ndarray__": True,
            # a view is packed straight from the array's memory: no intermediate bytes
            # object (about 10x cheaper for a camera image than tobytes())
            b"data": data.data.cast("B") if data.size else b"",
            b"dtype": obj.dtype.str,
            b"shape": list(obj.shape),
        }
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in _KINDS:
            raise TypeError(f"cannot encode a {obj.dtype} scalar")
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot encode {type(obj).__name__}")


_packer = msgpack.Packer(default=_pack_default)


def encode(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (maps, lists, str, numbers, bytes, numpy arrays and scalars)."""
    packed: bytes = _packer.pack(obj)
    return packed


def _dtype(value: object) -> np.dtype[Any]:
    if not isinstance(value, str | bytes) or len(value) > 8:
        raise WireError(f"array dtype must be a short string such as '<f4', got {value!r:.40}")
    try:
        dtype = np.dtype(value if isinstance(value, str) else value.decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError):
        raise WireError(f"unknown array dtype {value!r:.40}") from None
    if dtype.kind not in _KINDS:
        raise WireError(f"array dtype {dtype} is not numeric or bool")
    return dtype


def _hook(obj: dict[Any, Any], max_elements: int) -> Any:
    if b"__ndarray__" in obj:
        strings = obj.get(b"dtype") in ("|O", b"|O")
        dtype = np.dtype(object) if strings else _dtype(obj.get(b"dtype"))
        shape = obj.get(b"shape")
        data = obj.get(b"data")
        if not isinstance(shape, list) or len(shape) > 32:
            raise WireError("array shape must be a list of at most 32 dimensions")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise WireError(f"array shape {shape!r:.80} must hold non-negative integers")
        count = math.prod(shape)  # Python ints: no overflow, whatever was declared
        if count > max_elements:
            raise WireError(
                f"array of shape {shape} has {count} elements; the limit is {max_elements}"
            )
        if strings:  # the list exists already: msgpack bounded it by the message
            if not isinstance(data, list) or len(data) != count:
                raise WireError(f"string array of shape {shape} needs a list of {count} strings")
            if not all(isinstance(v, str) for v in data):
                raise WireError("string array data must hold only strings")
            array = np.empty(count, dtype=object)
            array[:] = data
            return array.reshape(shape)
        if not isinstance(data, bytes):
            raise WireError("array data must be bytes")
        if count * dtype.itemsize != len(data):
            raise WireError(
                f"array of shape {shape} and dtype {dtype} needs {count * dtype.itemsize} "
                f"bytes of data, got {len(data)}"
            )
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if b"__npgeneric__" in obj:
        return _scalar(_dtype(obj.get(b"dtype")), obj.get(b"data"))
    return obj


def _scalar(dtype: np.dtype[Any], value: object) -> Any:
    if dtype.kind == "b":
        if not isinstance(value, bool):
            raise WireError(f"scalar of dtype {dtype} must carry true or false")
        return dtype.type(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(f"scalar of dtype {dtype} must carry a number")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not (float(value).is_integer() and info.min <= value <= info.max):
            raise WireError(f"scalar {value!r:.40} does not fit {dtype}")
        return dtype.type(int(value))
    if math.isfinite(value) and abs(value) > float(np.finfo(dtype).max):
        raise WireError(f"scalar {value!r:.40} does not fit {dtype}")
    return dtype.type(value)


def decode(data: bytes, *, max_elements: int = MAX_ELEMENTS) -> Any:
    """Decode one msgpack message; arrays come back as read-only numpy views of ``data``.

    Raises :class:`WireError` for anything malformed. That is truncated or trailing bytes,
    a declared length past the message, or nesting past msgpack's stack. It is also an
    array whose shape, dtype and data length disagree, or that has more than
    ``max_elements`` elements.
    """
    try:
        return msgpack.unpackb(data, object_hook=lambda obj: _hook(obj, max_elements))
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        # ExtraData, FormatError, StackError, OutOfData and length-limit ValueErrors
        reason = str(exc) or type(exc).__name__
        raise WireError(f"body is not valid msgpack: {reason}"[:300]) from None
