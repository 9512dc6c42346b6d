"""Chaos: 1,000 jobs through three workers while workers are SIGKILLed at random and Redis is
restarted once. At the end every job is finished with the outputs a direct ``session.run`` gives,
or failed with a reason; none is lost and none is answered twice.

Bounded: ~1,000 runs of a ~5 ms model on loopback, heartbeats every second (a dead worker's job is
taken back after 3 s), one durable redis-server of the test's own.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models
from tests.conftest import WorkerProcesses, answers_of_many

JOBS = 1000
WAVES = 20
WORKERS = 3


@pytest.mark.timeout(420)
def test_chaos_kills_and_a_redis_restart_lose_and_duplicate_nothing(
    workers: WorkerProcesses, model_name: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = onnx_models.slow_model(models_dir / "chaos.onnx", loops=12)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "1")
    rng = np.random.default_rng(11)
    chooser = random.Random(11)
    inputs = [rng.uniform(-1, 1, (1, 256)).astype(np.float32) for _ in range(JOBS)]
    kills = 0
    with LocalRedis(durable=True) as server, Producer(settings=Settings.from_url(server.url)) as producer:
        workers.serve(path, model_name, server.url, WORKERS)
        live = [process for process, _ in workers.processes]
        jobs = []
        per_wave = JOBS // WAVES
        for wave in range(WAVES):
            jobs += producer.submit_many(
                model_name, [{"x": x} for x in inputs[wave * per_wave : (wave + 1) * per_wave]]
            )
            time.sleep(chooser.uniform(0.05, 0.4))
            if wave == WAVES // 2:
                server.restart(down_for=1.0)
            elif wave % 3 == 1:
                victim = chooser.choice(live)
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
                kills += 1
                live.remove(victim)
                live.append(workers.start(path, model_name, server.url))
        responses = producer.results_of(jobs, timeout=300)

        connection = redis.Redis.from_url(server.url)
        answers = answers_of_many(connection, model_name, [job.id for job in jobs])
        finished = failed = taken_back = 0
        for job, x, response in zip(jobs, inputs, responses, strict=True):
            status = job.status()
            if response.error is None:
                finished += 1
                assert status == "finished", job.id
                expected = session.run(None, {"x": x})[0]
                np.testing.assert_allclose(response.outputs["y"], expected, rtol=1e-5, atol=1e-6)
                # Answered once: one result in RQ's stream, one entry in the reply stream.
                assert connection.xlen(f"rq:results:{job.id}") == 1, job.id
            else:
                failed += 1
                assert status == "failed", job.id
                assert response.error.type and response.error.message
            assert len(answers[job.id]) == 1, job.id
            taken_back += connection.hget(keys.job_key(job.id), "ortq_recoveries") is not None
        assert finished + failed == JOBS
        assert connection.llen(keys.queue_key(model_name)) == 0
        assert connection.zcard(f"rq:wip:{keys.queue_name(model_name)}") == 0
        connection.close()
    print(f"chaos: {finished} finished, {failed} failed, {taken_back} taken back from dead workers, "
          f"{kills} workers SIGKILLed, 1 Redis restart")  # fmt: skip
    assert kills >= 5
