"""``dispatch``: one ``MultiGpuDispatcher.step`` as the owner makes it, from the few values
a test or a benchmark names (the dispatcher takes a ``Step`` and an ``Assignment`` whole)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from affinity.claims import Assignment
from node.dispatcher import MultiGpuDispatcher
from node.record import StepResult
from node.step import Array, Step

__all__ = ["dispatch"]


async def dispatch(
    d: MultiGpuDispatcher,
    device: str,
    episode: str,
    token: int,
    fresh: bool,
    inputs: Mapping[str, Array],
    *,
    claim: str = "",
    generation: int | None = None,
    deadline: float = 0.0,
    **options: Any,
) -> StepResult:
    """Run a step of ``episode`` with ``inputs`` and ``options`` (``Step`` fields: ``seq``,
    ``origin``, ``execute_steps``, ``ensemble``, ``rtc``, ``arrived``) on ``device`` under
    the claim (``token``, ``claim``); ``fresh``: just claimed. ``deadline`` 0: a cancelled
    step's run counts as hung at once."""
    status = "claimed" if fresh else "hit"
    assignment = Assignment(episode, status, device, token, "", "", None, claim)
    step = Step(episode, dict(inputs), deadline, **options)
    return await d.step(step, assignment, generation=generation)
