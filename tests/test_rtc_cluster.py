"""Real-time chunking through three real nodes serving ``rtc-demo`` (``--control-hz 50``),
random entry nodes, every front door (``/act`` JSON and msgpack, openpi's websocket with the
unmodified ``openpi-client``, KServe over HTTP and gRPC): each chunk equals the plain-numpy
reference of ``tests/test_rtc.py``; ``executed`` and ``inference_delay`` are estimated when
not sent; after a SIGKILL of the owner and after a graceful hand-over the next chunk has no
prefix and says ``state_reset: true``."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from affinity import Client, wire
from tests.procs import wait_until
from tests.test_cluster import Cluster, grpc_nodes
from tests.test_rtc import D, H, close, observation, own_chunk, reference

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]

NAME = "rtc_demo"
HZ = 50.0
MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, list[str]]]:
    tmp = tmp_path_factory.mktemp("rtc")
    with grpc_nodes(tmp, "r", ["--model", "rtc-demo", "--control-hz", str(HZ)]) as three:
        yield three


Answer = tuple[np.ndarray, dict[str, Any]]
Door = Callable[..., Answer]
"""(cluster, grpc addresses, entry index, episode, step index, image, state, rtc values)
-> (the chunk [H, D], the reply's facts with ``rtc`` as a map)."""


def act(binary: bool) -> Door:
    def door(
        c: Cluster,
        _: list[str],
        at: int,
        ep: str,
        i: int,
        image: np.ndarray,
        state: np.ndarray,
        values: dict[str, Any],
    ) -> Answer:
        doc = {"episode_id": ep, **values}
        url = c.nodes[at].url + "/act"
        if binary:
            doc["inputs"] = {"image": image[np.newaxis], "state": state[np.newaxis]}
            r = httpx.post(url, content=wire.encode(doc), timeout=20, headers=MSGPACK)
            assert r.status_code == 200, r.text
            reply = wire.decode(r.content)
        else:
            doc["inputs"] = {"image": image[np.newaxis].tolist(), "state": [state.tolist()]}
            r = httpx.post(url, json=doc, timeout=20)
            assert r.status_code == 200, r.text
            reply = r.json()
        return np.asarray(reply.pop("outputs")["actions"]), reply

    return door


def openpi(
    c: Cluster,
    _: list[str],
    at: int,
    ep: str,
    i: int,
    image: np.ndarray,
    state: np.ndarray,
    values: dict[str, Any],
) -> Answer:
    node = c.nodes[at]
    policy = WebsocketClientPolicy(f"ws://{node.host}:{node.port}/?episode_id={ep}")
    try:
        reply = policy.infer({"observation/image": image, "observation/state": state, **values})
    finally:
        policy._ws.close()
    return np.asarray(reply.pop("actions")), reply


def _kserve_facts(params: dict[str, Any]) -> dict[str, Any]:
    facts = {k: v for k, v in params.items() if not k.startswith("rtc_")}
    facts["rtc"] = {k.removeprefix("rtc_"): v for k, v in params.items() if k.startswith("rtc_")}
    return facts


def kserve(
    c: Cluster,
    _: list[str],
    at: int,
    ep: str,
    i: int,
    image: np.ndarray,
    state: np.ndarray,
    values: dict[str, Any],
) -> Answer:
    client = th.InferenceServerClient(f"{c.nodes[at].host}:{c.nodes[at].port}")
    try:
        tensors = [
            th.InferInput("image", [1, 224, 224, 3], "UINT8").set_data_from_numpy(image[None]),
            th.InferInput("state", [1, 8], "FP32").set_data_from_numpy(state[None]),
        ]
        r = client.infer(NAME, tensors, sequence_id=ep, sequence_start=i == 0,
                         parameters=values or None)  # fmt: skip
        return r.as_numpy("actions"), _kserve_facts(r.get_response()["parameters"])
    finally:
        client.close()


def grpc(
    c: Cluster,
    addresses: list[str],
    at: int,
    ep: str,
    i: int,
    image: np.ndarray,
    state: np.ndarray,
    values: dict[str, Any],
) -> Answer:
    client = tg.InferenceServerClient(addresses[at])
    try:
        tensors = [tg.InferInput("image", [1, 224, 224, 3], "UINT8"),
                   tg.InferInput("state", [1, 8], "FP32")]  # fmt: skip
        tensors[0].set_data_from_numpy(image[None])
        tensors[1].set_data_from_numpy(state[None])
        r = client.infer(NAME, tensors, sequence_id=ep, sequence_start=i == 0,
                         parameters=values or None)  # fmt: skip
        params = r.get_response().parameters
        raw = {k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in params.items()}
        return r.as_numpy("actions"), _kserve_facts(raw)
    finally:
        client.close()


DOORS: dict[str, Door] = {
    "act-json": act(False),
    "act-msgpack": act(True),
    "openpi": openpi,
    "kserve-http": kserve,
    "kserve-grpc": grpc,
}


@pytest.mark.parametrize("door", list(DOORS))
def test_every_chunk_continues_the_last_through_every_front_door(
    three: tuple[Cluster, list[str]], door: str
) -> None:
    cluster, addresses = three
    rng, entry = np.random.default_rng(len(door)), random.Random(door)
    ep, previous, entries, devices = f"rtc-{door}", None, set(), set()
    for i in range(6):
        image, state = observation(rng)
        executed, delay = int(rng.integers(0, H + 1)), int(rng.integers(0, H + 1))
        at = entry.randrange(3)
        entries.add(at)
        values = {"executed": executed, "inference_delay": delay}
        chunk, facts = DOORS[door](cluster, addresses, at, ep, i, image, state, values)
        want, used = reference(image, state, previous, executed, delay)
        close(chunk, want)
        assert facts["rtc"] == used and facts["state_reset"] is False, (i, facts)
        if previous is not None:  # the first d rows are the previous chunk's from executed on
            d = used["delay"]
            close_rows = np.asarray(chunk, np.float64).reshape(H, -1)[:d]
            np.testing.assert_allclose(close_rows, previous[executed : executed + d], atol=2e-5)
        previous = want
        devices.add(facts["device"])
    assert len(devices) == 1 and len(entries) > 1  # one owner, reached from several nodes
    if door.startswith("kserve"):  # sequence_start begins again: no prefix
        image, state = observation(rng)
        chunk, facts = DOORS[door](cluster, addresses, 0, ep, 0, image, state, {})
        assert facts["rtc"] == {"executed": 0, "delay": 0, "prefix_len": 0}
        close(chunk, own_chunk(image, state))


@pytest.mark.parametrize("door", list(DOORS))
def test_the_robots_pending_actions_start_a_new_episodes_chunk_through_every_front_door(
    three: tuple[Cluster, list[str]], door: str
) -> None:
    """After a crash nothing of the episode is left: its first step at the new owner sends
    the actions the robot has not executed (``pending``, in each door's own shape) and the
    chunk starts from them, so the motion does not jump."""
    cluster, addresses = three
    rng = np.random.default_rng(100 + len(door))
    pending = rng.standard_normal((6, D)).astype(np.float32)
    image, state = observation(rng)
    sent: object = json.dumps(pending.tolist()) if door.startswith("kserve") else pending.tolist()
    values = {"executed": 0, "inference_delay": 3, "pending": sent}
    chunk, facts = DOORS[door](cluster, addresses, 1, f"pending-{door}", 0, image, state, values)
    assert facts["rtc"] == {"executed": H - 6, "delay": 3, "prefix_len": 6}, facts
    padded = np.vstack([np.zeros((H - 6, D)), pending])  # the chunk the robot still runs
    want, _ = reference(image, state, padded, H - 6, 3)
    close(chunk, want)
    got = np.asarray(chunk, np.float64).reshape(H, D)
    np.testing.assert_allclose(got[:3], pending[:3], atol=1e-5)  # no jump


def _timed(
    cluster: Cluster, door: Door, ep: str, n: int, values: dict[str, Any]
) -> list[tuple[float, float, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]]:
    rng, entry = np.random.default_rng(7), random.Random(ep)
    steps = []
    for i in range(n):
        image, state = observation(rng)
        sent = time.monotonic()
        chunk, facts = door(cluster, [], entry.randrange(3), ep, i, image, state, values)
        steps.append((sent, time.monotonic(), image, state, chunk, facts))
    return steps


@pytest.mark.parametrize(("door", "hz"), [("act-msgpack", 200.0), ("openpi", HZ)])
def test_executed_and_delay_are_estimated_when_not_sent(
    three: tuple[Cluster, list[str]], door: str, hz: float
) -> None:
    """What the node estimated lies within what the client's own clock allows: the node's
    interval from its last reply to this step's arrival lies within [last request sent,
    this reply received] and contains [last reply received, this request sent]; its
    latencies are no longer than the client's round trips."""
    cluster, _ = three
    values = {"control_hz": hz} if hz != HZ else {}
    steps = _timed(cluster, DOORS[door], f"rtc-estimate-{door}", 6, values)
    previous = None
    for i, (sent, got, image, state, chunk, facts) in enumerate(steps):
        rtc = facts["rtc"]
        if i:
            last_sent, last_got = steps[i - 1][0], steps[i - 1][1]
            low = int(np.floor((sent - last_got) * hz))
            high = min(H, int(np.floor((got - last_sent) * hz)) + 1)
            assert low <= rtc["executed"] <= high, (i, rtc)
            round_trips = [b - a for a, b, *_ in steps[:i]]
            assert rtc["delay"] <= min(rtc["prefix_len"], int(np.ceil(max(round_trips) * hz)) + 1)
            assert rtc["prefix_len"] == H - rtc["executed"]
        want, used = reference(image, state, previous, rtc["executed"], rtc["delay"])
        assert used == rtc
        close(chunk, want)
        previous = want


def _step_until_moved(cluster: Cluster, ep: str, image: np.ndarray, state: np.ndarray,
                      away: str) -> dict[str, Any]:  # fmt: skip
    node = next(n for n in cluster.nodes if n.node_id != away)
    body = {"episode_id": ep, "executed": 2, "inference_delay": 3,
            "inputs": {"image": image[None].tolist(), "state": [state.tolist()]}}  # fmt: skip

    def moved() -> httpx.Response | None:
        # 503 owner_unreachable until the dead owner's lease lapses, then the episode moves
        resp = httpx.post(node.url + "/act", json=body, timeout=20)
        return None if resp.status_code == 503 else resp

    r = wait_until(moved, 40, "the episode moved", interval=0.2)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("how", ["sigkill", "handover"])
def test_a_crashed_owners_episode_starts_without_a_prefix_a_handed_over_one_with_it(
    three: tuple[Cluster, list[str]], how: str
) -> None:
    """After a crash the chunk is gone with the state: no prefix, said with state_reset.
    A graceful stop hands the episode over with its record, the last chunk sent included:
    the next chunk continues it, on another node, with no reset."""
    cluster, _ = three
    rng = np.random.default_rng(11)
    ep = f"rtc-{how}"
    door = DOORS["act-json"]
    for i in range(3):
        image, state = observation(rng)
        last, facts = door(cluster, [], i % 3, ep, i, image, state,
                           {"executed": 4, "inference_delay": 2})  # fmt: skip
    assert facts["rtc"]["prefix_len"] == H - 4
    owner = cluster.node(facts["node"])
    try:
        if how == "sigkill":
            owner.stop(signal.SIGKILL)
        else:
            owner.proc.send(signal.SIGTERM)  # graceful: hands its episodes over, then exits
            assert owner.proc.popen is not None and owner.proc.popen.wait(timeout=30) == 0
        image, state = observation(rng)
        after = _step_until_moved(cluster, ep, image, state, owner.node_id)
        assert after["node"] != owner.node_id
        if how == "sigkill":
            assert after["routing"] == "reassigned" and after["state_reset"] is True
            assert after["rtc"] == {"executed": 0, "delay": 0, "prefix_len": 0}
            close(np.asarray(after["outputs"]["actions"]), own_chunk(image, state))
        else:
            assert after["routing"] == "hit" and after["state_reset"] is False
            assert after["rtc"] == {"executed": 2, "delay": 3, "prefix_len": H - 2}
            previous = np.asarray(last, np.float64).reshape(H, -1)
            want, _ = reference(image, state, previous, 2, 3)
            close(np.asarray(after["outputs"]["actions"]), want)
    finally:
        owner.proc.start()  # back for the other tests of the module
        wait_until(owner.ready, 60, "owner back")


def test_concurrent_episodes_with_different_values_equal_the_reference(
    three: tuple[Cluster, list[str]],
) -> None:
    """Many episodes stepping at once (their steps batched where they meet on a device),
    each with its own executed and delay, each equal to its one-at-a-time reference."""
    cluster, _ = three
    episodes = [f"rtc-many-{i}" for i in range(8)]
    rng = np.random.default_rng(13)
    plan = {
        ep: [(*observation(rng), int(rng.integers(0, H + 1)), int(rng.integers(0, H + 1)))
             for _ in range(4)]
        for ep in episodes
    }  # fmt: skip
    got: dict[str, list[dict[str, Any]]] = {ep: [] for ep in episodes}

    async def drive(client: httpx.AsyncClient, ep: str) -> None:
        entry = random.Random(ep)
        for image, state, executed, delay in plan[ep]:
            doc = {"episode_id": ep, "executed": executed, "inference_delay": delay,
                   "inputs": {"image": image[None], "state": state[None]}}  # fmt: skip
            url = entry.choice(cluster.nodes).url + "/act"
            r = await client.post(url, content=wire.encode(doc), headers=MSGPACK)
            assert r.status_code == 200, r.text
            got[ep].append(wire.decode(r.content))

    async def everyone() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(drive(client, ep) for ep in episodes))

    asyncio.run(everyone())
    for ep in episodes:
        previous = None
        for (image, state, executed, delay), reply in zip(plan[ep], got[ep], strict=True):
            want, used = reference(image, state, previous, executed, delay)
            close(reply["outputs"]["actions"], want)
            assert reply["rtc"] == used
            previous = want


def test_bad_rtc_values_are_422_and_change_nothing(three: tuple[Cluster, list[str]]) -> None:
    cluster, _ = three
    r = cluster.redis.client()
    image, state = observation(np.random.default_rng(17))
    for values, field in [
        ({"executed": H + 1}, "executed"),
        ({"inference_delay": -1}, "inference_delay"),
        ({"control_hz": 0}, "control_hz"),
        ({"executed": 1.5}, "executed"),
    ]:
        resp = httpx.post(cluster.nodes[0].url + "/act", timeout=20, json={
            "episode_id": "rtc-bad", "inputs": {"image": image[None].tolist(),
                                                "state": [state.tolist()]}, **values})  # fmt: skip
        assert resp.status_code == 422 and resp.json()["error"]["field"] == field, resp.text
    assert r.get("{affinity}:episode:rtc-bad") is None


def test_the_python_client_sends_where_the_robot_is(three: tuple[Cluster, list[str]]) -> None:
    """``affinity.Client``'s ``executed`` and ``inference_delay`` reach the model: each chunk
    equals the reference, and the step says what it ran with (``Step.rtc``, ``Step.model``)."""
    cluster, _ = three
    rng = np.random.default_rng(7)
    previous = None
    with Client([node.url for node in cluster.nodes]) as client:
        for i in range(4):
            image, state = observation(rng)
            executed, delay = int(rng.integers(0, H + 1)), int(rng.integers(0, H + 1))
            step = client.act(
                "rtc-client",
                {"image": image[np.newaxis], "state": state[np.newaxis]},
                executed=executed,
                inference_delay=delay,
            )
            want, used = reference(image, state, previous, executed, delay)
            close(step.outputs["actions"], want)
            assert step.rtc == used and step.seq == i + 1, (i, step)
            assert step.model is not None and step.model.startswith(NAME + "@")
            previous = want
