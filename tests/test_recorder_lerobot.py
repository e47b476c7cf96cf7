"""LeRobot's own, unmodified ``LeRobotDataset`` (lerobot 0.4.4) reads what the fleet recorded
(issue 45): frame counts and values equal what the robots sent and received, an episode that
moved between nodes and one that was reset included, and a camera input as images.

LeRobot pulls torch, so it lives in an environment of its own: ``tests/lerobot_env.sh``
makes it at ``.venv-lerobot`` (or give its python as ``AFFINITY_LEROBOT_PYTHON``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from affinity.dataset import Selection, finalize
from node.catalog import ModelSpec
from node.models import VLA_DEMO_MODEL
from tests.inproc import cluster, config
from tests.test_recorder import record_fleet, select

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent
PYTHON = Path(os.environ.get("AFFINITY_LEROBOT_PYTHON") or ROOT / ".venv-lerobot/bin/python")


@pytest.fixture
def lerobot_python() -> Path:
    if not PYTHON.exists():
        pytest.skip(f"no lerobot environment at {PYTHON}: make it with tests/lerobot_env.sh")
    return PYTHON


def check(python: Path, dataset: Path, truth: dict[str, Any], tmp: Path) -> None:
    """Run tests/lerobot_check.py in the lerobot environment. Its output goes to a file and
    it runs in a session of its own, killed whole at the bound: a process it left behind
    can neither hold a pipe this test reads to the end nor outlive the test."""
    (tmp / "truth.json").write_text(json.dumps(truth))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf")}
    argv = [
        str(python),
        str(ROOT / "tests/lerobot_check.py"),
        str(dataset),
        str(tmp / "truth.json"),
    ]
    with open(tmp / "lerobot.out", "w+") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(600)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        said = out.read()
    assert code == 0, f"exit {code}: {said}"
    assert said.startswith("ok") or "\nok " in said, said


async def test_lerobot_reads_the_fleets_dataset_moved_and_reset_episodes_included(
    redis: Any, tmp_path: Path, lerobot_python: Path
) -> None:
    truth = await record_fleet(redis, str(tmp_path / "rec"))
    finalize(str(tmp_path / "rec"), str(tmp_path / "ds"))
    sent = {ep: [{"observation.obs": x} for x in xs] for ep, xs in truth["sent"].items()}
    check(lerobot_python, tmp_path / "ds", {**truth, "sent": sent, "images": {}}, tmp_path)


async def test_lerobot_reads_a_camera_input_as_images(
    redis: Any, tmp_path: Path, lerobot_python: Path
) -> None:
    out = str(tmp_path / "rec")
    vla = (ModelSpec(VLA_DEMO_MODEL, "vla_demo"),)
    rng = np.random.default_rng(3)
    sent: list[dict[str, Any]] = []
    got: list[Any] = []
    cfg = config("a", devices="cpu:1", model=VLA_DEMO_MODEL, models=vla, record=out)
    async with cluster(redis, [cfg]) as ([a], _):
        await select([a], redis, Selection("all"))
        for _ in range(4):
            step = {
                "image": rng.integers(0, 256, (1, 224, 224, 3), np.uint8),
                "wrist_image": rng.integers(0, 256, (1, 224, 224, 3), np.uint8),
                "state": rng.standard_normal((1, 8)).astype(np.float32),
            }
            r = await a.act(episode_id="cam", inputs={k: v.tolist() for k, v in step.items()})
            assert r.status_code == 200, r.text
            sent.append({f"observation.{k}": v[0].tolist() for k, v in step.items()})
            got.append(np.asarray(r.json()["outputs"]["actions"]).reshape(-1).tolist())
    info = finalize(out, str(tmp_path / "ds"))
    assert info["features"]["observation.image"]["dtype"] == "image"
    truth = {
        "sent": {"cam": sent}, "got": {"cam": got}, "resets": {"cam": [False] * 4},
        "images": {"observation.image": True, "observation.wrist_image": True},
    }  # fmt: skip
    check(lerobot_python, tmp_path / "ds", truth, tmp_path)
