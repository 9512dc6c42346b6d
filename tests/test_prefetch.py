"""A worker holds only what it will run soon (ortq.worker.overlap.Ahead, ``--prefetch``): by
default its feeder takes the next batch while one runs only while runs are short next to a take's
round trip, so long jobs wait on the queue for whichever worker frees up first, not started in a
busy worker; at a stop, a batch taken ahead and not begun goes back to the queue at once. Real
Redis, real worker processes, real ONNX models; the rule itself unit by unit."""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import redis
from onnx import TensorProto, helper, numpy_helper

from ortq import keys
from ortq.producer import Producer
from ortq.rqcompat import layout
from ortq.settings import Settings
from ortq.worker.overlap import AHEAD_FLOOR, AHEAD_RATIO, SLOTS, SLOTS_WITH_BACKLOG, Ahead, Slots, Threads
from ortq.worker.serve import WorkerConfig, build_worker
from tests import onnx_models
from tests.conftest import WorkerProcesses, eventually
from tests.test_worker_inprocess import Serving

pytestmark = pytest.mark.timeout(240)

#: One long job's run, in CPU seconds of the thread that runs it (a loaded machine only lengthens it).
RUN_SECONDS = 2.0


# ------------------------------------------------------------------ the rule


def test_auto_takes_ahead_only_after_a_run_short_next_to_a_round_trip() -> None:
    ahead = Ahead()  # --prefetch left at auto
    assert not ahead.pays() and ahead.limit(backlog=True) == 1  # nothing has run: nothing is known
    ahead.took(0.0005)  # a start's round trip: 0.5 ms; the bound is then the floor
    assert ahead.bound() == AHEAD_FLOOR
    ahead.ran(0.002)  # a tiny model's batch: taken ahead as before (one, two with a backlog)
    assert ahead.pays() and (ahead.limit(False), ahead.limit(True)) == (SLOTS, SLOTS_WITH_BACKLOG) == (2, 3)
    ahead.ran(1.5)  # a long run: its next batch is taken once it ends, backlog or not
    assert not ahead.pays() and ahead.limit(False) == ahead.limit(True) == 1
    ahead.ran(0.002)
    ahead.forget()  # a take found the queue empty: the runs before say nothing of the next jobs
    assert ahead.limit(True) == 1
    # A slow Redis (a far one, a loaded one): the bound follows the measured round trip, smoothed.
    for _ in range(50):
        ahead.took(0.010)
    assert ahead.bound() == pytest.approx(AHEAD_RATIO * 0.010, rel=1e-3)
    ahead.ran(0.15)  # 15 round trips: worth taking ahead for
    assert ahead.limit(False) == 2
    ahead.ran(0.25)  # 25: not
    assert ahead.limit(False) == 1


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_an_explicit_prefetch_is_the_batches_taken_ahead_whatever_the_runs(prefetch: int) -> None:
    ahead = Ahead(prefetch)
    for run in (None, 0.0001, 100.0):
        if run is not None:
            ahead.ran(run)
        assert ahead.limit(backlog=False) == ahead.limit(backlog=True) == 1 + prefetch
        assert ahead.pays() is (prefetch > 0)


def test_a_batch_is_taken_ahead_when_another_is_in_hand_at_the_main_thread() -> None:
    """What a stop hands back: a batch handed over while the main thread had another (waiting or
    running); one handed to an idle main thread is the one it runs next, and runs."""
    threads = Threads(threading.Event())
    assert threads.handed_over() is False  # an idle main thread's next batch
    assert threads.handed_over() is True  # behind it: taken ahead
    threads.done_with()
    threads.done_with()
    assert threads.handed_over() is False


def _high_water(slots: Slots) -> list[int]:
    """Record the most batches in hand at once (running, waiting, being taken)."""
    seen = [0]
    acquire = slots.acquire

    def counting(limit: int, timeout: float) -> bool:
        got = acquire(limit, timeout)
        seen[0] = max(seen[0], slots._taken)
        return got

    slots.acquire = counting  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(("prefetch", "in_hand"), [(None, 2), (0, 1)])
def test_a_backlog_of_tiny_jobs_is_still_taken_ahead_by_default(
    prefetch: int | None, in_hand: int, tiny_path: Path, model_name: str, redis_url: str
) -> None:
    """Default settings, a backlog of tiny jobs: the feeder takes the next batch while one runs (two
    or more batches in hand at once), as before; ``--prefetch 0`` never does. The answers are a
    direct session.run's."""
    settings = Settings.from_url(redis_url, heartbeat_seconds=0.5)
    worker = build_worker(WorkerConfig(tiny_path, model_name, threads=1, prefetch=prefetch), settings)
    seen = _high_water(worker.threads.slots)
    serving = Serving(worker)
    try:
        with Producer(settings=settings) as producer:
            producer.wait_for_workers(model_name, 1, timeout=30)
            rng = np.random.default_rng(5)
            xs = [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(300)]
            handles = producer.submit_many(model_name, [{"x": x} for x in xs])
            responses = producer.results_of(handles, timeout=120)
        session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
        for x, response in zip(xs, responses, strict=True):
            assert response.ok, response.error
            np.testing.assert_array_equal(response.outputs["y"], session.run(None, {"x": x})[0])
    finally:
        assert serving.stop() == 0
    assert (seen[0] >= 2) if in_hand == 2 else (seen[0] == 1), seen[0]
    assert worker.ledger.defects == 0


# ------------------------------------------------------------------ long jobs, real worker processes


def loop_model(path: Path, loops_per_unit: int) -> Path:
    """Inputs ``x`` float32 [1, 256] and ``n`` int64 [1] -> ``y`` float32 [1, 256]: as
    tests/onnx_models.slow_model, with ``n * loops_per_unit`` loops set by the job, so that the
    worker's warm-up (zeros for ``n``) is instant and only the jobs are long."""
    rng = np.random.default_rng(onnx_models.SEED)
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["state_in", "w"], ["product"]),
            helper.make_node("Tanh", ["product"], ["state_out"]),
        ],
        "loop_body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("state_in", TensorProto.FLOAT, [256, 256]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [256, 256]),
        ],
    )
    initializers: dict[str, np.ndarray] = {
        "w": (rng.standard_normal((256, 256)) / 16).astype(np.float32),
        "repeats": np.array([256, 1], dtype=np.int64),
        "unit": np.array([loops_per_unit], dtype=np.int64),
        "scalar": np.array([], dtype=np.int64),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["n", "unit"], ["loops"]),
            helper.make_node("Reshape", ["loops", "scalar"], ["trip_count"]),
            helper.make_node("Tile", ["x", "repeats"], ["state0"]),
            helper.make_node("Loop", ["trip_count", "", "state0"], ["state"], body=body),
            helper.make_node("ReduceMean", ["state"], ["y"], axes=[0], keepdims=1),
        ],
        "loop_by_job",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256]),
            helper.make_tensor_value_info("n", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])],
        initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", onnx_models.OPSET)])
    model.ir_version = onnx_models.IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def long_path(models_dir: Path) -> Path:
    """:func:`loop_model` whose ``n = 1`` run lasts about RUN_SECONDS of one thread's CPU time here."""
    probe = loop_model(models_dir / "loop-probe.onnx", 1)
    session, x = _session(probe), np.ones((1, 256), np.float32)
    took = []
    for _ in range(3):
        began = time.thread_time()
        session.run(None, {"x": x, "n": np.array([200], np.int64)})
        took.append(time.thread_time() - began)
    per_loop = min(took) / 200
    return loop_model(models_dir / "loop-long.onnx", max(1, round(RUN_SECONDS / per_loop)))


def _inputs(i: int) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 256), 0.01 * (i + 1), np.float32), "n": np.array([1], np.int64)}


def _record(connection: redis.Redis, job_id: str) -> dict[str, str]:
    raw: dict[bytes, bytes] = connection.hgetall(layout.job_key(job_id))  # type: ignore[assignment]
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}


def _moment(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _worker_names(connection: redis.Redis, model: str) -> list[str]:
    members: set[bytes] = connection.smembers(keys.WORKERS_SET)  # type: ignore[assignment]
    return sorted(n.decode() for n in members if n.decode().startswith(model + "."))


@pytest.fixture
def producer_of(redis_url: str) -> Iterator[Producer]:
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        yield producer


def test_two_workers_share_four_long_jobs_none_waits_started_in_a_busy_one(
    long_path: Path,
    model_name: str,
    redis_url: str,
    connection: redis.Redis,
    workers: WorkerProcesses,
    producer_of: Producer,
) -> None:
    """Two idle workers (default settings); one job, then three more while it runs. Before, the busy
    worker's feeder waited on the queue beside its run and could take the second (and, the queue
    having a backlog, the third) ahead: started in RQ's records, held for a whole run while the
    other worker sat idle. Now the idle worker takes the second, and the last two wait on the queue
    for whichever worker frees up first: each worker runs two, one at a time."""
    workers.serve(long_path, model_name, redis_url, 2)
    producer = producer_of
    first = producer.submit(model_name, _inputs(0))
    eventually(lambda: first.status() == "started", 60)
    rest = producer.submit_many(model_name, [_inputs(i) for i in (1, 2, 3)])
    handles = [first, *rest]
    queue = layout.QueueKeys.of(keys.queue_name(model_name))
    # While they run, never more started than there are workers (none taken ahead of a run).
    most_started = 0
    while not all(h.status() == "finished" for h in handles):
        most_started = max(most_started, int(connection.zcard(queue.started)))
        assert all(h.status() != "failed" for h in handles), workers.logs()
        time.sleep(0.05)
    assert most_started <= 2, most_started
    session = _session(long_path)
    for i, handle in enumerate(handles):
        np.testing.assert_array_equal(handle.result(timeout=10)["y"], session.run(None, _inputs(i))[0])

    records = [_record(connection, h.id) for h in handles]
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        by_worker.setdefault(record["worker_name"], []).append(
            (_moment(record["started_at"]), _moment(record["ended_at"]))
        )
    assert sorted(by_worker) == _worker_names(connection, model_name), by_worker
    # Each worker held one job at a time: a job started once the run before it had ended (its
    # answer may land a moment after the next take: half a run is far more than that, far less
    # than a job taken ahead, which starts as the run before it begins).
    for name, spans in by_worker.items():
        spans.sort()
        for (began, ended), (next_began, _) in itertools.pairwise(spans):
            assert next_began >= ended - (ended - began) / 2, (name, spans)
    # The even split: two each, and each worker's first job began before the other's last one.
    assert sorted(len(spans) for spans in by_worker.values()) == [2, 2], by_worker
    first_starts = [spans[0][0] for spans in by_worker.values()]
    last_starts = [spans[-1][0] for spans in by_worker.values()]
    assert max(first_starts) < min(last_starts), by_worker


def test_sigterm_hands_a_job_taken_ahead_back_at_once_and_finishes_the_running_one(
    long_path: Path,
    model_name: str,
    redis_url: str,
    connection: redis.Redis,
    workers: WorkerProcesses,
    producer_of: Producer,
) -> None:
    """``--prefetch 1``: a worker running one long job holds the next, started (RQ's records say so).
    SIGTERM puts that one back on the queue at once, while the first still runs; the first is
    answered, the worker exits 0, and a second worker runs the one handed back."""
    workers.serve(long_path, model_name, redis_url, 1, "--prefetch", "1")
    process, _ = workers.processes[0]
    [first_name] = _worker_names(connection, model_name)
    producer = producer_of
    running, ahead = producer.submit_many(model_name, [_inputs(0), _inputs(1)])
    eventually(lambda: running.status() == "started" and ahead.status() == "started", 60)
    assert _record(connection, ahead.id)["worker_name"] == first_name  # taken ahead: shown as started
    queue = keys.queue_key(model_name)

    process.send_signal(signal.SIGTERM)
    seen: dict[str, object] = {}

    def handed_back() -> bool:
        queued = ahead.id.encode() in connection.lrange(queue, 0, -1)
        if queued:  # what else was true at that moment
            seen.update(running=running.status(), alive=process.poll() is None, status=ahead.status())
        return queued

    eventually(handed_back, 60)
    assert seen == {"running": "started", "alive": True, "status": "queued"}, (seen, workers.logs())
    session = _session(long_path)
    np.testing.assert_array_equal(running.result(timeout=120)["y"], session.run(None, _inputs(0))[0])
    assert process.wait(60) == 0, workers.logs()
    assert "1 job(s) taken ahead and not begun go back to the queue" in workers.logs()
    assert _record(connection, running.id)["worker_name"] == first_name

    workers.start(long_path, model_name, redis_url)  # another worker runs the one handed back
    np.testing.assert_array_equal(ahead.result(timeout=120)["y"], session.run(None, _inputs(1))[0])
    assert _record(connection, ahead.id)["worker_name"] not in ("", first_name)
    assert connection.llen(queue) == 0
