"""The fleet-side recorder (``affinity-node --record URL``): every selected episode's steps,
as this node served them, written as segments that ``affinity dataset finalize`` joins
into one LeRobotDataset v3 (``affinity/dataset.py``).

Two sides. :meth:`Recorder.offer` runs on the commit path (a device's worker thread, or
the event loop's for an inline run, ``node/commit.py``): it decides once per claim whether
the episode is recorded (:class:`Selection`, read from Redis by the node's main loop after
each lease renewal, never on a step), then appends a reference to the step's inputs and
outputs to a bounded deque; it never copies an array, never blocks and never raises. When
the deque is full the frame is dropped and counted (``affinity_record_frames_total``
``outcome="dropped"``, and the segment's ``dropped`` count, which finalize puts in the
dataset's metadata). The writer thread (:meth:`Recorder._run`, thread ``affinity-recorder``)
is the only reader: it copies each array once, into a Parquet row.

Segments: one per (claim) under ``<URL>/segments/<name>@<version>/<node>/<claim>/``;
``part-NNNNNN.parquet`` files of at most ``flush_frames`` rows each, written when that many
frames wait or ``flush_s`` after the oldest one came, and ``segment.json`` beside them. A
part is written whole before its name exists (a temporary name then a rename on a local
directory; one object put on an object store), so a node killed mid-episode leaves every
part it finished readable and loses only the frames still waiting (at most ``flush_frames``
or ``flush_s`` of them). Hazard: arrays handed to :meth:`offer` must not be written to
afterwards (the node never writes to a step's inputs or returned outputs once committed).

A step that fails at its owner (a 5xx: ``model_failure``, ``device_down``, ...) is never
committed: the owner hands it to :meth:`Recorder.failed` (event loop, after the refusal,
never on a step that succeeds). Its inputs (the references the step ran with, copied once
by the writer like any frame's) become a row with no outputs and its ``error`` code, and
its segment says ``error`` in ``segment.json`` (with the seq) and is written at once. A
later step kept in the same segment clears it: the segment ended in an error only when the
failed step was its last. When the queue is full the inputs are dropped, the error is not.

A shadowed episode (``node/shadow.py``) adds a paired stream: each compared ghost step's
outputs and divergence (:meth:`Recorder.offer_shadow`, event loop, after the live step's
frame), written to the live claim's segment as ``shadow-NNNNNN.parquet`` parts beside its
``part-*`` ones (never mixed in: a live frame is never held back for its ghost), which
finalize joins to the live frames by ``seq``.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from affinity.dataset import Selection

__all__ = ["Recorder"]

log = logging.getLogger("affinity.node")

Array = np.ndarray[Any, Any]
_SAFE = re.compile(r"[^A-Za-z0-9._@-]")
_IDLE_S = 300.0  # seconds a segment with nothing waiting stays in memory
_CHOSEN_MAX = 100_000  # claims whose choice is remembered before the memory starts over


@dataclass(slots=True)
class _Frame:
    episode: str
    claim: str
    token: int
    seq: int
    t: float
    state_reset: bool
    device: str
    inputs: Mapping[str, Array]
    outputs: Mapping[str, Array]
    mode: str  # the selection's mode that chose its claim
    error: str = ""  # a failed step's code (no outputs; no inputs when they were dropped)
    shadow: tuple[str, float, bool] | None = None  # a ghost step's: candidate, max-abs,
    # continuous (its outputs are the candidate's, it has no inputs)


@dataclass
class _Segment:
    model: str
    episode: str
    claim: str
    token: int
    device: str
    path: str
    mode: str
    rows: list[_Frame] = field(default_factory=list)
    ghosts: list[_Frame] = field(default_factory=list)  # the paired stream's waiting rows
    since: float = 0.0  # monotonic time of the oldest waiting row
    parts: int = 0
    frames: int = 0
    dropped: int = 0
    specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    shadow_parts: int = 0
    shadow_specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: dict[str, Any] | None = None  # the failed step it ended in: code, seq


class Recorder:
    """Records the selected episodes' steps under ``url`` (a directory or an fsspec URL).
    ``offer`` is the step path's side; the rest runs on the writer thread or the main loop.
    """

    def __init__(
        self,
        url: str,
        node_id: str,
        *,
        queue_max: int = 4096,
        flush_frames: int = 512,
        flush_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        on_count: Callable[[str, int], None] | None = None,
    ) -> None:
        import fsspec  # the optional "record" extra: imported only when recording is on

        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.url = url
        self.node_id = node_id
        self.queue_max = queue_max
        self.flush_frames = flush_frames
        self.flush_s = flush_s
        self.clock = clock
        self.selections: dict[str, Selection] = {}
        """``name@version`` -> its selection; replaced whole by :meth:`select`."""
        self._queue: collections.deque[tuple[str, _Frame]] = collections.deque()
        self._chosen: dict[tuple[str, str], str | None] = {}  # claim -> its mode (None: no)
        self._drops: dict[tuple[str, str], int] = {}
        self.queued = 0
        self.dropped = 0
        self.written = 0
        self._counted = {"queued": 0, "dropped": 0, "written": 0}
        self.on_count = on_count
        """Called on the writer thread with (outcome, increase) for the metrics."""
        self._segments: dict[tuple[str, str], _Segment] = {}
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="affinity-recorder", daemon=True)

    def start(self) -> None:
        self.fs.makedirs(f"{self.root}/segments", exist_ok=True)
        self._thread.start()

    def select(self, selections: Mapping[str, Selection]) -> None:
        """The fleet's selections as last read (main loop); choices made stay as made."""
        self.selections = dict(selections)

    # the step path -------------------------------------------------------------------

    def offer(
        self,
        model: str,
        device: str,
        episode: str,
        claim: str,
        token: int,
        seq: int,
        state_reset: bool,
        inputs: Mapping[str, Array],
        outputs: Mapping[str, Array],
    ) -> None:
        """Hand one committed step to the writer, or drop it when the writer is behind.
        Never blocks, copies nothing, raises nothing."""
        key = (episode, claim)
        chosen = self._chosen.get(key)
        if chosen is None:
            chosen = self._choose(model, episode, key)
        if chosen is None or not self._room(key):
            return
        frame = _Frame(episode, claim, token, seq, self.clock(), state_reset, device,
                       inputs, outputs, chosen)  # fmt: skip
        self._queue.append((model, frame))

    def _room(self, key: tuple[str, str]) -> bool:
        """Whether the queue takes one more frame of the claim ``key`` (counted as queued);
        False: it is full, and the frame is counted as dropped."""
        if len(self._queue) >= self.queue_max:
            self.dropped += 1
            self._drops[key] = self._drops.get(key, 0) + 1
            return False
        self.queued += 1
        return True

    def offer_shadow(
        self,
        model: str,
        episode: str,
        claim: str,
        seq: int,
        candidate: str,
        outputs: Mapping[str, Array],
        max_abs: float,
        continuous: bool,
    ) -> None:
        """Hand the paired stream's row of live step ``seq`` of ``episode`` under ``claim``
        (of ``model``): ``candidate``'s ``outputs`` for it, their max-abs divergence from
        the live ones, and whether the ghost ran from the episode's first step unbroken.
        Only for a claim already recorded; never blocks, copies nothing, raises nothing."""
        key = (episode, claim)
        chosen = self._chosen.get(key)
        if chosen is None or not self._room(key):
            return
        frame = _Frame(episode, claim, 0, seq, self.clock(), False, "", {}, outputs, chosen,
                       shadow=(candidate, max_abs, continuous))  # fmt: skip
        self._queue.append((model, frame))

    def _choose(self, model: str, episode: str, key: tuple[str, str]) -> str | None:
        """The mode that records this claim, or None (remembered; None also when the model
        version has no selection now: asked again at the claim's next step)."""
        selection = self.selections.get(model)
        if selection is None:
            return None
        if len(self._chosen) >= _CHOSEN_MAX:
            self._chosen.clear()
        chosen = selection.mode if selection.wants(episode) else None
        self._chosen[key] = chosen
        return chosen

    def failed(
        self,
        model: str,
        device: str,
        episode: str,
        claim: str,
        token: int,
        seq: int,
        code: str,
        inputs: Mapping[str, Array],
    ) -> None:
        """A step of ``episode`` failed at its owner with ``code`` (a 5xx) and was never
        committed: its segment ends in an error until a later step is kept. ``seq``: the
        seq it would have had. Never blocks, copies nothing, raises nothing."""
        key = (episode, claim)
        chosen = self._chosen.get(key)
        if chosen is None:
            chosen = self._choose(model, episode, key)
        if chosen is None:
            return
        if len(self._queue) >= self.queue_max:  # the error is said; its inputs dropped
            self.dropped += 1
            self._drops[key] = self._drops.get(key, 0) + 1
            inputs = {}
        else:
            self.queued += 1
        frame = _Frame(episode, claim, token, seq, self.clock(), False, device, inputs, {},
                       chosen, code)  # fmt: skip
        self._queue.append((model, frame))

    # the writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            moved = self._drain()
            self._flush_due(force=stopping)
            self._count()
            if stopping and not self._queue:
                return
            if not moved:
                self._idle.set()
                self._stop.wait(0.02)

    def _drain(self) -> int:
        n = 0
        queue = self._queue
        while queue:
            model, frame = queue.popleft()
            n += 1
            seg = self._segment(model, frame)
            if frame.shadow is not None:
                if not seg.rows and not seg.ghosts:
                    seg.since = time.monotonic()
                seg.ghosts.append(frame)
                if len(seg.ghosts) >= self.flush_frames:
                    self._write(seg)
                continue
            if not seg.token:  # made for a ghost's frame (which has neither) first
                seg.token, seg.device = frame.token, frame.device
            if frame.error:
                seg.error = {"code": frame.error, "seq": frame.seq}
            elif seg.error is not None and frame.seq >= seg.error["seq"]:
                seg.error = None  # a step kept after the failed one: not how it ended
            if frame.inputs or not frame.error:
                if not seg.rows:
                    seg.since = time.monotonic()
                seg.rows.append(frame)
            if frame.error or len(seg.rows) >= self.flush_frames:
                self._write(seg)  # a failed step at once: a node that dies next keeps it
        return n

    def _segment(self, model: str, frame: _Frame) -> _Segment:
        key = (frame.episode, frame.claim)
        seg = self._segments.get(key)
        if seg is None:
            path = "/".join(
                (self.root, "segments", _SAFE.sub("_", model), _SAFE.sub("_", self.node_id),
                 _SAFE.sub("_", frame.claim) or f"token-{frame.token}")
            )  # fmt: skip
            seg = self._segments[key] = _Segment(
                model, frame.episode, frame.claim, frame.token, frame.device, path, frame.mode
            )
            if self.fs.exists(f"{path}/segment.json"):  # evicted while idle: go on after it
                with self.fs.open(f"{path}/segment.json", "r") as fh:
                    meta = json.loads(fh.read())
                seg.parts, seg.frames = int(meta["parts"]), int(meta["frames"])
                seg.dropped, seg.specs = int(meta["dropped"]), dict(meta["specs"])
                seg.error = meta.get("error")
                seg.token, seg.device = int(meta["token"]), str(meta["device"])
                seg.shadow_parts = int(meta.get("shadow_parts", 0))
                seg.shadow_specs = dict(meta.get("shadow_specs", {}))
        return seg

    def _flush_due(self, force: bool) -> None:
        now = time.monotonic()
        for key, seg in list(self._segments.items()):
            if (seg.rows or seg.ghosts) and (force or now - seg.since >= self.flush_s):
                self._write(seg)
            elif not seg.rows and not seg.ghosts and now - seg.since >= _IDLE_S:
                del self._segments[key]  # its claim ended, most likely: memory stays bounded

    def _write(self, seg: _Segment) -> None:
        try:
            self._write_part(seg)
        except Exception:  # a full disk or an unreachable store: counted as dropped
            log.exception("recorder: a part of segment %s could not be written", seg.path)
            self.dropped += len(seg.rows) + len(seg.ghosts)
            seg.dropped += len(seg.rows) + len(seg.ghosts)
        seg.rows, seg.ghosts = [], []

    def _write_part(self, seg: _Segment) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = seg.rows
        seg.dropped += self._drops.pop((seg.episode, seg.claim), 0)
        if rows:
            self._write_rows(seg, pa, pq)
        if seg.ghosts:
            self._write_ghosts(seg, pa, pq)
        meta = {
            "model": seg.model, "node": self.node_id, "device": seg.device,
            "episode": seg.episode, "claim": seg.claim, "token": seg.token,
            "parts": seg.parts, "frames": seg.frames, "dropped": seg.dropped,
            "specs": seg.specs, "keep": seg.mode, "error": seg.error,
            "shadow_parts": seg.shadow_parts, "shadow_specs": seg.shadow_specs,
        }  # fmt: skip
        with self.fs.open(f"{seg.path}/segment.json", "w") as fh:
            fh.write(json.dumps(meta))

    def _write_rows(self, seg: _Segment, pa: Any, pq: Any) -> None:
        """The waiting rows as the segment's next part (a failed step's outputs: null)."""
        rows = seg.rows
        cols: dict[str, Any] = {
            "seq": pa.array([f.seq for f in rows], pa.int64()),
            "t": pa.array([f.t for f in rows], pa.float64()),
            "state_reset": pa.array([f.state_reset for f in rows], pa.bool_()),
            "device": pa.array([f.device for f in rows], pa.string()),
            "error": pa.array([f.error for f in rows], pa.string()),
        }
        for side, prefix in (("inputs", "in:"), ("outputs", "out:")):
            names = dict.fromkeys(n for f in rows for n in getattr(f, side))
            for name in names:
                arrays = [getattr(f, side).get(name) for f in rows]
                first = np.asarray(next(a for a in arrays if a is not None))
                seg.specs.setdefault(prefix + name, {"dtype": first.dtype.str,
                                                     "shape": list(first.shape)})  # fmt: skip
                cols[prefix + name] = _bytes_column(pa, arrays)
        self._put(f"{seg.path}/part-{seg.parts:06d}.parquet", pa.table(cols), pq)
        seg.parts += 1
        seg.frames += len(rows)
        self.written += len(rows)

    def _write_ghosts(self, seg: _Segment, pa: Any, pq: Any) -> None:
        """The paired stream's waiting rows as the segment's next ``shadow-`` part."""
        rows = seg.ghosts
        shadows = [f.shadow for f in rows if f.shadow is not None]
        cols: dict[str, Any] = {
            "seq": pa.array([f.seq for f in rows], pa.int64()),
            "t": pa.array([f.t for f in rows], pa.float64()),
            "candidate": pa.array([s[0] for s in shadows], pa.string()),
            "max_abs": pa.array([s[1] for s in shadows], pa.float64()),
            "continuous": pa.array([s[2] for s in shadows], pa.bool_()),
        }
        for name in dict.fromkeys(n for f in rows for n in f.outputs):
            arrays = [f.outputs.get(name) for f in rows]
            first = np.asarray(next(a for a in arrays if a is not None))
            seg.shadow_specs.setdefault("out:" + name, {"dtype": first.dtype.str,
                                                        "shape": list(first.shape)})  # fmt: skip
            cols["out:" + name] = _bytes_column(pa, arrays)
        self._put(f"{seg.path}/shadow-{seg.shadow_parts:06d}.parquet", pa.table(cols), pq)
        seg.shadow_parts += 1
        self.written += len(rows)

    def _put(self, name: str, table: Any, pq: Any) -> None:
        """Write ``table`` as ``name`` whole before the name exists."""
        self.fs.makedirs(name.rsplit("/", 1)[0], exist_ok=True)
        local = self.fs.protocol in ("file", "local") or "file" in self.fs.protocol
        target = f"{name}.tmp" if local else name
        with self.fs.open(target, "wb") as fh:
            pq.write_table(table, fh)
        if local:
            self.fs.mv(target, name)

    def _count(self) -> None:
        if self.on_count is None:
            return
        for outcome in ("queued", "dropped", "written"):
            now = getattr(self, outcome)
            if now > self._counted[outcome]:
                self.on_count(outcome, now - self._counted[outcome])
                self._counted[outcome] = now

    # the main loop -------------------------------------------------------------------

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until the writer found the queue empty once more (tests, benchmarks)."""
        self._idle.clear()
        return self._idle.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what waits, every segment's last part, and stop the writer."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


def _bytes_column(pa: Any, arrays: list[Array | None]) -> Any:
    """One binary value per array (None: null), built with the one copy of each array's
    bytes (into a shared buffer that Arrow then wraps, not copies)."""
    empty = np.zeros(0, np.uint8)
    flat = [empty if a is None else np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            for a in arrays]  # fmt: skip
    data = np.concatenate(flat)  # the copy
    offsets = np.zeros(len(flat) + 1, np.int64)
    np.cumsum([f.size for f in flat], out=offsets[1:])
    nulls = sum(a is None for a in arrays)
    valid = None
    if nulls:
        bits = np.packbits(np.array([a is not None for a in arrays]), bitorder="little")
        valid = pa.py_buffer(bits)
    buffers = [valid, pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(flat), buffers, nulls)
