"""What a job timeout costs a run, side by side in one run: ``session.run`` of the bundled digits
model (one row) with no timeout, with ortq's watcher (ortq.worker.deadline, what the worker does),
and with a ``threading.Timer`` a run (what it did before), in microseconds a run and as ratios.

    python -m bench.run_timeout [--runs 3000]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from ortq.demo import MODEL_PATH
from ortq.worker.deadline import RunDeadline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3000)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(MODEL_PATH), options, providers=["CPUExecutionProvider"])
    inputs = {"pixels": np.zeros((1, 64), np.float32)}
    deadline = RunDeadline()

    def plain() -> None:
        session.run(None, inputs)

    def watched() -> None:
        run_options = ort.RunOptions()
        deadline.arm(run_options, 180)
        try:
            session.run(None, inputs, run_options)
        finally:
            deadline.disarm()

    def timer() -> None:
        run_options = ort.RunOptions()
        stopper = threading.Timer(180, setattr, (run_options, "terminate", True))
        stopper.start()
        try:
            session.run(None, inputs, run_options)
        finally:
            stopper.cancel()

    def per_run(run: Callable[[], None]) -> float:
        for _ in range(100):
            run()
        started = time.perf_counter()
        for _ in range(args.runs):
            run()
        return 1e6 * (time.perf_counter() - started) / args.runs

    results = {name: per_run(run) for name, run in (("no timeout", plain), ("watcher", watched), ("timer", timer))}
    base = results["no timeout"]
    for name, us in results.items():
        print(f"{name:<12} {us:8.1f} us a run   x{us / base:6.2f} of no timeout")


if __name__ == "__main__":
    main()
