"""The README's "Run a fleet" block, run as written by bash, and what the README and
docs/redis.md then say about the fleet it leaves running.

Only what must differ on a shared machine is substituted: free ports for the block's Redis
(6390) and the three nodes (8001, 8002, 8003), a temporary folder for the `/tmp/affinity-*`
files, this test environment's `.venv/bin`, and a 3 s lease instead of 10 s (through
`AFFINITY_LEASE_TTL`, so the block's text is unchanged) so that the owner's lapse comes
sooner. Everything the block prints is checked against what the README says it prints,
whichever node registers first. On that fleet (two models, a node killed) the README's
`/act` bodies, its openpi and Python client loops and docs/redis.md's `redis-cli` lines
are run as written; then the README's clean-up line, which must stop what the block
started and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from tests.procs import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REDIS_MD = ROOT / "docs" / "redis.md"
PORTS = {"redis": "6390", "a": "8001", "b": "8002", "c": "8003"}

pytestmark = [
    pytest.mark.integration,
    # openpi-client 0.1.2 calls websockets' connect() outside a with block
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]


def section(title: str) -> str:
    return README.read_text(encoding="utf-8").split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def walkthrough() -> str:
    (block,) = re.findall(r"```bash\n(.*?)```", section("Run a fleet"), re.S)
    return str(block)


def clean_up() -> str:
    """The README's clean-up line, after the block."""
    (line,) = re.findall(r"Clean up with\s+`([^`]+)`", section("Run a fleet"))
    return str(line)


def snippet(needle: str) -> str:
    """The README's Python block of "From a robot" that holds ``needle``."""
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", section("From a robot"), re.S)
               if needle in c]  # fmt: skip
    return str(code)


def redis_md_lines() -> list[str]:
    """Every ``redis-cli`` line of docs/redis.md's shell blocks."""
    blocks = re.findall(r"```sh\n(.*?)```", REDIS_MD.read_text(encoding="utf-8"), re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("redis-cli ")]


@dataclass
class Fleet:
    tmp: Path
    ports: dict[str, int]
    env: dict[str, str]
    done: subprocess.CompletedProcess[str]
    lines: list[str]

    def url(self, node: str) -> str:
        return f"http://127.0.0.1:{self.ports[node[-1]]}"

    @property
    def owner(self) -> str:
        """The node that owned ep-42 first: drained with --move, then the survivor."""
        return self.lines[0].split()[0]

    @property
    def moved_to(self) -> str:
        """The node the drain moved ep-42 to, killed by the block."""
        return "gpu-b" if self.owner == "gpu-a" else "gpu-a"

    @property
    def survivor(self) -> str:
        return self.owner

    def bash(self, script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-euo", "pipefail", "-c", substitute(script, self.tmp, self.ports)],
            cwd=self.tmp, env=self.env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in self.tmp.glob("affinity-*.log"))


def substitute(script: str, tmp: Path, ports: dict[str, int]) -> str:
    for name, port in PORTS.items():
        script = script.replace(port, str(ports[name]))
    venv_bin = str(Path(sys.executable).parent) + "/"
    return script.replace("/tmp/affinity-", f"{tmp}/affinity-").replace(".venv/bin/", venv_bin)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AFFINITY_", "REDISCLI"))}
    env["AFFINITY_LEASE_TTL"] = "3"
    return env


def kill_what_is_left(tmp: Path) -> None:
    for pid_file in tmp.glob("affinity-*.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def require_tools() -> None:
    for tool in ("redis-server", "redis-cli", "curl"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed (bash .ci/run installs it)", pytrace=False)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_tools()
    tmp = tmp_path_factory.mktemp("walkthrough")
    ports = {name: free_port() for name in PORTS}
    env = environment()
    try:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", substitute(walkthrough(), tmp, ports)],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        # what the block exported, for the lines run after it
        url = f"redis://fleet:change-me@127.0.0.1:{ports['redis']}/0"
        exported = {"AFFINITY_CLUSTER_SECRET": "change-me", "REDISCLI_AUTH": "change-me"}
        env = {**env, **exported, "AFFINITY_REDIS_URL": url}
        yield Fleet(tmp, ports, env, done, done.stdout.splitlines())
    finally:
        kill_what_is_left(tmp)


def test_the_block_only_uses_what_the_test_substitutes() -> None:
    block = walkthrough()
    assert all(port in block for port in PORTS.values())
    assert "6379" not in block, "the block must not use the port another Redis may hold"
    assert "sleep 1" in block and "/readyz" in block, "it waits for readiness, not a fixed time"
    for line in block.splitlines():
        if line.startswith("curl") or line.strip().startswith("curl"):
            assert "curl -sf" in line, line
    assert "shutdown" not in clean_up(), "a shutdown reaches whichever Redis holds the port"


def test_the_walkthrough_runs_as_written(fleet: Fleet) -> None:
    done, lines = fleet.done, fleet.lines
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{fleet.logs()}"
    assert "Traceback" not in done.stderr, done.stderr

    steps = [line.split() for line in lines[:4]]
    nodes = {s[0] for s in steps}
    devices = {s[1] for s in steps}
    assert len(nodes) == 1 and len(devices) == 1, lines
    owner = fleet.owner
    assert owner in ("gpu-a", "gpu-b") and devices.pop().startswith(owner + "/"), lines
    assert [s[2] for s in steps] == ["claimed", "hit", "hit", "hit"], lines

    assert any(line.startswith("episode:") and "ep-42" in line for line in lines), lines
    assert any(re.fullmatch(rf"{owner}/\d \d+ [0-9a-f]+ demo_policy@v1", line) for line in lines)

    # the drain with --move: ep-42 goes on at the other node, at its fifth step, no reset
    assert f"{owner}/0: active -> draining" in lines and f"{owner}/1: active -> draining" in lines
    assert f"{fleet.moved_to} step 5 state_reset: False" in lines, f"{lines}\n{fleet.logs()}"
    assert f"{owner}/1: draining -> active" in lines, lines
    other = fleet.survivor
    assert f"{other} reassigned state_reset: True" in lines, lines
    canaries = [line.split()[1] for line in lines if line.startswith("canary ")]
    assert sorted(canaries) == sorted([other] * 3 + ["gpu-c"]), lines
    models = [line.split() for line in lines if line.startswith(("demo_policy ", "vla_demo "))]
    # each rollout line prints the versions as that line leaves them (its comment says so)
    assert [m[:3] for m in models[:2]] == [["demo_policy", "v1", "3"], ["demo_policy", "v2", "0"]]
    assert [m[:3] for m in models[-3:]] == [
        ["demo_policy", "v1", "3"],
        ["demo_policy", "v2", "1"],
        ["vla_demo", models[-1][1], "newest"],
    ], lines


def test_every_act_body_of_the_fleet_block_is_served_once_two_models_run(fleet: Fleet) -> None:
    """Issue 36 item 11: the block's first steps named no model; once the second model
    joined, the same lines answered 422 ``model_required``."""
    bodies = re.findall(r"-d '(\{.*?\})'", walkthrough())
    assert len(bodies) == 4, bodies
    for body in bodies:
        step = json.loads(body.replace("'$i'", "1"))
        assert "model" in step, body
        r = httpx.post(fleet.url(fleet.survivor) + "/act", json=step, timeout=30)
        assert r.status_code == 200, (body, r.text)


class Robot:
    """``robot.observations()`` of the README's loops: ``count`` observations made by
    ``make(i)``; ``before(i)`` runs before the i-th is handed out."""

    def __init__(self, count: int, make: Any, before: Any = None) -> None:
        self.count, self.make, self.before = count, make, before

    def observations(self) -> Iterator[dict[str, Any]]:
        for i in range(self.count):
            if self.before is not None:
                self.before(i)
            yield self.make(i)


def camera(i: int) -> dict[str, Any]:
    """A LIBERO-shaped observation, as openpi's examples send to ``vla_demo``."""
    rng = np.random.default_rng(i)
    return {
        "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/state": rng.standard_normal(8),
    }


def demo(i: int) -> dict[str, Any]:
    return {"obs": np.full((1, 8), 0.1 * i, np.float32)}


def run_loop(
    code: str, robot: Robot, urls: dict[str, str], namespace: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Execute one of the README's robot loops with ``robot`` and the node URLs it names
    replaced by ``urls`` (README URL -> live URL), in ``namespace`` (its variables, which
    ``robot`` may read while it runs); returns the namespace."""
    for given, live in urls.items():
        code = code.replace(given, live)
    namespace = {} if namespace is None else namespace
    namespace["robot"] = robot
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def test_the_readme_openpi_loop_runs_on_its_two_model_fleet(fleet: Fleet) -> None:
    """Issue 36 item 11: the snippet connected, the metadata named ``vla_demo``, and the
    first ``infer`` was refused (``model_required``) on the README's own fleet."""
    ws = {n: fleet.url(n).replace("http://", "ws://") for n in ("gpu-c", fleet.survivor)}
    done = run_loop(
        snippet("WebsocketClientPolicy"),
        Robot(3, camera),
        {"ws://node-a:8000": ws["gpu-c"], "ws://node-b:8000": ws[fleet.survivor]},
    )
    assert done["actions"].shape == (10, 7) and done["seq"] == 3
    assert done["reply"]["model"].startswith("vla_demo@") and not done["reply"]["state_reset"]


def test_the_readme_client_loop_runs_on_its_two_model_fleet(fleet: Fleet) -> None:
    urls = {"http://node-a:8000": fleet.url(fleet.survivor), "http://node-b:8000": fleet.url("c")}
    done = run_loop(snippet("from affinity import Client"), Robot(3, demo), urls)
    assert done["actions"].shape == (1, 4, 2) and done["step"].seq == 3
    assert done["step"].model.startswith("demo_policy@")


def test_docs_redis_md_lines_print_what_they_say_on_the_readme_fleet(fleet: Fleet) -> None:
    """Issue 36 item 10: docs/redis.md's model lines named ``demo@v1`` while the README's
    fleet registers ``demo_policy@v1``: they printed nothing. Every line runs here as
    written, against the README's fleet (its node ``gpu-a`` read as the live one), with the
    block's Redis port and user added."""
    lines = redis_md_lines()
    assert len(lines) >= 15 and any("demo_policy@v1" in line for line in lines)
    allowed_empty = (
        "'{affinity}:full'",  # nothing at capacity
        "ZRANGE '{affinity}:load:",
        "'{affinity}:score",  # (published at the first renewal, a third of a lease in)
    )
    for line in lines:
        # $(...) arithmetic is the shell's: run through bash, with the port and user added
        script = line.replace("gpu-a", fleet.survivor).replace(
            "redis-cli ", f"redis-cli -p {fleet.ports['redis']} --user fleet ", 1
        )
        out = subprocess.run(["bash", "-c", script], env=fleet.env, capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        assert out.returncode == 0 and "ERR" not in out.stdout + out.stderr, (line, out)
        if not any(part in line for part in allowed_empty):
            assert out.stdout.strip() not in ("", "(nil)", "(empty array)"), (line, out)


def test_the_clean_up_line_stops_what_the_block_started(fleet: Fleet) -> None:
    pids = {p.name: int(p.read_text()) for p in fleet.tmp.glob("affinity-*.pid")}
    assert sorted(pids) == sorted(
        ["affinity-redis.pid", f"affinity-{fleet.survivor}.pid", "affinity-gpu-c.pid"]
    )
    done = fleet.bash(clean_up())
    assert done.returncode == 0, done.stderr

    def gone() -> bool:
        for pid in pids.values():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            return False
        return True

    wait_until(gone, 30, "the nodes and the Redis the block started to stop")


def test_on_a_port_another_redis_holds_the_block_stops_loudly_and_leaves_it_alone(
    tmp_path: Path,
) -> None:
    """Issue 36 item 5: with 6379 taken, ``redis-server --daemonize yes`` exited 0, every
    later line wrote ``{affinity}:*`` keys into the other Redis, and the clean-up line shut
    it down. Here another Redis holds the block's port: the block stops with one line, writes
    nothing there, and the clean-up line leaves that Redis running."""
    require_tools()
    ports = {name: free_port() for name in PORTS}
    theirs = subprocess.Popen(
        ["redis-server", "--port", str(ports["redis"]), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    other = redis.Redis(port=ports["redis"], socket_timeout=2)
    try:
        wait_until(other.ping, 10, "the other Redis")
        other.set("theirs", "1")
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", substitute(walkthrough(), tmp_path, ports)],
            cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode != 0, done.stdout
        assert f"no Redis of ours on {ports['redis']}" in done.stderr, done.stderr
        assert done.stdout == ""
        assert other.keys("*") == [b"theirs"], "the block wrote into another Redis"
        subprocess.run(["bash", "-c", substitute(clean_up(), tmp_path, ports)],
                       capture_output=True, timeout=30)  # fmt: skip
        assert other.ping() and other.get("theirs") == b"1"
    finally:
        other.close()
        kill_what_is_left(tmp_path)
        theirs.kill()
        theirs.wait(10)


def test_pasted_with_its_port_taken_the_block_stops_at_the_guard_and_the_shell_lives_on(
    tmp_path: Path,
) -> None:
    """Issue 42 item 4: pasted into an interactive shell (no ``set -e`` of the caller's),
    the block went on past its guard when 6390 was taken: new-fleet, two nodes, every step
    and command failed in turn, 198 s and 1,670 lines with 111 Python tracebacks. Fed to
    bash line by line as a paste is, it must print the guard's one line and stop before
    anything else starts, and the shell must go on to run what the user types next."""
    require_tools()
    ports = {name: free_port() for name in PORTS}
    theirs = subprocess.Popen(
        ["redis-server", "--port", str(ports["redis"]), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    other = redis.Redis(port=ports["redis"], socket_timeout=2)
    try:
        wait_until(other.ping, 10, "the other Redis")
        pasted = substitute(walkthrough(), tmp_path, ports) + "echo the shell goes on\n"
        done = subprocess.run(
            ["bash"], input=pasted, cwd=tmp_path, env=environment(),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.stdout == "the shell goes on\n", done.stdout
        assert done.stderr.splitlines() == [
            f"no Redis of ours on {ports['redis']}: {tmp_path}/affinity-redis.log"
        ], done.stderr
        started = sorted(p.name for p in tmp_path.glob("affinity-*.pid"))
        assert started == ["affinity-redis.pid"], "the block went on past its guard"
        assert other.keys("*") == [], "the block wrote into another Redis"
    finally:
        other.close()
        kill_what_is_left(tmp_path)
        theirs.kill()
        theirs.wait(10)
