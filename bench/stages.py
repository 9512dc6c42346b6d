"""The worker's stages one by one, in microseconds a job: where its Python goes, without threads.

    python -m bench.stages [--rows 1] [--batch 32] [--max-batch ROWS] [--metrics]

Enqueues a batch of digits jobs (the bundled model) with ortq's Producer on a local Redis, takes
them with the worker's own start script (ortq.worker.intake), then times each later stage on that
batch, over and over, as the worker's threads run them: the main thread's check (jobs.check_batch),
group, joining the inputs, run and split (and their sum: the main thread's CPU a job outside the
run); the replier's encoding (jobs.Computed.answer), the
finish script's arguments (not sent) and, with ``--metrics``, the Prometheus metrics. RQ's result
and execution records are off, as in docs/performance.md's one-worker figures. ``--max-batch``
is the worker's, in rows a run (default: the whole take in one run); bench/gpu/throughput.py's
digits32 runs one 32-row job a run (``--rows 32 --max-batch 32``). The sum is less
than a real worker's CPU a job (bench/gpu/throughput.py): Redis round trips, thread hand-overs and
colder caches are not in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort

from ortq import keys
from ortq.demo import MODEL_PATH
from ortq.localredis import LocalRedis
from ortq.metrics import WorkerMetrics
from ortq.producer import Producer
from ortq.rqcompat.book import Book, Finished
from ortq.settings import Settings
from ortq.wire import layout_of
from ortq.worker import jobs
from ortq.worker.batch import group, split
from ortq.worker.intake import Intake
from ortq.worker.model_signature import signature_of


def timed(label: str, work: Callable[[], object], jobs_in_batch: int, repeat: int = 2000) -> float:
    """Prints and returns the seconds ``work`` takes a job."""
    seconds = min(timeit.repeat(work, number=repeat, repeat=5)) / repeat
    print(f"{label:34} {1e6 * seconds:9.2f} us a batch {1e6 * seconds / jobs_in_batch:7.2f} us a job")
    return seconds / jobs_in_batch


def split_as_the_worker(outputs: dict[str, np.ndarray], sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """ortq.worker.loop's split: a run of one job keeps its outputs as they are."""
    return split(outputs, sizes) if len(sizes) > 1 else [outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1, help="rows a job")
    parser.add_argument("--batch", type=int, default=32, help="jobs a take (the worker's --max-batch)")
    parser.add_argument("--max-batch", type=int, default=None, help="rows a run (default: rows x batch)")
    parser.add_argument("--metrics", action="store_true")
    args = parser.parse_args()
    with LocalRedis() as server:
        settings = dataclasses.replace(Settings.from_url(server.url), rq_results=False, rq_executions=False)
        connection = settings.connect()
        session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
        signature, names = signature_of(session), [o.name for o in session.get_outputs()]
        rng = np.random.default_rng(0)
        inputs = [{"pixels": rng.standard_normal((args.rows, 64)).astype(np.float32)} for _ in range(8)]
        with Producer(settings=settings, allow_unknown_models=True) as producer:
            producer.submit_many("digits", [inputs[i % 8] for i in range(args.batch)])
        book = Book(connection, "stages", keys.queue_name("digits"), executions=False)
        taken = Intake(connection, book, settings, args.batch, 0.002).take(block=True) or []
        n = len(taken)
        print(f"{n} jobs of {args.rows} row(s), taken by the start script; per stage:")
        max_rows = args.max_batch or args.batch * args.rows
        main_thread = timed(
            "check (main thread)", lambda: jobs.check_batch(taken, "digits", signature, settings, True, 0.001), n
        )
        pending, _ = jobs.check_batch(taken, "digits", signature, settings, True, 0.001)
        groups = group(pending, lambda p: p.key, max_rows, lambda p: p.rows)
        print(f"({len(groups)} runs of at most {max_rows} rows)")
        main_thread += timed("group", lambda: group(pending, lambda p: p.key, max_rows, lambda p: p.rows), n)
        main_thread += timed("join the inputs", lambda: [jobs.group_inputs(members) for members in groups], n)
        feeds = [jobs.group_inputs(members) for members in groups]
        timed("session.run (CPU)", lambda: [session.run(names, feed) for feed in feeds], n, 200)
        outputs = [dict(zip(names, session.run(names, feed), strict=True)) for feed in feeds]
        sizes = [[m.rows for m in members] for members in groups]
        main_thread += timed(
            "split", lambda: [split_as_the_worker(out, s) for out, s in zip(outputs, sizes, strict=True)], n
        )
        print(f"{'main thread (check to split, no run)':34} {'':19} {1e6 * main_thread:7.2f} us a job")
        computed = [
            jobs.Computed(member, mine, 0.001, len(members), 60, layout_of(mine))
            for members, out, s in zip(groups, outputs, sizes, strict=True)
            for member, mine in zip(members, split_as_the_worker(out, s), strict=True)
        ]
        timed("encode (replier)", lambda: [c.encode(settings) for c in computed], n)
        answers = [c.encode(settings) for c in computed]
        finished = [a for a in answers if isinstance(a, Finished)]
        unsent = Book(connection, "stages", keys.queue_name("digits"), executions=False)

        def arguments_only(name: str, arguments: list[Any], **_: Any) -> tuple[Any, list[Any]]:
            return 0, []

        unsent._pipelined = arguments_only  # type: ignore[method-assign]
        timed("finish script's arguments", lambda: unsent.finish(finished, state=""), n)
        if args.metrics:
            metrics = WorkerMetrics("digits", "cpu", "CPUExecutionProvider", "stages")
            timed("metrics", lambda: metrics.jobs_succeeded([f.timings for f in finished]), n)


if __name__ == "__main__":
    main()
