"""``POST /internal/act`` (the owner's side of a forward) and ``POST /internal/move`` (the
new owner's side of a live hand-over); not a public API.

The body is a :class:`node.forward.Forward` in msgpack, authenticated by the cluster
secret header. The reply is the :class:`~node.step.Reply` in msgpack. Or it is an error in
the project's JSON shape with the status the router acts on. 409/421: resolve again. 503
with ``Retry-After``: pass on to the client.
"""

from __future__ import annotations

from prometheus_client import Counter

from node.accesslog import STEP_KEY
from node.asgi import (
    CONNECTION,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    respond,
    respond_error,
    respond_gone,
    while_connected,
)
from node.errors import BodyError, ClientGone, Refused, Unavailable
from node.forward import CONTENT_TYPE, SECRET_HEADER, encode_reply
from node.service import NodeService
from node.step import Reply

__all__ = ["handle", "move"]

_SECRET = SECRET_HEADER.lower().encode()


def _counted(service: NodeService, exc: Exception) -> Counter | None:
    """Where a refused forward counts: a body cut off or too large is the router's, not a
    client's, so only a refusal (403 a wrong secret) counts."""
    return None if isinstance(exc, BodyError) else service.metrics.rejected


async def handle(service: NodeService, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI handler of ``POST /internal/act``.

    The owner serves a forward only while the router still waits. The forward's
    connection may close (the router gave up: its deadline, its client left). Then the
    step is cancelled, or undone if it was applied already (see
    ``node.asgi.while_connected``)."""
    try:
        body = await read_body(scope, receive, service.config.max_body_bytes)
        work = service.owner.serve_forwarded(body, header(scope, _SECRET))
        reply = await while_connected(receive, work, scope.get(CONNECTION))
    except ClientGone as exc:
        if isinstance(exc.result, Reply):
            await service.router.undelivered(exc.result)
        await respond_gone(send)  # never an unanswered request: uvicorn would log a 500
        return
    except (BodyError, Unavailable, Refused) as exc:
        await respond_error(send, exc, _counted(service, exc))
        return
    if reply is None:  # an undo
        await respond(send, 204, b"")
        return
    scope[STEP_KEY] = (reply.episode or "-", reply.device, reply.routing)
    await respond(send, 200, encode_reply(reply), CONTENT_TYPE.encode())


async def move(service: NodeService, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI handler of ``POST /internal/move``: install, confirm or drop a record
    another node hands over (``node/handover.py``); 204, or the error."""
    try:
        body = await read_body(scope, receive, service.config.max_body_bytes)
        await service.owner.mover.receive(body, header(scope, _SECRET), service.owner.local_devices)
    except (BodyError, Unavailable, Refused) as exc:
        await respond_error(send, exc, _counted(service, exc))
        return
    await respond(send, 204, b"")
