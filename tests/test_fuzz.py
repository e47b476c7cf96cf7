"""HTTP fuzzing of a real node process: schemathesis over the node's OpenAPI schema (every
endpoint, bounded), then hand-made hostile bodies. No 5xx, no crash, and the node still
healthy and serving afterwards, with no model failure counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from tests.procs import Node, RedisServer

pytestmark = pytest.mark.integration

ADMIN = "fuzz-admin"


@pytest.fixture(scope="module")
def fuzz_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    redis = RedisServer(tmp).start()
    node = Node(
        tmp,
        "fz",
        redis.url,
        devices="cpu:2",
        env={"AFFINITY_ADMIN_TOKEN": ADMIN, "AFFINITY_CLUSTER_SECRET": "s"},
        extra=["--capacity", "100000", "--max-body-bytes", "65536"],
    )
    try:
        node.start()
        yield node
    finally:
        node.stop()
        redis.stop()


def test_schema_fuzz_no_server_error(fuzz_node: Node) -> None:
    """Every operation of the node's OpenAPI schema, 250 generated cases each."""
    schema = schemathesis.openapi.from_url(fuzz_node.url + "/openapi.json")
    # /events/stream never ends by design (server-sent events); tests/test_ui.py covers it
    operations = [
        op for op in (r.ok() for r in schema.get_all_operations()) if op.path != "/events/stream"
    ]
    assert {op.path for op in operations} >= {"/act", "/episodes/{episode_id}", "/devices"}
    seen = []
    for op in operations:
        auth = {"Authorization": f"Bearer {ADMIN}"} if "drain" in op.path else None

        @given(case=op.as_strategy())
        @settings(
            max_examples=250,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            # run() is called right below, inside this iteration
            response = case.call(headers=auth, timeout=10)  # noqa: B023
            seen.append(response.status_code)
            case.validate_response(response, checks=[checks.not_a_server_error])

        run()
    assert len(seen) > 1000 and max(seen) < 500


HOSTILE: list[bytes] = [
    b"",
    b"null",
    b"[]",
    b'"str"',
    b"{",
    b"{}",
    b"\xff\xfe\xfd",
    b"[" * 50_000 + b"]" * 50_000,
    b'{"inputs": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b"}",
    b'{"episode_id": "e", "inputs": {"obs": [[' + b"9" * 5000 + b",1,1,1,1,1,1,1]]}}",
    b'{"episode_id": "e", "inputs": {"obs": [[1e308, 1e309, 1, 1, 1, 1, 1, 1]]}}',
    b'{"episode_id": "e", "inputs": {"obs": [[-0.0, 1, 1, 1, 1, 1, 1, Infinity]]}}',
    json.dumps({"episode_id": "\u0000\u0007\u001b[31m", "inputs": {"obs": [[1] * 8]}}).encode(),
    json.dumps({"episode_id": "🤖" * 200, "inputs": {"obs": [[1] * 8]}}).encode(),
    json.dumps({"episode_id": "\ud83e", "inputs": {"obs": [[1] * 8]}}).encode(),
    json.dumps({"session_id": ["x"], "inputs": {"obs": [[1] * 8]}}).encode(),
    json.dumps({"episode_id": "e", "inputs": {"obs": [[1] * 8]}, "end": "yes"}).encode(),
    json.dumps({"episode_id": "e", "inputs": {"obs": [[1] * 8]}, "token": -1}).encode(),
    json.dumps({"episode_id": "e", "inputs": {"obs": [[1] * 8]}, "token": 10**30}).encode(),
    json.dumps({"episode_id": "e", "inputs": {"obs": [[True] * 8]}}).encode(),
    json.dumps({"episode_id": "e", "inputs": {"obs": {"a": 1}}}).encode(),
    b'{"episode_id": "e", "inputs": {"obs": [[1,1,1,1,1,1,1,1]]}, "inputs": 5}',
    b"x" * 70_000,
]


def _array(dtype: object, shape: object, data: object) -> dict[bytes, object]:
    return {b"__ndarray__": True, b"dtype": dtype, b"shape": shape, b"data": data}


HOSTILE_MSGPACK = [
    b"",
    b"\xc1",
    b"\x91" * 100_000,  # nesting past msgpack's stack
    b"\xdd\xff\xff\xff\xff",  # an array declared past the body
    b"\xc6\x7f\xff\xff\xff" + b"x" * 10,  # a bin declared past the body
    msgpack.packb({"episode_id": "e", "inputs": {"obs": _array("<f4", [1, 8], b"\0" * 31)}}),
    msgpack.packb({"episode_id": "e", "inputs": {"obs": _array("<f4", [2**40, 2**40], b"\0")}}),
    msgpack.packb({"episode_id": "e", "inputs": {"obs": _array("<f4", [1, -8], b"\0" * 32)}}),
    msgpack.packb({"episode_id": "e", "inputs": {"obs": _array("|O", [1, 8], b"\0" * 64)}}),
    msgpack.packb({"episode_id": "e", "inputs": {"obs": _array("<c8", [1, 8], b"\0" * 64)}}),
    msgpack.packb({"episode_id": "e", "inputs": {"obs": _array("<f8", [1, 8], b"\0" * 64)}})[:-5],
    msgpack.packb({"episode_id": "e", "inputs": {"obs": _array("<f4", [1, 7], b"\0" * 28)}}),
    msgpack.packb({"episode_id": "e", "inputs": {"obs": "x"}}),
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"episode_id": 5, "inputs": {}}),
]


def test_hostile_bodies_then_still_serving(fuzz_node: Node) -> None:
    url = fuzz_node.url
    with httpx.Client(timeout=10) as c:
        for body in HOSTILE:
            for path in ("/act", "/internal/act"):
                r = c.post(url + path, content=body, headers={"content-type": "application/json"})
                assert 400 <= r.status_code < 500, (path, body[:60], r.status_code, r.text)
                assert "error" in r.json()
        for body in HOSTILE_MSGPACK:
            for path in ("/act", "/internal/act"):
                r = c.post(
                    url + path, content=body, headers={"content-type": "application/msgpack"}
                )
                assert 400 <= r.status_code < 500, (path, body[:60], r.status_code, r.text)
                assert "error" in r.json()
        for weird in ("%00", "a%2Fb", "%F0%9F%A4%96" * 100, "x" * 600):
            assert c.get(f"{url}/episodes/{weird}").status_code in (404, 422)
        assert c.get(url + "/healthz").status_code == 200
        assert c.get(url + "/readyz").status_code == 200
        r = c.post(url + "/act", json={"episode_id": "after", "inputs": {"obs": [[0.5] * 8]}})
        assert r.status_code == 200 and r.json()["routing"] == "claimed"
        metrics = c.get(url + "/metrics").text
    failures = [
        line
        for line in metrics.splitlines()
        if line.startswith("affinity_model_failures_total{") and not line.endswith(" 0.0")
    ]
    assert failures == []
    assert fuzz_node.proc.popen is not None and fuzz_node.proc.popen.poll() is None
