"""The README's "Run a fleet" block, run as written by bash.

Only what must differ on a shared machine is substituted: free ports for Redis (6379) and
the three nodes (8001, 8002, 8003), a temporary folder for the `/tmp/affinity-*` files, this test
environment's `.venv/bin`, and a 3 s lease instead of 10 s (through `AFFINITY_LEASE_TTL`, so
the block's text is unchanged) so that the owner's lapse comes sooner. Everything the block
prints is checked against what the README says it prints, whichever node registers first.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

pytestmark = pytest.mark.integration


def walkthrough() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Run a fleet", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    return str(block)


def test_the_block_only_uses_what_the_test_substitutes() -> None:
    block = walkthrough()
    assert "6379" in block and "8001" in block and "8002" in block
    assert "sleep 1" in block and "/readyz" in block, "it waits for readiness, not a fixed time"
    for line in block.splitlines():
        if line.startswith("curl") or line.strip().startswith("curl"):
            assert "curl -sf" in line, line


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    for tool in ("redis-server", "redis-cli", "curl"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed (bash .ci/run installs it)", pytrace=False)
    redis_port, port_a, port_b, port_c = free_port(), free_port(), free_port(), free_port()
    venv_bin = str(Path(sys.executable).parent) + "/"
    script = (
        walkthrough()
        .replace("redis-cli GET", f"redis-cli -p {redis_port} GET")
        .replace("6379", str(redis_port))
        .replace("8001", str(port_a))
        .replace("8002", str(port_b))
        .replace("8003", str(port_c))
        .replace("/tmp/affinity-", f"{tmp_path}/affinity-")
        .replace(".venv/bin/", venv_bin)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFINITY_")}
    env["AFFINITY_LEASE_TTL"] = "3"
    try:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        for pid_file in tmp_path.glob("affinity-gpu-*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        subprocess.run(
            ["redis-cli", "-p", str(redis_port), "shutdown", "nosave"],
            capture_output=True,
            timeout=30,
        )
    logs = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in tmp_path.glob("affinity-*.log"))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs}"
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()

    steps = [line.split() for line in lines[:4]]
    nodes = {s[0] for s in steps}
    devices = {s[1] for s in steps}
    assert len(nodes) == 1 and len(devices) == 1, lines
    (owner,) = nodes
    assert owner in ("gpu-a", "gpu-b") and devices.pop().startswith(owner + "/"), lines
    assert [s[2] for s in steps] == ["claimed", "hit", "hit", "hit"], lines

    assert any(line.startswith("episode:") and "ep-42" in line for line in lines), lines
    assert any(re.fullmatch(rf"{owner}/\d \d+ [0-9a-f]+ demo_policy@v1", line) for line in lines)

    other = "gpu-b" if owner == "gpu-a" else "gpu-a"
    assert f"{other} reassigned state_reset: True" in lines, lines
    canaries = [line.split()[1] for line in lines if line.startswith("canary ")]
    assert sorted(canaries) == sorted([other] * 3 + ["gpu-c"]), lines
    models = [line.split() for line in lines if line.startswith(("demo_policy ", "vla_demo "))]
    assert [m[:3] for m in models[-3:]] == [
        ["demo_policy", "v1", "3"],
        ["demo_policy", "v2", "1"],
        ["vla_demo", models[-1][1], "newest"],
    ], lines
