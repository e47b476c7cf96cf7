"""The node's runtime: registration, lease and self-fencing, routing, forwarding.

Everything here is transport-agnostic except the forward, which is one pooled keep-alive
``httpx`` client. ``node/app.py`` maps results and errors to HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from affinity import (
    AffinityError,
    Assignment,
    BackendUnavailable,
    Claims,
    DeviceRegistration,
    InvalidArgument,
    NoCapacity,
    NodeConflict,
    Registry,
    StaleToken,
    UnknownEpisode,
    check_episode,
    close,
)
from node.config import NodeConfig
from node.devices import DeviceSpec
from node.dispatcher import MultiGpuDispatcher
from node.metrics import Metrics
from node.policy import PolicyContract, parse_inputs

__all__ = ["ActReply", "NodeService", "Refused", "Unavailable"]

log = logging.getLogger("affinity.node")
VERSION = "0.1.0"
SECRET_HEADER = "X-Affinity-Secret"

Array = np.ndarray[Any, Any]


class Unavailable(Exception):
    """The request cannot be decided or served now; answer 503 with ``Retry-After``."""

    def __init__(self, reason: str, message: str, retry_after: float = 1.0) -> None:
        self.reason = reason
        self.retry_after = retry_after
        super().__init__(message)


class Refused(Exception):
    """A forwarded request the owner will not serve (409 stale token, 421 not the owner,
    403 bad secret)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True)
class ActReply:
    outputs: dict[str, Any]  # name -> nested lists
    episode_id: str | None
    device: str
    node: str
    token: int
    routing: str
    state_reset: bool
    degraded: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "outputs": self.outputs,
            "episode_id": self.episode_id,
            "device": self.device,
            "node": self.node,
            "token": self.token,
            "routing": self.routing,
            "state_reset": self.state_reset,
            "degraded": self.degraded,
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ActReply:
        return cls(
            outputs=dict(body["outputs"]),
            episode_id=body["episode_id"],
            device=str(body["device"]),
            node=str(body["node"]),
            token=int(body["token"]),
            routing=str(body["routing"]),
            state_reset=bool(body["state_reset"]),
            degraded=bool(body["degraded"]),
        )


def _lists(outputs: Mapping[str, Array]) -> dict[str, Any]:
    return {k: np.asarray(v).tolist() for k, v in outputs.items()}


class NodeService:
    """One node: its devices' dispatcher, its lease, and the routing of ``/act``."""

    def __init__(
        self,
        config: NodeConfig,
        redis: Any,
        specs: list[DeviceSpec],
        providers: Mapping[int, str],
        dispatcher_factory: Callable[
            [list[str], Callable[[str, str, str], None]], MultiGpuDispatcher
        ],
        contract: PolicyContract,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
        owns_redis: bool = False,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.redis = redis
        self.owns_redis = owns_redis  # close it at stop (it was made for this node)
        self.claims = Claims(redis, config.settings)
        self.registry = Registry(redis, config.settings)
        self.contract = contract
        self.clock = clock
        self.specs = specs
        self.providers = dict(providers)
        self.device_ids = [f"{config.node_id}/{s.index}" for s in specs]
        self.metrics = Metrics(self.device_ids)
        self.dispatcher = dispatcher_factory(self.device_ids, self._on_transition_threadsafe)
        self.lease_deadline = float("-inf")  # monotonic; nothing is served before register
        self.instance = uuid.uuid4().hex  # tells this process from another with the same id
        self.registered = False
        self._fenced_logged = False
        self._rr = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            timeout=httpx.Timeout(config.act_deadline_s),
            transport=transport,
        )
        self._degraded_warned = False

    # ---- lifecycle -------------------------------------------------------------------

    @property
    def lease_s(self) -> float:
        """How long after sending a renewal this node may serve: the lease TTL less a small
        margin, since Redis floors its clock to milliseconds and clock rates differ."""
        ttl = self.config.settings.lease_ttl_s
        return ttl - max(0.01, 0.02 * ttl)

    def registrations(self) -> list[DeviceRegistration]:
        return [
            DeviceRegistration(
                index=s.index,
                kind=s.kind,
                name=s.name,
                uuid=s.uuid,
                arch=s.arch,
                memory_mb=s.memory_mb,
                capacity=self.config.capacity,
                weight=self.config.weight,
                provider=self.providers.get(s.index, ""),
            )
            for s in self.specs
        ]

    async def register(self) -> None:
        """Register (again); only then does this node serve. Drops any local state: a node
        that lost its registration may have lost its episodes to other devices."""
        sent = self.clock()
        self.dispatcher.drop_all()
        await self.registry.register(
            self.node_id,
            self.config.advertise_url,
            self.registrations(),
            VERSION,
            instance=self.instance,
        )
        self.lease_deadline = sent + self.lease_s
        self.registered = True
        self._fenced_logged = False
        self.metrics.fenced.set(0)
        log.info(
            "node %s registered %d device(s) at %s",
            self.node_id,
            len(self.device_ids),
            self.config.advertise_url,
        )

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.config.cluster_secret and self.config.settings.redis_url:
            log.warning(
                "AFFINITY_CLUSTER_SECRET is unset: forwarded requests between nodes are "
                "not authenticated"
            )
        # A previous process with this id (killed, restarted at once) may still hold a
        # current lease: wait for it to lapse rather than serve its devices beside it.
        deadline = self.clock() + 2 * self.config.settings.lease_ttl_s + 1
        while True:
            try:
                await self.register()
                break
            except NodeConflict:
                if self.clock() > deadline:
                    raise
                log.warning("node id %s is still leased by another process; waiting", self.node_id)
                await asyncio.sleep(min(1.0, self.config.renew_every_s))
        self._tasks = [
            asyncio.create_task(self._renew_loop(), name="affinity-renew"),
            asyncio.create_task(self._maintenance_loop(), name="affinity-maintenance"),
        ]

    async def stop(self) -> None:
        """Graceful stop (after in-flight requests finished): deregister, which releases
        this node's episodes so they move at once."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.lease_deadline = float("-inf")  # serve nothing more, whatever is still queued
        self.dispatcher.drop_all()
        if self.registered:
            try:
                released = await self.registry.deregister(self.node_id, self.instance)
                log.info("node %s deregistered; released %d episode(s)", self.node_id, released)
            except AffinityError as exc:
                log.error("could not deregister node %s: %s", self.node_id, exc)
        self.dispatcher.close()
        await self._http.aclose()
        if self.owns_redis:
            await close(self.redis)

    async def renew_once(self) -> None:
        sent = self.clock()
        try:
            ok = await self.registry.renew(self.node_id, self.instance)
        except AffinityError as exc:
            self.metrics.renewals.labels("failed").inc()
            log.warning("lease renewal of %s failed: %s", self.node_id, exc)
            return
        if ok:
            self.metrics.renewals.labels("ok").inc()
            self.lease_deadline = sent + self.lease_s
            with contextlib.suppress(AffinityError):
                await self._reconcile()
            if self._fenced_logged:
                log.info("node %s lease renewed; serving again", self.node_id)
                self._fenced_logged = False
                self.metrics.fenced.set(0)
            return
        log.warning("node %s is no longer registered (lease lapsed or Redis lost it)", self.node_id)
        try:
            await self.register()
            self.metrics.renewals.labels("reregistered").inc()
        except AffinityError as exc:
            self.metrics.renewals.labels("failed").inc()
            log.warning("re-registration of %s failed: %s", self.node_id, exc)

    async def _renew_loop(self) -> None:
        while True:
            interval = self.config.renew_every_s
            if self.fenced():
                interval = min(interval, 0.5)  # come back quickly once Redis answers
            await asyncio.sleep(interval)
            try:
                await self.renew_once()
            except Exception:  # a renewal loop that dies would fence the node for good
                self.metrics.renewals.labels("failed").inc()
                log.exception("lease renewal of %s failed", self.node_id)

    async def _maintenance_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.renew_every_s))
            try:
                self.fenced()
                self.dispatcher.expire_idle()
                async with asyncio.timeout(self.config.act_deadline_s):
                    for device in await self.dispatcher.probe():
                        log.info("device %s passed its probe", device)
                self.refresh_gauges()
            except Exception:  # includes a probe that hangs past the deadline
                log.exception("maintenance of node %s failed", self.node_id)

    def refresh_gauges(self) -> None:
        for device in self.device_ids:
            self.metrics.live.labels(device).set(self.dispatcher.live_episodes(device))

    async def _reconcile(self) -> None:
        """Make Redis agree with the local crash trackers (a lost or reordered down/up
        write must not leave a crashed device taking claims, or a healthy one down), and
        the state gauges with Redis (an operator's drain). ``down`` belongs to the node."""
        states = await self.registry.states(self.device_ids)
        for device, state in states.items():
            tracker = self.dispatcher.tracker(device)
            if tracker.down and state in ("active", "draining"):
                state = "down"
                await self.registry.set_state(device, "down", tracker.last_error[:256])
            elif not tracker.down and state == "down":
                change = await self.registry.set_state(device, "active", "", only_if="down")
                state = change.state  # a drain from before comes back
            if state in ("active", "draining", "down"):
                self.metrics.set_state(device, state)

    def fenced(self) -> bool:
        """True (and local state dropped) when the lease deadline has passed locally."""
        if self.clock() < self.lease_deadline:
            return False
        if not self._fenced_logged:
            self._fenced_logged = True
            dropped = self.dispatcher.drop_all()
            self.metrics.fenced.set(1)
            log.error(
                "node %s fenced itself: lease not renewed within %.1fs; dropped %d episode "
                "state(s), answering 503 until registered again",
                self.node_id,
                self.config.settings.lease_ttl_s,
                dropped,
            )
        return True

    def _check_lease(self) -> None:
        if self.fenced():
            raise Unavailable("fenced", f"node {self.node_id} lease is not current", 1.0)

    # ---- crash tracker -> registry -----------------------------------------------------

    def _on_transition_threadsafe(self, device: str, to: str, reason: str) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.call_soon_threadsafe(
            lambda: self._tasks.append(
                asyncio.ensure_future(self._on_transition(device, to, reason))
            )
        )

    async def _on_transition(self, device: str, to: str, reason: str) -> None:
        self.metrics.transitions.labels(device, to).inc()
        self.metrics.set_state(device, "down" if to == "down" else "active")
        try:
            if to == "down":
                await self.registry.set_state(device, "down", reason[:256])
            else:  # back to what it was before (an operator's drain stays a drain)
                await self.registry.set_state(device, "active", "", only_if="down")
        except AffinityError as exc:
            log.error("could not record %s as %s: %s", device, to, exc)

    # ---- /act ------------------------------------------------------------------------

    def _parse(self, body: Mapping[str, Any]) -> _Step:
        inputs = parse_inputs(self.contract, body.get("inputs"))
        end, token = body.get("end", False), body.get("token")
        if not isinstance(end, bool):
            raise InvalidArgument("end", end, "must be true or false")
        if token is not None and (
            isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**63
        ):
            raise InvalidArgument("token", token, "must be the token of an earlier reply")
        return _Step(inputs, body.get("inputs"), end, token)

    async def act(self, body: Mapping[str, Any]) -> ActReply:
        """Route and serve one ``/act`` body (see ``node/app.py``).

        Raises InvalidInput/InvalidArgument (4xx, nothing changed), Unavailable (503)."""
        step = self._parse(body)
        self._check_lease()
        key = body.get("episode_id")
        if key is None and body.get("session_id") is not None:
            key, step.degraded = body["session_id"], True
            check_episode(key)
            self.metrics.degraded.inc()
            if not self._degraded_warned:
                self._degraded_warned = True
                log.warning("requests without episode_id are routed by session_id (degraded)")
        if key is None:
            return await self._stateless(step.inputs)
        a = await self._resolve(key)
        if a.node == self.node_id:
            return await self._serve_local(a, step)
        return await self._forward(a, step, retry=True)

    async def _resolve(self, episode: str) -> Assignment:
        try:
            a = await self.claims.resolve(episode)
        except BackendUnavailable as exc:
            self.metrics.routing.labels("unavailable").inc()
            raise Unavailable("redis", str(exc), 1.0) from exc
        except NoCapacity as exc:
            self.metrics.routing.labels("full").inc()
            raise Unavailable("full", str(exc), 2.0) from exc
        self.metrics.routing.labels(a.status).inc()
        return a

    async def _stateless(self, inputs: Mapping[str, Array]) -> ActReply:
        up = [d for d in self.device_ids if not self.dispatcher.tracker(d).down]
        if not up:
            self.metrics.routing.labels("unavailable").inc()
            raise Unavailable("down", "every device of this node is down", 5.0)
        device = up[self._rr % len(up)]
        self._rr += 1
        started = time.perf_counter()
        outputs = await self.dispatcher.run_stateless(device, inputs)
        self.metrics.routing.labels("stateless").inc()
        self.metrics.act_seconds.labels("local").observe(time.perf_counter() - started)
        return ActReply(_lists(outputs), None, device, self.node_id, 0, "stateless", False, False)

    async def _serve_local(self, a: Assignment, step: _Step) -> ActReply:
        started = time.perf_counter()
        self._check_lease()  # the resolve may have taken a while: check again
        result = await self.dispatcher.step(
            a.device, a.episode, a.token, a.status == "claimed", step.inputs
        )
        if self.fenced():  # the lease ran out while the model ran: this reply may be stale
            self.dispatcher.release(a.episode)
            raise Unavailable("fenced", f"node {self.node_id} lease ran out during the step", 1.0)
        if step.end:
            await self.end_episode(a.episode, a.token)
        self.metrics.act_seconds.labels("local").observe(time.perf_counter() - started)
        # The client's echo of its last token tells a lost assignment (Redis restarted
        # empty, a failover dropped the last writes) from a new episode.
        reset = result.state_reset or (step.client_token not in (None, a.token))
        return ActReply(
            _lists(result.outputs),
            a.episode,
            a.device,
            self.node_id,
            a.token,
            a.status,
            reset,
            step.degraded,
        )

    async def end_episode(self, episode: str, token: int) -> None:
        self.dispatcher.release(episode)
        with contextlib.suppress(StaleToken, UnknownEpisode):
            await self.claims.release(episode, token)

    # ---- forwarding ------------------------------------------------------------------

    async def _forward(self, a: Assignment, step: _Step, retry: bool) -> ActReply:
        started = time.perf_counter()
        payload = {
            "episode_id": a.episode,
            "token": a.token,
            "device": a.device,
            "routing": a.status,
            "inputs": step.raw_inputs,
            "end": step.end,
            "degraded": step.degraded,
            "client_token": step.client_token,
        }
        headers = {SECRET_HEADER: self.config.cluster_secret or ""}
        try:
            resp = await self._http.post(a.url + "/internal/act", json=payload, headers=headers)
        except httpx.HTTPError as exc:
            self.metrics.forwarded.labels("unreachable").inc()
            raise Unavailable(
                "owner_unreachable",
                f"episode {a.episode!r} is owned by {a.device} on {a.node} ({a.url}), "
                f"which did not answer: {type(exc).__name__}",
                1.0,
            ) from exc
        if resp.status_code != 200:
            self.metrics.forwarded.labels("refused").inc()
            code, message = _error_of(resp)
            text = f"owner {a.node} answered {resp.status_code}: {message}"
            if resp.status_code in (409, 421):
                if retry:  # our view was stale: resolve once more
                    again = await self._resolve(a.episode)
                    if again.node == self.node_id:
                        return await self._serve_local(again, step)
                    return await self._forward(again, step, retry=False)
                raise Unavailable("owner_refused", text, 1.0)
            # the owner's own answer (model failure, fenced, ...) passes through
            if resp.status_code == 503:
                raise Unavailable(code, text, float(resp.headers.get("retry-after", "1")))
            raise Refused(resp.status_code, code, text)
        self.metrics.forwarded.labels("ok").inc()
        self.metrics.act_seconds.labels("forwarded").observe(time.perf_counter() - started)
        return ActReply.from_json(resp.json())

    async def act_forwarded(self, body: Mapping[str, Any], secret: str | None) -> ActReply:
        """Serve a request another node forwarded here after resolving it.

        Refuses (403) a wrong cluster secret, (421) a device not on this node, (409) a
        token older than the one this node holds for the episode."""
        expected = self.config.cluster_secret or ""
        if expected and not hmac.compare_digest((secret or "").encode(), expected.encode()):
            raise Refused(403, "bad_secret", "missing or wrong cluster secret")
        self._check_lease()
        step = self._parse({**body, "token": body.get("client_token")})
        step.degraded = bool(body.get("degraded", False))
        device, episode = body.get("device"), body.get("episode_id")
        token, routing = body.get("token"), body.get("routing")
        if not isinstance(device, str) or device not in self.device_ids:
            raise Refused(421, "not_owner", f"device {device!r} is not on node {self.node_id}")
        if not isinstance(episode, str) or not isinstance(token, int) or isinstance(token, bool):
            raise Refused(400, "bad_forward", "episode_id and token are required")
        if routing not in ("hit", "claimed", "reassigned"):
            raise Refused(400, "bad_forward", f"routing {routing!r}")
        local = self.dispatcher.token_of(episode)
        if local is not None and local > token:
            raise Refused(
                409, "stale_token", f"episode {episode!r}: token {token} is older than {local}"
            )
        if local != token:
            # about to start state for a token this node does not hold: make sure Redis
            # still gives (device, token) to this episode, so a forward that was in flight
            # while the episode ended and moved never starts a second owner
            try:
                info = await self.claims.lookup(episode)
            except BackendUnavailable as exc:
                raise Unavailable("redis", str(exc), 1.0) from exc
            if info is None or (info.device, info.token) != (device, token):
                raise Refused(
                    409,
                    "stale_token",
                    f"episode {episode!r} is no longer {device} with token {token}",
                )
        return await self._serve_local(
            Assignment(episode, routing, device, token, self.node_id, "", None), step
        )


@dataclass
class _Step:
    inputs: dict[str, Array]
    raw_inputs: Any
    end: bool
    client_token: int | None
    degraded: bool = False


def _error_of(resp: httpx.Response) -> tuple[str, str]:
    try:
        err = resp.json()["error"]
        return str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        return "owner_error", resp.text[:200]
