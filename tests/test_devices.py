"""Device discovery: nvidia-smi parsing, CUDA_VISIBLE_DEVICES, explicit lists, CPU stand-ins."""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from node.devices import DeviceSpec, discover, pin_pci_bus_order

A100_0 = "GPU-a1a1a1a1-0000-4000-8000-000000000000"
A100_1 = "GPU-a1a1b2b2-0000-4000-8000-000000000001"
H100_0 = "GPU-c3c3c3c3-0000-4000-8000-000000000002"
H100_1 = "GPU-d4d4d4d4-0000-4000-8000-000000000003"

# Four GPUs, two architectures, listed out of order (the parser sorts by index).
SMI_4 = f"""\
2, {H100_0}, NVIDIA H100 80GB HBM3, 81559, 9.0, Disabled
0, {A100_0}, NVIDIA A100-SXM4-80GB, 81920, 8.0, Disabled
1, {A100_1}, NVIDIA A100-SXM4-80GB, 81920, 8.0, Disabled
3, {H100_1}, NVIDIA H100 80GB HBM3, 81559, 9.0, Disabled
"""
PINNED = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def smi(output: str = SMI_4) -> Callable[[], str]:
    return lambda: output


def missing_smi() -> str:
    raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")


def never_called() -> str:
    raise AssertionError("nvidia-smi must not run for cpu:N")


def physical(devices: list[DeviceSpec]) -> list[str]:
    return [d.uuid for d in devices]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "affinity.node" and r.levelno == logging.WARNING
    ]


def test_auto_lists_every_gpu_in_pci_order(caplog: pytest.LogCaptureFixture) -> None:
    devices = discover("auto", env=PINNED, run_nvidia_smi=smi())
    assert devices == [
        DeviceSpec(0, "cuda", 0, "NVIDIA A100-SXM4-80GB", A100_0, "sm_80", 81920),
        DeviceSpec(1, "cuda", 1, "NVIDIA A100-SXM4-80GB", A100_1, "sm_80", 81920),
        DeviceSpec(2, "cuda", 2, "NVIDIA H100 80GB HBM3", H100_0, "sm_90", 81559),
        DeviceSpec(3, "cuda", 3, "NVIDIA H100 80GB HBM3", H100_1, "sm_90", 81559),
    ]
    assert warnings_of(caplog) == []


def test_arch_and_unavailable_memory() -> None:
    out = "0, GPU-x, NVIDIA GeForce RTX 5090, [N/A], 12.0, [N/A]\n"
    [device] = discover("auto", env=PINNED, run_nvidia_smi=smi(out))
    assert (device.arch, device.memory_mb) == ("sm_120", 0)


def test_name_with_comma_is_kept() -> None:
    [device] = discover(
        "auto", env=PINNED, run_nvidia_smi=smi("0, GPU-x, Odd, Name, 1024, 8.6, Disabled")
    )
    assert (device.name, device.arch, device.memory_mb) == ("Odd, Name", "sm_86", 1024)


@pytest.mark.parametrize(
    "line",
    [
        "0, GPU-x, NVIDIA A100, 81920, 8.0",
        "zero, GPU-x, A100, 1, 8.0, Disabled",
        "0, GPU-x, A100, 1, 8, Disabled",
    ],
)
def test_unparseable_nvidia_smi_line_raises(line: str) -> None:
    with pytest.raises(RuntimeError, match="cannot parse nvidia-smi line"):
        discover("auto", env=PINNED, run_nvidia_smi=smi(line))


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("2,0", [H100_0, A100_0]),
        ("3", [H100_1]),
        (f"{H100_1},{A100_1}", [H100_1, A100_1]),
        ("GPU-d4d4,GPU-a1a1b", [H100_1, A100_1]),  # unique UUID prefixes
        (" 1 , 2 ", [A100_1, H100_0]),
        ("1abc", [A100_1]),  # CUDA reads indices like strtoul
    ],
)
def test_cuda_visible_devices_selects_and_orders(visible: str, expected: list[str]) -> None:
    devices = discover(
        "auto", env={**PINNED, "CUDA_VISIBLE_DEVICES": visible}, run_nvidia_smi=smi()
    )
    assert physical(devices) == expected
    # The ordinal is the position among visible GPUs; the local index follows that order.
    assert [(d.index, d.ordinal) for d in devices] == [(i, i) for i in range(len(expected))]


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("0,7,1", [A100_0]),  # an absent index ends the list
        ("GPU-c3,GPU-a1a1,GPU-d4", [H100_0]),  # so does an ambiguous prefix
        ("1,-1,2", [A100_1]),
        (f"{A100_0},1", [A100_0]),  # the first entry decides: UUIDs, then an index is invalid
    ],
)
def test_cuda_visible_devices_stops_at_first_invalid_entry(
    visible: str, expected: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    devices = discover(
        "auto", env={**PINNED, "CUDA_VISIBLE_DEVICES": visible}, run_nvidia_smi=smi()
    )
    assert physical(devices) == expected
    [warning] = warnings_of(caplog)
    assert "CUDA_VISIBLE_DEVICES" in warning
    assert "every entry after it" in warning


@pytest.mark.parametrize("visible", ["", "-1", "0,0", "GPU-a1a1", "7"])
def test_no_visible_gpu_serves_on_one_cpu_with_one_warning(
    visible: str, caplog: pytest.LogCaptureFixture
) -> None:
    devices = discover(
        "auto", env={**PINNED, "CUDA_VISIBLE_DEVICES": visible}, run_nvidia_smi=smi()
    )
    assert devices == [DeviceSpec(0, "cpu", None, "cpu", "cpu-0", "cpu", 0)]
    [warning] = warnings_of(caplog)
    assert f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU" in warning


def test_no_nvidia_smi_serves_on_one_cpu_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    devices = discover("auto", env={}, run_nvidia_smi=missing_smi)
    assert devices == [DeviceSpec(0, "cpu", None, "cpu", "cpu-0", "cpu", 0)]
    [warning] = warnings_of(caplog)
    assert "nvidia-smi unavailable" in warning
    assert "one CPU device" in warning


def test_nvidia_smi_listing_no_gpu_serves_on_one_cpu(caplog: pytest.LogCaptureFixture) -> None:
    assert [d.kind for d in discover("auto", env={}, run_nvidia_smi=smi(""))] == ["cpu"]
    assert warnings_of(caplog) == [
        "no GPU used: nvidia-smi lists no GPU; serving on one CPU device"
    ]


def test_real_runner_without_nvidia_smi_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert [d.kind for d in discover("auto", env={})] == ["cpu"]
    assert len(warnings_of(caplog)) == 1


def test_real_runner_reports_why_nvidia_smi_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        '#!/bin/sh\necho "NVIDIA-SMI has failed because it couldn\'t communicate" >&2\nexit 9\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert [d.kind for d in discover("auto", env={})] == ["cpu"]
    [warning] = warnings_of(caplog)
    assert "exited with 9: NVIDIA-SMI has failed" in warning


def test_real_runner_parses_nvidia_smi_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\nprintf '%s' '{SMI_4}'\n")  # printf: a builtin, PATH is bare
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert physical(discover("auto", env=PINNED)) == [A100_0, A100_1, H100_0, H100_1]


def test_unpinned_order_with_several_gpus_warns(caplog: pytest.LogCaptureFixture) -> None:
    discover("auto", env={}, run_nvidia_smi=smi())
    [warning] = warnings_of(caplog)
    assert "CUDA_DEVICE_ORDER" in warning
    caplog.clear()
    discover("auto", env={"CUDA_VISIBLE_DEVICES": "2"}, run_nvidia_smi=smi())
    assert warnings_of(caplog) == []  # one visible GPU: ordinal 0 whatever the order


def test_pin_pci_bus_order() -> None:
    env = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    pin_pci_bus_order(env)
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.mark.parametrize("spec", ["0,2", "cuda:0,2", " 0, 2 "])
def test_explicit_list(spec: str) -> None:
    devices = discover(spec, env=PINNED, run_nvidia_smi=smi())
    assert physical(devices) == [A100_0, H100_0]
    assert [(d.index, d.ordinal, d.arch) for d in devices] == [(0, 0, "sm_80"), (1, 2, "sm_90")]


def test_explicit_list_keeps_given_order_and_visible_ordinals() -> None:
    env = {**PINNED, "CUDA_VISIBLE_DEVICES": "3,2,1"}
    devices = discover("1,3", env=env, run_nvidia_smi=smi())
    assert physical(devices) == [A100_1, H100_1]
    assert [(d.index, d.ordinal) for d in devices] == [(0, 2), (1, 0)]


def test_explicit_gpu_hidden_by_cuda_visible_devices() -> None:
    env = {**PINNED, "CUDA_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(ValueError, match=r"GPU 2 is hidden by CUDA_VISIBLE_DEVICES='0,1'"):
        discover("0,2", env=env, run_nvidia_smi=smi())


def test_explicit_gpu_absent() -> None:
    with pytest.raises(ValueError, match=r"GPU 5 does not exist \(nvidia-smi lists: 0, 1, 2, 3\)"):
        discover("5", env=PINNED, run_nvidia_smi=smi())


def test_explicit_list_without_nvidia_smi() -> None:
    with pytest.raises(ValueError, match=r"devices '0': cannot list GPUs"):
        discover("0", env={}, run_nvidia_smi=missing_smi)


@pytest.mark.parametrize("count", [1, 3])
def test_cpu_stand_ins(count: int) -> None:
    devices = discover(f"cpu:{count}", env={}, run_nvidia_smi=never_called)
    assert devices == [
        DeviceSpec(i, "cpu", None, "cpu", f"cpu-{i}", "cpu", 0) for i in range(count)
    ]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("", "accepted: 'auto', 'cpu:N'"),
        ("gpu", "accepted: 'auto', 'cpu:N'"),
        ("cuda:", "accepted: 'auto', 'cpu:N'"),
        ("0,,1", "accepted: 'auto', 'cpu:N'"),
        ("auto,0", "accepted: 'auto', 'cpu:N'"),
        ("-1", "accepted: 'auto', 'cpu:N'"),
        ("cpu:0", "integer >= 1"),
        ("cpu:-2", "integer >= 1"),
        ("cpu:two", "integer >= 1"),
        ("cpu:\u00b2", "integer >= 1"),
        ("0,0", "listed twice"),
    ],
)
def test_bad_spec(spec: str, why: str) -> None:
    with pytest.raises(ValueError) as raised:
        discover(spec, env=PINNED, run_nvidia_smi=smi())
    assert repr(spec.strip()) in str(raised.value)
    assert why in str(raised.value)


# -- MIG ----------------------------------------------------------------------------------------

MIG_A = "MIG-c7384736-a75d-5afc-978f-d2f1294409fd"
MIG_B = "MIG-a28ad590-3fda-56dd-84fc-0a0b96edc58d"
MIG_H = "MIG-0f9e8d7c-0000-4000-8000-0000000000aa"
# GPU 0 (an A100) is in MIG mode with two 3g.40gb instances; GPU 2 (an H100) with one 1g.10gb.
SMI_MIG = SMI_4.replace(
    f"{A100_0}, NVIDIA A100-SXM4-80GB, 81920, 8.0, Disabled",
    (f"{A100_0}, NVIDIA A100-SXM4-80GB, 81920, 8.0, Enabled"),
).replace(
    f"{H100_0}, NVIDIA H100 80GB HBM3, 81559, 9.0, Disabled",
    (f"{H100_0}, NVIDIA H100 80GB HBM3, 81559, 9.0, Enabled"),
)
SMI_L = f"""\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: {A100_0})
  MIG 3g.40gb     Device  0: (UUID: {MIG_A})
  MIG 3g.40gb     Device  1: (UUID: {MIG_B})
GPU 1: NVIDIA A100-SXM4-80GB (UUID: {A100_1})
GPU 2: NVIDIA H100 80GB HBM3 (UUID: {H100_0})
  MIG 1g.10gb     Device  0: (UUID: {MIG_H})
GPU 3: NVIDIA H100 80GB HBM3 (UUID: {H100_1})
"""


def mig_env(visible: str) -> dict[str, str]:
    return {**PINNED, "CUDA_VISIBLE_DEVICES": visible}


@pytest.mark.parametrize("visible", [MIG_B, MIG_B[:12]], ids=["uuid", "prefix"])
def test_a_mig_instance_is_one_device_at_ordinal_0(visible: str) -> None:
    [device] = discover(
        "auto", env=mig_env(visible), run_nvidia_smi=smi(SMI_MIG), list_nvidia_smi=smi(SMI_L)
    )
    assert device == DeviceSpec(
        0, "cuda", 0, "NVIDIA A100-SXM4-80GB MIG 3g.40gb", MIG_B, "sm_80", 40 * 1024
    )


def test_mig_instance_of_another_gpu_takes_its_architecture() -> None:
    [device] = discover(
        "auto", env=mig_env(MIG_H), run_nvidia_smi=smi(SMI_MIG), list_nvidia_smi=smi(SMI_L)
    )
    assert (device.name, device.arch, device.memory_mb, device.ordinal) == (
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        "sm_90",
        10 * 1024,
        0,
    )


def test_older_drivers_mig_names() -> None:
    old = f"MIG-GPU-{A100_0.removeprefix('GPU-')}/1/0"
    listing = (
        f"GPU 0: NVIDIA A100-SXM4-80GB (UUID: {A100_0})\n  MIG 3g.40gb Device 0: (UUID: {old})\n"
    )
    [device] = discover(
        "auto", env=mig_env(old), run_nvidia_smi=smi(SMI_MIG), list_nvidia_smi=smi(listing)
    )
    assert (device.uuid, device.ordinal) == (old, 0)


@pytest.mark.parametrize(
    ("visible", "why"),
    [
        (f"{MIG_A},{MIG_B}", "names 2 devices starting with a MIG instance"),
        (f"{MIG_A},1", "names 2 devices starting with a MIG instance"),
        ("MIG-ffff", "no MIG instance matches it"),
        ("MIG-", "it matches several"),
    ],
)
def test_mig_instances_that_cannot_be_served_are_refused(visible: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"CUDA_VISIBLE_DEVICES={visible!r}") as raised:
        discover(
            "auto", env=mig_env(visible), run_nvidia_smi=smi(SMI_MIG), list_nvidia_smi=smi(SMI_L)
        )
    assert why in str(raised.value)


def test_mig_listing_failure_is_not_a_cpu_fallback() -> None:
    with pytest.raises(ValueError, match="cannot list MIG instances"):
        discover(
            "auto", env=mig_env(MIG_A), run_nvidia_smi=smi(SMI_MIG), list_nvidia_smi=missing_smi
        )
    with pytest.raises(ValueError, match="names a MIG instance but GPUs cannot be listed"):
        discover("auto", env=mig_env(MIG_A), run_nvidia_smi=missing_smi)


@pytest.mark.parametrize(("spec", "visible"), [("auto", None), ("0,1", None), ("auto", "0,1")])
def test_a_gpu_in_mig_mode_is_never_served_whole(spec: str, visible: str | None) -> None:
    env = PINNED if visible is None else mig_env(visible)
    with pytest.raises(ValueError) as raised:
        discover(spec, env=env, run_nvidia_smi=smi(SMI_MIG), list_nvidia_smi=never_called)
    message = str(raised.value)
    assert f"GPU 0 (NVIDIA A100-SXM4-80GB, {A100_0}) is in MIG mode" in message
    assert "CUDA_VISIBLE_DEVICES=MIG-<uuid>" in message and "nvidia-smi -L" in message


def test_gpus_not_in_mig_mode_beside_mig_ones_are_served() -> None:
    devices = discover("1,3", env=PINNED, run_nvidia_smi=smi(SMI_MIG), list_nvidia_smi=never_called)
    assert physical(devices) == [A100_1, H100_1]


def test_explicit_index_with_a_mig_instance_visible_says_use_auto() -> None:
    with pytest.raises(ValueError, match=r"GPU 0 is hidden by .*served with --devices auto"):
        discover("0", env=mig_env(MIG_A), run_nvidia_smi=smi(SMI_MIG), list_nvidia_smi=smi(SMI_L))


def test_real_runner_lists_mig_instances(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        f"if [ \"$1\" = -L ]; then printf '%s' '{SMI_L}'; else printf '%s' '{SMI_MIG}'; fi\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    [device] = discover("auto", env=mig_env(MIG_A))
    assert (device.uuid, device.ordinal, device.arch) == (MIG_A, 0, "sm_80")
