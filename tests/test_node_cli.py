"""``affinity-node`` as a user meets it: --help, --version, and start-up errors that say
which flag is wrong in one line, with the documented exit codes (2 usage, 3 Redis)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from node.main import _FLAGS
from tests.procs import ROOT, free_port

pytestmark = pytest.mark.integration


def node(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.main", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", **(env or {})},
    )


def test_help_names_every_flag_with_its_default_and_variable() -> None:
    out = node("--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for flag in _FLAGS:
        assert flag.name in text and flag.env in text, flag.name
    assert "default: 64" in text and "AFFINITY_CAPACITY" in text
    assert "--version" in text and "Exit codes" in text


def test_version() -> None:
    out = node("--version")
    assert out.returncode == 0 and out.stdout.startswith("affinity-node ")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--devices", "garbage"], "--devices"),
        (["--devices", "cpu:0"], "--devices"),
        (["--model", "/no/such/model.onnx"], "--model"),
        (["--capacity", "many"], "--capacity"),
        (["--log-format", "xml"], "--log-format"),
        (["--namespace", "a:b"], "namespace"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv: list[str], words: str) -> None:
    out = node(*argv, "--port", str(free_port()))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("affinity-node")]
    assert len(lines) == 1 and words in lines[0], out.stderr


def test_a_gpu_list_without_gpus_is_a_usage_error() -> None:
    out = node("--devices", "0", "--port", str(free_port()))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--devices" in out.stderr


def test_unreachable_redis_is_one_line_and_exit_3() -> None:
    url = f"redis://user:secret@127.0.0.1:{free_port()}/0"
    out = node(
        "--redis", url, "--devices", "cpu:1", "--port", str(free_port()),
        env={"AFFINITY_REDIS_DEADLINE": "1"},
    )  # fmt: skip
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr and "secret" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("affinity-node: cannot reach Redis at") and "--redis" in last
