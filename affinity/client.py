"""Python clients of the node's HTTP API: :class:`Client` (sync) and :class:`AsyncClient`.

What they do for a caller that steps episodes through ``POST /act``:

- keep each episode's last token and echo it, so a lost assignment is reported as
  ``state_reset`` (and, with ``raise_on_reset=True``, raised as :class:`StateReset`);
- number each episode's steps: every step sends ``seq`` (the last reply's ``seq`` + 1), so
  a retry after a timeout or a dropped connection is never applied twice (the owner
  answers a step it already applied with its stored reply, ``replayed``);
- send an episode's steps straight to its owner (the ``X-Affinity-URL`` of the last reply):
  no second hop through another node; when the owner cannot be reached or refuses, fall
  back to the configured nodes, which route the step to wherever the episode lives now;
- honour ``Retry-After`` on 503 within a time budget (``retry_budget_s`` seconds per
  step, 30 by default: longer than a node's lease, so an owner's crash is ridden out with
  one ``state_reset``; timeouts and transport errors included; ``retries`` caps the
  attempts too when given), then raise :class:`ServiceUnavailable`; a retry after a
  timeout or a transport error goes to a node other than the one that failed, while there
  is one, and waits (0.1 s, doubling to 1 s) once every node has failed;
- raise :class:`RequestRefused` for a 4xx (the node's error code, message and field);
- speak msgpack with numpy arrays both ways (``encoding="msgpack"``, the default: a camera
  image travels as its bytes) or JSON (``encoding="json"``: nested lists); outputs are
  numpy arrays either way.

The decisions live in :class:`_StickyRoutes`, without I/O: its :meth:`~_StickyRoutes.attempts`
generator yields what to send (or how long to wait) and is sent each answer, and the two
classes drive it as httpx drives an auth flow, handing ``httpx.Request`` objects straight to
a transport (no ``httpx.Client`` layer):
:class:`Client` to :class:`affinity.transport.Transport` (lean HTTP/1.1 on keep-alive
sockets: ``httpx.Client`` over httpcore cost ~1.5 ms of CPU per camera step), :class:`AsyncClient`
to ``httpx.AsyncHTTPTransport``; ``transport=`` takes any httpx transport instead. Proxy
variables (``HTTP_PROXY``) are not read: nodes are reached directly.
Steps of one episode must be sequential (a robot's loop is); different episodes may run
concurrently on one :class:`AsyncClient`. Node URLs are checked when a client is made: one
that is not ``http://`` or ``https://`` (``127.0.0.1:8000``) is a ``ValueError`` then, never
a retryable failure of every step.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson

from affinity import wire
from affinity.errors import AffinityError
from affinity.transport import Transport

__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "Encoding",
    "RequestRefused",
    "ServiceUnavailable",
    "StateReset",
    "Step",
    "StepReply",
]


class ClientError(AffinityError):
    """What the clients raise; ``code`` is the node's error code (or a client's own)."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


class RequestRefused(ClientError):
    """The node refused the request itself (4xx): retrying the same request won't help."""

    def __init__(self, status: int, code: str, message: str, field: str | None) -> None:
        self.status = status
        self.field = field
        super().__init__(code, f"{status} {code}: {message}")


class ServiceUnavailable(ClientError):
    """No node could serve the step within the retry budget (the last 503's reason)."""


class StateReset(ClientError):
    """The episode's state started over with this step (raised only with
    ``raise_on_reset=True``); ``step`` holds the reply, which was served."""

    def __init__(self, step: StepReply) -> None:
        self.step = step
        super().__init__(
            "state_reset",
            f"episode {step.episode_id!r}: state started over on {step.device} ({step.routing})",
        )


@dataclass(frozen=True)
class StepReply:
    """One served step: the outputs (numpy arrays, by output name) and where and how it
    ran."""

    outputs: dict[str, Any]
    episode_id: str | None
    device: str
    node: str
    token: int
    routing: str
    state_reset: bool
    degraded: bool
    source: str
    url: str  # the owner's address: where this episode's next step goes
    seq: int = 0  # the step's number under its claim (0 for a stateless step)
    replayed: bool = False  # the stored reply of a step already applied (a retry)
    model: str | None = None  # the model version that served it ("name@version")
    rtc: dict[str, int] | None = None  # real-time chunking: executed, delay, prefix_len

    @classmethod
    def of(cls, body: Mapping[str, Any], url: str) -> StepReply:
        return cls(
            outputs={name: np.array(value) for name, value in body["outputs"].items()},
            episode_id=body.get("episode_id"),
            device=str(body["device"]),
            node=str(body["node"]),
            token=int(body["token"]),
            routing=str(body["routing"]),
            state_reset=bool(body["state_reset"]),
            degraded=bool(body.get("degraded", False)),
            source=str(body.get("source", "model")),
            url=url,
            seq=int(body.get("seq", 0)),
            replayed=bool(body.get("replayed", False)),
            model=body.get("model"),
            rtc=body.get("rtc"),
        )


Step = StepReply
"""The former name of :class:`StepReply`, kept for one release."""

_BACKOFF_S = (0.1, 0.2, 0.4, 0.8, 1.0)
"""The waits before another round once every node failed to answer (then 1 s each)."""


def _node_url(url: str) -> str:
    """``url`` without a trailing slash; ``ValueError`` naming it unless it is an
    ``http://`` or ``https://`` URL with a host (a typo must fail once, here, not as a
    retryable failure of every step)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        example = f"http://{url}" if "://" not in url else "http://node-a:8000"
        raise ValueError(
            f"node URL {url!r}: must be an http:// or https:// URL with a host, such as {example!r}"
        )
    return url.rstrip("/")


@dataclass
class _StickyRoutes:
    """The clients' shared logic: where each episode's steps go (its owner, else the
    configured nodes in turn), what each step sends, and what to do with an answer. No
    I/O: :meth:`attempts` is a generator the clients drive."""

    nodes: tuple[str, ...]
    retries: int | None
    retry_budget_s: float
    raise_on_reset: bool
    tokens: dict[str, int] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)  # the last reply's seq per episode
    _next: Iterator[str] = field(init=False)

    @classmethod
    def of(
        cls,
        nodes: Sequence[str] | str,
        retries: int | None,
        retry_budget_s: float,
        raise_on_reset: bool,
    ) -> _StickyRoutes:
        """Raises ``ValueError`` for no node, or a node URL that is not ``http(s)://``."""
        urls = (nodes,) if isinstance(nodes, str) else tuple(nodes)
        return cls(tuple(_node_url(u) for u in urls), retries, retry_budget_s, raise_on_reset)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a client needs at least one node URL")
        if self.retries is not None and self.retries < 0:
            raise ValueError(f"retries {self.retries}: must be >= 0 (or None: the budget alone)")
        self._next = itertools.cycle(self.nodes)

    def body(self, episode: str | None, inputs: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
        # falsy values are sent too: execute_steps=0 is the node's to refuse, not ours to drop
        body: dict[str, Any] = {
            "inputs": dict(inputs),
            **{k: v for k, v in extra.items() if v is not None},
        }
        if episode is not None:
            body["episode_id"] = episode
            body["seq"] = self.seqs.get(episode, 0) + 1
            if episode in self.tokens:
                body["token"] = self.tokens[episode]
        return body

    def attempts(
        self,
        episode: str | None,
        inputs: Mapping[str, Any],
        *,
        end: bool,
        fields: Mapping[str, Any],
    ) -> Generator[
        tuple[str, dict[str, Any]] | float, httpx.Response | Exception | None, StepReply
    ]:
        """The attempts of one step, without I/O: yields (URL, body) to POST to ``URL/act``
        (and is sent the response, or the transport error), or seconds to sleep (and is
        sent ``None``); returns the served :class:`StepReply` or raises a
        :class:`ClientError`. Attempts go on until one is served or refused, for at most
        ``retry_budget_s`` (and ``retries`` + 1 attempts, when given)."""
        body = self.body(episode, inputs, end=end, **fields)
        deadline = time.monotonic() + self.retry_budget_s
        tried_owner = False
        failed: set[str] = set()  # nodes that timed out or could not be reached
        rounds = 0  # waits after every node failed
        last: ClientError = ServiceUnavailable("unreachable", "no node answered")
        for attempt in itertools.count():
            if self.retries is not None and attempt > self.retries:
                break
            url, owner = self.target(episode, tried_owner, failed)
            tried_owner = tried_owner or owner
            result = yield url, body
            if isinstance(result, Exception):
                # a timeout or a broken connection: the step may have run there; the seq
                # makes the retry safe, and it goes elsewhere while there is elsewhere
                failed.add(url)
                last = ServiceUnavailable(
                    "unreachable", f"{url}: {type(result).__name__}: {result}"
                )
                wait = 0.0
                if failed.issuperset(self.nodes):  # a whole round failed: wait, then again
                    wait = _BACKOFF_S[min(rounds, len(_BACKOFF_S) - 1)]
                    rounds += 1
                    failed.clear()
            else:
                assert isinstance(result, httpx.Response)
                if result.status_code == 200:
                    step = self.served(episode, result)
                    if end and episode is not None:
                        self.forget(episode)
                    return step
                last = self.failed(result)
                if result.status_code != 503:
                    if owner:
                        continue  # the owner refused (e.g. the episode moved): ask the fleet
                    raise last
                # the owner's 503 goes to the fleet at once; the fleet's is waited out
                wait = 0.0 if owner else self.retry_after(result)
            if time.monotonic() + wait >= deadline:
                break
            if wait:
                yield wait
        raise last

    def target(
        self, episode: str | None, tried_owner: bool, failed: Collection[str] = ()
    ) -> tuple[str, bool]:
        """(URL for this attempt, whether it is the episode's owner): the owner first, then
        the configured nodes in turn, skipping those in ``failed`` while others remain."""
        owner = self.owners.get(episode) if episode is not None else None
        if owner is not None and not tried_owner and owner not in failed:
            return owner, True
        for _ in self.nodes:
            url = next(self._next)
            if url not in failed:
                return url, False
        return next(self._next), False

    def served(self, episode: str | None, response: httpx.Response) -> StepReply:
        url = response.headers.get("x-affinity-url", "")
        step = StepReply.of(_decode(response), url)
        if episode is not None:
            self.tokens[episode] = step.token
            self.seqs[episode] = step.seq
            if url:
                self.owners[episode] = url
            if step.routing == "stateless":
                self.owners.pop(episode, None)
        if step.state_reset and self.raise_on_reset:
            raise StateReset(step)
        return step

    def forget(self, episode: str) -> None:
        self.tokens.pop(episode, None)
        self.owners.pop(episode, None)
        self.seqs.pop(episode, None)

    def failed(self, response: httpx.Response) -> ClientError:
        try:
            err = response.json()["error"]
            code, message, where = str(err["code"]), str(err["message"]), err.get("field")
        except (ValueError, KeyError, TypeError):
            code, message, where = "http_error", response.text[:200], None
        if response.status_code == 503:
            return ServiceUnavailable(code, message)
        return RequestRefused(response.status_code, code, message, where)

    @staticmethod
    def retry_after(response: httpx.Response) -> float:
        """The 503's ``Retry-After`` in seconds, 0.1-30 (a missing or bad one: 1)."""
        raw = response.headers.get("retry-after", "1")
        try:
            return min(max(float(raw), 0.1), 30.0)
        except ValueError:
            return 1.0


Encoding = Literal["msgpack", "json"]
"""How the clients send ``/act`` bodies and ask for replies."""

_MSGPACK = "application/msgpack"
_CONTENT = {
    "msgpack": {"Content-Type": _MSGPACK, "Accept": _MSGPACK},
    "json": {"Content-Type": "application/json", "Accept": "application/json"},
}


def _encoding(encoding: str) -> Encoding:
    if encoding not in _CONTENT:
        raise ValueError(f"encoding {encoding!r}: must be one of {', '.join(_CONTENT)}")
    return "msgpack" if encoding == "msgpack" else "json"


def _encode(body: Mapping[str, Any], encoding: Encoding) -> tuple[bytes, dict[str, str]]:
    """A step's body and its headers: numpy arrays as they are in msgpack (openpi's array
    encoding, :mod:`affinity.wire`), as nested lists in JSON."""
    if encoding == "msgpack":
        return wire.encode(body), _CONTENT["msgpack"]
    inputs = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in body["inputs"].items()}
    return orjson.dumps({**body, "inputs": inputs}), _CONTENT["json"]


def _decode(response: httpx.Response) -> Any:
    """A 200 reply's body, by its ``Content-Type``."""
    if response.headers.get("content-type", "").split(";")[0].strip() == _MSGPACK:
        return wire.decode(response.content)
    return response.json()


@dataclass(frozen=True)
class _Wire:
    """What every request of a client carries: the encoding, its own headers (the API
    key) and httpx's timeout extension."""

    encoding: Encoding
    headers: Mapping[str, str]
    extensions: Mapping[str, Any]

    @classmethod
    def of(cls, encoding: str, api_key: str | None, timeout: float) -> _Wire:
        auth = {"Authorization": f"Api-Key {api_key}"} if api_key else {}
        return cls(_encoding(encoding), auth, {"timeout": httpx.Timeout(timeout).as_dict()})

    def request(self, url: str, body: Mapping[str, Any]) -> httpx.Request:
        data, headers = _encode(body, self.encoding)
        headers = {**self.headers, **headers}
        return httpx.Request(
            "POST", _act_url(url), content=data, headers=headers, extensions=dict(self.extensions)
        )


@functools.lru_cache(maxsize=256)
def _act_url(node: str) -> httpx.URL:
    """``node``'s ``/act``, parsed once (half of building a request otherwise)."""
    return httpx.URL(node + "/act")


def _fields(
    model: str | None,
    execute_steps: int | None,
    executed: int | None,
    inference_delay: int | None,
    control_hz: float | None,
) -> dict[str, Any]:
    """A step's optional ``/act`` fields, as the node names them."""
    return {
        "model": model,
        "execute_steps": execute_steps,
        "executed": executed,
        "inference_delay": inference_delay,
        "control_hz": control_hz,
    }


class AsyncClient:
    """The async client (see the module doc). ``nodes`` are node base URLs (``http://`` or
    ``https://``; any of them accepts any episode); ``timeout`` bounds one HTTP attempt in
    seconds; ``retry_budget_s`` bounds one step's attempts and waits in seconds (30: an
    owner's crash costs a lease, 10 s by default, and a Retry-After), ``retries`` their
    number beyond the first (``None``: the budget alone); ``encoding`` is ``"msgpack"``
    (numpy arrays as bytes) or ``"json"``. Raises ``ValueError`` for a node URL that is not
    ``http(s)://``, or another encoding."""

    def __init__(
        self,
        nodes: Sequence[str] | str,
        *,
        timeout: float = 10.0,
        retries: int | None = None,
        retry_budget_s: float = 30.0,
        raise_on_reset: bool = False,
        api_key: str | None = None,
        encoding: Encoding = "msgpack",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._routes = _StickyRoutes.of(nodes, retries, retry_budget_s, raise_on_reset)
        self._wire = _Wire.of(encoding, api_key, timeout)
        self._transport = httpx.AsyncHTTPTransport() if transport is None else transport

    async def act(
        self,
        episode_id: str | None,
        inputs: Mapping[str, Any],
        *,
        end: bool = False,
        model: str | None = None,
        execute_steps: int | None = None,
        executed: int | None = None,
        inference_delay: int | None = None,
        control_hz: float | None = None,
    ) -> StepReply:
        """One step of ``episode_id`` (``None``: stateless). ``model`` names the policy
        (``name`` or ``name@version``; needed when the fleet serves several);
        ``execute_steps`` overrides action-chunk execution; ``executed``,
        ``inference_delay`` and ``control_hz`` are real-time chunking's (the node estimates
        what is left out; see docs/policies.md). ``None`` sends nothing. Raises
        :class:`StateReset` (if asked), :class:`RequestRefused`,
        :class:`ServiceUnavailable`."""
        fields = _fields(model, execute_steps, executed, inference_delay, control_hz)
        attempts = self._routes.attempts(episode_id, inputs, end=end, fields=fields)
        action = next(attempts)
        while True:
            result: httpx.Response | Exception | None = None
            if isinstance(action, float):
                await asyncio.sleep(action)
            else:
                try:
                    result = await self._transport.handle_async_request(self._wire.request(*action))
                    try:
                        await result.aread()
                    finally:
                        await result.aclose()
                except httpx.TransportError as exc:
                    result = exc
            try:
                action = attempts.send(result)
            except StopIteration as served:
                reply: StepReply = served.value
                return reply

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client:
    """The sync client: the same behaviour as :class:`AsyncClient`, on
    :class:`affinity.transport.Transport`."""

    def __init__(
        self,
        nodes: Sequence[str] | str,
        *,
        timeout: float = 10.0,
        retries: int | None = None,
        retry_budget_s: float = 30.0,
        raise_on_reset: bool = False,
        api_key: str | None = None,
        encoding: Encoding = "msgpack",
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._routes = _StickyRoutes.of(nodes, retries, retry_budget_s, raise_on_reset)
        self._wire = _Wire.of(encoding, api_key, timeout)
        self._transport = Transport() if transport is None else transport

    def act(
        self,
        episode_id: str | None,
        inputs: Mapping[str, Any],
        *,
        end: bool = False,
        model: str | None = None,
        execute_steps: int | None = None,
        executed: int | None = None,
        inference_delay: int | None = None,
        control_hz: float | None = None,
    ) -> StepReply:
        """One step of ``episode_id``; see :meth:`AsyncClient.act`."""
        fields = _fields(model, execute_steps, executed, inference_delay, control_hz)
        attempts = self._routes.attempts(episode_id, inputs, end=end, fields=fields)
        action = next(attempts)
        while True:
            result: httpx.Response | Exception | None = None
            if isinstance(action, float):
                time.sleep(action)
            else:
                try:
                    result = self._transport.handle_request(self._wire.request(*action))
                    try:
                        result.read()
                    finally:
                        result.close()
                except httpx.TransportError as exc:
                    result = exc
            try:
                action = attempts.send(result)
            except StopIteration as served:
                reply: StepReply = served.value
                return reply

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
