"""A device's worker process (``--device-workers process``, issue 43's third slice).

One process per device holds every model's ONNX Runtime session on that device (the live
models' and the shadow candidates'), its CUDA graphs and TensorRT engines, and runs them for
the node's core (``node/deviceprocs.py``). The core keeps the episodes, the batching and the
owner's rules; a run crosses to this process through the hop's shared memory
(``node/hop.py``: one slot per model, the feed written raw once, the outputs written back
raw), with an ``eventfd`` doorbell each way.

Each model is served by a thread of its own, which makes every run of that model: ONNX
Runtime keeps a captured CUDA graph per thread, so capture and replay happen on the same
thread, as on the core's device threads. A run that raises answers the error's text; the
core counts it as the device's failure, as for a session of its own.

Started by the core as ``python -m node.deviceproc`` with its spec in
``AFFINITY_DEVICE_SPEC`` (JSON: the device, the models, the provider settings, the
descriptors it inherits). It writes one JSON line to its hello descriptor: each model's
provider and batch sizes once every session is open, or the error that stopped it (the
core's start-up names it and exits). It dies with the core (``PR_SET_PDEATHSIG``) and
leaves when the core sends SIGUSR1. SIGINT and SIGTERM are the core's to act on: it starts
the process with them blocked (``node.hop.deaf_children``), so a ^C in a terminal, or a
service manager that signals every process of the node's group, never ends a device while
the core hands its episodes over.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from node.hop import ANSWERED, REPLY, Region, contiguous, die_with_parent, lift, lower

__all__ = ["RUN", "main"]

log = logging.getLogger("affinity.node")

RUN = 10
"""A slot's request kind: one model run (its feed; the outputs asked in ``o``)."""
RUN_ROWS = 11
"""A run of several steps' feeds, stacked here along the first axis (padded to ``size``),
its outputs split back per step (:func:`_rows`)."""
GET = 12
"""The host arrays of states held here (``s``: their ids), for a hand-over."""
FREE = 13
"""Nothing but the frees (``f``): the core lets go of states while the model is idle."""
CUDA_GRAPH_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
WATCH_S = 0.05
"""How often the process reads the node's lease generation when no request brings it."""


@dataclass
class _Model:
    """One model's session here and its end of the hop."""

    key: str
    session: Any
    provider: str
    slot: int
    ask: int
    answer: int
    live: bool = True  # a live model's (its states follow the node's lease), not a candidate's


def _open(spec: dict[str, Any]) -> list[_Model]:
    """Every model's session on the device, in the spec's order. Raises what ONNX Runtime
    (or the provider plan) raised, with the model's key."""
    from node.binding import BoundSession
    from node.contract import load_contract
    from node.devices import DeviceSpec
    from node.providers import ProviderSettings, build_session

    device = DeviceSpec(**spec["device"])
    settings = ProviderSettings(**spec["providers"])
    models = []
    for k, m in enumerate(spec["models"]):
        path = Path(m["path"])
        try:
            built = build_session(path, device, settings, intra_op_threads=m["threads"])
            session: Any = built.session
            if m["graph"] and settings.cuda_graph and built.active in CUDA_GRAPH_PROVIDERS:
                # each episode's state stays on the device, held here (_States)
                session = BoundSession(session, load_contract(path), "cuda", device.ordinal or 0)
        except Exception as exc:
            raise RuntimeError(f"{m['key']}: {type(exc).__name__}: {exc}") from exc
        ask, answer = m["fds"]
        models.append(
            _Model(m["key"], session, built.active, k, ask, answer, bool(m.get("live", True)))
        )
    return models


class _Lost(Exception):
    """A run names a state this process does not hold (a core's bug: a restarted process's
    handles are refused by the core itself)."""


class _Fenced(Exception):
    """A run would continue a state held here while the node's lease has run out, or one
    dropped here since because the node dropped its episodes (a fence, a registration
    anew)."""


SWEPT_KEPT = 1 << 16
"""How many ids of states dropped for a later generation a model remembers (a run that
names one is answered ``fenced``, not as a lost state)."""


class _States:
    """The states of one model's episodes held here, by id: what a run's state outputs
    (``k``) became, fed back by id (``h``) on the episode's next run, freed when the core
    no longer holds their handle (``f``). A host array, or on a GPU with ``--cuda-graph`` a
    ``DeviceTensor`` that never leaves the device.

    A live model's state is kept under the node's lease generation its request named
    (``g``). Once a later one is heard of (a request's, or the core's word in the control
    block, which the watch reads every 50 ms), every state kept under an earlier one is
    dropped: the node dropped their episodes' records (a fence, a registration anew), so
    none may be served again, and their memory is freed at once, not as the core's frees
    arrive. A shadow candidate's ghosts live in a table of their own, which no fence
    drops: its states follow only its own requests (``live`` False). The model's thread
    and the watch share it: :attr:`lock` guards the table (never held over a run)."""

    def __init__(self, region: Region, slot: int, key: str = "", live: bool = True) -> None:
        self.region = region
        self.slot = slot
        self.key = key
        self.live = live
        self.lock = threading.Lock()
        self.held: dict[int, Any] = {}
        self.kept_in: dict[int, int] = {}  # id -> the generation it was kept under
        self.swept: dict[int, None] = {}  # ids dropped for a later generation (bounded)
        self.generation = 0  # the latest the process heard of
        self.nbytes = 0
        self.buffers: dict[int, int] = {}  # a DeviceTensor's buffers -> its handles here
        self.next = 1
        self.new: list[int] = []  # kept by the request being answered (freed if it fails)
        self.late: list[int] = []  # kept under a generation already past: dropped once said

    def heard(self, generation: int) -> None:
        """The node's lease generation is ``generation``: drop the states of earlier ones."""
        if generation <= self.generation:  # (an int read: the usual case takes no lock)
            return
        with self.lock:
            if generation <= self.generation:
                return
            self.generation = generation
            old = [i for i, g in self.kept_in.items() if g < generation]
            for i in old:
                self._drop(i)
                self._swept(i)
            self._say()
        if old:
            log.info("the node dropped its episodes (lease generation %d): %d state(s) of "
                     "%s dropped here", generation, len(old), self.key)  # fmt: skip

    def free(self, ids: list[int]) -> None:
        if not ids:
            return
        with self.lock:
            for i in ids:
                self._drop(i)
            self._say()

    def drop_late(self) -> None:
        """Drop the states the answer just sent kept under a generation already past: the
        core keeps nothing a step of an earlier generation made."""
        if self.late:
            with self.lock:
                for i in self.late:
                    self._drop(i)
                    self._swept(i)
                self._say()
            self.late.clear()

    def get(self, i: int) -> Any:
        value = self.held.get(i)
        if value is None:
            if i in self.swept:
                raise _Fenced(
                    f"state {i} was dropped here: the node dropped its episodes since (its "
                    "lease lapsed, or it registered anew)"
                )
            raise _Lost(f"state {i} is not held by this worker process")
        return value

    def keep(self, value: Any, generation: int) -> list[Any]:
        """Hold ``value``, kept under ``generation``; its handle for the core: id, dtype,
        shape. One kept under a generation already past is dropped once answered."""
        with self.lock:
            i, self.next = self.next, self.next + 1
            self.held[i] = value
            self.kept_in[i] = generation
            self.nbytes += self._footprint(value, 1)
            self.new.append(i)
            if self.live and generation < self.generation:
                self.late.append(i)
            self._say()
        return [i, np.dtype(value.dtype).str, list(value.shape)]

    def _footprint(self, value: Any, sign: int) -> int:
        """The bytes ``value`` adds (``sign`` 1) or gives back (-1): an array's own; a
        ``DeviceTensor``'s three buffers once for all the handles on them (an episode's
        current state and the one before share them)."""
        buffers = getattr(value, "buffers", None)
        if buffers is None:
            return sign * int(value.nbytes)
        key = id(buffers)
        n = self.buffers.get(key, 0) + sign
        if n > 0:
            self.buffers[key] = n
        else:
            self.buffers.pop(key, None)
        whole = len(buffers) * int(value.nbytes)
        return whole if (sign > 0 and n == 1) else -whole if (sign < 0 and n == 0) else 0

    def _drop(self, i: int) -> None:
        value = self.held.pop(i, None)
        self.kept_in.pop(i, None)
        if value is not None:
            self.nbytes += self._footprint(value, -1)

    def _swept(self, i: int) -> None:
        self.swept[i] = None
        if len(self.swept) > SWEPT_KEPT:
            del self.swept[next(iter(self.swept))]

    def _say(self) -> None:
        """What this model holds, into the control block (the core's gauges read it)."""
        self.region.say_held(self.slot, len(self.held), self.nbytes)


def _refuse_when_fenced(states: _States, meta: dict[str, Any], kind: int) -> None:
    """Refuse a run that continues a live model's state held here once the node's lease has
    run out, as the core last said: whatever the core then does, no process of a lapsed
    node serves an episode from its memory. A run from an initial state (a claim's first
    step, a warm-up, a probe) is not refused: what it makes is kept only under a valid
    lease."""
    if not states.live:
        return
    named = any(row["h"] for row in meta["rows"]) if kind == RUN_ROWS else bool(meta.get("h"))
    if named and states.region.expired(time.monotonic_ns()):
        raise _Fenced("the node's lease has run out: a state held here is served no more")


def _answer(
    model: _Model, states: _States, kind: int, meta: dict[str, Any], arrays: list[Any]
) -> tuple[dict[str, Any], list[Any]]:
    """One request of the core: a run, a run of rows, or states read back."""
    from node.warmup import run

    states.free(meta.get("f") or [])
    generation = int(meta.get("g") or 0)
    if states.live:
        states.heard(max(generation, states.region.generation()))
    if kind == FREE:
        return {}, []
    if kind == GET:
        return {}, [contiguous(np.asarray(states.get(i))) for i in meta["s"]]
    names: list[str] | None = meta.get("o")
    keep = set(meta.get("k") or ())
    _refuse_when_fenced(states, meta, kind)
    if kind == RUN_ROWS:
        return _rows(model, states, meta, arrays, names or [], keep, generation)
    feed = dict(zip(meta["n"], arrays, strict=True))
    for name, carried in (meta.get("x") or {}).items():  # string tensors, by value
        feed[name] = lower(carried, [])
    for name, i in (meta.get("h") or {}).items():
        feed[name] = states.get(i)
    values = run(model.session, names, feed)
    del feed, arrays  # views of the slot, about to be overwritten
    handles: dict[str, Any] = {}
    strings: dict[str, Any] = {}
    outputs = []
    for at, (name, value) in enumerate(zip(names or [""] * len(values), values, strict=True)):
        if name in keep:
            handles[name] = states.keep(value, generation)
            continue
        array = np.asarray(value)
        if array.dtype.hasobject:  # a string output: by value (its name, or its place)
            strings[name or str(at)] = lift(array, [])
        else:
            outputs.append(contiguous(array))
    said: dict[str, Any] = {"h": handles}
    if strings:
        said["x"] = strings
    return said, outputs


def _rows(
    model: _Model,
    states: _States,
    meta: dict[str, Any],
    arrays: list[Any],
    names: list[str],
    keep: set[str],
    generation: int,
) -> tuple[dict[str, Any], list[Any]]:
    """Several steps' feeds stacked along the first axis, padded to ``size`` rows (padding
    rows made from the first step's: ``control.padding``), run once, and the outputs split
    back: each step's state outputs held here one by one, the others returned stacked
    (the steps' rows only). The core's ``_run_stacked`` does the same with host states."""
    from node import control
    from node.warmup import run

    rows: list[dict[str, Any]] = []
    at = 0
    for row in meta["rows"]:
        feed: dict[str, Any] = {}
        for name in row["n"]:
            feed[name] = arrays[at]
            at += 1
        for name, carried in (row.get("x") or {}).items():
            feed[name] = lower(carried, [])
        for name, i in row["h"].items():
            feed[name] = np.asarray(states.get(i))  # (a host copy, as a thread's batch)
        rows.append(feed)
    size = int(meta["size"])
    first = rows[0]
    stacked = {
        name: np.concatenate(
            [r[name] for r in rows] + [control.padding(name, first[name])] * (size - len(rows))
        )
        for name in first
    }
    del rows, arrays
    values = [np.asarray(v) for v in run(model.session, names, stacked)]
    for name, value in zip(names, values, strict=True):
        if value.shape[:1] != (size,):
            raise ValueError(f"output {name!r} has shape {value.shape} for a batch of {size}")
    n = len(meta["rows"])
    named = list(zip(names, values, strict=True))
    handles = [
        {name: states.keep(v[i : i + 1].copy(), generation) for name, v in named if name in keep}
        for i in range(n)
    ]
    outputs = [
        np.ascontiguousarray(v[:n])
        for name, v in named
        if name not in keep and not v.dtype.hasobject
    ]
    said: dict[str, Any] = {"h": handles}
    strings = {name: lift(v[:n], []) for name, v in named if name not in keep and v.dtype.hasobject}
    if strings:
        said["x"] = strings
    return said, outputs


def _serve(model: _Model, region: Region, states: _States, stopping: threading.Event) -> None:
    """Answer ``model``'s requests, one at a time, until the process leaves."""
    while not stopping.is_set():
        try:
            os.read(model.ask, 8)  # blocks (the GIL released) until the core rings
        except InterruptedError:
            continue
        if stopping.is_set():
            return
        states.new.clear()
        states.late.clear()
        try:
            kind, meta, arrays = region.read(model.slot, copy=False)  # the feed, in place
            said, outputs = _answer(model, states, kind, meta, arrays)
            del arrays
            region.write(model.slot, ANSWERED, REPLY, said, outputs)
        except _Lost as exc:  # not the device's failure: the episode's state is gone
            states.free(states.new)  # (the core never hears of them)
            region.write(model.slot, ANSWERED, REPLY, {"e": str(exc), "lost": True}, [])
        except _Fenced as exc:  # nor is this: the node's lease ran out
            states.free(states.new)
            region.write(model.slot, ANSWERED, REPLY, {"e": str(exc), "fenced": True}, [])
        except Exception as exc:  # the core counts it as the device's failure
            states.free(states.new)
            region.write(model.slot, ANSWERED, REPLY, {"e": f"{type(exc).__name__}: {exc}"}, [])
        os.write(model.answer, (1).to_bytes(8, "little"))
        states.drop_late()


def _watch(region: Region, held: list[_States], stopping: threading.Event) -> None:
    """Every 50 ms, the node's lease generation as the core said it: a fence drops every
    model's states here at once, an idle model's too (shared memory: no system call but
    the wait)."""
    live = [states for states in held if states.live]
    while not stopping.wait(WATCH_S):
        generation = region.generation()
        for states in live:
            states.heard(generation)


def main() -> None:
    spec = json.loads(os.environ["AFFINITY_DEVICE_SPEC"])
    die_with_parent(int(spec["parent"]))
    index = spec["device"]["index"]
    handler = logging.StreamHandler(sys.stderr)
    if spec.get("log_format") == "json":
        from node.accesslog import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s %(name)s[device {index}]: %(message)s")
        )
    logging.basicConfig(level=getattr(logging, str(spec.get("log_level", "info")).upper(),
                                      logging.INFO), handlers=[handler])  # fmt: skip
    stopping = threading.Event()
    # SIGINT and SIGTERM: blocked from birth (node.hop.deaf_children), the core's to act on
    region = Region.open(int(spec["region"]))
    with os.fdopen(int(spec["hello"]), "w") as hello:
        try:
            models = _open(spec)
        except Exception as exc:
            hello.write(json.dumps({"error": " ".join(str(exc).split())}) + "\n")
            hello.flush()
            os._exit(3)
        said = [
            {"provider": m.provider, "batch_sizes": list(getattr(m.session, "batch_sizes", ()))}
            for m in models
        ]
        hello.write(json.dumps({"models": said}) + "\n")
    held = [_States(region, m.slot, m.key, m.live) for m in models]
    threads = [
        threading.Thread(
            target=_serve, args=(m, region, s, stopping), daemon=True, name=f"affinity-{m.key}"
        )
        for m, s in zip(models, held, strict=True)
    ]
    threads.append(
        threading.Thread(
            target=_watch, args=(region, held, stopping), daemon=True, name="affinity-generation"
        )
    )
    for thread in threads:
        thread.start()
    signal.sigwait({signal.SIGUSR1})
    stopping.set()
    # the core stops asking first (its device threads have ended): no run is in progress
    os._exit(0)


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # for sigwait (every thread)
    main()
