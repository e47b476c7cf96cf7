"""Ask Redis who owns a step's episode: the resolve, its admission backlog, its refusals.

Redis decides (``affinity/claims.py``). This module asks and maps the answer to the step's
errors through the one table (``node.errors.refusal``). Another model or version is 409
``model_conflict``. A model no node registered is 404 ``unknown_model``. The rest is 503
with a reason. With ``--admission-wait`` a claim that finds
every device full waits in the backlog (``node/admission.py``) until its step's deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from affinity import (
    AffinityError,
    Assignment,
    BackendUnavailable,
    Claims,
    ModelConflict,
    ModelId,
    NoCapacity,
    Recovering,
    ResolveRequest,
    UnknownModel,
)
from node.admission import Admission
from node.catalog import Catalog
from node.errors import refusal
from node.metrics import Metrics
from node.peers import PeerHealth
from node.step import Step

__all__ = ["Placement", "Resolver"]


class Placement(NamedTuple):
    """How new episodes' devices are chosen (``--placement``, docs/policies.md). ``scored``:
    the device with the lowest predicted step time, none that predicts more than
    ``headroom`` x the control period (1 / the step's ``control_hz``, else 1 /
    ``control_hz`` here, the node's ``--control-hz``; neither: no gate)."""

    mode: str = "round-robin"
    headroom: float = 0.8
    control_hz: float | None = None

    def limit_ms(self, control_hz: float | None) -> float | None:
        """The most step time (ms) a chosen device may predict; None: no gate."""
        hz = control_hz or self.control_hz
        if self.mode != "scored" or not hz:
            return None
        return 1000.0 / hz * self.headroom


class Resolver:
    """A router's questions to Redis (see the module doc)."""

    def __init__(
        self,
        claims: Claims,
        first_model: str,
        metrics: Metrics,
        peers: PeerHealth,
        admission_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        catalog: Catalog | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.claims = claims
        self.first_model = first_model  # a step that names none
        self.metrics = metrics
        self.peers = peers
        self.catalog = catalog
        self.placement = placement or Placement()  # the node's --placement
        self.admission = (
            Admission(admission_wait_s, clock=clock, on_waiting=metrics.admission_waiting.set)
            if admission_wait_s
            else None
        )

    async def for_step(self, step: Step) -> Assignment:
        """Where ``step`` is served: claimed unless it is ``live_only``."""
        assert step.episode is not None
        return await self.resolve(
            step.episode,
            claim=not step.live_only,
            deadline=step.deadline,
            model=step.model or self.first_model,
            version=step.version or "",
            control_hz=step.control_hz,
        )

    async def resolve(
        self,
        episode: str,
        *,
        restart: bool = False,
        claim: bool = True,
        deadline: float | None = None,
        model: str = "",
        version: str = "",
        control_hz: float | None = None,
    ) -> Assignment:
        """Raises ``UnknownEpisode`` when not ``claim`` and Redis holds no assignment.
        ``deadline``: a new step's; with ``--admission-wait`` a claim that finds every
        device full waits in the backlog until then at most. ``model``/``version``: what
        the step names (Redis keeps an episode on its own; another version is
        :class:`Refused` 409 ``model_conflict``, a model no node registered 404
        ``unknown_model``). ``control_hz``: the step's, for scored placement's gate (every
        device over it: 503 ``slo``, counted in ``affinity_placement_slo_total``)."""
        placement = self.placement
        limit_ms = placement.limit_ms(control_hz)

        def resolve() -> Awaitable[Assignment]:
            return self.claims.resolve(
                episode, restart=restart, claim=claim, model=model, version=version,
                placement=placement.mode, limit_ms=limit_ms,
            )  # fmt: skip

        try:
            try:
                assignment = await resolve()
            except NoCapacity as exc:
                if self.admission is None or deadline is None or exc.reason != "at_capacity":
                    raise
                assignment = await self.admission.wait(episode, resolve, deadline)
        except AffinityError as exc:
            refused = self._refused(exc)
            if refused is exc:
                raise
            raise refused from exc
        return self._resolved(assignment)

    async def for_steps(self, steps: Sequence[Step]) -> list[Assignment | Exception]:
        """:meth:`for_step` for each of ``steps`` (rows of one message), in one round trip
        to Redis (:meth:`Claims.resolve_many`): each row's assignment, or the error
        :meth:`for_step` would raise for it. A row that finds every device full with
        ``--admission-wait`` waits in the backlog alone (its own asks)."""
        try:
            found = await self.claims.resolve_many([self._ask(s) for s in steps])
        except AffinityError as exc:  # no answer for any of them: each row its own error
            return [self._refused(exc) for _ in steps]
        results: list[Assignment | Exception] = []
        waiting: list[int] = []
        for i, got in enumerate(found):
            if isinstance(got, Assignment):
                results.append(self._resolved(got))
            elif (
                isinstance(got, NoCapacity)
                and got.reason == "at_capacity"
                and self.admission is not None
            ):
                results.append(got)
                waiting.append(i)
            else:
                results.append(self._refused(got))
        if waiting:
            waited = await asyncio.gather(
                *(self.for_step(steps[i]) for i in waiting), return_exceptions=True
            )
            for i, answer in zip(waiting, waited, strict=True):
                if not isinstance(answer, Exception | Assignment):
                    raise answer  # a cancellation
                results[i] = answer
        return results

    def _ask(self, step: Step) -> ResolveRequest:
        """What :meth:`for_step` asks Redis for ``step``."""
        assert step.episode is not None
        placement = self.placement
        return ResolveRequest(
            step.episode, claim=not step.live_only, model=step.model or self.first_model,
            version=step.version or "", placement=placement.mode,
            limit_ms=placement.limit_ms(step.control_hz),
        )  # fmt: skip

    def _resolved(self, assignment: Assignment) -> Assignment:
        """Note what Redis answered: the owner's health, a new claim's model."""
        self.peers.resolved(assignment)
        if assignment.status != "hit" and assignment.model:
            m = ModelId.parse(assignment.model)
            self.metrics.model_claims.labels(m.name, m.version, assignment.status).inc()
        return assignment

    def _refused(self, exc: AffinityError) -> Exception:
        """A resolve's error as the step's (the one table, ``node.errors.refusal``); a bad
        argument stays itself."""
        if isinstance(exc, UnknownModel):  # named with the models served here
            served = self.catalog.served() if self.catalog else []
            return refusal(UnknownModel(exc.model, served))
        if isinstance(exc, NoCapacity) and exc.reason == "slo":
            self.metrics.placement_slo.inc()
        if isinstance(exc, NoCapacity | ModelConflict | Recovering | BackendUnavailable):
            return refusal(exc)
        return exc

    def asked(self, step: Step) -> str:
        """The model a step names: ``"name@version"``, or its name alone."""
        name = step.model or self.first_model
        return f"{name}@{step.version}" if step.version else name

    def names_other(self, step: Step, model: str) -> bool:
        """Whether ``step`` names another model name or version than ``model`` (an
        episode's ``"name@version"``; ``""``: a fleet without models), as resolve.lua
        decides it (``model_conflict``)."""
        if not model:
            return False
        name, _, version = model.partition("@")
        return (step.model or self.first_model) != name or (step.version or version) != version
