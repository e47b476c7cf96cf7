"""The KServe v2 gRPC messages: a ``ModelInferRequest`` as ``body.py``'s
:class:`InferRequest`, a reply's parts as a ``ModelInferResponse``, and the status codes
of the service. Imports nothing heavy (grpcio, the generated messages, ``body.py``; no ONNX
Runtime, no FastAPI, no service): the node's servicer (``grpc.py``) and a front door
process (``grpc_front.py``, issue 43) both decode and encode with it.

Sizes are checked before an array exists; raw inputs are views of the received bytes.
Every refusal is :class:`~node.errors.BadRequest` (the servicer answers ``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np

from affinity.wire import MAX_ELEMENTS
from node.errors import BadRequest, Outcome
from node.protocols.kserve.body import (
    ROW_PARAMETERS,
    InferRequest,
    episode_of,
    rows_of,
    step_parameters,
)
from node.protocols.kserve.pb import kserve_pb2 as pb
from node.protocols.kserve.tensors import (
    DATATYPE_OF,
    DATATYPES,
    MAX_RANK,
    MAX_TENSORS,
    Array,
    bytes_elements,
    tensor_bytes,
)

__all__ = [
    "CODE_OF",
    "HTTP_STATUS",
    "SERVICE",
    "Abort",
    "abort",
    "code_of",
    "decode_request",
    "drain",
    "encode_response",
    "stream_infer",
]

SERVICE = "inference.GRPCInferenceService"
CODE_OF = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
"""KServe HTTP's status -> the gRPC status; any other (421, 422) is ``ABORTED``."""
HTTP_STATUS = {code: status for status, code in CODE_OF.items()}
"""The HTTP status an access line gives a gRPC status (as KServe HTTP would answer)."""


def code_of(status: int) -> grpc.StatusCode:
    """The gRPC status of a refusal KServe HTTP answers with ``status``."""
    return CODE_OF.get(status, grpc.StatusCode.ABORTED)


class Abort(Exception):
    """A call answered with a gRPC status (``code``) and the node's message, and, when the
    refusal says when to come back, a ``retry-after`` trailer (whole seconds). Raised and
    caught by the gRPC doors of one process (``grpc.py``) and of a front (``grpc_front.py``)
    alike; it never leaves them (``node/errors.py``: ``PRIVATE``)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: str | None = None):
        self.code = code
        self.retry_after = retry_after
        super().__init__(message)

    @classmethod
    def of(cls, o: Outcome) -> Abort:
        """The gRPC status of an outcome KServe HTTP answers with ``o.status``."""
        after = None if o.retry_after is None else str(max(1, round(o.retry_after)))
        return cls(code_of(o.status), o.message, after)


async def abort(context: Any, exc: Abort) -> None:
    """End the call with ``exc``'s status (``context.abort`` raises)."""
    if exc.retry_after is not None:
        context.set_trailing_metadata((("retry-after", exc.retry_after),))
    await context.abort(exc.code, str(exc))


async def stream_infer(
    requests: AsyncIterator[pb.ModelInferRequest],
    context: Any,
    check_key: Callable[[], Awaitable[None]],
    infer: Callable[[pb.ModelInferRequest], Awaitable[pb.ModelInferResponse]],
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """``ModelStreamInfer``, as both gRPC doors answer it: the key checked once (refused:
    the stream drained and aborted), then each request's reply, or its error in the stream
    (the stream goes on)."""
    try:
        await check_key()
    except Abort as exc:
        await drain(requests)
        await abort(context, exc)
    async for msg in requests:
        try:
            reply = await infer(msg)
        except Abort as exc:
            yield pb.ModelStreamInferResponse(
                error_message=str(exc), infer_response=pb.ModelInferResponse(id=msg.id)
            )
        else:
            yield pb.ModelStreamInferResponse(infer_response=reply)


_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
"""KServe datatype -> the typed ``contents`` field that carries it (FP16: raw only)."""

# ---- decoding ----------------------------------------------------------------------------


def _value(param: pb.InferParameter) -> Any:
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be a bool_param")
    return value


def decode_request(
    msg: pb.ModelInferRequest, *, max_elements: int = MAX_ELEMENTS, max_rows: int = 256
) -> InferRequest:
    """The :class:`InferRequest` of one ``ModelInferRequest``. Raises :class:`BadRequest`
    (``INVALID_ARGUMENT``); allocates nothing from a declared size before checking it. A
    request of rows (``episode_ids``, :func:`~node.protocols.kserve.request.rows_of`) past
    ``max_rows`` is refused before its tensors are read."""
    params = {key: _value(p) for key, p in msg.parameters.items()}
    rows = rows_of(params, max_rows)
    if rows is not None:  # the per-row ones are in rows
        params = {k: v for k, v in params.items() if k not in ROW_PARAMETERS}
    sequence = params.get("sequence_id")
    episode = episode_of(sequence)
    start, end = _flag(params, "sequence_start"), _flag(params, "sequence_end")
    if episode is None and (start or end):
        raise BadRequest("sequence_start and sequence_end need a non-zero sequence_id")
    timeout = params.get("timeout")
    if timeout is not None and (type(timeout) is not int or timeout < 0):
        raise BadRequest("timeout must be a whole number of microseconds")
    steps, ensemble = params.get("execute_steps"), params.get("ensemble")
    if steps is not None and type(steps) is not int:
        raise BadRequest("execute_steps must be an int64_param")
    if ensemble is not None and not isinstance(ensemble, str):
        raise BadRequest("ensemble must be a string_param")
    seq = params.get("seq")
    if seq is not None and (type(seq) is not int or seq < 1):
        raise BadRequest(f"seq {seq!r:.40} must be a step number >= 1 (an int64_param)")
    for key in params:
        if key.startswith("shared_memory"):
            raise BadRequest(f"parameter {key[:64]!r} is not supported")
    outputs: dict[str, bool] | None = None
    if msg.outputs:
        if len(msg.outputs) > MAX_TENSORS:
            raise BadRequest(f"{len(msg.outputs)} outputs; the limit is {MAX_TENSORS}")
        outputs = {}
        for out in msg.outputs:
            if out.name in outputs:
                raise BadRequest(f"output {out.name[:64]!r} is requested twice")
            for key in out.parameters:
                if key == "classification" or key.startswith("shared_memory"):
                    raise BadRequest(f"output {out.name[:64]!r}: {key} is not supported")
            outputs[out.name] = True
    return InferRequest(
        id=msg.id or None,
        sequence=None if episode is None else sequence,
        episode=episode,
        start=start,
        end=end,
        arrays=_inputs(msg, max_elements),
        outputs=outputs,
        binary_output=True,
        timing=_flag(params, "timing"),
        rows=rows,
        **step_parameters(params),
    )


def _inputs(msg: pb.ModelInferRequest, max_elements: int) -> dict[str, Array]:
    if len(msg.inputs) > MAX_TENSORS:
        raise BadRequest(f"{len(msg.inputs)} inputs; the limit is {MAX_TENSORS}")
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise BadRequest(
            f"{len(raw)} raw_input_contents for {len(msg.inputs)} inputs: give one per input, "
            "in order, or none"
        )
    arrays: dict[str, Array] = {}
    for i, tensor in enumerate(msg.inputs):
        name = tensor.name
        shown = f"input {name[:64]!r}"
        if name in arrays:
            raise BadRequest(f"{shown} is given twice")
        strings = tensor.datatype == "BYTES"
        if tensor.datatype not in DATATYPES and not strings:
            raise BadRequest(
                f"{shown}: datatype {tensor.datatype[:24]!r} is not supported; expected one of "
                f"{', '.join(DATATYPES)}, BYTES"
            )
        dtype: np.dtype[Any] = np.dtype(object) if strings else DATATYPES[tensor.datatype]
        shape = list(tensor.shape)
        if len(shape) > MAX_RANK or any(d < 0 for d in shape):
            raise BadRequest(
                f"{shown}: shape {shape[: MAX_RANK + 1]} must be at most {MAX_RANK} "
                "non-negative dimensions"
            )
        count = math.prod(shape)  # Python ints: no overflow, whatever was declared
        if count > max_elements:
            raise BadRequest(
                f"{shown} of shape {shape} has {count} elements; the limit is {max_elements}"
            )
        if any(key.startswith("shared_memory") for key in tensor.parameters):
            raise BadRequest(f"{shown}: shared memory is not supported")
        if raw:
            if tensor.HasField("contents"):
                raise BadRequest(f"{shown} has both contents and raw_input_contents")
            if strings:
                arrays[name] = bytes_elements(name, raw[i], shape)
                continue
            need = count * dtype.itemsize
            if len(raw[i]) != need:
                raise BadRequest(
                    f"{shown}: {len(raw[i])} raw bytes, but shape {shape} of "
                    f"{tensor.datatype} is {need} bytes"
                )
            array = np.frombuffer(raw[i], dtype=dtype, count=count).reshape(shape)
            if dtype.kind == "b" and array.size and array.view(np.uint8).max() > 1:
                raise BadRequest(f"{shown}: BOOL bytes must be 0 or 1")
            arrays[name] = array
            continue
        arrays[name] = _from_contents(tensor, shown, dtype, shape)
    return arrays


def _from_contents(
    tensor: pb.ModelInferRequest.InferInputTensor,
    shown: str,
    dtype: np.dtype[Any],
    shape: list[int],
) -> Array:
    """The array of an input's typed ``contents`` (its size is checked against ``shape``)."""
    count = math.prod(shape)
    field = _CONTENTS.get(tensor.datatype)
    if field is None:
        raise BadRequest(f"{shown}: {tensor.datatype} travels as raw_input_contents only")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise BadRequest(f"{shown}: {len(values)} values for shape {shape} ({count} values)")
    if dtype == np.dtype(object):  # BYTES
        try:
            text = [bytes(v).decode() for v in values]
        except UnicodeDecodeError:
            raise BadRequest(f"{shown}: a BYTES element is not UTF-8") from None
        array = np.empty(count, dtype=object)
        array[:] = text
        return array.reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if values and (min(values) < info.min or max(values) > info.max):
            raise BadRequest(f"{shown}: data outside {info.min}..{info.max}")
    return np.array(values, dtype=dtype).reshape(shape)


# ---- encoding ----------------------------------------------------------------------------


def _parameter(value: object) -> pb.InferParameter:
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    return pb.InferParameter(string_param=str(value))


def encode_response(
    outputs: dict[str, Array],
    wanted: dict[str, bool] | list[str],
    model_name: str,
    version: str,
    request_id: str | None,
    parameters: dict[str, Any],
) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` of a reply's parts (``http.reply_parts``'s, or what
    crossed the hop): the ``wanted`` outputs, in order, as ``raw_output_contents`` (gRPC
    has no JSON outputs: whether each would go binary is moot), the ``parameters``
    (affinity's facts; None values left out)."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=version,
                                     id=request_id or "")  # fmt: skip
    for key, value in parameters.items():
        if value is not None:
            response.parameters[key].CopyFrom(_parameter(value))
    for name in wanted:
        array = outputs[name]
        response.outputs.add(name=name, datatype=DATATYPE_OF[array.dtype], shape=array.shape)
        response.raw_output_contents.append(tensor_bytes(array))
    return response


# ---- streams -----------------------------------------------------------------------------

STREAM_FIRST_S = 10.0
STREAM_QUIET_S = 0.05
STREAM_DRAINED = 256


async def drain(requests: AsyncIterator[Any]) -> None:
    """Read and drop what a refused stream's client sends, until it stops.

    It stops when the client half-closes, or sends nothing for :data:`STREAM_QUIET_S` after
    a request (:data:`STREAM_FIRST_S` before the first). It also stops once the client has
    sent :data:`STREAM_DRAINED` requests. A status sent while the client still writes
    reaches it as grpc's own ``INTERNAL``, not as the status the node sent. ("Internal
    error from Core": its write failed.)"""
    pending = aiter(requests)
    wait = STREAM_FIRST_S
    with contextlib.suppress(StopAsyncIteration, TimeoutError):
        for _ in range(STREAM_DRAINED):
            await asyncio.wait_for(anext(pending), wait)
            wait = STREAM_QUIET_S
