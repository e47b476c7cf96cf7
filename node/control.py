"""Triton's sequence-batcher control inputs, filled by the node on every step.

A model input named ``control.start``, ``control.end``, ``control.ready`` or
``control.corrid`` (``node.contract.CONTROL_INPUTS``) is not sent by clients. It is hidden
from them like ``state_in.*``. The node fills it, on every front door, with Triton's
semantics.

- ``control.start``: 1 on an episode's first step on its device. Also 1 on the first step
  after its state was reset (a new claim, a reassignment, ``sequence_start``, lost state).
  Else 0. A stateless step is a sequence of one step: 1.
- ``control.end``: 1 on the step that ends the episode (``end`` in ``/act``,
  ``sequence_end`` in KServe); else 0. A stateless step: 1.
- ``control.ready``: 1 for each row that carries a real step, 0 for the rows a batched run
  is padded with.
- ``control.corrid``: the episode's correlation id, ``uint64``, ``int64`` or string as the
  model declares. A number: a KServe integer sequence id as is (``kserve:i:7`` -> 7). Any
  other episode id (a string sequence id, an ``/act`` or openpi ``episode_id``) becomes the
  first 8 bytes of its BLAKE2b digest. That is the same on every node; its top bit is
  cleared for ``int64``. 0 without one. A string (Triton's ``sequence(string_id)``): a
  KServe sequence id as the client sent it (``kserve:s:robot-7`` -> ``robot-7``,
  ``kserve:i:7`` -> ``7``). Any other episode id as is; ``""`` without one.

Each value has the input's dtype (a bool, integer or float input takes 1/0) and shape, one
per row: ``[1, 1]`` or ``[1]`` with a batch axis, as declared.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from node.contract import PolicyContract, TensorSpec
from node.step import Array

__all__ = ["START", "control_feed", "corrid_of", "padding", "started"]

START = "control.start"
_READY = "control.ready"
_KSERVE_INT = "kserve:i:"
_KSERVE_STR = "kserve:s:"


def corrid_of(episode: str | None, dtype: str) -> int | str:
    """The correlation id of ``episode`` for a ``dtype`` (``uint64``, ``int64`` or
    ``object``: a string) input."""
    if dtype == "object":
        if episode is None:
            return ""
        for prefix in (_KSERVE_INT, _KSERVE_STR):
            if episode.startswith(prefix):
                return episode.removeprefix(prefix)
        return episode
    if episode is None:
        return 0
    limit = 1 << (64 if dtype == "uint64" else 63)
    if episode.startswith(_KSERVE_INT):
        number = int(episode.removeprefix(_KSERVE_INT))
        if number < limit:
            return number
    digest = hashlib.blake2b(episode.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % limit


def _row(contract: PolicyContract, spec: TensorSpec, value: Any) -> Array:
    shape = contract.step_spec(spec).shape
    return np.full(tuple(d if isinstance(d, int) else 1 for d in shape), value, spec.dtype)


def control_feed(
    contract: PolicyContract, episode: str | None, *, start: bool, end: bool
) -> dict[str, Array]:
    """The control inputs of one step (none for a model without any). ``start`` is what the
    caller knows (a stateless step: True). The dispatcher sets it once it knows whether the
    episode's state was reset (:func:`started`)."""
    values: dict[str, Any] = {
        START: int(start),
        "control.end": int(end),
        _READY: 1,
    }
    feed = {}
    for spec in contract.control_inputs:
        if spec.name == "control.corrid":
            value = corrid_of(episode, spec.dtype)
        else:
            value = values[spec.name]
        feed[spec.name] = _row(contract, spec, value)
    return feed


def started(feed: dict[str, Array]) -> None:
    """Mark ``feed``'s step as the first of its episode (state reset): ``control.start`` 1."""
    if START in feed:
        feed[START] = np.ones_like(feed[START])


def padding(name: str, row: Array) -> Array:
    """The value of input ``name`` on a padding row copied from ``row``: ``control.ready`` 0
    (no real step), anything else the copy."""
    return np.zeros_like(row) if name == _READY else row
