"""node/resolver.py: what Redis answers a resolve, as the step's status and code; the
model a step names against an episode's. node/stateless.py: where a stateless step runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from affinity import (
    Assignment,
    BackendUnavailable,
    ModelConflict,
    NoCapacity,
    Recovering,
    UnknownModel,
)
from node.errors import Refused, Unavailable
from node.metrics import Metrics
from node.peers import PeerHealth
from node.resolver import Resolver
from node.stateless import Stateless
from node.step import Step

pytestmark = pytest.mark.anyio


def resolver(answer: Any) -> Resolver:
    async def resolve(episode: str, **_: Any) -> Assignment:
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    claims = SimpleNamespace(resolve=resolve)
    return Resolver(claims, "demo", Metrics(["a/0"], 1), PeerHealth(), 0.0)  # type: ignore[arg-type]


def step(model: str | None = None, version: str | None = None) -> Step:
    return Step("ep", {}, 0.0, model=model, version=version)


@pytest.mark.parametrize(
    ("error", "kind", "code"),
    [
        (ModelConflict("ep", "demo@v1", "demo@v2"), Refused, "model_conflict"),
        (UnknownModel("other"), Refused, "unknown_model"),
        (BackendUnavailable("down"), Unavailable, "redis"),
        (Recovering("ep", 3.0), Unavailable, "recovering"),
        (NoCapacity("ep"), Unavailable, "full"),
        (NoCapacity("ep", "no_nodes"), Unavailable, "no_nodes"),
    ],
)
async def test_what_redis_answers_is_the_steps_error(
    error: Exception, kind: type, code: str
) -> None:
    with pytest.raises(kind) as caught:
        await resolver(error).for_step(step())
    assert caught.value.reason == code


async def test_a_step_names_its_model_or_the_first_one() -> None:
    r = resolver(None)
    assert (r.asked(step()), r.asked(step("m", "v2"))) == ("demo", "m@v2")
    assert not r.names_other(step(), "")  # a fleet without models
    assert not r.names_other(step(), "demo@v1")  # the episode's own version
    assert r.names_other(step(version="v2"), "demo@v1")
    assert r.names_other(step("other"), "demo@v1")


async def test_a_stateless_step_runs_round_robin_on_the_devices_that_are_up() -> None:
    ran: list[str] = []

    async def run_stateless(device: str, inputs: Any) -> dict[str, Any]:
        ran.append(device)
        return {"a": np.zeros(1)}

    dispatcher = SimpleNamespace(
        contract=SimpleNamespace(control_inputs=()), run_stateless=run_stateless
    )
    down = {"a/1"}
    health = SimpleNamespace(devices=["a/0", "a/1", "a/2"], down=lambda d: d in down)
    stateless = Stateless("a", "http://a", {"demo": dispatcher}, health, {"demo": "demo@v1"})  # type: ignore[arg-type]
    arrival = SimpleNamespace(done=lambda: None)
    for _ in range(3):
        reply = await stateless.run(step(), arrival)  # type: ignore[arg-type]
    assert ran == ["a/0", "a/2", "a/0"] and reply.model == "demo@v1"
    assert reply.routing == "stateless" and reply.episode is None
    with pytest.raises(Refused) as caught:
        await stateless.run(step("other"), arrival)  # type: ignore[arg-type]
    assert caught.value.status == 404
    down.update({"a/0", "a/2"})
    with pytest.raises(Unavailable) as gone:
        await stateless.run(step(), arrival)  # type: ignore[arg-type]
    assert gone.value.reason == "device_down"
