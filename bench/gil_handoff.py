"""What another busy Python thread costs a thread that calls ``session.run``: the GIL's hand-back.

    python -m bench.gil_handoff [--provider cpu|cuda] [--rows 32] [--runs 2000]

ONNX Runtime releases the GIL inside ``Run``; once the run ends, the calling thread must take the
GIL back. If another thread of the process is computing in Python meanwhile, CPython hands the GIL
back only when that thread blocks (I/O, a lock) or once the switch interval
(``sys.setswitchinterval``, 5 ms by default) has passed. The worker's main thread is that caller,
and its feeder and replier threads are the others (ortq.worker.overlap): whenever they have Python
work in hand as a run ends, the next run waits for it. This prints, side by side in one run, the
time a digits run takes alone, and beside a thread that computes in Python without pause (the
worst case) at several switch intervals. docs/results/performance-history.md ("Seventh pass") records the figures.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import onnxruntime as ort

from ortq.demo import MODEL_PATH

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
INTERVALS = (0.005, 0.001, 0.0005, 0.0002, 0.0001)


def time_runs(session: ort.InferenceSession, feed: dict[str, np.ndarray], runs: int) -> float:
    """Seconds a run, over ``runs`` runs."""
    started = time.perf_counter()
    for _ in range(runs):
        session.run(None, feed)
    return (time.perf_counter() - started) / runs


def beside_busy_thread(session: ort.InferenceSession, feed: dict[str, np.ndarray], runs: int) -> float:
    """time_runs while another thread computes in Python (never blocking, never sleeping)."""
    stop = threading.Event()

    def busy() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        return time_runs(session, feed, runs)
    finally:
        stop.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as `ortq worker --threads 1`: the run's own threads do not blur it
    session = ort.InferenceSession(str(MODEL_PATH), options, providers=[PROVIDERS[args.provider]])
    name = session.get_inputs()[0].name
    feed = {name: np.random.default_rng(0).standard_normal((args.rows, 64)).astype(np.float32)}
    time_runs(session, feed, 100)  # warm-up
    alone = time_runs(session, feed, args.runs)
    print(f"{args.provider}, {args.rows} rows: a run alone {1e6 * alone:.1f} us")
    default = sys.getswitchinterval()
    try:
        for interval in INTERVALS:
            sys.setswitchinterval(interval)
            beside = beside_busy_thread(session, feed, max(200, int(args.runs * alone / interval)))
            print(
                f"  beside a busy Python thread, switch interval {1e6 * interval:6.0f} us: "
                f"{1e6 * beside:8.1f} us a run ({beside / alone:5.1f}x alone)"
            )
    finally:
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
