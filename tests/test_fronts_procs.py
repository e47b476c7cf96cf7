"""A node with ``--front-doors 2`` (issue 43's first slice), real processes: two fronts accept
on the node's port, ``/act`` (and openpi's websocket: ``tests/test_fronts_openpi_procs.py``)
crosses the shared-memory hop to the node's process, every other path is passed on to it.
Steps stay sticky and exactly-once whichever front gets them; a front killed mid-load costs
its connections only (a retry with ``seq`` gets its kept reply, the front comes back); a
node killed with ``kill -9`` leaves no process, and the next one binds the same port at
once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from affinity import Keys, wire
from node import inputs
from node.contract import load_contract
from node.errors import InvalidInput
from node.hop import DELIVERING, FREE
from node.models import DEMO_MODEL
from tests.models import counter_policy
from tests.procs import (
    ROOT,
    Node,
    RedisServer,
    alive,
    connections,
    deaf,
    free_port,
    handing_over,
    held_mid_step,
    hop_states,
    hop_tickets,
    metrics,
    on_the_hop,
    pause,
    queued,
    slow_link,
    stopped,
    wait_until,
)
from tests.rollout import reference_rollout

pytestmark = [
    pytest.mark.integration,
    # openpi-client connects without a context manager (websockets 17.1 deprecated that)
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]

ADMIN = "fronts-admin"
CONTRACT = load_contract(DEMO_MODEL)


def fronts(node: Node) -> list[int]:
    """The node's live fronts (a killed one not yet reaped is a zombie: not counted; its
    device worker processes, in a shape with them, are not fronts)."""
    assert node.proc.popen is not None
    return node.fronts()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp: Path = tmp_path_factory.mktemp("fronts")
    redis = RedisServer(tmp).start()
    # --keep-alive: a robot waiting at a gate (below) keeps its connection however long
    n = Node(tmp, "f", redis.url, devices="cpu:1", env={"AFFINITY_ADMIN_TOKEN": ADMIN},
             extra=["--front-doors", "2", "--capacity", "1000", "--keep-alive", "300"])  # fmt: skip
    try:
        n.start(timeout=60)
        wait_until(lambda: len(fronts(n)) == 2, 30, "two fronts")
        yield n
    finally:
        n.stop()
        redis.stop()


def observations(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def count(reply: dict[str, Any]) -> int:
    return int(np.asarray(reply["outputs"]["count"]).reshape(-1)[0])


def expect(history: list[np.ndarray], actions: Any) -> None:
    want = reference_rollout(DEMO_MODEL, history)[-1]["actions"]
    np.testing.assert_allclose(np.asarray(actions).reshape(want.shape), want, rtol=1e-5)


def post(url: str, body: dict[str, Any], binary: bool, timeout: float = 20) -> httpx.Response:
    """One step on a new connection (so either front may take it)."""
    if binary:
        headers = {"content-type": "application/msgpack", "accept": "application/msgpack"}
        return httpx.post(url + "/act", content=wire.encode(body), headers=headers,
                          timeout=timeout)  # fmt: skip
    return httpx.post(url + "/act", json=body, timeout=timeout)


def read(r: httpx.Response) -> Any:
    if r.headers["content-type"].startswith("application/msgpack"):
        return wire.decode(r.content)
    return r.json()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_steps_are_sticky_and_exactly_once_whichever_front_gets_them(
    node: Node, binary: bool
) -> None:
    episode = f"sticky-{binary}"
    sent = observations(1 + binary, 12)
    devices = set()
    for i, x in enumerate(sent, start=1):
        obs: Any = x if binary else x.tolist()
        body = {"episode_id": episode, "inputs": {"obs": obs}, "seq": i}
        r = post(node.url, body, binary)
        assert r.status_code == 200, r.text
        got = read(r)
        assert got["seq"] == i and not got["replayed"]
        assert r.headers["x-affinity-seq"] == str(i)
        expect(sent[:i], got["outputs"]["actions"])
        devices.add(got["device"])
        if i % 3 == 0:  # the same step again: the kept reply, not a second application
            again = read(post(node.url, body, binary))
            assert again["replayed"] and again["seq"] == i
            np.testing.assert_array_equal(
                np.asarray(again["outputs"]["actions"]), np.asarray(got["outputs"]["actions"])
            )
    assert len(devices) == 1


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_rows_and_refusals_answer_as_the_single_process(node: Node, binary: bool) -> None:
    xs = observations(7, 3)
    rows = [{"episode_id": f"rows-{binary}-{i}", "inputs": {"obs": x if binary else x.tolist()}}
            for i, x in enumerate(xs)]  # fmt: skip
    rows.append({"episode_id": f"rows-{binary}-bad", "inputs": {"obs": [[1, 2]]}})
    rows.append([1])  # type: ignore[arg-type]
    r = post(node.url, {"steps": rows}, binary)
    assert r.status_code == 200, r.text
    got = read(r)["steps"]
    for x, row in zip(xs, got, strict=False):
        expect([x], row["outputs"]["actions"])
    assert got[3]["error"]["status"] == 422 and got[3]["error"]["code"] == "bad_input"
    assert got[4]["error"]["code"] == "malformed"
    bad = post(node.url, {"episode_id": "x", "inputs": {"obs": [[1, 2]]}}, binary)
    assert bad.status_code == 422 and read(bad)["error"]["field"]
    mixed = post(node.url, {"episode_id": "x", "inputs": {"obs": [[True] + [0.5] * 7]}}, binary)
    assert mixed.status_code == 422 and read(mixed)["error"]["code"] == "bad_input", mixed.text
    typo = post(node.url, {"episodeId": "x", "inputs": {}}, binary)
    assert typo.status_code == 422 and "episodeId" in typo.text
    broken = httpx.post(node.url + "/act", content=b"{nope", timeout=10)
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "malformed"
    many = post(node.url, {"steps": [{}] * 300}, binary)
    assert many.status_code == 413 and read(many)["error"]["code"] == "too_many_rows"
    # numbers past float32: JSON lists the front made arrays of are refused in the words of
    # one process (which reads the lists), a step and a row alike
    far = [[1e39] * 8] if not binary else np.full((1, 8), 1e39)
    try:
        inputs.from_arrays(CONTRACT, {"obs": far}) if binary else inputs.from_json(
            CONTRACT, {"obs": far}
        )
        raise AssertionError("numbers past float32 taken")
    except InvalidInput as exc:
        said = str(exc)  # what a node of one process answers
    step = post(node.url, {"episode_id": "far", "inputs": {"obs": far}}, binary)
    assert step.status_code == 422 and read(step)["error"]["message"] == said, step.text
    row = post(node.url, {"steps": [{"episode_id": "far", "inputs": {"obs": far}}]}, binary)
    assert read(row)["steps"][0]["error"]["message"] == said, row.text


def test_every_other_path_reaches_the_nodes_process(node: Node) -> None:
    # KServe v2 over HTTP (passed on as bytes)
    x = observations(3, 1)[0]
    infer = {"inputs": [{"name": "obs", "shape": [1, 8], "datatype": "FP32",
                         "data": x.reshape(-1).tolist()}]}  # fmt: skip
    r = httpx.post(node.url + "/v2/models/demo_policy/infer", json=infer, timeout=20)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["name"] == "actions"
    assert httpx.get(node.url + "/v2/health/ready", timeout=10).status_code == 200
    # an admin call
    assert httpx.get(node.url + "/devices", timeout=10).status_code == 200
    device = "f/0"
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.post(f"{node.url}/devices/{device}/drain", headers=auth, timeout=10).is_success
    assert httpx.post(f"{node.url}/devices/{device}/undrain", headers=auth, timeout=10).is_success
    refused = httpx.post(f"{node.url}/devices/{device}/drain", timeout=10)
    assert refused.status_code in (401, 403)
    # an openpi episode with the unmodified client (decoded in a front: test_fronts_openpi_procs)
    policy = WebsocketClientPolicy(host=node.host, port=node.port)
    assert policy.get_server_metadata()["affinity"]["policy"]["inputs"]
    sent = observations(4, 3)
    replies = [policy.infer({"obs": o.reshape(8)}) for o in sent]
    policy._ws.close()
    for i, reply in enumerate(replies, start=1):
        expect(sent[:i], reply["actions"])
    # the event loop lag of both fronts and of the core, in the node's /metrics
    text = httpx.get(node.url + "/metrics", timeout=10).text
    for front in ("0", "1", "core"):
        name = f'affinity_event_loop_lag_seconds_count{{front="{front}"}}'
        line = next(li for li in text.splitlines() if li.startswith(name))
        assert float(line.split()[-1]) > 0, line


def test_a_path_no_url_may_hold_is_refused_as_by_one_process(node: Node) -> None:
    """A path passed on to the core is passed as the client sent it (percent-encoded): a
    NUL, or bytes that are not UTF-8, are the core's to judge as a node of one process
    does (a 4xx), where decoding them first made a URL the front could not send (a 500)."""
    with httpx.Client(timeout=10) as c:
        for weird in ("%00", "a%2Fb", "%F0%9F%A4%96" * 100, "x" * 600, "%C3%A7%F3%87%8F"):
            r = c.get(f"{node.url}/episodes/{weird}")
            assert r.status_code in (404, 422), (weird, r.status_code, r.text)
        r = c.post(f"{node.url}/episodes/%C3%A7%F3%87%8F%A9%00/end", json={})
        assert 400 <= r.status_code < 500, r.text


def test_a_front_killed_mid_load_loses_no_step_and_comes_back(node: Node) -> None:
    sent = {k: observations(100 + k, 30) for k in range(4)}
    failures: list[str] = []
    retried = [0]
    gate, at_gate = threading.Event(), threading.Semaphore(0)
    GATE = 10  # each robot's step at which it waits, its connection kept, for the pause

    def robot(k: int) -> None:
        try:
            steps(k)
        finally:  # a robot that failed before its gate still lets the test on
            at_gate.release()

    def steps(k: int) -> None:
        episode = f"killed-{k}"
        with httpx.Client(timeout=20) as client:  # keep-alive: one front holds it
            for i, x in enumerate(sent[k], start=1):
                if i == GATE:
                    at_gate.release()
                    gate.wait(60)
                body = {"episode_id": episode, "inputs": {"obs": x.tolist()}, "seq": i}
                for _ in range(50):
                    try:
                        r = client.post(node.url + "/act", json=body)
                    except httpx.TransportError:
                        retried[0] += 1
                        time.sleep(0.05)
                        continue
                    if r.status_code == 503:
                        time.sleep(0.05)
                        continue
                    break
                else:
                    failures.append(f"{episode} step {i} never served")
                    return
                if r.status_code != 200:
                    failures.append(f"{episode} step {i}: {r.status_code} {r.text}")
                    return
                got = r.json()
                try:
                    expect(sent[k][:i], got["outputs"]["actions"])
                except AssertionError as exc:
                    failures.append(f"{episode} step {i}: {exc}")
                    return

    before = fronts(node)
    threads = [threading.Thread(target=robot, args=(k,)) for k in range(len(sent))]
    for t in threads:
        t.start()
    for _ in threads:  # every robot is mid-episode, holding its connection
        assert at_gate.acquire(timeout=60), "a robot never reached its gate"
    assert not failures, failures  # (each robot releases again as it ends: after the gate)
    victim = max(before, key=lambda pid: connections(pid, node.port))  # it holds robots
    assert connections(victim, node.port) > 0
    held = connections(victim, node.port)
    pause(victim)  # its robots' next steps wait in it...
    gate.set()
    wait_until(lambda: queued(victim, node.port) == held, 60, "its robots' steps sent to it")
    os.kill(victim, signal.SIGKILL)  # ...and their connections go: they retry with seq
    for t in threads:
        t.join(120)
    assert not failures, failures
    assert retried[0] > 0  # its robots saw their connection go, and retried with seq
    wait_until(lambda: len(fronts(node)) == 2 and victim not in fronts(node), 30,
               "the front restarted")  # fmt: skip
    text = httpx.get(node.url + "/metrics", timeout=10).text
    assert "affinity_front_restarts_total 1.0" in text


def cli_nodes(node: Node, *argv: str) -> Any:
    """``affinity nodes`` run as the operator runs it, against the node's Redis."""
    url = node.proc.argv[node.proc.argv.index("--redis") + 1]
    done = subprocess.run(
        [sys.executable, "-m", "affinity.cli", "--redis", url, "nodes", *argv],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if "--json" in argv else done.stdout


def published(node: Node) -> dict[str, Any]:
    """The node's processes as ``affinity nodes --json`` shows them: role -> process."""
    (listed,) = [n for n in cli_nodes(node, "--json") if n["node"] == node.node_id]
    assert listed["fronts"] == 2, listed
    return {p["role"]: p for p in listed["processes"]}


def but_workers(procs: dict[str, Any]) -> dict[str, Any]:
    """``procs`` without the device worker processes (``dev0``, ...: in a shape with them)."""
    return {role: p for role, p in procs.items() if not role.startswith("dev")}


def test_affinity_nodes_shows_the_core_and_its_fronts_and_a_restart(node: Node) -> None:
    """Issue 43: ``affinity nodes`` shows the processes of each node, their real pids; a
    front killed with ``kill -9`` and restarted shows with its new pid and its restart at
    the next renewal."""
    core = node.proc.popen.pid if node.proc.popen is not None else -1

    def current() -> bool:  # an earlier test of the module may have had a front restarted:
        procs = but_workers(published(node))  # its new pid is published at the next renewal
        return len(procs) == 3 and {procs["0"]["pid"], procs["1"]["pid"]} == set(fronts(node))

    wait_until(current, 30, "both live fronts published", interval=0.5)
    procs = published(node)
    assert procs["core"]["pid"] == core
    assert {procs["0"]["pid"], procs["1"]["pid"]} == set(fronts(node))  # its children (/proc)
    assert all(alive(p["pid"]) for p in procs.values())
    assert all(p["since_ms"] <= time.time() * 1000 for p in procs.values())
    assert procs["core"]["restarts"] == 0 and "lag_p99_ms" in procs["core"]  # it samples
    victim, before = procs["1"]["pid"], procs["1"]["restarts"]
    os.kill(victim, signal.SIGKILL)

    def restarted() -> bool:
        now = published(node).get("1")
        return now is not None and now["pid"] != victim and now["restarts"] == before + 1

    wait_until(restarted, 30, "front 1's restart published", interval=0.5)
    procs = published(node)
    assert procs["1"]["pid"] in fronts(node) and alive(procs["1"]["pid"])
    assert victim not in fronts(node)
    (listed,) = [x for x in cli_nodes(node, "--json") if x["node"] == node.node_id]
    helpers = {p["role"]: (p["pid"], p["restarts"]) for p in listed["helpers"]}
    assert list(helpers) == ["forksrv"] and helpers["forksrv"][0] == node.fork_server()
    total = sum(p["restarts"] for p in procs.values()) + helpers["forksrv"][1]
    rows = cli_nodes(node).splitlines()
    (row,) = [r for r in rows if r.startswith(f"{node.node_id} ")]
    assert "core+2 fronts" in row and f" {total} restart" in row, rows
    cells = [line.split() for line in cli_nodes(node, "--processes").splitlines()[1:]]
    mine = {c[1]: (int(c[2]), int(c[4])) for c in cells if c[0] == node.node_id}
    assert mine == {**{role: (p["pid"], p["restarts"]) for role, p in procs.items()},
                    **helpers}, cells  # fmt: skip


def test_the_fork_server_is_published_and_its_restart_too(tmp_path: Path) -> None:
    """The fronts' fork server is a process of the node: ``affinity nodes`` lists it apart
    (a helper, role ``forksrv``) with its real pid. Killed (``kill -9``), it takes its
    fronts with it; the first front's restart starts a new server, which is published
    with its new pid and one restart, the fronts beside it, and counted in the node's
    restarts."""
    redis = RedisServer(tmp_path).start()
    n = Node(tmp_path, "forks", redis.url, devices="cpu:1", extra=["--front-doors", "2"])
    try:
        n.start(timeout=60)

        def helpers() -> list[dict[str, Any]]:
            (listed,) = [x for x in cli_nodes(n, "--json") if x["node"] == n.node_id]
            return list(listed.get("helpers", []))

        def shown(pid: int | None, restarts: int) -> bool:
            listed = [(h["role"], h["pid"], h["restarts"]) for h in helpers()]
            procs = but_workers(published(n))
            return listed == [("forksrv", pid, restarts)] and {
                procs.get("0", {}).get("pid"),
                procs.get("1", {}).get("pid"),
            } == set(fronts(n))

        wait_until(lambda: len(fronts(n)) == 2, 30, "two fronts")
        server = n.fork_server()
        wait_until(lambda: shown(server, 0), 30, "the fork server published", interval=0.5)
        assert server is not None and "forksrv" not in published(n)  # not a front
        old_fronts = set(fronts(n))
        os.kill(server, signal.SIGKILL)
        wait_until(lambda: len(fronts(n)) == 2 and not old_fronts & set(fronts(n)), 60,
                   "both fronts forked again by a new server")  # fmt: skip
        again = n.fork_server()
        assert again not in (None, server)
        wait_until(lambda: shown(again, 1), 60, "the new fork server published", interval=0.5)
        (row,) = [r for r in cli_nodes(n).splitlines() if r.startswith("forks ")]
        total = 1 + sum(p["restarts"] for p in published(n).values())
        assert "core+2 fronts" in row and f" {total} restarts" in row, row
        cells = [line.split() for line in cli_nodes(n, "--processes").splitlines()[1:]]
        assert [(c[2], c[4]) for c in cells if c[1] == "forksrv"] == [(str(again), "1")], cells
    finally:
        n.stop()
        redis.stop()


def test_a_fork_server_killed_during_the_nodes_start_is_started_again(tmp_path: Path) -> None:
    """The fork server starts before the node's own start (models, Redis), so its imports
    run meanwhile. Killed then (``kill -9``: the OOM killer, an operator), the fronts' start
    starts it again: the node comes up with both fronts, its restart published."""
    redis = RedisServer(tmp_path).start()
    n = Node(tmp_path, "early", redis.url, devices="cpu:1", extra=["--front-doors", "2"])
    try:
        n.proc.start()
        wait_until(lambda: n.fork_server() is not None, 60, "the fork server started",
                   interval=0.005)  # fmt: skip
        first = n.fork_server()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_until(n.ready, 120, f"node ready\n{n.proc.log()}")
        wait_until(lambda: len(fronts(n)) == 2, 60, "two fronts")
        assert n.proc.popen is not None and n.proc.popen.poll() is None
        assert n.fork_server() not in (None, first)

        def published_restart() -> bool:
            (listed,) = [x for x in cli_nodes(n, "--json") if x["node"] == n.node_id]
            return [(h["pid"], h["restarts"]) for h in listed.get("helpers", [])] == [
                (n.fork_server(), 1)
            ]

        wait_until(published_restart, 30, "the server's restart published", interval=0.5)
    finally:
        n.stop()
        redis.stop()


def test_the_fronts_are_published_as_soon_as_they_run(tmp_path: Path) -> None:
    """The registration comes before the fronts start; the node renews once they run, so
    the fleet does not show them down for a renewal's interval (40 s here: a 120 s lease)."""
    redis = RedisServer(tmp_path).start()
    n = Node(tmp_path, "soon", redis.url, devices="cpu:1",
             extra=["--front-doors", "2", "--lease-ttl", "120"])  # fmt: skip
    try:
        n.start(timeout=60)

        def shown() -> bool:
            procs = published(n)
            return set(but_workers(procs)) == {"core", "0", "1"} and all(
                alive(p["pid"]) for p in procs.values()
            )

        wait_until(shown, 20, "the fronts published before the next renewal", interval=0.5)
        (row,) = [r for r in cli_nodes(n).splitlines() if r.startswith("soon ")]
        assert "core+2 fronts" in row and "down" not in row, row
    finally:
        n.stop()
        redis.stop()


def embedded(
    tmp: Path,
    node_id: str,
    port: int | None = None,
    model: Path | None = None,
    env: dict[str, str] | None = None,
) -> Node:
    """A node with two fronts on the embedded store, on ``port`` if given. With ``model``
    (the tests' slow ones) its steps' deadline is a minute: a busy machine's slow step is
    still one step, not a 503 ``deadline``."""
    more = [] if model is None else ["--model", str(model), "--act-deadline", "60"]
    n = Node(tmp, node_id, "", devices="cpu:1", extra=["--front-doors", "2", *more], env=env)
    argv = n.proc.argv
    del argv[argv.index("--redis") : argv.index("--redis") + 2]
    if port is not None:
        n.port, n.url = port, f"http://{n.host}:{port}"
        argv[argv.index("--port") + 1] = str(port)
        argv[argv.index("--advertise-url") + 1] = n.url
    return n


def test_kill_9_of_the_node_leaves_no_process_and_the_port_is_free_at_once(
    tmp_path: Path,
) -> None:
    node = embedded(tmp_path, "k").start(timeout=60)
    wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
    pids = fronts(node)
    step = {"episode_id": "k", "inputs": {"obs": [[0.0] * 8]}}
    assert httpx.post(node.url + "/act", json=step, timeout=20).status_code == 200
    node.stop(signal.SIGKILL)
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the fronts gone")
    again = embedded(tmp_path, "k2", node.port)
    try:
        again.start(timeout=60)  # binds the same port: nothing holds it
        assert httpx.post(again.url + "/act", json=step, timeout=20).status_code == 200
    finally:
        again.stop()


def test_a_front_whose_loop_stopped_is_killed_and_its_socket_served_again(
    tmp_path: Path,
) -> None:
    """A front paused (SIGSTOP) keeps its socket, and the kernel keeps queueing new
    connections there: once its loop has not run for ``--front-hang-timeout`` the node
    kills it and starts another, which serves them. Every step on a fresh connection is
    answered, whichever socket it was queued on. A pause of the whole node (its core and
    fronts together, as a SIGSTOP to its process group) longer than the timeout kills
    nobody: the core's look after it came late, and counts at most 0.25 s of it."""
    node = embedded(tmp_path, "hg")
    node.proc.argv += ["--front-hang-timeout", "4"]
    node.start(timeout=60)
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
        assert node.proc.popen is not None
        core, pids = node.proc.popen.pid, fronts(node)
        pause(*pids)  # the whole node, past the timeout (the fronts first, and the core
        time.sleep(0.3)  # sees them still before it stops)
        pause(core)
        time.sleep(6)
        os.kill(core, signal.SIGCONT)  # the core first: it looks while they are still paused
        time.sleep(0.5)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        step = {"episode_id": "hg", "inputs": {"obs": [[0.0] * 8]}}
        for _ in range(6):  # fresh connections, either socket
            assert httpx.post(node.url + "/act", json=step, timeout=60).status_code == 200
        assert fronts(node) == pids  # nobody killed for the node's own pause
        pause(pids[0])
        try:
            for _ in range(8):  # a step queued on the paused front's socket waits for its
                r = httpx.post(node.url + "/act", json=step, timeout=120)  # replacement
                assert r.status_code == 200, r.text
            wait_until(lambda: not alive(pids[0]), 60, "the paused front killed")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[0], signal.SIGCONT)
        wait_until(lambda: len(fronts(node)) == 2 and pids[0] not in fronts(node), 60,
                   "its replacement up")  # fmt: skip
        for _ in range(6):
            assert httpx.post(node.url + "/act", json=step, timeout=60).status_code == 200
        assert "its event loop has not run for" in node.proc.log()
        assert metrics(node)[("affinity_front_restarts_total", frozenset())] == 1
    finally:
        node.stop()


def test_sigterm_stops_the_fronts_after_the_node_left(tmp_path: Path) -> None:
    node = embedded(tmp_path, "t").start(timeout=60)
    wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
    pids = fronts(node)
    # deaf from their birth to what a ^C or a service manager sends the node's group
    for pid in pids:
        assert deaf(pid), pid
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
    step = {"episode_id": "t", "inputs": {"obs": [[0.0] * 8]}}
    for _ in range(4):  # whichever front takes it
        assert httpx.post(node.url + "/act", json=step, timeout=20).status_code == 200
    assert fronts(node) == pids
    assert node.proc.popen is not None
    node.proc.popen.send_signal(signal.SIGTERM)
    assert node.proc.popen.wait(30) == 0, node.proc.log()
    assert "left: moved" in node.proc.log()  # it left the fleet before it stopped them
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the fronts gone")


def test_a_step_whose_front_died_mid_step_is_kept_for_the_clients_retry(tmp_path: Path) -> None:
    """The front holding the client's connection is killed while the node's process runs
    the step (a slow model): the step was applied, its answer had nowhere to go; the
    client's retry with the same seq, through the other front, gets the kept reply, and
    the episode has counted that step once. A step without seq whose front died so is
    undone, as for a client that left: its reply reached nobody."""
    node = embedded(tmp_path, "m", model=counter_policy(tmp_path, repeats=400, width=512))
    node.start(timeout=60)
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")

        def step(seq: int, client: httpx.Client) -> httpx.Response:
            body = {"episode_id": "slow", "inputs": {"obs": [[0.0] * 8]}, "seq": seq}
            return client.post(node.url + "/act", json=body, timeout=60)

        with httpx.Client() as client:
            first = step(1, client)
            assert first.status_code == 200 and count(first.json()) == 1
        lost: list[BaseException] = []
        with httpx.Client() as client:

            def second() -> None:
                try:
                    step(2, client)
                except httpx.TransportError as exc:
                    lost.append(exc)

            sender = threading.Thread(target=second)
            sender.start()
            with held_mid_step(lambda: fronts(node), node.port, node.pid()) as holder:
                assert sender.is_alive(), "the step was answered before its front could be killed"
                os.kill(holder, signal.SIGKILL)  # the core paused: the step still runs
            sender.join(60)
        assert lost, "the client should have lost its connection with its front"
        with httpx.Client() as client:  # a new connection: the other front, or the new one
            for _ in range(100):
                retry = step(2, client)
                if retry.status_code != 503:  # the step may still be running: busy
                    break
                time.sleep(0.1)
            assert retry.status_code == 200, retry.text
            assert retry.json()["replayed"] and count(retry.json()) == 2
            third = step(3, client)
            assert third.status_code == 200 and count(third.json()) == 3

        # without seq: the step whose front died is undone (its reply reached nobody)
        def plain(client: httpx.Client) -> httpx.Response:
            body = {"episode_id": "slow-plain", "inputs": {"obs": [[0.0] * 8]}}
            for _ in range(100):
                r = client.post(node.url + "/act", json=body, timeout=60)
                if r.status_code != 503:
                    return r
                time.sleep(0.1)
            raise AssertionError(f"still busy: {r.text}")

        with httpx.Client() as client:
            assert count(plain(client).json()) == 1
        lost.clear()
        with httpx.Client() as client:

            def second_plain() -> None:
                try:
                    plain(client)
                except httpx.TransportError as exc:
                    lost.append(exc)

            sender = threading.Thread(target=second_plain)
            sender.start()
            with held_mid_step(lambda: fronts(node), node.port, node.pid()) as holder:
                assert sender.is_alive(), "the step was answered before its front could be killed"
                os.kill(holder, signal.SIGKILL)  # the core paused: the step still runs
            sender.join(60)
        assert lost, "the client should have lost its connection with its front"
        with httpx.Client() as client:
            after, later = plain(client).json(), plain(client).json()
        # the lost step undone before the next ran: it continues from step 1; or undone
        # after it ran on top (guarantees.md: only state_reset can say so): the next says it
        undone = (count(after), after["state_reset"]) == (2, False) and count(later) == 3
        said = (count(after), after["state_reset"]) == (3, False) and later["state_reset"]
        assert undone or said, (after, later)
    finally:
        node.stop()


def test_the_api_key_is_checked_in_the_fronts_and_no_secret_reaches_them(tmp_path: Path) -> None:
    env = {"AFFINITY_API_KEY": "robot-key", "AFFINITY_ADMIN_TOKEN": "admin-token"}
    node = embedded(tmp_path, "a", env=env).start(timeout=60)
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
        step = {"episode_id": "keyed", "inputs": {"obs": [[0.0] * 8]}}
        refused = httpx.post(node.url + "/act", json=step, timeout=20)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Api-Key"
        key = {"Authorization": "Api-Key robot-key"}
        assert httpx.post(node.url + "/act", json=step, headers=key, timeout=20).is_success
        # KServe infer, decoded in the fronts: the key checked there, the model first
        infer = {"inputs": [{"name": "obs", "shape": [1, 8], "datatype": "FP32", "data": [0] * 8}]}
        path = node.url + "/v2/models/demo_policy/infer"
        refused = httpx.post(path, json=infer, timeout=20)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Api-Key"
        assert refused.json() == {"error": "this node wants Authorization: Api-Key <key>"}
        unknown = httpx.post(node.url + "/v2/models/other/infer", json=infer, timeout=20)
        assert unknown.status_code == 404 and "unknown model" in unknown.json()["error"]
        assert httpx.post(path, json=infer, headers=key, timeout=20).is_success
        text = httpx.get(node.url + "/metrics", timeout=10).text
        assert 'affinity_rejected_requests_total{reason="unauthorized"} 2.0' in text
        for pid in fronts(node):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            names = {entry.partition(b"=")[0] for entry in environ}
            assert not names & {b"AFFINITY_CLUSTER_SECRET", b"AFFINITY_ADMIN_TOKEN",
                                b"AFFINITY_API_KEY"}  # fmt: skip
    finally:
        node.stop()


def test_a_step_whose_client_left_while_the_core_was_paused_is_applied_once(
    tmp_path: Path,
) -> None:
    """The node's process (the core) is paused while a step is on the hop; the client
    gives up and leaves. Once the core runs again it applies the step (its seq holds the
    reply for a retry). The client's retry with the same seq, on a new connection, gets
    that kept reply: the step applied once, never twice, never from a reset."""
    node = embedded(tmp_path, "p", model=counter_policy(tmp_path))
    node.start(timeout=60)
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
        assert node.proc.popen is not None
        core = node.proc.popen.pid

        def step(seq: int, client: httpx.Client, timeout: float = 20) -> httpx.Response:
            body = {"episode_id": "paused", "inputs": {"obs": [[0.0] * 8]}, "seq": seq}
            return client.post(node.url + "/act", json=body, timeout=timeout)

        with httpx.Client() as client:
            first = step(1, client)
            assert first.status_code == 200 and count(first.json()) == 1
        body = json.dumps({"episode_id": "paused", "inputs": {"obs": [[0.0] * 8]}, "seq": 2})
        head = (f"POST /act HTTP/1.1\r\nHost: {node.host}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        pause(core)  # the core alone: the fronts keep accepting
        try:
            with socket.create_connection((node.host, node.port), timeout=30) as sock:
                sock.sendall(head.encode() + body.encode())
                wait_until(lambda: any(on_the_hop(f) for f in fronts(node)), 30,
                           "the step on a front's hop")  # fmt: skip
            # unanswered, the client left (its connection closed) with its step on the hop
        finally:
            os.kill(core, signal.SIGCONT)
        with httpx.Client() as client:
            for _ in range(100):
                retry = step(2, client)
                if retry.status_code != 503:  # the left step may still be being undone
                    break
                time.sleep(0.1)
            assert retry.status_code == 200, retry.text
            got = retry.json()
            assert got["replayed"] and count(got) == 2 and not got["state_reset"], retry.text
            third = step(3, client)
            assert third.status_code == 200 and count(third.json()) == 3, third.text
    finally:
        node.stop()


def grpc_refusal(address: str, sequence: int, **kw: Any) -> Any:
    """The refusal (``InferenceServerException``) of a first gRPC step of ``sequence``
    (the demo model's zeros) sent to ``address`` with ``kw`` (``timeout``: the KServe
    parameter); it fails when the step is served."""
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    from tests.test_kserve import MODEL

    grpc_in = tg.InferInput("obs", [1, 8], "FP32")
    grpc_in.set_data_from_numpy(np.zeros((1, 8), np.float32))
    with (
        tg.InferenceServerClient(address) as client,
        pytest.raises(InferenceServerException) as refused,
    ):
        client.infer(MODEL, [grpc_in], sequence_id=sequence, sequence_start=True,
                     client_timeout=30, **kw)  # fmt: skip
    return refused.value


def test_a_step_waiting_for_a_slot_waits_no_longer_than_its_clients_own_timeout(
    tmp_path: Path,
) -> None:
    """Every slot of both fronts' hops in flight (the core paused with a step in each, more
    steps waiting their turn behind them): a KServe request whose own ``timeout`` passes
    while it waits for a slot is refused by its front then, 503 ``deadline`` naming that
    timeout, over HTTP and over gRPC (``UNAVAILABLE``), as one process refuses a step whose
    deadline passed while it queued; not at ``--act-deadline`` (a minute here), and never
    sent to the core, which is still paused when they are answered."""

    from tests.test_kserve import INFER

    redis = RedisServer(tmp_path).start()
    grpc_port = free_port()
    extra = ["--front-doors", "2", "--act-deadline", "60", "--grpc-port", str(grpc_port)]
    n = Node(tmp_path, "queue", redis.url, devices="cpu:1", extra=extra)
    fillers: list[socket.socket] = []
    try:
        n.start(timeout=60)
        wait_until(lambda: len(fronts(n)) == 2, 30, "two fronts")
        assert n.proc.popen is not None
        core = n.proc.popen.pid
        body = json.dumps({"episode_id": "filler", "inputs": {"obs": [[0.0] * 8]}})
        head = (f"POST /act HTTP/1.1\r\nHost: {n.host}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        pause(core)  # the core alone: its fronts go on, and fill their hops
        try:
            # 160 connections: each front gets its 32 (the kernel spreads them by their
            # addresses: one getting fewer than 32 of 160 is a 1-in-10^13 chance)
            for _ in range(160):
                filler = socket.create_connection((n.host, n.port), timeout=30)
                filler.sendall(head.encode() + body.encode())
                fillers.append(filler)
            wait_until(lambda: all(len(on_the_hop(f)) == 32 for f in fronts(n)), 30,
                       "every slot of both fronts' hops in flight")  # fmt: skip
            ask = {"inputs": [{"name": "obs", "shape": [1, 8], "datatype": "FP32",
                               "data": [0.0] * 8}],
                   "parameters": {"sequence_id": "late", "sequence_start": True,
                                  "timeout": 300_000}}  # fmt: skip
            kserve = httpx.post(n.url + INFER, json=ask, timeout=30)
            grpc_refused = grpc_refusal(f"{n.host}:{grpc_port}", 78, timeout=300_000)
            assert stopped(core)  # answered by the fronts, the core never ran
        finally:
            os.kill(core, signal.SIGCONT)
        assert kserve.status_code == 503 and kserve.headers["retry-after"] == "1", kserve.text
        why = kserve.json()["error"]
        assert why == "deadline: no answer within the request's timeout of 300000 µs", why
        assert grpc_refused.status() == "StatusCode.UNAVAILABLE", grpc_refused.value
        assert "deadline: " in str(grpc_refused.message()), grpc_refused.value
        for filler in fillers:
            filler.close()
        step = {"episode_id": "after", "inputs": {"obs": [[0.0] * 8]}}
        wait_until(lambda: post(n.url, step, False).status_code == 200, 60, "served again")
        # the two refusals are the node's, counted by the core as its own
        routing = ("affinity_routing_total", frozenset({("result", "unavailable")}))
        wait_until(lambda: metrics(n).get(routing, 0) >= 2, 30, "the refusals counted")
        # the two refused never reached the core: no sequence of theirs holds a record
        assert httpx.get(n.url + "/episodes/kserve:s:late").status_code == 404
        assert httpx.get(n.url + "/episodes/kserve:i:78").status_code == 404
    finally:
        for filler in fillers:
            filler.close()
        n.stop()
        redis.stop()


def test_a_core_stuck_past_its_lease_has_its_fronts_refuse_steps_at_once(tmp_path: Path) -> None:
    """The node's process (the core) is paused past its lease, its fronts running: a step
    through any door (and a new openpi connection) is refused by the front at once, 503
    ``fenced`` (the core, still paused, would refuse it anyway once it ran), so the client
    tries another node instead of waiting on a stuck one. Before, it waited for the core,
    or for its own timeout. Once the core runs again it counts those refusals as its own
    and serves again."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from tests.test_kserve import INFER, request_body

    redis = RedisServer(tmp_path).start()
    grpc_port = free_port()
    extra = ["--front-doors", "2", "--lease-ttl", "3", "--grpc-port", str(grpc_port)]
    n = Node(tmp_path, "stuck", redis.url, devices="cpu:1", extra=extra)
    try:
        n.start(timeout=60)
        wait_until(lambda: len(fronts(n)) == 2, 30, "two fronts")
        step = {"episode_id": "stuck", "inputs": {"obs": [[0.0] * 8]}}
        assert post(n.url, step, False).status_code == 200
        assert n.proc.popen is not None
        core = n.proc.popen.pid
        r = redis.client()
        with connect(f"ws://{n.host}:{n.port}/", max_size=None) as ws:
            ws.recv(timeout=30)  # the metadata
            pause(core)  # the core alone: its fronts go on
            try:
                # past its lease: Redis's deadline for it is later than its own
                def lapsed() -> bool:
                    until = r.zscore(Keys().nodes, "stuck")  # (None: noticed, and gone)
                    return until is None or r.time()[0] * 1000 > until

                assert r.zscore(Keys().nodes, "stuck") is not None
                wait_until(lapsed, 30, "the core's lease to run out")
                got = [post(n.url, step, binary, timeout=30) for binary in (False, True)]
                body, headers = request_body(np.zeros((1, 8), np.float32))
                kserve = httpx.post(n.url + INFER, content=body, headers=headers, timeout=30)
                grpc_refused = grpc_refusal(f"{n.host}:{grpc_port}", 77)
                ws.send(wire.encode({"obs": np.zeros(8, np.float32)}))
                refused = ws.recv(timeout=30)
                with pytest.raises(InvalidStatus):  # a new connection: closed before accepted
                    connect(f"ws://{n.host}:{n.port}/", open_timeout=30).close()
                assert stopped(core)  # every one of them was answered by a front
            finally:
                os.kill(core, signal.SIGCONT)
        for reply in got:
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1", reply.text
            assert read(reply)["error"]["code"] == "fenced", reply.text
        assert kserve.status_code == 503 and kserve.json()["error"].startswith("fenced: ")
        assert isinstance(refused, str) and refused.startswith("fenced: "), refused
        assert grpc_refused.status() == "StatusCode.UNAVAILABLE", grpc_refused.value
        assert "fenced: " in str(grpc_refused.message()), grpc_refused.value
        # running again: it re-registers and serves; the refusals are counted as its own
        wait_until(lambda: post(n.url, step, False).status_code == 200, 60, "served again")
        routing = metrics(n)[("affinity_routing_total", frozenset({("result", "unavailable")}))]
        assert routing >= 6
    finally:
        n.stop()
        redis.stop()


def slow_post(node: Node, body: dict[str, Any]) -> socket.socket:
    """One msgpack ``/act`` step sent on a slow link (:func:`tests.procs.slow_link`)."""
    data = wire.encode(body)
    client = slow_link(node.host, node.port)
    client.sendall(b"POST /act HTTP/1.1\r\nHost: node\r\nContent-Type: application/msgpack"
                   b"\r\nAccept: application/msgpack\r\nContent-Length: "
                   + str(len(data)).encode() + b"\r\n\r\n" + data)  # fmt: skip
    return client


@contextlib.contextmanager
def wide_node(tmp: Path, name: str, capacity: int = 64) -> Iterator[tuple[Node, dict[str, Any]]]:
    """A node of two fronts whose steps answer 12 MB (``counter_policy(wide=...)``), its
    episode's first step applied: the node, and that step's body (msgpack)."""
    node = embedded(tmp, name, model=counter_policy(tmp, wide=3 << 20))
    node.proc.argv += ["--capacity", str(capacity)]
    node.start(timeout=60)
    zeros = {"episode_id": f"{name}-slow", "inputs": {"obs": np.zeros((1, 8), np.float32)}}
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
        assert count(read(post(node.url, zeros, True, timeout=60))) == 1
        yield node, zeros
    finally:
        node.stop()


def slow_act(node: Node, body: dict[str, Any]) -> tuple[socket.socket, int]:
    """One msgpack ``/act`` step sent on a slow link (:func:`tests.procs.slow_link`: its
    reply never read), once the fronts hand no reply over: the socket, and the front
    handing this step's reply over, the reply in part in its buffer: once it moved off its
    slot to a ticket (``node.hop.PARK``), which is where a slow client's reply waits."""
    wait_until(lambda: handing_over(lambda: fronts(node)) is None, 30, "no reply on its way")
    client = slow_post(node, body)

    def parked() -> int | None:
        return next((f for f in fronts(node) if DELIVERING in hop_tickets(f)), None)

    holder: int = wait_until(parked, 60, "a front handing the step's reply over", interval=0.01)
    return client, holder


def test_a_front_dead_with_a_reply_in_its_buffer_leaves_that_step_in_doubt(tmp_path: Path) -> None:
    """A client on a slow link: its step's reply (12 MB, msgpack) fills the kernel's socket
    buffers and the rest waits in its front's own buffer, so the slot says DELIVERING. The
    front is killed then. Whether the client got that step is unknown to the core: the
    episode's next step starts clean and says ``state_reset`` (DESIGN rule 6), never a
    silent continuation from the step before. (Before, the slot was freed once the reply
    was written to the front's transport: the step stood, its reply gone with the
    process.)"""
    with wide_node(tmp_path, "hd") as (node, zeros):
        client, holder = slow_act(node, zeros)
        os.kill(holder, signal.SIGKILL)
        client.close()
        seen = []
        for _ in range(2):  # the other front, or the new one once it is up
            for _ in range(100):
                try:
                    r = post(node.url, zeros, True, timeout=60)
                except httpx.TransportError:
                    time.sleep(0.1)
                    continue
                break
            assert r.status_code == 200, r.text
            seen.append((count(read(r)), bool(read(r)["state_reset"])))
        # in doubt before the next step ran: it starts clean and says so; or the next step
        # ran on top of it before the core saw its front die: the one after says it
        assert seen in ([(1, True), (2, False)], [(3, False), (1, True)]), seen


def test_a_client_gone_with_its_reply_in_part_unsent_has_that_step_in_doubt(
    tmp_path: Path,
) -> None:
    """The same slow client resets its connection while its 12 MB reply is still in part in
    its front's buffer (the front lives): the front saw its hand-over fail midway, and some
    of the reply may have arrived. The step is undone in doubt: the next step starts clean
    and says ``state_reset``. (Before, the step stood: the reply was counted as sent once
    written to the front's transport.)"""
    with wide_node(tmp_path, "hr") as (node, zeros):
        client, holder = slow_act(node, zeros)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a reset: the front's buffer still holds part of the reply
        wait_until(
            lambda: (
                hop_states(holder).count(FREE) == len(hop_states(holder))
                and not hop_tickets(holder)
            ),
            30,
            "the core told, slot and ticket freed",
        )
        seen = [(count(read(r)), bool(read(r)["state_reset"]))
                for r in (post(node.url, zeros, True, timeout=60) for _ in range(2))]  # fmt: skip
        assert seen == [(1, True), (2, False)], seen
        assert alive(holder)


def test_a_reply_sent_before_the_front_closes_the_connection_stands(tmp_path: Path) -> None:
    """A client that asks ``Connection: close`` (HTTP/1.0's habit): its front closes the
    connection once the reply is written, so the connection is closing when the front
    checks that the reply left. It did: the step stands, and the next goes on from it
    (no ``state_reset``), reply after reply, as with a connection kept alive."""
    node = embedded(tmp_path, "hc", model=counter_policy(tmp_path))
    node.start(timeout=60)
    body = {"episode_id": "hc-close", "inputs": {"obs": [[0.0] * 8]}}
    try:
        wait_until(lambda: len(fronts(node)) == 2, 30, "two fronts")
        seen = []
        for _ in range(6):  # new connections: either front
            r = httpx.post(node.url + "/act", json=body, headers={"connection": "close"},
                           timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            seen.append((count(r.json()), r.json()["state_reset"]))
        assert seen == [(n, False) for n in range(1, 7)], seen
    finally:
        node.stop()


def test_clients_that_read_nothing_never_starve_a_front_of_its_slots(tmp_path: Path) -> None:
    """80 clients on slow links, their 12 MB replies never read: each reply waits in its
    front's buffer, and each would hold a slot of the front's hop (a front has 32, the two
    64) until it left. A reply the kernel did not take at once moves off its slot to a ticket
    (``node.hop.PARK``), so all 80 are handed over at once, every slot stays free, and a
    client that reads its replies is served beside them, nobody dropped
    (``affinity_front_replies_parked`` says 80 over the two fronts). One of the slow
    clients then reads its reply whole: its step stood, and its next goes on from it.
    (Before the tickets, the fronts dropped the slow connections, their steps in doubt, to
    free slots; before that, the reading client waited 60 s behind them.)"""
    with wide_node(tmp_path, "hs", capacity=128) as (node, zeros):
        slow = []
        try:
            for i in range(80):
                slow.append(slow_post(node, {**zeros, "episode_id": f"hs-{i}"}))

            def parked() -> int:
                return sum(hop_tickets(f).count(DELIVERING) for f in fronts(node))

            wait_until(lambda: parked() == 80
                       and all(hop_states(f).count(FREE) == 32 for f in fronts(node)),
                       120, "every slow reply handed over off its slot")  # fmt: skip
            r = post(node.url, zeros, True, timeout=60)
            assert r.status_code == 200 and count(read(r)) == 2, r.text
            assert parked() == 80  # nobody dropped
            said = {front: value for (name, labels), value in metrics(node).items()
                    if name == "affinity_front_replies_parked" for _, front in labels}  # fmt: skip
            assert sorted(said) == ["0", "1"] and sum(said.values()) == 80, said
            first = slow[0]
            first.settimeout(60)
            raw = b""
            while b"\r\n\r\n" not in raw:
                raw += first.recv(1 << 16)
            head, _, body = raw.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))  # fmt: skip
            while len(body) < length:
                chunk = first.recv(1 << 20)
                assert chunk, "the connection closed mid-reply"
                body += chunk
            assert count(wire.decode(body)) == 1
            wait_until(lambda: parked() == 79, 60, "the read reply's ticket freed")
            r = post(node.url, {**zeros, "episode_id": "hs-0"}, True, timeout=60)
            assert (count(read(r)), bool(read(r)["state_reset"])) == (2, False)
        finally:
            for client in slow:
                client.close()
