"""Device discovery: which GPUs (or CPU stand-ins) this node serves on.

A node serves on a list of :class:`DeviceSpec`, one per device, chosen by a spec string:

``auto``
    Every GPU that ``nvidia-smi`` lists and ``CUDA_VISIBLE_DEVICES`` lets CUDA see. Best
    effort: when ``nvidia-smi`` is missing or fails, or no GPU is visible, the node serves on
    one CPU device and logs one warning line saying why.
``cpu:N``
    N CPU stand-ins (N >= 1), for tests and CPU hosts. ``nvidia-smi`` is not run.
``0,2`` or ``cuda:0,2``
    Exactly these GPUs, by their ``nvidia-smi`` index (PCI bus order), in the order given.
    Strict: a GPU that is missing or hidden by ``CUDA_VISIBLE_DEVICES`` raises ``ValueError``.

MIG. A GPU in MIG mode is never served whole. CUDA would run on one of its instances, not on
the GPU ``nvidia-smi --query-gpu`` describes. Naming it, or ``auto`` finding it, raises
``ValueError`` saying so. A MIG instance is served when ``CUDA_VISIBLE_DEVICES`` names it
(``MIG-<uuid>``, a unique prefix of it, or the older ``MIG-GPU-<uuid>/<gi>/<ci>``) with
``auto``. It is one cuda device with CUDA ordinal 0 and its ``MIG-`` UUID. Its name is the
parent GPU's with the instance's profile (``NVIDIA A100-SXM4-80GB MIG 3g.40gb``). It has the
parent's architecture and the memory of its profile. ``nvidia-smi -L`` lists the instances.
One MIG instance per node process: a CUDA process enumerates a single MIG instance (the
NVIDIA MIG user guide). Naming several raises ``ValueError``; run one ``affinity-node`` per
instance.

Ordinals. CUDA (and so ONNX Runtime's ``device_id``) numbers only the GPUs that
``CUDA_VISIBLE_DEVICES`` lets through, in the order that variable lists them.
``nvidia-smi`` lists every GPU regardless. :attr:`DeviceSpec.ordinal` is the CUDA number.
Both agree on the numbering only when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. CUDA's default
orders the fastest GPU first. So call :func:`pin_pci_bus_order` on ``os.environ`` before
anything initialises CUDA. :func:`discover` warns when more than one GPU is visible and the
order is not pinned.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("affinity.node")

NVIDIA_SMI_QUERY: tuple[str, ...] = (
    "nvidia-smi",
    "--query-gpu=index,uuid,name,memory.total,compute_cap,mig.mode.current",
    "--format=csv,noheader,nounits",
)
"""The command :func:`discover` runs; its output has one CSV line per GPU."""

NVIDIA_SMI_LIST: tuple[str, ...] = ("nvidia-smi", "-L")
"""Lists GPUs and their MIG instances; run only when ``CUDA_VISIBLE_DEVICES`` names one."""

_ACCEPTED = "'auto', 'cpu:N' (N >= 1), or GPU indices like '0,2' or 'cuda:0,2'"


@dataclass(frozen=True)
class DeviceSpec:
    """One device of this node.

    ``index`` is the local index; the device id is ``f"{node_id}/{index}"``. ``ordinal`` is
    the CUDA device number to give ONNX Runtime as ``device_id`` (``None`` for cpu). ``uuid``
    is the GPU UUID (``GPU-...``), or ``cpu-<index>`` for CPU stand-ins. ``arch`` is the
    compute capability as ``sm_90``, or ``cpu``. ``memory_mb`` is total memory in MiB: 0 for
    cpu, and 0 when ``nvidia-smi`` reports it as not available.
    """

    index: int
    kind: Literal["cuda", "cpu"]
    ordinal: int | None
    name: str
    uuid: str
    arch: str
    memory_mb: int


@dataclass(frozen=True)
class _Gpu:
    """One line of ``nvidia-smi`` output (or one MIG instance of one of its GPUs)."""

    physical: int
    uuid: str
    name: str
    memory_mb: int
    arch: str
    mig: bool = False  # the GPU is in MIG mode: only its instances can be served


def pin_pci_bus_order(env: MutableMapping[str, str]) -> None:
    """Set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` in ``env`` so CUDA numbers GPUs as nvidia-smi does.

    Only takes effect for CUDA if done before CUDA is initialised in this process (before the
    first CUDA session is built). Idempotent.
    """
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"


def discover(
    spec: str,
    *,
    env: Mapping[str, str] | None = None,
    run_nvidia_smi: Callable[[], str] | None = None,
    list_nvidia_smi: Callable[[], str] | None = None,
) -> list[DeviceSpec]:
    """Return the devices that ``spec`` selects, local indices ``0..n-1`` (see module doc).

    ``env`` defaults to ``os.environ``; it is read for ``CUDA_VISIBLE_DEVICES`` and
    ``CUDA_DEVICE_ORDER``. ``CUDA_VISIBLE_DEVICES`` holds indices, GPU UUIDs and UUID
    prefixes, or one MIG instance; ``""`` or ``-1`` hide every GPU. As in CUDA, an entry that
    matches no single GPU hides itself and every entry after it. ``run_nvidia_smi`` returns
    the output of :data:`NVIDIA_SMI_QUERY` and ``list_nvidia_smi`` that of
    :data:`NVIDIA_SMI_LIST`, or raise ``OSError`` saying why they could not. They default to
    running the real commands with a timeout.

    Raises ``ValueError`` when ``spec`` is malformed or names a GPU that is absent, not
    visible or in MIG mode. Also ``ValueError`` when ``CUDA_VISIBLE_DEVICES`` names MIG
    instances that cannot be served (see module doc). ``RuntimeError`` when ``nvidia-smi``
    prints a line this cannot parse.
    """
    env = os.environ if env is None else env
    run = _run_nvidia_smi if run_nvidia_smi is None else run_nvidia_smi
    listing = _run_nvidia_smi_list if list_nvidia_smi is None else list_nvidia_smi
    spec = spec.strip()
    if spec == "auto":
        return _auto(env, run, listing)
    if spec.startswith("cpu:"):
        return _cpus(spec)
    return _explicit(spec, env, run, listing)


def _cpus(spec: str) -> list[DeviceSpec]:
    count = spec.removeprefix("cpu:")
    if not (count.isascii() and count.isdigit()) or int(count) < 1:
        raise ValueError(f"devices {spec!r}: N in 'cpu:N' must be an integer >= 1")
    return [_cpu(i) for i in range(int(count))]


def _cpu(index: int) -> DeviceSpec:
    return DeviceSpec(
        index=index,
        kind="cpu",
        ordinal=None,
        name="cpu",
        uuid=f"cpu-{index}",
        arch="cpu",
        memory_mb=0,
    )


def _auto(
    env: Mapping[str, str], run: Callable[[], str], listing: Callable[[], str]
) -> list[DeviceSpec]:
    try:
        gpus = _parse(run())
    except OSError as exc:
        if _names_mig(env):
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r} names a MIG instance "
                f"but GPUs cannot be listed: {exc}"
            ) from exc
        log.warning("no GPU used: nvidia-smi unavailable (%s); serving on one CPU device", exc)
        return [_cpu(0)]
    visible = _visible(gpus, env, listing)
    if not visible:
        why = (
            "nvidia-smi lists no GPU"
            if not gpus
            else f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r} hides every GPU"
        )
        log.warning("no GPU used: %s; serving on one CPU device", why)
        return [_cpu(0)]
    _refuse_mig_mode(visible, "auto")
    _check_order(visible, env)
    return [_cuda(i, gpu, visible) for i, gpu in enumerate(visible)]


def _explicit(
    spec: str, env: Mapping[str, str], run: Callable[[], str], listing: Callable[[], str]
) -> list[DeviceSpec]:
    wanted = _parse_indices(spec)
    try:
        gpus = _parse(run())
    except OSError as exc:
        raise ValueError(f"devices {spec!r}: cannot list GPUs: {exc}") from exc
    present = {gpu.physical: gpu for gpu in gpus}
    visible = _visible(gpus, env, listing)
    chosen: list[_Gpu] = []
    for physical in wanted:
        if physical not in present:
            listed = ", ".join(str(g.physical) for g in gpus) or "none"
            raise ValueError(
                f"devices {spec!r}: GPU {physical} does not exist (nvidia-smi lists: {listed})"
            )
        if present[physical] not in visible:
            hint = " (a MIG instance is served with --devices auto)" if _names_mig(env) else ""
            raise ValueError(
                f"devices {spec!r}: GPU {physical} is hidden by "
                f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}{hint}"
            )
        chosen.append(present[physical])
    _refuse_mig_mode(chosen, f"devices {spec!r}")
    _check_order(visible, env)
    return [_cuda(i, gpu, visible) for i, gpu in enumerate(chosen)]


def _parse_indices(spec: str) -> list[int]:
    body = spec.removeprefix("cuda:")
    parts = [part.strip() for part in body.split(",")]
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise ValueError(f"devices {spec!r}: not understood; accepted: {_ACCEPTED}")
    indices = [int(part) for part in parts]
    if len(set(indices)) != len(indices):
        raise ValueError(f"devices {spec!r}: a GPU is listed twice")
    return indices


def _cuda(index: int, gpu: _Gpu, visible: Sequence[_Gpu]) -> DeviceSpec:
    return DeviceSpec(
        index=index,
        kind="cuda",
        ordinal=visible.index(gpu),
        name=gpu.name,
        uuid=gpu.uuid,
        arch=gpu.arch,
        memory_mb=gpu.memory_mb,
    )


def _check_order(visible: Sequence[_Gpu], env: Mapping[str, str]) -> None:
    order = env.get("CUDA_DEVICE_ORDER")
    if len(visible) > 1 and order != "PCI_BUS_ID":
        log.warning(
            "CUDA_DEVICE_ORDER=%r, not 'PCI_BUS_ID': CUDA may number the %d visible GPUs "
            "differently from nvidia-smi, so a device could run on the wrong GPU",
            order,
            len(visible),
        )


def _refuse_mig_mode(gpus: Sequence[_Gpu], what: str) -> None:
    for gpu in gpus:
        if gpu.mig:
            raise ValueError(
                f"{what}: GPU {gpu.physical} ({gpu.name}, {gpu.uuid}) is in MIG mode; CUDA "
                "would run on one of its MIG instances, not on the whole GPU. Serve an instance: "
                "CUDA_VISIBLE_DEVICES=MIG-<uuid> (nvidia-smi -L lists them) with --devices auto, "
                "one affinity-node per instance"
            )


def _names_mig(env: Mapping[str, str]) -> bool:
    return env.get("CUDA_VISIBLE_DEVICES", "").strip().startswith("MIG-")


def _visible(
    gpus: Sequence[_Gpu], env: Mapping[str, str], listing: Callable[[], str]
) -> list[_Gpu]:
    """The GPUs CUDA can see, in CUDA's order, as ``CUDA_VISIBLE_DEVICES`` selects them.

    Mirrors CUDA's parsing, as PyTorch models it. The first entry decides between indices,
    ``GPU-`` UUID prefixes and a ``MIG-`` instance (see :func:`_mig_visible`). The first entry
    that is invalid, absent or an ambiguous prefix ends the list. A GPU named twice makes the
    whole list empty.
    """
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(gpus)
    entries = [part.strip() for part in raw.split(",")]
    if entries[0].startswith("MIG-"):
        return _mig_visible(raw, entries, gpus, listing)
    by_uuid = entries[0].startswith("GPU-")
    visible: list[_Gpu] = []
    for entry in entries:
        gpu = _by_uuid_prefix(entry, gpus) if by_uuid else _by_index(entry, gpus)
        if gpu is None:
            if visible:
                log.warning(
                    "CUDA_VISIBLE_DEVICES=%r: entry %r matches no single GPU; CUDA ignores it "
                    "and every entry after it",
                    raw,
                    entry,
                )
            break
        if gpu in visible:
            return []
        visible.append(gpu)
    return visible


def _by_index(entry: str, gpus: Sequence[_Gpu]) -> _Gpu | None:
    digits = len(entry) - len(entry.lstrip("0123456789"))
    if digits == 0:
        return None
    # CUDA reads an index like strtoul: "1abc" is 1.
    return next((gpu for gpu in gpus if gpu.physical == int(entry[:digits])), None)


def _by_uuid_prefix(entry: str, gpus: Sequence[_Gpu]) -> _Gpu | None:
    if not entry.startswith("GPU-"):
        return None
    found = [gpu for gpu in gpus if gpu.uuid.startswith(entry)]
    return found[0] if len(found) == 1 else None


_LIST_GPU = re.compile(r"^GPU (\d+): .* \(UUID: (GPU-[^)\s]+)\)\s*$")
_LIST_MIG = re.compile(r"^\s+MIG (\S+)\s+Device\s+\d+: \(UUID: (MIG-[^)\s]+)\)\s*$")
_PROFILE_GB = re.compile(r"\.(\d+)gb$")


def _mig_visible(
    raw: str, entries: Sequence[str], gpus: Sequence[_Gpu], listing: Callable[[], str]
) -> list[_Gpu]:
    """The one MIG instance ``CUDA_VISIBLE_DEVICES`` names, as a GPU of its own."""
    if len(entries) > 1:
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={raw!r} names {len(entries)} devices starting with a MIG "
            "instance; a CUDA process uses one MIG instance, so run one affinity-node per "
            "instance, each with CUDA_VISIBLE_DEVICES=MIG-<uuid>"
        )
    try:
        text = listing()
    except OSError as exc:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={raw!r}: cannot list MIG instances: {exc}") from exc
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    parent: _Gpu | None = None
    found: list[_Gpu] = []
    for line in text.splitlines():
        if match := _LIST_GPU.match(line):
            parent = by_uuid.get(match.group(2))
        elif (match := _LIST_MIG.match(line)) and parent is not None:
            profile, uuid = match.groups()
            if uuid.startswith(entries[0]):
                size = _PROFILE_GB.search(profile)
                found.append(
                    _Gpu(
                        physical=parent.physical,
                        uuid=uuid,
                        name=f"{parent.name} MIG {profile}",
                        memory_mb=int(size.group(1)) * 1024 if size else 0,
                        arch=parent.arch,
                    )
                )
    if len(found) != 1:
        listed = "no MIG instance matches it" if not found else "it matches several"
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={raw!r}: {listed} (nvidia-smi -L lists the instances)"
        )
    return found


def _parse(output: str) -> list[_Gpu]:
    """Parse ``nvidia-smi`` CSV (index, uuid, name, memory MiB, compute capability, MIG mode)."""
    gpus = []
    for line in output.splitlines():
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        try:
            if len(fields) < 6:
                raise ValueError("expected 6 fields")
            index, uuid, *name, memory, capability, mig = fields
            major, minor = capability.split(".")
            gpus.append(
                _Gpu(
                    physical=int(index),
                    uuid=uuid,
                    name=", ".join(name),
                    memory_mb=int(memory) if memory.isascii() and memory.isdigit() else 0,
                    arch=f"sm_{int(major)}{int(minor)}",
                    mig=mig == "Enabled",
                )
            )
        except ValueError as exc:
            raise RuntimeError(f"cannot parse nvidia-smi line {line!r}: {exc}") from exc
    return sorted(gpus, key=lambda gpu: gpu.physical)


def _run_nvidia_smi() -> str:
    """Run :data:`NVIDIA_SMI_QUERY`; raise ``OSError`` saying why when it cannot."""
    return _run(NVIDIA_SMI_QUERY)


def _run_nvidia_smi_list() -> str:
    """Run :data:`NVIDIA_SMI_LIST`; raise ``OSError`` saying why when it cannot."""
    return _run(NVIDIA_SMI_LIST)


def _run(command: Sequence[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=30)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip().splitlines()
        why = detail[0] if detail else "no output"
        raise OSError(f"nvidia-smi exited with {exc.returncode}: {why}") from exc
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"nvidia-smi did not answer within {exc.timeout} s") from exc
    return done.stdout
