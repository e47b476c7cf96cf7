"""KServe v2 HTTP infer through a node with ``--front-doors 2`` (issue 43), real processes:
the body is decoded and the reply encoded in the fronts, the step crosses the shared-memory
hop to the node's process (the core), which no longer parses it. The unmodified
``tritonclient.http`` keeps its sequences sticky; every answer, errors included, is
byte for byte what a node of one process says; a front killed mid-step costs only its
connection (a retry with ``seq`` gets the kept reply), and a client that left mid-step has
its step undone: never applied twice."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from node.models import DEMO_MODEL
from tests.models import counter_policy
from tests.procs import Node, RedisServer, held_mid_step, on_the_hop, wait_until
from tests.rollout import reference_rollout
from tests.test_fronts_procs import embedded, fronts
from tests.test_kserve import HOSTILE, INFER, MODEL, obs_input, observations, request_body

pytestmark = pytest.mark.integration


class Pair:
    """A node of two fronts and a node of one process, each alone in its own fleet."""

    def __init__(self, fronted: Node, single: Node) -> None:
        self.fronted = fronted
        self.single = single


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp: Path = tmp_path_factory.mktemp("fronts-kserve")
    for k in range(2):
        (tmp / f"r{k}").mkdir()
        (tmp / f"n{k}").mkdir()
    redis = [RedisServer(tmp / f"r{k}").start() for k in range(2)]
    fronted = Node(tmp / "n0", "kf", redis[0].url, devices="cpu:1", extra=["--front-doors", "2"])
    single = Node(tmp / "n1", "ks", redis[1].url, devices="cpu:1")
    try:
        fronted.start(timeout=60)
        single.start(timeout=60)
        wait_until(lambda: len(fronts(fronted)) == 2, 30, "two fronts")
        yield Pair(fronted, single)
    finally:
        fronted.stop()
        single.stop()
        for r in redis:
            r.stop()


def triton(node: Node) -> th.InferenceServerClient:
    return th.InferenceServerClient(f"{node.host}:{node.port}", network_timeout=20)


def infer_lines(node: Node) -> list[str]:
    """The node's access lines for KServe infer requests (plain format: the peer first)."""
    return [
        line
        for line in node.proc.log_path.read_text(errors="replace").splitlines()
        if "affinity.access:" in line and '/infer"' in line
    ]


def test_sequences_stick_and_end_whichever_front_gets_each_step(pair: Pair) -> None:
    node = pair.fronted
    for n, sequence in enumerate((7, "seven")):
        obs = observations(200 + n, 12)
        ref = reference_rollout(DEMO_MODEL, obs)
        facts = []
        for i, o in enumerate(obs):
            client = triton(node)  # a new connection a step: either front takes it
            try:
                binary = i % 2 == 0
                outputs = [th.InferRequestedOutput("actions", binary_data=i % 3 == 0)]
                version = "1" if i % 4 == 1 else ""
                res = client.infer(
                    MODEL,
                    [obs_input(o, binary=binary)],
                    sequence_id=sequence,
                    sequence_start=i == 0,
                    outputs=outputs,
                    model_version=version,
                )
            finally:
                client.close()
            np.testing.assert_allclose(
                res.as_numpy("actions"), ref[i]["actions"], rtol=1e-4, atol=1e-6
            )
            facts.append(res.get_response()["parameters"])
        episode = "kserve:i:7" if sequence == 7 else "kserve:s:seven"
        assert {f["episode_id"] for f in facts} == {episode}
        assert len({f["device"] for f in facts}) == 1
        assert [f["routing"] for f in facts] == ["claimed"] + ["hit"] * 11
        assert not any(f["state_reset"] for f in facts)
        client = triton(node)
        try:
            client.infer(MODEL, [obs_input(obs[0])], sequence_id=sequence, sequence_end=True)
            with pytest.raises(InferenceServerException, match="START flag") as err:
                client.infer(MODEL, [obs_input(obs[0])], sequence_id=sequence)
            assert err.value.status() == "400"
        finally:
            client.close()
    # every one of them was served by a front: the core's own door (its access lines come
    # from its Unix socket, peer "-") never saw an infer body
    wait_until(lambda: len(infer_lines(node)) >= 2 * 14, 10, "the access lines")  # batched
    lines = infer_lines(node)
    assert not [li for li in lines if 'affinity.access: - "' in li], lines[:3]
    assert all(re.search(r'affinity.access: 127\.0\.0\.1:\d+ "POST', li) for li in lines)


def answers(node: Node, cases: list[tuple[str, bytes, dict[str, str]]]) -> list[Any]:
    out = []
    with httpx.Client(timeout=20) as http:
        for path, body, headers in cases:
            r = http.post(node.url + path, content=body, headers=headers)
            kept = {
                k: r.headers[k]
                for k in ("content-type", "retry-after", "inference-header-content-length")
                if k in r.headers
            }
            out.append((r.status_code, kept, r.content))
    return out


def test_errors_and_replies_are_those_of_one_process(pair: Pair) -> None:
    good = observations(300, 1)[0]
    body, headers = request_body(good)
    plain, _ = request_body(good, binary=False)
    short, short_headers = request_body(good[:, :4])

    def case(
        path: str, b: bytes, h: dict[str, str] | None = None
    ) -> tuple[str, bytes, dict[str, str]]:
        return path, b, h or {}

    rows = {
        "inputs": [
            {
                "name": "obs",
                "shape": [2, 8],
                "datatype": "FP32",
                "data": np.zeros((2, 8)).reshape(-1).tolist(),
            }
        ],
        "parameters": {"episode_ids": json.dumps(["r-1", 0]), "sequence_start": True},
    }
    cases = [
        case("/v2/models/other/infer", body, headers),  # unknown model (before the body)
        case("/v2/models/other/infer", b"{nope"),  # unknown model, bad body: still 404
        case(f"/v2/models/{MODEL}/versions/3/infer", body, headers),  # unknown version
        case(INFER, short, short_headers),  # bad shape
        case(INFER, *request_body(good, sequence_id=123)),  # a sequence that is not live
        case(INFER, orjson.dumps({"inputs": [], "outputs": [{"name": "no"}]})),
        case(
            INFER,
            orjson.dumps({"inputs": orjson.loads(plain)["inputs"], "outputs": [{"name": "no"}]}),
        ),
        case(INFER, *request_body(good, parameters={"seq": 10**30})),  # past 64 bits
        case(INFER, orjson.dumps(rows)),  # a request of rows: one bad episode id (0)
        case(INFER, orjson.dumps({**rows, "parameters": {"episode_ids": "[1, 1]"}})),
        case(INFER, b"x" * 10, {"content-encoding": "br"}),
        *(
            case(INFER, b, {} if n is None else {"Inference-Header-Content-Length": n})
            for b, n, _ in HOSTILE.values()
        ),
    ]
    before = {n: rejected(n) for n in (pair.fronted, pair.single)}
    fronted, single = answers(pair.fronted, cases), answers(pair.single, cases)
    for (path, sent, _), a, b in zip(cases, fronted, single, strict=True):
        assert a == b, (path, sent[:120], a, b)
    # and counted alike: a refusal the front found is counted by the core
    counted = {n: counter_delta(before[n], rejected(n)) for n in (pair.fronted, pair.single)}
    assert counted[pair.fronted] == counted[pair.single] != {}, counted
    assert [a[0] for a in fronted[:5]] == [404, 404, 404, 400, 400]
    # a stateless step and a request of rows: the same outputs and parameters, less the
    # node's own names (device, node, url) and times
    stateless = [
        case(INFER, body, headers),
        case(INFER, plain),
        case(INFER, gzip.compress(body), {**headers, "content-encoding": "gzip"}),
        case(INFER, body, {**headers, "x-affinity-timing": "1"}),  # the split of its time
        case(
            INFER,
            orjson.dumps(
                {**orjson.loads(plain), "id": "r7", "parameters": {"binary_data_output": True}}
            ),
        ),
    ]
    good_rows = {
        **rows,
        "parameters": {"episode_ids": json.dumps(["r-a", "r-b"]), "sequence_start": True},
    }
    stateless.append(case(INFER, orjson.dumps(good_rows)))
    for (s1, h1, b1), (s2, h2, b2) in zip(
        answers(pair.fronted, stateless), answers(pair.single, stateless), strict=True
    ):
        # the JSON header's length follows its node's own names and times: not compared
        # (parsed() reads each reply by its own)
        length = "inference-header-content-length"
        assert s1 == s2 == 200 and h1.keys() == h2.keys(), (h1, h2)
        assert {k: v for k, v in h1.items() if k != length} == {
            k: v for k, v in h2.items() if k != length
        }, (h1, h2)
        r1, r2 = parsed(b1, h1), parsed(b2, h2)
        np.testing.assert_allclose(r1.as_numpy("actions"), r2.as_numpy("actions"), rtol=1e-6)
        p1, p2 = r1.get_response()["parameters"], r2.get_response()["parameters"]
        assert set(p1) == set(p2), (p1, p2)
        assert r1.get_response().get("id") == r2.get_response().get("id")
        if "rows" in p1:
            assert [sorted(r) for r in json.loads(p1["rows"])] == [
                sorted(r) for r in json.loads(p2["rows"])
            ]


def rejected(node: Node) -> dict[str, float]:
    """``affinity_rejected_requests_total`` by reason, from the node's ``/metrics``."""
    text = httpx.get(node.url + "/metrics", timeout=10).text
    prefix = "affinity_rejected_requests_total{"
    return {
        line.split("}")[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def parsed(content: bytes, headers: dict[str, str]) -> th.InferResult:
    length = headers.get("inference-header-content-length")
    return th.InferenceServerClient.parse_response_body(
        content, header_length=None if length is None else int(length)
    )


def count(res: th.InferResult) -> int:
    return int(res.as_numpy("count").reshape(-1)[0])


def test_a_front_killed_mid_step_costs_its_connection_only(tmp_path: Path) -> None:
    """The front holding a tritonclient's connection is killed while the core runs the
    step (a slow model): the client's retry with the same ``seq`` parameter, through
    another front, gets the kept reply; the step counted once. Then a client that gives up
    mid-step (its front alive) has its step undone: the next step counts as if it never
    came, never twice."""
    node = embedded(tmp_path, "kk", model=counter_policy(tmp_path, repeats=400, width=512))
    node.start(timeout=60)
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
        zeros = np.zeros((1, 8), np.float32)
        (model,) = [m["name"] for m in httpx.get(node.url + "/v2/models").json()["models"]]

        def step(seq: int | None, timeout: float = 60, **kw: Any) -> th.InferResult:
            client = th.InferenceServerClient(f"{node.host}:{node.port}", network_timeout=timeout)
            try:
                params = {} if seq is None else {"seq": seq}
                return client.infer(
                    model, [obs_input(zeros)], sequence_id="slow", parameters=params, **kw
                )
            finally:
                client.close()

        assert count(step(1, sequence_start=True)) == 1
        lost: list[BaseException] = []

        def second() -> None:
            try:
                step(2)
            except Exception as exc:  # the connection went with its front
                lost.append(exc)

        sender = threading.Thread(target=second)
        sender.start()
        with held_mid_step(lambda: fronts(node), node.port, node.pid()) as holder:
            assert sender.is_alive(), "the step was answered before its front could be killed"
            os.kill(holder, signal.SIGKILL)  # the core paused: the step still runs
        sender.join(60)
        assert lost, "the client should have lost its connection with its front"
        for _ in range(100):
            try:
                retry = step(2)
                break
            except InferenceServerException as exc:  # still running: busy
                assert exc.status() == "503", exc
                time.sleep(0.1)
        got = retry.get_response()["parameters"]
        assert got["replayed"] and count(retry) == 2 and not got["state_reset"], got
        assert count(step(3)) == 3
        # a client that leaves mid-step, its front alive: the step is undone
        left: list[BaseException] = []

        def leaver() -> None:
            try:
                step(None, timeout=0.5)
            except Exception as exc:  # tritonclient's timeout, whatever its type
                left.append(exc)

        sender = threading.Thread(target=leaver)
        sender.start()
        with held_mid_step(lambda: fronts(node), node.port, node.pid()):
            sender.join(60)  # the client's timeout, while the core runs its step
        assert left, "the client should have given up mid-step"
        wait_until(
            lambda: any('/infer" 499' in li for li in infer_lines(node)),
            60,
            "the front saw its client gone, and told the core",
        )
        # the core answers the front's word once it has undone the step: the slot frees
        wait_until(lambda: not any(on_the_hop(f) for f in fronts(node)), 60, "the undo")
        fourth = step(None)
        assert count(fourth) == 4 and not fourth.get_response()["parameters"]["state_reset"]
    finally:
        node.stop()
