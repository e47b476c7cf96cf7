"""The frames of openpi's websocket protocol (``node/protocols/openpi.py`` says the
protocol): an observation frame decoded, a reply's timings, openpi's error, the access line
of a step, the watch for a close mid-step. What the front doors (``node/front.py``) and the
node's own door both do with a frame, in one place; it loads nothing of the node's service,
so a front imports it without the models.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, TypeVar

import numpy as np

from affinity import wire
from node.accesslog import STEP_KEY, AccessLog
from node.asgi import Receive, Scope, Send, cancel_when_gone, error_body
from node.errors import InvalidInput, Outcome, Refused

__all__ = [
    "CLOSE_ERROR",
    "FIELDS",
    "denied",
    "fail",
    "finished",
    "log_line",
    "observation",
    "refusal",
    "unauthorized",
    "watching",
]

T = TypeVar("T")

FIELDS = (
    "episode_id", "execute_steps", "ensemble", "seq", "executed", "inference_delay",
    "control_hz", "pending", "timing",
)  # fmt: skip
"""The keys of a one-environment observation frame that are the step's fields, not the
observation (``node/protocols/openpi.py``'s ``decode_observation`` takes them out)."""

CLOSE_ERROR = 1011
UNAUTHORIZED = "this node wants Authorization: Api-Key <key> (openpi-client's api_key)"


def observation(message: Mapping[str, Any], max_rows: int) -> dict[Any, Any]:
    """The observation map of one frame; one of rows past ``max_rows`` is refused
    (413) before any row is decoded. Raises ``wire.WireError``, :class:`InvalidInput`,
    :class:`Refused`."""
    data = message.get("bytes")
    if data is None:
        raise InvalidInput(
            "", "observations are binary msgpack frames, got text", root="observation"
        )
    decoded = wire.decode(data)  # arrays are views of the frame: nothing allocated
    if not isinstance(decoded, dict):
        raise InvalidInput("", "must be a msgpack map", root="observation")
    ids = decoded.get("episode_ids")
    if isinstance(ids, list | np.ndarray) and len(ids) > max_rows:
        raise Refused(413, "too_many_rows", f"{len(ids)} rows in one observation; the limit "
                      f"is {max_rows} (--max-rows)")  # fmt: skip
    return decoded


def finished(
    doc: dict[str, Any],
    device_ms: float | None,
    total_ms: float,
    prev_total_ms: float | None,
    split: dict[str, Any] | None,
) -> dict[str, Any]:
    """A one-environment reply (``doc``: outputs and facts) with openpi's timings
    (``policy_timing``, ``server_timing``) and, when the step asked, ``timing``."""
    doc["policy_timing"] = {"infer_ms": total_ms if device_ms is None else device_ms}
    doc["server_timing"] = {"infer_ms": total_ms}
    if prev_total_ms is not None:
        doc["server_timing"]["prev_total_ms"] = prev_total_ms
    if split is not None:
        doc["timing"] = split
    return doc


def refusal(o: Outcome) -> str:
    """openpi's error text of a refused step: a bad observation says so, else its code."""
    return f"bad observation: {o.message}" if o.invalid else f"{o.code}: {o.message}"


async def fail(send: Send, text: str) -> None:
    """openpi's error: the message as a text frame, then close 1011. A client already gone
    (uvicorn's ``ClientDisconnected``, or the ``RuntimeError`` of a send after a close it
    made itself, a ping unanswered) gets nothing, and that is no crash of the handler."""
    try:
        await send({"type": "websocket.send", "text": text})
        await send({"type": "websocket.close", "code": CLOSE_ERROR, "reason": "policy error"})
    except (OSError, RuntimeError):
        return


def log_line(
    access: AccessLog,
    scope: Scope,
    started: float,
    status: int,
    episode: str | None,
    served: tuple[str, str] | None = None,
) -> None:
    """The access line of one websocket step, as ``WS <path>``: the HTTP status the same
    outcome gets on ``/act`` (200, 400, 422, 503...), the episode, and the device and
    routing of a served step."""
    if not access.enabled:
        return
    device, routing = served or ("-", "-")
    line = {**scope, "method": "WS", STEP_KEY: (episode or "-", device, routing)}
    access.write(line, status, time.monotonic() - started)


async def watching(
    receive: Receive,
    work: Awaitable[T],
    early: list[asyncio.Future[MutableMapping[str, Any]]],
    handing: Callable[[], bool] = lambda: False,
) -> T:
    """Await ``work`` (in this task) while watching the websocket: a close seen while it
    runs cancels it and raises :class:`~node.errors.ClientGone`, unless ``handing()`` says
    its reply is being handed over by then (the send fails instead, and says whether any
    of it went). Work that ends within :data:`~node.asgi.WATCH_AFTER_S` is not watched (no
    task per step). A receive begun to watch longer work is left in ``early``, because
    what it brings is the connection's next message. That is the next observation of a
    robot that did not wait."""

    def watch(gone: Callable[[], None]) -> None:
        def seen(future: asyncio.Future[MutableMapping[str, Any]]) -> None:
            if future.cancelled() or future.exception() is not None:
                return
            if future.result()["type"] == "websocket.disconnect" and not handing():
                gone()

        future = asyncio.ensure_future(receive())
        future.add_done_callback(seen)
        early.append(future)

    return await cancel_when_gone(work, watch)


async def unauthorized(scope: Scope, send: Send, access: AccessLog, started: float) -> None:
    """Refuse the handshake before the upgrade: 401 with the project's JSON error body (a
    server without ASGI's denial-response extension can only close: 403), and its line."""
    challenge = [(b"www-authenticate", b"Api-Key")]
    await denied(
        scope, send, access, started, Outcome(401, "unauthorized", UNAUTHORIZED), challenge
    )


async def denied(
    scope: Scope,
    send: Send,
    access: AccessLog,
    started: float,
    refused: Outcome,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Refuse the handshake before the upgrade with ``refused``'s status and the project's
    JSON error body (``Retry-After`` on a 503 that says one), as the HTTP doors answer it;
    a server without ASGI's denial-response extension can only close: 403. Its line."""
    if "websocket.http.response" in scope.get("extensions", {}):
        extra = list(headers or [])
        if refused.retry_after is not None:
            extra.append((b"retry-after", refused.retry_header.encode()))
        await send({
            "type": "websocket.http.response.start",
            "status": refused.status,
            "headers": [(b"content-type", b"application/json"), *extra],
        })  # fmt: skip
        await send({"type": "websocket.http.response.body",
                    "body": error_body(refused.code, refused.message, refused.field)})  # fmt: skip
        status = refused.status
    else:
        await send({"type": "websocket.close", "code": 1008})
        status = 403
    log_line(access, scope, started, status, None)
