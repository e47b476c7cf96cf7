"""Real GPUs: sessions pinned to the right GPU, CUDA graphs captured once on the worker that
replays them, concurrent workers, TensorRT caches, device-resident state.

Run with ``RUN_HARDWARE_TESTS=1`` on a host with NVIDIA GPUs and ``pip install -e '.[dev,gpu]'``
(CUDA 13 and cuDNN 9 from pip, and ``nvidia-ml-py`` for NVML); the TensorRT tests also need
TensorRT 10 (``.[tensorrt]``) and skip, saying so, without it. ``bench/gpu_check.sh`` runs them.

Everything that depends on which physical GPU CUDA picks runs in a child process
(``python tests/test_hardware.py <check> ...``) whose environment — ``CUDA_VISIBLE_DEVICES``,
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` — is set before anything in it initialises CUDA: in the test
process another test may already have. The child checks what it can and prints one JSON line;
NVML then says on which GPU the child's memory really is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.binding import BoundSession, DeviceTensor  # noqa: E402
from node.contract import Array, load_contract  # noqa: E402
from node.devices import DeviceSpec, discover, pin_pci_bus_order  # noqa: E402
from node.dispatcher import MultiGpuDispatcher  # noqa: E402
from node.errors import CudaGraphUnavailable  # noqa: E402
from node.models import DEMO_MODEL  # noqa: E402
from node.providers import (  # noqa: E402
    ProviderSettings,
    build_session,
    provider_plan,
    tensorrt_version,
    trt_cache_dir,
)
from tests.dispatch import dispatch  # noqa: E402
from tests.rollout import reference_rollout  # noqa: E402

pytestmark = [
    pytest.mark.hardware,
    pytest.mark.skipif(
        os.environ.get("RUN_HARDWARE_TESTS") != "1", reason="needs GPUs; set RUN_HARDWARE_TESTS=1"
    ),
]

CONTRACT = load_contract(DEMO_MODEL)
NAMES = [o.name for o in CONTRACT.outputs]
STEPS = 20
# What ONNX Runtime 1.31's CUDA provider logs (strings of libonnxruntime_providers_cuda.so).
CAPTURING = "Capturing the cuda graph for this model"
REPLAYING = "Replaying CUDA graph on stream"


# -- the child process ------------------------------------------------------------------------


def episode(seed: int, steps: int = STEPS) -> list[Array]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (1, 8)).astype(np.float32) for _ in range(steps)]


async def run_episodes(
    dispatcher: MultiGpuDispatcher, plan: Mapping[str, list[int]]
) -> list[tuple[int, float]]:
    """Run seeded episodes (device -> seeds) concurrently; (seed, max error vs CPU reference)."""

    async def one(device: str, seed: int) -> tuple[int, float]:
        obs = episode(seed)
        errors = []
        for step, (o, want) in enumerate(zip(obs, reference_rollout(DEMO_MODEL, obs), strict=True)):
            result = await dispatch(dispatcher, device, f"ep-{seed}", 1, step == 0, {"obs": o})
            errors.append(float(np.max(np.abs(result.outputs["actions"] - want["actions"]))))
        return seed, max(errors)

    return await asyncio.gather(*(one(d, s) for d, seeds in plan.items() for s in seeds))


class ThreadRecorder:
    """Wraps a session; records the threads that run (and warm up) it."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.threads: set[int] = set()

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        self.threads.add(threading.get_ident())
        result: list[Any] = self.session.run(names, feed)
        return result

    def warm_up(self) -> None:
        """What the dispatcher does for the wrapped session, recorded."""
        self.threads.add(threading.get_ident())
        if hasattr(self.session, "warm_up"):
            self.session.warm_up()
        else:
            feed = {s.name: s.zeros() for s in CONTRACT.inputs}
            self.session.run(NAMES, feed)


def nvml_memory() -> dict[str, int | None]:
    """GPU UUID -> bytes this process holds there (None: NVML lists it, amount unknown)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        held: dict[str, int | None] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid():
                    held[uuid] = proc.usedGpuMemory
        return held
    finally:
        pynvml.nvmlShutdown()


def child(check: str, args: list[str]) -> dict[str, Any]:
    """One check in this (child) process; CUDA is not initialised before this point."""
    if check == "pinned":
        device = discover("auto")[int(args[0])]
        built = build_session(DEMO_MODEL, device, ProviderSettings())
        dispatcher = MultiGpuDispatcher(["d"], lambda _: built.session, CONTRACT)
        errors = asyncio.run(run_episodes(dispatcher, {"d": [1]}))
        dispatcher.close()
        return {
            "uuid": device.uuid,
            "ordinal": device.ordinal,
            "active": built.active,
            "device_id": built.provider_options["CUDAExecutionProvider"]["device_id"],
            "error": max(e for _, e in errors),
            "memory": nvml_memory(),
        }
    if check == "graph":
        # ONNX Runtime logs captures at its most verbose level; its own session is built here
        # (not through build_session, which lowers ONNX Runtime's logging to errors).
        import onnxruntime

        onnxruntime.set_default_logger_severity(0)
        device = discover("auto")[0]
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 0
        plan = provider_plan(device, ProviderSettings(cuda_graph=True))
        session = onnxruntime.InferenceSession(
            str(DEMO_MODEL), options, providers=plan, enable_fallback=0
        )
        bound = ThreadRecorder(BoundSession(session, CONTRACT, "cuda", device.ordinal or 0))
        dispatcher = MultiGpuDispatcher(["d"], lambda _: bound, CONTRACT)
        main = threading.get_ident()
        if args[0] == "worker":
            asyncio.run(dispatcher.warm_up())
        else:  # what the node did before: capture on the start-up thread
            bound.warm_up()
        print("== steps ==", file=sys.stderr, flush=True)
        errors = asyncio.run(run_episodes(dispatcher, {"d": [1]}))
        dispatcher.close()
        return {
            "error": max(e for _, e in errors),
            "threads": len(bound.threads),
            "main_ran": main in bound.threads,
        }
    if check == "concurrent":
        devices = discover("auto")
        sessions = {
            f"n/{d.index}": ThreadRecorder(build_session(DEMO_MODEL, d, ProviderSettings()).session)
            for d in devices
        }
        dispatcher = MultiGpuDispatcher(list(sessions), sessions.__getitem__, CONTRACT)
        asyncio.run(dispatcher.warm_up())
        plan = {name: [10 * i + k for k in range(4)] for i, name in enumerate(sessions)}
        errors = asyncio.run(run_episodes(dispatcher, plan))
        dispatcher.close()
        return {
            "error": max(e for _, e in errors),
            "episodes": len(errors),
            "threads": [sorted(s.threads) for s in sessions.values()],
            "uuids": [d.uuid for d in devices],
            "memory": nvml_memory(),
        }
    raise SystemExit(f"unknown check {check!r}")


def spawn(check: str, *args: str, visible: str | None = None) -> tuple[dict[str, Any], str]:
    """Run ``check`` in a fresh process with CUDA's environment set before it starts."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    pin_pci_bus_order(env)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    done = subprocess.run(
        [sys.executable, __file__, check, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{check} {args} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


# -- tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpus() -> list[DeviceSpec]:
    """Every GPU, by nvidia-smi (no CUDA in this process: nothing here depends on its order)."""
    devices = discover("auto", env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert devices and all(d.kind == "cuda" for d in devices), f"no GPU discovered: {devices}"
    try:
        import pynvml  # noqa: F401
    except ImportError:
        pytest.fail("the hardware tests read NVML: pip install -e '.[gpu]' (nvidia-ml-py)")
    return devices


def held_only_on(memory: Mapping[str, int | None], uuid: str) -> None:
    if not memory:
        pytest.skip("NVML lists no process of this PID (a container's PID namespace?)")
    assert set(memory) == {uuid}, f"GPU memory held on {sorted(memory)}, expected only {uuid}"
    assert memory[uuid] is None or memory[uuid] > 0


def test_each_gpu_gets_its_session_and_its_memory(gpus: list[DeviceSpec]) -> None:
    for device in gpus:
        result, _ = spawn("pinned", str(device.index))
        assert result["uuid"] == device.uuid and result["active"] == "CUDAExecutionProvider"
        assert result["device_id"] == str(device.ordinal)
        assert result["error"] < 1e-4
        held_only_on(result["memory"], device.uuid)


def shortest_unique_prefix(uuid: str, others: Sequence[str]) -> str:
    for end in range(len("GPU-") + 8, len(uuid)):
        if not any(o.startswith(uuid[:end]) for o in others if o != uuid):
            return uuid[:end]
    return uuid


@pytest.mark.parametrize("form", ["index", "uuid", "uuid-prefix"])
def test_cuda_visible_devices_forms_pin_the_named_gpu(gpus: list[DeviceSpec], form: str) -> None:
    target = gpus[-1]  # on a multi-GPU host its physical index is not 0, its ordinal is
    visible = {
        "index": str(target.index),
        "uuid": target.uuid,
        "uuid-prefix": shortest_unique_prefix(target.uuid, [g.uuid for g in gpus]),
    }[form]
    result, _ = spawn("pinned", "0", visible=visible)
    assert (result["uuid"], result["ordinal"], result["device_id"]) == (target.uuid, 0, "0")
    assert result["error"] < 1e-4
    held_only_on(result["memory"], target.uuid)


def test_cuda_visible_devices_order_is_followed(gpus: list[DeviceSpec]) -> None:
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    first, last = gpus[0], gpus[-1]
    result, _ = spawn("pinned", "1", visible=f"{last.index},{first.index}")
    assert (result["uuid"], result["ordinal"]) == (first.uuid, 1)  # local device 1 = GPU first
    held_only_on(result["memory"], first.uuid)


def test_cuda_graph_is_captured_once_on_the_worker_and_replayed(gpus: list[DeviceSpec]) -> None:
    result, log = spawn("graph", "worker")
    steps = log.split("== steps ==", 1)[1]
    assert log.count(CAPTURING) == 1, "captured more than once (or ORT's log message changed)"
    assert steps.count(CAPTURING) == 0, "the steps captured again: the warm-up graph was lost"
    assert steps.count(REPLAYING) >= STEPS
    assert result["threads"] == 1 and not result["main_ran"]
    assert result["error"] < 1e-4


def test_a_graph_captured_on_another_thread_is_captured_again(gpus: list[DeviceSpec]) -> None:
    """The fact the warm-up design rests on (ORT keeps the graph per thread)."""
    result, log = spawn("graph", "start-up-thread")
    assert log.count(CAPTURING) == 2
    assert log.split("== steps ==", 1)[1].count(CAPTURING) == 1
    assert result["threads"] == 2 and result["main_ran"]


def test_concurrent_workers_on_every_gpu(gpus: list[DeviceSpec]) -> None:
    result, _ = spawn("concurrent")
    assert result["episodes"] == 4 * len(gpus) and result["error"] < 1e-4
    threads = [tuple(t) for t in result["threads"]]
    assert all(len(t) == 1 for t in threads), "a session ran on more than its worker"
    assert len(set(threads)) == len(gpus), "two devices shared a worker"
    memory = result["memory"]
    if not memory:
        pytest.skip("NVML lists no process of this PID (a container's PID namespace?)")
    assert set(memory) == set(result["uuids"])


# -- in this process: nothing below depends on which physical GPU CUDA numbers first ---------


def test_device_state_stays_on_the_gpu_and_matches_host_state(gpus: list[DeviceSpec]) -> None:
    device = gpus[0]
    settings = ProviderSettings(cuda_graph=True)
    on_device = BoundSession(
        build_session(DEMO_MODEL, device, settings).session, CONTRACT, "cuda", device.ordinal or 0
    )
    on_host = BoundSession(
        build_session(DEMO_MODEL, device, settings).session,
        CONTRACT,
        "cuda",
        device.ordinal or 0,
        state_on_device=False,
    )
    state_d: dict[str, Any] = CONTRACT.initial_state()
    state_h: dict[str, Any] = CONTRACT.initial_state()
    obs = episode(5)
    for o, want in zip(obs, reference_rollout(DEMO_MODEL, obs), strict=True):
        actions_d, hidden_d = on_device.run(NAMES, {"obs": o, **state_d})
        actions_h, hidden_h = on_host.run(NAMES, {"obs": o, **state_h})
        assert isinstance(hidden_d, DeviceTensor) and hidden_d.device.lower() == "cuda"
        assert isinstance(hidden_h, np.ndarray)
        np.testing.assert_allclose(actions_d, want["actions"], atol=1e-4)
        np.testing.assert_allclose(actions_d, actions_h, atol=1e-6)
        state_d, state_h = {"state_in.hidden": hidden_d}, {"state_in.hidden": hidden_h}


def test_a_graph_cuda_cannot_capture_is_refused_with_the_reason(
    gpus: list[DeviceSpec], tmp_path: Path
) -> None:
    """A model with control flow: ONNX Runtime raises Fail (not a RuntimeError) for it."""
    from onnx import TensorProto, helper, save

    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["out"])],
        "branch",
        [],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
            helper.make_node("Greater", ["s", "zero"], ["c"]),
            helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch),
        ],
        "control_flow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # onnx 1.23 writes IR 14, which ORT 1.31 refuses
    path = tmp_path / "control_flow.onnx"
    save(model, path)
    with pytest.raises(CudaGraphUnavailable, match="--cuda-graph cannot be honoured"):
        build_session(path, gpus[0], ProviderSettings(cuda_graph=True))
    build_session(path, gpus[0], ProviderSettings())  # without the graph it runs


def trt_or_skip() -> str:
    version, why = tensorrt_version()
    if version is None:
        pytest.skip(f"TensorRT libraries absent: {why}")
    return version


def test_tensorrt_fills_one_cache_per_gpu_model(gpus: list[DeviceSpec], tmp_path: Path) -> None:
    version = trt_or_skip()
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    for device in gpus:
        built = build_session(DEMO_MODEL, device, settings)
        assert built.active == "TensorrtExecutionProvider", device
        assert built.provider_options["TensorrtExecutionProvider"]["device_id"] == str(
            device.ordinal
        )
        obs = episode(2, 3)
        state = CONTRACT.initial_state()
        for o, want in zip(obs, reference_rollout(DEMO_MODEL, obs), strict=True):
            actions, hidden = built.session.run(None, {"obs": o, **state})
            np.testing.assert_allclose(actions, want["actions"], atol=1e-3)
            state = {"state_in.hidden": hidden}
    for device in gpus:
        cache = trt_cache_dir(device, settings, version)
        names = [p.name for p in cache.iterdir()]
        sm = device.arch.removeprefix("sm_")
        assert any(n.endswith(".engine") and f"sm{sm}" in n for n in names), names


def test_an_unreadable_tensorrt_cache_is_rebuilt(
    gpus: list[DeviceSpec], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    version = trt_or_skip()
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    device = gpus[0]
    build_session(DEMO_MODEL, device, settings)
    cache = trt_cache_dir(device, settings, version)
    engines = [p for p in cache.iterdir() if p.suffix == ".engine"]
    assert engines
    for engine in engines:
        engine.write_bytes(b"\x00" * 64)  # a write cut short
    with caplog.at_level(logging.WARNING, logger="affinity.node"):
        built = build_session(DEMO_MODEL, device, settings)
    assert built.active == "TensorrtExecutionProvider"
    assert any("could not be read" in r.getMessage() for r in caplog.records)
    assert all(p.stat().st_size > 64 for p in cache.iterdir() if p.suffix == ".engine")


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2:])), flush=True)
