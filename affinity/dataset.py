"""``affinity dataset finalize``: the recorder's segments (``node/recorder.py``) joined into
one LeRobotDataset v3, and :func:`read_episodes`, which ``affinity replay`` reads it with.

Runs in the operator's process, never in a node. Segments are grouped by episode id, ordered
by claim token (claims only grow), and their rows by ``seq``; a step recorded twice under
one claim (a reply that never reached the robot, undone, then run again) keeps its last
row. One robot episode is one dataset episode, however many nodes served it.

The layout is LeRobot's (``lerobot/datasets/utils.py``, codebase ``v3.0``):
``data/chunk-000/file-000.parquet``, ``meta/info.json``, ``meta/stats.json``,
``meta/tasks.parquet`` and ``meta/episodes/chunk-000/file-000.parquet``. Features: each
observation input as ``observation.<name>`` (an input already named ``observation.*`` keeps
its name), images (uint8 ``[H, W, 1|3|4]``) as PNG ``image`` features, other tensors flattened
to one axis (their shape in ``info.json``'s ``affinity.shapes``); the returned output as
``action`` (several: ``action.<name>``); then ``timestamp`` (seconds since the episode's
first step), ``frame_index``, ``episode_index``, ``index``, ``task_index``, and ``model``,
``node``, ``device``, ``seq``, ``state_reset``.

A step that failed at its owner (``Recorder.failed``) ends its segment in an error: its
frame (its inputs, an action of NaN, 0 for an integer action) stays only as its episode's
last frame, and the episode's metadata says ``affinity/error`` (the code),
``affinity/error_seq`` and ``affinity/error_frame`` (-1: none); ``info.json``'s
``affinity.failed_frames`` lists those frames' indices (statistics and replay skip them).

A shadowed episode's paired stream (the ghost steps of a candidate, ``node/shadow.py``)
joins its frames by ``seq``: ``shadow.action`` (``shadow.action.<name>`` beside several
outputs; NaN where no ghost step was compared), ``shadow.max_abs`` (its max-abs divergence
from the live action; NaN where none) and ``shadow.continuous`` (the ghost ran from the
episode's first step, never restarted); ``info.json``'s ``affinity.shadow`` names the
candidates. A recording without one has none of these features.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["KEEPS", "MODES", "Recorded", "Selection", "finalize", "picked", "read_episodes"]

Array = np.ndarray[Any, Any]
HIDDEN = ("state_in.", "control.", "rtc.")
CODEBASE_VERSION = "v3.0"
MODES = ("all", "fraction", "named", "reset", "error", "reset+error")
"""How ``affinity record`` selects a model version's episodes (``reset``: every episode is
written, and finalize keeps those in which a step started from clean state after the first:
a crash, a lapsed lease, a lost claim; ``error``: every episode is written, and finalize
keeps those whose segment on some node ended in a failed step, a 5xx such as
``model_failure`` or ``device_down``; ``reset+error``: either)."""
KEEPS = {"reset": ("reset",), "error": ("error",), "reset+error": ("reset", "error")}
"""The modes whose episodes are all written and kept by finalize on a condition."""


def picked(episode: str, fraction: float) -> bool:
    """Whether ``episode`` falls in ``fraction`` of all episodes: by a hash of its id, so
    every node agrees (an episode that moves stays recorded, or not)."""
    digest = hashlib.sha256(episode.encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


@dataclass(frozen=True)
class Selection:
    """Which episodes of one model version are recorded: ``all``, a ``fraction`` (by
    :func:`picked`), the ``named`` episode ids, or those that see a ``reset``, end a
    segment in an ``error``, or either (``reset+error``): all written, kept by finalize."""

    mode: str = "all"
    fraction: float = 1.0
    episodes: frozenset[str] = field(default_factory=frozenset)

    def wants(self, episode: str) -> bool:
        if self.mode == "all" or self.mode in KEEPS:
            return True
        if self.mode == "fraction":
            return picked(episode, self.fraction)
        return episode in self.episodes

    def to_json(self) -> str:
        return json.dumps(
            {"mode": self.mode, "fraction": self.fraction, "episodes": sorted(self.episodes)}
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Selection:
        """The selection ``affinity record`` wrote. Raises ``ValueError`` on anything else."""
        doc = json.loads(text)
        mode = str(doc.get("mode"))
        fraction = float(doc.get("fraction", 1.0))
        if mode not in MODES or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"not a recording selection: {doc!r}")
        return cls(mode, fraction, frozenset(str(e) for e in doc.get("episodes", ())))


@dataclass
class Recorded:
    """One episode as the robots saw it: its frames' inputs and outputs, in order."""

    episode: str
    inputs: dict[str, list[Array]] = field(default_factory=dict)
    outputs: dict[str, list[Array]] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)  # seq, t, state_reset, ...
    shadow: list[dict[str, Any] | None] = field(default_factory=list)
    """Per frame, the paired stream's row (candidate, max_abs, continuous, and the
    candidate's ``outputs``), or None: no ghost step of it was compared."""
    error: dict[str, Any] | None = None
    """The failed step a segment of it ended in: code, seq, node, and ``frame`` (the index
    of its frame, the failed step's inputs with no action, or None when not recorded)."""


def _is_image(shape: list[int], dtype: str) -> bool:
    return dtype == "|u1" and len(shape) == 3 and shape[-1] in (1, 3, 4)


def _step_shape(shape: list[int]) -> list[int]:
    """A step's tensor without its batch axis of 1."""
    return shape[1:] if len(shape) > 1 and shape[0] == 1 else shape


def _segments(fs: Any, root: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(fs.glob(f"{root}/segments/*/*/*/segment.json")):
        with fs.open(path, "r") as fh:
            meta = json.loads(fh.read())
        meta["dir"] = path.rsplit("/", 1)[0]
        out.append(meta)
    return out


def _read_segment(fs: Any, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of every complete part of a segment (a part still being written when its
    node died has no name yet and is not read)."""
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for part in sorted(fs.glob(f"{meta['dir']}/part-*.parquet")):
        with fs.open(part, "rb") as fh:
            table = pq.read_table(fh)
        rows += table.to_pylist()
    return rows


def _read_shadow(fs: Any, meta: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A segment's paired stream by seq (its candidate's outputs as arrays; a seq written
    twice keeps its last row), or {} for none."""
    import pyarrow.parquet as pq

    specs = meta.get("shadow_specs") or {}
    out: dict[int, dict[str, Any]] = {}
    for part in sorted(fs.glob(f"{meta['dir']}/shadow-*.parquet")):
        with fs.open(part, "rb") as fh:
            rows = pq.read_table(fh).to_pylist()
        for row in rows:
            outputs = {}
            for col, spec in specs.items():
                dtype, shape, value = np.dtype(spec["dtype"]), spec["shape"], row.get(col)
                if value is not None and len(value) == dtype.itemsize * math.prod(shape):
                    outputs[col.partition(":")[2]] = np.frombuffer(value, dtype).reshape(shape)
            keep = ("candidate", "max_abs", "continuous")
            out[int(row["seq"])] = {**{k: row[k] for k in keep}, "outputs": outputs}
    return out


def read_episodes(url: str, model: str | None = None) -> tuple[str, list[Recorded], int]:
    """The recorded episodes of ``model`` (``name@version``; None: the only one recorded)
    under ``url``, joined from their segments: (model, episodes in order of their first
    step, frames dropped). Raises ``ValueError`` naming what is wrong."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    metas = _segments(fs, root)
    models = sorted({m["model"] for m in metas})
    if not metas:
        raise ValueError(f"{url}: no recorded segments under {url}/segments")
    if model is None:
        if len(models) > 1:
            raise ValueError(f"{url}: segments of several models ({', '.join(models)}): name one")
        model = models[0]
    elif model not in models:
        raise ValueError(f"{url}: no segments of {model} (found {', '.join(models)})")
    by_episode: dict[str, list[dict[str, Any]]] = {}
    dropped = 0
    for meta in metas:
        if meta["model"] == model:
            by_episode.setdefault(meta["episode"], []).append(meta)
            dropped += int(meta.get("dropped", 0))
    out_specs: dict[str, dict[str, Any]] = {}  # a failed step's action: none returned
    for meta in metas:
        if meta["model"] == model:
            out_specs.update({k: v for k, v in meta["specs"].items() if k.startswith("out:")})
    episodes = []
    for episode, segs in by_episode.items():
        keeps = {k for m in segs for k in KEEPS.get(str(m.get("keep")), ())}
        rec = Recorded(episode)
        read = []
        for meta in segs:
            kept: dict[int, dict[str, Any]] = {}
            for row in _read_segment(fs, meta):
                kept[int(row["seq"])] = row  # a step recorded twice keeps its last row
            if kept:  # a claim moved live keeps its token: its seqs go on at the new node
                read.append((int(meta["token"]), min(kept), meta, kept))
        ghosts = {id(meta): _read_shadow(fs, meta) for meta in segs}
        ordered = [
            (meta, seq, kept[seq])
            for _, _, meta, kept in sorted(read, key=lambda r: r[:2])
            for seq in sorted(kept)
        ]
        # a failed step's frame stays only as the episode's last: steps after it (a retry,
        # the episode moved on) mean the robot never acted on it
        ordered = [
            o for i, o in enumerate(ordered) if i == len(ordered) - 1 or not o[2].get("error")
        ]
        for meta, seq, row in ordered:
            frame = _frame(row, meta["specs"], out_specs)
            if frame is None:
                continue  # a failed step's inputs that do not fit the recorded features
            for side, data in zip((rec.inputs, rec.outputs), frame, strict=True):
                for name, arr in data.items():
                    side.setdefault(name, []).append(arr)
            rec.shadow.append(ghosts[id(meta)].get(seq))
            rec.rows.append({
                "seq": seq, "t": row["t"], "state_reset": row["state_reset"],
                "device": row["device"], "node": meta["node"], "claim": meta["claim"],
                "dropped": int(meta.get("dropped", 0)), "error": row.get("error") or "",
            })  # fmt: skip
        ended = [m for m in sorted(segs, key=lambda m: int(m["token"])) if m.get("error")]
        if ended:
            err = ended[-1]["error"]
            last = rec.rows[-1] if rec.rows else None
            at = len(rec.rows) - 1 if last is not None and last["error"] else None
            rec.error = {"code": str(err["code"]), "seq": int(err["seq"]),
                         "node": ended[-1]["node"], "frame": at}  # fmt: skip
        if keeps:  # selected as "reset" or "error": kept only when it was one
            reset = "reset" in keeps and any(r["state_reset"] for r in rec.rows[1:])
            if not reset and not ("error" in keeps and rec.error is not None):
                continue
        if rec.rows:
            episodes.append(rec)
    episodes.sort(key=lambda r: r.rows[0]["t"])
    return model, episodes, dropped


def _frame(
    row: dict[str, Any], specs: dict[str, dict[str, Any]], out_specs: dict[str, dict[str, Any]]
) -> tuple[dict[str, Array], dict[str, Array]] | None:
    """A row's inputs and outputs as arrays; a failed step's action (it returned none) as
    NaN (0 for an integer action). None: a value missing or not of its feature's size."""
    ins: dict[str, Array] = {}
    outs: dict[str, Array] = {}
    failed = bool(row.get("error"))
    for col, spec in {**specs, **(out_specs if failed else {})}.items():
        side, _, name = col.partition(":")
        if side == "in" and name.startswith(HIDDEN):
            continue
        dtype, shape = np.dtype(spec["dtype"]), spec["shape"]
        value = row.get(col)
        if value is None and failed and side == "out":
            outs[name] = np.full(shape, np.nan if dtype.kind in "fc" else 0, dtype)
            continue
        if value is None or len(value) != dtype.itemsize * math.prod(shape):
            return None
        (ins if side == "in" else outs)[name] = np.frombuffer(value, dtype).reshape(shape)
    return ins, outs


def _feature_names(inputs: Iterable[str], outputs: list[str]) -> dict[str, str]:
    names = {f"in:{n}": n if n.startswith("observation.") else f"observation.{n}" for n in inputs}
    if len(outputs) == 1:
        names[f"out:{outputs[0]}"] = "action"
    else:
        names.update({f"out:{n}": f"action.{n}" for n in outputs})
    return names


def _png(image: Array) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    img = image[..., 0] if image.shape[-1] == 1 else image
    Image.fromarray(np.ascontiguousarray(img)).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _stats(values: Array) -> dict[str, Any]:
    v = values.astype(np.float64)
    v = v[~np.isnan(v).all(axis=tuple(range(1, v.ndim)))]  # a failed step's action: none
    if not len(v):
        v = np.zeros((1, *values.shape[1:]))
    return {
        "min": v.min(axis=0).tolist(), "max": v.max(axis=0).tolist(),
        "mean": v.mean(axis=0).tolist(), "std": v.std(axis=0).tolist(),
        "count": [int(v.shape[0])],
    }  # fmt: skip


def finalize(
    url: str, out: str, model: str | None = None, task: str = "", fps: int | None = None
) -> dict[str, Any]:
    """Write the LeRobotDataset v3 of ``model``'s recorded episodes under ``url`` to ``out``
    (a directory or an fsspec URL); returns its ``info.json``."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    model, episodes, dropped = read_episodes(url, model)
    first = episodes[0]
    in_names = sorted(first.inputs)
    out_names = sorted(first.outputs)
    names = _feature_names(in_names, out_names)
    if fps is None:  # the median step rate of the recording
        gaps = [b["t"] - a["t"] for e in episodes for a, b in zip(e.rows, e.rows[1:], strict=False)]
        gaps = [g for g in gaps if g > 0]
        fps = max(1, round(1.0 / float(np.median(gaps)))) if gaps else 1
    task = task or f"{model} as served by the fleet"
    features: dict[str, dict[str, Any]] = {}
    shapes: dict[str, list[int]] = {}
    columns: dict[str, list[Any]] = {k: [] for k in names.values()}
    meta_cols: dict[str, list[Any]] = {
        k: [] for k in ("timestamp", "frame_index", "episode_index", "index", "task_index",
                        "model", "node", "device", "seq", "state_reset")
    }  # fmt: skip
    shadowed = any(s is not None for rec in episodes for s in rec.shadow)
    if shadowed:  # the paired stream: the candidate's action and its divergence
        columns.update({f"shadow.{names[f'out:{n}']}": [] for n in out_names})
        columns["shadow.max_abs"] = []
        meta_cols["shadow.continuous"] = []
    candidates: set[str] = set()
    ep_rows: list[dict[str, Any]] = []
    failed: list[int] = []  # the dataset indices of failed steps' frames (no action)
    index = 0
    for ep_index, rec in enumerate(episodes):
        t0 = rec.rows[0]["t"]
        start = index
        for side, data in (("in", rec.inputs), ("out", rec.outputs)):
            for name, arrays in data.items():
                key = names[f"{side}:{name}"]
                shape = _step_shape(list(arrays[0].shape))
                dtype = arrays[0].dtype
                if _is_image(shape, dtype.str):
                    features[key] = {"dtype": "image", "shape": shape,
                                     "names": ["height", "width", "channels"]}  # fmt: skip
                    columns[key] += [{"bytes": _png(a.reshape(shape)), "path": None}
                                     for a in arrays]  # fmt: skip
                else:
                    size = int(math.prod(shape))
                    shapes[key] = shape
                    features[key] = {"dtype": dtype.name, "shape": [size], "names": None}
                    columns[key] += [a.reshape(size) for a in arrays]
        if shadowed:
            for name in out_names:
                key = f"shadow.{names[f'out:{name}']}"
                size = int(math.prod(_step_shape(list(rec.outputs[name][0].shape))))
                none = np.full(size, np.nan, np.float32)
                columns[key] += [
                    none if s is None or name not in s["outputs"]
                    else s["outputs"][name].astype(np.float32).reshape(size)
                    for s in rec.shadow
                ]  # fmt: skip
                features[key] = {"dtype": "float32", "shape": [size], "names": None}
            columns["shadow.max_abs"] += [
                np.array([np.nan if s is None else s["max_abs"]], np.float32) for s in rec.shadow
            ]
            features["shadow.max_abs"] = {"dtype": "float32", "shape": [1], "names": None}
            meta_cols["shadow.continuous"] += [s is not None and s["continuous"]
                                               for s in rec.shadow]  # fmt: skip
            candidates.update(s["candidate"] for s in rec.shadow if s is not None)
        nodes: list[str] = []
        moves: list[int] = []
        resets: list[int] = []
        for i, row in enumerate(rec.rows):
            if not nodes or nodes[-1] != row["node"]:
                if nodes:
                    moves.append(i)
                nodes.append(row["node"])
            if row["state_reset"]:
                resets.append(i)
            meta_cols["timestamp"].append(float(row["t"] - t0))
            meta_cols["frame_index"].append(i)
            meta_cols["episode_index"].append(ep_index)
            meta_cols["index"].append(index)
            meta_cols["task_index"].append(0)
            meta_cols["model"].append(model)
            meta_cols["node"].append(row["node"])
            meta_cols["device"].append(row["device"])
            meta_cols["seq"].append(row["seq"])
            meta_cols["state_reset"].append(bool(row["state_reset"]))
            index += 1
        claims = list(dict.fromkeys(r["claim"] for r in rec.rows))
        error = rec.error or {}
        if error.get("frame") is not None:
            failed.append(start + int(error["frame"]))
        ep_rows.append({
            "episode_index": ep_index, "tasks": [task], "length": len(rec.rows),
            "data/chunk_index": 0, "data/file_index": 0,
            "dataset_from_index": start, "dataset_to_index": index,
            "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0,
            "affinity/episode_id": rec.episode, "affinity/claims": claims,
            "affinity/nodes": nodes, "affinity/moved_at": moves,
            "affinity/state_reset_at": resets,
            "affinity/dropped_frames": sum(
                {r["claim"]: r["dropped"] for r in rec.rows}.values()
            ),
            "affinity/error": error.get("code", ""),
            "affinity/error_seq": int(error.get("seq", -1)),
            "affinity/error_frame": -1 if error.get("frame") is None else int(error["frame"]),
        })  # fmt: skip
    for key, kind in (("timestamp", "float32"), ("frame_index", "int64"),
                      ("episode_index", "int64"), ("index", "int64"), ("task_index", "int64"),
                      ("model", "string"), ("node", "string"), ("device", "string"),
                      ("seq", "int64"), ("state_reset", "bool"),
                      ("shadow.continuous", "bool")):  # fmt: skip
        if key in meta_cols:
            features[key] = {"dtype": kind, "shape": [1], "names": None}
    arrow: dict[str, Any] = {}
    for key, values in columns.items():
        ft = features[key]
        if ft["dtype"] == "image":
            image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
            arrow[key] = pa.array(values, image)
        else:
            flat = np.stack(values)
            arrow[key] = pa.FixedSizeListArray.from_arrays(
                pa.array(flat.reshape(-1)), ft["shape"][0]
            )
    types = {"float32": pa.float32(), "int64": pa.int64(), "string": pa.string(),
             "bool": pa.bool_()}  # fmt: skip
    for key, values in meta_cols.items():
        arrow[key] = pa.array(values, types[features[key]["dtype"]])
    ofs, oroot = fsspec.core.url_to_fs(out)
    for d in ("data/chunk-000", "meta/episodes/chunk-000"):
        ofs.makedirs(f"{oroot}/{d}", exist_ok=True)
    with ofs.open(f"{oroot}/data/chunk-000/file-000.parquet", "wb") as fh:
        pq.write_table(pa.table(arrow), fh)
    with ofs.open(f"{oroot}/meta/episodes/chunk-000/file-000.parquet", "wb") as fh:
        pq.write_table(pa.Table.from_pylist(ep_rows), fh)
    pandas_meta = {
        "index_columns": ["task"], "column_indexes": [], "pandas_version": "2.2.0",
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "columns": [
            {"name": "task", "field_name": "task", "pandas_type": "unicode",
             "numpy_type": "object", "metadata": None},
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
             "numpy_type": "int64", "metadata": None},
        ],
    }  # fmt: skip
    tasks = pa.table({"task_index": pa.array([0], pa.int64()), "task": pa.array([task])})
    tasks = tasks.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})
    with ofs.open(f"{oroot}/meta/tasks.parquet", "wb") as fh:
        pq.write_table(tasks, fh)
    stats = {}
    for key, values in columns.items():
        if features[key]["dtype"] == "image":
            continue  # LeRobot's image statistics are per channel over decoded frames
        stats[key] = _stats(np.stack(values))
    for key in ("timestamp", "frame_index", "episode_index", "index", "task_index", "seq"):
        stats[key] = _stats(np.asarray(meta_cols[key]).reshape(-1, 1))
    info = {
        "codebase_version": CODEBASE_VERSION, "robot_type": None,
        "total_episodes": len(episodes), "total_frames": index, "total_tasks": 1,
        "chunks_size": 1000, "data_files_size_in_mb": 100, "video_files_size_in_mb": 200,
        "fps": fps, "splits": {"train": f"0:{len(episodes)}"},
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": None, "features": features,
        "affinity": {"model": model, "recorded_from": url, "dropped_frames": dropped,
                     "failed_frames": failed, "shapes": shapes,
                     "shadow": sorted(candidates),
                     "names": {k.partition(":")[2]: v for k, v in names.items()}},
    }  # fmt: skip
    with ofs.open(f"{oroot}/meta/info.json", "w") as fh:
        fh.write(json.dumps(info, indent=2))
    with ofs.open(f"{oroot}/meta/stats.json", "w") as fh:
        fh.write(json.dumps(stats, indent=2))
    return info
