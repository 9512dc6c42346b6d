"""Where one sequential request's time goes: a timeline of ortq's stages, producer and worker.

    python -m bench.timeline [--model tiny|conv] [--requests 300]

One real ``ortq worker`` (unbatched, one intra-op thread) serves requests sent one at a time by a
``Producer`` (``submit`` then ``result``), on a local Redis. The worker runs under this module
(``--serve``), which wraps a few of its functions to note the moment each begins and ends (on
``time.perf_counter``, the system's monotonic clock, the same in both processes): the wake-up from
``BLMOVE``, the start script's round trip, the hand-over to the main thread, the check,
``session.run``, and the finish script's round trip. Printed: each stage's median over the
requests and the median of the whole, beside a direct ``session.run`` of the same inputs timed in
this process. The wrappers cost a few microseconds a stage; bench/latency.py gives the ratios
without them.
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models

#: The marks one request passes, in order: (mark, what the time up to it was). The finish script's
#: reply reaches the producer and the worker at once: its round trip in the worker ("finish<") runs
#: beside the producer's last stage and is printed apart.
STAGES = [
    ("woken", "producer: encode and enqueue, until BLMOVE returns in the worker"),
    ("start>", "worker: from the wake-up to the start script sent"),
    ("start<", "worker: start script + first frame's GETRANGE, one round trip"),
    ("check>", "worker: hand-over to the main thread"),
    ("run>", "worker: check and decode"),
    ("run<", "worker: session.run"),
    ("finish>", "worker: split, encode, finish script's arguments"),
    ("done", "finish script, until the producer has read and decoded the reply"),
]
BESIDE = ("finish<", "(beside the last: the finish script's round trip, in the worker)")


def _note(events: list[tuple[float, str]], owner: Any, name: str, begin: str | None, end: str | None) -> None:
    """Wrap ``owner.name`` so that each call appends (time, begin) on entry and (time, end) on return."""
    wrapped = getattr(owner, name)

    @functools.wraps(wrapped)
    def noted(*args: Any, **kwargs: Any) -> Any:
        if begin:
            events.append((time.perf_counter(), begin))
        result = wrapped(*args, **kwargs)
        if end and result is not None:  # a BLMOVE slice that took nothing is no wake-up
            events.append((time.perf_counter(), end))
        return result

    setattr(owner, name, noted)


def serve(out: Path, worker_args: list[str]) -> None:
    """Run ``ortq worker`` with the stage wrappers; at exit, write its marks to ``out``."""
    import redis

    from ortq import cli
    from ortq.rqcompat.book import Book
    from ortq.worker.loop import Worker
    from ortq.worker.session import LoadedModel

    events: list[tuple[float, str]] = []
    _note(events, redis.Redis, "blmove", None, "woken")
    _note(events, Book, "start", "start>", "start<")
    _note(events, Worker, "_check_and_run", "check>", None)
    _note(events, LoadedModel, "_run", "run>", "run<")
    _note(events, Book, "finish", "finish>", "finish<")

    def write() -> None:
        out.write_text("".join(f"{moment:.7f} {mark}\n" for moment, mark in events))

    atexit.register(write)
    sys.argv = ["ortq", "worker", *worker_args]
    cli.run()


def stage_times(requests: list[tuple[float, float]], events: list[tuple[float, str]]) -> dict[str, list[float]]:
    """Each stage's durations (ms) over the requests whose marks were all found, each the first of
    its name after the previous mark and before the next request's submit (the worker's finish
    round trip may end after that: the producer has its reply as soon as the worker)."""
    times = [moment for moment, _ in events]
    durations: dict[str, list[float]] = {mark: [] for mark, _ in [*STAGES, BESIDE]}
    for index, (began, ended) in enumerate(requests):
        until = requests[index + 1][0] if index + 1 < len(requests) else float("inf")
        chain = [began]
        for mark, _ in STAGES[:-1]:
            chain.append(_first(events, times, mark, chain[-1], until))
        chain.append(ended)
        finished = _first(events, times, BESIDE[0], chain[-2], float("inf"))
        if any(moment is None for moment in chain) or finished is None:
            continue
        for (mark, _), start, end in zip(STAGES, chain[:-1], chain[1:], strict=True):
            durations[mark].append(1000 * (end - start))
        durations[BESIDE[0]].append(1000 * (finished - chain[-2]))
    return durations


def _first(events: list[tuple[float, str]], times: list[float], mark: str, after: float | None, until: float) -> Any:
    """The time of the first ``mark`` at or after ``after`` and before ``until``; None if none."""
    if after is None:
        return None
    for moment, name in events[bisect.bisect_left(times, after) : bisect.bisect_left(times, until)]:
        if name == mark:
            return moment
    return None


def measure(model: Path, inputs: dict[str, np.ndarray], count: int, url: str, tmp: Path) -> None:
    out = tmp / "marks.txt"
    command = [sys.executable, "-m", "bench.timeline", "--serve", str(out), "--", "--model", str(model),
               "--name", "timeline", "--redis-url", url, "--threads", "1"]  # fmt: skip
    worker = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": os.getcwd()})
    requests: list[tuple[float, float]] = []
    try:
        with Producer(settings=Settings.from_url(url)) as producer:
            producer.wait_for_workers("timeline", 1, timeout=60)
            for _ in range(count + 20):
                began = time.perf_counter()
                producer.submit("timeline", inputs).result(timeout=30)
                requests.append((began, time.perf_counter()))
    finally:
        worker.terminate()
        worker.wait(30)
    events = sorted((float(moment), mark) for moment, mark in (line.split() for line in out.read_text().splitlines()))
    durations = stage_times(requests[20:], events)
    report(durations, [ended - began for began, ended in requests[20:]], direct_ms(model, inputs, count))


def direct_ms(model: Path, inputs: dict[str, np.ndarray], count: int) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])
    samples = []
    for _ in range(count + 20):
        began = time.perf_counter()
        session.run(None, inputs)
        samples.append(time.perf_counter() - began)
    return 1000 * statistics.median(samples[20:])


def report(durations: dict[str, list[float]], totals: list[float], direct: float) -> None:
    complete = len(durations["done"])
    print(f"{complete} of {len(totals)} requests with every mark; medians in ms:")
    for mark, what in [*STAGES, BESIDE]:
        print(f"  {statistics.median(durations[mark]):7.3f}  {what}")
    total = 1000 * statistics.median(totals)
    print(f"  {total:7.3f}  the whole request (median), {total / direct:.2f}x a direct session.run ({direct:.3f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description="a sequential request's time, stage by stage")
    parser.add_argument("--model", choices=["tiny", "conv"], default="conv")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the worker under the wrappers
    args, rest = parser.parse_known_args()
    if args.serve is not None:
        serve(args.serve, [arg for arg in rest if arg != "--"])
        return
    rng = np.random.default_rng(0)
    build: Callable[[Path], Path]
    if args.model == "tiny":
        build, inputs = onnx_models.tiny_model, {"x": rng.standard_normal((1, 4)).astype(np.float32)}
    else:
        build = onnx_models.conv_model
        inputs = {"image": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as server:
        model = build(Path(tmp) / f"{args.model}.onnx")
        print(f"{args.model}: {args.requests} sequential requests, one worker; onnxruntime {ort.__version__}")
        measure(model, inputs, args.requests, server.url, Path(tmp))


if __name__ == "__main__":
    main()
