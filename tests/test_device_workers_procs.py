"""``--device-workers process`` with real processes: each device's model sessions run in a
worker process of its own (``node/deviceproc.py``), the core keeping the episodes, their
state and the batching (``node/deviceprocs.py``).

Its rollouts equal a ``thread`` node's step for step (one at a time, batched, in rows). A
worker killed while idle takes its device down and comes back restarted, its episodes'
states gone with it (each one's next step says ``state_reset``); one killed, or stopped
past ``--act-deadline``, in the middle of a run fails that step alone, which is not
applied: its retry applies it once. A core killed with ``kill -9`` takes its workers with
it and the next node binds the same port; a core stopped with SIGTERM hands its episodes
over with their state and leaves no process. A node that fences itself has every worker
drop every state it held at once.

Every wait is bounded and waits for what it names (a run on a worker's hop, a queue's
depth, a metric), never for a guessed time.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from affinity import Keys
from node.models import DEMO_MODEL
from tests.models import counter_policy
from tests.procs import (
    Node,
    RedisServer,
    alive,
    asked_of,
    device_workers,
    metrics,
    pause,
    wait_until,
    worker_mid_step,
)
from tests.rollout import reference_rollout

pytestmark = [pytest.mark.integration]

KEYS = Keys()
Array = npt.NDArray[np.float32]
DEADLINE = "10"
"""The main nodes' --act-deadline: generous, a worker is stopped for a while in some tests
(past it, the core would kill it as hung)."""
PROCESS = ["--device-workers", "process"]
ZERO = np.zeros((1, 8), np.float32)


@dataclass
class Nodes:
    proc: Node  # --device-workers process
    thread: Node  # the default, the reference
    redis: RedisServer  # the process node's
    counter: Path


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    """A ``process`` node and a ``thread`` node, each on a Redis of its own (no step of one
    is placed on the other), serving the demo and the counter policy on two CPU devices."""
    tmp = tmp_path_factory.mktemp("device-workers")
    counter = counter_policy(tmp)
    models = ["--model", "demo", "--model", f"counter={counter}", "--capacity", "1000",
              "--act-deadline", DEADLINE]  # fmt: skip
    redis_p, redis_t = RedisServer(tmp), RedisServer(tmp)
    proc = Node(tmp, "p", redis_p.url, devices="cpu:2", extra=[*models, *PROCESS])
    thread = Node(tmp, "t", redis_t.url, devices="cpu:2", extra=models)
    try:
        redis_p.start()
        redis_t.start()
        proc.proc.start()
        thread.proc.start()
        for node in (proc, thread):
            wait_until(node.ready, 60, f"node {node.node_id} ready")
        yield Nodes(proc, thread, redis_p, counter)
    finally:
        proc.stop()
        thread.stop()
        redis_p.stop()
        redis_t.stop()


def observations(seed: int, n: int) -> list[Array]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def body(episode: str, model: str, obs: Array, seq: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"episode_id": episode, "model": model, "inputs": {"obs": obs.tolist()}}
    if seq is not None:
        out["seq"] = seq
    return out


def act(node: Node, episode: str, model: str, obs: Array, seq: int | None = None,
        timeout: float = 60) -> httpx.Response:  # fmt: skip
    return httpx.post(node.url + "/act", json=body(episode, model, obs, seq), timeout=timeout)


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    got: dict[str, Any] = r.json()
    return got


def count(reply: dict[str, Any]) -> int:
    return int(np.asarray(reply["outputs"]["count"]).reshape(-1)[0])


def same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """A process node's reply equals a thread node's (or the oracle's outputs)."""
    outputs = want.get("outputs", want)
    assert set(got["outputs"]) == set(outputs), what
    for name, value in outputs.items():
        expected = np.asarray(value, dtype=np.float32)
        np.testing.assert_allclose(
            np.asarray(got["outputs"][name], dtype=np.float32).reshape(expected.shape),
            expected, rtol=1e-5, atol=1e-6, err_msg=f"{what}: {name}",
        )  # fmt: skip


def one(node: Node, name: str, **labels: str) -> float:
    return metrics(node).get((name, frozenset(labels.items())), 0.0)


@dataclass(frozen=True)
class Restarts:
    """A device's worker restarts and crash transitions, as the node's metrics count them."""

    restarts: float
    down: float
    up: float


def restarts(node: Node, device: str) -> Restarts:
    m = metrics(node)
    return Restarts(
        m.get(("affinity_device_worker_restarts_total", frozenset({("device", device)})), 0.0),
        *(
            m.get(("affinity_crash_transitions_total", frozenset({("device", device), ("to", to)})))
            or 0.0
            for to in ("down", "up")
        ),
    )


def wait_back(node: Node, device: str, before: Restarts, timeout: float = 60) -> None:
    """Wait until ``device`` went down, had its worker restarted once and is up again: one
    transition down and one up, whatever the number of models (each has a crash tracker
    of its own for the device, and the worker's death takes it down for all: the device
    goes down with the first and up with the last)."""
    want = Restarts(before.restarts + 1, before.down + 1, before.up + 1)
    seen: list[Restarts] = []

    def back() -> bool:
        seen[:] = [restarts(node, device)]
        return seen[0] == want

    try:
        wait_until(back, timeout, f"{device} down, its worker restarted once, up again")
    except AssertionError:
        raise AssertionError(f"{device}: want {want}, last {seen}\n{node.proc.log()}") from None


def worker(node: Node, index: int, other_than: int | None = None) -> int:
    """The live worker process of device ``index`` of ``node`` (a new one, with
    ``other_than``: the one it had), waited for."""
    found: list[int] = []

    def there() -> bool:
        pid = device_workers(node.pid()).get(index)
        found[:] = [pid] if pid is not None and pid != other_than else []
        return bool(found)

    wait_until(there, 60, f"the worker process of device {index} of {node.node_id}")
    return found[0]


def placed_on(node: Node, device: str, prefix: str, model: str, n: int) -> list[str]:
    """``n`` new episodes of ``model`` whose first step (seq 1, a zero observation) landed on
    ``device`` (episodes placed elsewhere are left alone); bounded."""
    found: list[str] = []
    for i in range(8 * n):
        episode = f"{prefix}-{i}"
        got = ok(act(node, episode, model, ZERO, seq=1))
        assert (got["seq"], got["state_reset"]) == (1, False), got
        if got["device"] == device:
            found.append(episode)
            if len(found) == n:
                return found
    raise AssertionError(f"fewer than {n} of {8 * n} new episodes landed on {device}")


def in_background(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn(*args)`` on a thread; its result (or exception) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def step_in_stopped_worker(
    node: Node, index: int, episode: str, seq: int
) -> tuple[int, tuple[threading.Thread, list[Any]]]:
    """Stop (SIGSTOP) device ``index``'s worker, send ``episode``'s step ``seq`` in the
    background and wait until its run is on the worker's hop: the worker's pid and the
    step's (:func:`joined` gives its answer). The caller kills or resumes the worker."""
    pid = worker(node, index)
    pause(pid)
    job = in_background(act, node, episode, "counter", ZERO, seq)
    worker_mid_step(pid)
    return pid, job


def joined(thread: threading.Thread, out: list[Any]) -> Any:
    thread.join(90)
    assert not thread.is_alive() and len(out) == 1, "the step in the background never returned"
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


# ---- equal to a thread node --------------------------------------------------------------


def test_rollouts_equal_a_thread_nodes_step_for_step_alone_concurrent_and_in_rows(
    nodes: Nodes,
) -> None:
    """Six episodes (three of the demo, three of the counter policy) step together on the
    process node (what arrives together on a device may run as one batch), one at a time
    on the thread node, then two steps as ``{"steps": [...]}`` rows on both: every reply
    is the same, and the demo's the oracle's rollout."""
    episodes = {f"roll-{m}-{i}": m for m in ("demo_policy", "counter") for i in range(3)}
    obs = {ep: observations(k, 8) for k, ep in enumerate(episodes)}
    served: dict[str, list[dict[str, Any]]] = {ep: [] for ep in episodes}
    with ThreadPoolExecutor(len(episodes)) as pool:
        for t in range(6):
            got = pool.map(lambda ep, t=t: act(nodes.proc, ep, episodes[ep], obs[ep][t], t + 1),
                           episodes)  # fmt: skip
            for ep, r in zip(episodes, got, strict=True):
                reply = ok(r)
                want = ok(act(nodes.thread, ep, episodes[ep], obs[ep][t], t + 1))
                assert (reply["seq"], reply["state_reset"], reply["replayed"]) == (
                    t + 1, False, False), reply  # fmt: skip
                assert reply["model"] == want["model"]
                same(reply, want, f"{ep} step {t + 1}")
                served[ep].append(reply)
    for t in (6, 7):
        rows = [body(ep, m, obs[ep][t], t + 1) for ep, m in episodes.items()]
        got_rows = ok(httpx.post(nodes.proc.url + "/act", json={"steps": rows}, timeout=60))
        want_rows = ok(httpx.post(nodes.thread.url + "/act", json={"steps": rows}, timeout=60))
        for ep, reply, want in zip(episodes, got_rows["steps"], want_rows["steps"], strict=True):
            assert (reply["episode_id"], reply["seq"]) == (ep, t + 1), reply
            assert not reply["state_reset"], reply
            same(reply, want, f"{ep} row step {t + 1}")
            served[ep].append(reply)
    for ep, model in episodes.items():
        assert len({r["device"] for r in served[ep]}) == 1, f"{ep} changed device"
        if model == "demo_policy":
            for t, (reply, want) in enumerate(
                zip(served[ep], reference_rollout(DEMO_MODEL, obs[ep]), strict=True)
            ):
                same(reply, {"actions": want["actions"]}, f"{ep} oracle step {t + 1}")
        else:
            assert [count(r) for r in served[ep]] == list(range(1, 9))


def test_steps_queued_behind_a_stopped_workers_run_go_as_one_batch_equal_to_a_thread_nodes(
    nodes: Nodes,
) -> None:
    """Device 0's worker is stopped with a run on its hop; three more episodes' steps queue
    on the device (its queue depth says so); once the worker runs again the three go as one
    model run of three, and every reply equals the thread node's for the same history."""
    p, t = nodes.proc, nodes.thread
    episodes = placed_on(p, "p/0", "batch", "demo_policy", 4)
    for ep in episodes:  # the same first step on the thread node, wherever it lands
        ok(act(t, ep, "demo_policy", ZERO, seq=1))
    obs = {ep: observations(100 + k, 1)[0] for k, ep in enumerate(episodes)}
    before = metrics(p)
    runs0 = before.get(("affinity_batch_size_count", frozenset({("device", "p/0")})), 0.0)
    steps0 = before.get(("affinity_batch_size_sum", frozenset({("device", "p/0")})), 0.0)
    pid = worker(p, 0)
    pause(pid)
    try:
        pending = [in_background(act, p, episodes[0], "demo_policy", obs[episodes[0]], 2)]
        wait_until(lambda: asked_of(pid), 30, "the first step's run on the stopped worker's hop",
                   interval=0.01)  # fmt: skip
        pending += [in_background(act, p, ep, "demo_policy", obs[ep], 2) for ep in episodes[1:]]
        wait_until(lambda: one(p, "affinity_worker_queue_depth", device="p/0") == 3, 30,
                   "three steps queued on p/0")  # fmt: skip
    finally:
        os.kill(pid, signal.SIGCONT)
    replies = [ok(joined(*job)) for job in pending]
    after = metrics(p)
    runs = after[("affinity_batch_size_count", frozenset({("device", "p/0")}))] - runs0
    steps = after[("affinity_batch_size_sum", frozenset({("device", "p/0")}))] - steps0
    assert (runs, steps) == (2, 4), "the first step alone, then the three queued as one run"
    assert worker(p, 0) == pid, "the worker was not restarted"
    for ep, reply in zip(episodes, replies, strict=True):
        assert (reply["device"], reply["seq"], reply["state_reset"]) == ("p/0", 2, False), reply
        same(reply, ok(act(t, ep, "demo_policy", obs[ep], 2)), f"{ep} batched step")


# ---- a worker killed --------------------------------------------------------------------


def test_a_worker_killed_while_idle_comes_back_and_its_episodes_start_over_said(
    nodes: Nodes,
) -> None:
    """kill -9 of device 0's worker: the device goes down and comes back with a new
    worker (a restart counted, one transition down and one up). Its episodes' states went
    with it (the worker is their only home): an episode stepped at once may be moved off
    the down device, answered on the device back already, or refused for a retry; an
    episode not stepped meanwhile starts over on its device. Each says ``state_reset``
    and counts from 1: never a silent reset, never a count from a state that is gone."""
    p = nodes.proc
    stepped, waited = placed_on(p, "p/0", "idle", "counter", 2)
    for ep in (stepped, waited):
        assert count(ok(act(p, ep, "counter", ZERO, seq=2))) == 2
    registry = nodes.redis.client()
    state = registry.hget(KEYS.device("p/0"), "state")
    before = restarts(p, "p/0")
    pid = worker(p, 0)
    os.kill(pid, signal.SIGKILL)
    r = act(p, stepped, "counter", ZERO, seq=3)  # races the restart
    if r.status_code == 200:  # moved off the down device, or on it back already
        got = r.json()
        assert (got["state_reset"], count(got)) == (True, 1), got
    else:  # refused: the step was not applied (the retry below starts over)
        assert r.status_code in (500, 503), r.text
        assert r.json()["error"]["code"] in ("model_failure", "device_down"), r.text
    wait_back(p, "p/0", before)
    new = worker(p, 0, other_than=pid)
    assert not alive(pid) and new != pid
    assert registry.hget(KEYS.device("p/0"), "state") == state
    if r.status_code != 200:
        got = ok(act(p, stepped, "counter", ZERO, seq=3))
        assert (got["state_reset"], count(got)) == (True, 1), got
    got = ok(act(p, waited, "counter", ZERO, seq=3))
    assert (got["device"], got["routing"], got["seq"]) == ("p/0", "hit", 3), got
    assert (got["state_reset"], got["replayed"], count(got)) == (True, False, 1), got
    assert count(ok(act(p, waited, "counter", ZERO, seq=4))) == 2  # and goes on from there
    log = p.proc.log_path.read_text(errors="replace")
    assert f"device p/0: its worker process {pid} was killed by SIGKILL" in log
    assert "episode state(s) went with its worker process" in log
    assert "device p/0 is back after its worker process was restarted" in log


def test_a_worker_killed_mid_step_fails_that_step_alone_and_its_retry_applies_it_once(
    nodes: Nodes,
) -> None:
    """Device 1's worker is stopped with an episode's step on its hop, then killed: that
    step is refused as a model failure, not applied; once the device is back the retry
    starts the episode over (its state went with the process), said, and a second retry
    of that step is its kept reply."""
    p = nodes.proc
    (episode,) = placed_on(p, "p/1", "midkill", "counter", 1)
    assert count(ok(act(p, episode, "counter", ZERO, seq=2))) == 2
    before = restarts(p, "p/1")
    pid, job = step_in_stopped_worker(p, 1, episode, 3)
    os.kill(pid, signal.SIGKILL)
    r = joined(*job)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_failure", r.text
    assert "died during the run" in r.json()["error"]["message"], r.text
    wait_back(p, "p/1", before)
    assert worker(p, 1, other_than=pid) != pid
    got = ok(act(p, episode, "counter", ZERO, seq=3))  # its state went with the process
    assert (got["device"], got["routing"], got["seq"]) == ("p/1", "hit", 3), got
    assert (got["state_reset"], got["replayed"], count(got)) == (True, False, 1), got
    again = ok(act(p, episode, "counter", ZERO, seq=3))
    assert (again["seq"], again["replayed"], count(again)) == (3, True, 1), again
    assert count(ok(act(p, episode, "counter", ZERO, seq=4))) == 2


def test_a_worker_stopped_past_the_deadline_is_killed_as_hung_and_restarted(
    tmp_path: Path,
) -> None:
    """A worker stopped (SIGSTOP) in the middle of a run: the step answers 503 deadline at
    --act-deadline, the core kills the worker as hung and restarts it, the device comes
    back, and the retry starts the episode over (its state went with the process), said;
    a retry of that step is its kept reply."""
    redis = RedisServer(tmp_path).start()
    node = Node(tmp_path, "h", redis.url, devices="cpu:1",
                extra=[*PROCESS, "--model", f"counter={counter_policy(tmp_path)}",
                       "--act-deadline", "2"])  # fmt: skip
    try:
        node.start(timeout=60)
        episode = "hung"
        for seq in (1, 2):
            assert count(ok(act(node, episode, "counter", ZERO, seq))) == seq
        before = restarts(node, "h/0")
        pid, job = step_in_stopped_worker(node, 0, episode, 3)
        try:
            r = joined(*job)  # answered at the deadline, the run still on the worker
            assert r.status_code == 503 and r.json()["error"]["code"] == "deadline", r.text
            wait_until(lambda: not alive(pid), 30, "the hung worker killed by the core")
        finally:
            if alive(pid):  # the hang watch did not kill it (the test failed)
                os.kill(pid, signal.SIGKILL)
        wait_back(node, "h/0", before)
        assert not alive(pid) and worker(node, 0, other_than=pid) != pid
        log = node.proc.log_path.read_text(errors="replace")
        assert f"its worker process {pid} is hung, killed and restarted" in log, node.proc.log()
        got = ok(act(node, episode, "counter", ZERO, seq=3))  # its state went with it
        assert (got["routing"], got["seq"], got["state_reset"]) == ("hit", 3, True), got
        assert (got["replayed"], count(got)) == (False, 1), got
        again = ok(act(node, episode, "counter", ZERO, seq=3))
        assert (again["replayed"], count(again)) == (True, 1), again
    finally:
        node.stop()
        redis.stop()


# ---- the core stopped ---------------------------------------------------------------------


def test_a_core_killed_takes_its_workers_and_the_next_node_binds_the_same_port(
    tmp_path: Path,
) -> None:
    redis = RedisServer(tmp_path).start()
    node = Node(tmp_path, "k", redis.url, devices="cpu:2", extra=PROCESS)
    try:
        node.start(timeout=60)
        first = [worker(node, 0), worker(node, 1)]
        core = node.pid()
        os.kill(core, signal.SIGKILL)  # the core alone: its workers die with it
        assert node.proc.popen is not None and node.proc.popen.wait(30) == -signal.SIGKILL
        wait_until(lambda: not any(alive(pid) for pid in first), 30,
                   "the killed core's workers gone")  # fmt: skip
        node.start(timeout=60)  # the same argv: the same port
        assert node.pid() != core
        second = [worker(node, 0), worker(node, 1)]
        assert not set(first) & set(second)
        got = ok(act(node, "after-kill", "demo_policy", ZERO, seq=1))
        assert (got["node"], got["seq"]) == ("k", 1), got
    finally:
        node.stop()
        redis.stop()


def test_a_graceful_stop_hands_the_episodes_over_with_their_state_and_leaves_no_worker(
    tmp_path: Path,
) -> None:
    """Two process nodes on one Redis; a serves three episodes, then stops on SIGTERM (to
    its process group, as a terminal or a service manager sends it): the episodes move to b
    with their state (their next step there continues the count, no reset said), a exits
    0, and none of its workers is left."""
    redis = RedisServer(tmp_path).start()
    extra = [*PROCESS, "--model", f"counter={counter_policy(tmp_path)}"]
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=extra)
    b = Node(tmp_path, "b", redis.url, devices="cpu:1", extra=extra)
    try:
        a.start(timeout=60)
        episodes = [f"leave-{i}" for i in range(3)]
        for ep in episodes:
            for seq in (1, 2, 3):
                got = ok(act(a, ep, "counter", ZERO, seq))
                assert (got["node"], count(got)) == ("a", seq), got
        b.start(timeout=60)
        workers = [worker(a, 0)]
        a.proc.send(signal.SIGTERM)
        assert a.proc.popen is not None and a.proc.popen.wait(60) == 0, a.proc.log()
        wait_until(lambda: not any(alive(pid) for pid in workers), 30, "a's worker gone")
        for ep in episodes:
            got = ok(act(b, ep, "counter", ZERO, seq=4))
            assert (got["node"], got["seq"], got["state_reset"]) == ("b", 4, False), got
            assert count(got) == 4, got
        died = [  # a worker that ended before the core stopped it
            line for line in a.proc.log_path.read_text(errors="replace").splitlines()
            if "its worker process" in line and ("exited with" in line or "killed by" in line)
        ]  # fmt: skip
        assert not died, died
    finally:
        a.stop()
        b.stop()
        redis.stop()


def test_a_fenced_node_has_every_worker_drop_its_states_at_once(tmp_path: Path) -> None:
    """A process node (2 devices, a 2 s lease) whose Redis stops answering fences itself
    once its lease runs out: it drops every episode's record, its lease generation goes up,
    and each device's worker process drops every state it held at once, without a step and
    while Redis is still away (``affinity_device_worker_states`` and ``_state_bytes`` fall
    to 0 on both devices). Once Redis is back the node registers anew, and each episode's
    next step starts clean and says ``state_reset``: never a count from a state of before."""
    redis = RedisServer(tmp_path).start()
    extra = [*PROCESS, "--model", f"counter={counter_policy(tmp_path)}", "--lease-ttl", "2"]
    p = Node(tmp_path, "p", redis.url, devices="cpu:2", extra=extra)
    devices = ("p/0", "p/1")
    try:
        p.start(timeout=60)
        episodes = [placed_on(p, d, f"fence-{d[-1]}", "counter", 1)[0] for d in devices]
        for ep in episodes:
            assert count(ok(act(p, ep, "counter", ZERO, seq=2))) == 2
        for d in devices:  # the gauges: what each worker process says it holds
            states = one(p, "affinity_device_worker_states", device=d)
            assert states >= 1, d
            assert one(p, "affinity_device_worker_state_bytes", device=d) >= 4 * states, d
        redis.proc.send(signal.SIGSTOP)
        try:
            wait_until(lambda: one(p, "affinity_fenced") == 1, 60, "the node fenced")
            wait_until(
                lambda: all(
                    one(p, "affinity_device_worker_states", device=d) == 0
                    and one(p, "affinity_device_worker_state_bytes", device=d) == 0
                    for d in devices
                ),
                60, "every worker process holding no state, Redis still away",
            )  # fmt: skip
            # dropped by the worker processes themselves, told of the fence (not freed one
            # by one as the core lets go of its handles)
            log = p.proc.log_path.read_text(errors="replace")
            for index in (0, 1):
                assert re.search(
                    rf"\[device {index}\]: the node dropped its episodes \(lease generation "
                    r"\d+\): \d+ state\(s\) of counter dropped here",
                    log,
                ), log[-3000:]
        finally:
            redis.proc.send(signal.SIGCONT)
        wait_until(lambda: one(p, "affinity_fenced") == 0, 60, "the node registered again")
        for ep in episodes:
            got = ok(act(p, ep, "counter", ZERO, seq=3))
            assert (got["seq"], got["state_reset"], count(got)) == (3, True, 1), got
            assert count(ok(act(p, ep, "counter", ZERO, seq=4))) == 2
    finally:
        p.stop()
        redis.stop()
