"""Job timeouts of ``session.run`` (ortq.worker.deadline): one watcher thread a worker, real
sessions, real runs stopped by ONNX Runtime. The end-to-end path (a producer's ``job_timeout``
through a worker process) is tests/test_reliability.py's."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

from ortq.errors import JobTimeout
from ortq.worker.deadline import RunDeadline
from ortq.worker.session import LoadedModel, SessionPlan, load_model
from tests import onnx_models


@pytest.fixture(scope="module")
def slow_path(models_dir: Path) -> Path:
    """A model whose one single-threaded run takes about 2 s on this machine."""
    return onnx_models.timed_slow_model(models_dir / "slow-2s.onnx", 2.0)


def _cpu(path: Path) -> LoadedModel:
    return load_model(path, SessionPlan("cpu", None, 1, allow_cpu_fallback=False))


def test_timed_runs_share_one_thread_and_answer_as_session_run(conv_path: Path) -> None:
    model = _cpu(conv_path)
    direct = ort.InferenceSession(str(conv_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    threads_before = threading.active_count()
    for _ in range(50):
        image = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
        got = model.run({"image": image}, timeout=180)
        want = direct.run(None, {"image": image})
        np.testing.assert_allclose(got[model.output_names[0]], want[0], rtol=1e-5, atol=1e-6)
    # A timer thread a run would leave up to 50 behind (each until its cancel is seen); one watcher.
    assert threading.active_count() <= threads_before + 1
    assert [t.name for t in threading.enumerate()].count("ortq-run-timeout") == 1


def test_a_short_timeout_after_a_long_one_stops_its_run(tiny_path: Path, slow_path: Path) -> None:
    tiny, slow = _cpu(tiny_path), _cpu(slow_path)
    slow.deadline = tiny.deadline  # one worker, one watcher: here it sleeps toward the long deadline
    tiny.run({"x": np.ones((1, 4), np.float32)}, timeout=3600)
    x = {"x": np.ones((1, 256), np.float32)}
    started = time.perf_counter()
    slow.run(x)
    unstopped = time.perf_counter() - started
    assert unstopped > 1.0  # the model really outlasts the timeout below
    started = time.perf_counter()
    with pytest.raises(JobTimeout, match=r"timeout of 0\.3 s"):
        slow.run(x, timeout=0.3)
    # Stopped near its timeout: the watcher was woken for the earlier deadline.
    assert time.perf_counter() - started < unstopped * 0.75
    # The next timed run is not stopped by what came before.
    np.testing.assert_allclose(slow.run(x, timeout=60)["y"], slow.run(x)["y"])


def test_a_run_that_ended_is_not_terminated_at_its_deadline() -> None:
    deadline = RunDeadline()
    ended, stopped = SimpleNamespace(terminate=False), SimpleNamespace(terminate=False)
    deadline.arm(ended, 0.1)
    deadline.disarm()
    time.sleep(0.3)
    assert ended.terminate is False
    deadline.arm(stopped, 0.1)
    time.sleep(0.3)
    assert stopped.terminate is True
