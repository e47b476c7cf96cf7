"""Moving an episode to another device with its state: the live hand-over's Redis side.

One script (``affinity/lua/transfer.lua``) serves the calls of :class:`Transfers`.
:meth:`~Transfers.place` reserves a slot on a device that serves the model, and a token.
The owner then sends the record to that device's node, whose
:meth:`~Transfers.installed` marks the reservation: it holds the copy now.
:meth:`~Transfers.commit` moves the assignment to the new claim: the fence.
It is refused unless the owner's claim holds it unmarked, the owner's lease is live and the
reservation is marked installed. So a paused or fenced owner cannot move, nor move an
episode an operator released, nor onto a copy the new owner no longer holds.
:meth:`~Transfers.abort` takes the reservation back when the move did not happen.
:meth:`~Transfers.settle` is the new owner's: was its copy committed? If not, it never
will be (the mark is gone in the same step), and the copy may be dropped.
:meth:`~Transfers.kept` writes the ``move-kept`` event of a move that could not be made.
Argument building and reply parsing are plain functions; the class is a thin shell.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from affinity.keys import check_episode, check_token
from affinity.scripts import EpisodeScriptCaller

__all__ = ["NotPlaced", "Placement", "Transfers"]


class Placement(NamedTuple):
    """Where a moving episode goes: the device (a slot reserved there), the new claim's
    token and claim id, the device's node, its URL and the instance holding it."""

    device: str
    token: int
    claim: str
    node: str
    url: str
    instance: str


class NotPlaced(NamedTuple):
    """Why Redis would not place or commit a move.

    ``stale``: another claim holds the episode. ``missing``: none does (Redis lost it, or
    its backstop ran out). ``marked``: an operator released it, or it was handed over.
    ``lease``: the owner's lease is not live. ``none``: no device with room serves its
    model. ``target``: the chosen device's node is no longer alive, or is leaving.
    ``copy``: the new owner does not hold the copy (never installed, or dropped)."""

    reason: str


def parse_placement(reply: str, claim: str) -> Placement | NotPlaced:
    fields = reply.split(" ")
    if fields[0] == "refused":
        return NotPlaced(fields[1])
    _, device, token, node, url, instance = fields
    return Placement(device, int(token), claim, node, url, instance)


class Transfers(EpisodeScriptCaller):
    """Async transfer API over one Redis client (every call one bounded ``EVALSHA``,
    raising :class:`affinity.BackendUnavailable` when Redis cannot answer in time)."""

    async def place(
        self,
        episode: str,
        token: int,
        claim: str,
        instance: str,
        *,
        target: str = "",
        hold_ms: int = 10_000,
    ) -> Placement | NotPlaced:
        """Pick a device for ``episode`` and reserve a slot there for ``hold_ms``.

        The caller holds ``episode`` under ``token``/``claim``. The device serves its model
        and has room; ``target`` narrows it to a node or a device. The new claim's token
        and id come back. Nothing else changes."""
        episode = check_episode(episode)
        check_token(token)
        fresh = os.urandom(8).hex()
        args = ("place", str(token), claim, instance, fresh, target, str(hold_ms))
        return parse_placement(str(await self._call(self.scripts.transfer, episode, args)), fresh)

    async def commit(
        self,
        episode: str,
        token: int,
        claim: str,
        instance: str,
        to: Placement,
        *,
        size: int = 0,
        reason: str = "move",
    ) -> NotPlaced | None:
        """Move ``episode``'s assignment from the caller's claim to ``to``'s, fenced: only
        while that claim holds it unmarked and the caller's lease is live. None when it
        moved (a ``moved`` event records ``size`` bytes and ``reason``)."""
        args = (
            "commit", str(token), claim, instance, to.device, str(to.token), to.claim, str(size),
            reason,
        )  # fmt: skip
        reply = str(await self._call(self.scripts.transfer, episode, args))
        return None if reply == "moved" else NotPlaced(reply.split(" ")[1])

    async def abort(
        self, episode: str, token: int, claim: str, instance: str, to: Placement
    ) -> bool:
        """Take back the slot ``to`` reserved, unless the move was committed after all."""
        args = ("abort", str(token), claim, instance, to.device)
        return int(await self._call(self.scripts.transfer, episode, args)) == 1

    async def installed(self, episode: str, device: str, token: int, claim: str) -> bool:
        """The new owner holds the copy of ``episode`` for the claim (``device``, ``token``,
        ``claim``): mark its reservation installed, which the commit needs. False: the
        reservation is gone or names another claim (the copy must not stay)."""
        args = ("install", device, str(token), claim)
        return int(await self._call(self.scripts.transfer, episode, args)) == 1

    async def settle(self, episode: str, device: str, token: int, claim: str) -> bool:
        """Whether the claim of a copy the new owner holds was committed (True: serve it);
        False: it was not, and its reservation is gone in the same step, so it never will
        be (drop the copy)."""
        args = ("settle", device, str(token), claim)
        return str(await self._call(self.scripts.transfer, episode, args)) == "committed"

    async def kept(self, episode: str, reason: str, why: str) -> None:
        """Say that a move of ``episode`` (``reason``: drain, move) left it where it was, and
        ``why`` (none, unreachable, refused, redis): a ``move-kept`` event."""
        await self._call(self.scripts.transfer, episode, ("kept", reason, why))
