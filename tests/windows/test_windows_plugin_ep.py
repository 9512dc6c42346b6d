"""Plugin EPs on Windows CPython under Wine 8: ``--provider webgpu`` (the Windows code path of
ortq's WebGPU support: devices from ONNX Runtime's DXGI-based discovery, and what the WebGPU EP
itself does there) and ``--provider winml`` (what Windows ML's ``windowsml`` does there).

What was seen (onnxruntime-directml 1.24.4 + onnxruntime-ep-webgpu 0.4.0, Wine 8.0, vkd3d over
lavapipe): ONNX Runtime lists the llvmpipe adapter for the WebGPU EP with the same DXGI metadata
as for DirectML, but the EP cannot create its Dawn device: "D3D12 create fence handle failed with
E_NOTIMPL" (Wine 8's vkd3d has no shared fence handles); forced onto Dawn's Vulkan backend it
finds no adapter. ONNX Runtime's own default then quietly runs the model on the CPU; ortq must
refuse instead. If a newer Wine makes the EP work, the refusal test fails and is to be turned into
an end-to-end one. Windows ML's ``Microsoft.Windows.AI.MachineLearning.dll`` does not load under
Wine 8 (it imports ``api-ms-win-core-psm-appnotify-l1-1-0.dll``, which Wine lacks), so the catalog
cannot be read at all; the worker must say so.

Needs the environment tests/windows/setup.sh builds; skipped without it, except with CI=true or
ORTQ_REQUIRE_WINE=1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models
from tests.windows.test_windows_worker import _MISSING, _wine_required
from tests.windows.winenv import WineEnvironment, WineSession, windows_path

if _MISSING is not None and not _wine_required():
    pytest.skip(f"{_MISSING} (ORTQ_REQUIRE_WINE=1 makes this a failure)", allow_module_level=True)

pytestmark = [pytest.mark.timeout(300), pytest.mark.adapters]


@pytest.fixture(scope="module")
def wine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WineSession]:
    env = WineEnvironment.find()
    if env is None:
        pytest.fail(f"the Wine environment is required but: {WineEnvironment.missing_reason()}", pytrace=False)
    if "onnxruntime-ep-webgpu" not in env.versions or "windowsml" not in env.versions:
        pytest.fail("the Wine environment lacks onnxruntime-ep-webgpu or windowsml: run tests/windows/setup.sh again")
    with WineSession(env, tmp_path_factory.mktemp("wine-plugin-ep")) as session:
        yield session


def test_webgpu_adapters_come_from_onnxruntimes_dxgi_discovery(wine: WineSession) -> None:
    done = wine.run(["-m", "ortq", "adapters", "--json"], timeout=180).check()
    rows = json.loads(done.output[done.output.index("[") :])
    dml = [r for r in rows if r["provider"] == "dml"]
    webgpu = [r for r in rows if r["provider"] == "webgpu"]
    assert len(dml) == 1 and len(webgpu) == 1, rows
    # The same adapter, seen by DXGI (ctypes) and by the WebGPU EP's OrtEpDevice metadata.
    assert webgpu[0]["name"] == dml[0]["name"] and "llvmpipe" in webgpu[0]["name"]
    assert webgpu[0]["luid"] == dml[0]["luid"] and webgpu[0]["ep_name"] == "WebGpuExecutionProvider"
    assert webgpu[0]["high_performance_rank"] == 0
    # ONNX Runtime's metadata does not say the adapter is a software one; DXGI does, and ortq uses it.
    assert (webgpu[0]["kind"], webgpu[0]["software"]) == (dml[0]["kind"], dml[0]["software"])


def test_webgpu_worker_refuses_instead_of_running_on_the_cpu(wine: WineSession, tmp_path: Path) -> None:
    model = onnx_models.tiny_model(tmp_path / "tiny.onnx")
    with LocalRedis() as server, Producer(settings=Settings.from_url(server.url)) as producer:
        done = wine.run(["-m", "ortq", "worker", "--model", windows_path(model), "--name", "webgpu-wine",
                         "--provider", "webgpu", "--redis-url", server.url], timeout=180)  # fmt: skip
        assert done.returncode == 2, done.output
        assert "ProviderUnavailable" in done.output and "WebGpuExecutionProvider could not start" in done.output
        assert "Failed to get a WebGPU device: D3D12 create fence handle failed with E_NOTIMPL" in done.output
        assert producer.workers("webgpu-wine") == []  # never served, not even on the CPU


def test_winml_says_windows_ml_did_not_load(wine: WineSession, tmp_path: Path) -> None:
    model = onnx_models.tiny_model(tmp_path / "tiny.onnx")
    done = wine.run(["-m", "ortq", "worker", "--model", windows_path(model), "--name", "winml-wine",
                     "--provider", "winml", "--redis-url", "redis://127.0.0.1:1/0"], timeout=180)  # fmt: skip
    assert done.returncode == 2, done.output
    assert "ProviderUnavailable: Windows ML's runtime did not load" in done.output
    assert "Microsoft.Windows.AI.MachineLearning.dll" in done.output and "Windows 11 24H2" in done.output
