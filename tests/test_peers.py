"""A router logs one warning per change of an owner's reachability, not one per request."""

from __future__ import annotations

import logging

import pytest

from affinity import Assignment
from node.peers import PeerHealth


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_one_warning_when_unreachable_and_one_when_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "affinity.node")
    peers = PeerHealth()
    for _ in range(5):
        peers.failed("gpu-b", "http://gpu-b:8000", "connection refused")
    peers.answered("gpu-a")  # another owner answering changes nothing
    assert warnings(caplog) == [
        "owner gpu-b (http://gpu-b:8000) is unreachable: connection refused; its episodes "
        "get 503 until it answers or its lease lapses"
    ]
    peers.answered("gpu-b")
    peers.answered("gpu-b")
    assert warnings(caplog)[1:] == ["owner gpu-b answers again (5 forward(s) failed meanwhile)"]
    peers.failed("gpu-b", "http://gpu-b:8000", "timed out")  # a new outage: said again
    assert len(warnings(caplog)) == 3 and "timed out" in warnings(caplog)[-1]


def test_one_warning_when_an_unreachable_owners_lease_lapses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "affinity.node")
    peers = PeerHealth()
    moved = Assignment("ep-7", "reassigned", "gpu-a/0", 18, "gpu-a", "http://gpu-a", "gpu-b/1")
    peers.resolved(moved)  # nobody was unreachable: a handover, say nothing
    assert warnings(caplog) == []
    peers.failed("gpu-b", "http://gpu-b:8000", "connection refused")
    peers.resolved(moved._replace(status="hit", previous=None))
    peers.resolved(moved)
    peers.resolved(moved._replace(episode="ep-8"))
    assert warnings(caplog)[1:] == [
        "owner gpu-b lost its episodes (lease lapsed or device down): they are claimed anew, "
        "e.g. ep-7 on gpu-a/0 (1 forward(s) failed meanwhile)"
    ]
    peers.answered("gpu-b")  # it came back later: nothing to say, it was already told
    assert len(warnings(caplog)) == 2
