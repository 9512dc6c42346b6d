"""Dynamic batching: per-job results equal an unbatched session.run, bad jobs fail alone,
batching is refused where the model's first dimension is fixed, max-wait is honoured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortq.errors import ConfigurationError, InferenceFailed
from ortq.producer import Producer
from ortq.rqjob import OrtqJob
from ortq.serializer import MsgpackSerializer
from ortq.signature import ModelSignature, TensorSpec
from ortq.worker.batch import BatchSplitError, batch_key, check_batchable, concat, group, split
from tests import onnx_models
from tests.conftest import REPO, WorkerProcesses


def summary(producer: Producer, job_id: str) -> dict[str, object]:
    result = OrtqJob.fetch(job_id, connection=producer.connection, serializer=MsgpackSerializer).latest_result()
    assert result is not None
    value: dict[str, object] = result.return_value
    return value


def test_batched_results_equal_each_job_run_alone(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, conv_path: Path
) -> None:
    producer = Producer(settings=producer.settings, allow_unknown_models=True)  # before any worker starts
    rng = np.random.default_rng(5)
    images = [rng.standard_normal((1 + i % 2, 3, 224, 224)).astype(np.float32) for i in range(12)]
    # Queued before the worker starts, so that it finds them waiting and batches them.
    jobs = producer.submit_many(model_name, [{"image": image} for image in images])
    workers.serve(conv_path, model_name, redis_url, 1, "--max-batch", "8", "--rows-independent", "--max-wait-ms", "50")
    session = ort.InferenceSession(str(conv_path), providers=["CPUExecutionProvider"])
    for job, image in zip(jobs, images, strict=True):
        got = job.result(timeout=60)["logits"]
        assert got.shape == (image.shape[0], 10)
        np.testing.assert_allclose(got, session.run(None, {"image": image})[0], rtol=1e-4, atol=1e-5)
    sizes = [summary(producer, job.id)["batch_size"] for job in jobs]
    assert max(sizes) > 1, sizes  # type: ignore[type-var]


def test_a_bad_job_in_a_batch_fails_alone(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    unchecked = Producer(redis_url, validate=False, allow_unknown_models=True)  # before any worker starts
    xs = [np.full((2, 4), i, np.float32) for i in range(6)]
    inputs: list[dict[str, np.ndarray]] = [{"x": x} for x in xs]
    inputs[3] = {"x": np.zeros((2, 5), np.float32)}  # wrong fixed dim
    jobs = unchecked.submit_many(model_name, inputs)
    workers.serve(tiny_path, model_name, redis_url, 1, "--max-batch", "16", "--rows-independent")
    for i, job in enumerate(jobs):
        if i == 3:
            with pytest.raises(InferenceFailed, match="size 5 on axis 1"):
                job.result(timeout=30)
        else:
            np.testing.assert_array_equal(job.result(timeout=30)["y"], xs[i] * 2 + 1)
    assert summary(unchecked, jobs[0].id)["batch_size"] == 5


def test_batching_is_refused_without_a_dynamic_first_dim(models_dir: Path, redis_url: str, model_name: str) -> None:
    fixed = onnx_models.fixed_batch_model(models_dir / "fixed.onnx")
    command = [sys.executable, "-m", "ortq", "worker", "--model", str(fixed), "--name", model_name,
               "--redis-url", redis_url, "--max-batch", "4", "--rows-independent"]  # fmt: skip
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2
    assert "batching needs a dynamic first dimension" in done.stderr and "x: float32[1, 4]" in done.stderr


def test_a_lone_job_waits_about_max_wait(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    workers.serve(tiny_path, model_name, redis_url, 1, "--max-batch", "8", "--rows-independent", "--max-wait-ms", "300")
    job = producer.submit(model_name, {"x": np.ones((1, 4), np.float32)})
    response = producer.wait_response(job.id, model_name, 30, job.proof)
    assert response.ok
    # The worker's own account of how long it held the job open for company.
    assert 0.25 <= response.timings["batch_wait"] <= 0.6, response.timings


def test_grouping_split_and_checks() -> None:
    a = {"x": np.zeros((2, 3), np.float32)}
    b = {"x": np.ones((1, 3), np.float32)}
    c = {"x": np.ones((1, 4), np.float32)}  # other trailing dims: a group of its own
    d = {"x": np.ones((1, 3), np.float64)}  # other dtype: a group of its own
    items = [a, b, c, d, {"x": np.ones((3, 3), np.float32)}]
    groups = group(items, batch_key, max_rows=4, rows=lambda t: t["x"].shape[0])
    assert [[next(i for i, t in enumerate(items) if t is m) for m in g] for g in groups] == [[0, 1], [2], [3], [4]]
    joined = concat([a, b])
    assert joined["x"].shape == (3, 3)
    parts = split({"y": joined["x"] * 2}, [2, 1])
    np.testing.assert_array_equal(parts[1]["y"], b["x"] * 2)
    with pytest.raises(BatchSplitError):
        split({"y": np.zeros((2, 3))}, [2, 1])
    with pytest.raises(ConfigurationError, match="0-d"):
        check_batchable(ModelSignature((TensorSpec("s", "float32", ()),), ()))
    check_batchable(ModelSignature((TensorSpec("x", "float32", ("batch", 3)),), (TensorSpec("y", "float32", (None,)),)))


# ------------------------------------------------------------------ rows that are not independent


def _worker(model: Path, name: str, redis_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ortq", "worker", "--model", str(model), "--name", name,
               "--redis-url", redis_url, "--burst", *extra]  # fmt: skip
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("build", [onnx_models.job_gather_model, onnx_models.centered_model])
def test_batching_needs_the_declaration_that_rows_are_independent(
    build: object, models_dir: Path, redis_url: str, model_name: str
) -> None:
    assert callable(build)
    model = build(models_dir / f"{build.__name__}.onnx")
    done = _worker(model, model_name, redis_url, "--max-batch", "4")
    assert done.returncode == 2, done.stderr
    assert "--rows-independent" in done.stderr and "x - mean(x, axis=0)" in done.stderr


def test_models_that_mix_rows_are_exact_unbatched_and_wrong_if_falsely_declared(
    producer: Producer, redis_url: str, model_name: str, models_dir: Path
) -> None:
    """Why batching is a declaration: the same jobs through an unbatched worker equal session.run
    job by job, and through a worker that (falsely) declared the rows independent they do not:
    one job reads another's rows (Gather) or its outputs change with its company (the mean)."""
    gather = onnx_models.job_gather_model(models_dir / "job_gather.onnx")
    centered = onnx_models.centered_model(models_dir / "centered.onnx")
    rng = np.random.default_rng(3)
    cases = [
        (gather, [{"x": rng.standard_normal((2, 4)).astype(np.float32), "idx": np.array([1, 0])} for _ in range(4)]),
        (centered, [{"x": rng.standard_normal((2, 4)).astype(np.float32)} for _ in range(4)]),
    ]
    for model, inputs in cases:
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        expected = [session.run(None, job)[0] for job in inputs]
        for batched in (False, True):
            name = f"{model_name}-{model.stem}-{batched}"
            jobs = Producer(redis_url, validate=False, allow_unknown_models=True).submit_many(name, inputs)
            extra = ("--max-batch", "4", "--rows-independent") if batched else ()
            assert _worker(model, name, redis_url, *extra).returncode == 0
            got = [job.result(timeout=10)["y"] for job in jobs]
            same = all(np.allclose(g, e, rtol=1e-5, atol=1e-6) for g, e in zip(got, expected, strict=True))
            assert same is not batched, (model.stem, batched)


def test_with_batching_every_input_of_a_job_has_the_same_rows(
    workers: WorkerProcesses, redis_url: str, model_name: str, models_dir: Path
) -> None:
    gather = onnx_models.job_gather_model(models_dir / "job_gather.onnx")
    workers.serve(gather, model_name, redis_url, 1, "--max-batch", "4", "--rows-independent")
    unchecked = Producer(redis_url, validate=False)
    job = unchecked.submit(model_name, {"x": np.ones((2, 4), np.float32), "idx": np.array([0, 1, 1])})
    with pytest.raises(InferenceFailed, match="same first dimension"):
        job.result(timeout=30)
