"""KServe v2 over gRPC (``inference.GRPCInferenceService``), as the unmodified
``tritonclient.grpc`` (sync, ``aio`` and streams) speaks it, on ``--grpc-port``.

A request decodes into ``request.py``'s :class:`InferRequest` and takes the HTTP front
door's path (Triton's live-sequence rule, ``service.router.act``), so a sequence sticks to
its GPU whichever front door each step used. Sizes are checked before an array exists;
raw inputs are views of the received bytes. Failures are status codes with the node's
message (``_Abort``); in a stream, one answers that request and the stream goes on, as
Triton's does. The wire and its errors: docs/protocols.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from affinity import InvalidArgument, UnknownEpisode
from affinity.wire import MAX_ELEMENTS
from node.accesslog import STEP_KEY, AccessLog
from node.asgi import io_seen
from node.contract import PolicyContract
from node.inputs import InvalidInput
from node.lease import VERSION
from node.protocols.kserve.pb import kserve_pb2 as pb
from node.protocols.kserve.request import (
    EXTENSIONS,
    InferRequest,
    NotServed,
    config_of,
    episode_of,
    find_model,
    metadata_of,
    not_live,
    service_step,
    statistics_of,
    stats_for,
    timing_parameters,
)
from node.protocols.kserve.tensors import (
    DATATYPE_OF,
    DATATYPES,
    MAX_RANK,
    MAX_TENSORS,
    BadRequest,
    bytes_elements,
    tensor_bytes,
)
from node.service import NodeService
from node.step import Array, Refused, Reply, Unavailable

__all__ = ["SERVICE", "GrpcFrontDoor", "decode_request", "encode_reply", "start"]

SERVICE = "inference.GRPCInferenceService"
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
_REFUSED = {403: grpc.StatusCode.PERMISSION_DENIED, 500: grpc.StatusCode.INTERNAL}
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.UNAVAILABLE: 503,
}
"""The HTTP status an access line gives a gRPC status (as KServe HTTP would answer)."""


class _Abort(Exception):
    """A request answered with a gRPC status (``code``) and the node's message."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None):
        self.code = code
        self.retry_after = retry_after
        super().__init__(message)


# ---- a step whose RPC was cancelled ---------------------------------------------------


async def undo_if_cancelled(service: NodeService, context: Any, reply: Reply) -> None:
    """Undo the step of ``reply`` when its RPC was cancelled (the client's deadline, or it
    left) before the reply could go: the client sees no reply, so the step must not
    count. A cancel that came with the request is read after :func:`io_seen`; one seen
    while the step awaited cancelled it already (the dispatcher undid it)."""
    try:
        await io_seen()
    except asyncio.CancelledError:
        await service.router.undelivered(reply)
        raise
    if context.cancelled():
        await service.router.undelivered(reply)
        raise asyncio.CancelledError


# ---- decoding ----------------------------------------------------------------------------


def _value(param: pb.InferParameter) -> Any:
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be a bool_param")
    return value


def decode_request(msg: pb.ModelInferRequest, *, max_elements: int = MAX_ELEMENTS) -> InferRequest:
    """The :class:`InferRequest` of one ``ModelInferRequest``. Raises :class:`BadRequest`
    (``INVALID_ARGUMENT``); allocates nothing from a declared size before checking it."""
    params = {key: _value(p) for key, p in msg.parameters.items()}
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
        timeout_s=timeout / 1e6 if timeout else None,
        execute_steps=steps,
        ensemble=ensemble,
        seq=seq,
        executed=params.get("executed"),
        inference_delay=params.get("inference_delay"),
        control_hz=params.get("control_hz"),
        timing=_flag(params, "timing"),
        pending=params.get("pending"),
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
        field = _CONTENTS.get(tensor.datatype)
        if field is None:
            raise BadRequest(f"{shown}: {tensor.datatype} travels as raw_input_contents only")
        values = getattr(tensor.contents, field)
        if len(values) != count:
            raise BadRequest(f"{shown}: {len(values)} values for shape {shape} ({count} values)")
        if strings:
            try:
                text = [bytes(v).decode() for v in values]
            except UnicodeDecodeError:
                raise BadRequest(f"{shown}: a BYTES element is not UTF-8") from None
            array = np.empty(count, dtype=object)
            array[:] = text
            arrays[name] = array.reshape(shape)
            continue
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            if values and (min(values) < info.min or max(values) > info.max):
                raise BadRequest(f"{shown}: data outside {info.min}..{info.max}")
        arrays[name] = np.array(values, dtype=dtype).reshape(shape)
    return arrays


# ---- encoding ----------------------------------------------------------------------------


def _parameter(value: object) -> pb.InferParameter:
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    return pb.InferParameter(string_param=str(value))


def encode_reply(reply: Reply, request: InferRequest, model_name: str) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` of a step: the requested outputs (all by default) as
    ``raw_output_contents``, affinity's facts as parameters."""
    names = list(reply.outputs) if request.outputs is None else list(request.outputs)
    response = pb.ModelInferResponse(
        model_name=model_name,
        model_version=reply.model.partition("@")[2],
        id=request.id or "",
    )
    facts = reply.facts(flat=True)
    if request.timing:
        facts.update(timing_parameters(reply))
    for key, value in facts.items():
        if value is not None:
            response.parameters[key].CopyFrom(_parameter(value))
    for name in names:
        array = reply.outputs[name]
        response.outputs.add(name=name, datatype=DATATYPE_OF[array.dtype], shape=array.shape)
        response.raw_output_contents.append(tensor_bytes(array))
    return response


# ---- the service -------------------------------------------------------------------------


class GrpcFrontDoor:
    """The RPC handlers of one node (``grpc.aio``), each a thin shell over the shared
    KServe logic and ``service.router``."""

    def __init__(self, service: NodeService, access: AccessLog) -> None:
        self.service = service
        self.access = access
        self.model_name = service.config.model_name or service.config.model.stem

    # -- helpers

    async def _check_model(self, name: str, version: str) -> tuple[str, PolicyContract]:
        """The model a request names, served by some live node, and its contract."""
        try:
            return await find_model(self.service, name, version)
        except NotServed as exc:
            raise _Abort(grpc.StatusCode.NOT_FOUND, str(exc)) from None

    def _ready(self) -> bool:
        return self.service.lease.may_serve()

    def _check_key(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        metadata = dict(context.invocation_metadata() or ())
        authorization = metadata.get("authorization")
        if not self.service.client_allowed(
            authorization if isinstance(authorization, str) else None
        ):
            self.service.metrics.rejected.labels("unauthorized").inc()
            raise _Abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this node wants the metadata authorization: Api-Key <key>",
            )

    async def _abort(self, context: grpc.aio.ServicerContext[Any, Any], exc: _Abort) -> None:
        if exc.retry_after is not None:
            context.set_trailing_metadata((("retry-after", str(max(1, round(exc.retry_after)))),))
        await context.abort(exc.code, str(exc))

    def _log(self, context: Any, rpc: str, status: int, started: float, served: list[str]) -> None:
        """One access line, like a request to the HTTP front doors: ``GRPC /<service>/<rpc>``
        with the HTTP status the same failure gets over KServe HTTP."""
        if self.access.enabled:
            peer = str(context.peer() or "").rsplit(":", 1)
            scope = {
                "method": "GRPC",
                "path": f"/{SERVICE}/{rpc}",
                "client": (peer[0].split(":", 1)[-1], peer[1]) if len(peer) == 2 else None,
                STEP_KEY: tuple(served),
            }
            self.access.write(scope, status, time.monotonic() - started)

    def _check_key_logged(self, context: Any, rpc: str) -> None:
        """:meth:`_check_key`, with the access line a refused call gets (401)."""
        started = time.monotonic()
        try:
            self._check_key(context)
        except _Abort as exc:
            self._log(context, rpc, _HTTP_STATUS.get(exc.code, 500), started, ["-", "-", "-"])
            raise

    async def infer(
        self, msg: pb.ModelInferRequest, context: Any, rpc: str
    ) -> pb.ModelInferResponse:
        """One step: decoded, routed, encoded and logged (one access line, see
        :meth:`_log`); raises :class:`_Abort`."""
        started = time.monotonic()
        served: list[str] = ["-", "-", "-"]  # episode, device, routing
        status = 500
        try:
            reply = await self._infer(msg, context, started, served)
            status = 200
            return reply
        except _Abort as exc:
            status = _HTTP_STATUS.get(exc.code, 500)
            raise
        finally:
            self._log(context, rpc, status, started, served)

    async def _infer(
        self, msg: pb.ModelInferRequest, context: Any, started: float, served: list[str]
    ) -> pb.ModelInferResponse:
        service = self.service
        rejected = service.metrics.rejected
        found = await self._check_model(msg.model_name, msg.model_version)
        name = found[0]
        try:
            request = decode_request(msg)
            budget = service.config.act_deadline_s
            if request.timeout_s is not None:
                budget = min(budget, request.timeout_s)
            remaining = context.time_remaining()  # the client's gRPC deadline, if it set one
            if remaining is not None:
                budget = min(budget, remaining)
            step = await service_step(
                service, request, started + budget, name, msg.model_version or None, found
            )
            step.door, step.received = "kserve_grpc", started
            served[0] = step.episode or "-"
            reply = await service.router.act(step)
            served[1:] = [reply.device, reply.routing]
            await undo_if_cancelled(service, context, reply)
            stats_for(service, name).answered(time.monotonic() - started)
        except UnknownEpisode:  # Triton's rule, decided in the step's own resolve
            rejected.labels("bad_input").inc()
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT, not_live(request.sequence, name)
            ) from None
        except BadRequest as exc:
            rejected.labels(exc.reason).inc()
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except (InvalidInput, InvalidArgument) as exc:
            rejected.labels("bad_input").inc()
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except Unavailable as exc:
            stats_for(service, name).failed()
            raise _Abort(
                grpc.StatusCode.UNAVAILABLE, f"{exc.reason}: {exc}", exc.retry_after
            ) from None
        except Refused as exc:
            if exc.status == 403:
                rejected.labels("forbidden").inc()
            if exc.status == 500:
                stats_for(service, name).failed()
            code = _REFUSED.get(exc.status, grpc.StatusCode.ABORTED)
            raise _Abort(code, f"{exc.reason}: {exc}") from None
        return encode_reply(reply, request, name)

    # -- the RPCs

    async def ServerLive(self, msg: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, msg: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, msg: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        try:
            await self._check_model(msg.name, msg.version)
        except _Abort:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self._ready())

    async def ServerMetadata(
        self, msg: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="affinity", version=VERSION, extensions=EXTENSIONS)

    async def ModelMetadata(
        self, msg: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        try:
            name, contract = await self._check_model(msg.name, msg.version)
        except _Abort as exc:
            await self._abort(context, exc)
            raise  # unreachable: the abort raises
        doc = metadata_of(self.service, name, contract)
        response = pb.ModelMetadataResponse(
            name=doc["name"], versions=doc["versions"], platform=doc["platform"]
        )
        for key in ("inputs", "outputs"):
            for t in doc[key]:
                getattr(response, key).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return response

    async def ModelStatistics(
        self, msg: pb.ModelStatisticsRequest, context: Any
    ) -> pb.ModelStatisticsResponse:
        names = list(self.service.models)  # no name: every model served here
        if msg.name:
            try:
                names = [(await self._check_model(msg.name, msg.version))[0]]
            except _Abort as exc:
                await self._abort(context, exc)
        response = pb.ModelStatisticsResponse()
        for name in names:
            doc = statistics_of(self.service, name)
            entry = response.model_stats.add(
                name=doc["name"],
                version=doc["version"],
                last_inference=doc["last_inference"],
                inference_count=doc["inference_count"],
                execution_count=doc["execution_count"],
            )
            for key, value in doc["inference_stats"].items():
                getattr(entry.inference_stats, key).CopyFrom(pb.StatisticDuration(**value))
        return response

    async def ModelConfig(self, msg: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        try:
            name, contract = await self._check_model(msg.name, msg.version)
        except _Abort as exc:
            await self._abort(context, exc)
            raise  # unreachable: the abort raises
        config = json_format.ParseDict(config_of(self.service, name, contract), pb.ModelConfig())
        return pb.ModelConfigResponse(config=config)

    async def ModelInfer(self, msg: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        try:
            self._check_key_logged(context, "ModelInfer")
            return await self.infer(msg, context, "ModelInfer")
        except _Abort as exc:
            await self._abort(context, exc)
            raise AssertionError("abort returns only by raising") from None

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        try:
            self._check_key_logged(context, "ModelStreamInfer")
        except _Abort as exc:
            await _drain(requests)
            await self._abort(context, exc)
        async for msg in requests:
            try:
                reply = await self.infer(msg, context, "ModelStreamInfer")
            except _Abort as exc:
                yield pb.ModelStreamInferResponse(
                    error_message=str(exc),
                    infer_response=pb.ModelInferResponse(id=msg.id),
                )
            else:
                yield pb.ModelStreamInferResponse(infer_response=reply)


STREAM_FIRST_S = 10.0
STREAM_QUIET_S = 0.05
STREAM_DRAINED = 256


async def _drain(requests: AsyncIterator[pb.ModelInferRequest]) -> None:
    """Read and drop what a refused stream's client sends, until it half-closes, sends
    nothing for :data:`STREAM_QUIET_S` after a request (:data:`STREAM_FIRST_S` before the
    first), or has sent :data:`STREAM_DRAINED` requests. A status sent while the client
    still writes reaches it as grpc's own ``INTERNAL`` ("Internal error from Core": its
    write failed), not as the status the node sent."""
    pending = aiter(requests)
    wait = STREAM_FIRST_S
    with contextlib.suppress(StopAsyncIteration, TimeoutError):
        for _ in range(STREAM_DRAINED):
            await asyncio.wait_for(anext(pending), wait)
            wait = STREAM_QUIET_S


def _handlers(door: GrpcFrontDoor) -> grpc.GenericRpcHandler:
    unary = grpc.unary_unary_rpc_method_handler
    methods: dict[str, grpc.RpcMethodHandler] = {
        name: unary(
            getattr(door, name),
            request_deserializer=getattr(pb, f"{request}Request").FromString,
            response_serializer=getattr(pb, f"{response}Response").SerializeToString,
        )
        for name, request, response in (
            ("ServerLive", "ServerLive", "ServerLive"),
            ("ServerReady", "ServerReady", "ServerReady"),
            ("ModelReady", "ModelReady", "ModelReady"),
            ("ServerMetadata", "ServerMetadata", "ServerMetadata"),
            ("ModelMetadata", "ModelMetadata", "ModelMetadata"),
            ("ModelStatistics", "ModelStatistics", "ModelStatistics"),
            ("ModelConfig", "ModelConfig", "ModelConfig"),
            ("ModelInfer", "ModelInfer", "ModelInfer"),
        )
    }
    methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        door.ModelStreamInfer,
        request_deserializer=pb.ModelInferRequest.FromString,
        response_serializer=pb.ModelStreamInferResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, methods)


async def start(service: NodeService, host: str, port: int) -> grpc.aio.Server:
    """Start the gRPC front door on ``host:port`` (in the running event loop); the caller
    stops it (``await server.stop(grace)``). Raises ``RuntimeError`` if the port cannot be
    bound."""
    limit = service.config.max_body_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # an exclusive port: a second node on it fails to start instead of sharing it
            ("grpc.so_reuseport", 0),
        ]
    )
    config = service.config
    access = AccessLog(
        config.access_log, json=config.log_format == "json", on_drop=service.metrics.log_dropped.inc
    )
    server.add_generic_rpc_handlers((_handlers(GrpcFrontDoor(service, access)),))
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server
