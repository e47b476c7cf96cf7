"""The supervisor of a node's front doors (``node/fronts.py``, issue 43), without starting a
node: a front whose restart cannot start a process (no fork: memory, file descriptors) is
tried again with its backoff, leaking nothing, until one starts."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from node import fronts as fronts_module
from node.fronts import Fronts
from node.metrics import Metrics

pytestmark = pytest.mark.anyio


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_front_whose_restart_cannot_start_is_tried_again_leaking_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = SimpleNamespace(
        metrics=Metrics(["a/0"], 8), config=SimpleNamespace(front_hang_s=30.0)
    )
    listener = socket.socket()
    started: list[subprocess.Popen[bytes]] = []
    failures = [OSError(12, "Cannot allocate memory"), OSError(24, "Too many open files")]
    real_popen = subprocess.Popen

    def popen(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        if failures:
            raise failures.pop(0)
        proc = real_popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(proc)
        return proc

    monkeypatch.setattr(fronts_module, "BACKOFF_S", (0.01, 0.05))
    monkeypatch.setattr(fronts_module.subprocess, "Popen", popen)
    try:
        supervisor = Fronts(service, [listener], "core", {"max_body_bytes": 4096})  # type: ignore[arg-type]
    except BaseException:  # (never a socket left for the garbage collector to warn about)
        listener.close()
        raise
    front = supervisor.fronts[0]
    try:
        before = open_fds()
        supervisor._respawn(front)  # what a front's death schedules
        assert front.process is None and front.hop is None
        assert open_fds() == before  # its region and doorbells closed again
        for _ in range(500):  # tried again, bounded: the second failure, then a start
            if front.process is not None:
                break
            await asyncio.sleep(0.01)
        assert front.process is not None and started == [front.process] and not failures
        assert front.hop is not None and front.hop.alive
    finally:
        supervisor.stopping = True
        for proc in started:
            proc.kill()
            proc.wait()
        if front.hop is not None:
            front.hop.drop()
        listener.close()
