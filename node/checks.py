"""A front process's input checks (issue 43): the inputs of a step checked and converted
in the front by the rule the core applies (``node/inputs.py``), against the input check
(``node/contract.py``'s ``InputCheck``) the core taught it, so that the core takes them as
they are (``node/inputs.py``'s ``Checked`` and ``trusted``). Used by ``POST /act`` and KServe v2
(HTTP: ``node/front.py``; gRPC: ``node/protocols/kserve/grpc_front.py``); openpi's frames
are checked against their connection's check (``node/front.py``'s ``_observed``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from node import inputs
from node.contract import PolicyContract, checking_contract
from node.errors import InvalidInput

__all__ = ["Checks"]

log = logging.getLogger("affinity.node")

Array = np.ndarray[Any, Any]


def _grows(contract: PolicyContract, raw: Mapping[str, Array]) -> bool:
    """Whether an input of ``raw`` would take more bytes converted to the model's dtype
    than it came in (uint8 pixels to a float input): a body that fit a slot must still fit,
    so such inputs go as they came and the core converts them."""
    return any(
        np.dtype(spec.dtype).itemsize > raw[spec.name].itemsize
        for spec in contract.observation_inputs
        if spec.name in raw
    )


class Checks:
    """The input checks (``node/contract.py``'s ``InputCheck``) of the models this front's
    steps named, by a row's ``model`` as sent (None: the node's only model; KServe's in an
    instance of their own, by ``check_name``), as the core's replies taught them (``chk``:
    ``node/inputs.py``'s ``taught``). A row whose model is known has its
    inputs checked and converted here by the rule the core applies (``node/inputs.py``):
    passing, they go over the hop as the model's arrays, marked checked against that key,
    and the core takes them as they are when the key is its own contract's; failing,
    they go as they came and the core says what is wrong, as in one process. A check that
    is no longer the model's (a rollout) is refused by the core before anything changed,
    and the request is sent again unchecked (:meth:`FrontApp.act`). A model known by a key
    without a contract is not checked here (its check could not be read, or it changed
    too often): its rows say the key, so the core does not teach it again."""

    MAX = 256
    """Models (as named) known at most: past it, everything is forgotten and taught again."""
    CHANGES = 4
    CHANGES_S = 600.0
    """A model whose check changed :attr:`CHANGES` times within this many seconds is not
    checked here until that time has passed (versions of different inputs stepped through
    this front in turn: each change costs a step a second trip over the hop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._known: dict[str | None, tuple[str, PolicyContract | None]] = {}
        self._changes: dict[str | None, tuple[int, float]] = {}  # count, since
        self._clock = clock

    def learn(self, lessons: object) -> None:
        """Take the core's ``chk``: ``[model, key, doc]`` each (key None: not checked here)."""
        if not isinstance(lessons, list):
            return
        for lesson in lessons:
            if not (isinstance(lesson, list) and len(lesson) == 3):
                continue
            model, key, doc = lesson
            if model is not None and not isinstance(model, str):
                continue
            known = self._known.get(model)
            if known is not None and known[0] == key:
                continue  # (the same lesson again: the replies of steps sent before it)
            if not isinstance(key, str):  # no check: its rows then say no key
                self._known.pop(model, None)
                continue
            contract: PolicyContract | None = None
            if known is None or not self._changed(model):
                try:
                    contract = checking_contract(doc)
                except ValueError as exc:  # (said once: its rows say the key from now on)
                    log.warning("the core taught an input check this front cannot read: %s", exc)
            if len(self._known) >= self.MAX or len(self._changes) >= self.MAX:
                self._known.clear()
                self._changes.clear()
            self._known[model] = (key, contract)

    def _changed(self, model: str | None) -> bool:
        """Count a change of ``model``'s check; whether it changed too often to be checked."""
        now = self._clock()
        count, since = self._changes.get(model, (0, now))
        if now - since > self.CHANGES_S:
            count, since = 0, now
        self._changes[model] = (count + 1, since)
        return count + 1 >= self.CHANGES

    def row(self, doc: dict[Any, Any], binary: bool, arrays: list[Array]) -> dict[str, Any] | None:
        """A row's inputs for the hop, checked and converted against its model's check
        (``ok``), with the check's key (``ck``); None when its model is not known here."""
        model = doc.get("model")
        known = self._known.get(model) if model is None or isinstance(model, str) else None
        if known is None:
            return None
        key, contract = known
        raw = doc["inputs"]
        if contract is None or (
            binary
            and not (isinstance(raw, dict) and all(isinstance(v, np.ndarray) for v in raw.values()))
        ):  # (msgpack lists of small numbers converted could outgrow the body: the core's)
            return {"ck": key}
        if binary and _grows(contract, raw):
            return {"ck": key}  # (uint8 pixels to a float input: 4x the bytes) the core's
        try:
            feed = inputs.from_arrays(contract, raw) if binary else inputs.from_json(contract, raw)
        except InvalidInput:
            return {"ck": key}  # as it came: the core says what is wrong
        arrays.extend(feed.values())
        return {"in": [["n", name] for name in feed], "ck": key, "ok": True}

    def tensors(
        self, model: str, arrays: dict[str, Array], rows: int | None
    ) -> tuple[dict[str, Array], dict[str, Any]] | None:
        """A KServe infer request's input tensors for ``model`` (the name its lessons come
        under: ``kserve.body.check_name``), checked and converted against the model's check,
        and the word for the hop (``ok``, ``ck``: as :meth:`row`'s). The tensors as they
        came, with the key alone, when the check refuses them (the core says what is wrong,
        in Triton's words: a missing input, a datatype or shape the model does not take) or
        when they would grow converted. A request of ``rows`` rows (``episode_ids``) is
        checked row by row, each row's inputs the slices the core cuts
        (``kserve.request.row_requests``), and crosses as the converted rows joined again
        along the rows' axis, so that the core cuts each row as the rule converted it; a
        row refused (or inputs without the rows' axis) and the request crosses as it came,
        each row then checked in the core and refused alone, as in one process. None for a
        model not known here."""
        known = self._known.get(model)
        if known is None:
            return None
        key, contract = known
        if (
            contract is None
            or not contract.observation_specs.keys() <= arrays.keys()  # the core names them
            or _grows(contract, arrays)
        ):
            return arrays, {"ck": key}
        feed: dict[str, Array] | None
        try:
            if rows is None:
                feed = inputs.from_arrays(contract, arrays)
            else:
                feed = _rows(contract, arrays, rows)
        except InvalidInput:
            return arrays, {"ck": key}
        if feed is None:
            return arrays, {"ck": key}
        return feed, {"ck": key, "ok": True}


def _rows(
    contract: PolicyContract, arrays: Mapping[str, Array], count: int
) -> dict[str, Array] | None:
    """The inputs of a request of ``count`` rows with each row's converted by the rule
    (``InvalidInput`` for a row it refuses), joined again along the rows' axis; None
    when an input has no such axis (the core says so)."""
    if any(a.ndim == 0 or a.shape[0] != count for a in arrays.values()):
        return None
    batch = contract.batch_axis
    rows = [
        inputs.from_arrays(
            contract, {n: a[i : i + 1] if batch else a[i] for n, a in arrays.items()}
        )
        for i in range(count)
    ]
    join = np.concatenate if batch else np.stack
    return {name: join([row[name] for row in rows]) for name in rows[0]} if rows else None
