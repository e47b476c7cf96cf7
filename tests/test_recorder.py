"""The fleet-side recorder (issue 45): selection modes, the writer falling behind, a node
killed mid-episode, finalize's join of an episode that moved and one that was reset, and
replay's parity and error report. LeRobot's own reader: tests/test_recorder_lerobot.py."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from affinity import Claims, EventStream, Inventory, Keys, Registry, Settings
from affinity.cli import Context, build_parser, cmd_record, main
from affinity.dataset import Selection, finalize, picked, read_episodes
from affinity.models import Models
from node.models import DEMO_MODEL
from node.recorder import Recorder
from node.replay import replay
from tests.inproc import InProcNode, cluster, config
from tests.models import slow_policy

pytestmark = pytest.mark.anyio
pytest.importorskip("pyarrow", reason="the record extra (pyarrow) is not installed")


def obs(i: int) -> np.ndarray:
    return np.full((1, 8), 0.05 * i, np.float32) + np.arange(8, dtype=np.float32) / 100


def frame(r: Recorder, episode: str, seq: int, claim: str = "c1", token: int = 1) -> None:
    x = obs(seq)
    r.offer("m@1", "n/0", episode, claim, token, seq, False, {"obs": x}, {"actions": x * 2})


async def select(nodes: list[InProcNode], redis: Any, selection: Selection | None) -> str:
    """Set the fleet's selection of the nodes' model as ``affinity record`` does, and have
    each node read it as at its renewal; returns ``name@version``."""
    mid = next(iter(nodes[0].service.models.values()))[0]
    text = None if selection is None else selection.to_json()
    await Models(redis, Settings()).set_recording(mid.name, mid.version, text)
    for n in nodes:
        await n.service._read_recordings()
    return str(mid)


# -- selection -----------------------------------------------------------------------------


def test_each_selection_mode_records_what_it_names(tmp_path: Path) -> None:
    r = Recorder(str(tmp_path), "n", flush_frames=1000)
    modes = {
        "all": Selection("all"),
        "fraction": Selection("fraction", 0.25),
        "named": Selection("named", 1.0, frozenset({"e7", "e11"})),
    }
    for mode, selection in modes.items():
        r.select({"m@1": selection})
        for i in range(400):
            frame(r, f"e{i}", 1, claim=mode)
    took = {}
    for mode in ("all", "fraction", "named"):
        took[mode] = sorted(f.episode for m, f in r._queue if f.claim == mode)
    assert len(took["all"]) == 400
    assert took["fraction"] == sorted(f"e{i}" for i in range(400) if picked(f"e{i}", 0.25))
    assert 60 < len(took["fraction"]) < 140  # a hash, not every episode nor none
    assert took["named"] == ["e11", "e7"]
    # a model version with no selection records nothing, and asks again at the next step
    r.select({})
    frame(r, "later", 1, claim="x")
    assert all(f.episode != "later" for _, f in r._queue)
    r.select({"m@1": Selection("all")})
    frame(r, "later", 2, claim="x")
    assert any(f.episode == "later" for _, f in r._queue)


async def test_the_fleets_selection_reaches_every_node_and_off_stops_it(
    redis: Any, tmp_path: Path
) -> None:
    out = str(tmp_path / "rec")
    cfgs = [config("a", devices="cpu:1", record=out), config("b", devices="cpu:1", record=out)]
    async with cluster(redis, cfgs) as (nodes, _):
        a, b = nodes
        model = await select(nodes, redis, Selection("named", 1.0, frozenset({"wanted"})))
        for ep in ("wanted", "other"):
            for i in range(3):
                assert (
                    await b.act(episode_id=ep, inputs={"obs": obs(i).tolist()})
                ).status_code == 200
        await select(nodes, redis, None)
        assert a.service.recorder is not None and a.service.recorder.selections == {}
    recorded, episodes, dropped = read_episodes(out)
    assert recorded == model and dropped == 0
    assert [e.episode for e in episodes] == ["wanted"]
    assert [r["seq"] for r in episodes[0].rows] == [1, 2, 3]


# -- the writer falling behind ---------------------------------------------------------------


def test_a_writer_behind_drops_frames_counts_them_and_says_so(tmp_path: Path) -> None:
    counted: dict[str, int] = {}

    def count(outcome: str, n: int) -> None:
        counted[outcome] = counted.get(outcome, 0) + n

    r = Recorder(str(tmp_path), "n", queue_max=4, flush_frames=2, on_count=count)
    r.select({"m@1": Selection("all")})
    held, entered = threading.Event(), threading.Event()
    write = r._write_part

    def slow(seg: Any) -> None:  # the store stalls on the first part
        entered.set()
        held.wait(30)
        write(seg)

    r._write_part = slow  # type: ignore[method-assign]
    r.start()
    frame(r, "e", 1)
    frame(r, "e", 2)
    assert entered.wait(30)  # the writer is stuck writing frames 1-2
    for seq in range(3, 13):  # ten more steps: four fit in the queue, six are dropped
        frame(r, "e", seq)  # returns at once: a step never waits on the writer
    assert (r.queued, r.dropped) == (6, 6)
    held.set()
    r.close()
    assert counted == {"queued": 6, "dropped": 6, "written": 6}
    meta = json.loads(next(tmp_path.glob("segments/*/*/*/segment.json")).read_text())
    assert (meta["frames"], meta["dropped"]) == (6, 6)
    info = finalize(str(tmp_path), str(tmp_path / "ds"))
    assert info["total_frames"] == 6 and info["affinity"]["dropped_frames"] == 6


async def test_the_node_counts_recorded_frames_in_its_metrics(redis: Any, tmp_path: Path) -> None:
    async with cluster(redis, [config("a", devices="cpu:1", record=str(tmp_path))]) as ([a], _):
        await select([a], redis, Selection("all"))
        for i in range(3):
            await a.act(episode_id="m", inputs={"obs": obs(i).tolist()})
        rec = a.service.recorder
        assert rec is not None
        for _ in range(100):  # the writer counts on its own thread
            if rec.written == 3 or not rec.wait_idle():
                break
        rec.close()
        rec._count()
        written = a.service.metrics.recorded.labels("written")._value.get()
        queued = a.service.metrics.recorded.labels("queued")._value.get()
        assert (queued, written) == (3, 3)


def test_a_segment_evicted_while_idle_goes_on_after_its_parts(tmp_path: Path) -> None:
    r = Recorder(str(tmp_path), "n", flush_frames=2)
    r.select({"m@1": Selection("all")})
    for seq in (1, 2):
        frame(r, "e", seq)
    r._drain()
    r._segments.clear()  # what _flush_due does to a segment idle for _IDLE_S
    for seq in (3, 4):
        frame(r, "e", seq)
    r._drain()
    _, episodes, _ = read_episodes(str(tmp_path))
    assert [row["seq"] for row in episodes[0].rows] == [1, 2, 3, 4]


# -- a node killed mid-episode --------------------------------------------------------------


def test_a_segment_is_readable_up_to_its_last_complete_part(tmp_path: Path) -> None:
    r = Recorder(str(tmp_path), "n", flush_frames=4, flush_s=3600)
    r.select({"m@1": Selection("all")})
    r.start()
    for seq in range(1, 11):
        frame(r, "e", seq)
    for _ in range(100):
        if r.written == 8 or not r.wait_idle():
            break
    assert r.written == 8  # two parts of four; frames 9-10 wait for the next part
    # the node dies here (no close): a part it was writing has only its temporary name
    seg = next(tmp_path.glob("segments/*/*/*"))
    (seg / "part-000002.parquet.tmp").write_bytes(b"PAR1 half a part")
    _, episodes, _ = read_episodes(str(tmp_path))
    assert [row["seq"] for row in episodes[0].rows] == list(range(1, 9))
    np.testing.assert_array_equal(episodes[0].inputs["obs"][7], obs(8))


# -- one robot episode across nodes, resets, finalize, replay -------------------------------


async def record_fleet(redis: Any, out: str, mode: str = "all") -> dict[str, Any]:
    """Two nodes record: an episode that moves from a to b with its state mid-way, one whose
    claim is released under it (its next step says state_reset), and a plain one. Returns
    what the robots sent and got, per episode."""
    cfgs = [config("a", devices="cpu:1", record=out), config("b", devices="cpu:1", record=out)]
    sent: dict[str, list[Any]] = {}
    got: dict[str, list[Any]] = {}
    resets: dict[str, list[bool]] = {}
    async with cluster(redis, cfgs) as (nodes, _):
        a, b = nodes
        await select(nodes, redis, Selection(mode))

        async def step(via: InProcNode, ep: str, i: int, **kw: Any) -> dict[str, Any]:
            x = obs(i + 10 * len(sent))
            r = (await via.act(episode_id=ep, inputs={"obs": x.tolist()}, **kw)).json()
            sent.setdefault(ep, []).append(x.reshape(-1).tolist())
            got.setdefault(ep, []).append(np.asarray(r["outputs"]["actions"]).reshape(-1).tolist())
            resets.setdefault(ep, []).append(r["state_reset"])
            return dict(r)

        for k in range(16):  # an episode that lands on a (the others: one step each)
            moved = f"moved{k}"
            if (await step(a, moved, 0))["node"] == "a":
                break
        for i in range(1, 4):
            await step(b, moved, i)
        assert await a.service.owner.handovers.hand_over(moved, "move") == "moved"
        for i in range(4, 8):
            r = await step(a, moved, i)
            assert (r["node"], r["state_reset"]) == ("b", False)
        first = await step(a, "reset", 0)
        for i in range(1, 3):
            await step(a, "reset", i)
        owner = a if first["node"] == "a" else b
        await owner.service.claims.release("reset", first["token"], "operator")
        await owner.service.lease.renew_once()
        r = await step(a, "reset", 3, token=first["token"])
        assert r["state_reset"] is True
        for i in range(4, 6):
            await step(a, "reset", i)
        for i in range(5):
            await step(b, "plain", i)
    return {"sent": sent, "got": got, "resets": resets, "moved": moved}


async def test_finalize_joins_a_moved_episode_and_keeps_a_reset(redis: Any, tmp_path: Path) -> None:
    out = str(tmp_path / "rec")
    truth = await record_fleet(redis, out)
    info = finalize(out, str(tmp_path / "ds"))
    import pyarrow.parquet as pq

    eps = pq.read_table(tmp_path / "ds/meta/episodes/chunk-000/file-000.parquet").to_pylist()
    data = pq.read_table(tmp_path / "ds/data/chunk-000/file-000.parquet").to_pydict()
    by_id = {e["affinity/episode_id"]: e for e in eps}
    assert set(by_id) == set(truth["sent"])
    assert info["total_frames"] == sum(len(v) for v in truth["sent"].values())
    for ep, e in by_id.items():
        rows = range(e["dataset_from_index"], e["dataset_to_index"])
        f32 = np.float32
        recorded_obs = np.asarray([data["observation.obs"][i] for i in rows], f32)
        recorded_action = np.asarray([data["action"][i] for i in rows], f32)
        np.testing.assert_array_equal(recorded_obs, np.asarray(truth["sent"][ep], f32))
        np.testing.assert_array_equal(recorded_action, np.asarray(truth["got"][ep], f32))
        assert [data["state_reset"][i] for i in rows] == truth["resets"][ep]
        assert [data["frame_index"][i] for i in rows] == list(range(len(rows)))
    moved = by_id[truth["moved"]]
    assert moved["affinity/nodes"] == ["a", "b"] and moved["affinity/moved_at"] == [4]
    assert by_id["reset"]["affinity/state_reset_at"] == [3]
    assert len(by_id["reset"]["affinity/claims"]) == 2
    assert info["codebase_version"] == "v3.0" and info["features"]["action"]["shape"] == [8]


async def test_reset_mode_keeps_only_the_episodes_that_were_reset(
    redis: Any, tmp_path: Path
) -> None:
    out = str(tmp_path / "rec")
    truth = await record_fleet(redis, out, mode="reset")
    _, episodes, _ = read_episodes(out)
    assert [e.episode for e in episodes] == ["reset"]  # moved with its state: not a reset
    assert [r["state_reset"] for r in episodes[0].rows] == truth["resets"]["reset"]
    info = finalize(out, str(tmp_path / "ds"))
    assert info["total_episodes"] == 1 and info["total_frames"] == len(truth["sent"]["reset"])


async def test_replay_matches_the_same_version_bit_for_bit_and_reports_error_of_another(
    redis: Any, tmp_path: Path
) -> None:
    out = str(tmp_path / "rec")
    truth = await record_fleet(redis, out)
    # the command line: finalize, then replay --check (exit 0 only at parity)
    ds, cli = str(tmp_path / "ds"), ["--redis", "redis://127.0.0.1:1"]  # neither asks Redis
    assert await asyncio.to_thread(main, [*cli, "dataset", "finalize", out, "--out", ds]) == 0
    checked = [*cli, "replay", ds, "--check", "--model"]
    assert await asyncio.to_thread(main, [*checked, str(DEMO_MODEL)]) == 0
    other_file = str(slow_policy(tmp_path, repeats=1, width=8))
    assert await asyncio.to_thread(main, [*checked, other_file]) == 1
    same = await replay(str(tmp_path / "ds"), str(DEMO_MODEL))
    frames = sum(len(v) for v in truth["sent"].values())
    assert same.parity and same.frames == frames and same.max_error == 0.0
    assert same.model == same.recorded_model
    other = await replay(str(tmp_path / "ds"), other_file)
    assert not other.parity and other.max_error > 0
    doc = other.to_json()
    assert len(doc["per_joint_mean_abs_error"]) == len(truth["sent"])
    assert all(len(v) == 8 for v in doc["per_joint_mean_abs_error"].values())
    assert sum(len(v) for v in doc["per_step_max_abs_error"].values()) == frames


# -- episodes that end in an error -----------------------------------------------------------


class Failing:
    """A real ORT session whose runs raise when the input's first value is 99."""

    def __init__(self, spec: Any) -> None:
        from node.providers import ProviderSettings, build_session

        self.inner = build_session(DEMO_MODEL, spec, ProviderSettings()).session

    def run(self, names: Any, feed: Any) -> Any:
        if feed["obs"][0][0] == 99:
            raise RuntimeError("the policy failed on this input")
        return self.inner.run(names, dict(feed))


BAD = np.full((1, 8), 99, np.float32)


async def record_failures(redis: Any, out: str, mode: str) -> dict[str, Any]:
    """One node records three episodes: ``fails`` (three steps, then a step whose model run
    raises, and no more), ``recovers`` (its failed step is retried and kept) and ``plain``.
    Returns what the robots sent and got for ``fails``."""
    sent: list[np.ndarray] = []
    got: list[list[float]] = []
    cfgs = [config("a", devices="cpu:1", record=out)]
    failing = lambda s: (Failing(s), "CPU")  # noqa: E731
    async with cluster(redis, cfgs, session_factory=failing) as (nodes, _):
        await select(nodes, redis, Selection(mode))
        for i in range(3):
            r = await nodes[0].act(episode_id="fails", inputs={"obs": obs(i).tolist()})
            assert r.status_code == 200
            sent.append(obs(i))
            got.append(np.asarray(r.json()["outputs"]["actions"]).reshape(-1).tolist())
        r = await nodes[0].act(episode_id="fails", inputs={"obs": BAD.tolist()})
        assert (r.status_code, r.json()["error"]["code"]) == (500, "model_failure"), r.text
        sent.append(BAD)
        for i, x in enumerate([obs(0), BAD, obs(1), obs(2)]):
            r = await nodes[0].act(episode_id="recovers", inputs={"obs": x.tolist()})
            assert r.status_code == (500 if i == 1 else 200), r.text
        for i in range(3):
            r = await nodes[0].act(episode_id="plain", inputs={"obs": obs(i).tolist()})
            assert r.status_code == 200
    return {"sent": sent, "got": got}


async def test_error_mode_keeps_the_episode_that_ended_in_a_failed_step(
    redis: Any, tmp_path: Path
) -> None:
    out = str(tmp_path / "rec")
    truth = await record_failures(redis, out, "error")
    _, episodes, _ = read_episodes(out)
    assert [e.episode for e in episodes] == ["fails"]  # recovers and plain: not kept
    rec = episodes[0]
    assert [r["seq"] for r in rec.rows] == [1, 2, 3, 4]
    assert [r["error"] for r in rec.rows] == ["", "", "", "model_failure"]
    assert rec.error == {"code": "model_failure", "seq": 4, "node": "a", "frame": 3}
    for x, want in zip(rec.inputs["obs"], truth["sent"], strict=True):  # the failed step's too
        np.testing.assert_array_equal(x, want)
    assert np.isnan(rec.outputs["actions"][3]).all()
    info = finalize(out, str(tmp_path / "ds"))
    import pyarrow.parquet as pq

    (ep,) = pq.read_table(tmp_path / "ds/meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert (ep["affinity/error"], ep["affinity/error_seq"], ep["affinity/error_frame"]) == (
        "model_failure",
        4,
        3,
    )
    assert info["total_frames"] == 4 and info["affinity"]["failed_frames"] == [3]
    data = pq.read_table(tmp_path / "ds/data/chunk-000/file-000.parquet").to_pydict()
    f32 = np.float32
    np.testing.assert_array_equal(
        np.asarray(data["action"][:3], f32), np.asarray(truth["got"], f32)
    )
    assert np.isnan(np.asarray(data["action"][3], np.float32)).all()
    stats = json.loads((tmp_path / "ds/meta/stats.json").read_text())
    assert stats["action"]["count"] == [3] and not np.isnan(stats["action"]["mean"]).any()
    replayed = await replay(str(tmp_path / "ds"), str(DEMO_MODEL))  # the failed frame: skipped
    assert replayed.parity and replayed.frames == 3


async def test_a_failed_step_retried_and_kept_is_no_error_and_leaves_no_frame(
    redis: Any, tmp_path: Path
) -> None:
    out = str(tmp_path / "rec")
    await record_failures(redis, out, "all")
    _, episodes, _ = read_episodes(out)
    by_id = {e.episode: e for e in episodes}
    assert set(by_id) == {"fails", "recovers", "plain"}
    recovers = by_id["recovers"]
    assert recovers.error is None and [r["seq"] for r in recovers.rows] == [1, 2, 3]
    assert all(r["error"] == "" for r in recovers.rows)
    assert not any((x == 99).any() for x in recovers.inputs["obs"])
    assert by_id["plain"].error is None
    assert by_id["fails"].error is not None and by_id["fails"].error["frame"] == 3
    # reset+error keeps either; the error episode here (none was reset)
    out2 = str(tmp_path / "rec2")
    await record_failures(redis, out2, "reset+error")
    assert [e.episode for e in read_episodes(out2)[1]] == ["fails"]


def test_a_failed_step_with_the_writer_behind_keeps_its_error_not_its_inputs(
    tmp_path: Path,
) -> None:
    r = Recorder(str(tmp_path), "n", queue_max=2, flush_frames=1000)
    r.select({"m@1": Selection("error")})
    frame(r, "e", 1)
    frame(r, "e", 2)
    r.failed("m@1", "n/0", "e", "c1", 1, 3, "device_down", {"obs": obs(3)})  # queue full
    assert (r.queued, r.dropped) == (2, 1)
    r.start()
    r.close()
    assert r.written == 2
    _, (rec,), dropped = read_episodes(str(tmp_path))
    assert dropped == 1 and [row["seq"] for row in rec.rows] == [1, 2]
    assert rec.error == {"code": "device_down", "seq": 3, "node": "n", "frame": None}


async def test_the_error_mode_round_trips_through_the_cli_and_reaches_a_node(
    redis: Any, tmp_path: Path
) -> None:
    cfgs = [config("a", devices="cpu:1", record=str(tmp_path / "rec"))]
    async with cluster(redis, cfgs) as (nodes, _):
        mid = next(iter(nodes[0].service.models.values()))[0]
        recorder = nodes[0].service.recorder
        assert recorder is not None
        s = Settings()
        ctx = Context(Registry(redis, s), Inventory(redis, s), EventStream(redis, s),
                      Models(redis, s), Claims(redis, s), False, io.StringIO(), "test")  # fmt: skip
        for flags, mode in ((["--errors"], "error"), (["--reset", "--errors"], "reset+error"),
                            (["--reset"], "reset")):  # fmt: skip
            args = build_parser().parse_args(["record", str(mid), *flags])
            assert await cmd_record(args, ctx) == 0
            stored = await redis.hget(Keys("affinity").recording(mid.name), mid.version)
            assert Selection.from_json(stored).mode == mode
            await nodes[0].service._read_recordings()
            assert recorder.selections[str(mid)].mode == mode
    assert "reset+error" in ctx.out.getvalue()  # type: ignore[attr-defined]
