"""What a node publishes of its processes (``node/procs.py``, issue 43): the 99th percentile
of each process's loop lag over the samples since the last renewal, read from the
histograms the node already keeps, and the fronts and device workers joining once they start."""

from __future__ import annotations

import math
import os

from affinity.registry import NodeProcess
from node.metrics import LoopBuckets
from node.procs import NO_LAG, Processes, Running, p99_ms

BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


def observed(buckets: LoopBuckets, *values: float) -> None:
    for value in values:
        buckets.observe(value)


def test_p99_is_the_bound_of_the_bucket_of_the_99th_percentile_in_the_window() -> None:
    none = [0] * (len(BOUNDS) + 1)
    assert p99_ms(BOUNDS, none, none) is None  # nothing sampled
    buckets = LoopBuckets(BOUNDS)
    observed(buckets, *[0.0002] * 99, 0.04)  # 99 samples under 1 ms, 1 of 40 ms
    assert p99_ms(BOUNDS, none, buckets.counts) == 1.0
    before = list(buckets.counts)
    observed(buckets, *[0.0002] * 98, 0.04, 0.04)  # two of 100 over: the p99 is theirs
    assert p99_ms(BOUNDS, before, buckets.counts) == 50.0
    before = list(buckets.counts)
    observed(buckets, 3.0)  # past the largest bound
    assert p99_ms(BOUNDS, before, buckets.counts) == math.inf


class FakeFronts:
    def __init__(self) -> None:
        self.rows: list[Running] = []
        self.helping: list[Running] = []

    def running(self) -> list[Running]:
        return self.rows

    def helpers(self) -> list[Running]:
        return self.helping


def test_each_description_covers_the_samples_since_the_last_one() -> None:
    core = LoopBuckets(BOUNDS)
    procs = Processes(2, core, BOUNDS)
    first = procs.describe()
    assert first.fronts == 2 and [p.role for p in first.processes] == ["core"]
    assert first.processes[0].pid == os.getpid() and first.processes[0].lag_p99_ms is None
    observed(core, 0.2)
    assert procs.describe().processes[0].lag_p99_ms == 250.0
    observed(core, 0.0001)
    assert procs.describe().processes[0].lag_p99_ms == 1.0  # the slow one is past
    # the fronts join when they start; a front restarted shows its new pid and its count
    fronts = FakeFronts()
    procs.watch(fronts)
    lag0 = LoopBuckets(BOUNDS)
    fronts.rows = [Running("0", 11, 5, 0, lag0), Running("1", 12, 6, 0, LoopBuckets(BOUNDS))]
    observed(lag0, 0.003)
    rows = procs.describe().processes
    assert [(p.role, p.pid, p.restarts) for p in rows] == [("core", os.getpid(), 0), ("0", 11, 0),
                                                           ("1", 12, 0)]  # fmt: skip
    assert rows[1].lag_p99_ms == 5.0 and rows[2].lag_p99_ms is None
    fronts.rows = [fronts.rows[0], Running("1", 13, 7, 1, fronts.rows[1].lag)]
    assert procs.describe().processes[2] == NodeProcess("1", 13, 7, 1, None)
    # the fork server is a helper, apart from the fronts; no lag read from it
    assert procs.describe().helpers == ()
    fronts.helping = [Running("forksrv", 10, 4, 2, NO_LAG)]
    described = procs.describe()
    assert described.helpers == (NodeProcess("forksrv", 10, 4, 2, None),)
    assert len(described.processes) == 3 and described.restarts == 3


def test_device_workers_are_described_without_a_lag() -> None:
    assert p99_ms(BOUNDS, [], []) is None  # no counts: no sample, not a crash
    procs = Processes(1, LoopBuckets(BOUNDS), BOUNDS, workers=2)
    assert (procs.describe().workers, len(procs.describe().processes)) == (2, 1)
    workers = FakeFronts()
    procs.watch(workers)
    workers.rows = [Running("dev0", 21, 8, 0, NO_LAG), Running("dev1", 22, 9, 0, NO_LAG)]
    for _ in range(2):  # the second one reads the empty counts it saw the first time
        described = procs.describe()
        assert described.processes[1:] == (NodeProcess("dev0", 21, 8, 0, None),
                                           NodeProcess("dev1", 22, 9, 0, None))  # fmt: skip
    workers.rows = [workers.rows[0], Running("dev1", 23, 10, 1, NO_LAG)]  # restarted
    described = procs.describe()
    assert described.processes[2] == NodeProcess("dev1", 23, 10, 1, None)
    assert (described.fronts, described.workers, described.restarts) == (1, 2, 1)
