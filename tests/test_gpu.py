"""GPU inventory: NVML readings, a node without a driver, the static fake, and simulated GPUs
(the ``simulated_gpus`` setting, a testing aid)."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from berth.config import Settings
from berth.doctor.engines import gpu_check
from berth.errors import ConfigError
from berth.paths import BerthHome
from berth.runtime.gpu import (
    GpuInventory,
    NvmlInventory,
    SimulatedInventory,
    StaticInventory,
    inventory_for,
    read_gpus,
)
from berth.vocab.gpu import GpuInfo, parse_simulated_gpus

GIB = 1 << 30


@dataclass
class FakeDevice:
    name: str
    uuid: str
    total_bytes: int
    used_bytes: int
    utilization: int | None
    lost: bool = False


@dataclass
class FakeNvml:
    """Stands in for the NVIDIA driver behind pynvml's functions."""

    devices: list[FakeDevice]
    init_error: int | None = None
    calls: list[str] = field(default_factory=list)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(pynvml, "nvmlInit", self.init)
        monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: self.calls.append("shutdown"))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(self.devices))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", self.handle)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda device: device.name)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda device: device.uuid.encode())
        monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", self.memory)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", self.utilization)

    def init(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def handle(self, index: int) -> FakeDevice:
        return self.devices[index]

    def memory(self, device: FakeDevice) -> SimpleNamespace:
        if device.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        free = device.total_bytes - device.used_bytes
        return SimpleNamespace(total=device.total_bytes, used=device.used_bytes, free=free)

    def utilization(self, device: FakeDevice) -> SimpleNamespace:
        if device.utilization is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=device.utilization, memory=0)


def test_gpus_are_read_in_index_order_with_memory_in_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(
        [
            FakeDevice("NVIDIA H200", "GPU-aaaa", 141 * GIB, 3 * GIB + 5, 42),
            FakeDevice("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-bbbb", 40 * GIB, 0, None),
        ]
    )
    nvml.install(monkeypatch)

    gpus = read_gpus()

    assert gpus == [
        GpuInfo(0, "NVIDIA H200", "GPU-aaaa", 141 * 1024, 3 * 1024, 42),
        GpuInfo(1, "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-bbbb", 40 * 1024, 0, None),
    ]
    assert gpus[0].memory_free_mb == 138 * 1024
    assert nvml.calls == ["init", "shutdown"]


def test_no_driver_means_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    nvml.install(monkeypatch)

    assert read_gpus() == []
    assert NvmlInventory().read() == []


def test_a_lost_gpu_is_left_out_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml(
        [
            FakeDevice("GPU zero", "GPU-0", 16 * GIB, 0, 0),
            FakeDevice("GPU one", "GPU-1", 16 * GIB, 0, 0, lost=True),
        ]
    )
    nvml.install(monkeypatch)

    with caplog.at_level(logging.WARNING, logger="berth.runtime.gpu"):
        gpus = read_gpus()

    assert [gpu.uuid for gpu in gpus] == ["GPU-0"]
    assert "GPU 1" in caplog.text
    assert nvml.calls[-1] == "shutdown"


def test_static_inventory_is_a_gpu_inventory() -> None:
    card = GpuInfo(0, "Fake GPU", "GPU-fake", 24_576, 1_024, 7)
    inventory: GpuInventory = StaticInventory([card])

    first = inventory.read()
    first.clear()

    assert inventory.read() == [card]
    assert StaticInventory().read() == []


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no NVIDIA driver on this node")
def test_real_nvml_agrees_with_nvidia_smi() -> None:
    listing = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout

    expected = [line.split(",") for line in listing.strip().splitlines()]
    gpus = read_gpus()

    assert [(gpu.index, gpu.uuid) for gpu in gpus] == [
        (int(index), uuid.strip()) for index, uuid, _ in expected
    ]
    for gpu, (_, _, total) in zip(gpus, expected, strict=True):
        # nvidia-smi may report memory with or without the driver's reservation.
        assert abs(gpu.memory_total_mb - int(total)) <= int(total) // 20
        assert gpu.name and 0 <= gpu.memory_used_mb <= gpu.memory_total_mb


# -- simulated GPUs (a testing aid) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "sizes_mb"),
    [
        ("24GiB,24GiB", (24_576, 24_576)),
        ("80000MiB", (80_000,)),
        (" 24g , 1.5GiB, 512m ", (24_576, 1_536, 512)),  # any case, spaces, decimals
        ("1TiB", (1_048_576,)),
        ("", ()),
        ("   ", ()),
    ],
)
def test_simulated_gpu_sizes_are_read_in_mib(text: str, sizes_mb: tuple[int, ...]) -> None:
    assert parse_simulated_gpus(text) == sizes_mb


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("24", "'24' is not a GPU size such as 24GiB or 81920MiB"),
        ("24GB", "'24GB' is not a GPU size"),  # decimal units are not what nvidia-smi counts
        ("24GiB,,24GiB", "'' is not a GPU size"),
        ("0GiB", "'0GiB': a GPU has more than 0 and at most 16 TiB"),
        ("17TiB", "'17TiB': a GPU has more than 0 and at most 16 TiB"),
        (",".join(["1GiB"] * 65), "at most 64 simulated GPUs, not 65"),
    ],
)
def test_a_malformed_simulated_gpus_value_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_simulated_gpus(text)


def test_simulated_gpus_report_their_size_and_nothing_used() -> None:
    gpus = SimulatedInventory((24_576, 1_024)).read()
    assert [(g.index, g.memory_total_mb, g.memory_free_mb, g.simulated) for g in gpus] == [
        (0, 24_576, 24_576, True),
        (1, 1_024, 1_024, True),
    ]
    assert not GpuInfo(0, "H100", "GPU-1234", 81_559, 0, 0).simulated
    assert isinstance(inventory_for("24GiB"), SimulatedInventory)
    assert isinstance(inventory_for(None), NvmlInventory)
    assert isinstance(inventory_for(""), NvmlInventory)


def test_the_setting_refuses_a_malformed_value_naming_the_variable(tmp_path: Path) -> None:
    home = BerthHome(tmp_path)
    with pytest.raises(ConfigError) as refused:
        Settings.load(home, env={"BERTH_SIMULATED_GPUS": "24GiB,lots"})
    assert str(refused.value) == (
        "environment variable BERTH_SIMULATED_GPUS: invalid simulated_gpus '24GiB,lots': "
        "'lots' is not a GPU size such as 24GiB or 81920MiB (comma-separated, one per GPU)"
    )
    loaded = Settings.load(home, env={"BERTH_SIMULATED_GPUS": "2GiB,2GiB"})
    assert (loaded.simulated_gpus, loaded.source("simulated_gpus")) == ("2GiB,2GiB", "env")


def test_doctor_says_simulated_gpus_are_on() -> None:
    check = gpu_check("24GiB,24GiB", "env")
    assert (check.name, check.verdict) == ("gpus", "warn")
    assert check.detail == (
        "simulated (0: 24576 MiB, 1: 24576 MiB) by simulated_gpus from env: a testing aid, "
        "NVML is not asked and engines run on the CPU"
    )
