"""The ONNX Runtime provider plan of one device, and building a session pinned to it.

A CUDA device gets ``[TensorRT (opt-in), CUDA, CPU]``, each GPU provider carrying the
device's CUDA ordinal as ``device_id``; a CPU device gets ``[CPU]``. TensorRT engine and timing
caches live in one directory per GPU architecture (``<trt_cache_root>/sm_90``): an engine built
for one architecture is useless on another, so GPUs of different kinds never share a cache.

ONNX Runtime's own fallback is disabled when a session is built: when a provider cannot be
registered it retries with ``["CUDAExecutionProvider", "CPUExecutionProvider"]`` *without
their options*, which would silently move every device onto GPU 0. :func:`build_session`
drops failed providers itself, keeping the device's options, and says so in one warning line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import onnxruntime

from node.devices import DeviceSpec

logger = logging.getLogger(__name__)

ProviderPlan = list[tuple[str, dict[str, str]]]
"""Providers in order of preference, each with its ONNX Runtime options."""

# ONNX Runtime severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.
_ORT_ERROR = 3


@dataclass(frozen=True)
class ProviderSettings:
    """How GPU sessions are built; one value for the whole node.

    ``tensorrt`` puts the TensorRT provider first (engines are built on the first session
    creation per architecture, which can take minutes, then loaded from
    ``trt_cache_root/<arch>``). ``trt_fp16`` lets TensorRT use FP16 kernels. ``cuda_graph``
    captures the model as a CUDA graph per device (ONNX Runtime then requires runs through
    I/O binding with fixed shapes and buffers). ``cuda_mem_limit_mb`` caps the CUDA memory
    arena of each session, in MiB. ``trt_cache_root`` is stored with ``~`` expanded.
    """

    tensorrt: bool = False
    trt_cache_root: Path = Path("~/.cache/affinity/trt")
    trt_fp16: bool = False
    cuda_graph: bool = False
    cuda_mem_limit_mb: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trt_cache_root", Path(self.trt_cache_root).expanduser())
        if self.cuda_mem_limit_mb is not None and self.cuda_mem_limit_mb < 1:
            raise ValueError(f"cuda_mem_limit_mb={self.cuda_mem_limit_mb}: must be >= 1 MiB")


@dataclass(frozen=True)
class BuiltSession:
    """A session and what ONNX Runtime really made of the plan.

    ``requested`` is the first provider of the plan, ``active`` the first provider the session
    uses; ``fell_back`` is true when they differ. ``provider_options`` is
    ``session.get_provider_options()`` (the options in force, ``device_id`` included).
    """

    session: onnxruntime.InferenceSession
    requested: str
    active: str
    fell_back: bool
    provider_options: dict[str, dict[str, str]]


def trt_cache_dir(device: DeviceSpec, settings: ProviderSettings) -> Path:
    """The TensorRT engine and timing cache directory of ``device``: one per architecture."""
    return settings.trt_cache_root / device.arch


def provider_plan(device: DeviceSpec, settings: ProviderSettings) -> ProviderPlan:
    """Return the providers and options for a session on ``device``.

    For a cuda device: TensorRT (only when ``settings.tensorrt``; creates its cache directory,
    see :func:`trt_cache_dir`), then CUDA, then CPU. For a cpu device: CPU alone. Raises
    ``ValueError`` for a cuda device without an ordinal.
    """
    if device.kind == "cpu":
        return [("CPUExecutionProvider", {})]
    if device.ordinal is None:
        raise ValueError(f"device {device.index} ({device.name}) is cuda but has no ordinal")
    device_id = str(device.ordinal)
    plan: ProviderPlan = []
    if settings.tensorrt:
        cache = trt_cache_dir(device, settings)
        cache.mkdir(parents=True, exist_ok=True)
        trt = {
            "device_id": device_id,
            "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": str(cache),
            "trt_timing_cache_enable": "True",
            "trt_timing_cache_path": str(cache),
            "trt_fp16_enable": str(settings.trt_fp16),
        }
        if settings.cuda_graph:
            # ONNX Runtime replays the graph of the first provider that captures one; with
            # TensorRT running the model, CUDA's own capture would find no nodes to capture.
            trt["trt_cuda_graph_enable"] = "True"
        plan.append(("TensorrtExecutionProvider", trt))
    # HEURISTIC: exhaustive cuDNN search would stall the first request of every new shape.
    cuda = {"device_id": device_id, "cudnn_conv_algo_search": "HEURISTIC"}
    if settings.cuda_mem_limit_mb is not None:
        cuda["gpu_mem_limit"] = str(settings.cuda_mem_limit_mb * 1024 * 1024)
        # Growing by powers of two could overshoot the limit by almost half of it.
        cuda["arena_extend_strategy"] = "kSameAsRequested"
    if settings.cuda_graph:
        cuda["enable_cuda_graph"] = "1"
    plan.append(("CUDAExecutionProvider", cuda))
    plan.append(("CPUExecutionProvider", {}))
    return plan


def build_session(
    model_path: Path,
    device: DeviceSpec,
    settings: ProviderSettings,
    *,
    intra_op_threads: int = 1,
) -> BuiltSession:
    """Build an ONNX Runtime session for ``model_path`` pinned to ``device``.

    Providers of the plan that ONNX Runtime cannot register (libraries missing) are dropped in
    order, keeping the others' options; a CUDA provider that fails to load is dropped by ONNX
    Runtime itself. Either way the result says so (``fell_back``) and one warning line names
    the device and the provider really used. ONNX Runtime's own logging is lowered to errors,
    process-wide. ``intra_op_threads`` is the session's intra-op thread count (0 lets ONNX
    Runtime use one per core; the default 1 keeps device workers on a CPU host from fighting
    over cores). Errors loading the model itself propagate unchanged.
    """
    plan = provider_plan(device, settings)
    onnxruntime.set_default_logger_severity(_ORT_ERROR)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = _ORT_ERROR
    options.intra_op_num_threads = intra_op_threads
    failures: list[str] = []
    session = _open(model_path, options, plan, failures)
    requested = plan[0][0]
    active = session.get_providers()[0]
    if active != requested:
        why = "; ".join(failures) or f"{requested} did not load; ONNX Runtime logged why"
        logger.warning(
            "device %d (%s, %s, cuda ordinal %s): asked for %s, ONNX Runtime runs on %s (%s)",
            device.index,
            device.name,
            device.uuid,
            device.ordinal,
            requested,
            active,
            why,
        )
    return BuiltSession(
        session=session,
        requested=requested,
        active=active,
        fell_back=active != requested,
        provider_options=session.get_provider_options(),
    )


def _open(
    model_path: Path,
    options: onnxruntime.SessionOptions,
    plan: ProviderPlan,
    failures: list[str],
) -> onnxruntime.InferenceSession:
    """Open a session on the longest tail of ``plan`` whose providers all register.

    Appends one line per dropped provider to ``failures``.
    """
    for start, (provider, _) in enumerate(plan[:-1]):
        try:
            return _session(model_path, options, plan[start:])
        # What ONNX Runtime raises when a provider cannot be registered.
        except (RuntimeError, ValueError) as exc:
            reason = str(exc).strip().splitlines()
            failures.append(f"{provider} failed: {reason[0] if reason else type(exc).__name__}")
    return _session(model_path, options, plan[-1:])


def _session(
    model_path: Path, options: onnxruntime.SessionOptions, plan: ProviderPlan
) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(str(model_path), options, providers=plan, enable_fallback=0)
