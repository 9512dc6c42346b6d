"""How a worker starts and stops: provider strictness, DML options, runtime conflicts, signals."""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis
from rq.command import send_shutdown_command

from ortq import keys
from ortq.errors import ProviderUnavailable
from ortq.producer import Producer
from ortq.settings import Settings
from ortq.worker.runtime import check_single_runtime, installed_runtimes
from ortq.worker.session import SessionPlan, load_model
from tests import onnx_models
from tests.cli_support import invoke
from tests.conftest import REPO, WorkerProcesses, eventually

#: A worker's start on the oldest onnxruntime `worker` allows too (scripts/test.sh's second pass).
pytestmark = pytest.mark.rqcompat


def run_worker(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``ortq worker`` in a process of its own; a worker refused at start-up runs in this one (tests/cli_support.py)."""
    return subprocess.run(
        [sys.executable, "-m", "ortq", "worker", *args], check=False, capture_output=True, text=True, timeout=timeout,
        cwd=REPO, env=env,
    )  # fmt: skip


def test_cuda_without_cuda_refuses_to_start(tiny_path: Path, redis_url: str, model_name: str) -> None:
    # This machine's onnxruntime is the CPU build: a CUDA session would silently be a CPU one.
    assert "CUDAExecutionProvider" not in ort.get_available_providers()
    done = invoke("worker", "--model", str(tiny_path), "--name", model_name, "--provider", "cuda", "--redis-url",
                  redis_url)  # fmt: skip
    assert done.returncode == 2 and done.no_traceback(), done.stderr
    assert "ProviderUnavailable" in done.stderr
    assert "CUDAExecutionProvider" in done.stderr and "onnxruntime-gpu" in done.stderr
    assert "--allow-cpu-fallback" in done.stderr


@pytest.mark.skipif(platform.system() != "Linux", reason="DirectML's refusal is Linux's here")
@pytest.mark.parametrize("adapter", [[], ["--adapter", "0"], ["--adapter", "discrete"], ["--adapter", "name:radeon"]])
def test_a_provider_that_cannot_run_here_is_said_first_in_one_line(
    tiny_path: Path, redis_url: str, model_name: str, adapter: list[str]
) -> None:
    """The reason is all a worker says: no adapter listing, warning about adapters or "cannot
    resolve --adapter" before it (or instead of it), whatever --adapter asks for."""
    reasons = {
        "dml": "ortq: ProviderUnavailable: DirectML (--provider dml) is Windows-only: onnxruntime-directml has no "
        "Linux build. Use --provider cuda for an NVIDIA GPU (pip install 'ortq[cuda]'), else --provider cpu",
        "cuda": f"ortq: ProviderUnavailable: this ONNX Runtime (onnxruntime {ort.__version__}) has no "
        "CUDAExecutionProvider: --provider cuda needs the onnxruntime-gpu package (pip uninstall -y onnxruntime && "
        "pip install 'ortq[cuda]'); it offers ",
    }
    for provider, reason in reasons.items():
        args = ["--model", str(tiny_path), "--name", model_name, "--provider", provider, *adapter]
        done = invoke("worker", *args, "--redis-url", redis_url)
        assert done.returncode == 2 and done.no_traceback(), done.stderr
        assert done.stderr.startswith(reason) and done.stderr.count("\n") == 1, done.stderr


def test_cuda_with_allow_cpu_fallback_runs_on_cpu_and_says_so(
    tiny_path: Path, redis_url: str, model_name: str, workers: WorkerProcesses, connection: redis.Redis
) -> None:
    workers.serve(tiny_path, model_name, redis_url, 1, "--provider", "cuda", "--allow-cpu-fallback")
    [name] = [n.decode() for n in connection.smembers(keys.WORKERS_SET) if n.decode().startswith(model_name + ".")]
    record = json.loads(connection.get(keys.worker_key(name)) or b"{}")
    assert record["provider"] == "CPUExecutionProvider"
    assert record["requested_provider"] == "cuda"
    assert record["fell_back_to_cpu"] is True
    assert "running on the CPU because --allow-cpu-fallback" in workers.logs()


def test_dml_session_options_are_what_directml_requires() -> None:
    plan = SessionPlan("dml", device_id=1, threads=None, allow_cpu_fallback=False)
    options = plan.session_options(ort)
    assert options.enable_mem_pattern is False
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert plan.providers() == [("DmlExecutionProvider", {"device_id": "1"})]
    # device_id is passed even for adapter 0: the default lookup can fall back silently.
    assert SessionPlan("dml", 0, None, False).providers() == [("DmlExecutionProvider", {"device_id": "0"})]
    assert SessionPlan("cuda", 3, None, False).providers() == [("CUDAExecutionProvider", {"device_id": "3"})]
    cpu_options = SessionPlan("cpu", 0, 2, False).session_options(ort)
    assert cpu_options.enable_mem_pattern is True  # only DML turns it off
    assert cpu_options.intra_op_num_threads == 2


def test_dml_on_a_cpu_build_names_the_package_to_install(tiny_path: Path) -> None:
    with pytest.raises(ProviderUnavailable, match="onnxruntime-directml"):
        load_model(tiny_path, SessionPlan("dml", 0, None, allow_cpu_fallback=False))


def _fake_distribution(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("onnxruntime/capi/_pybind_state.py,,\n")


def test_two_onnxruntime_distributions_are_refused(tiny_path: Path, tmp_path: Path, model_name: str) -> None:
    assert [name for name, _ in installed_runtimes()] == ["onnxruntime"]
    check_single_runtime("cpu")
    site = tmp_path / "site"
    _fake_distribution(site, "onnxruntime-gpu", "1.31.1")
    _fake_distribution(site, "onnxruntime-extensions", "0.14.0")  # ships no onnxruntime/capi: not a runtime
    (site / "onnxruntime_extensions-0.14.0.dist-info" / "RECORD").write_text("onnxruntime_extensions/x.py,,\n")
    env = {"PYTHONPATH": f"{site}:{REPO}", "PATH": "/usr/bin:/bin"}
    done = run_worker("--model", str(tiny_path), "--name", model_name, "--provider", "cuda", env=env)
    assert done.returncode == 2, done.stderr
    assert "RuntimeConflict" in done.stderr
    assert "onnxruntime-gpu 1.31.1" in done.stderr and "onnxruntime-extensions" not in done.stderr
    assert "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu" in done.stderr


def test_sigterm_finishes_and_unregisters(
    tiny_path: Path, redis_url: str, model_name: str, workers: WorkerProcesses, connection: redis.Redis
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    process, _ = workers.processes[0]
    names = [n.decode() for n in connection.smembers(keys.WORKERS_SET) if n.decode().startswith(model_name + ".")]
    process.send_signal(signal.SIGTERM)
    assert process.wait(20) == 0, workers.logs()
    assert connection.get(keys.worker_key(names[0])) is None
    assert names[0].encode() not in connection.smembers(keys.WORKERS_SET)
    assert connection.hget(f"rq:worker:{names[0]}", "death") is not None  # RQ saw a clean death too


def test_a_shutdown_command_through_redis_lets_the_running_job_finish(
    redis_url: str, model_name: str, workers: WorkerProcesses, connection: redis.Redis, models_dir: Path
) -> None:
    """RQ's shutdown command (what ``ortq pool`` sends on Windows, where no console may exist):
    the running job is answered, then the worker unregisters and exits 0."""
    slow = onnx_models.slow_model(models_dir / "slow-shutdown.onnx", 2 * onnx_models.SLOW_MODEL_LOOPS)
    workers.serve(slow, model_name, redis_url)
    process, _ = workers.processes[0]
    [name] = [n.decode() for n in connection.smembers(keys.WORKERS_SET) if n.decode().startswith(model_name + ".")]
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        job = producer.submit(model_name, {"x": np.ones((1, 256), np.float32)})
        eventually(lambda: job.status() == "started")
        send_shutdown_command(connection, name)
        assert "y" in job.result(timeout=60)
    assert process.wait(30) == 0, workers.logs()
    assert "shutdown command received" in workers.logs()
    assert connection.get(keys.worker_key(name)) is None


def test_missing_model_file_is_a_clear_error(redis_url: str, model_name: str, tmp_path: Path) -> None:
    done = invoke("worker", "--model", str(tmp_path / "nope.onnx"), "--name", model_name, "--redis-url", redis_url)
    assert done.returncode == 2 and done.no_traceback()
    assert "ModelLoadError" in done.stderr and "nope.onnx" in done.stderr
