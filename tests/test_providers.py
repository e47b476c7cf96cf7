"""Provider plans per device, sessions that say which provider they really run on, and the
start-up checks that keep GPU traffic off the CPU."""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import EPFail, Fail, NoSuchFile
from packaging.requirements import Requirement
from packaging.version import Version

import node.providers as providers
from node.devices import DeviceSpec
from node.errors import CudaGraphUnavailable, CudaUnavailable, GpuUnavailable
from node.models import DEMO_MODEL
from node.providers import (
    ORT_PROVIDER_ERRORS,
    ProviderSettings,
    build_session,
    library_load_error,
    provider_plan,
    require_cuda,
    trt_cache_dir,
)
from tests.procs import free_port
from tests.rollout import reference_rollout

ROOT = Path(__file__).resolve().parent.parent
# Two architectures on one node: the TensorRT caches must not be shared between them.
GPUS = [
    DeviceSpec(0, "cuda", 0, "NVIDIA A100-SXM4-80GB", "GPU-a0", "sm_80", 81920),
    DeviceSpec(1, "cuda", 1, "NVIDIA A100-SXM4-80GB", "GPU-a1", "sm_80", 81920),
    DeviceSpec(2, "cuda", 2, "NVIDIA H100 80GB HBM3", "GPU-h0", "sm_90", 81559),
    DeviceSpec(3, "cuda", 3, "NVIDIA H100 80GB HBM3", "GPU-h1", "sm_90", 81559),
]
CPU = DeviceSpec(0, "cpu", None, "cpu", "cpu-0", "cpu", 0)
# An ordinal no machine has.
NO_SUCH_GPU = DeviceSpec(1, "cuda", 99, "NVIDIA H200", "GPU-h200", "sm_90", 143771)
CUDA_PROVIDER = Path(onnxruntime.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
TRT = "10.13.3"


def our_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "affinity.node" and r.levelno >= logging.WARNING
    ]


# -- plans ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", GPUS, ids=lambda d: f"gpu{d.index}")
def test_cuda_plan_defaults(device: DeviceSpec, tmp_path: Path) -> None:
    settings = ProviderSettings(trt_cache_root=tmp_path)
    assert provider_plan(device, settings, TRT) == [
        (
            "CUDAExecutionProvider",
            {"device_id": str(device.ordinal), "cudnn_conv_algo_search": "HEURISTIC"},
        ),
        ("CPUExecutionProvider", {}),
    ]


@pytest.mark.parametrize("device", GPUS, ids=lambda d: f"gpu{d.index}")
def test_cuda_plan_everything_on(device: DeviceSpec, tmp_path: Path) -> None:
    settings = ProviderSettings(
        tensorrt=True,
        trt_cache_root=tmp_path,
        trt_fp16=True,
        cuda_graph=True,
        cuda_mem_limit_mb=2048,
    )
    cache = str(trt_cache_dir(device, settings, TRT))
    assert provider_plan(device, settings, TRT) == [
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
    assert list(tmp_path.iterdir()) == []  # a plan is pure: the directory comes with a session


def test_tensorrt_without_fp16_or_graphs(tmp_path: Path) -> None:
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    (trt_name, trt), (cuda_name, cuda), _ = provider_plan(GPUS[2], settings, TRT)
    assert (trt_name, cuda_name) == ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    assert trt["trt_fp16_enable"] == "False"
    assert "trt_cuda_graph_enable" not in trt
    assert "enable_cuda_graph" not in cuda


def test_tensorrt_that_cannot_load_is_left_out(tmp_path: Path) -> None:
    settings = ProviderSettings(tensorrt=True, cuda_graph=True, trt_cache_root=tmp_path)
    assert [name for name, _ in provider_plan(GPUS[0], settings, None)] == [
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]


def test_trt_cache_is_keyed_by_gpu_model_memory_and_versions(tmp_path: Path) -> None:
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    a0, a1, h0, h1 = (trt_cache_dir(d, settings, TRT) for d in GPUS)
    assert a0 == a1 and h0 == h1 and a0 != h0  # same model and memory share one cache
    assert a0 == (
        tmp_path
        / "sm_80"
        / "NVIDIA_A100-SXM4-80GB-81920MiB"
        / f"trt{TRT}-ort{onnxruntime.__version__}"
    )
    # Same architecture, another model or memory size: an engine may not load there.
    h100_94 = DeviceSpec(4, "cuda", 4, "NVIDIA H100 NVL", "GPU-n", "sm_90", 95830)
    h100_pcie = DeviceSpec(5, "cuda", 5, "NVIDIA H100 80GB HBM3", "GPU-p", "sm_90", 81920)
    mig = DeviceSpec(0, "cuda", 0, "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "MIG-1", "sm_90", 40960)
    keyed = {trt_cache_dir(d, settings, TRT) for d in (GPUS[2], h100_94, h100_pcie, mig)}
    assert len(keyed) == 4
    assert all(p.parent.parent.name == "sm_90" for p in keyed)
    # An upgrade of TensorRT gets a new directory rather than engines it cannot deserialize.
    assert trt_cache_dir(GPUS[2], settings, "10.16.1") != h0
    assert trt_cache_dir(GPUS[2], settings, TRT).name.endswith(f"-ort{onnxruntime.__version__}")


def test_cpu_plan() -> None:
    assert provider_plan(CPU, ProviderSettings(tensorrt=True, cuda_graph=True), TRT) == [
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
    with pytest.raises(ValueError, match="CUDA memory limit 0 MiB: must be >= 1 MiB"):
        ProviderSettings(cuda_mem_limit_mb=0)


# -- what ONNX Runtime raises ------------------------------------------------------------------


def test_ort_failures_that_drop_a_provider_are_not_runtime_errors() -> None:
    # The reason for catching them by name: an except (RuntimeError, ValueError) misses both.
    for cls in (Fail, EPFail):
        assert cls.__mro__[1:] == (Exception, BaseException, object), cls
        assert cls in ORT_PROVIDER_ERRORS
    assert not issubclass(NoSuchFile, ORT_PROVIDER_ERRORS)  # model errors propagate


# -- sessions, with ONNX Runtime's real session on the CPU -------------------------------------


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


def test_a_gpu_is_never_served_on_the_cpu(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Where CUDA cannot run (this machine), a cuda device raises instead of falling back."""
    if library_load_error(CUDA_PROVIDER) is None:
        pytest.skip("CUDA's libraries load on this host; the no-CUDA path is not reachable")
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    with pytest.raises(CudaUnavailable) as raised:
        build_session(DEMO_MODEL, NO_SUCH_GPU, settings)
    message = str(raised.value)
    assert message.startswith("device 1 (NVIDIA H200, GPU-h200, cuda ordinal 99): ")
    assert "\n" not in message
    assert raised.value.library is not None and raised.value.library in message
    with pytest.raises(OSError):  # the library it names really does not load
        ctypes.CDLL(raised.value.library)
    # ONNX Runtime's own fallback (which drops device_id) stayed off: it prints "EP Error".
    assert "EP Error" not in capfd.readouterr().out


def test_build_session_propagates_model_errors(tmp_path: Path) -> None:
    for device in (CPU, GPUS[0]):
        with pytest.raises(NoSuchFile):
            build_session(
                tmp_path / "absent.onnx", device, ProviderSettings(trt_cache_root=tmp_path)
            )


# -- sessions, with a fake ONNX Runtime (what a GPU host's would do) ---------------------------


class FakeSession:
    def __init__(self, plan: list[tuple[str, dict[str, str]]]) -> None:
        self.plan = plan

    def get_providers(self) -> list[str]:
        return [name for name, _ in self.plan]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return dict(self.plan)


class FakeOrt:
    """``onnxruntime.InferenceSession`` as it behaves on a GPU host, per plan."""

    def __init__(self, fail: Callable[[str, dict[str, str]], Exception | None]) -> None:
        self.fail = fail
        self.tried: list[str] = []

    def __call__(self, path: str, options: Any, *, providers: Any, enable_fallback: int) -> Any:
        assert enable_fallback == 0
        first, first_options = providers[0]
        self.tried.append(first)
        error = self.fail(first, first_options)
        if error is not None:
            raise error
        return FakeSession(list(providers))


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorRT 10.13.3 loads; nothing is preloaded for real."""
    monkeypatch.setattr(providers, "preload_gpu_libraries", lambda tensorrt=False: None)
    monkeypatch.setattr(providers, "tensorrt_version", lambda: (TRT, ""))


GRAPH_REFUSED = (
    "This session cannot use the graph capture feature as requested by the user as all the "
    "graph nodes have not been assigned to TensorrtExecutionProvider"
)


@pytest.mark.usefixtures("gpu_host")
def test_tensorrt_that_cannot_take_the_graph_falls_to_cuda_keeping_the_graph(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = ProviderSettings(tensorrt=True, cuda_graph=True, trt_cache_root=tmp_path)
    ort = FakeOrt(lambda p, o: Fail(GRAPH_REFUSED) if p == "TensorrtExecutionProvider" else None)
    built = build_session(DEMO_MODEL, GPUS[2], settings, session_factory=ort)
    assert ort.tried == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    assert (built.requested, built.active, built.fell_back) == (
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
        True,
    )
    cuda = built.provider_options["CUDAExecutionProvider"]
    assert cuda["enable_cuda_graph"] == "1" and cuda["device_id"] == "2"
    [warning] = our_warnings(caplog)
    assert "asked for TensorrtExecutionProvider, ONNX Runtime runs on CUDAExecutionProvider" in (
        warning
    )
    assert f"TensorrtExecutionProvider failed: {GRAPH_REFUSED}" in warning


@pytest.mark.usefixtures("gpu_host")
def test_a_graph_cuda_cannot_capture_says_why(tmp_path: Path) -> None:
    settings = ProviderSettings(tensorrt=True, cuda_graph=True, trt_cache_root=tmp_path)
    cuda_refused = (
        "This session cannot use the graph capture feature as requested by the user as the "
        "model has control flow nodes which can't be supported by CUDAExecutionProvider"
    )
    ort = FakeOrt(
        lambda p, o: {
            "TensorrtExecutionProvider": Fail(GRAPH_REFUSED),
            "CUDAExecutionProvider": Fail(cuda_refused),
        }.get(p)
    )
    with pytest.raises(CudaGraphUnavailable) as raised:
        build_session(DEMO_MODEL, GPUS[2], settings, session_factory=ort)
    assert isinstance(raised.value, GpuUnavailable)
    assert str(raised.value) == (
        "device 2 (NVIDIA H100 80GB HBM3, GPU-h0, cuda ordinal 2): --cuda-graph cannot be "
        f"honoured: {cuda_refused} (run without --cuda-graph, or export a model CUDA can take "
        "whole)"
    )


@pytest.mark.usefixtures("gpu_host")
def test_an_unreadable_trt_cache_is_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    cache = trt_cache_dir(GPUS[2], settings, TRT)
    cache.mkdir(parents=True)
    engine = cache / "TensorrtExecutionProvider_TRTKernel_graph_main_1_0_sm90.engine"
    engine.write_bytes(b"\x00truncated by a crash")

    def tensorrt(provider: str, options: dict[str, str]) -> Exception | None:
        if provider != "TensorrtExecutionProvider":
            return None
        here = Path(options["trt_engine_cache_path"]) / engine.name
        if here.exists() and here.read_bytes() != b"ENGINE":
            return EPFail(f"TensorRT EP could not deserialize engine from cache: {here}")
        here.write_bytes(b"ENGINE")  # built and cached
        return None

    ort = FakeOrt(tensorrt)
    built = build_session(DEMO_MODEL, GPUS[2], settings, session_factory=ort)
    assert (built.active, built.fell_back) == ("TensorrtExecutionProvider", False)
    assert ort.tried == ["TensorrtExecutionProvider", "TensorrtExecutionProvider"]
    assert engine.read_bytes() == b"ENGINE"
    aside = cache.with_name(cache.name + ".unreadable")
    assert (aside / engine.name).read_bytes() == b"\x00truncated by a crash"
    [warning] = our_warnings(caplog)
    assert f"TensorRT cache {cache} could not be read" in warning and "rebuilding" in warning
    # a second corrupt cache replaces the first one kept aside: it never grows
    engine.write_bytes(b"garbage")
    build_session(DEMO_MODEL, GPUS[2], settings, session_factory=FakeOrt(tensorrt))
    assert (aside / engine.name).read_bytes() == b"garbage"


@pytest.mark.usefixtures("gpu_host")
def test_other_tensorrt_failures_drop_tensorrt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    ort = FakeOrt(
        lambda p, o: (
            EPFail("TensorRT EP failed to create engine from network")
            if p == "TensorrtExecutionProvider"
            else None
        )
    )
    built = build_session(DEMO_MODEL, GPUS[0], settings, session_factory=ort)
    assert built.active == "CUDAExecutionProvider"
    assert ort.tried == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    assert not trt_cache_dir(GPUS[0], settings, TRT).with_name("x.unreadable").exists()
    [warning] = our_warnings(caplog)
    assert "TensorRT EP failed to create engine" in warning


def test_tensorrt_libraries_missing_runs_on_cuda_and_names_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(providers, "preload_gpu_libraries", lambda tensorrt=False: None)
    why = "libnvinfer.so.10: cannot open shared object file: No such file or directory"
    monkeypatch.setattr(providers, "tensorrt_version", lambda: (None, why))
    ort = FakeOrt(lambda p, o: None)
    settings = ProviderSettings(tensorrt=True, trt_cache_root=tmp_path)
    built = build_session(DEMO_MODEL, GPUS[0], settings, session_factory=ort)
    assert ort.tried == ["CUDAExecutionProvider"]
    assert (built.requested, built.active) == ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    [warning] = our_warnings(caplog)
    assert f"TensorrtExecutionProvider cannot load: {why}" in warning
    assert list(tmp_path.iterdir()) == []  # no cache directory for a TensorRT that never ran


def test_cuda_that_onnx_runtime_drops_silently_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ONNX Runtime leaves CUDA out without raising when its libraries do not load."""
    monkeypatch.setattr(providers, "preload_gpu_libraries", lambda tensorrt=False: None)
    monkeypatch.setattr(
        providers,
        "library_load_error",
        lambda path: "libcudnn.so.9: cannot open shared object file: No such file or directory",
    )

    def cpu_only(path: str, options: Any, *, providers: Any, enable_fallback: int) -> Any:
        return FakeSession([p for p in providers if p[0] == "CPUExecutionProvider"])

    with pytest.raises(CudaUnavailable) as raised:
        build_session(DEMO_MODEL, GPUS[1], ProviderSettings(), session_factory=cpu_only)
    assert raised.value.library == "libcudnn.so.9"
    assert str(raised.value).endswith(
        "ONNX Runtime cannot run CUDA here: libcudnn.so.9: cannot open shared object file: "
        "No such file or directory"
    )


# -- the start-up check ----------------------------------------------------------------------


class FakeCudart:
    def __init__(self, driver: int = 13000, runtime: int = 13000, count: int = 4) -> None:
        self.driver, self.runtime, self.count = driver, runtime, count

    def driver_version(self) -> int:
        return self.driver

    def runtime_version(self) -> int:
        return self.runtime

    def device_count(self) -> tuple[int, str]:
        return (self.count, "") if self.count else (0, "no CUDA-capable device is detected")


def loads() -> Path:
    """A library that loads here: ONNX Runtime's own Python extension."""
    return next((Path(onnxruntime.__file__).parent / "capi").glob("onnxruntime_pybind11*.so"))


def test_no_gpu_needs_no_cuda() -> None:
    def never() -> FakeCudart:
        raise AssertionError("CUDA must not be touched for CPU devices")

    require_cuda([CPU], provider_library=Path("/nonexistent.so"), runtime=never)


def test_cuda_that_runs() -> None:
    require_cuda(GPUS, provider_library=loads(), runtime=FakeCudart)
    # minor version compatibility: pip's CUDA 13.5 runtime on a driver for CUDA 13.0
    require_cuda(GPUS, provider_library=loads(), runtime=lambda: FakeCudart(13000, 13050))


def test_missing_cuda_library_is_named_in_one_line() -> None:
    """On this machine (no CUDA) the real provider library names what it misses."""
    reason = library_load_error(CUDA_PROVIDER)
    if reason is None:
        pytest.skip("CUDA's libraries load on this host")
    with pytest.raises(CudaUnavailable) as raised:
        require_cuda(GPUS[:1])
    message, library = str(raised.value), raised.value.library
    assert library is not None and message.startswith(f"cannot use GPUs: {library} is missing (")
    assert f"needs CUDA {providers.ORT_CUDA_VERSION}" in message and "\n" not in message
    with pytest.raises(OSError, match=library.replace(".", r"\.")):
        ctypes.CDLL(library)


@pytest.mark.parametrize(
    ("cudart", "expected"),
    [
        (FakeCudart(driver=0), "cannot use GPUs: no NVIDIA driver is loaded"),
        (
            FakeCudart(driver=12040),
            "cannot use GPUs: the NVIDIA driver supports CUDA 12.4, onnxruntime-gpu "
            f"{onnxruntime.__version__} needs CUDA {providers.ORT_CUDA_VERSION or '?'} (CUDA 13.0 "
            "runtime): upgrade the driver",
        ),
        (
            FakeCudart(count=2),
            "cannot use GPUs: CUDA sees 2 GPU(s), but device 3 needs CUDA ordinal 3",
        ),
        (
            FakeCudart(count=0),
            "cannot use GPUs: CUDA sees 0 GPU(s) (no CUDA-capable device is detected), but",
        ),
    ],
    ids=["no-driver", "old-driver", "fewer-gpus", "no-gpu"],
)
def test_cuda_that_cannot_start_says_why(cudart: FakeCudart, expected: str) -> None:
    with pytest.raises(CudaUnavailable) as raised:
        require_cuda(GPUS, provider_library=loads(), runtime=lambda: cudart)
    assert str(raised.value).startswith(expected)
    assert raised.value.library is None


def test_library_load_error() -> None:
    assert library_load_error(loads()) is None
    assert library_load_error(Path("/nonexistent/libx.so")) == "/nonexistent/libx.so does not exist"
    assert providers._missing_library(
        "libcublasLt.so.13: cannot open shared object file: No such file or directory"
    ) == ("libcublasLt.so.13")
    assert providers._missing_library("/x/libfoo.so: undefined symbol: bar") is None


# -- the node refuses to start ---------------------------------------------------------------


def fake_nvidia_smi(directory: Path) -> dict[str, str]:
    smi = directory / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\nprintf '%s\\n' '0, GPU-a1a1a1a1, NVIDIA H200, 143771, 9.0, Disabled'\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**env, "PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}


def node(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.server", "--port", str(free_port()), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("devices", ["0", "auto"])
def test_node_with_gpus_but_no_cuda_exits_with_one_line(tmp_path: Path, devices: str) -> None:
    if library_load_error(CUDA_PROVIDER) is None:
        pytest.skip("CUDA's libraries load on this host")
    done = node(fake_nvidia_smi(tmp_path), "--devices", devices)
    assert done.returncode == 5, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("affinity-node: cannot use GPUs: lib") and "is missing" in line
    assert done.stdout == ""  # onnxruntime.preload_dlls()'s complaints are not printed


def test_node_naming_a_gpu_it_cannot_list_exits_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no nvidia-smi
    done = node(env, "--devices", "0")
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("affinity-node: --devices '0': cannot list GPUs:")


def test_the_onnxruntime_floor_has_what_the_node_relies_on() -> None:
    """pyproject's floor: 1.26 has OrtValue.update_inplace(OrtValue) (1.25.0 does not), and it
    is past 1.22, the first release with ORT PR #24010 (TensorRT on device_id > 0 from another
    thread)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    builds = {
        req.name: req
        for req in map(Requirement, project["dependencies"])
        if req.name in ("onnxruntime", "onnxruntime-gpu")
    }
    floors = {Version(spec.version) for req in builds.values() for spec in req.specifier}
    [floor] = floors
    assert floor >= Version("1.26") and Version(onnxruntime.__version__) >= floor
    gpu_extra = [Requirement(g) for g in project["optional-dependencies"]["gpu"]]
    assert any(g.name == "onnxruntime-gpu" and g.extras == {"cuda", "cudnn"} for g in gpu_extra)


@pytest.mark.parametrize(
    ("platform", "machine", "build"),
    [
        ("linux", "x86_64", "onnxruntime-gpu"),
        ("win32", "AMD64", "onnxruntime-gpu"),
        ("linux", "aarch64", "onnxruntime"),
        ("darwin", "arm64", "onnxruntime"),
        ("darwin", "x86_64", "onnxruntime"),
    ],
)
def test_exactly_one_onnxruntime_build_installs_on_each_platform(
    platform: str, machine: str, build: str
) -> None:
    """onnxruntime-gpu where PyPI has its wheels, the CPU build elsewhere; never both (they
    install the same module)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    env = {"sys_platform": platform, "platform_machine": machine}
    chosen = [
        req.name
        for req in map(Requirement, project["dependencies"])
        if req.name.startswith("onnxruntime") and (req.marker is None or req.marker.evaluate(env))
    ]
    assert chosen == [build]


def test_a_cpu_only_onnxruntime_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_build = ["AzureExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: cpu_build)

    def never() -> Any:
        raise AssertionError("a CPU-only build has no CUDA to ask")

    with pytest.raises(CudaUnavailable) as raised:
        require_cuda(GPUS[:1], provider_library=Path("/nonexistent.so"), runtime=never)
    message = str(raised.value)
    assert message.startswith(f"cannot use GPUs: onnxruntime {onnxruntime.__version__} is ")
    assert "CPU-only" in message and "onnxruntime-gpu" in message and "\n" not in message
    source = onnxruntime.OrtValue.ortvalue_from_numpy(np.arange(4, dtype=np.float32))
    target = onnxruntime.OrtValue.ortvalue_from_shape_and_type([4], np.float32, "cpu", 0)
    target.update_inplace(source)  # the device-to-device copy, here host to host
    np.testing.assert_array_equal(target.numpy(), np.arange(4, dtype=np.float32))
