"""Real GPUs: a session pinned to every discovered GPU, and TensorRT caches per architecture.

Run with ``RUN_HARDWARE_TESTS=1`` on a host with NVIDIA GPUs, CUDA and cuDNN (and TensorRT for
the TensorRT test) installed where ONNX Runtime finds them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from node.devices import DeviceSpec, discover, pin_pci_bus_order
from node.policy import DEMO_MODEL, Array, load_contract, reference_rollout
from node.providers import ProviderSettings, build_session, trt_cache_dir

pytestmark = [
    pytest.mark.hardware,
    pytest.mark.skipif(
        os.environ.get("RUN_HARDWARE_TESTS") != "1", reason="needs GPUs; set RUN_HARDWARE_TESTS=1"
    ),
]


@pytest.fixture(scope="module")
def gpus() -> list[DeviceSpec]:
    # Before any CUDA session exists in this process, so CUDA numbers GPUs as nvidia-smi does.
    pin_pci_bus_order(os.environ)
    devices = discover("auto")
    assert devices and all(d.kind == "cuda" for d in devices), f"no GPU discovered: {devices}"
    return devices


def run_episode(session: Any, steps: int) -> tuple[list[Array], list[Array]]:
    """Run the demo for ``steps`` steps; return (observations, actions)."""
    rng = np.random.default_rng(3)
    contract = load_contract(DEMO_MODEL)
    state = contract.initial_state()
    observations: list[Array] = []
    actions: list[Array] = []
    for _ in range(steps):
        obs = rng.uniform(-1, 1, (1, 8)).astype(np.float32)
        action, hidden = session.run(None, {"obs": obs, **state})
        state = {"state_in.hidden": hidden}
        observations.append(obs)
        actions.append(action)
    return observations, actions


def test_cuda_session_on_every_gpu(gpus: list[DeviceSpec], tmp_path: Path) -> None:
    for device in gpus:
        built = build_session(DEMO_MODEL, device, ProviderSettings(trt_cache_root=tmp_path))
        assert built.session.get_providers()[0] == "CUDAExecutionProvider", device
        assert not built.fell_back
        options = built.provider_options["CUDAExecutionProvider"]
        assert options["device_id"] == str(device.ordinal)
        observations, actions = run_episode(built.session, 10)
        expected = reference_rollout(DEMO_MODEL, observations)
        for got, want in zip(actions, expected, strict=True):
            np.testing.assert_allclose(got, want["actions"], atol=1e-4)


def test_tensorrt_fills_one_cache_per_architecture(gpus: list[DeviceSpec], tmp_path: Path) -> None:
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    for device in gpus:
        built = build_session(DEMO_MODEL, device, settings)
        assert built.active == "TensorrtExecutionProvider", device
        assert built.provider_options["TensorrtExecutionProvider"]["device_id"] == str(
            device.ordinal
        )
        run_episode(built.session, 1)
    for arch in {d.arch for d in gpus}:
        cache = trt_cache_dir(next(d for d in gpus if d.arch == arch), settings)
        assert any(cache.iterdir()), f"TensorRT left no cache files in {cache}"
    assert {p.name for p in tmp_path.iterdir()} == {d.arch for d in gpus}


def test_cuda_graph_per_device_matches_reference(gpus: list[DeviceSpec], tmp_path: Path) -> None:
    from node.binding import BoundSession

    contract = load_contract(DEMO_MODEL)
    names = [o.name for o in contract.outputs]
    for device in gpus:
        built = build_session(
            DEMO_MODEL, device, ProviderSettings(cuda_graph=True, trt_cache_root=tmp_path)
        )
        options = built.provider_options["CUDAExecutionProvider"]
        assert options["enable_cuda_graph"] == "1" and options["device_id"] == str(device.ordinal)
        bound = BoundSession(built.session, contract, "cuda", device.ordinal or 0)
        rng = np.random.default_rng(5)
        obs = [rng.uniform(-1, 1, (1, 8)).astype(np.float32) for _ in range(10)]
        state = contract.initial_state()
        for o, want in zip(obs, reference_rollout(DEMO_MODEL, obs), strict=True):
            out = dict(zip(names, bound.run(names, {"obs": o, **state}), strict=True))
            np.testing.assert_allclose(out["actions"], want["actions"], atol=1e-4)
            state = {"state_in.hidden": out["state_out.hidden"]}
