"""KServe v2 over gRPC in a front door process (``--front-doors N`` > 1 with
``--grpc-port``, issue 43): the front's side of ``grpc.py``.

Each front runs a ``grpc.aio`` server on the node's gRPC port with ``SO_REUSEPORT`` (the
core holds the port from before it registers, bound and not listening, so another node
still cannot take it). ``ModelInfer`` and ``ModelStreamInfer`` are decoded here
(``messages.py``: ``raw_input_contents`` and typed ``contents``), cross to the core over the
shared-memory hop as a KServe request (``node/hop.py``'s ``KSERVE``, served by
``http.serve_hop``, which serves it as ``grpc.py``'s servicer would: the client's deadline
joins the step's budget, the steps are the door ``kserve_grpc``'s), and the reply is
encoded here. A call cancelled before its reply could go (the client's deadline, or it
left) has its step undone, as the hop undoes an HTTP step whose client left. The reply's
slot stays the front's (DELIVERING) until gRPC has sent it: a unary call's until the call
is done (cancelled by then: in doubt), a stream's reply until the stream asks for the next
one (the stream ended first: in doubt), so a front that dies while gRPC still holds a
reply leaves its step in doubt (``node/hop.py``). Every other
RPC of the service (health, metadata, config, statistics, and those the node does not
implement) is passed to the core's own gRPC server on an abstract Unix name as raw bytes,
so its answers, statuses and messages stay exactly the core's.

Imports nothing heavy (grpcio, the generated messages, ``body.py``): a front's memory
stays small.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from affinity import InvalidArgument
from node.accesslog import STEP_KEY, AccessLog
from node.checks import Checks
from node.errors import (
    BadRequest,
    BodyError,
    CoreLapsed,
    HopError,
    HopFull,
    Refused,
    Uncarried,
    Undelivered,
    outcome,
)
from node.hop import KSERVE, Array, FrontHop
from node.protocols.kserve.body import InferRequest, reply_of, request_meta, shaped
from node.protocols.kserve.messages import (
    HTTP_STATUS,
    SERVICE,
    Abort,
    abort,
    code_of,
    decode_request,
    encode_response,
    stream_infer,
)
from node.protocols.kserve.pb import kserve_pb2 as pb

__all__ = ["FrontServicer", "start", "write_access"]

INFER = f"/{SERVICE}/ModelInfer"
STREAM = f"/{SERVICE}/ModelStreamInfer"
KEY_MESSAGE = "this node wants the metadata authorization: Api-Key <key>"
_UNFORWARDED = ("user-agent", "te", "content-type")
"""Metadata grpcio sets itself on a call (and every ``grpc-`` key): not passed on."""


Settle = Callable[[bool | None], None]
"""How a held call says whether its reply reached the client (``FrontHop.call``'s hold)."""


def _size(answer: pb.ModelInferResponse | Abort) -> int:
    """The bytes of a reply gRPC holds until it is sent (what a parked one keeps in the
    front: ``node.hop.PARKED_BYTES``); a refusal is settled at once."""
    return answer.ByteSize() if isinstance(answer, pb.ModelInferResponse) else 0


def write_access(
    access: AccessLog, context: Any, rpc: str, status: int, started: float, served: list[str]
) -> None:
    """One access line, like a request to the HTTP front doors: ``GRPC /<service>/<rpc>``
    with the HTTP status the same failure gets over KServe HTTP."""
    if access.enabled:
        peer = str(context.peer() or "").rsplit(":", 1)
        scope = {
            "method": "GRPC",
            "path": f"/{SERVICE}/{rpc}",
            "client": (peer[0].split(":", 1)[-1], peer[1]) if len(peer) == 2 else None,
            STEP_KEY: tuple(served),
        }
        access.write(scope, status, time.monotonic() - started)


class FrontServicer:
    """The front's RPCs: the two infer RPCs over the hop, the rest passed to the core.
    ``allowed`` checks an ``authorization`` value against the node's API key; ``note``
    has the core count a refusal answered here; ``checks``: the KServe input checks the
    core taught this front (``node/checks.py``, shared with its HTTP door)."""

    def __init__(
        self,
        hop: FrontHop,
        core: grpc.aio.Channel,
        access: AccessLog,
        max_rows: int,
        allowed: Callable[[str | None], bool],
        note: Callable[[str], Awaitable[None]],
        checks: Checks | None = None,
    ) -> None:
        self.hop = hop
        self.checks = Checks() if checks is None else checks
        self.core = core
        self.access = access
        self.max_rows = max_rows
        self.allowed = allowed
        self.note = note

    async def _check_key(self, context: Any, rpc: str) -> None:
        """The API key, as the core's servicer checks it (counted, an access line 401)."""
        authorization = dict(context.invocation_metadata() or ()).get("authorization")
        if self.allowed(authorization if isinstance(authorization, str) else None):
            return
        started = time.monotonic()
        await self.note("unauthorized")
        write_access(self.access, context, rpc, 401, started, ["-", "-", "-"])
        raise Abort(grpc.StatusCode.UNAUTHENTICATED, KEY_MESSAGE)

    async def infer(
        self,
        msg: pb.ModelInferRequest,
        context: Any,
        rpc: str,
        held: Callable[[Settle], None],
    ) -> pb.ModelInferResponse:
        """One call's step over the hop, its access line written; raises :class:`Abort`.
        ``held`` gets how to say whether gRPC sent the reply (the slot is held till then)."""
        started = time.monotonic()
        served = ["-", "-", "-"]  # episode, device, routing
        status = 500
        try:
            reply = await self._infer(msg, context, started, served, held)
            status = 200
            return reply
        except Abort as exc:
            status = HTTP_STATUS.get(exc.code, 500)
            raise
        finally:
            write_access(self.access, context, rpc, status, started, served)

    async def _infer(
        self,
        msg: pb.ModelInferRequest,
        context: Any,
        started: float,
        served: list[str],
        held: Callable[[Settle], None],
    ) -> pb.ModelInferResponse:
        name, version = msg.model_name, msg.model_version or None
        meta: dict[str, Any] = {"model": name, "version": version}
        arrays: list[Array] = []
        request_id: str | None = None
        ends: list[float] = []  # when the request's own timeout, the client's deadline end
        request: InferRequest | None = None
        try:
            request = decode_request(msg, max_rows=self.max_rows)
        except (BadRequest, BodyError, Refused, InvalidArgument) as exc:
            o = shaped(outcome(exc))
            meta["refused"] = [o.status, o.message, o.reject_reason, []]
        else:
            meta, arrays = request_meta(request, name, version, self.checks)
            request_id = request.id
            if request.timeout_s is not None:
                ends.append(started + request.timeout_s)
            if request.rows is None:
                served[0] = request.episode or "-"
        meta["recv"] = started
        meta["grpc"] = client_s = context.time_remaining()  # the client's deadline, if any
        if client_s is not None:
            ends.append(time.monotonic() + client_s)

        def use(
            kind: int, reply: dict[str, Any], views: list[Array]
        ) -> pb.ModelInferResponse | Abort | None:
            if "chk" in reply:
                self.checks.learn(reply["chk"])
            if reply.get("recheck"):  # checked against a contract no longer the model's
                return None
            err = reply.get("kerr")
            if err is not None:
                status, message, headers = err
                retry = [bytes(v).decode() for k, v in headers if bytes(k) == b"retry-after"]
                return Abort(code_of(status), message, retry[0] if retry else None)
            if served[0] != "-":
                served[1:] = reply["log"][1:]
            outputs, wanted, served_version, parameters = reply_of(reply, views)
            return encode_response(outputs, wanted, reply["name"], served_version, request_id,
                                   parameters)  # fmt: skip

        try:
            for first in (True, False):
                if not first:  # the core refused the check, before anything changed
                    assert request is not None
                    meta, arrays = request_meta(request, name, version)
                    meta["recv"], meta["grpc"] = started, context.time_remaining()
                answer, settle = await self.hop.call(  # a slot waited for no longer than its
                    KSERVE, meta, arrays, use, context.cancelled,  # deadline
                    wait_s=min(ends) - time.monotonic() if ends else None, hold=True,
                    size=_size, ahead=not first,  # (a check refused: sent again at once)
                )  # fmt: skip
                if answer is not None:
                    break
                settle(True)  # (the refused check: nothing to deliver, no step applied)
        except HopFull as exc:  # busy, or its deadline passed while it waited for a slot
            why = shaped(outcome(exc.refusal())).message
            raise Abort(grpc.StatusCode.UNAVAILABLE, why, "1") from None
        except CoreLapsed as exc:  # the core is stuck past its lease: try another node
            raise Abort(grpc.StatusCode.UNAVAILABLE, shaped(outcome(exc)).message, "1") from None
        except (Uncarried, HopError) as exc:
            raise Abort(code_of(413), str(exc) or "the request does not fit the hop") from None
        except Undelivered:  # the call was cancelled: its step was undone
            raise asyncio.CancelledError from None
        if isinstance(answer, Abort):  # refused: no step applied
            settle(True)
            raise answer
        assert isinstance(answer, pb.ModelInferResponse)
        held(settle)
        return answer

    async def model_infer(self, msg: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        def held(settle: Settle) -> None:  # sent once the call is done, unless cancelled
            context.add_done_callback(lambda done: settle(None if done.cancelled() else True))

        try:
            await self._check_key(context, "ModelInfer")
            return await self.infer(msg, context, "ModelInfer", held)
        except Abort as exc:
            await abort(context, exc)
            raise AssertionError("abort returns only by raising") from None

    async def model_stream_infer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # an async generator itself: grpc.aio takes any other function for a sync one
        pending: list[Settle] = []  # the reply yielded last: sent once the next is asked for

        def ended(_: Any) -> None:  # (cancelled mid-write, gRPC may not close the generator)
            for settle in pending:
                settle(None)

        context.add_done_callback(ended)
        try:
            async for reply in stream_infer(
                requests,
                context,
                lambda: self._check_key(context, "ModelStreamInfer"),
                lambda msg: self.infer(msg, context, "ModelStreamInfer", pending.append),
            ):
                yield reply
                for settle in pending:  # gRPC wrote it before it asked for the next
                    settle(True)
                pending.clear()
        finally:
            for settle in pending:  # the stream ended with it perhaps unsent
                settle(None)

    def forward(self, method: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        """The handler that passes ``method``'s calls to the core as bytes."""
        call = self.core.unary_unary(method)  # no serializers: the bytes as they came

        async def forward(request: bytes, context: Any) -> bytes:
            metadata = tuple(
                (k, v)
                for k, v in context.invocation_metadata() or ()
                if not k.startswith("grpc-") and k not in _UNFORWARDED
            )
            try:
                answer: bytes = await call(
                    request, metadata=metadata, timeout=context.time_remaining()
                )
            except grpc.aio.AioRpcError as exc:
                trailing = tuple(
                    (k, v) for k, v in exc.trailing_metadata() or () if not k.startswith("grpc-")
                )
                if trailing:
                    context.set_trailing_metadata(trailing)
                await context.abort(exc.code(), exc.details() or "")
                raise AssertionError("abort returns only by raising") from None
            return answer

        return forward


class _Handlers(grpc.GenericRpcHandler):  # type: ignore[misc]
    """The two infer RPCs decoded here; any other of the service passed to the core."""

    def __init__(self, servicer: FrontServicer) -> None:
        self.servicer = servicer
        self.infer = grpc.unary_unary_rpc_method_handler(
            servicer.model_infer,
            request_deserializer=pb.ModelInferRequest.FromString,
            response_serializer=pb.ModelInferResponse.SerializeToString,
        )
        self.stream = grpc.stream_stream_rpc_method_handler(
            servicer.model_stream_infer,
            request_deserializer=pb.ModelInferRequest.FromString,
            response_serializer=pb.ModelStreamInferResponse.SerializeToString,
        )
        self.passed: dict[str, grpc.RpcMethodHandler] = {}

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        if method == INFER:
            return self.infer
        if method == STREAM:
            return self.stream
        if not method.startswith(f"/{SERVICE}/"):
            return None  # grpc's own UNIMPLEMENTED, as the core answers it
        handler = self.passed.get(method)
        if handler is None:
            if len(self.passed) >= 64:  # a client's made-up names do not grow this
                return grpc.unary_unary_rpc_method_handler(self.servicer.forward(method))
            handler = self.passed[method] = grpc.unary_unary_rpc_method_handler(
                self.servicer.forward(method)
            )
        return handler


async def start(
    servicer_of: Callable[[grpc.aio.Channel], FrontServicer],
    host: str,
    port: int,
    core: str,
    max_bytes: int,
) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    """The front's gRPC server on ``host:port`` (``SO_REUSEPORT``: every front and the
    core's reservation share it), started, and its channel to the core's server on the
    abstract Unix name ``core``. Raises ``RuntimeError`` if the port cannot be bound."""
    limits = [("grpc.max_receive_message_length", max_bytes),
              ("grpc.max_send_message_length", max_bytes)]  # fmt: skip
    channel = grpc.aio.insecure_channel(f"unix-abstract:{core}", options=limits)
    server = grpc.aio.server(options=[*limits, ("grpc.so_reuseport", 1)])
    server.add_generic_rpc_handlers((_Handlers(servicer_of(channel)),))
    try:
        server.add_insecure_port(f"{host}:{port}")
        await server.start()
    except BaseException:
        await channel.close()
        raise
    return server, channel
