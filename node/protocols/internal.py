"""``POST /internal/act``: the owner's side of a forward (not a public API).

The body is a :class:`node.forward.Forward` in msgpack, authenticated by the cluster
secret header; the reply is the :class:`~node.step.Reply` in msgpack, or an error in the
project's JSON shape with the status the router acts on (409/421: resolve again; 503 with
``Retry-After``: pass on to the client).
"""

from __future__ import annotations

from node.accesslog import STEP_KEY
from node.asgi import BodyError, Receive, Scope, Send, header, read_body, respond, respond_error
from node.forward import CONTENT_TYPE, SECRET_HEADER, encode_reply
from node.service import NodeService
from node.step import Refused, Unavailable

__all__ = ["handle"]

_SECRET = SECRET_HEADER.lower().encode()


async def handle(service: NodeService, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI handler of ``POST /internal/act``."""
    try:
        body = await read_body(scope, receive, service.config.max_body_bytes)
        reply = await service.routing.serve_forwarded(body, header(scope, _SECRET))
        scope[STEP_KEY] = (reply.episode or "-", reply.device, reply.routing)
    except (BodyError, Unavailable, Refused) as exc:
        if isinstance(exc, Refused) and exc.status == 403:
            service.metrics.rejected.labels("forbidden").inc()
        await respond_error(send, exc)
    else:
        await respond(send, 200, encode_reply(reply), CONTENT_TYPE.encode())
