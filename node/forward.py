"""Node-to-node forwarding: one persistent HTTP/1.1 connection pool on asyncio, msgpack bodies.

A router that resolved an episode to another node sends it to the owner's
``POST /internal/act``. It sends the decided assignment, the already-validated input
arrays (binary, never JSON lists) and what is left of the client's deadline. The owner
checks the cluster secret, the device and the token. It checks that the inputs fit its own
model: names, shapes and dtypes. A node serving another model refuses them 422, never
counting them as a crash. The owner does not redo what the router decided (no second
resolve unless the tokens disagree).
The forward carries the :class:`~node.step.Step` whole, field by field under fixed msgpack
keys. So a new step option travels without a change here, and nodes of two releases talk.

The client is deliberately small: requests with a ``Content-Length`` body, responses with
a ``Content-Length`` body (what affinity nodes send), keep-alive, one request at a time
per connection. A connection idle for longer than ``keepalive_s`` is not reused (the
server may be closing it). A reused connection that fails before a single byte of the
response arrived is retried once on a fresh one. The server closed it without reading the
request, so the step did not run.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from dataclasses import dataclass, fields
from typing import Any, Protocol
from urllib.parse import urlsplit

import numpy as np

from affinity import wire
from node.errors import ForwardError
from node.rtc import Ask
from node.step import Reply, Step

__all__ = [
    "GHOST_PATH",
    "MOVE_PATH",
    "ROWS_PATH",
    "Forward",
    "ForwardPool",
    "GhostStep",
    "Poster",
    "Response",
]

INTERNAL_PATH = "/internal/act"
ROWS_PATH = "/internal/rows"  # several episodes' steps for one owner (issue 44)
MOVE_PATH = "/internal/move"  # a live hand-over's record (node/transfer.py)
GHOST_PATH = "/internal/ghost"  # a ghost step for a node running the candidate (node/shadow.py)
SECRET_HEADER = "X-Affinity-Secret"
CONTENT_TYPE = "application/msgpack"
_MAX_HEADER = 64 * 1024


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


_NOT_SENT = frozenset(
    {
        *("deadline", "model", "version"),  # as budget_ms, and in the forward's model
        *("live_only", "arrived", "door", "received", "control_hz", "timing"),  # the router's
    }
)
"""The step's fields a forward does not carry as they are."""
_SENT = tuple(
    (f.name, "episode_id" if f.name == "episode" else f.name)
    for f in fields(Step)
    if f.name not in _NOT_SENT
)
"""(field, msgpack key) of each step field a forward carries, in ``Step``'s order."""


@dataclass(slots=True)
class Forward:
    """What travels from the router to the owner. The step goes whole: its fields but
    :data:`_NOT_SENT`, field by field. With it go the assignment the router obtained from
    Redis and the time left of the client's deadline (``budget_s``). ``claim``: the claim
    id issued with the token. ``instance``: the process Redis says holds the owner's
    registration, which the owner checks is itself. ``model``: the assignment's
    ``"name@version"`` ("" in a fleet without models). For a restart it is the model the
    step names, which the owner's fresh claim takes. ``step.origin`` is a random id of this
    forward; a router sends its own step with ``origin`` set instead (sent as the step's,
    without a copy of the step). ``undo`` asks the owner to undo the step that forward
    ``step.origin`` applied (the router could not deliver its reply; no inputs); with
    ``doubt`` the reply may have reached its client (its front died handing it over): the
    episode's next step starts clean and says ``state_reset``.
    ``release`` asks the owner to end the episode (a release sent to another node; no
    inputs). The owner sets the decoded step's ``deadline`` on receipt (``budget_s`` from
    then)."""

    step: Step
    token: int
    device: str
    routing: str
    budget_s: float
    undo: bool = False
    claim: str = ""
    instance: str = ""
    model: str = ""
    elapsed_s: float = 0.0  # how long the router had the step before forwarding it
    release: bool = False  # end the episode (``POST /episodes/<id>/end`` at another node)
    origin: str | None = None  # sent as the step's origin (None: ``step.origin``)
    doubt: bool = False  # an undo of a reply that may have reached its client

    @classmethod
    def about(
        cls,
        episode: str,
        token: int,
        device: str,
        budget_s: float,
        *,
        origin: str = "",
        seq: int | None = None,
        undo: bool = False,
        release: bool = False,
        doubt: bool = False,
    ) -> Forward:
        """A forward without a step to run: an undo or a release of ``episode``."""
        step = Step(episode, {}, 0.0, seq=seq, origin=origin)
        return cls(step, token, device, "hit", budget_s, undo=undo, release=release,
                   doubt=doubt)  # fmt: skip

    @property
    def episode(self) -> str:
        assert self.step.episode is not None, "a forwarded step has an episode"
        return self.step.episode

    def encode(self) -> bytes:
        return wire.encode(self.doc())

    def doc(self) -> dict[str, Any]:
        """The forward as a map, before msgpack (:meth:`encode`; a ghost step nests it)."""
        doc: dict[str, Any] = {key: getattr(self.step, name) for name, key in _SENT}
        if self.origin is not None:
            doc["origin"] = self.origin
        rtc = self.step.rtc
        doc["rtc"] = None if rtc is None else [getattr(rtc, f.name) for f in fields(Ask)]
        doc.update(
            token=self.token,
            device=self.device,
            routing=self.routing,
            budget_ms=round(self.budget_s * 1000, 3),
            undo=self.undo,
            claim=self.claim,
            instance=self.instance,
            model=self.model,
            elapsed_ms=round(self.elapsed_s * 1000, 3),
            release=self.release,
        )
        if self.doubt:  # (only then: the map an older node reads is unchanged)
            doc["doubt"] = True
        return doc

    @classmethod
    def decode(cls, body: bytes) -> Forward:
        """Raises ``ValueError`` (``wire.WireError`` included) on a malformed forward."""
        return cls.of(wire.decode(body))

    @classmethod
    def of(cls, doc: object) -> Forward:
        """A forward from its map (:meth:`doc`); raises ``ValueError`` on a malformed one."""
        if not isinstance(doc, dict):
            raise ValueError("a forward is a map")
        try:
            episode, token, device = doc["episode_id"], doc["token"], doc["device"]
            routing, inputs, budget = doc["routing"], doc["inputs"], doc["budget_ms"]
        except KeyError as exc:
            raise ValueError(f"a forward needs {exc.args[0]}") from None
        ok = (
            isinstance(episode, str)
            and isinstance(device, str)
            and isinstance(token, int)
            and not isinstance(token, bool)
            and routing in ("hit", "claimed", "reassigned")
            and isinstance(inputs, dict)
            and all(isinstance(v, np.ndarray) for v in inputs.values())
            and isinstance(budget, int | float)
        )
        client_token, execute_steps = doc.get("client_token"), doc.get("execute_steps")
        ensemble, seq, origin = doc.get("ensemble"), doc.get("seq"), doc.get("origin", "")
        ints = (client_token, execute_steps, seq)
        if not ok or not all(v is None or type(v) is int for v in ints):
            raise ValueError("a forward's fields have the wrong types")
        claim, instance = doc.get("claim", ""), doc.get("instance", "")
        model, client_claim = doc.get("model", ""), doc.get("client_claim")
        if not all(isinstance(v, str) for v in (origin, claim, instance, model)):
            raise ValueError("a forward's origin, claim, instance and model must be strings")
        if client_claim is not None and not isinstance(client_claim, str):
            raise ValueError("a forward's client_claim must be a string")
        if ensemble is not None and not isinstance(ensemble, str):
            raise ValueError("a forward's ensemble must be a string")
        rtc, elapsed = doc.get("rtc"), doc.get("elapsed_ms", 0)
        if rtc is not None and not (isinstance(rtc, list) and len(rtc) in (3, 4)):
            raise ValueError("a forward's rtc must be [executed, delay, control_hz, pending]")
        if not isinstance(elapsed, int | float) or isinstance(elapsed, bool) or elapsed < 0:
            raise ValueError("a forward's elapsed_ms must be a number >= 0")
        name, _, version = model.partition("@")
        step = Step(
            episode=episode,
            inputs=inputs,
            deadline=float("inf"),  # the owner's: budget_s from receipt
            end=doc.get("end") is True,
            client_token=client_token,
            degraded=doc.get("degraded") is True,
            restart=doc.get("restart") is True,
            execute_steps=execute_steps,
            ensemble=ensemble,
            seq=seq,
            origin=origin,
            model=name or None,
            version=version or None,
            rtc=None if rtc is None else Ask(*rtc),
            client_claim=client_claim,
        )
        return cls(
            step,
            token,
            device,
            routing,
            float(budget) / 1000,
            undo=doc.get("undo") is True,
            claim=claim,
            instance=instance,
            model=model,
            elapsed_s=float(elapsed) / 1000,
            release=doc.get("release") is True,
            doubt=doc.get("doubt") is True,
        )


@dataclass(slots=True)
class GhostStep:
    """What an owner without a shadow's candidate sends a node running it, after a live
    step (``POST /internal/ghost``, ``node/shadow.py``): the live ``step`` (inputs, end,
    chunk options; as a :class:`Forward` carries it), the ``live`` and ``candidate``
    ``"name@version"``, the live claim id, the live step's ``seq``, whether the live
    episode's state started over (``reset``) and the live ``outputs`` to compare."""

    step: Step
    live: str
    candidate: str
    claim: str
    seq: int
    reset: bool
    outputs: dict[str, np.ndarray[Any, Any]]

    def encode(self) -> bytes:
        forward = Forward(self.step, 0, "", "hit", 0.0, claim=self.claim, model=self.live)
        doc = {"forward": forward.doc(), "candidate": self.candidate, "seq": self.seq,
               "reset": self.reset, "outputs": self.outputs}  # fmt: skip
        return wire.encode(doc)

    @classmethod
    def decode(cls, body: bytes) -> GhostStep:
        """Raises ``ValueError`` (``wire.WireError`` included) on a malformed message."""
        doc = wire.decode(body)
        if not isinstance(doc, dict):
            raise ValueError("a ghost step is a map")
        forward = Forward.of(doc.get("forward"))
        candidate, seq, outputs = doc.get("candidate"), doc.get("seq"), doc.get("outputs")
        if not (
            isinstance(candidate, str) and type(seq) is int and seq >= 1
            and isinstance(outputs, dict)
            and all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in outputs.items())
        ):  # fmt: skip
            raise ValueError("a ghost step needs candidate, seq >= 1 and outputs (arrays)")
        return cls(forward.step, forward.model, candidate, forward.claim, seq,
                   doc.get("reset") is True, outputs)  # fmt: skip


async def send_undo(pool: Poster, url: str, undo: Forward) -> str:
    """POST ``undo`` (a :meth:`Forward.about` that undoes) to the owner at ``url``, within
    its ``budget_s``. Returns "" when the owner confirmed, else what went wrong."""
    try:
        async with asyncio.timeout(undo.budget_s):
            resp = await pool.post(url, undo.encode())
    except (TimeoutError, ForwardError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "" if resp.status == 204 else f"it answered {resp.status}"


def encode_reply(reply: Reply) -> bytes:
    return wire.encode(
        {"outputs": reply.outputs, **reply.facts(), "url": reply.url, "timing": reply.timing}
    )


def decode_reply(body: bytes) -> Reply:
    """The owner's reply; raises ``ValueError`` when it is not one."""
    doc = wire.decode(body)
    try:
        return Reply(
            outputs=dict(doc["outputs"]),
            episode=doc["episode_id"],
            device=str(doc["device"]),
            node=str(doc["node"]),
            token=int(doc["token"]),
            routing=str(doc["routing"]),
            state_reset=bool(doc["state_reset"]),
            degraded=bool(doc["degraded"]),
            url=str(doc.get("url", "")),
            source=str(doc.get("source", "model")),
            timing={str(k): float(v) for k, v in dict(doc.get("timing", {})).items()},
            seq=int(doc.get("seq", 0)),
            replayed=bool(doc.get("replayed", False)),
            rtc=None if doc.get("rtc") is None else {str(k): int(v) for k, v in doc["rtc"].items()},
            model=str(doc.get("model", "")),
            claim=str(doc.get("claim", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not an owner's reply: {exc}") from None


class Poster(Protocol):
    """What routing needs of a pool: POST a forward body to an owner (tests route it
    in-process)."""

    async def post(self, url: str, body: bytes, path: str = INTERNAL_PATH) -> Response: ...

    def close(self) -> None: ...


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 client connection: one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[Response] | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self.reused = False
        self._head: tuple[int, dict[str, str], int] | None = None  # status, headers, body at

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            got = len(self.buffer)
            self.waiter.set_exception(
                ForwardError(f"connection closed after {got} bytes of the response")
            )

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is None or self.waiter.done():
            return
        try:
            response = self._parse()
        except ForwardError as exc:
            self.waiter.set_exception(exc)
            self.close()
            return
        if response is not None:
            self.waiter.set_result(response)

    def _parse(self) -> Response | None:
        if self._head is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > _MAX_HEADER:
                    raise ForwardError("response headers too long")
                return None
            lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise ForwardError(f"not an HTTP response: {lines[0][:80]!r}")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = headers.get("content-length", "")
            if not length.isdigit():
                raise ForwardError("the owner's response has no Content-Length")
            self._head = (int(parts[1]), headers, end + 4)
        status, headers, start = self._head
        stop = start + int(headers["content-length"])
        if len(self.buffer) < stop:
            return None
        body = bytes(self.buffer[start:stop])
        del self.buffer[:stop]
        self._head = None
        return Response(status, headers, body)

    async def request(self, head: bytes, body: bytes) -> Response:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.transport.write(body)
        try:
            return await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


@dataclass(frozen=True)
class _Origin:
    host: str
    port: int
    tls: bool

    @classmethod
    def of(cls, url: str) -> _Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ForwardError(f"owner URL {url!r} is not http(s)://host[:port]", unsent=True)
        tls = parts.scheme == "https"
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls)


class ForwardPool:
    """Keep-alive connections to owners, by origin. Use from one event loop."""

    def __init__(
        self,
        secret: str | None,
        *,
        keepalive_s: float = 4.0,
        max_idle_per_origin: int = 64,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.secret = secret or ""
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle_per_origin
        self._ssl = ssl_context
        self._idle: dict[_Origin, collections.deque[_Connection]] = {}
        # (url, path) -> its origin and its request head up to the body's length
        self._heads: dict[tuple[str, str], tuple[_Origin, bytes]] = {}

    async def post(self, url: str, body: bytes, path: str = INTERNAL_PATH) -> Response:
        """POST ``body`` (msgpack) to the owner at ``url`` + ``/internal/act``.

        Raises :class:`ForwardError` when the owner cannot be reached or the connection
        breaks. Cancellation (the caller's deadline) closes the connection."""
        known = self._heads.get((url, path))
        if known is None:
            origin = _Origin.of(url)
            start = (
                f"POST {path} HTTP/1.1\r\nHost: {origin.host}:{origin.port}\r\n"
                f"Content-Type: {CONTENT_TYPE}\r\n{SECRET_HEADER}: {self.secret}\r\n"
                "Content-Length: "
            ).encode("latin-1")
            known = self._heads[(url, path)] = (origin, start)
        origin, start = known
        head = b"%s%d\r\n\r\n" % (start, len(body))
        conn = await self._acquire(origin)
        try:
            response = await conn.request(head, body)
        except ForwardError:
            conn.close()
            if not (conn.reused and not conn.buffer):
                raise
            conn = await self._connect(origin)  # the server closed it unread: retry once
            try:
                response = await conn.request(head, body)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            conn.close()
            raise
        if response.headers.get("connection", "").lower() == "close":
            conn.close()
        else:
            self._release(origin, conn)
        return response

    async def _acquire(self, origin: _Origin) -> _Connection:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                conn.reused = True
                return conn
            conn.close()
        return await self._connect(origin)

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context: Any = None
        if origin.tls:
            context = self._ssl or ssl.create_default_context()
        try:
            transport, conn = await loop.create_connection(
                _Connection, origin.host, origin.port, ssl=context
            )
        except OSError as exc:
            raise ForwardError(
                f"cannot connect to {origin.host}:{origin.port}: {exc}", unsent=True
            ) from exc
        conn.transport = transport  # uvloop may call connection_made only later
        return conn

    def _release(self, origin: _Origin, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, collections.deque())
        if len(idle) >= self.max_idle or conn.closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()
