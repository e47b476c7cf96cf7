"""Action-chunk execution: an episode's action buffer, execute-k and temporal ensembling.

A policy that predicts a chunk of H future actions per run (output ``[B, H, D]`` or
``[H, D]``) need not run at every step. Per step, one of:

* **off** (no mode): the model runs and every output is returned as the model made it.
* **execute k** (``1 <= k <= H``): the model runs, its chunk is kept, and the step is answered
  with action 0 of it. The next ``k - 1`` steps are answered with actions ``1 .. k-1`` of
  the same chunk from the buffer, without running the model. ``k = 1`` runs every step and
  returns action 0.
* **ensemble exp** with decay ``m >= 0`` (ACT's temporal ensembling): the model runs every
  step. The reply for time step ``t`` blends every stored prediction for ``t``. There is one
  from each of the (at most H) chunks predicted at ``t-H+1 .. t``. They are ordered oldest
  first (``i = 0`` is the chunk predicted longest ago). Prediction ``i`` gets the weight
  ``w_i = exp(-m * i)``, and the reply is ``sum(w_i * a_i) / sum(w_i)``. With ``m > 0`` the
  oldest prediction weighs most, as in ACT (``m = 0.01`` there); ``m = 0`` is a plain mean.
  The blend is computed in float64 and cast to the chunk's dtype.

The action of a step is the chunk output with its time axis removed. That is ``[1, D]``
for a ``[B, H, D]`` output (the batch axis is kept), ``[D]`` for an ``[H, D]`` output.

The buffer belongs to the episode's state and lives and dies with it. It holds at most H
chunks of ``H x D`` values (ensembling; execute-k keeps one), so at most ``H * H * D``
numbers per episode. Changing mode within an episode continues from the same buffer; a
step with chunk execution off drops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from affinity.errors import InvalidArgument
from node.contract import PolicyContract

__all__ = ["ENSEMBLES", "ActionBuffer", "ChunkMode", "ChunkSpec", "find_chunk"]

Array = np.ndarray[Any, Any]

ENSEMBLES = ("none", "exp")


@dataclass(frozen=True)
class ChunkSpec:
    """The model's action-chunk output: its name, horizon H, and whether it has a batch axis."""

    output: str
    horizon: int
    batch_axis: bool  # [batch, H, D] (the action keeps the batch axis, of 1) or [H, D]

    def action(self, row: Array) -> Array:
        """The reply array for one action ``row`` (``[D]``): ``[1, D]`` or ``[D]``."""
        return row[np.newaxis] if self.batch_axis else row

    def chunk_of(self, output: Array) -> Array:
        """The ``[H, D]`` chunk of one step's output (``[1, H, D]`` or ``[H, D]``)."""
        return output[0] if self.batch_axis else output


def find_chunk(contract: PolicyContract) -> tuple[ChunkSpec | None, str]:
    """The action-chunk output of ``contract`` (its ``chunk``: the sidecar's, or the one
    returned output shaped like a chunk), or None and a sentence saying why there is none."""
    if contract.chunk is None or contract.chunk_shape is None:
        return None, (
            'the model has no action-chunk output (name it in the sidecar\'s "chunk"; '
            "by default it is the one returned output shaped [batch, H, D])"
        )
    horizon, _ = contract.chunk_shape
    return ChunkSpec(contract.chunk, horizon, contract.batch_axis), ""


@dataclass(frozen=True)
class ChunkMode:
    """How one step uses the action buffer (see the module doc)."""

    execute_steps: int = 1
    ensemble: str = "none"
    decay: float = 0.01

    @classmethod
    def checked(
        cls,
        chunk: ChunkSpec | None,
        why_none: str,
        execute_steps: object,
        ensemble: object,
        decay: float,
    ) -> ChunkMode:
        """A mode from caller values, or :class:`InvalidArgument` naming the bad one.

        ``execute_steps`` None means 1; ``ensemble`` None means ``"none"``. Ensembling runs
        the model every step, so it takes ``execute_steps`` 1 only.
        """
        if ensemble is not None and ensemble not in ENSEMBLES:
            raise InvalidArgument("ensemble", ensemble, f"must be one of {', '.join(ENSEMBLES)}")
        field, value = ("execute_steps", execute_steps)
        if execute_steps is None:
            field, value = "ensemble", ensemble
        if chunk is None:
            raise InvalidArgument(field, value, f"this model has no action chunk: {why_none}")
        k = 1 if execute_steps is None else execute_steps
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk.horizon:
            raise InvalidArgument(
                "execute_steps",
                execute_steps,
                f"must be an integer from 1 to the chunk's horizon {chunk.horizon}",
            )
        mode = "none" if ensemble is None else str(ensemble)
        if mode == "exp" and k != 1:
            raise InvalidArgument(
                "execute_steps", k, "ensembling runs the model every step; it takes 1 only"
            )
        if not (np.isfinite(decay) and decay >= 0):
            raise InvalidArgument("ensemble_decay", decay, "must be a finite number >= 0")
        return cls(k, mode, float(decay))


@dataclass(frozen=True)
class ActionBuffer:
    """One episode's chunks. Immutable: each step makes the next buffer.

    ``t`` is the time step the next reply is for (steps served since the buffer began).
    ``chunks`` holds (time step it was predicted at, ``[H, D]`` chunk), oldest first.
    """

    t: int = 0
    chunks: tuple[tuple[int, Array], ...] = ()

    def buffered(self, mode: ChunkMode) -> Array | None:
        """The action for step ``t`` from the newest chunk, when ``mode`` lets the step be
        answered without the model; else None."""
        if mode.ensemble != "none" or not self.chunks:
            return None
        start, chunk = self.chunks[-1]
        offset = self.t - start
        return chunk[offset] if offset < min(mode.execute_steps, len(chunk)) else None

    def served(self) -> ActionBuffer:
        """The buffer after a step answered from it."""
        return ActionBuffer(self.t + 1, self.chunks)

    def after_run(self, chunk: Array, mode: ChunkMode) -> tuple[ActionBuffer, Array]:
        """The buffer after a model run that predicted ``chunk`` at step ``t``, and the
        action to reply with."""
        t = self.t
        if mode.ensemble == "none":
            return ActionBuffer(t + 1, ((t, chunk),)), chunk[0]
        # the chunks predicted at t-H+1 .. t, oldest first: each has a prediction for t
        live = (*((s, c) for s, c in self.chunks if s + len(c) > t), (t, chunk))
        predictions = np.stack([c[t - s] for s, c in live]).astype(np.float64)
        weights = np.exp(-mode.decay * np.arange(len(live)))
        blend = np.tensordot(weights / weights.sum(), predictions, axes=1)
        return ActionBuffer(t + 1, live), blend.astype(chunk.dtype)
