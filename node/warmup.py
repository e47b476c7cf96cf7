"""What a node feeds a model before any client does: the warm-up and the probe.

The warm-up runs at start-up, once per batch size; it also captures CUDA graphs. The probe
runs on a down device.

A model must never be fed made-up values it may reject (Triton warms a model up only from
the samples its configuration gives). So the feed of an observation input is, in order:

1. the operator's sample: ``<stem>.warmup.npz`` beside the model file (the sidecar's
   neighbour, ``np.savez``). It holds one array per observation input named as the input,
   in the shape of one client step (the batch axis as 1). It is checked at start-up by the
   rule every front door applies to a client's arrays. Strings come as numpy ``str``
   arrays: no pickles.
2. else zeros, for a numeric input: every numeric dtype holds 0, and a new episode's state
   starts from zeros too.
3. else nothing: a string (BYTES) input has no value the contract guarantees valid. An
   empty string fails a model that parses numbers from it. So the model is not warmed up
   (one info line) and serves all the same. Its first steps pay what the warm-up would have.

State inputs get the initial state and real-time-chunking inputs a step without a prefix:
what the node itself feeds a first step. Control inputs get what a real step of a sequence
of one step gets (``node/control.py``), as the step of KServe sequence id 0
(:data:`EPISODE`): start, end and ready 1, and a correlation id of ``0``, or ``"0"`` for a
string one (Triton's ``simple_string_dyna_sequence`` casts it to a number; an empty string
fails that cast).
"""

from __future__ import annotations

import functools
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import onnxruntime

from node.contract import Array, PolicyContract
from node.control import control_feed
from node.errors import InvalidInput, ModelFailure
from node.inputs import from_arrays
from node.rtc import rtc_of
from node.worker import DeviceWorker

__all__ = [
    "EPISODE",
    "control_values",
    "feed",
    "made_up",
    "probe",
    "run",
    "samples_path",
    "unfed",
    "warm_up",
    "with_samples",
]

SUFFIX = ".warmup.npz"
EPISODE = "kserve:i:0"
"""The episode a warm-up or probe run is fed as (its control inputs): KServe sequence id 0."""


def samples_path(model_path: Path) -> Path:
    """The samples file of ``model_path``: ``<stem>.warmup.npz`` in the same directory."""
    return model_path.with_name(model_path.stem + SUFFIX)


def with_samples(model_path: Path, contract: PolicyContract) -> PolicyContract:
    """``contract`` with the samples of :func:`samples_path` as its ``warmup`` (unchanged
    when there is no such file). Raises ``ValueError`` naming the file, and the input when
    one is missing, unknown or not of the model's shape and dtype for one step."""
    path = samples_path(model_path)
    if not path.exists():
        return contract
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a .npz file of numpy arrays (np.savez): {exc}") from None
    try:
        samples = from_arrays(contract, arrays)
    except InvalidInput as exc:
        raise ValueError(f"{path}: {exc}") from None
    return replace(contract, warmup=MappingProxyType(samples))


def unfed(contract: PolicyContract) -> list[str]:
    """The observation inputs nothing may be fed to: strings without a sample. While there
    is one, the model is neither warmed up nor probed with made-up values."""
    return [
        spec.name
        for spec in contract.observation_inputs
        if spec.dtype == "object" and spec.name not in contract.warmup
    ]


def made_up(contract: PolicyContract) -> list[str]:
    """The observation inputs :func:`feed` gives zeros (no sample), for messages."""
    return [spec.name for spec in contract.observation_inputs if spec.name not in contract.warmup]


def control_values(contract: PolicyContract) -> list[str]:
    """What :func:`feed` gives each control input, as ``name=value``, for messages."""
    return [
        f"{name}={value.reshape(-1).tolist()[0]!r}"
        for name, value in control_feed(contract, EPISODE, start=True, end=True).items()
    ]


def feed(contract: PolicyContract, rows: int = 1) -> dict[str, Array] | None:
    """The inputs of one warm-up or probe run of ``rows`` rows (the same row repeated along
    the batch axis), or ``None`` when :func:`unfed` names an input. Fresh arrays."""
    if unfed(contract):
        return None
    one: dict[str, Array] = {
        spec.name: contract.warmup.get(spec.name, spec.zeros())
        for spec in contract.observation_inputs
    }
    one.update(contract.initial_state())
    one.update(control_feed(contract, EPISODE, start=True, end=True))
    rtc = rtc_of(contract)
    if rtc is not None:
        one.update(rtc.none())
    return {name: np.concatenate([value] * rows) for name, value in one.items()}


_QUIET = onnxruntime.RunOptions()
_QUIET.log_severity_level = 4  # fatal only: a failed run is reported once, by the node


def run(session: Any, outputs: Sequence[str] | None, inputs: Mapping[str, Array]) -> Any:
    """One warm-up run of ``session``. ONNX Runtime's own log line about a run that fails
    is left out (the exception carries the same text, and the node says it in one line)."""
    if isinstance(session, onnxruntime.InferenceSession):
        return session.run(outputs, inputs, _QUIET)
    return session.run(outputs, inputs)


async def probe(worker: DeviceWorker, contract: PolicyContract) -> bool:
    """Probe ``worker``'s device if it is down and its cool-down has passed. The probe runs
    the warm-up's :func:`feed` on its worker thread. True when it came back up. A
    model nothing may be fed to made up comes back untested, and its next steps probe it (a
    failure takes it down again)."""
    if worker.probing or not worker.tracker.probe_due():  # (one probe at once: a slow one,
        return False  # a recycled GPU process's first run, given up by its round, runs on)
    inputs = feed(contract)
    if inputs is None:
        worker.count_success()
        return True
    worker.probing = True  # until its run ends on the worker's thread, whoever still waits
    try:
        await worker.call(functools.partial(_run_counted, worker, inputs))
    except ModelFailure:
        return False
    return True


def _run_counted(worker: DeviceWorker, inputs: dict[str, Array]) -> None:
    """One run of ``inputs`` that counts as the device's; raises :class:`ModelFailure`."""
    try:
        worker.session.run(worker.outputs, inputs)
    except Exception as exc:
        worker.count_failure(f"{type(exc).__name__}: {exc}")
        raise ModelFailure(worker.id, exc) from exc
    finally:
        worker.probing = False
    worker.count_success()


async def warm_up(worker: DeviceWorker, contract: PolicyContract) -> None:
    """Warm ``worker``'s device up on its worker thread, before serving. A session with a
    ``warm_up()`` method is asked to (``node.binding.BoundSession`` captures its CUDA graph
    there). Any other runs :func:`feed` (the operator's samples, else zeros).
    It runs once at every batch size it will use. A session with ``batch_sizes`` captures
    one graph per size there. A model with an input nothing may be fed
    (:func:`unfed`) is not run at all. ONNX Runtime keeps a captured CUDA graph per
    thread. So the capture must happen on the thread that runs the device's steps. CUDA's
    capture mode is process-wide, so warm one device at a time. Raises what a run raised
    (nothing is counted: the node stops)."""
    if unfed(contract):
        return
    warm = getattr(worker.session, "warm_up", None)
    if warm is not None:
        await worker.call(warm)
        return
    sizes = [s for s in worker.sizes or () if s <= worker.max_batch] or [worker.bucket(1)]
    for size in sizes:
        inputs = feed(contract, size)
        assert inputs is not None  # no unfed input
        await worker.call(functools.partial(run, worker.session, worker.outputs, inputs))
