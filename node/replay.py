"""``affinity replay``: recorded episodes run open-loop, in this process, through the node's
own dispatcher (``node/dispatcher.py``: the same state feedback, control inputs and commit
rules) on an ONNX Runtime CPU session built as a node builds one (``node/providers.py``),
compared with the actions the fleet returned.

Runs in the operator's process on its event loop; the dispatcher's device thread runs the
model. A recorded frame that said ``state_reset`` (or a step number 1) starts a fresh claim
here too, so the replay resets where the fleet did. Parity: every replayed action equals
the recorded one bit for bit (same model file, CPU, one intra-op thread). A failed step's
frame (``affinity.failed_frames``: it has no action) is neither run nor compared.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from affinity.claims import Assignment
from node.catalog import parse_model_arg
from node.contract import load_contract
from node.devices import discover
from node.dispatcher import MultiGpuDispatcher
from node.providers import ProviderSettings, build_session
from node.step import Step

__all__ = ["Report", "main", "replay"]

Array = np.ndarray[Any, Any]


@dataclass
class Report:
    """What a replay found: per episode, per step, per joint absolute action error."""

    model: str
    recorded_model: str
    frames: int = 0
    seconds: float = 0.0
    fps: int = 0
    errors: dict[int, Array] = field(default_factory=dict)  # episode -> [steps, joints]

    @property
    def max_error(self) -> float:
        return max((float(e.max()) for e in self.errors.values() if e.size), default=0.0)

    @property
    def parity(self) -> bool:
        """Every replayed action equal to the recorded one, bit for bit."""
        return self.frames > 0 and self.max_error == 0.0

    @property
    def speed(self) -> float:
        """Replayed time over wall time (how many times faster than real time)."""
        return (self.frames / self.fps) / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "recorded_model": self.recorded_model,
            "frames": self.frames,
            "episodes": len(self.errors),
            "parity": self.parity,
            "max_abs_error": self.max_error,
            "per_joint_mean_abs_error": {
                str(ep): e.mean(axis=0).tolist() for ep, e in self.errors.items()
            },
            "per_step_max_abs_error": {
                str(ep): e.max(axis=1).tolist() for ep, e in self.errors.items()
            },
            "seconds": round(self.seconds, 4),
            "x_real_time": round(self.speed, 2),
        }


def _decode(value: Any, dtype: str) -> Array:
    if isinstance(value, dict):  # an image feature: PNG bytes
        from PIL import Image

        img = np.asarray(Image.open(io.BytesIO(value["bytes"])))
        return img[..., None] if img.ndim == 2 else img
    return np.asarray(value, dtype=dtype)


async def replay(dataset: str, model: str) -> Report:
    """Replay every episode of the LeRobotDataset at ``dataset`` (written by ``affinity
    dataset finalize``) through ``model`` (``--model``'s form: a packaged name or a file,
    ``[NAME=]FILE[@VERSION]``). Raises ``ValueError`` naming what does not fit."""
    import pyarrow.parquet as pq

    root = Path(dataset)
    info = json.loads((root / "meta" / "info.json").read_text())
    aff = info.get("affinity")
    if not aff:
        raise ValueError(f"{dataset}: not a dataset affinity recorded (no affinity metadata)")
    spec = parse_model_arg(model)
    contract = load_contract(spec.path)
    table = pq.read_table(sorted((root / "data").glob("*/*.parquet")))
    cols = table.to_pydict()
    features = info["features"]
    names: dict[str, str] = aff["names"]  # input or output name -> feature
    inputs = [s for s in contract.observation_inputs if s.name in names]
    missing = [s.name for s in contract.observation_inputs if s.name not in names]
    if missing:
        raise ValueError(f"{dataset}: the model takes {', '.join(missing)}, never recorded")
    outputs = [s.name for s in contract.returned_outputs if s.name in names]
    if not outputs:
        raise ValueError(f"{dataset}: none of the model's outputs was recorded")
    device = discover("cpu:1")[0]
    built = build_session(spec.path, device, ProviderSettings(), intra_op_threads=1)
    dev_id = "replay/0"
    d = MultiGpuDispatcher([dev_id], lambda _: built.session, contract)
    report = Report(str(spec.identity()), aff["model"], fps=int(info["fps"]))
    try:
        n = len(cols["index"])
        token = 0
        episode_steps: dict[int, list[Array]] = {}
        started = time.perf_counter()
        failed = set(aff.get("failed_frames", ()))  # a failed step's frame: no action
        for i in range(n):
            if int(cols["index"][i]) in failed:
                continue
            ep = int(cols["episode_index"][i])
            fresh = cols["frame_index"][i] == 0 or cols["state_reset"][i] or cols["seq"][i] == 1
            if fresh:
                token += 1
            feed = {}
            for s in inputs:
                key = names[s.name]
                shape = features[key]["shape"] if features[key]["dtype"] == "image" else None
                arr = _decode(cols[key][i], s.dtype)
                full = shape or aff["shapes"].get(key, list(arr.shape))
                arr = arr.reshape(full)
                feed[s.name] = arr[None] if contract.batch_axis else arr
            assignment = Assignment(
                f"replay-{ep}", "claimed" if fresh else "hit", dev_id, token, "", "", None,
                f"replay-{token}",
            )  # fmt: skip
            result = await d.step(Step(f"replay-{ep}", feed, 0.0), assignment)
            errs = []
            for out in outputs:
                got = np.asarray(result.outputs[out]).reshape(-1)
                want = np.asarray(cols[names[out]][i], dtype=got.dtype).reshape(-1)
                errs.append(np.abs(got.astype(np.float64) - want.astype(np.float64)))
            episode_steps.setdefault(ep, []).append(np.concatenate(errs))
            report.frames += 1
        report.seconds = time.perf_counter() - started
        report.errors = {ep: np.stack(rows) for ep, rows in episode_steps.items()}
    finally:
        d.close()
    return report


def run(dataset: str, model: str) -> Report:
    """:func:`replay` on a new event loop (the command line's)."""
    return asyncio.run(replay(dataset, model))


def main(argv: list[str] | None = None) -> int:
    """``python -m node.replay DATASET --model M [--check] [--json]``, what ``affinity replay``
    runs: the library's command line hands the replay to the node's package by process, so
    ``affinity`` never imports ``node``. Exit 0, or 1 with ``--check`` and no parity."""
    parser = argparse.ArgumentParser(prog="affinity replay", description=main.__doc__)
    parser.add_argument("dataset", metavar="DATASET")
    parser.add_argument("--model", required=True)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run(args.dataset, args.model)
    doc = report.to_json()
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{doc['frames']} frame(s) of {doc['episodes']} episode(s) recorded with "
              f"{doc['recorded_model']}, replayed with {doc['model']}: max |error| "
              f"{doc['max_abs_error']:.6g}, parity {'yes' if doc['parity'] else 'no'}, "
              f"{doc['x_real_time']}x real time")  # fmt: skip
    return 0 if report.parity or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
