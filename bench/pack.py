"""A producer's CPU a job with ortq's command packer (ortq.redispack) and with redis-py's own, side by side.

    python -m bench.pack [--jobs 256] [--rounds 40]

Two measures, each alternated between the two packers in one run: packing one enqueue's commands
(the request frame's SET, the job hash's HSET, its EXPIRE, the queue's RPUSH), and ``submit_many``
of ``--jobs`` small jobs through a real Producer and a real AsyncProducer on a local Redis (no
worker: the jobs queue up), as this process's CPU time a job.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Callable

import numpy as np
import redis

from ortq.localredis import LocalRedis
from ortq.producer import AsyncProducer, Producer
from ortq.settings import Settings

MODEL = "bench-pack"


def enqueue_commands() -> list[tuple[object, ...]]:
    job_id = str(uuid.uuid4())
    fields: list[object] = []
    for name in ("status", "origin", "data", "description", "created_at", "enqueued_at", "timeout",
                 "result_ttl", "failure_ttl", "ttl", "ortq_proof", "ortq_version", "retries_left", "meta"):  # fmt: skip
        fields += [name, "v" * 20]
    return [
        ("SET", f"ortq:req:{MODEL}:{job_id}", b"x" * 150, "EX", 86400),
        ("HSET", f"rq:job:{job_id}", *fields),
        ("EXPIRE", f"rq:job:{job_id}", 172800),
        ("RPUSH", f"rq:queue:ortq:{MODEL}", job_id),
    ]


def cpu_us(call: Callable[[], object], count: int) -> float:
    started = time.process_time()
    for _ in range(count):
        call()
    return (time.process_time() - started) / count * 1e6


def producer(url: str, ours: bool) -> Producer:
    made = Producer(settings=Settings.from_url(url), allow_unknown_models=True)
    if not ours:  # redis-py's own packer: connections made from now on go without ortq's
        made.connection.connection_pool.connection_kwargs.pop("command_packer", None)
        made.connection.connection_pool.reset()
    return made


async def async_cpu_us(url: str, jobs: list[dict[str, np.ndarray]], rounds: int) -> dict[str, float]:
    """AsyncProducer.submit_many's CPU a job (median of ``rounds``) with ortq's packing connection
    class and with redis-py's own (the class it subclasses, set before the pool made any), alternated."""
    found: dict[str, list[float]] = {"redis-py": [], "ortq": []}
    producers = {name: AsyncProducer(settings=Settings.from_url(url), allow_unknown_models=True) for name in found}
    for pool in (
        producers["redis-py"].connection.connection_pool,
        producers["redis-py"]._default.reader.client.connection_pool,
    ):
        pool.connection_class = pool.connection_class.__mro__[1]
    for _ in range(rounds):
        for name, producer in producers.items():
            started = time.process_time()
            await producer.submit_many(MODEL, jobs)
            found[name].append((time.process_time() - started) / len(jobs) * 1e6)
        await producers["ortq"].connection.delete(f"rq:queue:ortq:{MODEL}")
    for producer in producers.values():
        await producer.aclose()
    return {name: statistics.median(values) for name, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    with LocalRedis() as server:
        client = redis.Redis.from_url(server.url)
        plain = client.connection_pool.make_connection()  # redis-py's packer
        ours = Settings.from_url(server.url).connect(check=False).connection_pool.make_connection()
        commands = enqueue_commands()
        packing: dict[str, list[float]] = {"redis-py": [], "ortq": []}
        for _ in range(5):
            packing["redis-py"].append(cpu_us(lambda: plain.pack_commands(commands), 2000))
            packing["ortq"].append(cpu_us(lambda: ours.pack_commands(commands), 2000))
        producers = {"redis-py": producer(server.url, False), "ortq": producer(server.url, True)}
        jobs = [{"x": np.ones((1, 4), np.float32)}] * args.jobs
        submitting: dict[str, list[float]] = {name: [] for name in producers}
        for _ in range(args.rounds):
            for name, each in producers.items():
                submitting[name].append(cpu_us(lambda each=each: each.submit_many(MODEL, jobs), 1) / args.jobs)
            client.delete(f"rq:queue:ortq:{MODEL}")
        for each in producers.values():
            each.close()
        asynchronous = asyncio.run(async_cpu_us(server.url, jobs, args.rounds))
    print(f"packing one enqueue's commands, us of CPU: redis-py {statistics.median(packing['redis-py']):.1f}, "
          f"ortq {statistics.median(packing['ortq']):.1f}")  # fmt: skip
    old, new = statistics.median(submitting["redis-py"]), statistics.median(submitting["ortq"])
    print(f"submit_many of {args.jobs} jobs, us of CPU a job (median of {args.rounds}): redis-py's packer {old:.1f}, "
          f"ortq's {new:.1f} ({new / old:.2f}x)")  # fmt: skip
    old, new = asynchronous["redis-py"], asynchronous["ortq"]
    print(f"AsyncProducer.submit_many, the same: redis-py's packer {old:.1f}, ortq's {new:.1f} ({new / old:.2f}x)")


if __name__ == "__main__":
    main()
