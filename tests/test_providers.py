"""Provider plans per device, and sessions that say which provider they really run on."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from node.devices import DeviceSpec
from node.policy import DEMO_MODEL, reference_rollout
from node.providers import ProviderSettings, build_session, provider_plan, trt_cache_dir

# Two architectures on one node: the TensorRT caches must not be shared between them.
GPUS = [
    DeviceSpec(0, "cuda", 0, "NVIDIA A100-SXM4-80GB", "GPU-a0", "sm_80", 81920),
    DeviceSpec(1, "cuda", 1, "NVIDIA A100-SXM4-80GB", "GPU-a1", "sm_80", 81920),
    DeviceSpec(2, "cuda", 2, "NVIDIA H100 80GB HBM3", "GPU-h0", "sm_90", 81559),
    DeviceSpec(3, "cuda", 3, "NVIDIA H100 80GB HBM3", "GPU-h1", "sm_90", 81559),
]
CPU = DeviceSpec(0, "cpu", None, "cpu", "cpu-0", "cpu", 0)
# An ordinal no machine has: building on it falls back to the CPU with or without CUDA.
NO_SUCH_GPU = DeviceSpec(1, "cuda", 99, "NVIDIA H200", "GPU-h200", "sm_90", 143771)


def our_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "node.providers" and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("device", GPUS, ids=lambda d: f"gpu{d.index}")
def test_cuda_plan_defaults(device: DeviceSpec, tmp_path: Path) -> None:
    settings = ProviderSettings(trt_cache_root=tmp_path)
    assert provider_plan(device, settings) == [
        (
            "CUDAExecutionProvider",
            {"device_id": str(device.ordinal), "cudnn_conv_algo_search": "HEURISTIC"},
        ),
        ("CPUExecutionProvider", {}),
    ]
    assert list(tmp_path.iterdir()) == []  # no TensorRT, no cache directory


@pytest.mark.parametrize("device", GPUS, ids=lambda d: f"gpu{d.index}")
def test_cuda_plan_everything_on(device: DeviceSpec, tmp_path: Path) -> None:
    settings = ProviderSettings(
        tensorrt=True,
        trt_cache_root=tmp_path,
        trt_fp16=True,
        cuda_graph=True,
        cuda_mem_limit_mb=2048,
    )
    cache = str(tmp_path / device.arch)
    assert provider_plan(device, settings) == [
        (
            "TensorrtExecutionProvider",
            {
                "device_id": str(device.ordinal),
                "trt_engine_cache_enable": "True",
                "trt_engine_cache_path": cache,
                "trt_timing_cache_enable": "True",
                "trt_timing_cache_path": cache,
                "trt_fp16_enable": "True",
                "trt_cuda_graph_enable": "True",
            },
        ),
        (
            "CUDAExecutionProvider",
            {
                "device_id": str(device.ordinal),
                "cudnn_conv_algo_search": "HEURISTIC",
                "gpu_mem_limit": str(2048 * 1024 * 1024),
                "arena_extend_strategy": "kSameAsRequested",
                "enable_cuda_graph": "1",
            },
        ),
        ("CPUExecutionProvider", {}),
    ]
    assert Path(cache).is_dir()


def test_tensorrt_without_fp16_or_graphs(tmp_path: Path) -> None:
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    (trt_name, trt), (cuda_name, cuda), _ = provider_plan(GPUS[2], settings)
    assert (trt_name, cuda_name) == ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    assert trt["trt_fp16_enable"] == "False"
    assert "trt_cuda_graph_enable" not in trt
    assert "enable_cuda_graph" not in cuda


def test_trt_cache_is_one_directory_per_architecture(tmp_path: Path) -> None:
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    paths = [provider_plan(d, settings)[0][1]["trt_engine_cache_path"] for d in GPUS]
    assert paths[0] == paths[1] == str(tmp_path / "sm_80")
    assert paths[2] == paths[3] == str(tmp_path / "sm_90")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sm_80", "sm_90"]
    assert [trt_cache_dir(d, settings) for d in GPUS] == [Path(p) for p in paths]


def test_cpu_plan() -> None:
    assert provider_plan(CPU, ProviderSettings(tensorrt=True, cuda_graph=True)) == [
        ("CPUExecutionProvider", {})
    ]


def test_cuda_device_without_ordinal_is_refused() -> None:
    broken = DeviceSpec(0, "cuda", None, "NVIDIA A100", "GPU-a0", "sm_80", 81920)
    with pytest.raises(ValueError, match="has no ordinal"):
        provider_plan(broken, ProviderSettings())


def test_cache_root_is_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ProviderSettings().trt_cache_root == tmp_path / ".cache/affinity/trt"


def test_memory_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cuda_mem_limit_mb=0"):
        ProviderSettings(cuda_mem_limit_mb=0)


def test_build_session_on_cpu(caplog: pytest.LogCaptureFixture) -> None:
    built = build_session(DEMO_MODEL, CPU, ProviderSettings(), intra_op_threads=2)
    assert (built.requested, built.active, built.fell_back) == (
        "CPUExecutionProvider",
        "CPUExecutionProvider",
        False,
    )
    assert built.provider_options == {"CPUExecutionProvider": {}}
    assert our_warnings(caplog) == []
    observation = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)
    hidden = np.zeros((1, 16), np.float32)
    actions, _ = built.session.run(None, {"obs": observation, "state_in.hidden": hidden})
    np.testing.assert_array_equal(
        actions, reference_rollout(DEMO_MODEL, [observation])[0]["actions"]
    )


def test_build_session_detects_cuda_fallback(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    built = build_session(DEMO_MODEL, NO_SUCH_GPU, ProviderSettings(trt_cache_root=tmp_path))
    assert built.requested == "CUDAExecutionProvider"
    assert built.active == "CPUExecutionProvider"
    assert built.fell_back
    assert built.session.get_providers() == ["CPUExecutionProvider"]
    [warning] = our_warnings(caplog)
    assert warning.startswith(
        "device 1 (NVIDIA H200, GPU-h200, cuda ordinal 99): asked for CUDAExecutionProvider, "
        "ONNX Runtime runs on CPUExecutionProvider"
    )
    # ONNX Runtime's own fallback (which drops device_id) stayed off: it prints "EP Error".
    assert "EP Error" not in capfd.readouterr().out


def test_build_session_drops_tensorrt_that_cannot_load(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    built = build_session(DEMO_MODEL, NO_SUCH_GPU, settings)
    assert (built.requested, built.active, built.fell_back) == (
        "TensorrtExecutionProvider",
        "CPUExecutionProvider",
        True,
    )
    [warning] = our_warnings(caplog)
    assert (
        "asked for TensorrtExecutionProvider, ONNX Runtime runs on CPUExecutionProvider" in warning
    )
    assert "TensorrtExecutionProvider failed: " in warning
    assert "\n" not in warning
    assert "EP Error" not in capfd.readouterr().out


def test_build_session_propagates_model_errors(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="NO_SUCHFILE") as raised:
        build_session(tmp_path / "absent.onnx", GPUS[0], ProviderSettings(trt_cache_root=tmp_path))
    assert not isinstance(raised.value, RuntimeError | ValueError)
