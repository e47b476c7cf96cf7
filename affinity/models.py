"""Model identity (a policy's name and version) and what the fleet keeps per model in Redis:
the operator's rollout weights and the contracts nodes registered.

A model is ``name@version``. The name is what a client uses (KServe's model name, ``/act``'s
``model``, openpi's ``?model=``). The version is what an operator gives
(``--model NAME@VERSION``), or the first 12 hex digits of the SHA-256 of the model file.
Both are 1-64 characters of ``A-Z a-z 0-9 . _ -`` starting with a letter or digit, so a
model is one word in an episode's value, a key suffix and a URL path segment. A rollout
changes which version new episodes get, never the version of a running one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from affinity.errors import InvalidArgument, UnknownModel
from affinity.scripts import ScriptCaller, bounded, evalsha

__all__ = ["MAX_WEIGHT", "ModelId", "Models", "Rollout", "check_model_part"]

MAX_WEIGHT = 1000
"""The largest weight of a device or of a rollout's version: it keeps the rings' and the
versions' ``picks/weight`` scores exact in a double (see ``affinity/lua/lib.lua``)."""

_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_model_part(what: str, value: object) -> str:
    """``value`` as a model name or version (``what`` says which), or raise
    :class:`InvalidArgument`."""
    if not isinstance(value, str) or not _PART.fullmatch(value):
        raise InvalidArgument(
            f"model {what}", value, "must be 1-64 of A-Z a-z 0-9 . _ - from a letter or digit"
        )
    return value


class ModelId(NamedTuple):
    """One (name, version) a node serves; ``str()`` is ``name@version``."""

    name: str
    version: str

    @classmethod
    def parse(cls, text: str) -> ModelId:
        """``"name@version"`` (as stored in Redis) -> ModelId; raises InvalidArgument."""
        name, sep, version = text.partition("@")
        if not sep:
            raise InvalidArgument("model", text, "must be name@version")
        return cls(check_model_part("name", name), check_model_part("version", version))

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class Rollout:
    """What Redis holds of one model name's rollout: each version's first registration
    (ms, server time: the newest takes new episodes while there are no weights) and the
    operator's weights (empty: none)."""

    versions: Mapping[str, int]
    weights: Mapping[str, int]


class Models(ScriptCaller):
    """What the fleet keeps per model, over one Redis client: rollout weights (written by
    operators) and registered contracts (written by :meth:`Registry.register`). Every
    call is bounded."""

    async def rollouts(self, names: Iterable[str]) -> dict[str, Rollout]:
        """The rollout of each model name, in one round trip (no MULTI)."""
        names = list(names)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.zrange(self.keys.versions(name), 0, -1, withscores=True)
            pipe.hgetall(self.keys.rollout(name))
        replies = await bounded(self.settings, pipe.execute())
        out = {}
        for i, name in enumerate(names):
            versions, weights = replies[2 * i], replies[2 * i + 1]
            out[name] = Rollout(
                {_text(v): int(score) for v, score in versions},
                {_text(v): int(w) for v, w in weights.items()},
            )
        return out

    async def recordings(self, names: Iterable[str]) -> dict[str, dict[str, str]]:
        """Each model name's recording selections (version -> JSON), in one round trip."""
        names = list(names)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.recording(name))
        replies = await bounded(self.settings, pipe.execute())
        return {
            name: {_text(v): _text(s) for v, s in reply.items()}
            for name, reply in zip(names, replies, strict=True)
        }

    async def set_recording(self, name: str, version: str, selection: str | None) -> None:
        """Record ``name@version``'s episodes as ``selection`` says (JSON; None: stop)."""
        key = self.keys.recording(name)
        if selection is None:
            await bounded(self.settings, self.redis.hdel(key, version))
        else:
            await bounded(self.settings, self.redis.hset(key, version, selection))

    async def restore(self, name: str, rollout: Rollout) -> tuple[int, bool]:
        """Put back ``rollout`` of model ``name`` after Redis lost its data
        (``affinity/lua/restore_rollout.lua``): each version's first registration where
        Redis has a later one or none, and the weights while the name has none. Returns
        (versions whose place was put back, whether the weights were)."""
        args: list[str | int] = [len(rollout.versions)]
        for version, ms in rollout.versions.items():
            args += [version, ms]
        for version, weight in rollout.weights.items():
            args += [version, weight]
        moved, weighted = await bounded(
            self.settings,
            evalsha(self.redis, self.scripts.restore_rollout, self.keys.rollout(name), args),
        )
        return int(moved), bool(weighted)

    async def contract(self, model: ModelId) -> str | None:
        """The contract (JSON text) a node registered for ``model``, or None."""
        value = await bounded(self.settings, self.redis.get(self.keys.contract(str(model))))
        return value.decode() if isinstance(value, bytes) else value

    async def rollout(self, name: str, version: str, weight: int) -> None:
        """Give ``version`` of model ``name`` ``weight`` shares of its new episodes (0:
        none). Once a name has weights, only its versions of weight > 0 take new
        episodes, by exact weighted round-robin from now on; running episodes keep
        theirs. Raises :class:`UnknownModel` for a version no node registered,
        :class:`InvalidArgument` for a bad name, version or weight."""
        check_model_part("name", name)
        check_model_part("version", version)
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= MAX_WEIGHT:
            raise InvalidArgument("rollout weight", weight, f"must be an integer 0-{MAX_WEIGHT}")
        k = self.keys

        async def write() -> None:
            if await self.redis.zscore(k.versions(name), version) is None:
                raise UnknownModel(f"{name}@{version}")
            pipe = self.redis.pipeline(transaction=False)  # no MULTI: the ACL of docs/security.md
            pipe.hset(k.rollout(name), version, weight)
            pipe.delete(k.picks(name))
            pipe.xadd(
                k.events,
                {"type": "rollout", "model": name, "version": version, "weight": str(weight)},
                maxlen=self.settings.events_maxlen,
                approximate=True,
            )
            await pipe.execute()

        await bounded(self.settings, write())

    async def clear_rollout(self, name: str) -> bool:
        """Drop the weights of model ``name``: its newest registered version takes every
        new episode again. ``True`` when it had weights."""
        check_model_part("name", name)
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)  # no MULTI: the ACL of docs/security.md
        pipe.delete(k.rollout(name))
        pipe.delete(k.picks(name))
        pipe.xadd(
            k.events,
            {"type": "rollout", "model": name, "version": "", "weight": ""},
            maxlen=self.settings.events_maxlen,
            approximate=True,
        )
        had, _, _ = await bounded(self.settings, pipe.execute())
        return bool(had)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
