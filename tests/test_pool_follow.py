"""Many models on one adapter: elastic groups (max_workers) that follow their queues within a memory
budget (ortq/pool/follow.py). The follower's rule on recorded states, the config and --check, and a
real CPU pool of four models under a budget of two workers (real redis-server, real workers, real
jobs compared with session.run)."""

from __future__ import annotations

import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortq import info, keys
from ortq.demo import HOLDOUT_PATH, MODEL_PATH
from ortq.errors import ConfigurationError
from ortq.localredis import LocalRedis
from ortq.pool import status
from ortq.pool.config import PoolConfig
from ortq.pool.follow import Elastic, Follower, QueueReader, QueueState, SlotState, SlotView
from ortq.producer import Producer
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests import onnx_models
from tests.cli_support import invoke
from tests.conftest import Pool, eventually

MiB = 1024**2


# ------------------------------------------------------------------------------------ the rule


def spec(model: str, group: int, most: int = 1, least: int = 0, idle: float = 60.0, budget: int = 2) -> Elastic:
    """A group on one CPU whose budget holds ``budget`` workers of 100 MiB, residency 10 s."""
    return Elastic(model, group, "cpu", budget * 100 * MiB, 100 * MiB, least, most, idle, 10.0)


class Slots:
    """Slots as the supervisor would show them, changed as the follower's actions say (a stop
    takes effect when :meth:`exit` is called, as a worker's exit would)."""

    def __init__(self, *groups: Elastic) -> None:
        self.views: list[SlotView] = []
        #: Workers still loading their model (not yet registered with RQ).
        self.loading: set[str] = set()
        for group in groups:
            for _ in range(group.max_workers):
                self.views.append(SlotView(len(self.views), group, SlotState.OFF))

    def apply(self, now: float, follower: Follower, queues: dict[str, QueueState]) -> list[str]:
        """One tick; every running worker but those in :attr:`loading` shows as registered with RQ."""
        for model, read in queues.items():
            ready = {v.worker_name for v in self.views if v.state is SlotState.RUNNING and v.spec.model == model}
            queues[model] = replace(read, ready=frozenset(ready - self.loading))
        done = []
        for action in follower.decide(now, self.views, queues):
            view = self.views[action.number]
            if action.start:
                name = f"{view.spec.model}.{action.number}"
                self.views[action.number] = SlotView(view.number, view.spec, SlotState.RUNNING, now, name)
                done.append(f"start {view.spec.model}")
            else:
                self.views[action.number] = SlotView(view.number, view.spec, SlotState.STOPPING, view.started_at,
                                                     view.worker_name)  # fmt: skip
                done.append(f"stop {view.spec.model}: {action.why}")
        return done

    def exit(self) -> None:
        """Every stopping worker exits."""
        self.views = [SlotView(v.number, v.spec, SlotState.OFF) if v.state is SlotState.STOPPING else v
                      for v in self.views]  # fmt: skip

    def running(self) -> list[str]:
        return sorted(v.spec.model for v in self.views if v.state is SlotState.RUNNING)


def queued(**depths: int) -> dict[str, QueueState]:
    return {model: QueueState(n) for model, n in depths.items()}


def test_models_take_turns_within_the_budget_and_an_idle_one_makes_room() -> None:
    follower, slots = Follower(), Slots(spec("a", 0), spec("b", 1), spec("c", 2), spec("d", 3))
    assert slots.apply(0, follower, queued(a=0, b=0, c=0, d=0)) == []  # min_workers 0: nothing runs
    assert slots.apply(1, follower, queued(a=5, b=5, c=0, d=0)) == ["start a", "start b"]
    # c waits; a and b are busy and have run only 1 s: nobody is taken for it yet
    assert slots.apply(2, follower, queued(a=3, b=3, c=4, d=0)) == []
    # a's queue is empty and its worker idle; past the 10 s residency it makes room for c
    assert slots.apply(12, follower, queued(a=0, b=3, c=4, d=0)) == [
        "stop a: making room for c (waiting jobs): a idle longest"
    ]
    # a's worker has not exited: its memory is still held, and no second worker is stopped for c
    assert slots.apply(13, follower, queued(a=0, b=3, c=4, d=0)) == []
    slots.exit()
    assert slots.apply(14, follower, queued(a=0, b=3, c=4, d=0)) == ["start c"]
    assert slots.running() == ["b", "c"]


def test_a_model_with_no_worker_is_served_even_when_every_other_is_busy() -> None:
    follower = Follower()
    slots = Slots(spec("a", 0, most=2, budget=3), spec("b", 1, budget=3), spec("c", 2, budget=3))
    assert slots.apply(0, follower, queued(a=9, b=9, c=0)) == ["start a", "start b"]
    assert slots.apply(1, follower, queued(a=9, b=9, c=0)) == ["start a"]  # a grows while the budget allows
    assert slots.running() == ["a", "a", "b"]
    # c waits and everyone is busy: inside the residency nothing is stopped ...
    assert slots.apply(5, follower, queued(a=9, b=9, c=1)) == []
    # ... past it, the model with the most workers gives one up (a model with a worker waits its turn)
    assert slots.apply(11, follower, queued(a=9, b=9, c=1)) == [
        "stop a: making room for c (waiting jobs): a served 10 s, past min_residency_seconds"
    ]
    slots.exit()
    # c, with no worker, goes before a (waiting longer, but with a worker) to the memory made free
    assert slots.apply(12, follower, queued(a=9, b=9, c=1)) == ["start c"]
    # a still waits, but has a worker: it takes no busy worker from anyone
    assert slots.apply(30, follower, queued(a=9, b=9, c=1)) == []
    assert slots.running() == ["a", "b", "c"]


def test_a_worker_still_loading_is_not_stopped_and_the_room_made_is_kept_for_its_model() -> None:
    follower, slots = Follower(), Slots(spec("a", 0, budget=1), spec("b", 1, budget=1), spec("c", 2, budget=1))
    assert slots.apply(0, follower, queued(a=1, b=0, c=0)) == ["start a"]
    slots.loading.add("a.0")
    # b and c wait; a's worker is past the residency by its start, but still loads its model
    assert slots.apply(20, follower, queued(a=1, b=1, c=0)) == []
    slots.loading.clear()
    assert slots.apply(21, follower, queued(a=0, b=1, c=1)) == []  # serving since 21
    assert slots.apply(31, follower, queued(a=0, b=1, c=1)) == [
        "stop a: making room for b (waiting jobs): a idle longest"
    ]
    slots.exit()
    # The room was made for b: c does not take it, even were it first in line (say it waited
    # longer, as a model whose own worker went away meanwhile would).
    follower.models["c"].waiting_since = 0.0
    assert slots.apply(32, follower, queued(a=0, b=1, c=1)) == ["start b"]
    assert slots.running() == ["b"]


def test_idle_workers_stop_but_never_below_min_workers() -> None:
    follower, slots = Follower(), Slots(spec("a", 0, most=2, least=1, idle=30, budget=3))
    assert slots.apply(0, follower, queued(a=0)) == ["start a"]  # min_workers
    assert slots.apply(1, follower, queued(a=4)) == ["start a"]
    assert slots.apply(20, follower, queued(a=0)) == []  # idle 19 s of 30
    assert slots.apply(52, follower, queued(a=0)) == ["stop a: a had no job for 51 s (idle_seconds)"]
    slots.exit()
    assert slots.apply(200, follower, queued(a=0)) == []
    assert slots.running() == ["a"]


def test_a_busy_worker_counts_as_activity_and_an_unread_queue_changes_nothing() -> None:
    follower, slots = Follower(), Slots(spec("a", 0, idle=30), spec("b", 1, budget=2))
    slots.apply(0, follower, queued(a=2))
    busy = {"a": QueueState(0, frozenset({"a.0"}))}
    assert slots.apply(40, follower, busy) == []  # its queue is empty but its worker runs a job
    assert slots.apply(69, follower, queued(a=0)) == []
    assert slots.apply(71, follower, {"a": QueueState(None)}) == []  # Redis unreadable: decide nothing
    assert slots.apply(72, follower, queued(a=0)) == ["stop a: a had no job for 32 s (idle_seconds)"]


def test_started_jobs_with_no_worker_make_a_model_wait() -> None:
    """A killed worker's orphans are taken back only by a worker of their model: they count as waiting."""
    follower, slots = Follower(), Slots(spec("a", 0), spec("b", 1))
    assert slots.apply(0, follower, {"a": QueueState(0, started=True), "b": QueueState(0)}) == ["start a"]
    # once a's worker runs, its started jobs are its own to take back: no second start, no idle stop
    assert slots.apply(5, follower, {"a": QueueState(0, started=True), "b": QueueState(0)}) == []


# ------------------------------------------------------------------------------------ config and --check


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "digits.onnx"
    path.write_bytes(MODEL_PATH.read_bytes())
    return path


def model_table(name: str, path: str | Path, group: str) -> str:
    """A [[model]] of 100 MiB a worker, one thread, and its [[model.workers]] table's ``group`` lines."""
    return (f'\n[[model]]\nname = "{name}"\npath = "{path}"\nthreads = 1\nmemory_per_worker_mib = 100\n'
            f"[[model.workers]]\n{group}")  # fmt: skip


def pool_file(tmp_path: Path, pool: str, groups: list[str]) -> Path:
    text = "[pool]\nmeasure_memory = false\n" + pool
    for n, group in enumerate(groups):
        text += model_table(f"m{n}", "digits.onnx", group)
    path = tmp_path / "pool.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("pool", "group", "message"),
    [
        ("", "count = 1\nmax_workers = 2\n", "count is a fixed number of workers: give it or max_workers"),
        ("", "max_workers = 1\nmin_workers = 2\n", "min_workers (2) is more than max_workers (1)"),
        ("", "min_workers = 1\n", "min_workers and idle_seconds need max_workers"),
        ("", "max_workers = 1\nidle_seconds = 0\n", "idle_seconds must be a number > 0"),
        ("", "max_workers = 0\n", "max_workers must be an integer >= 1"),
        ("memory_budget_mib = 100\nmemory_budget_fraction = 0.5\n", "max_workers = 1\n", "both given"),
        ("memory_budget_fraction = 1.5\n", "max_workers = 1\n", "memory_budget_fraction must be at most 1"),
        ("", "max_worker = 1\n", "unknown key 'max_worker'; did you mean 'max_workers'?"),
    ],
)
def test_bad_elastic_groups_are_refused(tmp_path: Path, model_file: Path, pool: str, group: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        PoolConfig.from_file(pool_file(tmp_path, pool, [group]))
    assert message in str(caught.value), caught.value


def test_check_prints_the_plan_and_refuses_a_budget_too_small(tmp_path: Path, model_file: Path) -> None:
    groups = ["max_workers = 2\nidle_seconds = 10\n", "max_workers = 1\nmin_workers = 1\n"]
    done = invoke("pool", "--config", str(pool_file(tmp_path, "memory_budget_mib = 200\n", groups)), "--check")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^m0 .* 0\.\.2, idle 10 s\s+100 MiB \(configured\)$", done.stdout, re.M), done.stdout
    assert re.search(r"^m1 .* 1\.\.1, idle 300 s\s+100 MiB \(configured\)$", done.stdout, re.M), done.stdout
    assert re.search(r"^cpu \(.+\)\s+3\s+300 MiB\s+200 MiB\s", done.stdout, re.M), done.stdout
    assert "at most 3 workers" in done.stdout
    # 150 MiB holds m1's one worker always running, and one of m0's at a time: accepted
    done = invoke("pool", "--config", str(pool_file(tmp_path, "memory_budget_mib = 150\n", groups)), "--check")
    assert done.returncode == 0, done.stderr
    # 90 MiB holds no worker at all: refused, --force or not
    for force in ([], ["--force"]):
        path = pool_file(tmp_path, "memory_budget_mib = 90\n", groups)
        done = invoke("pool", "--config", str(path), "--check", *force)
        assert done.returncode == 2, done.stdout
        assert "the workers always running (count, min_workers) need about 100 MiB, more than its budget of 90 MiB" in (
            done.stderr
        )
        assert "one m0 worker needs about 100 MiB, more than its budget of 90 MiB: it could never start" in done.stderr


def test_a_fraction_of_the_hosts_memory_is_the_cpus_budget(tmp_path: Path, model_file: Path) -> None:
    path = pool_file(tmp_path, "memory_budget_fraction = 0.5\n", ["max_workers = 1\n"])
    done = invoke("pool", "--config", str(path), "--check")
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("cpu ("))
    total, budget = re.findall(r"([\d.]+) GiB", row)[::-1][0], re.findall(r"([\d.]+) GiB", row)[0]
    assert abs(float(budget) - float(total) / 2) < 0.11, row


# ------------------------------------------------------------------------------------ a real pool


def live_counts(text: str) -> tuple[int, dict[str, int]]:
    """From a pool's log: the most workers alive at once (started, not yet exited) and each model's starts."""
    alive, most, starts = 0, 0, {}
    for line in text.splitlines():
        if m := re.search(r"ortq\.pool INFO worker (m\d)\.\d started: pid", line):
            alive += 1
            starts[m.group(1)] = starts.get(m.group(1), 0) + 1
            most = max(most, alive)
        elif re.search(r"ortq\.pool \w+ worker m\d\.\d \(pid \d+\) .* after [\d.]+ s: ", line):
            alive -= 1
    return most, starts


def test_four_models_under_a_budget_of_two_workers_are_all_served(
    tmp_path: Path, model_file: Path, redis_url: str, model_name: str, pools: list[Pool]
) -> None:
    # The models have never been served: their jobs are enqueued for workers that start later.
    producer = Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True)
    names = [f"{model_name}m{n}" for n in range(4)]
    text = "[pool]\nmeasure_memory = false\nmemory_budget_mib = 200\nmin_residency_seconds = 1\ngrace_seconds = 60\n"
    for name in names:
        text += model_table(name, "digits.onnx", "max_workers = 1\nidle_seconds = 600\n")
    path = tmp_path / "pool.toml"
    path.write_text(text)
    pool = Pool(path, redis_url)
    pools.append(pool)

    session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    pixels = np.load(HOLDOUT_PATH)["pixels"][:40]

    def serve(name: str, rows: np.ndarray) -> None:
        # The wait is the producer's own for a worker to start and answer; 300 s bounds only a hang.
        jobs = producer.submit_many(name, [{"pixels": row[None]} for row in rows])
        for got, row in zip(producer.results(jobs, timeout=300), rows, strict=True):
            probabilities, label = session.run(["probabilities", "label"], {"pixels": row[None]})
            np.testing.assert_allclose(got["probabilities"], probabilities, rtol=1e-6)
            np.testing.assert_array_equal(got["label"], label)

    # In turn: each model's jobs arrive while the two workers serve others (or nobody yet).
    for n, name in enumerate(names):
        serve(name, pixels[4 * n : 4 * n + 4])
    # At once: every model has jobs waiting together.
    with ThreadPoolExecutor(len(names)) as rush:  # a failed check in any thread is raised here
        list(rush.map(serve, names, [pixels[20 + 5 * n : 25 + 5 * n] for n in range(len(names))]))

    # The pool's record, as ortq info and the exporter read it.
    [record] = info.collect(producer.connection)["pools"]
    [adapter] = record["adapters"]
    assert adapter["budget_bytes"] == 200 * MiB and 0 < adapter["used_bytes"] <= 200 * MiB, record
    assert record["evictions"] >= 1 and record["cold_starts"] >= 4, record
    assert set(record["loads"]) <= set(names) and all(v["count"] >= 1 for v in record["loads"].values()), record
    shown = invoke("info", "--redis-url", redis_url)
    assert re.search(r"^POOL\s+ADAPTER\s+BUDGET\s+USED\s+RESIDENT\s+CHANGING\s+EVICTIONS\s+COLD STARTS$",
                     shown.stdout, re.M), shown.stdout  # fmt: skip
    series = {m.name: m.samples for m in status.pool_metrics([record])}
    assert [s.value for s in series["ortq_pool_budget_bytes"]] == [200.0 * MiB]
    assert series["ortq_pool_evictions"][0].value == record["evictions"]

    pool.process.send_signal(signal.SIGTERM)
    assert pool.wait() == 0, pool.text()
    assert info.collect(producer.connection)["pools"] == []  # withdrawn as it stopped
    log = pool.text().replace(model_name, "")
    assert "making room for m" in log, log  # evictions happened
    most, starts = live_counts(log)
    assert most <= 2, f"more than the budget's two workers alive at once:\n{log}"
    assert set(starts) == {"m0", "m1", "m2", "m3"}, starts
    # No start-stop loop: each model was started for its turn and for the rush, a few times at most.
    assert max(starts.values()) <= 4, starts
    for name in names:  # nothing left behind
        assert producer.connection.llen(keys.queue_key(name)) == 0
    producer.close()


def test_a_worker_killed_while_it_makes_room_loses_no_job(
    tmp_path: Path, model_file: Path, models_dir: Path, redis_url: str, model_name: str, pools: list[Pool]
) -> None:
    """One worker's budget, a slow model and the digits model: the slow model's busy worker is
    stopped for the digits job (it has no worker), and SIGKILLed while it finishes its run. The
    digits job is answered; the slow job, orphaned, is taken back by the slow model's next worker
    once the digits worker has gone idle, and answered once, as session.run answers it."""
    slow_path = onnx_models.timed_slow_model(models_dir / "follow-slow-3s.onnx", 3.0)
    slow, digits = f"{model_name}slow", f"{model_name}digits"
    path = tmp_path / "pool.toml"
    pool_text = "[pool]\nmeasure_memory = false\nmemory_budget_mib = 100\nmin_residency_seconds = 0.5\n"
    pool_text += '[pool.env]\nORTQ_HEARTBEAT_SECONDS = "1"\n'
    pool_text += model_table(slow, slow_path, "max_workers = 1\n")
    path.write_text(pool_text + model_table(digits, "digits.onnx", "max_workers = 1\nidle_seconds = 2\n"))
    pool = Pool(path, redis_url)
    pools.append(pool)
    producer = Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True)
    x = np.full((1, 256), 0.5, np.float32)
    slow_job = producer.submit(slow, {"x": x})
    eventually(lambda: slow_job.status() == "started", timeout=120, what="the slow job to start")
    row = np.load(HOLDOUT_PATH)["pixels"][:1]
    digits_job = producer.submit(digits, {"pixels": row})
    stopping = re.compile(rf"stopping worker {slow}\.0 \(pid (\d+)\): making room for {digits}")
    eventually(lambda: stopping.search(pool.text()), timeout=120, what="the slow worker to be stopped")
    match = stopping.search(pool.text())
    assert match is not None
    os.kill(int(match.group(1)), signal.SIGKILL)

    digits_session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    got = digits_job.result(timeout=300)
    np.testing.assert_allclose(got["probabilities"], digits_session.run(["probabilities"], {"pixels": row})[0],
                               rtol=1e-6)  # fmt: skip
    slow_session = ort.InferenceSession(str(slow_path), providers=["CPUExecutionProvider"])
    expected = slow_session.run(None, {"x": x})
    got = slow_job.result(timeout=300)
    for name, value in zip([o.name for o in slow_session.get_outputs()], expected, strict=True):
        np.testing.assert_allclose(got[name], value, rtol=1e-6)
    pool.process.send_signal(signal.SIGTERM)
    assert pool.wait() == 0, pool.text()
    log = pool.text()
    assert re.search(rf"worker {slow}\.0 \(pid {match.group(1)}\) killed by SIGKILL after [\d.]+ s: stopped", log), log
    most, _ = live_counts(log.replace(slow, "m0").replace(digits, "m1"))
    assert most <= 1, log
    producer.close()


def test_readers_skip_pool_records_that_are_not_a_pools(redis_url: str, model_name: str) -> None:
    """Anyone with the worker rule may write ortq:pool:*: junk, a huge value, a wrong shape, a
    member naming no key are all left out, and a reader reads at most MOST_RECORD_BYTES of each."""
    connection = Settings.from_url(redis_url).connect()
    good = status.PoolStatus(f"{model_name}-good").record({"cpu": 100 * MiB}, [])
    junk = {
        f"{model_name}-json": b"{not json",
        f"{model_name}-huge": b"x" * (status.MOST_RECORD_BYTES + 10),
        f"{model_name}-shape": json.dumps({"pool": 1, "adapters": "no"}).encode(),
        f"{model_name}-good": json.dumps(good).encode(),
    }
    try:
        for name, value in junk.items():
            connection.set(status.pool_key(name), value)
        connection.sadd(status.POOLS_SET, *junk, f"{model_name}-gone")
        pools = [p for p in status.read_pools(connection)[0] if p["pool"].startswith(model_name)]
        assert [p["pool"] for p in pools] == [f"{model_name}-good"]
        assert "none" not in status.format_pools(pools) and "100 MiB" in status.format_pools(pools)
    finally:
        connection.delete(*(status.pool_key(n) for n in junk))
        connection.srem(status.POOLS_SET, *junk, f"{model_name}-gone")
        connection.close()


def test_the_reader_counts_a_job_left_between_take_and_start(redis_url: str, model_name: str) -> None:
    """A job a killed worker's BLMOVE moved to the intermediate list, never started, waits for a
    worker of its model (rescue.lua puts it back): the reader counts it as queued, and a worker's
    started job makes ``started`` true."""
    connection = Settings.from_url(redis_url).connect()
    queue = layout.QueueKeys.of(keys.queue_name(model_name))
    reader = QueueReader(lambda url: Settings.from_url(url).connect(), lambda model: redis_url)
    try:
        assert reader.read({model_name: []}) == {model_name: QueueState(0)}
        connection.rpush(queue.intermediate, "a-job-id")
        connection.zadd(queue.started, {"another-job:execution": 1})
        assert reader.read({model_name: []}) == {model_name: QueueState(1, started=True)}
    finally:
        connection.delete(queue.intermediate, queue.started)
        connection.close()


def test_pool_names_stay_bounded_for_readers_and_writers() -> None:
    """ortq:pools is a set the worker rule may grow: 20,000 junk names cost a reader one bounded
    read (MOST_POOLS of them, each record missing: nothing shown), and every publish forgets a few
    names whose record is gone, so a killed pool's name does not stay for ever. A Redis of its own:
    the junk would hide other tests' pools from their readers."""
    with LocalRedis() as server:
        connection = Settings.from_url(server.url).connect()
        junk = [f"junk-{n}" for n in range(20_000)]
        connection.sadd(status.POOLS_SET, *junk)
        assert status.read_pools(connection) == ([], 20_000 - status.MOST_POOLS)
        # and readers say so: ortq info's note, the exporter's warning (info.collect's count)
        shown = info.collect(connection)
        assert shown["skipped_pools"] == 20_000 - status.MOST_POOLS
        assert f"note: {20_000 - status.MOST_POOLS} name(s) in ortq:pools were not looked at" in info.format_info(shown)
        publisher = status.Publisher(connection, "live.1")
        record = status.PoolStatus("live.1").record({"cpu": 100 * MiB}, [])
        for _ in range(50):
            publisher.publish(record)
        left = connection.scard(status.POOLS_SET)
        assert left < 20_001 and connection.sismember(status.POOLS_SET, "live.1"), left
        assert 20_001 - left >= 50, left  # at least one stale name forgotten a write (4 are looked at)
        connection.delete(status.POOLS_SET)
        connection.sadd(status.POOLS_SET, "live.1", "killed.2")  # killed.2's record expired
        publisher.publish(record)
        assert connection.smembers(status.POOLS_SET) == {b"live.1"}
        assert [p["pool"] for p in status.read_pools(connection)[0]] == ["live.1"]
        publisher.withdraw()
        assert status.read_pools(connection) == ([], 0) and not connection.exists(status.POOLS_SET)
        connection.set(status.POOLS_SET, "not a set")  # the worker rule's ~ortq:* may write anything there
        assert status.read_pools(connection) == ([], 0)
        connection.close()
