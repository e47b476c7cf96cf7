"""``POST /internal/act`` (the owner's side of a forward), ``POST /internal/rows`` (the
owner's side of a forward of several episodes' steps), ``POST /internal/move`` (the
new owner's side of a live hand-over) and ``POST /internal/ghost`` (a ghost step from an
owner that does not run a shadow's candidate, ``node/shadow.py``); not a public API.

Every request is authenticated by the cluster secret header, checked here once
(:func:`admit`), and its body decoded here: a :class:`node.forward.Forward` in msgpack, or
a hand-over's message (:func:`node.transfer.decode_move`); the owner gets them decoded.
The reply is the :class:`~node.step.Reply` in msgpack. Or it is an error in
the project's JSON shape with the status the router acts on. 409/421: resolve again. 503
with ``Retry-After``: pass on to the client.

``/internal/rows``' body is ``{"rows": [Forward, ...]}`` (each one forward's msgpack, as
``/internal/act`` takes it). The owner serves the rows concurrently, so rows on one
device join one batch of its worker. The reply is ``{"rows": [...]}`` in msgpack, in
order: ``{"status": 200, "reply": <the Reply's msgpack>}`` or ``{"status", "code",
"message", "retry_after"}`` (``node.errors.outcome`` of the row's error, which the router
acts on as it does for one forward).
"""

from __future__ import annotations

import hmac
from typing import Any

from prometheus_client import Counter

from affinity import wire
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
from node.errors import (
    BodyError,
    ClientGone,
    ModelNotServed,
    Refused,
    TransferError,
    Unavailable,
    outcome,
)
from node.forward import CONTENT_TYPE, SECRET_HEADER, Forward, GhostStep, encode_reply
from node.jobs import together
from node.service import NodeService
from node.step import Reply
from node.transfer import Install, Settle, decode_move

__all__ = ["admit", "ghost", "handle", "move", "rows"]

_SECRET = SECRET_HEADER.lower().encode()


def admit(service: NodeService, scope: Scope) -> None:
    """Refuse (403 ``bad_secret``) a request to ``/internal/*`` without the cluster secret
    (``AFFINITY_CLUSTER_SECRET``; unset: every request passes), compared in constant time.
    The node's one check of it."""
    expected = (service.config.cluster_secret or "").encode()
    if expected and not hmac.compare_digest((header(scope, _SECRET) or "").encode(), expected):
        raise Refused(403, "bad_secret", "missing or wrong cluster secret")


def _forward(body: bytes) -> Forward:
    """One forward's body decoded; raises :class:`Refused` 400 ``bad_forward``."""
    try:
        return Forward.decode(body)
    except ValueError as exc:
        raise Refused(400, "bad_forward", str(exc)) from None


def _move_message(service: NodeService, body: bytes) -> Install | Settle:
    """A hand-over's message decoded against the models served here. Raises
    :class:`Refused`: 400 ``bad_forward`` (not msgpack), 421 ``not_owner`` (a model not
    served here), 422 ``bad_record`` (a record that does not fit its model)."""
    mover = service.owner.mover
    try:
        ghosts = {} if mover.ghosts is None else mover.ghosts.contracts
        return decode_move(body, mover.contracts, mover.clock(), ghosts)
    except wire.WireError as exc:
        raise Refused(400, "bad_forward", str(exc)) from None
    except ModelNotServed as exc:
        raise Refused(421, "not_owner", f"node {service.node_id}: {exc}") from None
    except TransferError as exc:
        raise Refused(422, "bad_record", str(exc)) from None


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
        received = service.owner.clock()
        admit(service, scope)
        work = service.owner.serve_forwarded(_forward(body), received)
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
        admit(service, scope)
        message = _move_message(service, body)
        await service.owner.mover.receive(message, service.owner.local_devices)
    except (BodyError, Unavailable, Refused) as exc:
        await respond_error(send, exc, _counted(service, exc))
        return
    await respond(send, 204, b"")


async def ghost(service: NodeService, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI handler of ``POST /internal/ghost``: a ghost step from the owner of a live
    episode that does not run the shadow's candidate (``node/shadow.py``), taken for a
    ghost here; 204 (its run comes later, when this node is quiet), 400 ``bad_forward``,
    or 421 ``not_owner`` (no such shadow on, or its candidate not run here)."""
    try:
        body = await read_body(scope, receive, service.config.max_body_bytes)
        admit(service, scope)
        try:
            message = GhostStep.decode(body)
        except ValueError as exc:
            raise Refused(400, "bad_forward", str(exc)) from None
        if not service.shadow.receive(message):
            raise Refused(421, "not_owner", f"node {service.node_id} runs no ghost of "
                          f"{message.candidate} beside {message.live}")  # fmt: skip
    except (BodyError, Refused) as exc:
        await respond_error(send, exc, _counted(service, exc))
        return
    await respond(send, 204, b"")


async def rows(service: NodeService, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI handler of ``POST /internal/rows``: each row as ``/internal/act`` serves
    one forward, concurrently; one row's error never touches another's. The router going
    away cancels the rows not done and undoes the ones done (as for one forward)."""
    done: list[Reply] = []
    try:
        body = await read_body(scope, receive, service.config.max_body_bytes)
        received = service.owner.clock()  # every row's: they came together
        admit(service, scope)
        try:
            doc = wire.decode(body)
            forwards = doc["rows"] if isinstance(doc, dict) else None
        except (ValueError, KeyError) as exc:
            raise Refused(400, "bad_forward", f"not a message of rows: {exc}") from None
        if not isinstance(forwards, list) or not all(isinstance(f, bytes) for f in forwards):
            raise Refused(400, "bad_forward", "a message of rows is {rows: [forward, ...]}")
        if len(forwards) > service.config.max_rows:
            raise Refused(413, "too_many_rows", f"{len(forwards)} rows; the limit is "
                          f"{service.config.max_rows}")  # fmt: skip

        async def one(forward: bytes) -> dict[str, Any]:
            try:
                reply = await service.owner.serve_forwarded(_forward(forward), received)
            except Exception as exc:  # the row's error
                o = outcome(exc)
                return {"status": o.status, "code": o.code, "message": o.message,
                        "retry_after": o.retry_after}  # fmt: skip
            if reply is None:  # an undo or a release
                return {"status": 204}
            done.append(reply)
            return {"status": 200, "reply": encode_reply(reply)}

        # one device's rows join one run (node.jobs.together): not the first alone, inline
        work = together(service.router.arrivals, [one(f) for f in forwards],
                        batch=len(forwards) > 1)  # fmt: skip
        answers = await while_connected(receive, work, scope.get(CONNECTION))
    except ClientGone:
        for reply in done:  # nobody will read them: undone (unless held for a retry)
            await service.router.undelivered(reply)
        await respond_gone(send)
        return
    except (BodyError, Refused) as exc:
        await respond_error(send, exc, _counted(service, exc))
        return
    scope[STEP_KEY] = (f"{len(answers)} rows", "-", "-")
    await respond(send, 200, wire.encode({"rows": answers}), CONTENT_TYPE.encode())
