"""``affinity-node`` as a user meets it: --help, --version, and start-up errors that say
which flag is wrong in one line, with the documented exit codes (2 usage, 3 Redis)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from affinity.keys import Keys
from node.cli import _FLAGS
from tests.procs import FLEET_SECRET, ROOT, Node, RedisServer, free_port, tmpdir

pytestmark = pytest.mark.integration


def node(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.server", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": "/tmp",
            "AFFINITY_CLUSTER_SECRET": FLEET_SECRET,
            **(env or {}),
        },
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
        (["--redis", "127.0.0.1:1"], "--redis"),
        (["--redis", "redis://127.0.0.1:99999/0"], "--redis"),
        (["--capacity", "0"], "--capacity"),
        (["--weight", "0"], "--weight"),
        (["--weight", "5000"], "--weight"),
        (["--node-id", "a/b"], "--node-id"),
        (["--log-level", "loud"], "--log-level"),
        (["--act-deadline", "0"], "--act-deadline"),
        (["--keep-alive", "-1"], "--keep-alive"),
        (["--batch-delay", "-1"], "--batch-delay -1.0: must be 0-60000000"),
        (["--batch-delay", "nan"], "--batch-delay nan"),
        (["--cooldown", "-1"], "--cooldown -1.0"),
        (["--ensemble-decay", "-1"], "--ensemble-decay -1.0"),
        (["--ensemble", "fancy"], "--ensemble 'fancy': must be one of none, exp"),
        (["--lease-ttl", "0.0001"], "--lease-ttl 0.0001: must be more than 0.001 seconds"),
        (["--episode-ttl", "0.0001"], "--episode-ttl 0.0001"),
        (["--advertise-url", "ftp://x"], "--advertise-url 'ftp://x'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv: list[str], words: str) -> None:
    out = node(*argv, "--port", str(free_port()))
    assert_one_line(out, words)
    assert_no_field_named(out.stderr)


@pytest.mark.parametrize(
    ("var", "value"),
    [("AFFINITY_REDIS_DEADLINE", "0"), ("AFFINITY_EVENTS_MAXLEN", "0"),
     ("AFFINITY_REDIS_MAX_CONNECTIONS", "0"), ("AFFINITY_REDIS_RETRIES", "-1")],
)  # fmt: skip
def test_a_bad_setting_from_the_environment_names_its_variable(var: str, value: str) -> None:
    out = node("--port", str(free_port()), env={var: value})
    assert_one_line(out, f"affinity-node: {var}=")
    assert_no_field_named(out.stderr)


def test_a_chunk_setting_the_model_cannot_take_names_the_flag() -> None:
    out = node("--devices", "cpu:1", "--port", str(free_port()), "--execute-steps", "5")
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("affinity-node: --execute-steps 5: must be an integer from 1"), last
    assert_no_field_named(last)


def assert_no_field_named(text: str) -> None:
    """No name of the code's (``lease_ttl_s``, ``max_batch=0``) in what the node printed."""
    assert not re.search(r"\b[a-z]+_[a-z_]+\b|\b[a-z_]+=", text), text


def assert_one_line(out: subprocess.CompletedProcess[str], words: str, code: int = 2) -> None:
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("affinity-node") and words in lines[0], (
        out.stderr
    )


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_a_port_out_of_range_is_a_usage_error(port: str) -> None:
    assert_one_line(node("--port", port), "--port")


def test_a_redis_url_from_the_environment_is_checked_too() -> None:
    out = node("--port", str(free_port()), env={"AFFINITY_REDIS_URL": "localhost:6379"})
    assert_one_line(out, "AFFINITY_REDIS_URL")


@pytest.mark.parametrize("fronts", [[], ["--front-doors", "2"]], ids=["one", "fronts"])
@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "reuseport"])
def test_a_port_in_use_exits_6_before_the_node_registers(
    fronts: list[str], reuse_port: bool
) -> None:
    """Also with fronts, whose sockets share the port (SO_REUSEPORT): a listener already
    there, even one that allows sharing, is refused, never joined."""
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    try:
        with socket.socket() as taken:
            if reuse_port:
                taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            out = node("--redis", server.url, "--devices", "cpu:1", "--port", str(port),
                       "--node-id", "busy", *fronts)  # fmt: skip
        assert_one_line(out, f"cannot listen on 127.0.0.1:{port}", code=6)
        # it never registered, nor advertised itself (the fleet marker is the test server's)
        assert server.client().keys("*") == [Keys().fleet]
    finally:
        server.stop()


def test_a_duplicate_node_id_says_once_how_long_it_waits_then_the_result() -> None:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    first = Node(tmp, "twin", server.url, devices="cpu:1", extra=["--lease-ttl", "1"]).start()
    try:
        out = node("--redis", server.url, "--devices", "cpu:1", "--port", str(free_port()),
                   "--node-id", "twin", "--lease-ttl", "1")  # fmt: skip
        assert out.returncode == 4, out.stderr
        waiting = [line for line in out.stderr.splitlines() if "waiting" in line]
        assert len(waiting) == 1 and "up to 3s" in waiting[0], out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith("affinity-node: node id 'twin'")
    finally:
        first.stop()
        server.stop()


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
