"""The worker's CPU to read large request frames: redis-py (with hiredis) against
ortq.worker.largeframes, on the same keys, alternated, in one run.

    python -m bench.frame_read [--bytes 602112] [--frames 8] [--rounds 300] [--repeat 3]

Each round reads ``--frames`` frames in one pipelined round trip of ``GETRANGE key 0 limit``, as
the worker's intake does for a batch's frames over the inline size. Printed per frame: this
thread's CPU time (``time.thread_time``) and the wall time, and the ratio of the two readers.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import redis

from ortq.localredis import LocalRedis
from ortq.worker.largeframes import read_large_frames, read_through_redis_py

LIMIT = 1 << 26


def through_redis_py(connection: redis.Redis, keys: list[str]) -> None:
    read_through_redis_py(connection, keys, LIMIT)


def through_largeframes(connection: redis.Redis, keys: list[str]) -> None:
    read_large_frames(connection, keys, LIMIT)


def timed(
    read: Callable[[redis.Redis, list[str]], None], connection: redis.Redis, keys: list[str], rounds: int
) -> tuple[float, float]:
    """CPU and wall µs a frame."""
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(rounds):
        read(connection, keys)
    frames = rounds * len(keys)
    return 1e6 * (time.thread_time() - cpu) / frames, 1e6 * (time.perf_counter() - wall) / frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=3 * 224 * 224 * 4, help="frame size (default: a conv image)")
    parser.add_argument("--frames", type=int, default=8, help="frames a round trip (the bench's conv batch)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with LocalRedis() as server:
        connection = redis.Redis.from_url(server.url)
        keys = [f"frame:{i}" for i in range(args.frames)]
        for key in keys:
            connection.set(key, os.urandom(args.bytes))
        print(f"{args.frames} frames of {args.bytes} bytes a round trip, {args.rounds} rounds; µs a frame:")
        for _ in range(args.repeat):
            mine = timed(through_largeframes, connection, keys, args.rounds)
            theirs = timed(through_redis_py, connection, keys, args.rounds)
            print(
                f"  redis-py cpu {theirs[0]:6.1f} wall {theirs[1]:6.1f} | largeframes cpu {mine[0]:6.1f} "
                f"wall {mine[1]:6.1f} | cpu ratio {mine[0] / theirs[0]:.2f}"
            )
        connection.close()


if __name__ == "__main__":
    main()
