"""How an episode moves to another node with its state: the live hand-over, the third door.

The old owner stops serving the episode; its new steps wait, bounded by their deadlines.
It waits for the step in flight. It asks Redis for a device that serves the episode's model
and has room; a slot is reserved there and a token issued (``affinity/transfers.py``). It
sends the record to that device's node, which installs it unconfirmed. Then it commits in
Redis, only while its own claim still holds the episode and its lease is live. Then it
drops its copy. The new owner serves the record from memory once Redis (a routed step) or
the old owner confirms it. Any failure leaves exactly one owner. Before the commit the old
owner keeps the episode. When nothing can take it, it hands it over without its state,
said with ``state_reset``. After the commit, the new one holds it.

Why this is hard: the commit is the only moment ownership changes. A record installed on
a node whose commit never came must never be served from memory there. It is not
confirmed, and the new owner's first flush finds it lost and drops it. A paused old
owner's commit is refused once its lease lapsed. A step that waited behind the move asks
Redis again and reaches the new owner.

:class:`HandOvers` decides when: an operator's move or drain, a graceful stop, at most
:data:`MOVES_AT_ONCE` at a time, one per episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from affinity import AffinityError, Claims, wire
from affinity.registry import MoveRequest
from affinity.transfers import NotPlaced, Placement, Transfers
from node.contract import PolicyContract
from node.episodes import Episode, EpisodeTable
from node.errors import ForwardError, Refused, TransferError
from node.forward import MOVE_PATH, Forward, Poster, send_undo
from node.lease import Lease
from node.metrics import Metrics
from node.transfer import Install, decode_install, encode_install, record_bytes

__all__ = ["HOLD_MS", "MOVES_AT_ONCE", "MOVE_S", "HandOvers", "MoveOutcome", "Mover", "Reason"]

log = logging.getLogger("affinity.node")

MoveOutcome = Literal["moved", "reset", "kept"]
"""moved: with its state; reset: handed over without it (said with state_reset); kept:
nothing moved (the episode is not held here, or its owner must keep it: fenced, released)."""
Reason = Literal["drain", "stop", "move"]

HOLD_MS = 10_000
"""How long Redis keeps the slot a move reserved (a move that dies leaves it to expire)."""
MOVE_S = 5.0
"""The most one move's record may take to reach the new owner."""
RETRY_S = 0.2
"""How often a move whose commit answer was lost asks Redis again whether it moved."""
MOVES_AT_ONCE = 16
"""How many episodes a node hands over at a time."""


class Mover:
    """Both sides of a live hand-over for one node (see the module doc)."""

    def __init__(
        self,
        node_id: str,
        table: EpisodeTable,
        lease: Lease,
        transfers: Transfers,
        lease_claims: Claims,
        pool: Poster,
        metrics: Metrics,
        contracts: Mapping[str, PolicyContract],
        secret: str | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.table = table
        self.lease = lease
        self.transfers = transfers
        self.lease_claims = lease_claims
        self.pool = pool
        self.metrics = metrics
        self.contracts = contracts  # model name -> contract, of the models served here
        self.secret = secret or ""
        self.clock = clock
        self._telling: set[asyncio.Task[None]] = set()

    # ---- the old owner ---------------------------------------------------------------

    async def hand_over(self, episode: str, reason: Reason, target: str = "") -> MoveOutcome:
        """Move ``episode`` with its state. When nothing can take it, or the transfer
        fails before its commit, hand it over without its state. Its next step is then
        ``reassigned`` with ``state_reset``. A hand-over already under way is joined."""
        if not self.table.begin_move(episode):
            await self.table.wait_moved(episode)
            return "kept"
        started = time.perf_counter()
        outcome: MoveOutcome = "kept"
        try:
            await self.table.wait_idle(episode)  # the step in flight, if any, finishes first
            outcome = await self._move(episode, reason, target)
        finally:
            self.table.end_move(episode)  # the steps that waited ask Redis again
            self.metrics.moves.labels(reason, outcome).inc()
            if outcome == "moved":
                self.metrics.move_seconds.observe(time.perf_counter() - started)
        return outcome

    async def _move(self, episode: str, reason: Reason, target: str) -> MoveOutcome:
        record = self.table.get(episode)
        if record is None:
            return "kept"
        instance = self.lease.instance
        try:
            to = await self.transfers.place(
                episode, record.token, record.claim, instance, target=target, hold_ms=HOLD_MS
            )
        except AffinityError as exc:
            return await self._fallback(episode, record.token, reason, str(exc))
        if isinstance(to, NotPlaced):
            if to.reason == "none":
                why = "no device of a live node serving its model has room"
                return await self._fallback(episode, record.token, reason, why)
            if to.reason == "stale":  # Redis holds another claim: this record is stale
                self.table.release(episode, "lost", record.token)
            return "kept"
        body = encode_install(
            Install(episode, to.device, to.token, to.claim, self.node_id, record), self.clock()
        )
        size = record_bytes(record)
        if not await self._send(to, body, episode):
            await self._abort(episode, record.token, record.claim, instance, to)
            return await self._fallback(episode, record.token, reason, f"{to.node} did not take it")
        try:
            refused = await self.transfers.commit(
                episode, record.token, record.claim, instance, to, size=size, reason=reason
            )
        except AffinityError as exc:  # unknown: Redis may have moved it; find out
            log.warning("moving %s: the commit's answer was lost (%s)", episode, exc)
            refused = await self._committed_after_all(episode, record, to)
        if refused is not None and refused.reason == "unknown":
            # Redis could not be asked while this node's lease lasted: the fence drops the
            # record here, and the new owner's copy is served only if Redis moved it there
            # (a routed step confirms it); nothing is told or undone on a guess
            return "kept"
        if refused is not None:
            await self._abort(episode, record.token, record.claim, instance, to)
            await self._tell(to, episode, "drop")
            if refused.reason in ("lease", "marked", "stale"):
                return "kept"  # fenced, released or moved meanwhile: the owner's rules apply
            return await self._fallback(episode, record.token, reason, f"commit {refused.reason}")
        self.table.moved(episode, record.token, (to.url, to.device, to.token))
        self.metrics.move_bytes.observe(size)
        task = asyncio.ensure_future(self._tell(to, episode, "confirm", to.claim))
        self._telling.add(task)  # (a routed step confirms it too, should this not arrive)
        task.add_done_callback(self._telling.discard)
        return "moved"

    async def _committed_after_all(
        self, episode: str, record: Episode, to: Placement
    ) -> NotPlaced | None:
        """The commit's answer was lost (a timeout, a dropped connection). Ask Redis which
        claim holds ``episode`` now. Ask again every :data:`RETRY_S` while this node's lease
        is valid; the episode's steps wait meanwhile. None: it moved. ``failed``: the old
        claim still holds it (the commit never ran). ``marked``: an operator released it.
        ``stale``: another claim holds it, or none. ``unknown``: the lease ran out first.
        Never a guess: telling the new owner to drop a record Redis gave it would leave the
        episode with an owner that refuses it."""
        while self.lease.valid():
            try:
                info = await self.lease_claims.lookup(episode)
            except AffinityError as exc:
                log.warning("moving %s: cannot tell whether it moved yet (%s)", episode, exc)
                await asyncio.sleep(RETRY_S)
                continue
            if info is None:
                return NotPlaced("stale")
            held = (info.device, info.token, info.claim)
            if held == (to.device, to.token, to.claim):
                return None
            if held == (record.device, record.token, record.claim):
                return NotPlaced("marked" if info.revoked or info.moved else "failed")
            return NotPlaced("stale")
        return NotPlaced("unknown")

    async def _send(self, to: Placement, body: bytes, episode: str) -> bool:
        try:
            async with asyncio.timeout(MOVE_S):
                resp = await self.pool.post(to.url, body, MOVE_PATH)
        except (TimeoutError, ForwardError) as exc:
            log.warning("could not send %s's record to %s: %s", episode, to.node, exc)
            return False
        if resp.status != 204:
            text = resp.body[:200].decode("utf-8", "replace")
            log.warning("%s refused %s's record (%s): %s", to.node, episode, resp.status, text)
            return False
        return True

    async def _abort(
        self, episode: str, token: int, claim: str, instance: str, to: Placement
    ) -> None:
        with contextlib.suppress(AffinityError):
            await self.transfers.abort(episode, token, claim, instance, to)

    async def _tell(self, to: Placement, episode: str, op: str, claim: str = "") -> None:
        body = wire.encode({"op": op, "episode_id": episode, "claim": claim or to.claim})
        with contextlib.suppress(TimeoutError, ForwardError):
            async with asyncio.timeout(MOVE_S):
                await self.pool.post(to.url, body, MOVE_PATH)

    async def _fallback(self, episode: str, token: int, reason: Reason, why: str) -> MoveOutcome:
        """A move that could not be made. A graceful stop hands the episode over without
        its state; its next step says ``state_reset``. A drain's or an operator's move
        leaves it here, with its state; a drain never resets anything."""
        if reason != "stop":
            log.warning("could not move %s (%s): %s; it stays here with its state", episode,
                        reason, why)  # fmt: skip
            return "kept"
        log.info("could not move %s (stop): %s; handed over without its state", episode, why)
        return await self._without_state(episode, token)

    async def _without_state(self, episode: str, token: int) -> MoveOutcome:
        """The fallback: hand ``episode`` over without its state (``state_reset``)."""
        if self.table.release(episode, "handed", token) is None:
            return "kept"
        try:
            await self.lease_claims.handoff(episode, token)
        except AffinityError as exc:  # deregistration covers it
            log.warning("could not hand %s over: %s", episode, exc)
        return "reset"

    async def undo_moved(self, episode: str, seq: int | None, origin: str | None) -> None:
        """An undo for an episode whose record moved on: it follows the record, where it
        leaves the episode in doubt (the record before the step did not move)."""
        to = self.table.moved_to(episode)
        if to is None:
            return
        url, device, token = to
        undo = Forward.about(
            episode, token, device, MOVE_S, origin=origin or "", seq=seq, undo=True
        )
        await send_undo(self.pool, url, undo)

    # ---- the new owner ---------------------------------------------------------------

    def receive(self, body: bytes, secret: str | None, local_devices: frozenset[str]) -> None:
        """Install (or confirm, or drop) a record another node hands over. Raises
        :class:`Refused` (403 bad secret, 400/422 a record that does not fit, 421 a device
        not here) and ``Unavailable`` (this node's lease is not current)."""
        if self.secret and not hmac.compare_digest((secret or "").encode(), self.secret.encode()):
            raise Refused(403, "bad_secret", "missing or wrong cluster secret")
        self.lease.require()
        try:
            doc = wire.decode(body)
        except wire.WireError as exc:
            raise Refused(400, "bad_forward", str(exc)) from None
        op = doc.get("op", "install") if isinstance(doc, dict) else None
        if op in ("confirm", "drop"):
            episode, claim = str(doc.get("episode_id", "")), str(doc.get("claim", ""))
            if op == "confirm":
                self.table.confirm(episode, claim)
            else:
                record = self.table.get(episode)
                if record is not None and record.claim == claim and not record.confirmed:
                    self.table.release(episode, "end", record.token)
            return
        name = str(doc.get("model", "")).partition("@")[0] if isinstance(doc, dict) else ""
        contract = self.contracts.get(name) or (
            next(iter(self.contracts.values())) if not name else None
        )
        if contract is None:
            raise Refused(421, "not_owner", f"node {self.node_id} does not serve model {name!r}")
        try:
            install = decode_install(body, contract, self.clock())
        except TransferError as exc:
            raise Refused(422, "bad_record", str(exc)) from None
        if install.device not in local_devices:
            raise Refused(421, "not_owner", f"device {install.device!r} is not on {self.node_id}")
        self.table.install(install.episode, install.record)
        log.debug("installed %s's record from %s", install.episode, install.origin_node)


class HandOvers:
    """When the owner's episodes are handed over. One hand-over at a time per episode.
    :data:`MOVES_AT_ONCE` in all: a drain's, a graceful stop's and an operator's together.
    Operators' moves run in the background. Also the graceful stop."""

    def __init__(
        self,
        node_id: str,
        table: EpisodeTable,
        lease: Lease,
        mover: Mover,
        drain_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.table = table
        self.lease = lease
        self.mover = mover
        self.drain_timeout_s = drain_timeout_s
        self.clock = clock
        self._handing: dict[str, asyncio.Task[MoveOutcome]] = {}
        self._moving: set[asyncio.Task[MoveOutcome]] = set()  # operators' moves under way
        self._gate = asyncio.Semaphore(MOVES_AT_ONCE)  # hand-overs under way, at most

    async def hand_over(
        self, episode: str, reason: Reason = "stop", target: str = ""
    ) -> MoveOutcome:
        """Hand ``episode`` over once its in-flight step (if any) finished. It goes with its
        state to a device that serves its model and has room (:class:`Mover`). Else it goes
        without it; its next step is ``reassigned``, ``state_reset``. Idempotent; concurrent
        callers share one hand-over. An episode waiting its turn goes on stepping here."""
        task = self._handing.get(episode)
        if task is None:
            task = asyncio.ensure_future(self._gated(episode, reason, target))
            self._handing[episode] = task
            task.add_done_callback(lambda _: self._handing.pop(episode, None))
        return await asyncio.shield(task)

    async def _gated(self, episode: str, reason: Reason, target: str) -> MoveOutcome:
        async with self._gate:
            return await self.mover.hand_over(episode, reason, target)

    def move_requested(self, moves: Sequence[MoveRequest]) -> None:
        """Carry out the moves an operator asked (read at the renewal): every episode of a
        drained device, or one episode to a target; in the background."""
        for move in moves:
            if move.device:
                episodes = [ep for ep, r in self.table.records() if r.device == move.device]
                targets = [(ep, "drain", "") for ep in episodes]
            else:
                targets = [(move.episode, "move", move.target)]
            for ep, reason, target in targets:
                task = asyncio.ensure_future(self.hand_over(ep, reason, target))  # type: ignore[arg-type]
                self._moving.add(task)
                task.add_done_callback(self._moving.discard)

    async def leave(self) -> None:
        """The graceful stop: no new episodes here. Every episode is handed over within
        ``--drain-timeout``. It goes with its state, after its in-flight step,
        :data:`MOVES_AT_ONCE` at a time; or without it when nothing can take it. What is left
        then is handed over by the deregistration, without its state. Then the node
        deregisters, while it still listens (forwards get answers, not connection errors)."""
        if self.lease.leaving:
            return
        started = self.clock()
        registered = self.lease.registered
        await self.lease.begin_leave()
        held = [episode for episode, _ in self.table.records()]
        outcomes: list[MoveOutcome | BaseException] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.drain_timeout_s):
                outcomes = await asyncio.gather(
                    *(self.hand_over(ep, "stop") for ep in held), return_exceptions=True
                )
        self.table.drop_all("handed")
        released = await self.lease.end()
        if registered:
            log.info(
                "node %s left: moved %d episode(s) with their state, handed over %d without, "
                "deregistered %d more in %.2fs",
                self.node_id,
                sum(o == "moved" for o in outcomes),
                sum(o == "reset" for o in outcomes),
                max(released, 0),
                self.clock() - started,
            )
