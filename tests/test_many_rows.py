"""Batches of many-row jobs (a producer that batches itself, e.g. 32 rows a job: issue 34's
digits32): the main thread's check, join and split of such a batch give each job exactly its own
rows of one ``session.run`` on the joined inputs, and a bad job among them fails alone. Real ONNX
Runtime sessions on real models (tests/onnx_models.py, the bundled digits model); no mocks.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortq import keys, knownheaders, wire
from ortq.demo import MODEL_PATH
from ortq.errors import InferenceFailed
from ortq.producer import Producer
from ortq.rqcompat.book import StartedJob
from ortq.rqcompat.layout import utcnow
from ortq.settings import Settings
from ortq.worker import jobs
from ortq.worker.batch import BatchSplitError, group, split
from ortq.worker.intake import Taken
from ortq.worker.model_signature import signature_of
from tests import onnx_models
from tests.conftest import WorkerProcesses
from tests.test_batching import summary
from tests.test_fuzz import job_fields

SETTINGS = Settings.from_url("redis://127.0.0.1:1/0")  # never connects
#: A job hash of model "m" that names the reply stream its producer reads (else it fails InvalidJob).
FIELDS = {**job_fields("m"), b"ortq_reply": keys.new_reply_name(60).encode()}


def taken_of(frames: list[bytes]) -> list[Taken]:
    return [
        Taken(StartedJob(f"job-{i}", uuid.uuid4().hex, FIELDS, None, 60, utcnow(), len(f)), f)
        for i, f in enumerate(frames)
    ]


def frame_of(inputs: dict[str, np.ndarray], seed: int) -> bytes:
    return wire.encode_request(inputs, {"nonce": np.random.default_rng(seed).bytes(16)})


def through_the_worker_stages(
    session: ort.InferenceSession, frames: list[bytes], max_rows: int
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, str], list[dict[str, np.ndarray]], list[list[str]]]:
    """The main thread's stages on ``frames``, as ortq.worker.loop runs them: each job's outputs, each
    failed job's reason, each run's joined inputs and its members' ids."""
    signature, names = signature_of(session), [o.name for o in session.get_outputs()]
    pending, failures = jobs.check_batch(taken_of(frames), "m", signature, SETTINGS, True, 0.0)
    outputs: dict[str, dict[str, np.ndarray]] = {}
    feeds, members_of_runs = [], []
    for members in group(pending, lambda p: p.key, max_rows, lambda p: p.rows):
        feed = jobs.group_inputs(members)
        ran = dict(zip(names, session.run(names, feed), strict=True))
        per_job = split(ran, [m.rows for m in members]) if len(members) > 1 else [ran]
        outputs.update((m.started.job_id, mine) for m, mine in zip(members, per_job, strict=True))
        feeds.append(feed)
        members_of_runs.append([m.started.job_id for m in members])
    return outputs, {f.started.job_id: f.reason for f in failures}, feeds, members_of_runs


@pytest.mark.parametrize("rows", [[32] * 24, [32, 1, 7, 32, 0, 32, 5, 32, 32, 3]], ids=["32 each", "mixed"])
def test_many_row_jobs_get_their_own_rows_of_one_run_and_a_bad_one_fails_alone(rows: list[int]) -> None:
    session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    inputs = [{"pixels": rng.standard_normal((n, 64)).astype(np.float32)} for n in rows]
    frames = [frame_of(x, i) for i, x in enumerate(inputs)]
    # Bad jobs among the good, each with a header of its own: a dim of another size, another dtype.
    bad: dict[int, dict[str, np.ndarray]] = {
        3: {"pixels": np.zeros((32, 63), np.float32)},
        6: {"pixels": np.zeros((32, 64), np.float64)},
    }
    for i, x in bad.items():
        frames[i] = frame_of(x, 100 + i)
    knownheaders.KNOWN.clear()
    wire.decode_request(frame_of(inputs[0], 99))  # the producer's header, remembered from before
    outputs, failed, feeds, runs = through_the_worker_stages(session, frames, max_rows=256)

    assert failed.keys() == {f"job-{i}" for i in bad}
    assert "size 63 on axis 1" in failed["job-3"] and "float64" in failed["job-6"], failed
    assert outputs.keys() == {f"job-{i}" for i in range(len(rows)) if i not in bad}
    assert max(len(members) for members in runs) > 1, runs  # jobs did share runs
    # Each run's inputs are its members' own rows, in order.
    for feed, members in zip(feeds, runs, strict=True):
        own = [inputs[int(job_id.split("-")[1])]["pixels"] for job_id in members]
        np.testing.assert_array_equal(feed["pixels"], np.concatenate(own))
        # Each job's outputs: exactly its rows of a direct run on the same joined inputs, bit for bit.
        direct = session.run(None, {"pixels": np.concatenate(own)})
        start = 0
        for job_id, mine in zip(members, own, strict=True):
            got, end = outputs[job_id], start + len(mine)
            assert list(got) == ["probabilities", "label"]
            for name, whole in zip(["probabilities", "label"], direct, strict=True):
                assert got[name].dtype == whole.dtype and got[name].shape == whole[start:end].shape
                assert got[name].tobytes() == whole[start:end].tobytes(), (job_id, name)
            start = end
    # And each job's outputs are what its inputs give run alone (the model's rows are independent).
    for i, x in enumerate(inputs):
        if i in bad:
            continue
        alone = session.run(None, x)
        np.testing.assert_allclose(outputs[f"job-{i}"]["probabilities"], alone[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(outputs[f"job-{i}"]["label"], alone[1])


def test_split_gives_each_job_its_rows_as_views_whatever_the_sizes(tmp_path: Path) -> None:
    session = ort.InferenceSession(
        str(onnx_models.tiny_model(tmp_path / "tiny.onnx")), providers=["CPUExecutionProvider"]
    )
    for sizes in ([32] * 8, [1] * 5, [3, 32, 1, 0, 32], [0, 0], [5]):
        x = np.arange(4 * sum(sizes), dtype=np.float32).reshape(-1, 4)
        [y] = session.run(None, {"x": x})
        parts = split({"y": y, "x": x}, sizes)
        start = 0
        for size, part in zip(sizes, parts, strict=True):
            assert list(part) == ["y", "x"]
            np.testing.assert_array_equal(part["y"], y[start : start + size])
            np.testing.assert_array_equal(part["y"], x[start : start + size] * 2 + 1)
            assert part["y"].shape == (size, 4) and np.shares_memory(part["y"], y) == (size > 0)
            start += size
    with pytest.raises(BatchSplitError):
        split({"y": np.zeros((63, 4), np.float32)}, [32, 32])


def test_a_bad_job_among_many_row_jobs_fails_alone_in_a_worker(
    workers: WorkerProcesses, redis_url: str, model_name: str
) -> None:
    unchecked = Producer(redis_url, validate=False, allow_unknown_models=True)  # before any worker starts
    rng = np.random.default_rng(3)
    inputs = [{"pixels": rng.standard_normal((32, 64)).astype(np.float32)} for _ in range(12)]
    inputs[5] = {"pixels": np.zeros((32, 65), np.float32)}  # wrong fixed dim
    submitted = unchecked.submit_many(model_name, inputs)
    workers.serve(MODEL_PATH, model_name, redis_url, 1, "--max-batch", "256", "--rows-independent")
    session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    for i, job in enumerate(submitted):
        if i == 5:
            with pytest.raises(InferenceFailed, match="size 65 on axis 1"):
                job.result(timeout=30)
            continue
        got, alone = job.result(timeout=30), session.run(None, inputs[i])
        assert got["probabilities"].shape == (32, 10)
        np.testing.assert_allclose(got["probabilities"], alone[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["label"], alone[1])
    assert max(int(str(summary(unchecked, job.id)["batch_size"])) for job in submitted[:5]) > 1
