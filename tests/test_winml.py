"""``--provider winml``: which of Windows ML's catalog EPs ortq makes ready and registers, and
which device an ``--adapter`` spec then means, decided on recorded catalogs; and the refusal off
Windows. The catalog itself, ``ensure_ready()`` and the sessions need Windows 11 24H2 with the
Windows App SDK runtime, which no machine here has (under Wine 8 windowsml's DLL does not even
load: docs/adapters.md).

The catalogs and device lists below are written in the shapes ``windowsml`` and ONNX Runtime
report (EP names, ready states, certification, OrtEpDevice metadata keys as captured under Wine
for DML), for machines of the kinds Windows ML targets; they were not captured on those machines.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ortq.devices.plugin_ep import EpDeviceInfo
from ortq.devices.winml import CatalogEntry, choose_device, choose_entries
from ortq.errors import AdapterNotFound, AmbiguousAdapter, ProviderUnavailable
from tests.conftest import REPO

APPS = "C:\\Program Files\\WindowsApps"
OV, DML, TRT = "OpenVINOExecutionProvider", "DmlExecutionProvider", "NvTensorRTRTXExecutionProvider"


def dml(description: str, number: int, rank: int, memory_mb: int, luid: int, discrete: bool) -> EpDeviceInfo:
    return EpDeviceInfo("DmlExecutionProvider", "gpu", "", 0, 0, {
        "Description": description, "Discrete": "1" if discrete else "0", "DxgiAdapterNumber": str(number),
        "DxgiHighPerformanceIndex": str(rank), "DxgiVideoMemory": f"{memory_mb} MB", "LUID": str(luid)})  # fmt: skip


CPU = EpDeviceInfo("CPUExecutionProvider", "cpu", "Intel", 0x8086, 0, {"Description": "Intel(R) Core(TM) Ultra 7 258V"})

# A Copilot+ laptop on Snapdragon X: QNN for the NPU, ready and certified.
SNAPDRAGON_CATALOG = [
    CatalogEntry("QNNExecutionProvider", "2.1.0", "Ready", "Certified", f"{APPS}\\QNN\\onnxruntime_providers_qnn.dll"),
]
SNAPDRAGON_DEVICES = [
    EpDeviceInfo(
        "QNNExecutionProvider", "npu", "Qualcomm", 0x4D4F4351, 0, {"Description": "Snapdragon(R) X Elite NPU"}
    ),
    dml("Qualcomm(R) Adreno(TM) X1-85 GPU", 0, 0, 512, 70245, discrete=False),
    CPU,
]
# An Intel Core Ultra laptop: OpenVINO (not downloaded yet) offers CPU, the Arc iGPU and the NPU;
# DirectML offers the iGPU too. Plus an uncertified EP someone published.
INTEL_CATALOG = [
    CatalogEntry("OpenVINOExecutionProvider", "1.8.1", "NotPresent", "Certified", ""),
    CatalogEntry("ExampleExecutionProvider", "0.1.0", "Ready", "Uncertified", f"{APPS}\\Example\\example_ep.dll"),
]
INTEL_DEVICES = [
    EpDeviceInfo("OpenVINOExecutionProvider", "cpu", "Intel", 0x8086, 0, {"ov_device": "CPU"}),
    EpDeviceInfo("OpenVINOExecutionProvider", "gpu", "Intel", 0x8086, 0x64A0,
                 {"ov_device": "GPU", "Description": "Intel(R) Arc(TM) 140V GPU"}),
    EpDeviceInfo("OpenVINOExecutionProvider", "npu", "Intel", 0x8086, 0x643E,
                 {"ov_device": "NPU", "Description": "Intel(R) AI Boost"}),
    dml("Intel(R) Arc(TM) 140V GPU (16GB)", 0, 0, 128, 88211, discrete=False),
    CPU,
]  # fmt: skip
# A desktop with an RTX 4090 and an iGPU: NVIDIA's TensorRT RTX EP installed but not prepared.
NVIDIA_CATALOG = [CatalogEntry("NvTensorRTRTXExecutionProvider", "1.0.0", "NotReady", "Certified", "")]
NVIDIA_DEVICES = [
    EpDeviceInfo("NvTensorRTRTXExecutionProvider", "gpu", "NVIDIA", 0x10DE, 0x2684,
                 {"Description": "NVIDIA GeForce RTX 4090", "Discrete": "1", "LUID": "91234"}),
    dml("AMD Radeon(TM) Graphics", 0, 1, 512, 77001, discrete=False),
    dml("NVIDIA GeForce RTX 4090", 1, 0, 24210, 91234, discrete=True),
    CPU,
]  # fmt: skip


def test_only_certified_eps_unless_one_is_named() -> None:
    assert [e.name for e in choose_entries(INTEL_CATALOG, None)] == ["OpenVINOExecutionProvider"]
    assert [e.name for e in choose_entries(INTEL_CATALOG, "ExampleExecutionProvider")] == ["ExampleExecutionProvider"]
    assert choose_entries(NVIDIA_CATALOG, None)[0].ready_state == "NotReady"  # made ready, then registered
    with pytest.raises(
        ProviderUnavailable, match=r"no QNNExecutionProvider .* OpenVINOExecutionProvider \(Certified\)"
    ):
        choose_entries(INTEL_CATALOG, "QNNExecutionProvider")


@pytest.mark.parametrize(
    ("devices", "spec", "ep_name", "chosen_ep", "index_in_ep", "name"),
    [
        (SNAPDRAGON_DEVICES, "npu", None, "QNNExecutionProvider", 0, "Snapdragon(R) X Elite NPU"),
        (SNAPDRAGON_DEVICES, "integrated", None, DML, 0, "Qualcomm(R) Adreno(TM) X1-85 GPU"),
        (INTEL_DEVICES, "npu", None, OV, 2, "Intel(R) AI Boost"),
        (INTEL_DEVICES, "name:arc", OV, OV, 1, "Intel(R) Arc(TM) 140V GPU"),
        (INTEL_DEVICES, None, OV, OV, 1, "Intel(R) Arc(TM) 140V GPU"),
        (INTEL_DEVICES, "cpu", OV, OV, 0, "Intel CPU"),
        (NVIDIA_DEVICES, "high-performance", DML, DML, 1, "NVIDIA GeForce RTX 4090"),
        (NVIDIA_DEVICES, "luid:91234", TRT, TRT, 0,
         "NVIDIA GeForce RTX 4090"),
        (NVIDIA_DEVICES, "minimum-power", None, DML, 0, "AMD Radeon(TM) Graphics"),
    ],
)  # fmt: skip
def test_a_spec_names_one_device_of_one_ep(
    devices: list[EpDeviceInfo], spec: str | None, ep_name: str | None, chosen_ep: str, index_in_ep: int, name: str
) -> None:
    choice = choose_device(devices, spec, ep_name)
    assert choice is not None
    adapter, index = choice
    assert (adapter.ep_name, index, adapter.name, adapter.provider) == (chosen_ep, index_in_ep, name, "winml")


def test_a_gpu_two_eps_offer_needs_the_ep_named() -> None:
    # DirectML and OpenVINO both offer the Arc iGPU; DirectML and TensorRT RTX both the RTX 4090.
    with pytest.raises(AmbiguousAdapter, match="be more specific") as caught:
        choose_device(INTEL_DEVICES, "name:arc", None)
    assert "winml:OpenVINOExecutionProvider" in str(caught.value) and "winml:DmlExecutionProvider" in str(caught.value)
    with pytest.raises(AmbiguousAdapter):
        choose_device(NVIDIA_DEVICES, "discrete", None)
    # Without a spec or an EP, ONNX Runtime's --policy chooses (None); the CPU is never a candidate unasked.
    assert choose_device(INTEL_DEVICES, None, None) is None
    with pytest.raises(AdapterNotFound, match="offers no device besides the CPU"):
        choose_device([CPU], None, "CPUExecutionProvider")


def test_winml_off_windows_is_refused_with_what_to_use(tiny_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "ortq", "worker", "--model", str(tiny_path), "--name", "w",
                           "--provider", "winml", "--redis-url", "redis://127.0.0.1:1/0"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Windows ML (--provider winml) is Windows-only (Windows 11 24H2 or later)" in done.stderr
    assert "--provider webgpu" in done.stderr
