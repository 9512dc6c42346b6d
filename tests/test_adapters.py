"""Choosing the adapter: selection on recorded adapter tables, CUDA renumbering, NVML without a
driver, resolution when nothing can be enumerated, none for a provider that cannot run here, the
CPU canary and ``--provider auto``."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from ortq.devices.adapters import Adapter, nvml_adapters, select_adapter, visible_cuda_order
from ortq.errors import AdapterNotFound, AmbiguousAdapter, CanaryMismatch, ConfigurationError, ProviderUnavailable
from ortq.worker.serve import WorkerConfig, resolve_adapter, resolve_plan
from ortq.worker.session import SessionPlan, compare_with_cpu, load_model, warmup_inputs
from tests.conftest import REPO

#: ONNX Runtime's side of adapters and providers changes between releases: scripts/test.sh's second
#: pass runs these on the oldest onnxruntime `worker` allows too.
pytestmark = pytest.mark.rqcompat

GiB = 1024**3

# Recorded from the shapes real machines report (DXGI descriptions, memory, preference ranks).
LAPTOP = [
    Adapter("dml", 0, "Intel(R) Iris(R) Xe Graphics", "integrated", luid="0x0000000000011c2e", vendor_id=0x8086,
            memory_bytes=128 * 1024**2, high_performance_rank=1, minimum_power_rank=0),
    Adapter("dml", 1, "NVIDIA GeForce RTX 3060 Laptop GPU", "discrete", luid="0x0000000000012f41",
            vendor_id=0x10DE, memory_bytes=6 * GiB, high_performance_rank=0, minimum_power_rank=1),
    Adapter("dml", 2, "Microsoft Basic Render Driver", "software", software=True, luid="0x0000000000013311",
            vendor_id=0x1414, memory_bytes=0, high_performance_rank=2, minimum_power_rank=2),
    Adapter("cpu", None, "11th Gen Intel(R) Core(TM) i7-11800H", "cpu"),
]  # fmt: skip
WORKSTATION = [
    Adapter("dml", 0, "NVIDIA GeForce RTX 4090", "discrete", luid="0x00000000000a1b01", memory_bytes=24 * GiB),
    Adapter("dml", 1, "NVIDIA GeForce RTX 4090", "discrete", luid="0x00000000000a1c77", memory_bytes=24 * GiB),
    Adapter("dml", 2, "Microsoft Basic Render Driver", "software", software=True, luid="0x00000000000a2000"),
    Adapter("cuda", 0, "NVIDIA GeForce RTX 4090", "discrete", uuid="GPU-5f3c0a9e-1111-2222-3333-444455556666"),
    Adapter("cuda", 1, "NVIDIA GeForce RTX 4090", "discrete", uuid="GPU-9d01be42-aaaa-bbbb-cccc-ddddeeeeffff"),
    Adapter("cpu", None, "AMD Ryzen Threadripper", "cpu"),
]
SOFTWARE_ONLY = [
    Adapter("dml", 0, "llvmpipe (LLVM 15.0.6, 256 bits)", "software", software=True, luid="0x0000000000000d1d"),
    Adapter("cpu", None, "CPU", "cpu"),
]


@pytest.mark.parametrize(
    ("table", "spec", "index"),
    [
        (LAPTOP, "1", 1),
        (LAPTOP, "discrete", 1),
        (LAPTOP, "integrated", 0),
        (LAPTOP, "high-performance", 1),
        (LAPTOP, "minimum-power", 0),
        (LAPTOP, "name:nvidia", 1),
        (LAPTOP, "NAME:iris", 0),
        (LAPTOP, "luid:0x0000000000012f41", 1),
        (LAPTOP, "luid:77633", 1),  # the same LUID in decimal
        (WORKSTATION, "luid:0xa1c77", 1),
        (WORKSTATION, "high-performance", 0),
        (SOFTWARE_ONLY, "high-performance", 0),
        (SOFTWARE_ONLY, "name:llvmpipe", 0),
    ],
)
def test_selection(table: list[Adapter], spec: str, index: int) -> None:
    assert select_adapter(spec, table, "dml").index == index


def test_cuda_selection_by_uuid_prefix() -> None:
    assert select_adapter("uuid:GPU-9d01", WORKSTATION, "cuda").index == 1
    assert select_adapter("0", WORKSTATION, "cuda").uuid == "GPU-5f3c0a9e-1111-2222-3333-444455556666"


@pytest.mark.parametrize(("table", "spec"), [(WORKSTATION, "name:geforce"), (WORKSTATION, "discrete"),
                                             (WORKSTATION, "uuid:GPU")])  # fmt: skip
def test_ambiguous_specs_are_refused_with_the_table(table: list[Adapter], spec: str) -> None:
    provider = "cuda" if spec.startswith("uuid") else "dml"
    with pytest.raises(AmbiguousAdapter) as caught:
        select_adapter(spec, table, provider)
    message = str(caught.value)
    assert "2 " in message and "be more specific" in message
    assert "provider  index  name" in message and "0x00000000000a1c77" in message


UNMATCHED = [(WORKSTATION, "name:intel"), (WORKSTATION, "integrated"), (LAPTOP, "7"), (SOFTWARE_ONLY, "discrete"),
             (LAPTOP, "luid:0x1")]  # fmt: skip


@pytest.mark.parametrize(("table", "spec"), UNMATCHED)
def test_unmatched_specs_are_refused_with_the_table(table: list[Adapter], spec: str) -> None:
    with pytest.raises(AdapterNotFound, match="Adapters on this machine"):
        select_adapter(spec, table, "dml")


def test_bad_specs() -> None:
    with pytest.raises(ConfigurationError, match="unknown adapter spec"):
        select_adapter("fastest", LAPTOP, "dml")
    with pytest.raises(ConfigurationError, match="bad LUID"):
        select_adapter("luid:xyz", LAPTOP, "dml")


def test_preference_without_a_system_order_uses_memory_and_kind() -> None:
    unranked = [Adapter(a.provider, a.index, a.name, a.kind, a.software, a.luid, memory_bytes=a.memory_bytes)
                for a in LAPTOP]  # fmt: skip
    assert select_adapter("high-performance", unranked, "dml").index == 1
    assert select_adapter("minimum-power", unranked, "dml").index == 0


def test_cuda_visible_devices_renumbers() -> None:
    uuids = ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-cccc3333"]
    assert visible_cuda_order(uuids, None) == [0, 1, 2]
    assert visible_cuda_order(uuids, "2,0") == [2, 0]
    assert visible_cuda_order(uuids, "GPU-bbbb,1") == [1]  # a repeat ends the list, as in CUDA
    assert visible_cuda_order(uuids, "1,7,0") == [1]  # so does an entry that matches nothing
    assert visible_cuda_order(uuids, "") == []


def test_nvml_without_a_driver_lists_no_cuda_devices() -> None:
    import pynvml

    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()  # this machine has no NVIDIA driver: the real library says so
    assert nvml_adapters() == []


def test_ortq_adapters_lists_the_cpu_and_says_what_is_missing() -> None:
    done = subprocess.run([sys.executable, "-m", "ortq", "adapters", "--json"], check=True, capture_output=True,
                          text=True, cwd=REPO)  # fmt: skip
    rows = json.loads(done.stdout)
    # No DML or CUDA here; a webgpu row where the Vulkan loader finds lavapipe (tests/test_plugin_ep.py).
    assert [row["provider"] for row in rows if row["provider"] != "webgpu"] == ["cpu"]
    table = subprocess.run([sys.executable, "-m", "ortq", "adapters"], check=True, capture_output=True, text=True)
    assert "DXGI exists only on Windows" in table.stdout and "no CUDA devices" in table.stdout


def resolved(config: WorkerConfig) -> tuple[SessionPlan, dict[str, Any] | None]:
    """The adapter resolution alone, as a worker does it where its provider can run (Windows with
    DirectML but no DXGI enumeration, Linux with onnxruntime-gpu but no nvidia-ml-py)."""
    return resolve_adapter(config, SessionPlan(config.provider, None, None, False))


def test_resolution_when_nothing_can_be_enumerated(tiny_path: Path) -> None:
    # Off Windows nothing enumerates DML adapters: a preference falls to DirectML's own options.
    plan, record = resolved(WorkerConfig(tiny_path, "m", provider="dml", adapter="high-performance"))
    assert plan.device_id is None
    assert plan.provider_options() == {"performance_preference": "high_performance", "device_filter": "gpu"}
    assert record == {"spec": "high-performance", "performance_preference": "high_performance", "device_filter": "gpu"}
    plan, _ = resolved(WorkerConfig(tiny_path, "m", provider="cuda", adapter="1"))
    assert plan.provider_options() == {"device_id": "1"}
    with pytest.raises(AdapterNotFound, match="cannot resolve --adapter 'name:radeon'"):
        resolved(WorkerConfig(tiny_path, "m", provider="cuda", adapter="name:radeon"))
    # DirectML off Windows: a spec only DXGI could resolve says why it cannot, not "use an index".
    with pytest.raises(ProviderUnavailable, match=r"DirectML .* is Windows-only"):
        resolved(WorkerConfig(tiny_path, "m", provider="dml", adapter="name:radeon"))
    with pytest.raises(ConfigurationError, match="does not apply"):
        WorkerConfig(tiny_path, "m", provider="cpu", adapter="0")


@pytest.mark.skipif(platform.system() != "Linux", reason="DirectML's refusal is Linux's; CUDA's needs the CPU build")
def test_a_provider_that_cannot_run_here_is_not_resolved_to_an_adapter(tiny_path: Path) -> None:
    """Before any adapter is looked for, the worker asks whether its provider can run at all: the
    plan carries the reason (load_model raises it, or falls back), and no adapter is resolved."""
    assert "CUDAExecutionProvider" not in ort.get_available_providers()  # this machine's CPU build
    for provider, reason in (("dml", "is Windows-only"), ("cuda", "has no CUDAExecutionProvider")):
        for adapter in (None, "0", "discrete", "name:radeon", "uuid:GPU-0000"):
            plan, record = resolve_plan(WorkerConfig(tiny_path, "m", provider=provider, adapter=adapter))
            assert plan.unavailable is not None and reason in plan.unavailable, (provider, adapter)
            assert record is None and plan.device_id is None


def test_canary_catches_zeros_and_accepts_gpu_rounding(conv_path: Path) -> None:
    model = load_model(conv_path, SessionPlan("cpu", None, 1, False))
    inputs = warmup_inputs(model.signature, seed=1)
    reference = model.run(inputs)
    zeros = {name: np.zeros_like(value) for name, value in reference.items()}
    with pytest.raises(CanaryMismatch, match="differs from the CPU"):
        compare_with_cpu(zeros, reference, "DmlExecutionProvider")
    # TF32-sized relative noise (seen on the H200: 3.6e-4) passes.
    rng = np.random.default_rng(0)
    noisy = {n: (v * (1 + 4e-4 * rng.standard_normal(v.shape))).astype(v.dtype) for n, v in reference.items()}
    assert compare_with_cpu(noisy, reference, "CUDAExecutionProvider") > 0
    ints = {"i": np.array([1, 2, 3])}
    with pytest.raises(CanaryMismatch):
        compare_with_cpu({"i": np.array([1, 2, 4])}, ints, "DmlExecutionProvider")


def test_provider_auto_that_lands_on_the_cpu_is_refused(tiny_path: Path, redis_url: str, model_name: str) -> None:
    # Seen here: PREFER_GPU quietly picks the CPU when there is no GPU.
    command = [sys.executable, "-m", "ortq", "worker", "--model", str(tiny_path), "--name", model_name,
               "--provider", "auto", "--redis-url", redis_url]  # fmt: skip
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2, done.stderr
    if not hasattr(ort.SessionOptions(), "set_provider_selection_policy"):
        # onnxruntime < 1.23 (scripts/test.sh's second pass): no policies at all, said as such,
        # with or without --allow-cpu-fallback.
        assert "--provider auto needs onnxruntime >= 1.23" in done.stderr
        command += ["--allow-cpu-fallback", "--burst"]
        again = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert again.returncode == 2 and "needs onnxruntime >= 1.23" in again.stderr, again.stderr
        return
    assert "--provider auto (policy prefer-gpu) chose the CPU" in done.stderr
    fallback = subprocess.run([*command, "--allow-cpu-fallback", "--burst"], check=False, capture_output=True,
                              text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert fallback.returncode == 0, fallback.stderr
    assert "running on the CPU because --allow-cpu-fallback" in fallback.stderr
