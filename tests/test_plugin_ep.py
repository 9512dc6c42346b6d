"""Plugin execution providers: the real ``ortq worker --provider webgpu`` (onnxruntime-ep-webgpu
on Mesa's lavapipe, a software Vulkan driver), the general ``--provider plugin``, and their
refusals (no Vulkan loader, no driver, an ONNX Runtime too old for the plugin, a model the EP
takes no node of); then the WebGPU adapter logic on recorded tables.

Needs the Vulkan loader and lavapipe (``libvulkan1``, ``mesa-vulkan-drivers``; .ci/run installs
them). Without them the module is skipped, except under CI=true or ORTQ_REQUIRE_WEBGPU=1, where
it fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortq.demo import HOLDOUT_PATH, MODEL_PATH
from ortq.devices.adapters import Adapter
from ortq.devices.plugin_ep import EpDeviceInfo, adapter_from_ep_device, dawn_choice, resolve_webgpu
from ortq.errors import ConfigurationError
from ortq.producer import Producer
from tests.conftest import REPO, Pool, WorkerProcesses

GiB = 1024**3


def _missing() -> str | None:
    if importlib.util.find_spec("onnxruntime_ep_webgpu") is None:
        return "onnxruntime-ep-webgpu is not installed"
    from ortq.devices.vulkan import enumerate_vulkan

    try:
        devices = enumerate_vulkan()
    except OSError as exc:
        return str(exc)
    return None if devices else "no Vulkan driver (apt install mesa-vulkan-drivers for lavapipe)"


MISSING = _missing()
REQUIRED = os.environ.get("CI") == "true" or os.environ.get("ORTQ_REQUIRE_WEBGPU") == "1"
needs_webgpu = pytest.mark.skipif(MISSING is not None and not REQUIRED, reason=f"WebGPU cannot run here: {MISSING}")


def worker(
    *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``ortq worker`` that is expected to stop at start-up (it has no Redis to reach)."""
    command = [*prefix, sys.executable, "-m", "ortq", "worker", "--name", "refused", "--redis-url", "redis://127.0.0.1:1/0",
               *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, env=env, check=False)


def cpu_run(model: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def record_of(producer: Producer, name: str) -> dict[str, object]:
    [record] = producer.workers(name)
    return record


def float64_model(path: Path) -> Path:
    """``y = x + x`` in float64, a type the WebGPU EP has no kernel for."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "f64",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@needs_webgpu
@pytest.mark.parametrize("which", ["digits", "conv"])
def test_webgpu_worker_serves_like_the_cpu(
    which: str, conv_path: Path, producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str
) -> None:
    model = MODEL_PATH if which == "digits" else conv_path
    workers.serve(model, model_name, redis_url, 1, "--provider", "webgpu")
    if which == "digits":
        inputs = {"pixels": np.load(HOLDOUT_PATH)["pixels"][:32]}
    else:
        inputs = {"image": np.random.default_rng(3).standard_normal((2, 3, 224, 224)).astype(np.float32)}
    outputs = producer.infer(model_name, inputs, timeout=120)
    expected = cpu_run(model, inputs)
    for name, want in expected.items():
        if want.dtype.kind == "f":
            np.testing.assert_allclose(outputs[name], want, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max())))
        else:
            np.testing.assert_array_equal(outputs[name], want)
    record = record_of(producer, model_name)
    assert record["provider"] == "WebGpuExecutionProvider" and record["fell_back_to_cpu"] is False
    assert record["requested_provider"] == "webgpu"
    adapter = record["adapter"]
    assert isinstance(adapter, dict) and "llvmpipe" in adapter["name"] and adapter["kind"] == "software"
    assert adapter["power_preference"] == "high-performance"
    # Every node on WebGPU, and the CPU canary ran (it would have refused wrong outputs).
    nodes = record["nodes"]
    assert (
        isinstance(nodes, dict) and list(nodes) == ["WebGpuExecutionProvider"] and nodes["WebGpuExecutionProvider"] > 0
    )
    canary = record["canary"]
    assert isinstance(canary, dict) and canary["passed"] is True and "max_abs_diff" in canary


@needs_webgpu
def test_ortq_adapters_lists_what_vulkaninfo_lists() -> None:
    rows = json.loads(subprocess.run([sys.executable, "-m", "ortq", "adapters", "--json"], check=True,
                                     capture_output=True, text=True, cwd=REPO).stdout)  # fmt: skip
    webgpu = [r for r in rows if r["provider"] == "webgpu"]
    assert webgpu and all(r["ep_name"] == "WebGpuExecutionProvider" for r in webgpu)
    if shutil.which("vulkaninfo"):  # an independent reading of the same devices
        summary = subprocess.run(["vulkaninfo", "--summary"], capture_output=True, text=True, check=True).stdout
        for row in webgpu:
            assert f"deviceName         = {row['name']}" in summary
            assert f"deviceUUID         = {row['uuid'].removeprefix('GPU-')}" in summary


@needs_webgpu
def test_a_model_the_ep_takes_no_node_of_is_refused(tmp_path: Path) -> None:
    model = float64_model(tmp_path / "f64.onnx")
    done = worker("--model", str(model), "--provider", "webgpu")
    assert done.returncode == 2, done.stderr
    assert "WebGpuExecutionProvider was created but took none of the model's 1 nodes (1 on CPUExecutionProvider)" in (
        done.stderr
    )
    assert "--allow-cpu-fallback" in done.stderr


@needs_webgpu
def test_general_plugin_provider_with_the_webgpu_library(
    tiny_path: Path, producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import onnxruntime_ep_webgpu

    library = onnxruntime_ep_webgpu.get_library_path()
    # The plain plugin path sets nothing for the EP: with this, it offers lavapipe on the CPU's hardware device.
    monkeypatch.setenv("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
    refused = worker("--model", str(tiny_path), "--provider", "plugin", "--ep-library", library)
    assert refused.returncode == 2, refused.stderr
    assert "WebGpuExecutionProvider offers only CPU devices; to run it there anyway, say so with --adapter cpu" in (
        refused.stderr
    )
    wrong = worker("--model", str(tiny_path), "--provider", "plugin", "--ep-library", library, "--ep-name", "NoSuchEP")
    assert wrong.returncode == 2 and "no device of an EP named 'NoSuchEP'" in wrong.stderr, wrong.stderr
    missing = worker("--model", str(tiny_path), "--provider", "plugin", "--ep-library", "/nonexistent/libep.so")
    assert missing.returncode == 2 and "could not register the execution provider library" in missing.stderr
    assert "No such file or directory" in missing.stderr

    workers.serve(
        tiny_path, model_name, redis_url, 1, "--provider", "plugin", "--ep-library", library, "--adapter", "cpu"
    )
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(producer.infer(model_name, {"x": x}, timeout=60)["y"], 2 * x + 1)
    record = record_of(producer, model_name)
    adapter = record["adapter"]
    assert record["provider"] == "WebGpuExecutionProvider" and isinstance(adapter, dict)
    assert adapter["provider"] == "plugin" and adapter["kind"] == "cpu" and adapter["ep_library"] == library
    listed = subprocess.run([sys.executable, "-m", "ortq", "adapters", "--ep-library", library], check=True,
                            capture_output=True, text=True, cwd=REPO).stdout  # fmt: skip
    assert "plugin:WebGpuExecutionProvider" in listed


@needs_webgpu
def test_a_pool_of_webgpu_and_plugin_workers(
    tmp_path: Path, tiny_path: Path, producer: Producer, redis_url: str, model_name: str, pools: list[Pool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``ortq pool`` plans WebGPU and plugin-EP workers as the workers resolve them, starts them with
    their adapter's stable spec and their EP library, and they serve what the CPU computes."""
    import onnxruntime_ep_webgpu

    library = onnxruntime_ep_webgpu.get_library_path()
    monkeypatch.setenv("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")  # the plugin path sets nothing for the EP
    shutil.copy(MODEL_PATH, tmp_path / "digits.onnx")
    shutil.copy(tiny_path, tmp_path / "tiny.onnx")
    web, plug = f"{model_name}-web", f"{model_name}-plug"
    path = tmp_path / "pool.toml"
    path.write_text(f"""
[pool]
grace_seconds = 20
[[model]]
name = "{web}"
path = "digits.onnx"
provider = "webgpu"
[[model.workers]]
count = 2
[[model]]
name = "{plug}"
path = "tiny.onnx"
provider = "plugin"
ep_library = "{library}"
[[model.workers]]
adapter = "cpu"
count = 1
""")
    check = subprocess.run([sys.executable, "-m", "ortq", "pool", "--config", str(path), "--check"], cwd=REPO,
                           capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert check.returncode == 0, check.stderr
    [vulkan] = [line for line in check.stdout.splitlines() if line.startswith(web)]
    assert "webgpu" in vulkan and "llvmpipe" in vulkan and "uuid:" in vulkan, check.stdout
    [plugin] = [line for line in check.stdout.splitlines() if line.startswith(plug)]
    assert "plugin" in plugin and "cpu -> " in plugin, check.stdout

    pool = Pool(path, redis_url)
    pools.append(pool)
    records = producer.wait_for_workers(web, 2, timeout=120) + producer.wait_for_workers(plug, 1, timeout=120)
    assert [r["provider"] for r in records] == ["WebGpuExecutionProvider"] * 3, pool.text()
    pixels = np.load(HOLDOUT_PATH)["pixels"][:16]
    jobs = producer.submit_many(web, [{"pixels": row[None]} for row in pixels])
    for got, row in zip(producer.results(jobs, timeout=120), pixels, strict=True):
        want = cpu_run(MODEL_PATH, {"pixels": row[None]})
        np.testing.assert_allclose(got["probabilities"], want["probabilities"], rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(got["label"], want["label"])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(producer.infer(plug, {"x": x}, timeout=60)["y"], cpu_run(tiny_path, {"x": x})["y"])
    [plugged] = producer.workers(plug)
    assert plugged["adapter"]["ep_library"] == library and plugged["adapter"]["kind"] == "cpu"
    pool.process.terminate()
    assert pool.wait() == 0, pool.text()


@needs_webgpu
def test_webgpu_without_the_vulkan_loader_says_what_to_install(tiny_path: Path) -> None:
    import ctypes.util

    loader = Path("/lib/x86_64-linux-gnu/libvulkan.so.1")
    if not loader.exists() or ctypes.util.find_library("vulkan") is None:
        pytest.skip("the loader is not where this test hides it")
    # A private mount namespace in which the loader is an empty file: the real missing-loader path.
    hide = (
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount --bind /dev/null {loader} && exec "$@"',
        "-",
    )
    done = worker("--model", str(tiny_path), "--provider", "webgpu", prefix=hide)
    if "unshare" in done.stderr and done.returncode != 2:
        pytest.skip(f"no mount namespace here: {done.stderr[-200:]}")
    assert done.returncode == 2, done.stderr
    assert "the Vulkan loader libvulkan.so.1 could not be loaded" in done.stderr
    assert "apt install libvulkan1" in done.stderr


@needs_webgpu
def test_webgpu_without_a_vulkan_driver_says_so(tiny_path: Path) -> None:
    env = {**os.environ, "VK_DRIVER_FILES": "/nonexistent.json", "VK_ICD_FILENAMES": "/nonexistent.json"}
    done = worker("--model", str(tiny_path), "--provider", "webgpu", env=env)
    assert done.returncode == 2, done.stderr
    assert "the Vulkan loader found no device (no Vulkan driver)" in done.stderr
    assert "mesa-vulkan-drivers" in done.stderr


@pytest.fixture(scope="module")
def old_onnxruntime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with onnxruntime 1.23.2: it has the plugin-EP API, but is older than the WebGPU EP needs."""
    venv = tmp_path_factory.mktemp("ort-1.23")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    wanted = [
        "onnxruntime==1.23.2",
        "onnxruntime-ep-webgpu==0.4.0",
        "numpy",
        "msgpack",
        "redis[hiredis]",
        "rq",
        "click",
        "prometheus-client",
    ]
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check",
                           "--target", site, *wanted], check=False, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sysconfig.get_paths()["purelib"] != site
    return python


@needs_webgpu
def test_webgpu_on_an_onnxruntime_too_old_for_it(old_onnxruntime: Path, tiny_path: Path) -> None:
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    done = subprocess.run([str(old_onnxruntime), "-m", "ortq", "worker", "--model", str(tiny_path), "--name", "old",
                           "--provider", "webgpu", "--redis-url", "redis://127.0.0.1:1/0"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "onnxruntime 1.23.2 could not register the execution provider library" in done.stderr
    assert 'ORT runtime version "1.23.2" is below the minimum required version "1.24.4"' in done.stderr
    assert "pip install --upgrade 'onnxruntime>=1.24.4'" in done.stderr


# --------------------------------------------------------------------------- recorded tables

# The Vulkan view of a laptop (Intel iGPU + NVIDIA dGPU + lavapipe) and of this CI machine.
LAPTOP = [
    Adapter("webgpu", 0, "Intel(R) Iris(R) Xe Graphics (TGL GT2)", "integrated",
            uuid="8680a99a-0c00-0000-0002-000000000000", vendor_id=0x8086, memory_bytes=16 * GiB),
    Adapter("webgpu", 1, "NVIDIA GeForce RTX 3060 Laptop GPU", "discrete",
            uuid="GPU-5f3c0a9e-1111-2222-3333-444455556666", vendor_id=0x10DE, memory_bytes=6 * GiB),
    Adapter("webgpu", 2, "llvmpipe (LLVM 15.0.6, 256 bits)", "software", software=True,
            uuid="6d657361-3235-2e30-2e37-2d327e627000", vendor_id=0x10005),
]  # fmt: skip
LAVAPIPE_ONLY = [Adapter("webgpu", 0, "llvmpipe (LLVM 15.0.6, 256 bits)", "software", software=True)]


@pytest.mark.parametrize(
    ("spec", "index", "preference"),
    [
        (None, 1, "high-performance"),
        ("high-performance", 1, "high-performance"),
        ("minimum-power", 0, "minimum-power"),
        ("discrete", 1, "high-performance"),
        ("integrated", 0, "minimum-power"),
        ("name:nvidia", 1, "high-performance"),
        ("uuid:GPU-5f3c", 1, "high-performance"),
        ("0", 0, "minimum-power"),
    ],
)
def test_webgpu_specs_map_to_dawns_power_preference(spec: str | None, index: int, preference: str) -> None:
    adapter, chosen = resolve_webgpu(spec, LAPTOP)
    assert (adapter.index, chosen) == (index, preference)


def test_webgpu_refuses_an_adapter_no_preference_reaches() -> None:
    with pytest.raises(ConfigurationError, match=r"no preference reaches this one") as caught:
        resolve_webgpu("name:llvmpipe", LAPTOP)
    assert "high-performance gives NVIDIA GeForce RTX 3060 Laptop GPU" in str(caught.value)
    # Alone, the software driver is what Dawn picks, by either preference.
    assert resolve_webgpu(None, LAVAPIPE_ONLY)[0].index == 0
    assert dawn_choice(LAVAPIPE_ONLY, "minimum-power").index == 0


# get_ep_devices() as ONNX Runtime reported it: the first two under Wine (Windows CPython,
# onnxruntime-directml 1.24.4 + onnxruntime-ep-webgpu 0.4.0, vkd3d over lavapipe); the others in
# the shapes ONNX Runtime's Linux discovery and an NPU plugin give (not captured on such machines).
WINE_WEBGPU = EpDeviceInfo("WebGpuExecutionProvider", "gpu", "", 65541, 0, {
    "Description": "llvmpipe (LLVM 15.0.6, 256 bits)", "DxgiAdapterNumber": "0", "DxgiHighPerformanceIndex": "0",
    "DxgiVideoMemory": "24105 MB", "LUID": "1008"})  # fmt: skip
WINE_CPU = EpDeviceInfo("CPUExecutionProvider", "cpu", "AMD", 4130, 0, {"Description": "AMD"})
LINUX_GPU = EpDeviceInfo("WebGpuExecutionProvider", "gpu", "NVIDIA", 0x10DE, 0x2335, {"card_idx": "0"})
NPU = EpDeviceInfo("QNNExecutionProvider", "npu", "Qualcomm", 0x4D4F4351, 0, {"Description": "Snapdragon X Elite NPU"})


def test_ep_devices_become_adapter_rows() -> None:
    # From the metadata alone llvmpipe's 24 GB count as a discrete GPU; on Windows ortq completes the
    # row from DXGI by LUID (software), as tests/windows/test_windows_plugin_ep.py checks.
    wine = adapter_from_ep_device(WINE_WEBGPU, 0, "webgpu")
    assert (wine.name, wine.kind, wine.luid, wine.memory_bytes) == (
        "llvmpipe (LLVM 15.0.6, 256 bits)", "discrete", "0x00000000000003f0", 24105 * 1024**2)  # fmt: skip
    assert wine.high_performance_rank == 0 and wine.ep_name == "WebGpuExecutionProvider"
    linux = adapter_from_ep_device(LINUX_GPU, 0, "plugin")
    assert (linux.kind, linux.name, linux.luid) == ("gpu", "NVIDIA GPU", None)
    assert adapter_from_ep_device(NPU, 0, "plugin").kind == "npu"
    assert adapter_from_ep_device(WINE_CPU, 0, "plugin").kind == "cpu"
