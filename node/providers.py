"""The ONNX Runtime provider plan of one device, and building a session pinned to it.

A CUDA device gets ``[TensorRT (opt-in), CUDA, CPU]``, each GPU provider with the device's
CUDA ordinal as ``device_id``; a CPU device gets ``[CPU]``. ``docs/internals.md`` tells why.
Hazards: when CUDA cannot load, ONNX Runtime quietly runs on the CPU; :func:`require_cuda`
and :func:`build_session` raise :class:`CudaUnavailable` instead, naming the missing
library. ORT's own fallback drops ``device_id`` (every device on GPU 0): it is disabled.
ORT raises ``Fail``/``EPFail``, not ``RuntimeError``, for an option a provider refuses:
both drop that provider (:class:`CudaGraphUnavailable` when CUDA cannot capture either).
A TensorRT cache is keyed by GPU model, memory and versions (:func:`trt_cache_dir`); an
unreadable one is moved aside and rebuilt, never fatal.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import io
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import onnxruntime
from onnxruntime.capi import build_and_package_info
from onnxruntime.capi.onnxruntime_pybind11_state import EPFail, Fail

from node.devices import DeviceSpec
from node.errors import CudaGraphUnavailable, CudaUnavailable

__all__ = [
    "BuiltSession",
    "CudaRuntime",
    "ProviderPlan",
    "ProviderSettings",
    "build_session",
    "library_load_error",
    "preload_gpu_libraries",
    "provider_plan",
    "require_cuda",
    "tensorrt_version",
    "trt_cache_dir",
]

log = logging.getLogger("affinity.node")

ProviderPlan = list[tuple[str, dict[str, str]]]
"""Providers in order of preference, each with its ONNX Runtime options."""

TRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
GPU_PROVIDERS = (TRT, CUDA)

# ONNX Runtime severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.
_ORT_ERROR = 3

ORT_PROVIDER_ERRORS: tuple[type[Exception], ...] = (RuntimeError, ValueError, Fail, EPFail)
"""What creating a session raises when a provider cannot be registered or cannot honour its
options. Model errors (``NoSuchFile``, ``InvalidProtobuf``, ``InvalidGraph``...) are not here:
they propagate unchanged."""

ORT_CUDA_VERSION: str = getattr(build_and_package_info, "cuda_version", "") or ""
"""The CUDA version this onnxruntime-gpu build needs (``"13.0"`` for 1.31.1)."""

_CAPI = Path(onnxruntime.__file__).parent / "capi"


@dataclass(frozen=True)
class ProviderSettings:
    """How GPU sessions are built; one value for the whole node.

    ``tensorrt`` puts the TensorRT provider first (engines are built on the first session
    creation per GPU model, which can take minutes, then loaded from :func:`trt_cache_dir`).
    ``trt_fp16`` lets TensorRT use FP16 kernels. ``cuda_graph`` captures the model as a CUDA
    graph per device (ONNX Runtime then requires runs through I/O binding with fixed shapes and
    buffers). ``cuda_mem_limit_mb`` caps the CUDA memory arena of each session, in MiB.
    ``trt_cache_root`` is stored with ``~`` expanded.
    """

    tensorrt: bool = False
    trt_cache_root: Path = Path("~/.cache/affinity/trt")
    trt_fp16: bool = False
    cuda_graph: bool = False
    cuda_mem_limit_mb: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trt_cache_root", Path(self.trt_cache_root).expanduser())
        if self.cuda_mem_limit_mb is not None and self.cuda_mem_limit_mb < 1:
            raise ValueError(f"CUDA memory limit {self.cuda_mem_limit_mb} MiB: must be >= 1 MiB")


@dataclass(frozen=True)
class BuiltSession:
    """A session and what ONNX Runtime really made of the plan.

    ``requested`` is the provider the settings ask for: TensorRT when ``tensorrt``, else
    CUDA, for a cuda device. ``active`` is the first provider the session uses. ``fell_back``
    is true when they differ. A cuda device never falls back further than CUDA: that raises.
    ``provider_options`` is ``session.get_provider_options()`` (``device_id`` included).
    """

    session: Any
    requested: str
    active: str
    fell_back: bool
    provider_options: dict[str, dict[str, str]]


# -- libraries -------------------------------------------------------------------------------


def library_load_error(path: Path) -> str | None:
    """Load the shared library at ``path`` as ONNX Runtime would; ``None`` when it loads.

    Otherwise the loader's reason, e.g. ``libcublasLt.so.13: cannot open shared object file:
    No such file or directory``. ONNX Runtime's provider libraries take one symbol from
    ``libonnxruntime_providers_shared.so``, which ONNX Runtime loads first with global
    symbols; so does this. Run only where the library would be loaded anyway.
    """
    if not path.exists():
        return f"{path} does not exist"
    try:
        shared = path.with_name("libonnxruntime_providers_shared.so")
        if shared.exists():
            ctypes.CDLL(str(shared), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(path))
    except OSError as exc:
        return str(exc).strip().splitlines()[0]
    return None


def _missing_library(reason: str) -> str | None:
    """The library a loader error names, e.g. ``libcublasLt.so.13``."""
    found = re.match(r"^\s*(\S*?lib[^\s/:]+\.so[.\d]*): cannot open shared object file", reason)
    return Path(found.group(1)).name if found else None


@functools.cache
def preload_gpu_libraries(tensorrt: bool = False) -> None:
    """Load the CUDA (and with ``tensorrt``, TensorRT) libraries that pip installed.

    ``onnxruntime.preload_dlls()`` loads ``libcudart``, ``libcublas``... from the ``nvidia``
    packages of ``onnxruntime-gpu[cuda,cudnn]``. Else it loads them by their names, from the
    loader's usual paths. Then ONNX Runtime's ``dlopen`` of its CUDA provider finds them. Its
    complaints about what it could not load go to stdout. They are kept at debug level here;
    the node says what is missing in one line instead. TensorRT comes from ``tensorrt_libs``
    (the ``tensorrt-cu13-libs`` wheel) when installed. Once per process (cached).
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        onnxruntime.preload_dlls()
    if out.getvalue().strip():
        log.debug("onnxruntime.preload_dlls(): %s", out.getvalue().strip())
    if tensorrt:
        spec = importlib.util.find_spec("tensorrt_libs")
        if spec is not None and spec.submodule_search_locations:
            where = Path(next(iter(spec.submodule_search_locations)))
            for name in ("libnvinfer.so.10", "libnvinfer_plugin.so.10", "libnvonnxparser.so.10"):
                with contextlib.suppress(OSError):
                    ctypes.CDLL(str(where / name), mode=ctypes.RTLD_GLOBAL)


class CudaRuntime(Protocol):
    """The three CUDA runtime facts :func:`require_cuda` checks (``libcudart`` via ctypes)."""

    def driver_version(self) -> int:
        """``cudaDriverGetVersion``: 1000 * major + 10 * minor; 0 without a driver."""

    def runtime_version(self) -> int:
        """``cudaRuntimeGetVersion``, same encoding."""

    def device_count(self) -> tuple[int, str]:
        """``cudaGetDeviceCount``: (count, "") or (0, the error string)."""


class _Cudart:
    def __init__(self, soname: str) -> None:
        self._lib = ctypes.CDLL(soname)
        self._lib.cudaGetErrorString.restype = ctypes.c_char_p

    def _int(self, fn: str) -> tuple[int, int]:
        value = ctypes.c_int(0)
        code = getattr(self._lib, fn)(ctypes.byref(value))
        return int(code), value.value

    def driver_version(self) -> int:
        return self._int("cudaDriverGetVersion")[1]

    def runtime_version(self) -> int:
        return self._int("cudaRuntimeGetVersion")[1]

    def device_count(self) -> tuple[int, str]:
        code, count = self._int("cudaGetDeviceCount")
        if code:
            why = self._lib.cudaGetErrorString(code)
            return 0, why.decode() if why else f"CUDA error {code}"
        return count, ""


def _cuda_version(encoded: int) -> str:
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def require_cuda(
    devices: Sequence[DeviceSpec],
    *,
    provider_library: Path | None = None,
    runtime: Callable[[], CudaRuntime] | None = None,
) -> None:
    """Check that CUDA can run every cuda device of ``devices``; nothing to do without one.

    Preloads pip-installed CUDA libraries (:func:`preload_gpu_libraries`). Then loads ONNX
    Runtime's CUDA provider library (``provider_library``, default the installed one). Then
    asks the CUDA runtime for the driver's version and the device count (``runtime``,
    default ``libcudart`` through ctypes). Call it after ``CUDA_DEVICE_ORDER`` is pinned.

    Raises :class:`CudaUnavailable` with one line: a CPU-only onnxruntime, the missing library,
    a driver older than the CUDA this onnxruntime-gpu needs, or fewer devices than the
    ordinals asked for.
    """
    gpus = [d for d in devices if d.kind == "cuda"]
    if not gpus:
        return
    if CUDA not in onnxruntime.get_available_providers():
        raise CudaUnavailable(
            f"cannot use GPUs: onnxruntime {onnxruntime.__version__} is the CPU-only build "
            "(no CUDA provider): install onnxruntime-gpu (Linux x86_64, Windows amd64) in its "
            "place, or run with --devices cpu"
        )
    preload_gpu_libraries()
    wanted = f"onnxruntime-gpu {onnxruntime.__version__} needs CUDA {ORT_CUDA_VERSION or '?'}"
    reason = library_load_error(provider_library or _CAPI / "libonnxruntime_providers_cuda.so")
    if reason is not None:
        library = _missing_library(reason)
        what = f"{library} is missing" if library else reason
        raise CudaUnavailable(
            f"cannot use GPUs: {what} ({wanted} and cuDNN 9: install onnxruntime-gpu[cuda,cudnn] "
            "or put the libraries on LD_LIBRARY_PATH; the driver provides libcuda.so.1)",
            library,
        )
    cudart = (runtime or (lambda: _Cudart(f"libcudart.so.{ORT_CUDA_VERSION.split('.')[0]}")))()
    driver, needed = cudart.driver_version(), cudart.runtime_version()
    if driver == 0:
        raise CudaUnavailable("cannot use GPUs: no NVIDIA driver is loaded (libcuda found none)")
    # CUDA's minor version compatibility: a 13.x runtime runs on any driver for CUDA 13.0+
    if driver // 1000 < needed // 1000:
        raise CudaUnavailable(
            f"cannot use GPUs: the NVIDIA driver supports CUDA {_cuda_version(driver)}, "
            f"{wanted} (CUDA {_cuda_version(needed)} runtime): upgrade the driver (r580+ for "
            "CUDA 13)"
        )
    count, error = cudart.device_count()
    highest = max(d.ordinal or 0 for d in gpus)
    if count <= highest:
        seen = f"sees {count} GPU(s)" + (f" ({error})" if error else "")
        raise CudaUnavailable(
            f"cannot use GPUs: CUDA {seen}, but device {gpus[-1].index} needs CUDA ordinal "
            f"{highest} (check CUDA_VISIBLE_DEVICES and the container's GPUs)"
        )


@functools.cache
def tensorrt_version() -> tuple[str | None, str]:
    """(TensorRT's version such as ``"10.13.3"``, "") or (None, why it cannot load).

    Asks ``libnvinfer.so.10`` (the one ONNX Runtime 1.31's TensorRT provider links) through
    ``getInferLibVersion()`` (``major * 10000 + minor * 100 + patch``). Cached.
    """
    preload_gpu_libraries(tensorrt=True)
    try:
        lib = ctypes.CDLL("libnvinfer.so.10")
    except OSError as exc:
        return None, str(exc).strip().splitlines()[0]
    version = int(lib.getInferLibVersion())
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}", ""


# -- plans -----------------------------------------------------------------------------------


def trt_cache_dir(device: DeviceSpec, settings: ProviderSettings, trt_version: str) -> Path:
    """The TensorRT engine and timing cache directory of ``device``.

    ``<root>/<arch>/<GPU name>-<memory>MiB/trt<TensorRT version>-ort<ONNX Runtime version>``,
    e.g. ``~/.cache/affinity/trt/sm_90/NVIDIA_H100_80GB_HBM3-81559MiB/trt10.13.3-ort1.31.1``.
    GPUs of one model and memory size share it. A different GPU, memory size (a MIG slice
    included: its name carries its profile) or an upgrade of either library gets a new one.
    """
    gpu = re.sub(r"[^A-Za-z0-9.+-]+", "_", device.name).strip("_") or "gpu"
    return (
        settings.trt_cache_root
        / device.arch
        / f"{gpu}-{device.memory_mb}MiB"
        / f"trt{trt_version}-ort{onnxruntime.__version__}"
    )


def provider_plan(
    device: DeviceSpec, settings: ProviderSettings, trt_version: str | None = None
) -> ProviderPlan:
    """Return the providers and options for a session on ``device``; no side effects.

    For a cuda device: TensorRT (when ``settings.tensorrt`` and ``trt_version`` says which
    TensorRT is loadable; its cache in :func:`trt_cache_dir`), then CUDA, then CPU. For a cpu
    device: CPU alone. Raises ``ValueError`` for a cuda device without an ordinal.
    """
    if device.kind == "cpu":
        return [(CPU, {})]
    if device.ordinal is None:
        raise ValueError(f"device {device.index} ({device.name}) is cuda but has no ordinal")
    device_id = str(device.ordinal)
    plan: ProviderPlan = []
    if settings.tensorrt and trt_version is not None:
        cache = str(trt_cache_dir(device, settings, trt_version))
        trt = {
            "device_id": device_id,
            "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": cache,
            "trt_timing_cache_enable": "True",
            "trt_timing_cache_path": cache,
            "trt_fp16_enable": str(settings.trt_fp16),
        }
        if settings.cuda_graph:
            # ONNX Runtime replays the graph of the first provider that captures one; with
            # TensorRT running the model, CUDA's own capture would find no nodes to capture.
            trt["trt_cuda_graph_enable"] = "True"
        plan.append((TRT, trt))
    # HEURISTIC: exhaustive cuDNN search would stall the first request of every new shape.
    cuda = {"device_id": device_id, "cudnn_conv_algo_search": "HEURISTIC"}
    if settings.cuda_mem_limit_mb is not None:
        cuda["gpu_mem_limit"] = str(settings.cuda_mem_limit_mb * 1024 * 1024)
        # Growing by powers of two could overshoot the limit by almost half of it.
        cuda["arena_extend_strategy"] = "kSameAsRequested"
    if settings.cuda_graph:
        cuda["enable_cuda_graph"] = "1"
    plan.append((CUDA, cuda))
    plan.append((CPU, {}))
    return plan


# -- sessions --------------------------------------------------------------------------------

SessionFactory = Callable[..., Any]
"""``onnxruntime.InferenceSession``'s signature: (path, options, providers=, enable_fallback=)."""


def build_session(
    model_path: Path,
    device: DeviceSpec,
    settings: ProviderSettings,
    *,
    intra_op_threads: int = 1,
    session_factory: SessionFactory | None = None,
) -> BuiltSession:
    """Build an ONNX Runtime session for ``model_path`` pinned to ``device``.

    Providers of the plan that ONNX Runtime cannot register or cannot honour are dropped in
    order, keeping the others' options. One warning line names the device, the provider used
    and why. A TensorRT cache that cannot be read is moved aside and rebuilt (one warning).
    ONNX Runtime's own logging is lowered to errors, process-wide. ``intra_op_threads`` is the
    session's intra-op thread count (0: one per core). ``session_factory`` replaces
    ``onnxruntime.InferenceSession`` (tests).

    Raises :class:`CudaUnavailable` when a cuda device would end up on the CPU (the reason:
    the library that does not load, or ONNX Runtime's error). Raises
    :class:`CudaGraphUnavailable` when ``settings.cuda_graph`` cannot be honoured on CUDA.
    Errors loading the model itself propagate unchanged.
    """
    make = session_factory or onnxruntime.InferenceSession
    onnxruntime.set_default_logger_severity(_ORT_ERROR)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = _ORT_ERROR
    options.intra_op_num_threads = intra_op_threads
    failures: list[str] = []
    trt_version: str | None = None
    if device.kind == "cuda":
        preload_gpu_libraries(tensorrt=settings.tensorrt)
        if settings.tensorrt:
            trt_version, why = tensorrt_version()
            if trt_version is None:
                failures.append(f"{TRT} cannot load: {why}")
    plan = provider_plan(device, settings, trt_version)
    requested = plan[0][0] if device.kind == "cpu" else (TRT if settings.tensorrt else CUDA)
    session, cuda_error = _open(make, model_path, options, plan, failures)
    active = session.get_providers()[0]
    where = f"device {device.index} ({device.name}, {device.uuid}, cuda ordinal {device.ordinal})"
    if device.kind == "cuda" and active not in GPU_PROVIDERS:
        if cuda_error is not None and settings.cuda_graph:
            raise CudaGraphUnavailable(
                f"{where}: --cuda-graph cannot be honoured: {cuda_error} "
                "(run without --cuda-graph, or export a model CUDA can take whole)"
            )
        reason = cuda_error or library_load_error(_CAPI / "libonnxruntime_providers_cuda.so")
        library = _missing_library(reason) if reason else None
        raise CudaUnavailable(
            f"{where}: ONNX Runtime cannot run CUDA here: "
            f"{reason or 'see the ONNX Runtime error above'}",
            library,
        )
    if active != requested:
        log.warning(
            "%s: asked for %s, ONNX Runtime runs on %s (%s)",
            where,
            requested,
            active,
            "; ".join(failures) or f"{requested} did not load; ONNX Runtime logged why",
        )
    return BuiltSession(
        session=session,
        requested=requested,
        active=active,
        fell_back=active != requested,
        provider_options=session.get_provider_options(),
    )


def _open(
    make: SessionFactory,
    model_path: Path,
    options: Any,
    plan: ProviderPlan,
    failures: list[str],
) -> tuple[Any, str | None]:
    """Open a session on the longest tail of ``plan`` whose providers all work.

    Appends one line per dropped provider to ``failures``; returns the session and the first
    line of CUDA's own error, when CUDA was dropped for one.
    """
    cuda_error: str | None = None
    for start, (provider, _) in enumerate(plan[:-1]):
        tail = plan[start:]
        try:
            if provider == TRT:
                return _open_tensorrt(make, model_path, options, tail, failures), None
            return make(str(model_path), options, providers=tail, enable_fallback=0), cuda_error
        except ORT_PROVIDER_ERRORS as exc:
            reason = _first_line(exc)
            failures.append(f"{provider} failed: {reason}")
            if provider == CUDA:
                cuda_error = reason
    return make(str(model_path), options, providers=plan[-1:], enable_fallback=0), cuda_error


def _open_tensorrt(
    make: SessionFactory, model_path: Path, options: Any, plan: ProviderPlan, failures: list[str]
) -> Any:
    """Open with TensorRT first; a cache it cannot read is moved aside and rebuilt once."""
    cache = Path(plan[0][1]["trt_engine_cache_path"])
    cache.mkdir(parents=True, exist_ok=True)
    try:
        return make(str(model_path), options, providers=plan, enable_fallback=0)
    except ORT_PROVIDER_ERRORS as exc:
        # "TensorRT EP could not deserialize engine from cache: <path>" (the provider's
        # message for a truncated, corrupt or foreign engine file)
        if "deserialize" not in str(exc):
            raise
        aside = cache.with_name(cache.name + ".unreadable")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(cache, aside)
        cache.mkdir()
        log.warning(
            "TensorRT cache %s could not be read (%s): moved to %s, rebuilding",
            cache,
            _first_line(exc),
            aside,
        )
        return make(str(model_path), options, providers=plan, enable_fallback=0)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
