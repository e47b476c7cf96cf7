"""node/health.py: a device with several models goes down once, when its first model's
crash tracker does, and up once, when its last one's is up again (a worker process that
dies takes it down for every model at once): one transition each way in the metric and in
Redis, never "active" while a model still has it down."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from node.crashes import CrashTracker
from node.health import DeviceHealth
from node.metrics import Metrics

pytestmark = pytest.mark.anyio


class Model:
    def __init__(self) -> None:
        self.trackers = {"n/0": CrashTracker(3, 30.0, lambda: 0.0)}

    @property
    def devices(self) -> list[str]:
        return list(self.trackers)

    def tracker(self, device: str) -> CrashTracker:
        return self.trackers[device]

    async def probe(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class Registry:
    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []

    async def set_state(self, device: str, state: str, reason: str, **_: Any) -> None:
        self.writes.append((device, state))


def count(metrics: Metrics, to: str) -> float:
    value = metrics.registry.get_sample_value(
        "affinity_crash_transitions_total", {"device": "n/0", "to": to}
    )
    return value or 0.0


async def test_a_device_of_two_models_goes_down_once_and_up_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "affinity.node")
    a, b = Model(), Model()
    registry = Registry()
    metrics = Metrics(["n/0"], 4)
    health = DeviceHealth({"a": a, "b": b}, registry, metrics)  # type: ignore[arg-type]
    health.start()

    async def settle() -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        await asyncio.gather(*health._tasks)

    for model in (a, b):  # a worker process died: down for every model
        assert model.tracker("n/0").force_down("its worker process was killed by SIGKILL")
        health.on_transition_threadsafe("n/0", "down", "its worker process was killed")
    await settle()
    assert (count(metrics, "down"), registry.writes) == (1, [("n/0", "down")])

    a.tracker("n/0").success()  # the first model warmed up: the device is still down
    health.on_transition_threadsafe("n/0", "up", "")
    await settle()
    assert count(metrics, "up") == 0 and registry.writes == [("n/0", "down")]

    b.tracker("n/0").success()  # the last one: up, once
    health.on_transition_threadsafe("n/0", "up", "")
    await settle()
    assert count(metrics, "up") == 1
    assert registry.writes == [("n/0", "down"), ("n/0", "active")]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == ["device n/0 is down: its worker process was killed", "device n/0 is up"], (
        said
    )  # once each way, not once per model
