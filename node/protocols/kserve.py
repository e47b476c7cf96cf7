"""The KServe v2 inference protocol over HTTP/REST, with Triton's sequence parameters, as
the unmodified ``tritonclient.http`` (sync and ``aio``) speaks it. gRPC is not served.

Endpoints (``{m}`` is ``--model-name``, by default the model file's stem; the one version
is ``1``; ``/versions/1`` may be given or left out)::

    GET  /v2                                  server metadata: name, version, extensions
    GET  /v2/health/live                      200 while the process runs
    GET  /v2/health/ready                     200 registered, lease current, not leaving; else 400
    GET  /v2/models/{m}[/versions/1]          model metadata (state tensors hidden)
    GET  /v2/models/{m}[/versions/1]/ready    as /v2/health/ready
    GET  /v2/models/{m}[/versions/1]/stats    Triton's model statistics (``node/stats.py``)
    GET  /v2/models/stats                     the same, for every model (the one served)
    POST /v2/models/{m}[/versions/1]/infer    one step

**Infer.** The body is the JSON request, or — the binary tensor extension, what
``tritonclient`` sends by default — ``Inference-Header-Content-Length`` bytes of JSON
followed by each binary input's raw little-endian row-major bytes, in input order, each
input declaring ``parameters.binary_data_size``. JSON inputs carry ``data``: a flat
row-major list, or lists nested exactly as ``shape``. ``Content-Encoding: gzip`` or
``deflate`` bodies are inflated up to ``--max-body-bytes``. Every declared size (header
length against the body, ``binary_data_size`` against the shape and datatype and against the
bytes that follow, element counts) is checked before anything is allocated; binary inputs
are read-only views of the body. The arrays then pass the policy's one input rule
(``node.policy.inputs_from_arrays``): the model's shape for one step (batch axis 1), its
dtype or one the rule converts. ``BYTES`` tensors (a model's string inputs and outputs)
travel as JSON strings or, binary, as Triton's elements of a 4-byte little-endian length
and that many bytes (``bytes_elements``: a declared length that runs past the data is
refused before the next element is read, and the element count is bounded by the bytes);
their text must be UTF-8, as ONNX Runtime takes strings. ``BF16`` inputs are refused, as
are shared-memory parameters. Request parameters the node does not read are Triton's custom
parameters: taken (and unused) when a boolean, a number or a string, refused otherwise, as
Triton refuses them; ``priority`` must be a uint64.

The reply holds every returned output (or those ``outputs`` names), as JSON ``data`` or —
with ``parameters.binary_data_output`` or an output's ``binary_data`` (``tritonclient``
asks for binary when no outputs are named) — as binary data after the JSON header; and
affinity's facts in ``parameters``: ``episode_id``, ``device``, ``node``, ``token``,
``routing``, ``state_reset``, ``degraded``, ``source``, ``seq``, ``replayed`` (and
``rtc_executed``, ``rtc_delay``, ``rtc_prefix_len`` for a real-time-chunking model).

**Sequences.** ``parameters.sequence_id`` is the episode: a uint64, or a string (Triton's
``sequence(string_id)``); ``0`` and ``""`` (or none) are no sequence: a stateless step.
The episode id keeps the integer ``7`` and the string ``"7"`` apart: ``kserve:i:7`` and
``kserve:s:7`` (``GET /episodes/kserve:i:7``, ``affinity show kserve:s:7``).
``sequence_start: true`` starts the sequence over (a fresh token, clean state, a stale
assignment under the same id released first); ``sequence_end: true`` releases it after
the step. A request without ``sequence_start`` for a sequence that is not live (never
started, ended, idle past ``--episode-ttl``) is refused as Triton refuses it (400, Triton's
message), so a client that lost its sequence learns it instead of silently continuing from
clean state; ``--kserve-claim-unknown`` makes such a request start the sequence instead.
The check is the step's own resolve, in a form that never claims: one atomic decision, so
an END in flight cannot make the step start a new sequence. ``seq`` (an integer
parameter) is the step number the client expects to be applied, as in ``/act``; a client
whose connection closes before its reply is sent gets its step undone. ``timeout`` (µs)
shortens ``--act-deadline`` for the request; ``execute_steps`` and ``ensemble`` override
the node's action-chunk mode for the step, as in ``/act`` (a step then returns the chunk
output alone, one action: ``[1, D]``; the model metadata shows the node's own mode).
``executed``, ``inference_delay`` (integers) are a real-time-chunking model's step values
and ``control_hz`` (a number) the robot's control rate, as in ``/act``; ``timing: true``
(or the header ``X-Affinity-Timing: 1``) adds the split of the step's time to the reply's
parameters (``timing_total_ms``, ``timing_queue_ms``, ``timing_run_ms``,
``timing_forward_ms``).

**Errors** are KServe's: a non-200 status with ``{"error": "<message>"}`` — 400 for a
malformed body or a bad tensor, parameter or sequence, 401 without the API key (when the
node has one), 404 for another model, version or path, 405, 413 past ``--max-body-bytes``,
500 when the model failed, 503 with ``Retry-After`` when the step cannot be decided or
served now (Redis, capacity, a fenced node, an unreachable owner, the deadline).
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import orjson

from affinity import InvalidArgument, UnknownEpisode, check_episode
from affinity.wire import MAX_ELEMENTS
from node.accesslog import STEP_KEY
from node.asgi import (
    CONNECTION,
    BodyError,
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    respond,
    while_connected,
)
from node.lease import VERSION
from node.policy import InvalidInput, PolicyContract, TensorSpec, inputs_from_arrays
from node.rtc import Ask, control_rate
from node.service import NodeService
from node.stats import model_statistics
from node.step import Array, Refused, Reply, Step, Unavailable
from node.timing import TIMING_HEADER, asks_timing

__all__ = [
    "EXTENSIONS",
    "MODEL_VERSION",
    "BadRequest",
    "InferRequest",
    "decode_infer",
    "encode_infer",
    "episode_of",
    "handle",
    "model_metadata",
    "not_live",
    "service_step",
    "timing_parameters",
    "to_step",
]

MODEL_VERSION = "1"
EXTENSIONS = ("binary_tensor_data", "sequence", "sequence(string_id)", "statistics")
PLATFORM = "onnxruntime_onnx"
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
_NAMES = {dtype.name: name for name, dtype in DATATYPES.items()} | {"object": "BYTES"}
"""numpy dtype name (``float32``) -> KServe datatype (a string tensor, ``object``: BYTES)."""
_STRINGS = np.dtype(object)
"""BYTES: an object array of str (a model's string tensor; values must be UTF-8)."""
_REFUSED_TYPES = ("BF16",)
_JSON = b"application/json"
_HEADER_LENGTH = b"inference-header-content-length"


class BadRequest(ValueError):
    """A request this protocol refuses with 400; ``reason`` is the rejection metric's label
    (``malformed`` for a body that is not a v2 request, ``bad_input`` for a bad value)."""

    def __init__(self, message: str, reason: str = "bad_input") -> None:
        self.reason = reason
        super().__init__(message)


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
    timing: bool = False  # the split of the step's time in the reply's parameters


# ---- decoding ----------------------------------------------------------------------------


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
        f"sequence_id must be an unsigned integer or a string, not {_kind(sequence_id)}"
    )


def decode_infer(
    body: bytes,
    header_length: str | None,
    *,
    content_encoding: str | None = None,
    max_bytes: int = 1 << 24,
    max_elements: int = MAX_ELEMENTS,
) -> InferRequest:
    """Decode one infer body (see the module doc). ``header_length`` is the
    ``Inference-Header-Content-Length`` header, if any; ``max_bytes`` bounds an inflated
    body. Raises :class:`BadRequest` (400) or ``BodyError`` (413, an inflated body past
    ``max_bytes``); allocates nothing from a declared size before checking it."""
    if content_encoding is not None:
        body = _inflate(body, content_encoding.strip().lower(), max_bytes)
    if header_length is None:
        json_end = len(body)
    else:
        text = header_length.strip()
        if not text.isdigit() or len(text) > 20 or int(text) > len(body):
            raise BadRequest(
                f"Inference-Header-Content-Length {header_length[:24]!r} must be the length of "
                f"the JSON header within the {len(body)}-byte body",
                "malformed",
            )
        json_end = int(text)
    try:
        doc = orjson.loads(memoryview(body)[:json_end])
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request JSON is not valid: {exc}"[:300], "malformed") from None
    if not isinstance(doc, dict):
        raise BadRequest("the request must be a JSON object", "malformed")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(f"id must be a string, not {_kind(request_id)}")
    params = _object(doc.get("parameters"), "parameters")
    _check_custom(params)
    sequence = params.get("sequence_id")
    episode = episode_of(sequence)
    start = _flag(params, "sequence_start")
    end = _flag(params, "sequence_end")
    if episode is None and (start or end):
        raise BadRequest("sequence_start and sequence_end need a non-zero sequence_id")
    timeout = params.get("timeout")
    if timeout is not None and (type(timeout) is not int or timeout < 0):
        raise BadRequest(f"timeout {timeout!r:.40} must be a whole number of microseconds")
    steps, ensemble = params.get("execute_steps"), params.get("ensemble")
    if steps is not None and type(steps) is not int:
        raise BadRequest(f"execute_steps must be an integer, not {_kind(steps)}")
    if ensemble is not None and not isinstance(ensemble, str):
        raise BadRequest(f"ensemble must be a string, not {_kind(ensemble)}")
    seq = params.get("seq")
    if seq is not None and (type(seq) is not int or seq < 1):
        raise BadRequest(f"seq {seq!r:.40} must be a step number >= 1")
    arrays = _inputs(doc.get("inputs"), body, json_end, max_elements)
    binary_output = _flag(params, "binary_data_output")
    return InferRequest(
        id=request_id,
        sequence=None if episode is None else sequence,
        episode=episode,
        start=start,
        end=end,
        arrays=arrays,
        outputs=_requested(doc.get("outputs"), binary_output),
        binary_output=binary_output,
        timeout_s=timeout / 1e6 if timeout else None,
        execute_steps=steps,
        ensemble=ensemble,
        seq=seq,
        executed=params.get("executed"),
        inference_delay=params.get("inference_delay"),
        control_hz=params.get("control_hz"),
        timing=_flag(params, "timing"),
    )


def _inflate(body: bytes, encoding: str, limit: int) -> bytes:
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


def _inputs(raw: object, body: bytes, json_end: int, max_elements: int) -> dict[str, Array]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("inputs must be a non-empty list of tensors")
    if len(raw) > MAX_TENSORS:
        raise BadRequest(f"{len(raw)} inputs; the limit is {MAX_TENSORS}")
    binary = len(body) - json_end
    planned: list[tuple[str, np.dtype[Any], list[int], tuple[int, int] | None, object]] = []
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
        params = _object(tensor.get("parameters"), f"input {name[:64]!r} parameters")
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
        if dtype == _STRINGS:  # each element: a 4-byte length, then that many bytes
            need = max(4 * count, size) if type(size) is int else 4 * count
        if type(size) is not int or size != need:
            raise BadRequest(
                f"input {name[:64]!r}: binary_data_size {size!r:.24} disagrees with shape "
                f"{shape} of {_NAMES[dtype.name]}, which is {need} bytes"
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
    arrays: dict[str, Array] = {}
    for name, dtype, shape, at, data in planned:
        if at is None:
            arrays[name] = _from_json(name, data, dtype, shape)
        elif dtype == _STRINGS:
            arrays[name] = bytes_elements(name, memoryview(body)[at[0] : at[1]], shape)
        else:
            arrays[name] = _from_binary(name, body, at[0], dtype, shape)
    return arrays


def bytes_elements(name: str, data: bytes | memoryview, shape: list[int]) -> Array:
    """The BYTES tensor of ``shape`` in ``data``: each element a 4-byte little-endian length
    and that many bytes of UTF-8, filling ``data`` exactly. Raises :class:`BadRequest` for a
    length that runs past the data, trailing bytes or text that is not UTF-8; the object
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
    if dtype == _STRINGS:
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
        raise BadRequest(f"{shown}: {_NAMES[dtype.name]} data must be {what}")
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
        raise BadRequest(f"{shown}: data must be a list, not {_kind(data)}")
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
        return _STRINGS
    if value in _REFUSED_TYPES:
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


def _requested(raw: object, binary_output: bool) -> dict[str, bool] | None:
    if raw is None or raw == []:  # none named: every output
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise BadRequest(f"outputs must be a list of at most {MAX_TENSORS} objects")
    requested: dict[str, bool] = {}
    for i, tensor in enumerate(raw):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise BadRequest(f"outputs[{i}] must be an object with a name")
        name = tensor["name"]
        params = _object(tensor.get("parameters"), f"output {name[:64]!r} parameters")
        for key in params:
            if key == "classification" or key.startswith("shared_memory"):
                raise BadRequest(f"output {name[:64]!r}: {key} is not supported")
        if name in requested:
            raise BadRequest(f"output {name[:64]!r} is requested twice")
        binary = params.get("binary_data", binary_output)
        if not isinstance(binary, bool):
            raise BadRequest(f"output {name[:64]!r}: binary_data must be true or false")
        requested[name] = binary
    return requested


def _object(value: object, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be an object, not {_kind(value)}")
    return value


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, not {_kind(value)}")
    return value


REQUEST_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "timeout", "priority",
     "binary_data_output", "execute_steps", "ensemble", "executed", "inference_delay",
     "control_hz", "timing"}
)  # fmt: skip
"""The request parameters the node reads (``priority`` only checked, as Triton does)."""


def _check_custom(params: dict[str, Any]) -> None:
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
                f"not {_kind(value)}"
            )


def _kind(value: object) -> str:
    """The JSON kind of ``value``, for messages (never the value: it may be huge)."""
    if value is None:
        return "null"
    kinds = ((bool, "a boolean"), (int | float, "a number"), (str, "a string"),
             (list, "a list"), (dict, "an object"))  # fmt: skip
    return next((name for t, name in kinds if isinstance(value, t)), type(value).__name__)


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
        control_hz=control_rate(request.control_hz),
        timing=request.timing,
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
    dispatcher = service.dispatchers.get(chosen)  # elsewhere: the owner checks
    mode = dispatcher.mode_for(request.execute_steps, request.ensemble) if dispatcher else None
    rtc = service.rtc_for(chosen, request.executed, request.inference_delay, request.control_hz)
    returned = [dispatcher.chunk.output] if dispatcher and mode and dispatcher.chunk else None
    claim_unknown = service.config.kserve_claim_unknown
    step = to_step(contract, request, deadline, returned, claim_unknown, rtc)
    step.model, step.version = chosen, version
    return step


# ---- encoding ----------------------------------------------------------------------------


def encode_infer(
    reply: Reply, request: InferRequest, model_name: str
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """(body, headers) of a step's reply: JSON, or a JSON header and binary outputs with
    ``Inference-Header-Content-Length`` when any output goes back binary."""
    wanted = request.outputs
    if wanted is None:
        wanted = dict.fromkeys(reply.outputs, request.binary_output)
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, binary in wanted.items():
        array = reply.outputs[name]
        entry: dict[str, Any] = {
            "name": name,
            "datatype": _NAMES[array.dtype.name],
            "shape": list(array.shape),
        }
        if binary:
            if array.dtype == _STRINGS:
                blob = serialize_bytes(array)
            else:
                blob = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif array.dtype == _STRINGS:
            entry["data"] = [str(v) for v in array.reshape(-1).tolist()]
        else:
            entry["data"] = np.ascontiguousarray(array).reshape(-1)
        outputs.append(entry)
    version = reply.model.partition("@")[2] or MODEL_VERSION  # the version that served it
    doc: dict[str, Any] = {"model_name": model_name, "model_version": version}
    if request.id is not None:
        doc["id"] = request.id
    doc["parameters"] = {k: v for k, v in reply.facts(flat=True).items() if v is not None}
    if request.timing:
        doc["parameters"].update(timing_parameters(reply))
    doc["outputs"] = outputs
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    headers = [(b"x-affinity-node", reply.node.encode())]
    if reply.url:
        headers.append((b"x-affinity-url", reply.url.encode()))
    if not blobs:
        return head, [(b"content-type", _JSON), *headers]
    return b"".join([head, *blobs]), [
        (b"content-type", b"application/octet-stream"),
        (_HEADER_LENGTH, str(len(head)).encode()),
        *headers,
    ]


def timing_parameters(reply: Reply) -> dict[str, float]:
    """The split of a step's time as flat reply parameters (``timing_total_ms``, ...)."""
    return {f"timing_{k}": v for k, v in reply.split().items()}


def model_metadata(contract: PolicyContract, name: str, chunk: str | None = None) -> dict[str, Any]:
    """The model metadata of KServe v2: the inputs a client sends and the outputs it gets
    (recurrent state hidden: the node feeds it back), ``-1`` for a variable dimension.
    ``chunk`` names the action-chunk output when the node executes chunks: a step then
    returns that output alone, one action (its time axis dropped)."""

    def tensor(spec: TensorSpec) -> dict[str, Any]:
        return {
            "name": spec.name,
            "datatype": _NAMES[spec.dtype],
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


# ---- the ASGI handler --------------------------------------------------------------------


async def _error(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await respond(send, status, orjson.dumps({"error": message}), _JSON, headers or [])


async def _json(send: Send, status: int, doc: dict[str, Any]) -> None:
    await respond(send, status, orjson.dumps(doc), _JSON)


def _statistics(service: NodeService, served: str) -> dict[str, Any]:
    return model_statistics(service.metrics, service.device_ids, served, MODEL_VERSION)


def _not_ready(service: NodeService) -> str | None:
    if not service.lease.valid():
        return f"node {service.node_id} is not registered with a current lease"
    if service.lease.leaving:
        return f"node {service.node_id} is shutting down"
    return None


async def handle(service: NodeService, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI handler of every path under ``/v2``."""
    parts = scope["path"].rstrip("/").split("/")[2:]  # after "", "v2"
    method = scope["method"]
    if parts in ([], ["health", "live"], ["health", "ready"]):
        if method != "GET":
            await _error(send, 405, f"use GET {scope['path']}", [(b"allow", b"GET")])
        elif not parts:
            extensions = list(EXTENSIONS)
            await _json(send, 200, {"name": "affinity", "version": VERSION,
                                    "extensions": extensions})  # fmt: skip
        elif parts[1] == "live":
            await _json(send, 200, {"live": True})
        elif (why := _not_ready(service)) is not None:
            await _json(send, 400, {"ready": False, "error": why})
        else:
            await _json(send, 200, {"ready": True})
        return
    if parts == ["models"]:  # the models of the fleet (any node routes any of them)
        if method != "GET":
            await _error(send, 405, f"use GET {scope['path']}", [(b"allow", b"GET")])
        else:
            await service.catalog.refresh(force=True)
            listed = [{"name": n, "versions": service.catalog.versions(n)}
                      for n in service.catalog.served()]  # fmt: skip
            await _json(send, 200, {"models": listed})
        return
    if len(parts) < 2 or parts[0] != "models":
        await _error(send, 404, f"{method} {scope['path'][:200]}: not a KServe v2 endpoint")
        return
    if parts == ["models", "stats"]:  # every model's statistics: those served here
        if method != "GET":
            await _error(send, 405, f"use GET {scope['path']}", [(b"allow", b"GET")])
        else:
            stats = [_statistics(service, served) for served in service.models]
            await _json(send, 200, {"model_stats": stats})
        return
    name, rest = parts[1], parts[2:]
    version = None
    if rest[:1] == ["versions"] and len(rest) >= 2:
        version, rest = rest[1], rest[2:]
    if rest not in ([], ["ready"], ["infer"], ["stats"]):
        await _error(send, 404, f"{method} {scope['path'][:200]}: not a KServe v2 endpoint")
        return
    try:
        served, contract = await service.model_for(
            name, None if version in (None, MODEL_VERSION) else version
        )
    except (Refused, InvalidArgument):
        which = f"'{name[:128]}'" + (f" version {version[:32]}" if version else "")
        fleet = ", ".join(f"'{n}'" for n in service.catalog.served())
        await _error(send, 404, f"Request for unknown model: {which} is not found (this "
                                f"fleet serves {fleet})")  # fmt: skip
        return
    want = "POST" if rest == ["infer"] else "GET"
    if method != want:
        await _error(send, 405, f"use {want} {scope['path'][:200]}", [(b"allow", want.encode())])
    elif rest == ["infer"]:
        await _infer(service, served, scope, receive, send, version)
    elif rest == ["stats"]:
        await _json(send, 200, {"model_stats": [_statistics(service, served)]})
    elif not rest:
        local = service.dispatchers.get(served)
        chunk = local.chunk.output if local and local.chunk and local.chunk_mode else None
        await _json(send, 200, model_metadata(contract, served, chunk))
    elif (why := _not_ready(service)) is not None:
        await _json(send, 400, {"name": served, "ready": False, "error": why})
    else:
        await _json(send, 200, {"name": served, "ready": True})


async def _infer(
    service: NodeService,
    model_name: str,
    scope: Scope,
    receive: Receive,
    send: Send,
    version: str | None = None,
) -> None:
    started = time.monotonic()
    rejected = service.metrics.rejected
    if not service.client_allowed(header(scope, b"authorization")):
        rejected.labels("unauthorized").inc()
        await _error(send, 401, "this node wants Authorization: Api-Key <key>",
                     [(b"www-authenticate", b"Api-Key")])  # fmt: skip
        return
    budget = service.config.act_deadline_s
    try:
        body = await read_body(scope, receive, service.config.max_body_bytes)
        request = decode_infer(
            body,
            header(scope, _HEADER_LENGTH),
            content_encoding=header(scope, b"content-encoding"),
            max_bytes=service.config.max_body_bytes,
        )
        if request.timeout_s is not None:
            budget = min(budget, request.timeout_s)
        request.timing = request.timing or asks_timing(header(scope, TIMING_HEADER))
        step = await service_step(service, request, started + budget, model_name, version)
        step.door, step.received = "kserve_http", started
        scope[STEP_KEY] = (step.episode or "-", "-", "-")
        reply = await while_connected(receive, service.router.act(step), scope.get(CONNECTION))
        scope[STEP_KEY] = (step.episode or "-", reply.device, reply.routing)
    except ClientGone as exc:  # nobody will read the reply: the step did not happen
        if isinstance(exc.result, Reply):
            await service.router.undelivered(exc.result)
    except UnknownEpisode:
        # Triton's rule: a request without START must belong to a live sequence. Redis
        # decides it in the step's own resolve (state this node may hold says nothing about
        # an operator's release, an idle expiry, an END in flight, a Redis restarted empty)
        rejected.labels("bad_input").inc()
        await _error(send, 400, not_live(request.sequence, model_name))
    except BodyError as exc:
        rejected.labels(exc.reason).inc()
        await _error(send, exc.status, str(exc))
    except BadRequest as exc:
        rejected.labels(exc.reason).inc()
        await _error(send, 400, str(exc))
    except (InvalidInput, InvalidArgument) as exc:
        rejected.labels("bad_input").inc()
        await _error(send, 400, str(exc))
    except Unavailable as exc:
        retry = str(max(1, round(exc.retry_after))).encode()
        why = str(exc)
        if exc.reason == "deadline" and budget < service.config.act_deadline_s:
            why = f"no answer within the request's timeout of {round(budget * 1e6)} µs"
        await _error(send, 503, f"{exc.reason}: {why}", [(b"retry-after", retry)])
    except Refused as exc:
        if exc.status == 403:
            rejected.labels("forbidden").inc()
        await _error(send, exc.status, f"{exc.reason}: {exc}")
    else:
        payload, headers = encode_infer(reply, request, model_name)
        content_type = headers[0][1]
        await respond(send, 200, payload, content_type, headers[1:])
