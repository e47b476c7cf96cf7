"""Python clients of the node's ``POST /act``: :class:`Client` (sync) and :class:`AsyncClient`.

They own each episode's client-side state: its token, its last ``seq`` and its owner's URL.
Every step sends ``seq``, so a retry after a timeout is never applied twice.
An episode's steps go straight to its owner; the configured nodes are the fallback.
A 503 is retried within ``retry_budget_s``; a 4xx raises :class:`RequestRefused` at once.
The decisions live in :class:`_StickyRoutes`, without I/O; the two clients only drive it.
The sync client posts on :class:`affinity.transport.Transport`: ``httpx.Client`` cost CPU.

Hazards: one episode's steps must be sequential; different episodes may run concurrently.
A node URL that is not ``http(s)://`` is a ``ValueError`` when the client is made.
Proxy variables (``HTTP_PROXY``) are not read: nodes are reached directly.
The manual is docs/protocols.md, "The Python client".
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable, Collection, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypedDict, TypeVar, Unpack
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
    "StepOptions",
    "StepReply",
    "StepRows",
    "drive",
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
    device: str  # the device that ran it ("gpu0")
    node: str  # the node that ran it
    token: int  # the claim's fencing token; the client echoes it with the next step
    routing: str  # how the step found its device: claimed, hit, reassigned or stateless
    state_reset: bool  # the episode's state started over with this step
    degraded: bool  # routed by ``session_id``: the request named no ``episode_id``
    source: str  # "model" (the policy ran) or "buffer" (the action chunk's next action)
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


@dataclass(frozen=True)
class StepRows:
    """The rows of one :meth:`Client.step_many`, in order: each a :class:`StepReply`, or
    the :class:`ClientError` that row ended with (a 4xx at once, a 503 once the retry
    budget ran out); the other rows were served."""

    replies: list[StepReply | ClientError]

    @property
    def ok(self) -> bool:
        return all(isinstance(r, StepReply) for r in self.replies)

    def stacked(self, name: str) -> np.ndarray[Any, Any]:
        """Output ``name`` of every row along a new leading axis (K rows); raises the
        first failed row's error."""
        for r in self.replies:
            if not isinstance(r, StepReply):
                raise r
        return np.stack([r.outputs[name] for r in self.replies])  # type: ignore[union-attr]


_BACKOFF_S = (0.1, 0.2, 0.4, 0.8, 1.0)
"""The waits before another round once every node failed to answer (then 1 s each)."""


def _node_url(url: str) -> str:
    """``url`` without a trailing slash.

    Raises ``ValueError`` naming it unless it is an ``http://`` or ``https://`` URL with a
    host. A typo must fail once, here, not as a retryable failure of every step."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        example = f"http://{url}" if "://" not in url else "http://node-a:8000"
        raise ValueError(
            f"node URL {url!r}: must be an http:// or https:// URL with a host, such as {example!r}"
        )
    return url.rstrip("/")


@dataclass
class _StickyRoutes:
    """The clients' shared logic: where steps go, what they send, what an answer means.

    Each episode's steps go to its owner, else the configured nodes in turn. No
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
        options: StepOptions,
    ) -> _Attempts:
        """The attempts of one step, without I/O.

        It yields (URL, body) to POST to ``URL/act``, and is sent the response or the
        transport error. Or it yields seconds to sleep, and is sent ``None``. It returns
        the served :class:`StepReply` or raises a :class:`ClientError`. Attempts go on
        until one is served or refused, for at most ``retry_budget_s`` (and ``retries`` + 1
        attempts, when given)."""
        unknown = options.keys() - _OPTIONS
        if unknown:
            raise TypeError(f"act() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        end = options.get("end", False)
        body = self.body(episode, inputs, **{"end": end, **options})
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

    def rows(
        self,
        episodes: Sequence[str],
        inputs: Mapping[str, Any],
        options: StepOptions,
    ) -> Generator[_Action, _Result, StepRows]:
        """The attempts of one message of rows (:meth:`attempts` for K episodes): row i's
        inputs are ``inputs[name][i]``. Every row names its ``seq``, so rows answered 503
        (or a message that broke) are sent again, alone, within ``retry_budget_s``."""
        unknown = options.keys() - _OPTIONS
        if unknown:
            raise TypeError(f"step_many() got unexpected keyword arguments: {sorted(unknown)}")
        k = len(episodes)
        if len(set(episodes)) != k:
            raise ValueError("step_many() needs distinct episode ids (one row each)")
        arrays = {name: np.asarray(v) for name, v in inputs.items()}
        for name, a in arrays.items():
            if a.ndim == 0 or a.shape[0] != k:
                raise ValueError(
                    f"input {name!r} has shape {a.shape}: its leading axis is the {k} rows"
                )
        end = options.get("end", False)
        results: list[StepReply | ClientError | None] = [None] * k
        pending = list(range(k))
        deadline = time.monotonic() + self.retry_budget_s
        failed: set[str] = set()
        rounds = 0
        for attempt in itertools.count():
            if not pending or (self.retries is not None and attempt > self.retries):
                break
            bodies = [
                self.body(
                    episodes[i], {n: a[i] for n, a in arrays.items()}, **{"end": end, **options}
                )
                for i in pending
            ]
            url, _ = self.target(None, True, failed)
            result = yield url, {"steps": bodies}
            wait = 0.0
            if isinstance(result, Exception):  # the seqs make sending them again safe
                failed.add(url)
                for i in pending:
                    results[i] = ServiceUnavailable("unreachable", f"{url}: {result}")
                if failed.issuperset(self.nodes):
                    wait = _BACKOFF_S[min(rounds, len(_BACKOFF_S) - 1)]
                    rounds += 1
                    failed.clear()
            else:
                assert isinstance(result, httpx.Response)
                if result.status_code != 200:
                    error = self.failed(result)
                    if result.status_code != 503:
                        raise error  # the message itself (duplicate ids, too many rows)
                    for i in pending:
                        results[i] = error
                    wait = self.retry_after(result)
                else:
                    again = []
                    for i, row in zip(pending, _decode(result)["steps"], strict=True):
                        results[i] = self._row(episodes[i], row, end)
                        if isinstance(results[i], ServiceUnavailable):
                            again.append(i)
                            wait = max(
                                wait, min(max(float(row["error"].get("retry_after", 1)), 0.1), 30.0)
                            )
                    pending = again
            if not pending or time.monotonic() + wait >= deadline:
                break
            if wait:
                yield wait
        return StepRows(
            [r if r is not None else ServiceUnavailable("unreachable", "") for r in results]
        )

    def _row(self, episode: str, row: Mapping[str, Any], end: bool) -> StepReply | ClientError:
        """One row's answer, recorded as :meth:`served` records a reply."""
        if "error" in row:
            e = row["error"]
            code, message = str(e.get("code", "http_error")), str(e.get("message", ""))
            if e.get("status") == 503:
                return ServiceUnavailable(code, message)
            return RequestRefused(int(e.get("status", 400)), code, message, e.get("field"))
        step = StepReply.of(row, "")
        self._record(episode, step, "")
        if end:
            self.forget(episode)
        if step.state_reset and self.raise_on_reset:
            return StateReset(step)
        return step

    def served(self, episode: str | None, response: httpx.Response) -> StepReply:
        url = response.headers.get("x-affinity-url", "")
        step = StepReply.of(_decode(response), url)
        self._record(episode, step, url)
        if step.state_reset and self.raise_on_reset:
            raise StateReset(step)
        return step

    def _record(self, episode: str | None, step: StepReply, url: str) -> None:
        if episode is not None:
            self.tokens[episode] = step.token
            self.seqs[episode] = step.seq
            if url:
                self.owners[episode] = url
            if step.routing == "stateless":
                self.owners.pop(episode, None)

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
    if "steps" in body:  # a message of rows
        rows = [orjson.loads(_encode(row, encoding)[0]) for row in body["steps"]]
        return orjson.dumps({"steps": rows}), _CONTENT["json"]
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


_OPTIONS = frozenset(("end", "model", "execute_steps", "executed", "inference_delay", "control_hz"))


class StepOptions(TypedDict, total=False):
    """The keyword options of ``act``, sent as the ``/act`` fields of the same names.

    One left out (or ``None``) is not sent, but ``end`` is always sent (``False`` by
    default)."""

    end: bool  # the episode ends with this step: the node drops its state
    model: str | None  # ``name`` or ``name@version``; needed when the fleet serves several
    execute_steps: int | None  # overrides action-chunk execution
    executed: int | None  # real-time chunking: actions executed since the last chunk
    inference_delay: int | None  # real-time chunking: actions the inference will take
    control_hz: float | None  # real-time chunking: the robot's control rate


_Action = tuple[str, dict[str, Any]] | float
_Result = httpx.Response | Exception | None
_Attempts = Generator[_Action, _Result, "StepReply"]
_T = TypeVar("_T", httpx.BaseTransport, httpx.AsyncBaseTransport)


def _advance(attempts: _Attempts, result: _Result) -> _Action | StepReply:
    """What ``attempts`` asks for next once sent ``result``, or the reply it returns."""
    try:
        return attempts.send(result)
    except StopIteration as served:
        reply: StepReply = served.value
        return reply


class _ClientBase(Generic[_T]):
    """What both clients hold: the episodes' routes, the wire settings and a transport
    (``transport``, else :meth:`_default_transport`). Parameters: see :class:`AsyncClient`."""

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
        transport: _T | None = None,
    ) -> None:
        self._routes = _StickyRoutes.of(nodes, retries, retry_budget_s, raise_on_reset)
        self._wire = _Wire.of(encoding, api_key, timeout)
        self._transport: _T = self._default_transport() if transport is None else transport

    def _default_transport(self) -> _T:
        raise NotImplementedError


class AsyncClient(_ClientBase[httpx.AsyncBaseTransport]):
    """The async client (see the module doc).

    ``nodes`` are node base URLs (``http://`` or ``https://``; any of them accepts any
    episode). ``timeout`` bounds one HTTP attempt in seconds. ``retry_budget_s`` bounds one
    step's attempts and waits in seconds. (30: an owner's crash costs a lease, 10 s by
    default, and a Retry-After.) ``retries`` is their number beyond the first (``None``:
    the budget alone). ``encoding`` is ``"msgpack"`` (numpy arrays as bytes) or ``"json"``.
    ``transport`` is any httpx async transport (``httpx.AsyncHTTPTransport`` by default).
    Raises ``ValueError`` for a node URL that is not ``http(s)://``, or another encoding."""

    def _default_transport(self) -> httpx.AsyncBaseTransport:
        return httpx.AsyncHTTPTransport()

    async def act(
        self, episode_id: str | None, inputs: Mapping[str, Any], **options: Unpack[StepOptions]
    ) -> StepReply:
        """One step of ``episode_id`` (``None``: stateless); ``options`` are
        :class:`StepOptions` (``end``, ``model``, ``execute_steps``, and real-time chunking's
        ``executed``, ``inference_delay``, ``control_hz``: the node estimates what is left
        out; see docs/policies.md). Raises :class:`StateReset` (if asked),
        :class:`RequestRefused`, :class:`ServiceUnavailable`; ``TypeError`` for another
        option."""
        attempts = self._routes.attempts(episode_id, inputs, options)
        result: _Result = None
        while not isinstance(action := _advance(attempts, result), StepReply):
            if isinstance(action, float):
                await asyncio.sleep(action)
                result = None
            else:
                result = await self._post(self._wire.request(*action))
        return action

    async def step_many(
        self,
        episode_ids: Sequence[str],
        inputs: Mapping[str, Any],
        **options: Unpack[StepOptions],
    ) -> StepRows:
        """One step of each of K episodes in one message: row i's inputs are
        ``inputs[name][i]`` (arrays with a leading axis of K rows). The fleet splits the
        rows by owner; each keeps a one-row step's guarantees. Rows answered 503 are sent
        again within the retry budget. Raises :class:`RequestRefused` when the message
        itself is refused (``ValueError`` here for duplicate ids)."""
        attempts = self._routes.rows(episode_ids, inputs, options)
        result: _Result = None
        while True:
            try:
                action = attempts.send(result)
            except StopIteration as done:
                rows: StepRows = done.value
                return rows
            if isinstance(action, float):
                await asyncio.sleep(action)
                result = None
            else:
                result = await self._post(self._wire.request(*action))

    async def _post(self, request: httpx.Request) -> httpx.Response | httpx.TransportError:
        """The response, read, or the transport error (the step may have run there)."""
        try:
            response = await self._transport.handle_async_request(request)
            try:
                await response.aread()
            finally:
                await response.aclose()
        except httpx.TransportError as exc:
            return exc
        return response

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client(_ClientBase[httpx.BaseTransport]):
    """The sync client: the same behaviour and parameters as :class:`AsyncClient`, on
    :class:`affinity.transport.Transport` (``transport`` is any httpx sync transport)."""

    def _default_transport(self) -> httpx.BaseTransport:
        return Transport()

    def act(
        self, episode_id: str | None, inputs: Mapping[str, Any], **options: Unpack[StepOptions]
    ) -> StepReply:
        """One step of ``episode_id``; see :meth:`AsyncClient.act`."""
        attempts = self._routes.attempts(episode_id, inputs, options)
        result: _Result = None
        while not isinstance(action := _advance(attempts, result), StepReply):
            if isinstance(action, float):
                time.sleep(action)
                result = None
            else:
                result = self._post(self._wire.request(*action))
        return action

    def step_many(
        self,
        episode_ids: Sequence[str],
        inputs: Mapping[str, Any],
        **options: Unpack[StepOptions],
    ) -> StepRows:
        """One step of each of K episodes in one message; see :meth:`AsyncClient.step_many`."""
        attempts = self._routes.rows(episode_ids, inputs, options)
        result: _Result = None
        while True:
            try:
                action = attempts.send(result)
            except StopIteration as done:
                rows: StepRows = done.value
                return rows
            if isinstance(action, float):
                time.sleep(action)
                result = None
            else:
                result = self._post(self._wire.request(*action))

    def _post(self, request: httpx.Request) -> httpx.Response | httpx.TransportError:
        """The response, read, or the transport error (the step may have run there)."""
        try:
            response = self._transport.handle_request(request)
            try:
                response.read()
            finally:
                response.close()
        except httpx.TransportError as exc:
            return exc
        return response

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drive(
    client: Client,
    episode_ids: Sequence[str],
    observations: Mapping[str, Any],
    step: Callable[[dict[str, np.ndarray[Any, Any]]], Mapping[str, Any] | None],
    *,
    output: str = "actions",
) -> int:
    """Drive K episodes (a vectorized environment, K simulated robots) through the fleet:
    each round sends the K rows of ``observations`` (arrays with a leading axis of K) in
    one message, and calls ``step`` with the outputs stacked along that axis; ``step``
    returns the next observations, or None to stop. Returns the rounds run. Raises the
    first failed row's :class:`ClientError` (the fleet retried it within the budget).

    With a Gymnasium ``VectorEnv``: ``drive(client, ids, {"obs": env.reset()[0]}, lambda
    out: {"obs": env.step(out["actions"])[0]})``."""
    rounds = 0
    current: Mapping[str, Any] | None = observations
    while current is not None:
        rows = client.step_many(episode_ids, current)
        first = rows.replies[0]
        names = first.outputs if isinstance(first, StepReply) else {output: None}
        current = step({name: rows.stacked(name) for name in names})
        rounds += 1
    return rounds
