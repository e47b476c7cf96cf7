"""Access control with a real redis-server: a password, an ACL user restricted to the
namespace's keys and the commands affinity uses, and TLS (rediss://) with a self-signed
certificate. A real node and the CLI run against each."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from affinity.keys import Keys
from tests.procs import Node, RedisServer, free_port, wait_until

pytestmark = pytest.mark.integration

# Every command affinity sends, directly or from its Lua scripts (ACL applies to both).
ACL_COMMANDS = (
    "+ping +hello +auth +time "
    "+evalsha +wait +script|load "  # (+wait: with --redis-replicas)
    "+get +set +incr +del +exists +pexpireat +pttl +info "  # (+info: run_id)
    "+hget +hmget +hset +hdel +hgetall +hexists "
    "+sadd +srem +smembers "
    "+zadd +zrem +zscore +zcount +zrange +zrangebyscore +zremrangebyscore +zcard "
    "+xadd +xrange +xrevrange +xread"
)
ACL_LINE = f"ACL SETUSER affinity on >node-pw resetkeys ~{{affinity}}:* -@all {ACL_COMMANDS}"


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "affinity.cli", "--redis", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def exercise(node: Node, url: str) -> None:
    """Claim, hit, end; then the CLI lists and shows through the same credentials."""
    with httpx.Client(timeout=10) as c:
        for _ in range(2):
            r = c.post(
                node.url + "/act", json={"episode_id": "ep-acl", "inputs": {"obs": [[0] * 8]}}
            )
            assert r.status_code == 200, r.text
        assert r.json()["routing"] == "hit"
    devices = cli(url, "devices", "--json")
    assert devices.returncode == 0, devices.stderr
    assert {d["device"] for d in json.loads(devices.stdout)} == {f"{node.node_id}/0"}
    shown = cli(url, "show", "ep-acl")
    assert shown.returncode == 0 and f"{node.node_id}/0" in shown.stdout
    events = cli(url, "events", "--count", "5", "--json")
    assert events.returncode == 0 and '"claim"' in events.stdout
    assert cli(url, "release", "ep-acl").returncode == 0


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[int]:
    server = RedisServer(tmp_path, extra=["--requirepass", "admin-pw"])
    server.proc.start()  # RedisServer.start() would ping without the password
    admin = redis.Redis(port=server.port, password="admin-pw", decode_responses=True)
    try:
        wait_until(admin.ping, 10, "redis with a password")
        admin.execute_command(*ACL_LINE.split())
        admin.set(Keys().fleet, "0")  # a new fleet (as RedisServer.start() marks one)
        yield server.port
    finally:
        server.stop()


def test_node_and_cli_with_a_namespace_restricted_acl_user(acl_redis: int, tmp_path: Path) -> None:
    url = f"redis://affinity:node-pw@127.0.0.1:{acl_redis}/0"
    limited = redis.Redis.from_url(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        limited.get("someone-else:key")
    with pytest.raises(redis.exceptions.NoPermissionError):
        limited.flushall()
    node = Node(tmp_path, "acl", url, devices="cpu:1")
    try:
        node.start()
        exercise(node, url)
    finally:
        node.stop()


def test_node_and_cli_with_a_password(acl_redis: int, tmp_path: Path) -> None:
    url = f"redis://:admin-pw@127.0.0.1:{acl_redis}/0"
    node = Node(tmp_path, "pw", url, devices="cpu:1")
    try:
        node.start()
        exercise(node, url)
        wrong = cli(f"redis://:nope@127.0.0.1:{acl_redis}/0", "devices")
        assert wrong.returncode == 3 and "nope" not in wrong.stderr
    finally:
        node.stop()


def test_node_and_cli_over_tls(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificate", pytrace=False)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    server = RedisServer(
        tmp_path,
        extra=[
            "--port",
            "0",  # TLS only: the plain-text port RedisServer chose is turned off
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
        ],
    )
    server.proc.start()
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
    node = Node(tmp_path, "tls", url, devices="cpu:1")
    try:
        wait_until(redis.Redis.from_url(url).ping, 10, "redis over TLS")
        redis.Redis.from_url(url).set(Keys().fleet, "0")  # a new fleet
        with pytest.raises(redis.exceptions.ConnectionError):
            redis.Redis(port=port, socket_timeout=2).ping()  # plain text is refused
        node.start()
        exercise(node, url)
    finally:
        node.stop()
        server.stop()


def test_docs_document_the_tested_acl_line() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    assert ACL_LINE in doc
