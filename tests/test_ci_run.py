"""``.ci/run`` and the README's "Two commands" (issue 42 items 5 and 8), and what a test
session leaves behind (item 9).

``.ci/run`` runs here in a copy of the repository's ``.ci`` folder whose commands are fakes
on ``PATH`` (``redis-server``, ``redis-cli``, ``apt-get``, ``.venv/bin/*``): each records
that it ran. The fake ``redis-server`` starts a ``sleep`` standing in for the Redis it
would start on 6379 (nothing here listens on 6379). So the script's own logic runs: which
packages it installs, the switch that skips them, that it ends with the README's test
command, and that it stops the Redis it started however it exits.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import wait_until

ROOT = Path(__file__).resolve().parent.parent
CI_RUN = ROOT / ".ci" / "run"
README = ROOT / "README.md"
TEST_COMMAND = ".venv/bin/python -m pytest -q"
BASH = shutil.which("bash") or "/bin/bash"


def two_commands() -> str:
    text = README.read_text(encoding="utf-8").split("## Two commands", 1)[1]
    return str(re.findall(r"```bash\n(.*?)```", text.split("\n## ", 1)[0], re.S)[0])


def packages() -> list[str]:
    done = subprocess.run([BASH, str(CI_RUN), "--print-packages"], capture_output=True,
                          text=True, timeout=30, check=True)  # fmt: skip
    return done.stdout.split()


def fake(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_ci(
    tmp: Path, *args: str, pytest_rc: int = 0, **env: str
) -> subprocess.CompletedProcess[str]:
    """``.ci/run`` in ``tmp`` with every outside command faked; ``tmp/calls`` lists what ran."""
    (tmp / ".ci").mkdir()
    shutil.copy(CI_RUN, tmp / ".ci" / "run")
    bin_ = tmp / "bin"
    log = tmp / "calls"
    record = f'echo "$(basename "$0") $*" >> {log}\n'
    fake(bin_ / "apt-get", record)
    fake(bin_ / "sudo", record + '"$@"\n')
    fake(bin_ / "redis-cli", record + f"[ -f {tmp}/up ] && echo PONG || exit 1\n")
    # the stand-in Redis: a sleep whose pid goes where --pidfile says
    fake(bin_ / "redis-server", record + "while [ $# -gt 0 ]; do\n"
         '  [ "$1" = --pidfile ] && pidfile=$2; shift\ndone\n'
         f'sleep 300 >/dev/null 2>&1 &\necho $! > "$pidfile"\necho $! > {tmp}/up\n')  # fmt: skip
    venv = tmp / ".venv" / "bin"
    fake(venv / "python", record + f'case "$*" in *pytest*) exit {pytest_rc};; esac\n')
    fake(venv / "ruff", record)
    fake(venv / "mypy", record)
    fake(tmp / "tests" / "lerobot_env.sh", record)  # the LeRobot reader's environment
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "AFFINITY_CI_NO_APT")}
    # only the basic tools of the system: none of the Debian packages the script looks for
    tools = tmp / "tools"
    tools.mkdir()
    for tool in (
        "basename",
        "dirname",
        "cat",
        "mktemp",
        "seq",
        "sort",
        "sleep",
        "id",
        "kill",
        "rm",
    ):
        found = shutil.which(tool)
        if found:
            (tools / tool).symlink_to(found)
    env = {**base, "PATH": f"{bin_}:{tools}", **env}
    return subprocess.run(
        [BASH, str(tmp / ".ci" / "run"), *args], cwd=tmp, env=env, capture_output=True,
        text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def calls(tmp: Path) -> list[str]:
    return (tmp / "calls").read_text().splitlines()


def test_the_readme_names_the_packages_ci_installs_and_runs_its_test_command() -> None:
    """Item 5: the plain path first (the Debian packages named, then the test command);
    item 8: step 1 runs a node from the lean install, not the 1.1 GB dev extra."""
    block = two_commands()
    step1 = next(line for line in block.splitlines() if "affinity-node" in line)
    assert "pip install -e . " in step1 and "[dev]" not in step1, step1
    named = set(re.findall(r"[a-z0-9][a-z0-9.+-]+", block.split("# 2.", 1)[1]))
    assert set(packages()) <= named, set(packages()) - named
    assert TEST_COMMAND in block
    assert {"podman", "runc", "debootstrap", "netavark", "aardvark-dns"} <= set(packages())
    script = CI_RUN.read_text(encoding="utf-8")
    assert script.rstrip().endswith(TEST_COMMAND), "CI runs exactly the README's command"


def test_ci_run_is_plain_bash_3_2() -> None:
    """Item 5: ``declare -A`` (bash 4) failed on macOS' /bin/bash 3.2."""
    script = CI_RUN.read_text(encoding="utf-8")
    for bash4 in ("declare -A", "local -A", "mapfile", "readarray", "${!", ",,}", "^^}", "|&"):
        assert bash4 not in script, bash4
    subprocess.run([BASH, "-n", str(CI_RUN)], check=True, timeout=30)


@pytest.mark.parametrize("switch", [("--no-system",), ("AFFINITY_CI_NO_APT",)])
def test_the_switch_skips_the_system_install_and_the_redis_it_started_stops(
    tmp_path: Path, switch: tuple[str]
) -> None:
    args, env = (switch, {}) if switch[0].startswith("--") else ((), {switch[0]: "1"})
    done = run_ci(tmp_path, *args, **env)
    assert done.returncode == 0, done.stderr
    ran = calls(tmp_path)
    assert not any(c.startswith(("apt-get", "sudo")) for c in ran), ran
    assert "not installing Debian packages" in done.stderr
    assert ran[-1] == "python -m pytest -q", ran
    pid = int((tmp_path / "up").read_text())
    wait_until(lambda: not alive(pid), 30, "the Redis .ci/run started to stop")


def test_ci_installs_what_is_missing_unasked_and_stops_its_redis_when_the_tests_fail(
    tmp_path: Path,
) -> None:
    """As CI runs it (CI=true, no terminal): apt-get installs every missing package, no
    question; a failing test run still stops the Redis it started on 6379."""
    done = run_ci(tmp_path, pytest_rc=1, CI="true")
    assert done.returncode == 1, done.stderr
    ran = calls(tmp_path)
    install = next(c for c in ran if c.startswith("apt-get install"))
    # every package whose command is not on PATH; redis-server and redis-cli are (fakes)
    wanted = {"iproute2", "iptables", "wrk", "chromium", "prometheus", "podman", "debootstrap"}
    assert wanted <= set(install.split()) and "redis-tools" not in install, install
    assert ran[-1] == "python -m pytest -q", ran
    pid = int((tmp_path / "up").read_text())
    wait_until(lambda: not alive(pid), 30, "the Redis .ci/run started to stop")


def test_a_failed_test_session_leaves_no_affinity_test_folders(tmp_path: Path) -> None:
    """Item 9: each session left its ``affinity-test-*`` folders (its Redis', its nodes')
    in the temporary directory. A session whose test fails, with this suite's conftest,
    starts a real Redis and makes a folder; none is left once it ended."""
    work = tmp_path / "session"
    (work / "temp").mkdir(parents=True)
    (work / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (work / "test_inner.py").write_text(
        "from tests.conftest import require_real_redis\n"
        "from tests.procs import tmpdir\n\n\n"
        "def test_fails() -> None:\n"
        "    require_real_redis()\n"
        "    (tmpdir() / 'node.log').write_text('x')\n"
        "    assert False, 'this session fails'\n"
    )
    env = {**os.environ, "TMPDIR": str(work / "temp"), "PYTHONPATH": str(ROOT)}
    env.pop("AFFINITY_TEST_REDIS_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cloudcoil",
         "--rootdir", str(work), str(work / "test_inner.py")],
        cwd=work, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "this session fails" in done.stdout, done.stdout
    left = sorted(p.name for p in (work / "temp").glob("affinity-test-*"))
    assert left == [], f"the session left {left}"


def test_a_test_process_killed_from_outside_leaves_none_of_the_processes_it_started(
    tmp_path: Path,
) -> None:
    """A test session killed with SIGKILL (a CI timeout, a tool's) ran no teardown: the
    nodes and redis-servers it started went on, eating the cores of the runs after it.
    ``tests.procs`` has each process group it starts killed by a reaper process once the
    test process is gone, however it ended."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from tests.procs import Proc\n"
        "log = Path(sys.argv[1])\n"
        "kept = Proc(['sleep', '600'], None, log)\n"
        "kept.start()\n"
        "done = Proc(['sleep', '600'], None, log)\n"
        "done.start()\n"
        "done.stop()\n"
        "print(kept.popen.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    test = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "log")], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert test.stdout is not None
        started = int(test.stdout.readline())
        assert alive(started)
        test.kill()  # nothing of it runs now: no atexit, no fixture
        test.wait(30)
        wait_until(lambda: not alive(started), 30, "the sleep its killed test started to end")
    finally:
        if test.poll() is None:
            test.kill()
            test.wait()
        if test.stdout is not None:
            test.stdout.close()
