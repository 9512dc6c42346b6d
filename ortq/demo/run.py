"""``ortq demo``: the bundled digits model served through a real queue, checked against ONNX Runtime.

Starts a local Redis (unless given one) and worker processes, sends every held-out digit as
its own job, then prints the accuracy and whether the queue's outputs equal a direct
in-process ``session.run`` on the same inputs.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np

from ortq.demo import HOLDOUT_PATH, MODEL_PATH
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings

MODEL_NAME = "digits"


@contextlib.contextmanager
def _redis(redis_url: str | None) -> Iterator[str]:
    if redis_url:
        yield redis_url
        return
    with LocalRedis() as server:
        print(f"started a local redis-server at {server.url}")
        yield server.url


@contextlib.contextmanager
def _workers(redis_url: str, count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    command = [sys.executable, "-m", "ortq", "worker", "--model", str(MODEL_PATH),
               "--name", MODEL_NAME, "--provider", "cpu", "--threads", "1", "--redis-url", redis_url]  # fmt: skip
    processes = [subprocess.Popen(command) for _ in range(count)]
    try:
        yield processes
    finally:
        for process in processes:
            process.terminate()  # SIGTERM: the worker finishes its job and unregisters
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


def run_demo(redis_url: str | None, workers: int = 1) -> bool:
    import onnxruntime

    holdout = np.load(HOLDOUT_PATH)
    pixels, labels = holdout["pixels"], holdout["labels"]
    with (
        _redis(redis_url) as url,
        _workers(url, workers),
        Producer(settings=Settings.from_env(redis_url=url)) as producer,
    ):
        found = producer.wait_for_workers(MODEL_NAME, workers, timeout=120)
        print(f"{len(found)} worker(s) ready on {', '.join(w['provider'] for w in found)}")
        started = time.perf_counter()
        jobs = producer.submit_many(MODEL_NAME, [{"pixels": pixels[i : i + 1]} for i in range(len(pixels))])
        results = producer.results(jobs, timeout=60)
        elapsed = time.perf_counter() - started
    probabilities = np.concatenate([r["probabilities"] for r in results])
    predicted = np.concatenate([r["label"] for r in results])

    session = onnxruntime.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    direct = np.concatenate(
        [session.run(["probabilities"], {"pixels": pixels[i : i + 1]})[0] for i in range(len(pixels))]
    )
    max_diff = float(np.max(np.abs(direct - probabilities)))
    accuracy = float(np.mean(predicted == labels))
    same = bool(np.allclose(direct, probabilities, rtol=1e-5, atol=1e-6))
    print(f"{len(jobs)} held-out digits through the queue in {elapsed:.2f} s ({len(jobs) / elapsed:.0f} jobs/s)")
    print(f"accuracy: {accuracy:.3f}")
    print(f"outputs equal direct onnxruntime session.run: {same} (max abs difference {max_diff:.2e})")
    return same and accuracy >= 0.9
