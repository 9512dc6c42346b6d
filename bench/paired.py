"""Two checkouts of ortq side by side, paired request by request: sequential latency on this machine.

    python -m bench.paired --before DIR [--after .] [--models tiny,conv] [--requests 500] [--rounds 2]

Runs one ``ortq worker`` from each checkout (``python -m ortq`` with that directory as the working
directory, so each imports its own code) on one Redis, each serving a model queue of its own, and
sends the same request to one then the other, alternating which goes first, one request at a time.
A noisy machine's drift (the CI VM's moves a cell by 30-70% between runs of bench/latency.py) then
falls on both alike, and the p50s can be compared within a few percent. Drains are not paired
here: their two workers would compete for the same cores; bench/latency.py measures them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models

CASES: dict[str, tuple[Callable[[Path], Path], str, tuple[int, ...]]] = {
    "tiny": (onnx_models.tiny_model, "x", (1, 4)),
    "conv": (onnx_models.conv_model, "image", (1, 3, 224, 224)),
}


def paired(url: str, model: Path, trees: dict[str, Path], inputs: dict[str, np.ndarray], requests: int) -> None:
    """Serve ``model`` from each tree's worker and time ``requests`` alternated infers against each."""

    def command(tag: str) -> list[str]:
        return [sys.executable, "-m", "ortq", "worker", "--model", str(model), "--name", f"{model.stem}-{tag}",
                "--redis-url", url, "--threads", "1"]  # fmt: skip

    workers = [subprocess.Popen(command(tag), cwd=tree, stderr=subprocess.DEVNULL) for tag, tree in trees.items()]
    try:
        samples: dict[str, list[float]] = {tag: [] for tag in trees}
        with Producer(settings=Settings.from_url(url)) as producer:
            for tag in trees:
                producer.wait_for_workers(f"{model.stem}-{tag}", 1, timeout=60)
            for i in range(20 + requests):  # the first 20 of each warm up
                for tag in list(trees) if i % 2 == 0 else list(reversed(trees)):
                    started = time.perf_counter()
                    producer.infer(f"{model.stem}-{tag}", inputs, timeout=30)
                    if i >= 20:
                        samples[tag].append(time.perf_counter() - started)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait()
    first = next(iter(trees))
    for tag, values in samples.items():
        p50, p90 = np.percentile(values, 50), np.percentile(values, 90)
        ratio = p50 / np.percentile(samples[first], 50)
        mean = statistics.mean(values)
        print(f"  {tag:8} p50 {1000 * p50:7.3f} ms  p90 {1000 * p90:7.3f} ms  mean {1000 * mean:7.3f} ms", end="")
        print(f"  p50 / {first}'s {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout of ortq (e.g. a git worktree)")
    parser.add_argument("--after", type=Path, default=Path("."), help="another (default: this one)")
    parser.add_argument("--models", default="tiny,conv", help="comma-separated: tiny, conv")
    parser.add_argument("--requests", type=int, default=500, help="sequential requests to each worker per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as server:
        for name in args.models.split(","):
            build, input_name, shape = CASES[name]
            model = build(Path(tmp) / f"{name}.onnx")
            inputs = {input_name: rng.standard_normal(shape).astype(np.float32)}
            for round_ in range(1, args.rounds + 1):
                print(f"{name} model, input {'x'.join(map(str, shape))}, round {round_}:")
                paired(server.url, model, trees, inputs, args.requests)


if __name__ == "__main__":
    main()
