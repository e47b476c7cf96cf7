"""A front door process (``--front-doors N`` > 1; the core's side: ``node/fronts.py``).

It accepts on the node's HTTP listening socket, inherited from the core (the core bound it
before it registered), with the node's own HTTP protocol (``node/server.py``); with
``--grpc-port``, on that port too (``node/protocols/kserve/grpc_front.py``: its own
``SO_REUSEPORT`` listener; ``ModelInfer`` and ``ModelStreamInfer`` decoded here, the rest
passed to the core's gRPC server). Decoded here on the HTTP port: ``POST /act`` (the body's
parse, JSON or msgpack, one row or ``{"steps": [...]}``), KServe v2 HTTP infer
(``POST /v2/models/{m}[/versions/{v}]/infer``, JSON or binary tensors:
``node/protocols/kserve/body.py``) and openpi's websocket (its handshake, the API key, each
observation frame's msgpack-numpy decode, each reply's encode and send). Each step's inputs
are written once into a slot of the hop (``node/hop.py``); the core applies the step's
semantics and answers into the slot; the reply is encoded here. Every other HTTP path is
passed to the core's Unix socket as it came (a keep-alive pool), and so is a request the hop
cannot carry (an integer past 64 bits). It keeps no episode state (an openpi connection's
tokens, claims and own episode are the core's, ended when this front goes): killed, it loses
only its connections.

It dies with its parent (``PR_SET_PDEATHSIG``), the node's fork server (``node/forkserver.py``,
which forks it and dies with the core); SIGINT and SIGTERM are the core's to act on
(it keeps serving while the core hands its episodes over): it is born with them blocked
(``node.hop.deaf_children``), so even a front still importing never sees them; SIGUSR1 from
the core stops it gracefully.

Forked by the fork server, which calls :func:`main` with ``INDEX LISTEN_FD REGION_FD ASK_FD
ANSWER_FD PARENT_PID CORE_SOCKET_HEX`` (``python -m node.front`` with those arguments runs
the same), its settings in ``AFFINITY_FRONT_SPEC`` (JSON)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import httpx
import numpy as np
import orjson
import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from affinity import wire
from affinity.wire import WireError
from node import inputs
from node.accesslog import STEP_KEY, AccessLog, JsonFormatter
from node.asgi import (
    CONNECTION,
    Receive,
    Scope,
    Send,
    cross_site,
    error_body,
    header_values,
    io_seen,
    read_body,
    respond,
    respond_error,
    respond_gone,
)
from node.checks import Checks
from node.contract import PolicyContract, checking_contract
from node.errors import (
    BadRequest,
    BodyError,
    ClientGone,
    CoreLapsed,
    HopError,
    HopFull,
    InvalidInput,
    Outcome,
    Refused,
    Uncarried,
    Undelivered,
    outcome,
)
from node.hop import (
    ACT,
    KSERVE,
    NOTE,
    ROWS,
    WS_CLOSE,
    WS_OPEN,
    WS_STEP,
    Array,
    FrontHop,
    Handing,
    Region,
    contiguous,
    die_with_parent,
    lift,
    lower,
)
from node.hop import SharedLoopBuckets as _Lag
from node.httpproto import KeepAliveProtocol
from node.looplag import watch_loop_lag
from node.protocols.body import MSGPACK, encode_doc, is_msgpack, parse, reply_headers
from node.protocols.kserve.body import (
    HEADER_LENGTH,
    INFER_PATH,
    JSON,
    InferRequest,
    decode_infer,
    encode_reply,
    reply_of,
    request_meta,
    shaped,
)
from node.protocols.openpiframe import (
    FIELDS,
    denied,
    fail,
    finished,
    log_line,
    observation,
    refusal,
    unauthorized,
    watching,
)

__all__ = ["main"]

log = logging.getLogger("affinity.node")

TIMING_HEADER = b"x-affinity-timing"  # node/timing.py's, not imported: it loads the models
_HEADERS = (b"content-type", b"accept", b"authorization", TIMING_HEADER)
LAG_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
"""``affinity_event_loop_lag_seconds``' bounds (node/metrics.py), observed into the region."""
_KSERVE_HEADERS = (b"authorization", HEADER_LENGTH, b"content-encoding", TIMING_HEADER)
DISCONNECT_POLL_S = 1.0
"""How often a reply streamed from the core looks whether its client's connection closed."""
_HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te", b"trailer")
)


def _asks_timing(value: str | None) -> bool:
    """``node/timing.py``'s ``asks_timing`` (not imported: it loads the models)."""
    return value is not None and value.strip().lower() in ("1", "true")


def _inputs(raw: Any, binary: bool, arrays: list[Array]) -> dict[str, Any]:
    """A row's inputs for the hop: tensors into ``arrays`` (raw bytes in the slot), what
    is not a rectangular array of numbers as its value (the core decodes it as ``/act``
    does)."""
    if not isinstance(raw, dict):
        return {"raw": raw}
    entries: list[list[Any]] = []
    for name, value in raw.items():
        array = _tensor(value, binary)
        if array is None:
            if binary and _holds_numpy(value):  # the header would make them plain numbers
                raise Uncarried("numpy values inside a list: read by the core's own door")
            entries.append(["v", name, value])
        else:
            entries.append(["n", name])
            arrays.append(array)
    return {"in": entries}


def _holds_numpy(value: Any) -> bool:
    """Whether a msgpack value (lists and maps) holds a numpy scalar or array inside: the
    rule reads their dtypes (``[np.float32(1)]`` for an integer input is refused by one
    process), which a header value would lose."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, np.ndarray | np.generic):
            return True
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return False


def _tensor(value: Any, binary: bool) -> Array | None:
    if binary:
        if isinstance(value, np.ndarray | np.generic) and value.dtype.kind in "biufcUS":
            # a numpy scalar crosses as a 0-d tensor of its dtype: as a header value it
            # would become a Python number (np.float64(3.0) to 3.0), which the rule takes
            # for an integer input where one process refuses the float64
            return contiguous(np.asarray(value))
        return None
    if not isinstance(value, list):
        return None
    try:
        array = np.array(value)
    except (ValueError, OverflowError):
        return None
    if array.dtype.kind not in "biuf" or array.size == 0:
        return None
    if array.dtype.kind != "b" and _has_bool(value):
        return None  # numpy made numbers of JSON's true/false: the core refuses them by name
    if (
        array.dtype.kind == "f"
        and bool(np.all(np.abs(array) < 2**53))
        and bool(np.all(array == np.trunc(array)))
    ):
        array = array.astype(np.int64)  # JSON's whole numbers fit an integer input too
    return array


def _has_bool(value: list[Any]) -> bool:
    """Whether a rectangular nested list (numpy took it whole) holds a ``true``/``false``."""
    if isinstance(value[0], list):
        return any(_has_bool(v) for v in value)
    return bool in map(type, value)


def _connection_check(taught: object) -> tuple[str, PolicyContract] | None:
    """An openpi connection's input check as its open in the core gave it (``[key, doc]``;
    None: its model's inputs are checked in the core)."""
    if not (isinstance(taught, list) and len(taught) == 2 and isinstance(taught[0], str)):
        return None
    try:
        return taught[0], checking_contract(taught[1])
    except ValueError as exc:
        log.warning("the core gave an input check this front cannot read: %s", exc)
        return None


def _observed(
    check: tuple[str, PolicyContract], frame: dict[Any, Any]
) -> tuple[dict[Any, Any], dict[str, Array], list[str]] | None:
    """A one-environment frame's step fields (openpi's ``FIELDS``), its inputs checked and
    converted by the rule the core applies (``inputs.from_observation``) against the
    connection's check, and the observation keys the model does not take (their values
    never cross the hop). None for a frame of rows, one whose observation the check
    refuses (sent as it came: the core says what is wrong), and one whose inputs
    converted would take more bytes than its arrays (uint8 pixels to a float input; lists),
    so that a frame that fit a slot still fits."""
    if "episode_ids" in frame:
        return None
    rest = {k: v for k, v in frame.items() if k not in FIELDS}
    given = _array_bytes(rest)
    if given is None or inputs.observation_grows(check[1], rest):
        return None  # (lists, or a wider dtype: converted they would outgrow what they replace)
    try:
        converted = inputs.from_observation(check[1], rest)
    except InvalidInput:
        return None
    if sum(a.nbytes for a in converted.inputs.values()) > given:
        return None  # the slot holds what the frame's own arrays held, no more
    fields = {k: v for k, v in frame.items() if k in FIELDS}
    return fields, converted.inputs, list(converted.ignored)


def _array_bytes(observation: dict[Any, Any]) -> int | None:
    """The bytes of an observation's arrays, its maps walked (as many levels as the rule
    reads: deeper ones it refuses); None when it holds a list."""
    total = 0
    stack: list[tuple[Any, int]] = [(observation, 0)]
    while stack:
        node, depth = stack.pop()
        for value in node.values():
            if isinstance(value, np.ndarray):
                total += value.nbytes
            elif isinstance(value, list):
                return None
            elif isinstance(value, dict) and depth < inputs.MAX_OBSERVATION_DEPTH:
                stack.append((value, depth + 1))
    return total


def _row(doc: Any, binary: bool, arrays: list[Array], checks: Checks | None) -> dict[str, Any]:
    if not isinstance(doc, dict):
        return {"row": doc}
    fields = {k: v for k, v in doc.items() if k != "inputs"}
    row: dict[str, Any] = {"doc": fields}
    if "inputs" in doc:
        checked = None if checks is None else checks.row(doc, binary, arrays)
        if checked is not None:
            row.update(checked)
        if "in" not in row:
            row.update(_inputs(doc["inputs"], binary, arrays))
    return row


def request(
    doc: dict[str, Any], binary: bool, checks: Checks | None = None
) -> tuple[int, dict[str, Any], list[Array]]:
    """(kind, meta, tensors) of a parsed ``/act`` body, for the hop; ``checks``: the
    inputs of each row whose model they know are checked here (:class:`Checks`)."""
    arrays: list[Array] = []
    if "steps" not in doc:
        return ACT, _row(doc, binary, arrays, checks), arrays
    rows = doc["steps"]
    if len(doc) != 1 or not isinstance(rows, list):
        return ROWS, {"bad": doc}, []
    return ROWS, {"rows": [_row(r, binary, arrays, checks) for r in rows]}, arrays


def _outputs(meta: dict[str, Any], views: list[Array], at: int) -> tuple[dict[str, Any], int]:
    """A reply's outputs by name, in order: its tensors from ``views`` (from ``at``), its
    string outputs by value (``x``: ``hop.lift``); and where the next reply's begin."""
    strings = meta.get("x") or {}
    outputs: dict[str, Any] = {}
    for name in meta["names"]:
        if name in strings:
            outputs[name] = lower(strings[name], [])
        else:
            if at >= len(views):
                raise HopError("fewer tensors than outputs")
            outputs[name] = views[at]
            at += 1
    return outputs, at


def _outcome(err: list[Any]) -> Outcome:
    """The core's refusal as the hop carried it (``node/fronts.py``'s ``_err``)."""
    status, code, message, field, retry_after = err
    return Outcome(int(status), str(code), str(message), retry_after, None, field)


def _answer(
    kind: int, meta: dict[str, Any], views: list[Array], binary: bool
) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
    """(status, body, content type, headers) of the core's reply, encoded here (while the
    outputs are views of the slot)."""
    err = meta.get("err")
    if err is not None:
        o = _outcome(err)
        headers = [] if o.retry_after is None else [(b"retry-after", o.retry_header.encode())]
        return o.status, error_body(o.code, o.message, o.field), b"application/json", headers
    if "rows" in meta:
        at, rows = 0, []
        for row in meta["rows"]:
            if "facts" in row:
                outputs, at = _outputs(row, views, at)
                rows.append({"outputs": outputs, **row["facts"]})
            else:
                rows.append(row)
        body, content_type = encode_doc({"steps": rows}, binary)
        return 200, body, content_type, []
    facts = meta["facts"]
    outputs, _ = _outputs(meta, views, 0)
    doc = {"outputs": outputs, **facts}
    body, content_type = encode_doc(doc, binary)
    return 200, body, content_type, reply_headers(facts, meta.get("url"))


@dataclass(frozen=True)
class _Names:
    """An openpi connection's number (the core's name for it), its ``?episode_id=`` and
    its own episode."""

    number: int
    fixed: str | None
    own: str
    check: tuple[str, PolicyContract] | None = None
    """The connection's input check (its key, the contract rebuilt from it), as its open
    in the core said: each one-environment frame's inputs are checked here with it."""

    def of(self, frame: dict[Any, Any]) -> str | None:
        """The episode of a frame, for an access line the core could not answer (the
        core's ``openpi.Connection`` decides it for every step it serves)."""
        if "episode_ids" in frame:
            return None
        named = frame.get("episode_id")
        if self.fixed or named is None:
            return self.fixed or self.own
        return named if isinstance(named, str) else None


class FrontApp:
    """The front's ASGI app: ``POST /act`` over the hop, the rest to the core."""

    def __init__(self, hop: FrontHop, core: str, spec: dict[str, Any]) -> None:
        self.hop = hop
        self.core = core
        self.api_key: str | None = spec.get("api_key")
        self.max_body = int(spec["max_body_bytes"])
        self.max_rows = int(spec["max_rows"])
        self.access = AccessLog(bool(spec.get("access_log", True)),
                                json=spec.get("log_format") == "json")  # fmt: skip
        self.checks = Checks()
        """The models' input checks, as the core taught them (``/act``: by ``model``)."""
        self.kserve_checks = Checks()
        """... and KServe's (by ``check_name``: gRPC's too, ``grpc_front``)."""
        self.numbers = itertools.count()
        """Each openpi connection's number, the core's name for it."""
        self._closing: set[asyncio.Future[None]] = set()  # closes sent from no request
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=core),
            timeout=httpx.Timeout(None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path, method = scope["path"], scope["method"]
            if path == "/act" and method == "POST" and not cross_site(scope):
                await self.access(self.act, scope, receive, send)
            elif (
                method == "POST"
                and path.startswith("/v2/models/")
                and INFER_PATH.fullmatch(path.rstrip("/"))
                and not cross_site(scope)
            ):
                await self.access(self.kserve_infer, scope, receive, send)
            else:
                await self.pass_on(scope, receive, send)
        elif kind == "websocket":
            await self.openpi(scope, receive, send)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    def grpc_servicer(self, channel: Any) -> Any:
        """The front's gRPC servicer (``--grpc-port``) over this app's hop, ``channel`` the
        core's: the same API key, access log and KServe input checks as its HTTP door."""
        from node.protocols.kserve import grpc_front  # (grpcio: only with --grpc-port)

        return grpc_front.FrontServicer(self.hop, channel, self.access, self.max_rows,
                                        self._allowed, self._note,
                                        self.kserve_checks)  # fmt: skip

    def _allowed(self, authorization: str | None) -> bool:
        if not self.api_key:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        return scheme.lower() == "api-key" and hmac.compare_digest(
            key.strip().encode(), self.api_key.encode()
        )

    async def _note(self, reason: str) -> None:
        """Have the core count a refusal this front answered itself."""
        with contextlib.suppress(HopFull, HopError):  # (never waits for a slot)
            await self.hop.call(NOTE, {"rejected": reason}, [], lambda *_: None, wait=False)

    async def act(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /act``, as ``node/protocols/act.py`` answers it."""
        received = time.monotonic()
        content_type, accept, authorization, timing = header_values(scope, _HEADERS)
        binary_in = is_msgpack(content_type)
        binary_out = MSGPACK in (accept or "")
        if not self._allowed(authorization):
            await self._note("unauthorized")
            body = error_body("unauthorized", "this node wants Authorization: Api-Key <key>")
            await respond(send, 401, body, headers=[(b"www-authenticate", b"Api-Key")])
            return
        try:
            body = await read_body(scope, receive, self.max_body)
            doc = parse(body, binary_in, self.max_rows)
            kind, meta, arrays = request(doc, binary_in, self.checks)
        except (BodyError, Refused) as exc:
            o = outcome(exc)
            if o.reject_reason is not None:
                await self._note(o.reject_reason)
            await respond(send, o.status, error_body(o.code, o.message, o.field))
            return
        except Uncarried:  # nothing was sent: the core answers it as one process does
            await self.forward(scope, body, send)
            return
        asks_timing = timing is not None and timing.strip().lower() in ("1", "true")
        connection = scope.get(CONNECTION)

        def use(
            kind: int, reply: dict[str, Any], views: list[Array]
        ) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]] | None:
            if "chk" in reply:
                self.checks.learn(reply["chk"])
            if reply.get("recheck"):  # checked against a contract no longer the model's
                return None
            facts = reply.get("facts")
            if facts is not None:  # the access line's
                scope[STEP_KEY] = (facts["episode_id"] or "-", facts["device"], facts["routing"])
            elif "rows" in reply:
                scope[STEP_KEY] = (f"{len(reply['rows'])} rows", "-", "-")
            return _answer(kind, reply, views, binary_out)

        def gone() -> bool:
            return connection is not None and bool(connection.peer_closed())

        writer = _Writer(scope, send)
        try:  # a slot waited for within its deadline; the reply written before it is freed
            for checked in (True, False):
                if not checked:  # the core refused the check, before anything changed
                    kind, meta, arrays = request(doc, binary_in)
                meta["recv"], meta["timing"] = received, asks_timing
                if not binary_in:
                    meta["j"] = True  # its tensors were JSON lists: what is wrong is said so
                wait_s = _left(received, self.hop.slot_wait_s)
                answered = await self.hop.call(kind, meta, arrays, use, gone, deliver=writer,
                                               wait_s=wait_s, ahead=not checked)  # fmt: skip
                if answered is not None:
                    break
        except HopFull as exc:  # busy, or its deadline passed while it waited for a slot
            await respond_error(send, exc.refusal())
            return
        except CoreLapsed as exc:  # the core is stuck past its lease: try another node
            await respond_error(send, exc)
            return
        except Uncarried:  # nothing was sent: the core answers it as one process does
            await self.forward(scope, body, send)
            return
        except HopError as exc:
            await respond(send, 413, error_body("too_large", str(exc)))
            return
        except Undelivered:
            if not writer.started:  # (a response under way or sent is never followed)
                await respond_gone(send)

    async def kserve_infer(self, scope: Scope, receive: Receive, send: Send) -> None:
        """KServe v2 HTTP infer, as ``node/protocols/kserve/http.py`` answers it: the API
        key checked and the body decoded here, the step served by the core over the hop
        (``http.serve_hop``: it looks the model up first, so a model no node serves is 404
        whatever the body, and counts a refusal found here), the reply encoded here."""
        received = time.monotonic()
        match = INFER_PATH.fullmatch(scope["path"].rstrip("/"))
        assert match is not None
        name, version = match["name"], match["version"]
        authorization, header_length, encoding, timing = header_values(scope, _KSERVE_HEADERS)
        request: InferRequest | None = None
        body = b""
        meta: dict[str, Any] = {"model": name, "version": version}
        arrays: list[Array] = []
        if not self._allowed(authorization):
            meta["refused"] = [401, "this node wants Authorization: Api-Key <key>",
                               "unauthorized", [(b"www-authenticate", b"Api-Key")]]  # fmt: skip
        else:
            try:
                body = await read_body(scope, receive, self.max_body)
                request = decode_infer(body, header_length, content_encoding=encoding,
                                       max_bytes=self.max_body, max_rows=self.max_rows)  # fmt: skip
            except (BadRequest, BodyError, Refused) as exc:
                o = shaped(outcome(exc))
                meta["refused"] = [o.status, o.message, o.reject_reason, []]
            else:
                request.timing = request.timing or _asks_timing(timing)
                meta, arrays = request_meta(request, name, version, self.kserve_checks)
                rows = request.rows
                scope[STEP_KEY] = ((f"{len(rows)} rows" if rows is not None else
                                    request.episode or "-"), "-", "-")  # fmt: skip
        meta["recv"] = received
        connection = scope.get(CONNECTION)
        request_id = None if request is None else request.id

        def use(
            kind: int, reply: dict[str, Any], views: list[Array]
        ) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]] | None:
            if "chk" in reply:
                self.kserve_checks.learn(reply["chk"])
            if reply.get("recheck"):  # checked against a contract no longer the model's
                return None
            err = reply.get("kerr")
            if err is not None:
                status, message, headers = err
                return status, orjson.dumps({"error": message}), JSON, [tuple(h) for h in headers]
            scope[STEP_KEY] = tuple(reply["log"])
            outputs, wanted, served, parameters = reply_of(reply, views)
            out, headers = encode_reply(outputs, wanted, name, served, request_id, parameters)
            headers.append((b"x-affinity-node", reply["node"].encode()))
            if reply["url"]:
                headers.append((b"x-affinity-url", reply["url"].encode()))
            return 200, out, headers[0][1], headers[1:]

        def gone() -> bool:
            return connection is not None and bool(connection.peer_closed())

        timeout_s = None if request is None else request.timeout_s
        wait = self.hop.slot_wait_s  # (--act-deadline: counted from its arrival too)
        writer = _Writer(scope, send)
        try:  # a slot waited for no longer than the request's own timeout, if it set one
            for first in (True, False):
                if not first:  # the core refused the check, before anything changed
                    assert request is not None
                    meta, arrays = request_meta(request, name, version)
                    meta["recv"] = received
                answered = await self.hop.call(
                    KSERVE,
                    meta,
                    arrays,
                    use,
                    gone,
                    deliver=writer,
                    wait_s=_left(received, min(timeout_s or wait, wait)),
                    ahead=not first,  # (it had its turn: sent again at once)
                )
                if answered is not None:
                    break
        except HopFull as exc:  # busy, or its deadline passed while it waited for a slot
            own = timeout_s if timeout_s is not None and timeout_s < wait else None
            why = shaped(outcome(exc.refusal()), own).message
            await respond(send, 503, orjson.dumps({"error": why}), JSON,
                          [(b"retry-after", b"1")])  # fmt: skip
            return
        except CoreLapsed as exc:  # the core is stuck past its lease: try another node
            why = shaped(outcome(exc)).message
            await respond(send, 503, orjson.dumps({"error": why}), JSON, [(b"retry-after", b"1")])
            return
        except Uncarried:  # nothing was sent: the core answers it as one process does
            await self.forward(scope, body, send)
            return
        except HopError as exc:
            await respond(send, 413, orjson.dumps({"error": str(exc)}), JSON)
            return
        except Undelivered:
            if not writer.started:  # (a response under way or sent is never followed)
                await respond_gone(send)

    async def pass_on(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Any other HTTP request, to the core's app as it came; its reply back, streamed."""
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await self.forward(scope, b"".join(chunks), send, receive)

    async def forward(
        self, scope: Scope, body: bytes, send: Send, receive: Receive | None = None
    ) -> None:
        """A request whose ``body`` was read, to the core's app; its reply back, streamed.
        With ``receive``, a client that leaves while the reply streams ends the request to
        the core at once (an event stream holds one of the core's stream slots until its
        client goes, and an idle one writes nothing that would tell)."""
        # the target as the client sent it (still percent-encoded: a decoded path may hold
        # what no URL may, a NUL; the core decodes and judges it as for its own clients)
        target = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
        if scope["query_string"]:
            target += b"?" + scope["query_string"]
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP]
        try:
            url = _CORE.copy_with(raw_path=target)
        except httpx.InvalidURL as exc:  # bytes no URL may hold, sent raw by the client
            await respond(send, 400, error_body("bad_request", f"a malformed target: {exc}"))
            return
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            body = error_body("unavailable", f"the node's core did not answer: {exc}")
            await respond(send, 503, body, headers=[(b"retry-after", b"1")])
            return
        try:
            await send({
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in
                            _HOP_BY_HOP],
            })  # fmt: skip
            relaying = asyncio.ensure_future(_relay(response, send))
            if receive is None:
                await relaying
                return
            left = asyncio.ensure_future(_disconnected(receive, scope.get(CONNECTION)))
            try:
                await asyncio.wait((relaying, left), return_when=asyncio.FIRST_COMPLETED)
                if relaying.done():
                    relaying.result()
            finally:
                for task in (relaying, left):
                    task.cancel()
                await asyncio.gather(relaying, left, return_exceptions=True)
        finally:
            await response.aclose()

    async def openpi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """An openpi websocket (``node/protocols/openpi.py``): its frames decoded and
        encoded here, each observation's arrays written once into a slot of the hop; the
        connection's state and each step's semantics are the core's (its
        ``openpi.Connection``), so the rules are written once."""
        if (await receive())["type"] != "websocket.connect":
            return
        if cross_site(scope):  # a page elsewhere must not drive a robot's episode
            await self._note("forbidden")
            await send({"type": "websocket.close", "code": 1008})  # before accept: 403
            return
        (authorization,) = header_values(scope, (b"authorization",))
        if not self._allowed(authorization):
            await self._note("unauthorized")
            await unauthorized(scope, send, self.access, time.monotonic())
            return
        number, started = next(self.numbers), time.monotonic()
        ask = {"c": number, "q": scope.get("query_string", b"")}
        try:  # asked per connection, never cached: the metadata of the models served now
            opened = await self.hop.call(WS_OPEN, ask, [], lambda _, meta, __: meta)
        except (HopFull, CoreLapsed) as exc:  # never sent: 503, try again later
            await denied(scope, send, self.access, started, outcome(exc.refusal()
                         if isinstance(exc, HopFull) else exc))  # fmt: skip
            return
        except HopError as exc:  # its reply unreadable: the core may have opened it
            self._close_later(number)
            await denied(scope, send, self.access, started,
                         Outcome(500, "internal", f"hop: {exc}"))  # fmt: skip
            return
        except BaseException:  # cancelled (a stop) with the open sent: closed there too
            self._close_later(number)
            raise
        if "err" in opened:  # not opened: what one process answers (Redis gone: 503)
            refused = _outcome(opened["err"])
            if refused.code == "internal":  # (a failure of the hop's own: it may be open there)
                self._close_later(number)
            await denied(scope, send, self.access, started, refused)
            return
        frame = opened.get("frame")
        if not isinstance(frame, bytes):  # a malformed ?episode_id=
            await send({"type": "websocket.close", "code": 1008})
            return
        problem = opened.get("problem")
        if problem is not None:  # not opened in the core
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "bytes": frame})
            # openpi's client reads the metadata on connect and an error only as a step's reply
            if (await receive())["type"] == "websocket.receive":
                await self._note("bad_input")
                await fail(send, str(problem))
            return
        try:  # opened in the core: closed there however this ends (a client gone at once)
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "bytes": frame})
            names = _Names(number, opened.get("fixed"), str(opened.get("own")),
                           _connection_check(opened.get("chk")))  # fmt: skip
            await self._steps(scope, receive, send, names)
        finally:
            await self._close(number)

    async def _steps(self, scope: Scope, receive: Receive, send: Send, names: _Names) -> None:
        """A connection's observations, one at a time (openpi is lockstep), until it
        closes or a step fails."""
        prev_total_ms: float | None = None
        early: list[asyncio.Future[MutableMapping[str, Any]]] = []  # a receive begun mid-step
        while True:
            message = await early.pop() if early else await receive()
            if message["type"] == "websocket.disconnect":
                return
            go_on, prev_total_ms = await self._step(
                scope, receive, send, names, message, prev_total_ms, early
            )
            if not go_on:
                return

    async def _step(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        names: _Names,
        message: MutableMapping[str, Any],
        prev_total_ms: float | None,
        early: list[asyncio.Future[MutableMapping[str, Any]]],
    ) -> tuple[bool, float | None]:
        """One observation frame: (whether the connection goes on, the step's total ms
        for the next reply's ``server_timing``)."""
        started = time.monotonic()
        arrays: list[Array] = []
        try:
            frame = observation(message, self.max_rows)
            meta: dict[str, Any] = {"c": names.number, "recv": started}
            check = names.check
            checked = None if check is None else _observed(check, frame)
            if check is None or checked is None:
                meta["o"] = lift(frame, arrays)
            else:
                fields, converted, ignored = checked
                meta["o"], meta["in"] = lift(fields, arrays), lift(converted, arrays)
                meta["ig"], meta["ok"], meta["ck"] = ignored, True, check[0]
        except (InvalidInput, WireError, Refused) as exc:
            o = outcome(exc)
            log_line(self.access, scope, started, o.status, None)
            if o.reject_reason is not None:
                await self._note(o.reject_reason)
            await fail(send, refusal(o))
            return False, prev_total_ms

        def use(kind: int, reply: dict[str, Any], views: list[Array]) -> dict[str, Any]:
            if "doc" not in reply:  # refused: openpi's error
                return reply
            doc = lower(reply["doc"], views)
            if not reply["rows"]:
                total_ms = (time.monotonic() - started) * 1000
                doc = finished(doc, reply["ms"], total_ms, prev_total_ms, reply["split"])
            at = reply["at"]
            log_line(self.access, scope, started, 200, reply["ep"],
                     None if at is None else (at[0], at[1]))  # fmt: skip
            reply["body"] = wire.encode(doc)  # while the outputs are views of the slot
            return reply

        handing_over = [False]  # from here a close seen fails the send, cancels nothing

        async def deliver(reply: dict[str, Any], handing: Handing) -> bool | None:
            handing_over[0] = True
            body = reply.get("body")
            if body is None:
                return True
            try:
                await io_seen()  # a close that came with the frame fails the send: undone
                await send({"type": "websocket.send", "bytes": body})
            except (OSError, RuntimeError):  # uvicorn's ClientDisconnected, or a close it
                return False  # sent itself (a ping unanswered): the robot never gets it
            drained = drained_of(scope)  # the slot is freed once it is in the kernel
            delivered: bool | None = await drained(handing)  # (None: in doubt)
            return delivered

        call = self.hop.call(WS_STEP, meta, arrays, use, deliver=deliver,
                             wait_s=_left(started, self.hop.slot_wait_s))  # fmt: skip
        try:
            reply = await watching(receive, call, early, lambda: handing_over[0])
        except ClientGone:  # closed mid-step: the core undoes it (or holds it: seq)
            log_line(self.access, scope, started, 499, names.of(frame))
            return False, prev_total_ms
        except Undelivered:  # the send failed: the core undoes it (or holds it)
            return False, prev_total_ms
        except HopFull as exc:
            log_line(self.access, scope, started, 503, names.of(frame))
            refused = exc.refusal()
            await fail(send, f"{refused.reason}: {refused}")
            return False, prev_total_ms
        except CoreLapsed as exc:
            log_line(self.access, scope, started, 503, names.of(frame))
            await fail(send, f"{exc.reason}: {exc}")
            return False, prev_total_ms
        except HopError as exc:
            log_line(self.access, scope, started, 413, names.of(frame))
            await fail(send, f"too_large: {exc}")
            return False, prev_total_ms
        if "fail" in reply:
            log_line(self.access, scope, started, int(reply["status"]), reply.get("ep"))
            await fail(send, str(reply["fail"]))
            return False, prev_total_ms
        if "err" in reply:
            status, code, text, _, _ = reply["err"]
            log_line(self.access, scope, started, int(status), None)
            await fail(send, f"{code}: {text}")
            return False, prev_total_ms
        if reply["rows"]:
            return True, prev_total_ms
        return True, (time.monotonic() - started) * 1000

    async def _close(self, number: int) -> None:
        """Tell the core the connection closed (its own episode ends). Never dropped: a
        hop with every slot in flight gives it the next slot released, ahead of the calls
        waiting, however long that takes (``urgent``); were this front to go first, the
        core ends the episode as it drops the front."""
        try:
            await self.hop.call(WS_CLOSE, {"c": number}, [], lambda *_: None, urgent=True)
        except HopError:
            log.warning("could not tell the core that openpi connection %d closed", number)

    def _close_later(self, number: int) -> None:
        """:meth:`_close` in a task of its own (a connection whose open may have reached the
        core, ended by an exception there is no awaiting in)."""
        task = asyncio.ensure_future(self._close(number))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _left(received: float, budget_s: float | None) -> float | None:
    """What is left now of ``budget_s`` (a client's own timeout or deadline) counted from
    ``received``; None without one."""
    return None if budget_s is None else budget_s - (time.monotonic() - received)


Response = tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]


class _Writer:
    """A call's ``deliver`` that writes its HTTP response (status, body, content type,
    headers): the slot stays the front's (DELIVERING) until the whole response is in the
    kernel (:class:`_DrainingHttp`), so a front that dies before leaves the step in doubt,
    never standing with its reply gone with the process (node/hop.py). ``started``: the
    response began (nothing else may be sent on the exchange then)."""

    def __init__(self, scope: Scope, send: Send) -> None:
        self.scope = scope
        self.send = send
        self.started = False

    async def __call__(self, response: Response | None, handing: Handing) -> bool | None:
        if response is None:  # nothing to write: the request is sent again (FrontApp.act)
            return True
        self.started = True
        await respond(self.send, *response)
        return await drained_of(self.scope)(handing)


_CORE = httpx.URL("http://core")
"""The core's app, as the fronts' client reaches it (its Unix socket)."""


async def _relay(response: httpx.Response, send: Send) -> None:
    async for chunk in response.aiter_raw():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _disconnected(receive: Receive, connection: Any) -> None:
    """Until the client of a request whose body was read has gone: said by ``receive``, or
    by the connection itself (polled each second: a client that pipelined a request
    behind this one is heard of by that one's ``receive`` only)."""

    async def said() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    told = asyncio.ensure_future(said())
    try:
        while not told.done():
            if connection is not None and connection.peer_closed():
                return
            await asyncio.wait((told,), timeout=DISCONNECT_POLL_S)
    finally:
        told.cancel()


DRAIN_S = 60.0
"""How long a reply may take to leave the front's buffer for the kernel (a client reading
nothing, its window shut): past it the connection is dropped, the step in doubt."""
PARK_AFTER_S = 0.02
"""How long a reply the kernel could not take at once may keep its hop slot before it moves
to a ticket (``Handing.park``): a big reply to a client that reads drains within it, and
costs no park."""
SHED_S = 0.25
"""How long a reply that the kernel could not take may hold its hop slot while other calls
wait for one, when no ticket was left to move it to (every one of :data:`~node.hop.TICKETS`
taken): past it the connection is dropped, the step in doubt (``_Drains.drained``)."""


async def _drained(handing: Handing | None = None) -> bool | None:
    """A server that cannot say when its writes reached the kernel: as soon as written."""
    return True


def drained_of(scope: Scope) -> Callable[[Handing | None], Awaitable[bool | None]]:
    """How to wait until what was written on ``scope``'s connection is in the kernel: its
    protocol's :meth:`_Drains.drained` (the scope's :data:`~node.asgi.CONNECTION`, HTTP's
    and the websocket's alike), or at once for a server that cannot say."""
    drained: Callable[[Handing | None], Awaitable[bool | None]] = getattr(
        scope.get(CONNECTION), "drained", _drained
    )
    return drained


class _Drains:
    """What a front's protocol (:class:`_DrainingHttp`, :class:`_DrainingWebSocket`) knows of
    its connection's end: :meth:`drained` says when everything written so far, a reply
    with it, has left the front's buffer for the kernel."""

    lost = False
    """The connection was lost."""
    broken = False
    """It was lost by an error (a reset): what its buffer held then never left. Lost
    without one, it closed once its buffer was empty (a close of ours after a reply with
    ``Connection: close``, a client's half-close)."""

    _ended: asyncio.Event | None = None

    def _lose(self, exc: Exception | None) -> None:
        self.lost = True
        self.broken = exc is not None
        if self._ended is not None:
            self._ended.set()

    async def _until_lost(self) -> None:
        if self._ended is None:
            self._ended = asyncio.Event()
        if not self.lost:
            await self._ended.wait()

    def _transport(self) -> asyncio.Transport:
        raise NotImplementedError

    async def _writable(self) -> None:
        """Once the transport no longer holds back writes (paused above its limit)."""
        raise NotImplementedError

    def _paused(self) -> bool:
        raise NotImplementedError

    async def drained(self, handing: Handing | None = None) -> bool | None:
        """True once the transport's buffer is empty (first in, first out: the reply went
        with it) with the connection still open, or after it closed without an error.
        None when that cannot be known, so the step is in doubt: the connection was lost
        by an error before the buffer emptied (perhaps only control frames written after
        the reply were left), or as the reply was written (a write then is dropped), or it
        stayed full past :data:`DRAIN_S` (then dropped). A write the event loop queued goes
        at the end of its turn, so a buffer not empty at once is looked at after one; still
        not empty then (the kernel's is full), the transport's write limit is set to 0 so
        that it says when it is empty, and set back then. A write that reached a closing
        transport (``OneWriteTransport.late``: the loop may drop it) is in doubt. A reply
        not in the kernel :data:`PARK_AFTER_S` on moves off its hop slot to a ticket
        (``handing.park()``, node/hop.py), so a client that reads nothing holds no slot.
        With no ticket left (or :data:`~node.hop.PARKED_BYTES` held by parked replies
        already) the wait holds the slot (and tries again for a ticket as it
        goes): while ``handing.starved()`` says other calls wait for one, a connection still
        full :data:`SHED_S` on is dropped (in doubt) rather than let clients that read
        nothing starve the front."""
        transport = self._transport()
        if self.lost or getattr(transport, "late", False):
            return None
        if not transport.is_closing() and not transport.get_write_buffer_size():
            return True  # the kernel took it all as it was written (the rule)
        await asyncio.sleep(0)  # a write the loop queued goes at the end of its turn
        start = time.monotonic()
        deadline, park_at, shed_at = start + DRAIN_S, start + PARK_AFTER_S, start + SHED_S
        limits: tuple[int, int] | None = None
        while True:
            if self.lost or getattr(transport, "late", False):
                return None if self.broken or getattr(transport, "late", False) else True
            now = time.monotonic()
            if now >= deadline:
                transport.abort()
                return None
            closing = transport.is_closing()
            if not closing and not transport.get_write_buffer_size():
                if limits is not None:  # the connection's later writes as before
                    with contextlib.suppress(RuntimeError):  # (a transport closed meanwhile)
                        transport.set_write_buffer_limits(high=limits[1], low=limits[0])
                return True
            unparked = handing is not None and handing.ticket is None
            if handing is not None and unparked and now >= park_at:
                # a slow reader: its slot freed for others (a ticket may have come free)
                unparked = not handing.park(transport.get_write_buffer_size())
                if unparked and now >= shed_at and handing.starved():
                    transport.abort()
                    return None
            wake = deadline
            if unparked:
                wake = min(wake, park_at if now < park_at else now + SHED_S)
            if closing:  # a flush before our close, or a reset (its buffer dropped): only
                with contextlib.suppress(TimeoutError):  # connection_lost says which
                    async with asyncio.timeout(max(0.0, wake - now)):
                        await self._until_lost()
                continue
            if limits is None:
                limits = transport.get_write_buffer_limits()
                transport.set_write_buffer_limits(high=0)  # paused now; resumed once empty
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wake - now)):
                    if self._paused():
                        await self._writable()
                    else:  # (a transport that did not pause: look again shortly)
                        await asyncio.sleep(0.01)


class _DrainingWebSocket(_Drains, WebSocketsSansIOProtocol):
    """uvicorn's websocket protocol, except that every connection's scope carries it as
    :data:`~node.asgi.CONNECTION`, as the HTTP protocol does, for :meth:`~_Drains.drained`
    (:func:`drained_of`). An openpi reply's slot stays DELIVERING
    until the reply is in the kernel: a front that dies with it still in its buffer (a
    robot on a slow link: the kernel's socket buffer is full) leaves the step in doubt
    (node/hop.py), never applied with its reply lost unsaid. Hazard: a uvicorn upgrade is
    checked by tests/test_fronts_openpi_procs.py (a reply held in a front's buffer)."""

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(exc)
        super().connection_lost(exc)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # (none for a handshake refused)
        if scope is not None:
            scope[CONNECTION] = self

    def _transport(self) -> asyncio.Transport:
        return self.transport

    async def _writable(self) -> None:
        await self.writable.wait()

    def _paused(self) -> bool:
        return not self.writable.is_set()


class _DrainingHttp(_Drains, KeepAliveProtocol):
    """The node's HTTP protocol (``node/httpproto.py``), with :meth:`~_Drains.drained` on
    the request's :data:`~node.asgi.CONNECTION`: a response's slot stays DELIVERING until
    the response is in the kernel whole (:class:`_Writer`)."""

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(exc)
        super().connection_lost(exc)

    def _transport(self) -> asyncio.Transport:
        return self.transport

    async def _writable(self) -> None:
        await self.flow.drain()

    def _paused(self) -> bool:
        return bool(self.flow.write_paused)


class _FrontServer(uvicorn.Server):
    """uvicorn, deaf to SIGINT/SIGTERM: they are the core's (it keeps the fronts serving
    while it hands its episodes over, then stops them with SIGUSR1)."""

    def __init__(self, config: uvicorn.Config, stopping: list[Callable[[], None]]) -> None:
        super().__init__(config)
        self._stopping = stopping
        """What the core's stop starts on this loop beside HTTP's drain, once (gRPC's own);
        emptied when serving ended, so that a late SIGUSR1 starts nothing."""
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGUSR1:
            super().handle_exit(signal.SIGTERM, frame)
            starts = list(self._stopping)
            self._stopping.clear()
            if not self._loop.is_closed():
                for start in starts:
                    self._loop.call_soon_threadsafe(start)


async def serve(argv: list[str]) -> None:
    index, listen_fd, region_fd, ask, answer, _, core_hex = argv
    spec = json.loads(os.environ.pop("AFFINITY_FRONT_SPEC"))
    region = Region.open(int(region_fd))
    hop = FrontHop(region, int(ask), int(answer), float(spec.get("slot_wait_s", 10.0)))
    lag = _Lag(region.mm, LAG_BOUNDS)
    watching = asyncio.create_task(watch_loop_lag(lag), name="affinity-loop-lag")
    app = FrontApp(hop, bytes.fromhex(core_hex).decode(), spec)
    stopping: list[Callable[[], None]] = []  # what a stop starts beside HTTP's drain
    server = _FrontServer(
        uvicorn.Config(
            app,
            http=_DrainingHttp,
            ws=_DrainingWebSocket,
            ws_max_size=int(spec["max_body_bytes"]),
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            timeout_keep_alive=max(1, round(float(spec["keep_alive_s"]))),
            timeout_graceful_shutdown=int(spec["close_s"]),
            lifespan="on",
        ),
        stopping,
    )
    signal.signal(signal.SIGUSR1, server.handle_exit)
    sock = socket.socket(fileno=int(listen_fd))
    grpc_port = spec.get("grpc_port")
    rpc: tuple[Any, Any] | None = None
    if grpc_port is not None:  # grpcio loads only where gRPC is served
        from node.protocols.kserve import grpc_front

        rpc = await grpc_front.start(app.grpc_servicer, spec["host"], int(grpc_port),
                                     spec["grpc_core"], app.max_body)  # fmt: skip
    grpc_stopped: list[asyncio.Task[None]] = []
    if rpc is not None:
        grpc_server = rpc[0]

        def stop_grpc() -> None:  # at once: its calls finish beside HTTP's, within its grace
            grpc_stopped.append(asyncio.ensure_future(grpc_server.stop(float(spec["grpc_stop_s"]))))

        stopping.append(stop_grpc)
    log.info("front %s serving (pid %d), %.2f s after its start", index, os.getpid(), _age_s())
    try:
        await server.serve(sockets=[sock])
    finally:
        stopping.clear()  # (a late SIGUSR1 starts nothing: the stop below is its own)
        watching.cancel()
        if rpc is not None:  # its calls finish (their steps still served by the core)
            if grpc_stopped:
                await grpc_stopped[0]
            else:  # (HTTP ended otherwise)
                await rpc[0].stop(float(spec["grpc_stop_s"]))
            await rpc[1].close()


def _age_s() -> float:
    """How long ago this process started (``/proc``: its start and the uptime, in clock
    ticks): what a front's start costs, its imports included."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    die_with_parent(int(args[5]))
    spec = json.loads(os.environ["AFFINITY_FRONT_SPEC"])
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if spec.get("log_format") == "json"
        else logging.Formatter(f"%(asctime)s %(levelname)s %(name)s[front {args[0]}]: %(message)s")
    )
    logging.basicConfig(level=getattr(logging, str(spec.get("log_level", "info")).upper(),
                                      logging.INFO), handlers=[handler])  # fmt: skip
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per passed request
    import uvloop

    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
