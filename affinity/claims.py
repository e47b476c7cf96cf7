"""Episode claims: resolve (hit / claim / reassign), lookup, release, handoff.

Argument building and reply parsing are plain functions; :class:`Claims` is the thin
async shell the node and the CLI share.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from redis.exceptions import RedisError

from affinity.errors import (
    AffinityError,
    BackendUnavailable,
    InvalidArgument,
    ModelConflict,
    NoCapacity,
    NotReplicated,
    Recovering,
    StaleToken,
    UnknownEpisode,
    UnknownModel,
)
from affinity.keys import MAX_EPISODE_BYTES, check_episode, check_token
from affinity.models import check_model_part
from affinity.scripts import (
    EpisodeScriptCaller,
    bounded,
    evalsha_many,
    failure,
    replicated,
    replicated_many,
)

__all__ = [
    "MAX_EPISODE_BYTES",
    "PLACEMENTS",
    "Assignment",
    "Claims",
    "EpisodeInfo",
    "Released",
    "ResolveRequest",
    "check_episode",
    "check_token",
]

PLACEMENTS = ("round-robin", "scored")

Status = Literal["hit", "claimed", "reassigned"]


class Assignment(NamedTuple):
    """Where an episode lives now, as decided by one ``resolve`` (a named tuple: made on
    every request, it is the cheapest immutable record)."""

    episode: str
    status: Status
    device: str
    token: int
    node: str
    url: str
    previous: str | None  # the device it was taken from ("reassigned" only)
    claim: str = ""  # the claim id issued with the token: unique even if a token number is not
    instance: str = ""  # the process holding the owner's registration ("" when unknown)
    model: str = ""  # "name@version" the episode is served with ("": a fleet without models)


class ResolveRequest(NamedTuple):
    """One episode's question to :meth:`Claims.resolve_many`: :meth:`Claims.resolve`'s
    arguments."""

    episode: str
    restart: bool = False
    claim: bool = True
    model: str = ""
    version: str = ""
    placement: str = "round-robin"
    limit_ms: float | None = None


class Released(NamedTuple):
    """What a release did: the device the episode was on, and how it went.

    Either its owner still lets go of it (``revoked``: at its next renewal), or it is gone
    already."""

    device: str
    revoked: bool = False


@dataclass(frozen=True)
class EpisodeInfo:
    """A read-only view of an assignment (``lookup``)."""

    episode: str
    device: str
    token: int
    ttl_ms: int
    node: str
    url: str
    state: str  # the device's state, or "removed" when its hash is gone
    alive: bool  # the device is listed by its node and that node's lease is current
    moved: bool = False  # its owner let it go (handed over): the next resolve is "reassigned"
    claim: str = ""  # the claim id issued with the token
    model: str = ""  # "name@version" it was claimed with ("": its node registered none)
    revoked: bool = False  # an operator released it; its owner lets go at its next renewal

    def to_json(self) -> dict[str, Any]:
        return {
            "episode": self.episode,
            "device": self.device,
            "token": self.token,
            "ttl_ms": self.ttl_ms,
            "node": self.node,
            "url": self.url,
            "state": self.state,
            "alive": self.alive,
            "moved": self.moved,
            "revoked": self.revoked,
            "model": self.model,
        }


def parse_resolution(episode: str, reply: str, asked: str = "") -> Assignment:
    """``"<status> <device> <token> <node> <url> <previous> <claim> <instance> <model>"``,
    or ``"full <reason>"``, ``"recovering <ms>"``, ``"missing"``, ``"conflict <model>"``,
    ``"unknown"`` (``asked``: the model the step named, for the errors)."""
    fields = reply.split(" ")
    if fields[0] == "full":
        raise NoCapacity(episode, fields[1])
    if fields[0] == "missing":
        raise UnknownEpisode(episode)
    if fields[0] == "conflict":
        raise ModelConflict(episode, fields[1], asked)
    if fields[0] == "unknown":
        raise UnknownModel(asked)
    if fields[0] == "recovering":
        raise Recovering(episode, int(fields[1]) / 1000)
    status, device, token, node, url, previous, claim, instance, model = fields
    if status not in ("hit", "claimed", "reassigned"):
        raise ValueError(f"unexpected resolve reply {reply!r}")
    checked: Status = status  # type: ignore[assignment]
    return Assignment(episode, checked, device, int(token), node, url, previous or None,
                      claim, instance, model)  # fmt: skip


def parse_lookup(episode: str, reply: Sequence[Any]) -> EpisodeInfo | None:
    if not reply:
        return None
    device, token, ttl, node, url, state, alive, mark, claim, model = reply
    return EpisodeInfo(
        episode=episode,
        device=str(device),
        token=int(token),
        ttl_ms=int(ttl),
        node=str(node),
        url=str(url),
        state=str(state),
        alive=str(alive) == "1",
        moved=str(mark) == "moved",
        claim=str(claim),
        model=str(model),
        revoked=str(mark) == "revoked",
    )


class Claims(EpisodeScriptCaller):
    """Async claim API over one Redis client. Safe to share between tasks.

    Every call is one ``EVALSHA`` bounded by ``settings.redis_deadline_s``; it raises
    :class:`BackendUnavailable` when Redis cannot decide in time. ``known_lease_ms``
    answers the longest lease TTL of the fleet its caller heard of (a node's lease: see
    :meth:`Registry.renewal`). A grace period a resolve starts lasts at least that long.
    """

    async def resolve(
        self,
        episode: str,
        *,
        restart: bool = False,
        claim: bool = True,
        model: str = "",
        version: str = "",
        placement: str = "round-robin",
        limit_ms: float | None = None,
    ) -> Assignment:
        """Find or make the episode's assignment in one atomic round trip.

        ``placement``: ``"scored"`` takes the device with the lowest published step time
        (``limit_ms``: the most it may predict, the episode's control period x the
        headroom; None: no gate), ``"round-robin"`` the ring's stride (docs/policies.md).
        Every device over ``limit_ms`` raises :class:`NoCapacity` ``"slo"``.

        ``hit`` slides the idle deadline; ``claimed``/``reassigned`` write a new assignment
        with a new fencing token. ``restart=True`` (a new sequence under the same id)
        always writes a fresh assignment (``claimed``) and frees the old slot.
        ``claim=False`` never writes a new episode: one without an assignment raises
        :class:`UnknownEpisode` in the same atomic step (a hit or a reassign happen as
        usual).

        ``model`` names the model's name (``""``: a fleet whose nodes register none, or
        an episode that keeps its own). A new episode takes a device whose node serves it.
        It takes ``version`` when given, else the version the operator's weights choose
        (else the newest registered). An episode keeps its (name, version): a reassignment
        stays on it.

        Raises :class:`ModelConflict` when the episode is served with another name or
        version than named (nothing written). Raises :class:`UnknownModel` when no node
        ever registered the name or version. Raises :class:`NoCapacity` (nothing written
        for the episode; ``reason`` says why). Raises :class:`Recovering` on a claim, of
        any model, during the grace period after Redis lost its data. Also raises
        :class:`InvalidArgument` and :class:`BackendUnavailable`.

        With ``settings.redis_replicas`` (N > 0) the script is followed by ``WAIT`` on its
        connection (one round trip). An assignment fewer than N replicas acknowledged
        raises :class:`NotReplicated` (a subclass of :class:`BackendUnavailable`). A claim
        or reassign this call made is released again first, token-checked, best effort;
        a hit, someone else's claim, stays. The hit writes too (its deadline), so its
        ``WAIT`` covers the claim it names, whichever connection wrote that.
        """
        ask = ResolveRequest(episode, restart, claim, model, version, placement, limit_ms)
        episode, args, asked = self._resolve_args(ask)
        if self.settings.redis_replicas:
            reply, short = await replicated(
                self.settings, self.redis, self.scripts.resolve, self._episode_key + episode, args
            )
        else:
            reply, short = await self._call(self.scripts.resolve, episode, args), None
        a = parse_resolution(episode, reply, asked)
        if short is not None:
            raise await self._not_replicated(a, short)
        return a

    async def resolve_many(
        self, asks: Sequence[ResolveRequest]
    ) -> list[Assignment | AffinityError]:
        """:meth:`resolve` for several episodes in one round trip to Redis: one ``EVALSHA``
        of the same script per episode, pipelined (``affinity/scripts.py``
        :func:`evalsha_many`; with ``settings.redis_replicas``, one ``WAIT`` after them all).
        Each claim is atomic by itself and means exactly what :meth:`resolve` would: none
        waits for, fails or undoes another. (Every key shares the namespace's hash tag, so
        under Redis Cluster the pipeline goes to one node too.)

        Returns, in order, each episode's :class:`Assignment` or the error
        :meth:`resolve` would raise for it (a bad argument's :class:`InvalidArgument` is
        that episode's alone, and it is not sent). Raises :class:`BackendUnavailable` when
        Redis cannot answer the round trip in time: no answer is known for any of them."""
        checked: list[tuple[str, tuple[Any, ...], str] | InvalidArgument] = []
        for ask in asks:
            try:
                checked.append(self._resolve_args(ask))
            except InvalidArgument as exc:
                checked.append(exc)
        calls = [(self._episode_key + c[0], c[1]) for c in checked if isinstance(c, tuple)]
        replies, short = (
            await replicated_many(self.settings, self.redis, self.scripts.resolve, calls)
            if calls
            else ([], None)
        )
        answers = iter(replies)
        results: list[Assignment | AffinityError] = []
        for c in checked:
            if isinstance(c, InvalidArgument):
                results.append(c)
                continue
            episode, _, asked = c
            reply = next(answers)
            try:
                if isinstance(reply, RedisError):  # BUSY, OOM...: this call's answer alone
                    raise BackendUnavailable(failure(reply))
                a = parse_resolution(episode, reply, asked)
                if short is not None:
                    raise await self._not_replicated(a, short)
                results.append(a)
            except AffinityError as exc:
                results.append(exc)
        return results

    def _resolve_args(self, ask: ResolveRequest) -> tuple[str, tuple[Any, ...], str]:
        """The checked episode id, the resolve script's ``ARGV`` and the model asked (for
        the errors) of ``ask``; raises :class:`InvalidArgument`."""
        episode = check_episode(ask.episode)
        model, version = ask.model, ask.version
        if model:
            check_model_part("name", model)
        if version:
            if not model:
                raise InvalidArgument("model version", version, "needs a model name")
            check_model_part("version", version)
        if ask.placement not in PLACEMENTS:
            raise InvalidArgument("placement", ask.placement, f"must be one of {PLACEMENTS}")
        gate = ""
        limit_ms = ask.limit_ms
        if limit_ms is not None:
            if isinstance(limit_ms, bool) or not limit_ms > 0 or limit_ms == float("inf"):
                raise InvalidArgument("step time limit (ms)", limit_ms, "must be > 0")
            gate = f"{limit_ms:.3f}"
        flag = "1" if ask.restart else "" if ask.claim else "2"
        args = (flag, os.urandom(8).hex(), model, version, self.known_lease_ms(), ask.placement,
                gate)  # fmt: skip
        return episode, args, f"{model}@{version}" if version else model

    async def _not_replicated(self, a: Assignment, short: int) -> NotReplicated:
        """The error of a resolve whose write fewer replicas than wanted acknowledged
        (``short`` of them). A claim or reassign is released first, token-checked, best
        effort: nobody may serve it (else its backstop ends it; a retry finds it a hit,
        WAITed again); a hit, someone else's claim, stays."""
        if a.status != "hit":
            with contextlib.suppress(AffinityError):  # (served nowhere: no owner to wait for)
                await self.release(a.episode, a.token, reason="not_replicated", owner=True)
        return NotReplicated(
            "claim", short, self.settings.redis_replicas, self.settings.redis_wait_s,
            f"episode {a.episode!r}",
        )  # fmt: skip

    async def lookup(self, episode: str) -> EpisodeInfo | None:
        """The episode's assignment without touching it, or ``None``."""
        episode = check_episode(episode)
        return parse_lookup(episode, await self._call(self.scripts.lookup, episode))

    async def lookup_many(self, episodes: Sequence[str]) -> list[EpisodeInfo | None]:
        """:meth:`lookup` of each of ``episodes`` in one round trip to Redis (one ``EVALSHA``
        each, pipelined: :func:`affinity.scripts.evalsha_many`), in order. Raises
        :class:`InvalidArgument` for a bad id before anything is sent, and
        :class:`BackendUnavailable` when Redis cannot answer them all in time or answers one
        with an error (nothing is changed by a lookup: the caller asks again)."""
        checked = [check_episode(e) for e in episodes]
        if not checked:
            return []
        calls = [(self._episode_key + e, ()) for e in checked]
        replies, _ = await bounded(
            self.settings, evalsha_many(self.redis, self.scripts.lookup, calls)
        )
        found: list[EpisodeInfo | None] = []
        for episode, reply in zip(checked, replies, strict=True):
            if isinstance(reply, RedisError):
                raise BackendUnavailable(failure(reply))
            found.append(parse_lookup(episode, reply))
        return found

    async def release(
        self, episode: str, token: int, reason: str = "end", *, owner: bool = False
    ) -> Released:
        """End the assignment if ``token`` still holds it.

        ``owner``: the caller is the episode's owner and dropped its record; the assignment
        is deleted. Anyone else's release of an episode whose owner holds a live lease is
        a revocation. The owner lets go at its next renewal (:meth:`Registry.renewal`).
        Then the episode's next step is reassigned with ``state_reset``. Until then its
        steps still reach the owner, so no second owner can start meanwhile.

        Idempotent per token. Raises :class:`StaleToken` (nothing changed) when another
        token holds the episode, :class:`UnknownEpisode` when nothing does.
        """
        episode = check_episode(episode)
        check_token(token)
        args = (str(token), reason, "owner" if owner else "")
        reply = await self._call(self.scripts.release, episode, args)
        if reply[0] == "missing":
            raise UnknownEpisode(episode)
        if reply[0] == "stale":
            raise StaleToken(episode, token, int(reply[2]), str(reply[1]))
        return Released(str(reply[1]), str(reply[0]) == "revoked")

    async def handoff(self, episode: str, token: int) -> bool:
        """Hand the episode over (graceful stop): its next :meth:`resolve` says
        ``reassigned`` with ``previous`` = its device, even though nothing failed, and its
        load slot is free now. ``False`` (nothing written) when ``token`` no longer holds
        the episode or it was handed over already."""
        episode = check_episode(episode)
        check_token(token)
        return int(await self._call(self.scripts.handoff, episode, (str(token),))) == 1
