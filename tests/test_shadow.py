"""Shadows (issue 47): a candidate version runs beside live episodes as ghost episodes
with their own state, never answering the robot; divergence measured step by step. In
process on fakeredis and a real redis-server; the CLI on a real one with a password."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis as sync_redis
from prometheus_client.parser import text_string_to_metric_families

from affinity import DeviceRegistration, Keys, ModelId, Settings
from affinity.cli import main
from affinity.registry import Registry
from affinity.shadows import PairTotals, Shadow, Shadows, selected
from node.catalog import ModelSpec
from node.devices import discover
from node.dispatcher import CrashSettings, MultiGpuDispatcher
from node.models import DEMO_MODEL
from node.providers import ProviderSettings, build_session
from node.shadow import SHADOW_LABELS, divergence
from tests.inproc import InProcNode, cluster, config
from tests.procs import RedisServer, wait_until
from tests.rollout import reference_rollout

pytestmark = pytest.mark.anyio
LIVE, CANDIDATE = "demo_policy@v1", "demo_policy@v2"
PAIR = (CANDIDATE, LIVE)


def shadowed(node_id: str = "a", **kw: Any) -> Any:
    """A node serving the demo policy as v1, able to run the same file as v2 beside it."""
    return config(
        node_id,
        devices="cpu:1",
        models=(ModelSpec(DEMO_MODEL, "demo_policy", "v1"),),
        shadow_models=(ModelSpec(DEMO_MODEL, "demo_policy", "v2"),),
        **kw,
    )


def observations(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


async def start(redis: Any, node: InProcNode, fraction: float = 1.0, cand: str = CANDIDATE) -> None:
    shadows = Shadows(redis, node.service.config.settings)
    await shadows.start(Shadow.checked(cand, LIVE, fraction))
    await node.service.shadow.sync()


async def step(node: InProcNode, episode: str, obs: np.ndarray, **kw: Any) -> dict[str, Any]:
    r = await node.act(episode_id=episode, model="demo_policy", inputs={"obs": obs.tolist()}, **kw)
    assert r.status_code == 200, r.text
    await node.service.shadow.idle()  # the ghost's step ran (or was skipped)
    return dict(r.json())


def actions(reply: dict[str, Any]) -> np.ndarray:
    return np.asarray(reply["outputs"]["actions"], np.float32)


def scrape(node: InProcNode) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest

    text = generate_latest(node.service.metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def swap_candidate_off_from(runner: Any, k: int) -> None:
    """Replace ``runner``'s candidate by the demo policy whose actions are pushed off by
    0.25 from its ``k``-th run on."""
    runs = [0]

    class FromK:
        def __init__(self, spec: Any) -> None:
            self.inner = build_session(DEMO_MODEL, spec, ProviderSettings()).session

        def get_inputs(self) -> Any:
            return self.inner.get_inputs()

        def get_outputs(self) -> Any:
            return self.inner.get_outputs()

        def run(self, names: Any, feed: Any) -> Any:
            out = self.inner.run(names, dict(feed))
            runs[0] += 1
            if runs[0] >= k:
                i = list(names).index("actions")
                out[i] = out[i] + np.float32(0.25)
            return out

    spec = discover("cpu:1")[0]
    old = runner.candidates[CANDIDATE]
    old.close()
    runner.candidates[CANDIDATE] = MultiGpuDispatcher(
        old.devices, lambda _d: FromK(spec), old.contract, table=runner.table, model=CANDIDATE
    )


async def test_an_identical_candidate_diverges_by_exactly_zero_and_the_live_replies_are_unchanged(
    redis: Any,
) -> None:
    episodes, steps = 4, 25
    obs = {e: observations(e, steps) for e in range(episodes)}
    async with cluster(redis, [shadowed()]) as ([a], _):
        await start(redis, a)
        svc = a.service
        for t in range(steps):
            for e in range(episodes):
                reply = await step(a, f"ep-{e}", obs[e][t])
                want = reference_rollout(DEMO_MODEL, obs[e][: t + 1])[-1]["actions"]
                # the robot's reply is the live version's, as without any shadow
                np.testing.assert_array_equal(actions(reply).reshape(want.shape), want)
                assert reply["model"] == LIVE
        totals = svc.shadow.totals[PAIR]
        assert (totals.compared, totals.skipped_total, totals.restarts) == (100, 0, 0)
        assert totals.max_abs == 0.0 and totals.l2_max == 0.0
        for e in range(episodes):  # the ghost's own state, kept step after step
            ghost = svc.shadow.table.get(f"ep-{e}")
            assert ghost is not None and ghost.seq == steps and ghost.model == CANDIDATE
            live = svc.table.state_of(f"ep-{e}")
            assert live is not None and live.keys() == ghost.state.keys()
            for k in live:
                np.testing.assert_array_equal(ghost.state[k], live[k])
        assert all(svc.table.get(f"ep-{e}").model == LIVE for e in range(episodes))  # type: ignore[union-attr]
        # the node writes its totals at the renewal; the fleet's figures add them up
        await svc.shadow.sync()
        fleet = await Shadows(redis, svc.config.settings).totals([PAIR])
        assert fleet[PAIR].to_json() == totals.to_json()
        seen = scrape(a)
        labels = (("candidate", CANDIDATE), ("live", LIVE))
        assert seen[("affinity_shadow_steps_total", (*labels, ("result", "compared")))] == 100
        assert seen[("affinity_shadow_max_abs", labels)] == 0.0
        assert seen[("affinity_shadow_ghosts", labels)] == episodes
        assert seen[("affinity_shadow_step_max_abs_count", labels)] == 100
        zero = [v for (n, lab), v in seen.items() if n == "affinity_shadow_step_max_abs_bucket"
                and float(dict(lab)["le"]) == 0.0]  # fmt: skip
        assert zero == [100]  # every step's divergence in the first bucket: exactly 0
        # the fleet page shows the same figures
        page = (await a.client.get("/shadows")).json()["shadows"]
        assert [(r["candidate"], r["live"], r["compared"], r["max_abs"]) for r in page] == [
            (CANDIDATE, LIVE, 100, 0.0)
        ]
        # nothing of the ghosts is in Redis: no claim, no load
        assert await redis.exists(Keys().episode("ep-0")) == 1  # the live one only


async def test_a_candidate_that_differs_at_step_k_shows_it_from_step_k(redis: Any) -> None:
    k, steps = 5, 9
    obs = observations(7, steps)
    async with cluster(redis, [shadowed()]) as ([a], _):
        svc = a.service
        swap_candidate_off_from(svc.shadow, k)
        await start(redis, a)
        seen = []
        for t in range(steps):
            await step(a, "ep-k", obs[t])
            seen.append(svc.shadow.ghosts["ep-k"].max_abs)
        assert seen[: k - 1] == [0.0] * (k - 1)
        assert all(v == pytest.approx(0.25) for v in seen[k - 1 :]), seen
        totals = svc.shadow.totals[PAIR]
        assert totals.compared == steps and totals.max_abs == pytest.approx(0.25)
        assert totals.max_abs_dims and max(totals.max_abs_dims) == pytest.approx(0.25)


async def test_a_ghost_without_capacity_is_skipped_and_says_its_restart(redis: Any) -> None:
    obs = observations(3, 6)
    async with cluster(redis, [shadowed()]) as ([a], _):
        svc = a.service
        await start(redis, a)
        for t in range(2):
            await step(a, "ep-c", obs[t])
        svc.shadow.max_in_flight = 0  # no spare capacity for one step
        await step(a, "ep-c", obs[2])
        ghost = svc.shadow.ghosts["ep-c"]
        assert ghost.restart and ghost.last_seq == 2  # its next run starts over
        svc.shadow.max_in_flight = 8
        for t in range(3, 6):
            await step(a, "ep-c", obs[t])
        totals = svc.shadow.totals[PAIR]
        assert totals.skipped == {"busy": 1} and totals.restarts == 1
        assert (totals.compared, totals.restarted_compared) == (2, 3)  # never mixed
        assert totals.max_abs == 0.0 and totals.restarted_max_abs > 0  # it restarted
        assert not ghost.continuous and ghost.last_seq == 6
        record = svc.shadow.table.get("ep-c")
        assert record is not None and record.seq == 3  # its state started over at step 4
        labels = (("candidate", CANDIDATE), ("live", LIVE))
        seen = scrape(a)
        assert seen[("affinity_shadow_steps_total", (*labels, ("result", "busy")))] == 1
        assert seen[("affinity_shadow_restarts_total", labels)] == 1
        restarted = (*labels, ("result", "compared_restarted"))
        assert seen[("affinity_shadow_steps_total", restarted)] == 3


async def test_a_ghost_step_waits_while_live_work_is_there_and_is_skipped_past_its_window(
    redis: Any,
) -> None:
    obs = observations(10, 4)
    async with cluster(redis, [shadowed()]) as ([a], _):
        svc = a.service
        svc.shadow.quiet_s = 0.0  # quiet as soon as no live step is on its way
        await start(redis, a)
        await step(a, "ep-q", obs[0])
        totals = svc.shadow.totals[PAIR]
        assert totals.compared == 1
        live = svc.dispatchers["demo_policy"].arrival()  # a live step on its way
        r = await a.act(episode_id="ep-q", model="demo_policy", inputs={"obs": obs[1].tolist()})
        assert r.status_code == 200
        ghost = svc.shadow.ghosts["ep-q"]
        for _ in range(20):  # the drain polls the node: the ghost's step never starts
            await asyncio.sleep(0.002)
        assert len(ghost.waiting) == 1 and not ghost.running and totals.compared == 1
        # its live episode's next step comes first: the waiting one and this one are skipped
        r = await a.act(episode_id="ep-q", model="demo_policy", inputs={"obs": obs[2].tolist()})
        assert r.status_code == 200
        assert ghost.waiting == [] and ghost.restart and totals.skipped == {"busy": 2}
        live.done()
        await step(a, "ep-q", obs[3])  # quiet again: it runs, its state started over
        assert (totals.compared, totals.restarted_compared, totals.restarts) == (1, 1, 1)
        assert not ghost.continuous and ghost.last_seq == 4


async def test_a_ghost_step_still_waiting_when_its_episode_ended_runs_before_its_ghost_goes(
    redis: Any,
) -> None:
    obs = observations(12, 2)
    async with cluster(redis, [shadowed()]) as ([a], _):
        svc = a.service
        svc.shadow.quiet_s = 0.0
        await start(redis, a)
        await step(a, "ep-w", obs[0])
        live = svc.dispatchers["demo_policy"].arrival()  # the node is not quiet
        body = {"obs": obs[1].tolist()}
        r = await a.act(episode_id="ep-w", model="demo_policy", inputs=body, end=True)
        assert r.status_code == 200 and svc.table.get("ep-w") is None  # the live one ended
        await svc.shadow.sync()  # a renewal meanwhile: the ghost's last step still waits
        assert svc.shadow.ghosts["ep-w"].waiting
        live.done()
        await svc.shadow.idle()
        totals = svc.shadow.totals[PAIR]
        assert (totals.compared, totals.skipped_total) == (2, 0)  # every step counted
        assert "ep-w" not in svc.shadow.ghosts and svc.shadow.table.get("ep-w") is None


async def test_a_ghost_step_running_when_its_ghost_is_freed_is_still_compared(redis: Any) -> None:
    import threading

    spec = discover("cpu:1")[0]
    running, go = threading.Event(), threading.Event()

    class Held:  # the demo policy, its second run held until ``go``
        runs = 0

        def __init__(self) -> None:
            self.inner = build_session(DEMO_MODEL, spec, ProviderSettings()).session

        def run(self, names: Any, feed: Any) -> Any:
            Held.runs += 1
            if Held.runs == 2:
                running.set()
                go.wait(30)
            return self.inner.run(names, dict(feed))

    obs = observations(13, 3)
    async with cluster(redis, [shadowed()]) as ([a], _):
        svc = a.service
        old = svc.shadow.candidates[CANDIDATE]
        old.close()
        svc.shadow.candidates[CANDIDATE] = MultiGpuDispatcher(
            old.devices, lambda _d: Held(), old.contract, table=svc.shadow.table,
            model=CANDIDATE,
        )  # fmt: skip
        await start(redis, a)
        await step(a, "ep-h", obs[0])
        r = await a.act(episode_id="ep-h", model="demo_policy", inputs={"obs": obs[1].tolist()})
        assert r.status_code == 200
        for _ in range(500):  # bounded: the ghost's step reaches the candidate's run
            if running.is_set():
                break
            await asyncio.sleep(0.01)
        assert running.is_set()
        svc.shadow.max_in_flight = 0  # the end finds no room: skipped, its ghost freed
        body = {"obs": obs[2].tolist()}
        r = await a.act(episode_id="ep-h", model="demo_policy", inputs=body, end=True)
        assert r.status_code == 200 and "ep-h" not in svc.shadow.ghosts
        go.set()
        await svc.shadow.idle()
        totals = svc.shadow.totals[PAIR]
        assert (totals.compared, totals.skipped) == (2, {"busy": 1})  # all three counted


async def test_stopping_the_shadow_frees_every_ghost_and_an_end_frees_its_own(redis: Any) -> None:
    obs = observations(5, 2)
    async with cluster(redis, [shadowed()]) as ([a], _):
        svc = a.service
        await start(redis, a)
        for e in range(3):
            for t in range(2):
                await step(a, f"ep-s{e}", obs[t])
        await step(a, "ep-s0", obs[0], end=True)  # an end ends its ghost at once
        assert set(svc.shadow.ghosts) == {"ep-s1", "ep-s2"}
        assert svc.shadow.table.get("ep-s0") is None
        svc.table.release("ep-s1", "idle")  # as an idle expiry: gone at the next renewal
        await svc.shadow.sync()
        assert set(svc.shadow.ghosts) == {"ep-s2"} and svc.shadow.table.get("ep-s1") is None
        stopped = await Shadows(redis, svc.config.settings).stop(CANDIDATE)
        assert stopped is not None and stopped.stopped
        await svc.shadow.sync()
        assert svc.shadow.ghosts == {} and len(svc.shadow.table) == 0
        await step(a, "ep-s2", obs[1])  # live steps go on, with no ghost
        assert svc.shadow.ghosts == {}
        assert svc.shadow.totals[PAIR].compared == 7


async def test_a_moved_episode_keeps_its_ghosts_state_and_diverges_by_zero(redis: Any) -> None:
    obs = observations(9, 8)
    async with cluster(redis, [shadowed("a"), shadowed("b")]) as ([a, b], _):
        await start(redis, a)
        await b.service.shadow.sync()
        ep = None
        for i in range(16):  # an episode a owns
            r = await step(a, f"mv-{i}", obs[0])
            if r["node"] == "a":
                ep = r["episode_id"]
                break
        assert ep is not None
        for t in range(1, 4):
            await step(a, ep, obs[t])
        assert await a.service.owner.handovers.hand_over(ep, "move") == "moved"
        assert a.service.shadow.ghosts == {} and a.service.shadow.table.get(ep) is None
        ghost = b.service.shadow.ghosts[ep]  # its state moved with the live record
        assert (ghost.last_seq, ghost.continuous, ghost.compared) == (4, True, 4)
        record = b.service.shadow.table.get(ep)
        assert record is not None and record.seq == 4 and record.model == CANDIDATE
        for t in range(4, 8):
            r = await step(b, ep, obs[t])
            assert (r["node"], r["seq"], r["state_reset"]) == ("b", t + 1, False)
            want = reference_rollout(DEMO_MODEL, obs[: t + 1])[-1]["actions"]
            np.testing.assert_array_equal(actions(r).reshape(want.shape), want)
        totals = b.service.shadow.totals[PAIR]
        assert (totals.compared, totals.restarts, totals.skipped_total) == (4, 0, 0)
        assert totals.max_abs == 0.0
        assert b.service.shadow.table.get(ep).seq == 8  # type: ignore[union-attr]


async def test_shadows_redis_lost_are_put_back_by_the_nodes(redis: Any) -> None:
    obs = observations(4, 3)
    async with cluster(redis, [shadowed()]) as ([a], _):
        svc = a.service
        await start(redis, a, fraction=0.5)
        await step(a, "ep-0", obs[0])
        await redis.delete(Keys().shadows)  # as Redis restarting empty
        await svc.shadow.sync()
        assert await redis.hget(Keys().shadows, CANDIDATE) == f"{LIVE} 0.5"
        assert svc.shadow.active[LIVE].fraction == 0.5
        await Shadows(redis, svc.config.settings).stop(CANDIDATE)
        await svc.shadow.sync()
        await svc.shadow.sync()  # a stop is a mark: nothing to put back
        assert await redis.hget(Keys().shadows, CANDIDATE) == f"{LIVE} 0.5 stopped"
        assert svc.shadow.active == {}


async def test_a_candidate_not_served_here_is_skipped_with_its_reason(redis: Any) -> None:
    async with cluster(redis, [shadowed()]) as ([a], _):
        await start(redis, a, cand="demo_policy@v3")
        await step(a, "ep-n", observations(1, 1)[0])
        assert a.service.shadow.totals[("demo_policy@v3", LIVE)].skipped == {"not_served": 1}
        assert a.service.shadow.ghosts == {}


def live_only(node_id: str = "a") -> Any:
    """A node serving the demo policy as v1, without its v2."""
    return config(node_id, devices="cpu:1", models=(ModelSpec(DEMO_MODEL, "demo_policy", "v1"),))


def runs_candidate(node_id: str = "b") -> Any:
    """A node able to run the demo policy's v2 as ghosts, serving no live episode of it."""
    return config(
        node_id,
        devices="cpu:1",
        models=(ModelSpec(DEMO_MODEL, "other_policy", "v1"),),
        shadow_models=(ModelSpec(DEMO_MODEL, "demo_policy", "v2"),),
    )


async def start_remote(redis: Any, a: InProcNode, b: InProcNode) -> None:
    """The shadow on, ``b`` saying it runs the candidate, then ``a`` reading that."""
    await Shadows(redis, a.service.config.settings).start(Shadow.checked(CANDIDATE, LIVE))
    await b.service.shadow.sync()
    await a.service.shadow.sync()


async def remote_step(
    a: InProcNode, b: InProcNode, episode: str, obs: np.ndarray, **kw: Any
) -> dict[str, Any]:
    reply = await step(a, episode, obs, **kw)  # its ghost step was sent to b (or not)
    await b.service.shadow.idle()  # and ran there
    return reply


async def test_a_ghost_runs_on_another_node_running_the_candidate_diverging_by_zero(
    redis: Any,
) -> None:
    episodes, steps = 3, 12
    obs = {e: observations(40 + e, steps) for e in range(episodes)}
    async with cluster(redis, [live_only(), runs_candidate()]) as ([a, b], _):
        await start_remote(redis, a, b)
        assert a.service.shadow.runners == {CANDIDATE: {"b": "http://b.test"}}
        for t in range(steps):
            for e in range(episodes):
                reply = await remote_step(a, b, f"ep-r{e}", obs[e][t])
                want = reference_rollout(DEMO_MODEL, obs[e][: t + 1])[-1]["actions"]
                np.testing.assert_array_equal(actions(reply).reshape(want.shape), want)
                assert reply["node"] == "a" and reply["model"] == LIVE
        assert a.service.shadow.ghosts == {} and len(a.service.shadow.table) == 0
        totals = b.service.shadow.totals[PAIR]
        assert (totals.compared, totals.skipped_total, totals.restarts) == (episodes * steps, 0, 0)
        assert totals.max_abs == 0.0 and totals.l2_max == 0.0
        for e in range(episodes):  # b keeps the ghost's own state, step after step
            ghost = b.service.shadow.table.get(f"ep-r{e}")
            assert ghost is not None and ghost.seq == steps and ghost.model == CANDIDATE
            live = a.service.table.state_of(f"ep-r{e}")
            assert live is not None
            for key in live:
                np.testing.assert_array_equal(ghost.state[key], live[key])
        await a.service.shadow.sync()
        await b.service.shadow.sync()  # b's totals are the fleet's: a skipped none
        fleet = await Shadows(redis, a.service.config.settings).totals([PAIR])
        assert fleet[PAIR].compared == episodes * steps and fleet[PAIR].skipped_total == 0
        # an end ends the remote ghost with it
        await remote_step(a, b, "ep-r0", obs[0][0], end=True)
        assert set(b.service.shadow.ghosts) == {"ep-r1", "ep-r2"}
        assert b.service.shadow.table.get("ep-r0") is None and "ep-r0" not in a.service.shadow.sent


async def test_a_remote_candidate_that_differs_at_step_k_shows_it_from_step_k(redis: Any) -> None:
    k, steps = 4, 8
    obs = observations(8, steps)
    async with cluster(redis, [live_only(), runs_candidate()]) as ([a, b], _):
        runner = b.service.shadow
        swap_candidate_off_from(runner, k)
        await start_remote(redis, a, b)
        seen = []
        for t in range(steps):
            await remote_step(a, b, "ep-rk", obs[t])
            seen.append(runner.ghosts["ep-rk"].max_abs)
        assert seen[: k - 1] == [0.0] * (k - 1)
        assert all(v == pytest.approx(0.25) for v in seen[k - 1 :]), seen
        assert runner.totals[PAIR].compared == steps


async def test_stopping_the_shadow_frees_the_remote_ghosts_and_an_idle_one_goes(
    redis: Any,
) -> None:
    obs = observations(9, 2)
    async with cluster(redis, [live_only(), runs_candidate()]) as ([a, b], _):
        await start_remote(redis, a, b)
        for e in range(3):
            for t in range(2):
                await remote_step(a, b, f"ep-rs{e}", obs[t])
        runner = b.service.shadow
        assert set(runner.ghosts) == {"ep-rs0", "ep-rs1", "ep-rs2"}
        runner.ghosts["ep-rs0"].touched -= runner.idle_s + 1  # its end was lost: idled out
        await runner.sync()
        assert set(runner.ghosts) == {"ep-rs1", "ep-rs2"} and runner.table.get("ep-rs0") is None
        await Shadows(redis, a.service.config.settings).stop(CANDIDATE)
        await runner.sync()
        await a.service.shadow.sync()
        assert runner.ghosts == {} and len(runner.table) == 0 and a.service.shadow.sent == {}
        await remote_step(a, b, "ep-rs1", obs[0])  # live steps go on, with no ghost
        assert runner.ghosts == {} and runner.totals[PAIR].compared == 6


async def test_an_unreachable_remote_node_is_counted_failed_and_live_replies_are_unchanged(
    redis: Any,
) -> None:
    steps = 4
    obs = observations(10, steps)
    async with cluster(redis, [live_only(), runs_candidate()]) as ([a, b], pool):
        await start_remote(redis, a, b)
        pool.down.add("b.test")
        for t in range(steps):
            reply = await remote_step(a, b, "ep-ru", obs[t])
            want = reference_rollout(DEMO_MODEL, obs[: t + 1])[-1]["actions"]
            np.testing.assert_array_equal(actions(reply).reshape(want.shape), want)
        assert a.service.shadow.totals[PAIR].skipped == {"failed": steps}
        assert b.service.shadow.ghosts == {}
        pool.down.clear()  # b back: the ghost starts there in mid-episode, said as a restart
        await a.service.shadow.sync()
        await remote_step(a, b, "ep-ru", obs[0])
        totals = b.service.shadow.totals[PAIR]
        assert (totals.compared, totals.restarted_compared, totals.restarts) == (0, 1, 1)


async def test_a_remote_node_that_never_answers_is_counted_failed_after_the_send_timeout(
    redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import node.shadow

    monkeypatch.setattr(node.shadow, "SEND_S", 0.01)
    obs = observations(12, 2)
    async with cluster(redis, [live_only(), runs_candidate()]) as ([a, b], pool):
        await start_remote(redis, a, b)

        async def hangs(*_: Any, **__: Any) -> Any:
            await asyncio.Event().wait()

        monkeypatch.setattr(pool, "post", hangs)
        for t in range(2):  # the live replies come; each ghost step's send gives up
            reply = await remote_step(a, b, "ep-rh", obs[t])
            want = reference_rollout(DEMO_MODEL, obs[: t + 1])[-1]["actions"]
            np.testing.assert_array_equal(actions(reply).reshape(want.shape), want)
        assert a.service.shadow.totals[PAIR].skipped == {"failed": 2}
        assert a.service.shadow.in_flight == 0


async def test_a_ghost_whose_node_went_away_restarts_on_another_running_the_candidate(
    redis: Any,
) -> None:
    obs = observations(11, 4)
    async with cluster(redis, [live_only(), runs_candidate("b"), runs_candidate("c")]) as (
        [a, b, c],
        pool,
    ):
        await Shadows(redis, a.service.config.settings).start(Shadow.checked(CANDIDATE, LIVE))
        for node in (b, c, a):
            await node.service.shadow.sync()
        by_id = {"b": b, "c": c}
        for t in range(2):
            await step(a, "ep-rg", obs[t])
            for node in (b, c):
                await node.service.shadow.idle()
        first = a.service.shadow.sent["ep-rg"].node
        other = by_id["c" if first == "b" else "b"]
        assert set(by_id[first].service.shadow.ghosts) == {"ep-rg"}
        pool.down.add(f"{first}.test")  # its node went away
        for t in range(2, 4):
            await step(a, "ep-rg", obs[t])
            await other.service.shadow.idle()
        assert a.service.shadow.totals[PAIR].skipped == {"failed": 1}
        totals = other.service.shadow.totals[PAIR]  # there: a start in mid-episode, said
        assert (totals.compared, totals.restarted_compared, totals.restarts) == (0, 1, 1)
        assert by_id[first].service.shadow.totals[PAIR].compared == 2


async def test_a_failing_candidate_never_touches_the_live_reply(redis: Any) -> None:
    class Broken:
        def run(self, names: Any, feed: Any) -> Any:
            raise RuntimeError("candidate crashed")

    obs = observations(2, 3)
    async with cluster(redis, [shadowed()]) as ([a], _):
        svc = a.service
        old = svc.shadow.candidates[CANDIDATE]
        old.close()
        svc.shadow.candidates[CANDIDATE] = MultiGpuDispatcher(
            old.devices, lambda _d: Broken(), old.contract, table=svc.shadow.table,
            model=CANDIDATE,
        )  # fmt: skip
        await start(redis, a)
        for t in range(3):
            reply = await step(a, "ep-f", obs[t])
            want = reference_rollout(DEMO_MODEL, obs[: t + 1])[-1]["actions"]
            np.testing.assert_array_equal(actions(reply).reshape(want.shape), want)
        assert svc.shadow.totals[PAIR].skipped == {"failed": 3}
        labels = (("candidate", CANDIDATE), ("live", LIVE), ("result", "failed"))
        assert scrape(a)[("affinity_shadow_steps_total", labels)] == 3
        assert svc.health.tracker(svc.device_ids[0]).down is False  # the live device is fine


async def test_a_candidates_device_that_went_down_is_probed_back_up(redis: Any) -> None:
    spec = discover("cpu:1")[0]

    class Flaky:  # the demo policy, crashing while ``broken``
        broken = True

        def __init__(self) -> None:
            self.inner = build_session(DEMO_MODEL, spec, ProviderSettings()).session

        def run(self, names: Any, feed: Any) -> Any:
            if Flaky.broken:
                raise RuntimeError("candidate crashed")
            return self.inner.run(names, dict(feed))

    obs = observations(8, 6)
    async with cluster(redis, [shadowed()]) as ([a], _):
        svc = a.service
        old = svc.shadow.candidates[CANDIDATE]
        old.close()
        candidate = svc.shadow.candidates[CANDIDATE] = MultiGpuDispatcher(
            old.devices, lambda _d: Flaky(), old.contract, table=svc.shadow.table,
            model=CANDIDATE, crashes=CrashSettings(failure_threshold=2, cooldown_s=0.0),
        )  # fmt: skip
        device = candidate.devices[0]
        await start(redis, a)
        for t in range(3):  # two failures take it down; the third is refused there
            await step(a, "ep-p", obs[t])
        assert candidate.tracker(device).down
        assert svc.health.tracker(device).down is False  # the live device is fine
        await svc.probe()  # the node's maintenance: a probe that fails keeps it down
        assert candidate.tracker(device).down
        Flaky.broken = False
        await svc.probe()
        assert not candidate.tracker(device).down  # back up, as a live device comes back
        for t in range(3, 6):
            await step(a, "ep-p", obs[t])
        totals = svc.shadow.totals[PAIR]
        assert totals.skipped == {"failed": 3} and totals.restarted_compared == 3


async def test_a_recorded_episode_carries_its_ghosts_actions_as_a_paired_stream(
    redis: Any, tmp_path: Path
) -> None:
    import pyarrow.parquet as pq

    from affinity.dataset import Selection, finalize
    from affinity.models import Models

    out = str(tmp_path / "rec")
    obs = observations(11, 5)
    async with cluster(redis, [shadowed(record=out)]) as ([a], _):
        svc = a.service
        await Models(redis, Settings()).set_recording("demo_policy", "v1", Selection().to_json())
        await svc._read_recordings()
        await start(redis, a)
        got = {}
        for ep in ("ep-r0", "ep-r1"):
            for t in range(5):
                if ep == "ep-r1" and t == 2:  # no room for this one: skipped, then restarted
                    svc.shadow.max_in_flight = 0
                got[(ep, t)] = actions(await step(a, ep, obs[t])).reshape(-1)
                svc.shadow.max_in_flight = 8
    info = finalize(out, str(tmp_path / "ds"))
    assert info["affinity"]["shadow"] == [CANDIDATE]
    assert info["features"]["shadow.action"]["shape"] == info["features"]["action"]["shape"]
    data = pq.read_table(tmp_path / "ds/data/chunk-000/file-000.parquet").to_pydict()
    eps = pq.read_table(tmp_path / "ds/meta/episodes/chunk-000/file-000.parquet").to_pylist()
    for e in eps:
        ep = e["affinity/episode_id"]
        for t, i in enumerate(range(e["dataset_from_index"], e["dataset_to_index"])):
            live = np.asarray(data["action"][i], np.float32)
            ghost = np.asarray(data["shadow.action"][i], np.float32)
            np.testing.assert_array_equal(live, got[(ep, t)])
            (max_abs,), continuous = data["shadow.max_abs"][i], data["shadow.continuous"][i]
            if ep == "ep-r0" or t < 2:  # an identical candidate, its state kept all along
                np.testing.assert_array_equal(ghost, live)
                assert (max_abs, continuous) == (0.0, True)
            elif t == 2:  # skipped: no ghost action for this frame
                assert np.isnan(ghost).all() and np.isnan(max_abs) and not continuous
            else:  # restarted: compared, kept apart as not continuous
                assert not np.isnan(ghost).any() and max_abs > 0 and not continuous


async def test_a_candidates_sessions_take_one_intra_op_thread(redis: Any) -> None:
    # the live model on every core (0): a ghost's run still never takes them
    async with cluster(redis, [shadowed(intra_op_threads=0)]) as ([a], _):
        candidate = a.service.shadow.candidates[CANDIDATE]
        session = candidate._devices[candidate.devices[0]].session
        assert session.get_session_options().intra_op_num_threads == 1  # type: ignore[attr-defined]


def test_the_fraction_picks_the_same_episodes_everywhere() -> None:
    picked = [e for e in range(2000) if selected(f"ep-{e}", 0.25)]
    assert 400 < len(picked) < 600
    assert picked == [e for e in range(2000) if selected(f"ep-{e}", 0.25)]
    assert all(selected(f"ep-{e}", 1.0) for e in range(10))


def test_divergence_per_action_dimension() -> None:
    live = {"actions": np.array([[1.0, 2.0, 3.0]], np.float32)}
    cand = {"actions": np.array([[1.0, 2.5, 1.0]], np.float32)}
    d = divergence(cand, live)
    assert d is not None and d.tolist() == [[0.0, 0.5, 2.0], [0.0, 0.5, 2.0]]
    assert divergence({"other": cand["actions"]}, live) is None
    assert divergence(live, live).tolist() == [[0.0] * 3, [0.0] * 3]  # type: ignore[union-attr]


def test_shadow_labels_are_documented() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    for family, labels in SHADOW_LABELS.items():
        row = next(line for line in doc.splitlines() if f"`{family}`" in line)
        for label, values in labels.items():
            assert f"`{label}`" in row
            if values != "shadow":
                for v in values:
                    assert f"`{v}`" in row, (family, v)


# ---- the CLI: authorization as every admin command (Redis' own) --------------------------


@pytest.fixture
def pw_redis(tmp_path: Path) -> Iterator[int]:
    server = RedisServer(tmp_path, extra=["--requirepass", "admin-pw"])
    server.proc.start()
    admin = sync_redis.Redis(port=server.port, password="admin-pw", decode_responses=True)
    try:
        wait_until(admin.ping, 10, "redis with a password")
        yield server.port
    finally:
        server.stop()


def test_the_cli_starts_stops_and_shows_shadows_with_the_admins_credentials(
    pw_redis: int, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://:admin-pw@127.0.0.1:{pw_redis}/0"
    wrong = f"redis://:nope@127.0.0.1:{pw_redis}/0"
    settings = Settings(redis_url=url)

    async def register() -> None:
        client = sync_redis.asyncio.Redis.from_url(url, decode_responses=True)
        try:
            registry = Registry(client, settings)
            await registry.new_fleet()
            device = DeviceRegistration(0, "cpu", "cpu", "", "", 0, capacity=4)
            await registry.register("n", "http://n:8000", [device],
                                    models={ModelId("demo_policy", "v1"): "{}"})  # fmt: skip
            await Shadows(client, settings).publish(
                "n", {PAIR: PairTotals(compared=7, skipped={"busy": 2}, max_abs=0.5)}
            )
        finally:
            await client.aclose()

    asyncio.run(register())

    def run(*argv: str, via: str = url) -> tuple[int, str, str]:
        code = main(["--redis", via, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    # without the admin's credentials nothing is read or written (exit 3)
    code, out, err = run("shadow", CANDIDATE, "--of", LIVE, via=wrong)
    assert code == 3 and "nope" not in err
    admin = sync_redis.Redis(port=pw_redis, password="admin-pw", decode_responses=True)
    assert not admin.exists(Keys().shadows)
    assert run("shadow", "status", via=wrong)[0] == 3
    # bad arguments (exit 2) and a live version no node serves (exit 1) change nothing
    assert run("shadow", CANDIDATE, "--of", "other@v1")[0] == 2
    assert run("shadow", CANDIDATE, "--of", LIVE, "--fraction", "0")[0] == 2
    assert run("shadow", CANDIDATE)[0] == 2
    assert run("shadow", CANDIDATE, "--of", "demo_policy@v9")[0] == 1
    assert not admin.exists(Keys().shadows)
    code, out, err = run("shadow", CANDIDATE, "--of", LIVE, "--fraction", "0.5")
    assert (code, err) == (0, "") and "shadows 0.5" in out
    assert admin.hget(Keys().shadows, CANDIDATE) == f"{LIVE} 0.5"
    other = run("shadow", "demo_policy@v3", "--of", LIVE)  # one candidate at a time
    assert other[0] == 2 and f"affinity shadow stop {CANDIDATE} first" in other[2]
    code, out, _ = run("shadow", "status", "--json")
    rows = json.loads(out)
    assert code == 0 and len(rows) == 1
    row = rows[0]
    assert (row["candidate"], row["live"], row["state"]) == (CANDIDATE, LIVE, "on")
    assert (row["compared"], row["skipped"], row["max_abs"]) == (7, 2, 0.5)
    code, out, _ = run("shadow", "status")
    assert code == 0 and "CANDIDATE" in out and CANDIDATE in out
    assert run("shadow", "stop", CANDIDATE, via=wrong)[0] == 3
    assert admin.hget(Keys().shadows, CANDIDATE) == f"{LIVE} 0.5"
    code, out, _ = run("shadow", "stop", CANDIDATE)
    assert code == 0 and "stopped" in out
    assert json.loads(run("shadow", "status", "--json")[1])[0]["state"] == "stopped"
    assert run("shadow", "stop", "demo_policy@v7")[0] == 1


# ---- real processes: a node, a redis-server, the CLI -------------------------------------


def test_a_real_node_shadows_through_the_cli_and_frees_its_ghosts_on_stop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import httpx

    from tests.procs import Node

    server = RedisServer(tmp_path).start()
    node = Node(
        tmp_path, "sh", server.url, devices="cpu:1",
        extra=["--model", "demo_policy=demo@v1", "--shadow-model", "demo_policy=demo@v2",
               "--lease-ttl", "3"],
    )  # fmt: skip
    try:
        node.start()

        def cli(*argv: str) -> tuple[int, str]:
            code = main(["--redis", server.url, *argv])
            out, _ = capsys.readouterr()
            return code, out

        assert cli("shadow", CANDIDATE, "--of", LIVE)[0] == 0

        def status() -> dict[str, Any]:
            code, out = cli("shadow", "status", "--json")
            assert code == 0
            return dict(json.loads(out)[0])

        obs = observations(11, 6)
        with httpx.Client(base_url=node.url, timeout=10) as client:
            # the node reads the shadow at a renewal (a third of its 3 s lease)
            probes = iter(range(10_000))

            def ghosts_on() -> bool:
                # a new episode each time: a ghost that began in mid-episode (the shadow
                # read after the episode's first step) counts apart, as restarted
                r = client.post(
                    "/act",
                    json={
                        "episode_id": f"probe-{next(probes)}",
                        "model": "demo_policy",
                        "inputs": {"obs": obs[0].tolist()},
                    },  # (no end: an ending step's ghost may be freed before it runs)
                )
                assert r.status_code == 200
                return status()["compared"] > 0

            wait_until(ghosts_on, 20, "the node to run ghosts")

            def counted() -> float:  # the node's own count of ghost steps, any result
                r = client.get("/metrics")
                for family in text_string_to_metric_families(r.text):
                    if family.name == "affinity_shadow_steps":
                        return sum(s.value for s in family.samples if s.name.endswith("_total"))
                return 0.0

            before = counted()
            for t, o in enumerate(obs):
                r = client.post(
                    "/act",
                    json={
                        "episode_id": "real",
                        "model": "demo_policy",
                        "inputs": {"obs": o.tolist()},
                    },
                )
                want = reference_rollout(DEMO_MODEL, obs[: t + 1])[-1]["actions"]
                got = np.asarray(r.json()["outputs"]["actions"], np.float32)
                np.testing.assert_array_equal(got.reshape(want.shape), want)
            # (a probe's ghost step may land after ``before`` was read: at least these)
            wait_until(lambda: counted() - before >= len(obs), 20, "the ghost steps")
            total = counted()

            def published() -> int:
                row = status()
                return int(row["compared"] + row["restarted_compared"] + row["skipped"])

            wait_until(lambda: published() == total, 20, "the renewal to publish")
            row = status()
            assert row["max_abs"] == 0.0 and row["l2_max"] == 0.0 and row["compared"] > 0

            def ghosts() -> float:
                r = client.get("/metrics")
                for family in text_string_to_metric_families(r.text):
                    if family.name == "affinity_shadow_ghosts":
                        return sum(s.value for s in family.samples)
                return -1.0

            assert ghosts() >= 1  # the ghost of "real"
            assert cli("shadow", "stop", CANDIDATE)[0] == 0
            wait_until(lambda: ghosts() == 0, 20, "the renewal to free every ghost")
            assert status()["state"] == "stopped"
    finally:
        node.stop()
        server.stop()
