"""KServe v2 over gRPC (``inference.GRPCInferenceService``), as the unmodified
``tritonclient.grpc`` (sync, ``aio`` and streams) speaks it, on ``--grpc-port``.

A request decodes (``messages.py``) into ``request.py``'s :class:`InferRequest`. It takes
the HTTP front door's path (Triton's live-sequence rule, ``service.router.act``). So a
sequence sticks to its GPU whichever front door each step used. Failures are the status
codes of KServe HTTP's statuses (``request.kserve_outcome``, one table here). They carry the
node's message (``Abort``). In a stream, one answers that request and the stream goes on,
as Triton's does. The wire and its errors: docs/protocols.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import json_format

from node import VERSION
from node.accesslog import AccessLog
from node.asgi import io_seen
from node.contract import PolicyContract
from node.errors import (
    NotServed,
    outcome,
)
from node.protocols.kserve import request as kserve
from node.protocols.kserve.grpc_front import write_access
from node.protocols.kserve.http import reply_parts
from node.protocols.kserve.messages import (
    HTTP_STATUS,
    SERVICE,
    Abort,
    abort,
    decode_request,
    encode_response,
    stream_infer,
)
from node.protocols.kserve.pb import kserve_pb2 as pb
from node.service import NodeService
from node.step import Reply

__all__ = ["SERVICE", "GrpcFrontDoor", "decode_request", "encode_reply", "start"]

_HTTP_STATUS = HTTP_STATUS
FORWARDED = ("ModelInfer", "ModelStreamInfer")
"""The RPCs a front door process decodes itself (``grpc_front.py``): with fronts, the
core's servicer has no handler for them."""


def encode_reply(
    reply: Reply, request: kserve.InferRequest, model_name: str, rows: str | None = None
) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` of a step: the requested outputs (all by default) as
    ``raw_output_contents``, affinity's facts as parameters. ``rows``: the reply of a
    request of rows (``reply`` holds the stacked outputs), whose one parameter is
    ``rows``."""
    outputs, wanted, version, parameters = reply_parts(reply, request, rows)
    return encode_response(outputs, wanted, model_name, version, request.id, parameters)


# ---- a step whose RPC was cancelled ---------------------------------------------------


async def undo_if_cancelled(service: NodeService, context: Any, reply: Reply) -> None:
    """Undo the step of ``reply`` when its RPC was cancelled before the reply could go.

    The cancel is the client's deadline, or it left. The client sees no reply, so the step
    must not count. A cancel that came with the request is read after :func:`io_seen`; one seen
    while the step awaited cancelled it already (the dispatcher undid it)."""
    try:
        await io_seen()
    except asyncio.CancelledError:
        await service.router.undelivered(reply)
        raise
    if context.cancelled():
        await service.router.undelivered(reply)
        raise asyncio.CancelledError


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
            return await kserve.find_model(self.service, name, version)
        except NotServed as exc:
            raise Abort.of(outcome(exc)) from None

    def _ready(self) -> bool:
        return self.service.lease.may_serve()

    def _check_key(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        metadata = dict(context.invocation_metadata() or ())
        authorization = metadata.get("authorization")
        if not self.service.client_allowed(
            authorization if isinstance(authorization, str) else None
        ):
            self.service.metrics.rejected.labels("unauthorized").inc()
            raise Abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this node wants the metadata authorization: Api-Key <key>",
            )

    def _log(self, context: Any, rpc: str, status: int, started: float, served: list[str]) -> None:
        """One access line (``grpc_front.write_access``)."""
        write_access(self.access, context, rpc, status, started, served)

    def _check_key_logged(self, context: Any, rpc: str) -> None:
        """:meth:`_check_key`, with the access line a refused call gets (401)."""
        started = time.monotonic()
        try:
            self._check_key(context)
        except Abort as exc:
            self._log(context, rpc, _HTTP_STATUS.get(exc.code, 500), started, ["-", "-", "-"])
            raise

    async def infer(
        self, msg: pb.ModelInferRequest, context: Any, rpc: str
    ) -> pb.ModelInferResponse:
        """One step: decoded, routed, encoded and logged (one access line, see
        :meth:`_log`); raises :class:`Abort`."""
        started = time.monotonic()
        served: list[str] = ["-", "-", "-"]  # episode, device, routing
        status = 500
        try:
            reply = await self._infer(msg, context, started, served)
            status = 200
            return reply
        except Abort as exc:
            status = _HTTP_STATUS.get(exc.code, 500)
            raise
        finally:
            self._log(context, rpc, status, started, served)

    async def _infer(
        self, msg: pb.ModelInferRequest, context: Any, started: float, served: list[str]
    ) -> pb.ModelInferResponse:
        service = self.service
        found = await self._check_model(msg.model_name, msg.model_version)
        name = found[0]
        request: kserve.InferRequest | None = None
        try:
            request = decode_request(msg, max_rows=service.config.max_rows)
            budget = service.config.act_deadline_s
            if request.timeout_s is not None:
                budget = min(budget, request.timeout_s)
            remaining = context.time_remaining()  # the client's gRPC deadline, if it set one
            if remaining is not None:
                budget = min(budget, remaining)
            if request.rows is not None:
                return await self._infer_rows(msg, request, started, budget, found, context)
            step = await kserve.service_step(
                service, request, started + budget, name, msg.model_version or None, found
            )
            step.door, step.received = "kserve_grpc", started
            served[0] = step.episode or "-"
            reply = await service.router.act(step)
            served[1:] = [reply.device, reply.routing]
            await undo_if_cancelled(service, context, reply)
            kserve.stats_for(service, name).answered(time.monotonic() - started)
        except kserve.REFUSED as exc:
            raise Abort.of(kserve.kserve_outcome(service, name, exc, request)) from None
        return encode_reply(reply, request, name)

    async def _infer_rows(
        self,
        msg: pb.ModelInferRequest,
        request: kserve.InferRequest,
        started: float,
        budget: float,
        found: tuple[str, Any],
        context: Any,
    ) -> pb.ModelInferResponse:
        """A request of rows (``episode_ids``): as KServe HTTP answers one
        (``node/protocols/kserve/http.py``); rows whose reply cannot go are undone."""
        service, name = self.service, found[0]
        served: list[Reply | Exception | None] = []
        try:
            results = await kserve.serve_rows(service, request, started + budget, name,
                                              msg.model_version or None, found, "kserve_grpc",
                                              served)  # fmt: skip
            await io_seen()  # a cancel that came meanwhile (see undo_if_cancelled)
            if context.cancelled():
                raise asyncio.CancelledError
        except asyncio.CancelledError:  # nobody will read the replies: undone
            for r in served:
                if isinstance(r, Reply):
                    await service.router.undelivered(r)
            raise
        outputs, rows, first = kserve.stack_rows(found[1], results, name)
        if request.outputs is not None and first is None:
            request.outputs = None
        kserve.stats_for(service, name).answered(time.monotonic() - started)
        reply = Reply(outputs, None, "", service.node_id, 0, "rows", False, False,
                      model=first.model if first else "")  # fmt: skip
        return encode_reply(reply, request, name, rows)

    # -- the RPCs

    async def ServerLive(self, msg: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, msg: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, msg: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        try:
            await self._check_model(msg.name, msg.version)
        except Abort:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self._ready())

    async def ServerMetadata(
        self, msg: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name="affinity", version=VERSION, extensions=kserve.EXTENSIONS
        )

    async def ModelMetadata(
        self, msg: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        try:
            name, contract = await self._check_model(msg.name, msg.version)
        except Abort as exc:
            await abort(context, exc)
            raise  # unreachable: the abort raises
        doc = kserve.metadata_of(self.service, name, contract)
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
            except Abort as exc:
                await abort(context, exc)
        response = pb.ModelStatisticsResponse()
        for name in names:
            doc = kserve.statistics_of(self.service, name)
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
        except Abort as exc:
            await abort(context, exc)
            raise  # unreachable: the abort raises
        config = json_format.ParseDict(
            kserve.config_of(self.service, name, contract), pb.ModelConfig()
        )
        return pb.ModelConfigResponse(config=config)

    async def ModelInfer(self, msg: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        try:
            self._check_key_logged(context, "ModelInfer")
            return await self.infer(msg, context, "ModelInfer")
        except Abort as exc:
            await abort(context, exc)
            raise AssertionError("abort returns only by raising") from None

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # an async generator itself: grpc.aio takes any other function for a sync one
        async def check_key() -> None:
            self._check_key_logged(context, "ModelStreamInfer")

        async for reply in stream_infer(
            requests, context, check_key, lambda msg: self.infer(msg, context, "ModelStreamInfer")
        ):
            yield reply


def _handlers(door: GrpcFrontDoor, infer: bool = True) -> grpc.GenericRpcHandler:
    """The service's handlers; without ``infer`` (the core of a node with front door
    processes) none for :data:`FORWARDED`: a front decodes those, never this process."""
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
    if not infer:
        for name in FORWARDED:
            del methods[name]
    return grpc.method_handlers_generic_handler(SERVICE, methods)


async def start(
    service: NodeService, host: str, port: int, core: str | None = None
) -> grpc.aio.Server:
    """Start the gRPC front door on ``host:port`` (in the running event loop); the caller
    stops it (``await server.stop(grace)``). Raises ``RuntimeError`` if the port cannot be
    bound. ``core``: with front door processes, the abstract Unix name to serve on instead
    (the RPCs the fronts pass on; no ``ModelInfer`` nor ``ModelStreamInfer``)."""
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
    door = GrpcFrontDoor(service, access)
    server.add_generic_rpc_handlers((_handlers(door, infer=core is None),))
    server.add_insecure_port(f"{host}:{port}" if core is None else f"unix-abstract:{core}")
    await server.start()
    return server
