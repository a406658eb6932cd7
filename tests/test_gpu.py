"""GPU inventory: NVML readings, a node without a driver, and the static fake."""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml
import pytest

from berth.runtime.gpu import GpuInfo, GpuInventory, NvmlInventory, StaticInventory, read_gpus

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
