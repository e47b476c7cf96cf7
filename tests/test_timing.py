"""The entry node's count of served steps (``node/timing.py``): noted at each step, counted
in batches, and always counted before the registry is read, so a scrape sees every step
served before it, on whichever thread it reads."""

from __future__ import annotations

import threading

from node.metrics import Metrics
from node.step import Reply, Step
from node.timing import COUNT_EVERY, StepTimes

MODEL = "demo@1"


def served(times: StepTimes, node: str = "a", control_hz: float | None = None) -> Reply:
    step = Step("ep", {}, deadline=0.0, door="openpi", control_hz=control_hz)
    reply = Reply({}, "ep", "a/0", node, 1, "hit", False, False, model=MODEL,
                  timing={"queue_ms": 1.0, "run_ms": 2.0})  # fmt: skip
    times.served(step, reply, 0.004, 0.005)
    return reply


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_read_of_the_registry_counts_every_step_noted_before_it() -> None:
    metrics = Metrics(["a/0"], 4)
    times = StepTimes(metrics, "a", control_hz=None)
    reply = served(times)
    assert reply.timing["total_ms"] == 5.0  # in the reply at once
    served(times, node="b", control_hz=250)  # 4 ms period: 5 ms is a miss
    assert sample(metrics, "affinity_routing_total", result="hit") == 2
    assert sample(metrics, "affinity_act_seconds_count", path="local") == 1
    assert sample(metrics, "affinity_act_seconds_count", path="forwarded") == 1
    assert sample(metrics, "affinity_step_seconds_count", model=MODEL, door="openpi") == 2
    assert sample(metrics, "affinity_step_seconds_sum", model=MODEL, door="openpi") == 0.01
    assert sample(metrics, "affinity_step_part_seconds_count", model=MODEL, part="run") == 2
    assert sample(metrics, "affinity_step_part_seconds_sum", model=MODEL, part="queue") == 0.002
    assert sample(metrics, "affinity_deadline_miss_total", model=MODEL, door="openpi") == 1
    assert sample(metrics, "affinity_control_period_seconds", model=MODEL) == 0.004
    assert sample(metrics, "affinity_routing_total", result="hit") == 2  # counted once


def test_steps_are_counted_in_batches_without_a_read_and_none_is_lost_to_one() -> None:
    metrics = Metrics(["a/0"], 4)
    times = StepTimes(metrics, "a", control_hz=None)
    child = metrics.step_seconds.labels(MODEL, "openpi")
    for _ in range(COUNT_EVERY):
        served(times)
    assert sum(child.counts) == COUNT_EVERY  # counted without a read
    reads = threading.Thread(target=lambda: [list(metrics.registry.collect()) for _ in range(200)])
    reads.start()  # reads on another thread while steps are noted here
    for _ in range(3 * COUNT_EVERY + 5):
        served(times)
    reads.join()
    assert sample(metrics, "affinity_step_seconds_count", model=MODEL, door="openpi") == (
        4 * COUNT_EVERY + 5
    )
