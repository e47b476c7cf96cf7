"""How an episode moves to another node with its state: the live hand-over, the third door.

The old owner stops serving the episode; its new steps wait, bounded by their deadlines.
It waits for the step in flight. It asks Redis for a device that serves the episode's model
and has room; a slot is reserved there, a token issued and the reservation written
(``affinity/transfers.py``). It sends the record to that device's node. The new owner
installs it as an unconfirmed *copy*, then marks the reservation ``installed`` in Redis,
and only then answers 204. Then the old owner commits in Redis, only while its own claim
still holds the episode, its lease is live, the new node is alive and not leaving, and the
reservation is marked installed. Then it drops its record and tells the new owner, which
confirms its copy. Any failure leaves exactly one owner. Before the commit the old owner
keeps the episode. When nothing can take it, a drain or a move keeps it (a ``move-kept``
event says so) and a graceful stop hands it over without its state (``state_reset``).

The protocol, and why (issue 41): a copy is not an owner until the commit is known.

- *The copy's life.* Installed unconfirmed and held apart from the records
  (``EpisodeTable.copy_of``): never served from memory, never slid in a flush, never
  re-asserted at a registration, never handed on, never ended by idleness; a move between
  two devices of one node keeps the live record beside it until the commit, and a copy
  from another node is refused beside a live record (409: it never replaces one).
  It becomes the record of the claim in exactly three ways, each a proof that Redis moved
  the claim: the old owner's ``confirm`` (it saw the commit), a routed step that carries
  the new claim (Redis gave it to the router), or the new owner's own *settle* answering
  ``committed``. It is dropped in one way only: *settle* answering ``dropped``, which
  deletes the reservation in the same script, so the commit can never happen afterwards.
  The old owner's ``drop`` and a copy unconfirmed for :data:`SETTLE_S` both settle;
  so does a graceful stop of the new owner. Dropping a copy remembers nothing as ended:
  its claim was never one here. So a slow old owner whose commit lands late finds either a
  copy waiting for it (and the copy is confirmed) or no mark (and the commit is refused):
  never a claim in Redis that its node refuses.
- *Nothing changes the record between read and commit unseen.* An undo that reaches the
  old owner before it sends the commit is applied to the record there and spoils the
  move: the copy is settled away and the move starts again with the record as it is now
  (:data:`MOVE_TRIES` times at most). An undo that arrives once the commit is on its way
  waits for the move, then follows the record: applied here if it stayed, sent to the new
  owner if it moved (where an undo of the copy's last step, whose previous record did not
  move, leaves it in doubt: its next step says ``state_reset``). An end waits likewise and
  follows the record.
- *Redis loses its data mid-move.* The reservation is lost with it, so the commit is
  refused (``missing``/``copy``) and the old owner keeps and re-asserts its record; the
  new owner never re-asserts the copy, and its settle drops it. Restored from a snapshot
  taken before a completed move, Redis names the old claim again: the old owner, which
  ended it, hands that claim over in Redis at once when it refuses a step of it
  (:meth:`node.owner.Owner.let_go`), so its next step is ``reassigned`` with
  ``state_reset`` (said, never stuck); the new owner drops its record at its next flush.
- *A leaving new owner* refuses installs (503), and the commit refuses a leaving target.

A paused old owner's commit is refused once its lease lapsed. A step that waited behind
the move asks Redis again and reaches the new owner.

:class:`HandOvers` decides when: an operator's move or drain, a graceful stop, at most
:data:`MOVES_AT_ONCE` at a time, one per episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Literal, Protocol

from affinity import AffinityError, Claims
from affinity.registry import MoveRequest
from affinity.transfers import NotPlaced, Placement, Transfers
from node.contract import PolicyContract
from node.episodes import Episode, EpisodeTable
from node.errors import ForwardError, Refused, Unavailable
from node.forward import MOVE_PATH, Forward, Poster, send_undo
from node.lease import Lease
from node.metrics import Metrics
from node.record import is_hosted
from node.transfer import (
    GhostCarry,
    Install,
    Settle,
    encode_install,
    encode_settle,
    hosted,
    record_bytes,
)

__all__ = [
    "HOLD_MS",
    "MOVES_AT_ONCE",
    "MOVE_S",
    "SETTLE_S",
    "Ghosts",
    "HandOvers",
    "MoveOutcome",
    "Mover",
    "Reason",
]

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
SETTLE_S = MOVE_S
"""How long a copy stays unconfirmed before its new owner asks Redis whether it was
committed (and drops it if not); well past a commit's round trip, within the reservation's
:data:`HOLD_MS`."""
MOVE_TRIES = 3
"""How many times a move starts again because an undo changed the record on its way."""


class Ghosts(Protocol):
    """The ghost episodes of a node (``node/shadow.py``'s ``ShadowRunner``), as a move
    asks them: what it carries of an episode's ghost, what a move away frees, what an
    install adopts, and the candidates whose carried ghosts an install can read."""

    @property
    def contracts(self) -> Mapping[str, PolicyContract]:
        """``"name@version"`` -> contract of each candidate run here."""
        ...

    async def carry(self, episode: str, record: Episode) -> GhostCarry | None: ...

    def free(self, episode: str) -> None: ...

    def adopt(self, install: Install) -> None: ...


class Mover:
    """Both sides of a live hand-over for one node (see the module doc). ``ghosts``: the
    node's ghost episodes, which move with their live ones (None: no shadows here)."""

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
        clock: Callable[[], float] = time.monotonic,
        ghosts: Ghosts | None = None,
    ) -> None:
        self.node_id = node_id
        self.table = table
        self.lease = lease
        self.transfers = transfers
        self.lease_claims = lease_claims
        self.pool = pool
        self.metrics = metrics
        self.contracts = contracts  # "name@version" -> contract, of the models served here
        self.ghosts = ghosts
        self.clock = clock
        self._telling: set[asyncio.Task[None]] = set()
        self._committing: set[str] = set()  # moves whose commit is on its way
        self._spoiled: set[str] = set()  # moves whose record an undo changed on its way

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
            self._committing.discard(episode)
            self._spoiled.discard(episode)
            self.table.end_move(episode)  # the steps (and undos, ends) that waited go on
            self.metrics.moves.labels(reason, outcome).inc()
            if outcome == "moved":
                self.metrics.move_seconds.observe(time.perf_counter() - started)
        return outcome

    async def _move(self, episode: str, reason: Reason, target: str) -> MoveOutcome:
        token = 0
        for _ in range(MOVE_TRIES):
            self._spoiled.discard(episode)
            record = self.table.get(episode)
            if record is None or not record.confirmed:
                return "kept"
            token = record.token
            outcome = await self._try(episode, record, reason, target)
            if outcome is not None:
                return outcome
        return await self._fallback(episode, token, reason, "refused", "its record kept changing")

    async def _try(
        self, episode: str, record: Episode, reason: Reason, target: str
    ) -> MoveOutcome | None:
        """One attempt; None: an undo changed the record on its way (start again)."""
        instance = self.lease.instance
        try:  # a state held on a device (or by its worker process) is read back first
            record = await _hosted(record)
        except Exception as exc:  # its worker process died: the state went with it
            why = f"its state could not be read back: {type(exc).__name__}: {exc}"
            return await self._fallback(episode, record.token, reason, "refused", why)
        try:
            to = await self.transfers.place(
                episode, record.token, record.claim, instance, target=target, hold_ms=HOLD_MS
            )
        except AffinityError as exc:
            return await self._fallback(episode, record.token, reason, "redis", str(exc))
        if isinstance(to, NotPlaced):
            if to.reason == "none":
                why = "no device of a live node serving its model has room"
                return await self._fallback(episode, record.token, reason, "none", why)
            if to.reason == "stale":  # Redis holds another claim: this record is stale
                self.table.release(episode, "lost", record.token)
            return "kept"  # (missing: Redis lost it; the registration re-asserts it)
        ghost = None if self.ghosts is None else await self.ghosts.carry(episode, record)
        if ghost is not None:
            try:
                ghost = replace(ghost, record=await _hosted(ghost.record))
            except Exception:  # not read back: the ghost restarts at the new owner
                ghost = None
        body = encode_install(
            Install(episode, to.device, to.token, to.claim, self.node_id, record, ghost),
            self.clock(),
        )
        size = record_bytes(record)
        if not await self._send(to, body, episode):
            await self._abort(episode, record.token, record.claim, instance, to)
            why = f"{to.node} did not take it"
            return await self._fallback(episode, record.token, reason, "unreachable", why)
        if episode in self._spoiled:  # an undo changed the record here: send it again
            await self._abort(episode, record.token, record.claim, instance, to)
            await self._tell(to, episode, "drop")
            return None
        self._committing.add(episode)  # from now on an undo waits for the outcome
        try:
            refused = await self.transfers.commit(
                episode, record.token, record.claim, instance, to, size=size, reason=reason
            )
        except AffinityError as exc:  # unknown: Redis may have moved it; find out
            log.warning("moving %s: the commit's answer was lost (%s)", episode, exc)
            refused = await self._committed_after_all(episode, record, to)
        if refused is not None and refused.reason == "unknown":
            # Redis could not be asked while this node's lease lasted: the fence drops the
            # record here; the new owner's settle finds out whether Redis moved it there
            return "kept"
        if refused is not None:
            await self._abort(episode, record.token, record.claim, instance, to)
            await self._tell(to, episode, "drop")
            if refused.reason in ("lease", "marked", "stale", "missing"):
                return "kept"  # fenced, released, moved or lost meanwhile: the owner's rules
            why = f"commit {refused.reason}"
            return await self._fallback(episode, record.token, reason, "refused", why)
        self.table.moved(episode, record.token, (to.url, to.device, to.token))
        if self.ghosts is not None:  # its ghost went with it (or restarts there)
            self.ghosts.free(episode)
        self.metrics.move_bytes.observe(size)
        task = asyncio.ensure_future(self._tell(to, episode, "confirm", to.claim))
        self._telling.add(task)  # (a routed step, or its settle, confirms it too)
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

    async def _tell(
        self, to: Placement, episode: str, op: Literal["confirm", "drop"], claim: str = ""
    ) -> None:
        body = encode_settle(Settle(op, episode, claim or to.claim))
        with contextlib.suppress(TimeoutError, ForwardError):
            async with asyncio.timeout(MOVE_S):
                await self.pool.post(to.url, body, MOVE_PATH)

    async def _fallback(
        self, episode: str, token: int, reason: Reason, code: str, why: str
    ) -> MoveOutcome:
        """A move that could not be made (``code``: none, unreachable, refused, redis). A
        graceful stop hands the episode over without its state; its next step says
        ``state_reset``. A drain's or an operator's move leaves it here, with its state (a
        drain never resets anything), said in the log and in a ``move-kept`` event."""
        if reason != "stop":
            log.warning("could not move %s (%s): %s; it stays here with its state", episode,
                        reason, why)  # fmt: skip
            try:
                await self.transfers.kept(episode, reason, code)
            except AffinityError as exc:
                log.warning("could not write the move-kept event of %s: %s", episode, exc)
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

    async def end_moved(self, episode: str) -> bool:
        """An end for an episode whose record moved on: it follows the record (the new
        owner ends it, token-checked). True when the new owner took it."""
        to = self.table.moved_to(episode)
        if to is None:
            return False
        url, device, token = to
        end = Forward.about(episode, token, device, MOVE_S, release=True)
        return not await send_undo(self.pool, url, end)

    async def undo_during_move(
        self, episode: str, seq: int | None, origin: str | None, doubt: bool = False
    ) -> None:
        """An undo that reached this node while ``episode`` is being moved. Before the
        commit is sent, it is applied here and spoils the move (which sends the record
        again). Once the commit is on its way it waits for the move (in a task of its own:
        a router that stops waiting does not cancel it), then follows the record."""
        if episode not in self._committing:
            if self.table.undo(episode, seq, origin, doubt):
                self._spoiled.add(episode)
            return
        task = asyncio.ensure_future(self._undo_after_move(episode, seq, origin, doubt))
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)
        await asyncio.shield(task)

    async def _undo_after_move(
        self, episode: str, seq: int | None, origin: str | None, doubt: bool
    ) -> None:
        await self.table.wait_moved(episode)
        if self.table.undo(episode, seq, origin, doubt) or self.table.get(episode) is not None:
            return
        await self.undo_moved(episode, seq, origin)

    # ---- the new owner ---------------------------------------------------------------

    async def receive(self, message: Install | Settle, local_devices: frozenset[str]) -> None:
        """Install a record another node hands over, or confirm or drop the copy of one
        (``message``: decoded by the door, ``node/protocols/internal.py``). Raises
        :class:`Refused` (421 a device not here, 409 a live record held here or a
        reservation that is gone) and ``Unavailable`` (this node's lease is not current, it
        is leaving, Redis cannot be asked)."""
        self.lease.require()
        if isinstance(message, Settle):
            episode, claim = message.episode, message.claim
            if message.op == "confirm":
                self.table.confirm(episode, claim)
                return
            copy = self.table.copy_of(episode)
            if copy is not None and copy.claim == claim:
                await self._settle(episode, copy)  # dropped only if never committed
            return
        if self.lease.leaving:
            raise Unavailable("leaving", f"node {self.node_id} is shutting down", 1.0)
        install = message
        if install.device not in local_devices:
            raise Refused(421, "not_owner", f"device {install.device!r} is not on {self.node_id}")
        await self._install(install)
        if install.ghost is not None and self.ghosts is not None:
            self.ghosts.adopt(install)  # a ghost never answers: held beside the copy at once
        log.debug("installed %s's record from %s", install.episode, install.origin_node)

    async def _install(self, install: Install) -> None:
        """The copy, unconfirmed, then its mark in Redis (the commit needs it). A copy
        whose mark cannot be written, or that this node would hold while leaving, is
        dropped (settled) before it is answered."""
        episode, claim = install.episode, install.claim
        beside = install.origin_node == self.node_id  # between two devices of this node
        if not self.table.install(episode, install.record, beside=beside):
            raise Refused(409, "held", f"node {self.node_id} serves a live record of {episode!r}")
        try:
            marked = await self.transfers.installed(episode, install.device, install.token, claim)
        except AffinityError as exc:  # (its commit needs an answer the sender never gets)
            self.table.drop_copy(episode, claim)
            raise Unavailable("redis", f"could not mark the copy of {episode!r}: {exc}") from None
        if not marked:
            self.table.drop_copy(episode, claim)
            raise Refused(409, "stale_token", f"the move of {episode!r} is no longer reserved")
        if self.lease.leaving:  # SIGTERMed while it was marked: take it back
            await self._settle(episode, install.record)
            raise Unavailable("leaving", f"node {self.node_id} is shutting down", 1.0)

    async def settle(self, older_than: float = SETTLE_S) -> None:
        """Ask Redis about every copy unconfirmed for ``older_than`` or longer: confirm
        the ones committed here, drop the rest (their commit can never happen now)."""
        now = self.clock()
        for episode, record in self.table.copies():
            if now - record.last_used >= older_than:
                await self._settle(episode, record)

    async def _settle(self, episode: str, record: Episode) -> None:
        try:
            committed = await self.transfers.settle(
                episode, record.device, record.token, record.claim
            )
        except AffinityError as exc:  # asked again at the next settle
            log.warning("could not settle the copy of %s: %s", episode, exc)
            return
        if committed:
            if self.table.confirm(episode, record.claim):
                log.info("episode %r: its move here was committed; serving it", episode)
        elif self.table.drop_copy(episode, record.claim):
            log.info("episode %r: its move here was not committed; its copy is dropped", episode)


async def _hosted(record: Episode) -> Episode:
    """``record`` with its state on the host; read back off the event loop when it is not
    (a device's buffers, or a worker process's: ``node.transfer.hosted``)."""
    return record if is_hosted(record) else await asyncio.to_thread(hosted, record)


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
        self._closing = False  # the graceful stop's timeout fired: begin no more moves

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
            if self._closing:
                return "kept"  # the deregistration hands it over (without its state)
            return await self.mover.hand_over(episode, reason, target)

    def move_requested(self, moves: Sequence[MoveRequest]) -> None:
        """Carry out the moves an operator asked (read at the renewal): every episode of a
        drained device, or one episode to a target; in the background."""
        for move in moves:
            if move.device:
                episodes = [ep for ep, r in self.table.owned() if r.device == move.device]
                targets = [(ep, "drain", "") for ep in episodes]
            else:
                targets = [(move.episode, "move", move.target)]
            for ep, reason, target in targets:
                task = asyncio.ensure_future(self.hand_over(ep, reason, target))  # type: ignore[arg-type]
                self._moving.add(task)
                task.add_done_callback(self._moving.discard)

    async def _hand_over_all(self, deadline: float) -> list[asyncio.Task[MoveOutcome]]:
        """Hand over every episode held here, and those that come to be held while the
        first ones move, until none is left or ``deadline`` passes. An episode whose
        first step was claimed in Redis just before the node began leaving has no record
        when the stop begins (its step is on its way, or running): it is found among the
        steps in flight, and handed over, with its state, once that step finished. Without
        this second look it was dropped at the deregistration, and its next step said
        ``state_reset``. Returns the hand-overs begun (some may be under way still)."""
        handled: set[str] = set()
        tasks: list[asyncio.Task[MoveOutcome]] = []
        quiet = 0
        while True:
            new = [ep for ep, _ in self.table.owned() if ep not in handled]
            new += [ep for ep in self.table.stepping_episodes() if ep not in handled]
            new = list(dict.fromkeys(new))
            if not new:
                if quiet >= 2:  # a step between its claim and its device's queue is seen
                    return tasks
                quiet += 1
                await asyncio.sleep(0)
                continue
            quiet = 0
            handled.update(new)
            wave = [asyncio.ensure_future(self.hand_over(ep, "stop")) for ep in new]
            tasks += wave
            left = deadline - self.clock()
            if left <= 0:
                return tasks
            _, pending = await asyncio.wait(wave, timeout=left)
            if pending:
                return tasks

    async def leave(self) -> None:
        """The graceful stop: no new episodes here, and no copies (settled first: the
        committed ones are handed over too). Every episode is handed over within
        ``--drain-timeout``. It goes with its state, after its in-flight step,
        :data:`MOVES_AT_ONCE` at a time; or without it when nothing can take it. When the
        timeout fires, no more moves begin and those under way finish (each bounded).
        What is left then is handed over by the deregistration, without its state. Then
        the node deregisters, while it still listens (forwards get answers, not connection
        errors). The log line counts what each hand-over did."""
        if self.lease.leaving:
            return
        started = self.clock()
        registered = self.lease.registered
        await self.lease.begin_leave()
        await self.mover.settle(0.0)
        tasks = await self._hand_over_all(started + self.drain_timeout_s)
        late = 0
        pending = [t for t in tasks if not t.done()]
        if pending:
            self._closing = True  # those waiting their turn begin nothing
            _, left = await asyncio.wait(pending, timeout=MOVE_S + 1)
            late = len(left)
        outcomes = [
            t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None
        ]
        # what the deregistration hands over: the records still held (an episode the stop
        # looked at that had none by its turn, its first step failed, left nothing to keep)
        kept = len(self.table.owned())
        self.table.drop_all("handed")
        released = await self.lease.end()
        if registered:
            log.info(
                "node %s left: moved %d episode(s) with their state, handed over %d without, "
                "kept %d for the deregistration%s, deregistered %d more in %.2fs",
                self.node_id,
                outcomes.count("moved"),
                outcomes.count("reset"),
                kept,
                f" (--drain-timeout {self.drain_timeout_s:g}s ran out; {late} move(s) "
                "still under way)"
                if self._closing
                else "",
                max(released, 0),
                self.clock() - started,
            )
