"""Past the byte floor: a 224x224 image sent as its JPEG (20-60 KB) vs as the decoded float tensor
(3x224x224 float32, 602 KB), side by side in one run on one machine.

    python -m bench.images [--provider cpu|cuda] [--threads 1] [--drain 300] [--requests 200] [--quality 90]

Two models with the same four convolutions and weights (tests/onnx_models.py's ``conv_model``):
``conv`` takes the float tensor, ``jpeg conv`` takes the JPEG's bytes and decodes them itself
(onnxruntime-extensions' ``DecodeImage``, tests/image_models.py; its workers run with
``--custom-ops onnxruntime_extensions``). The tensor sent is the JPEG decoded by that same decoder,
so both compute on the same pixels (checked: their logits agree). ``--images`` distinct synthetic
photos (tests/image_models.py) are sent in turn. Systems, each measured here:

- ``direct``: in-process ``session.run`` of each model (decode + convolutions, or the convolutions);
- ``raw``: bench/raw_worker.py, a bare LPUSH/BRPOP queue with the same codec and session: the floor
  of the tensor through Redis (and, beside it, of the JPEG);
- ``ortq``: one real ``ortq worker`` per model.

For each: sequential p50 (one request at a time, end to end) and drain jobs/s (a burst of jobs
enqueued at once, then all results awaited). Ratios: JPEG over tensor through ortq, and each ortq
over the tensor's raw floor. ``--provider cuda`` runs every session and worker on GPU 0 (the decoder
itself always runs on the CPU: it is a CPU custom op).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import onnxruntime_extensions
import redis

from bench.latency import percentile, raw_round_trips, time_each
from ortq import wire
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import image_models, onnx_models

Inputs = dict[str, np.ndarray]
PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": [("CUDAExecutionProvider", {"device_id": "0"})]}


@dataclass
class Case:
    """One way of sending the images: its model, the jobs' inputs, and what it needs to run."""

    label: str
    model: Path
    inputs: list[Inputs]
    custom_ops: bool

    @property
    def frame_bytes(self) -> float:
        return float(np.mean([len(wire.encode_request(i)) for i in self.inputs]))


@dataclass
class Measured:
    system: str
    p50_ms: float
    p99_ms: float
    jobs_per_s: float


def session(case: Case, provider: str, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if case.custom_ops:
        options.register_custom_ops_library(onnxruntime_extensions.get_library_path())
    return ort.InferenceSession(str(case.model), sess_options=options, providers=PROVIDERS[provider])


def cycle(inputs: list[Inputs]) -> Callable[[], Inputs]:
    """The inputs in turn, one a call."""
    state = {"n": 0}

    def following() -> Inputs:
        state["n"] += 1
        return inputs[state["n"] % len(inputs)]

    return following


def measure_direct(case: Case, provider: str, threads: int, requests: int, drain: int) -> Measured:
    run, following = session(case, provider, threads), cycle(case.inputs)
    samples = time_each(lambda: run.run(None, following()), requests)
    started = time.perf_counter()
    for _ in range(drain):
        run.run(None, following())
    rate = drain / (time.perf_counter() - started)
    return Measured(f"direct, {case.label}", 1000 * statistics.median(samples), 1000 * percentile(samples, 99), rate)


def measure_raw(case: Case, url: str, provider: str, threads: int, requests: int, drain: int) -> Measured:
    queue = f"bench:images:{case.model.stem}"
    command = [sys.executable, "-m", "bench.raw_worker", "--model", str(case.model), "--redis-url", url,
               "--queue", queue, "--threads", str(threads), "--provider", provider]  # fmt: skip
    command += ["--custom-ops", onnxruntime_extensions.get_library_path()] if case.custom_ops else []
    r = redis.Redis.from_url(url, socket_timeout=60)
    r.delete(queue, queue + ":reply", queue + ":ready")
    worker, following = subprocess.Popen(command), cycle(case.inputs)
    try:
        while not r.exists(queue + ":ready"):
            if worker.poll() is not None:
                raise RuntimeError(f"bench.raw_worker exited with {worker.returncode} before serving")
            time.sleep(0.05)

        samples, rate = raw_round_trips(r, queue, following, requests, drain, 60)
    finally:
        r.lpush(queue, b"stop")
        worker.wait(20)
    return Measured(f"raw, {case.label}", 1000 * statistics.median(samples), 1000 * percentile(samples, 99), rate)


def measure_ortq(case: Case, url: str, provider: str, threads: int, requests: int, drain: int) -> Measured:
    name = f"bench-images-{case.model.stem}"
    command = [sys.executable, "-m", "ortq", "worker", "--model", str(case.model), "--name", name,
               "--redis-url", url, "--threads", str(threads), "--provider", provider]  # fmt: skip
    command += ["--custom-ops", "onnxruntime_extensions"] if case.custom_ops else []
    worker, following = subprocess.Popen(command), cycle(case.inputs)
    try:
        with Producer(settings=Settings.from_url(url)) as producer:
            producer.wait_for_workers(name, 1, timeout=120)
            samples = time_each(lambda: producer.infer(name, following(), timeout=60), requests)
            started = time.perf_counter()
            jobs = producer.submit_many(name, [following() for _ in range(drain)])
            producer.results(jobs, timeout=300)
            rate = drain / (time.perf_counter() - started)
    finally:
        worker.terminate()
        worker.wait(30)
    return Measured(f"ortq, {case.label}", 1000 * statistics.median(samples), 1000 * percentile(samples, 99), rate)


def make_cases(folder: Path, count: int, quality: int) -> tuple[Case, Case]:
    """The JPEG case and the tensor case of ``count`` images, the tensors decoded from the JPEGs by
    the models' own decoder; their logits checked to agree."""
    jpegs = [image_models.jpeg_bytes(image_models.synthetic_photo(224, 224, seed=n), quality) for n in range(count)]
    jpeg = Case("JPEG", image_models.decoding_conv_model(folder / "jpeg_conv.onnx", resize=False),
                [{"encoded": np.frombuffer(j, np.uint8)} for j in jpegs], custom_ops=True)  # fmt: skip
    decoder = session(Case("decoder", image_models.decoder_model(folder / "decoder.onnx"), [], True), "cpu", 1)
    tensors = [image_models.decoded_tensor(decoder.run(None, i)[0]) for i in jpeg.inputs]
    tensor = Case("tensor", onnx_models.conv_model(folder / "conv.onnx"), [{"image": t} for t in tensors], False)
    for a, b in zip(jpeg.inputs[:4], tensor.inputs[:4], strict=True):
        from_jpeg = session(jpeg, "cpu", 1).run(None, a)[0]
        np.testing.assert_allclose(from_jpeg, session(tensor, "cpu", 1).run(None, b)[0], rtol=1e-4, atol=1e-5)
    return jpeg, tensor


def report(rows: list[Measured]) -> None:
    by = {r.system: r for r in rows}
    print(f"\n{'system':18} {'p50 ms':>8} {'p99 ms':>8} {'drain jobs/s':>13}")
    for r in rows:
        print(f"{r.system:18} {r.p50_ms:8.3f} {r.p99_ms:8.3f} {r.jobs_per_s:13.0f}")
    floor = by["raw, tensor"].jobs_per_s
    print("\nratios (drain jobs/s):")
    print(f"  ortq JPEG / ortq tensor      {by['ortq, JPEG'].jobs_per_s / by['ortq, tensor'].jobs_per_s:6.2f}x")
    print(f"  ortq tensor / raw tensor     {by['ortq, tensor'].jobs_per_s / floor:6.2f}x")
    print(f"  ortq JPEG / raw tensor       {by['ortq, JPEG'].jobs_per_s / floor:6.2f}x")
    print(f"  ortq JPEG / raw JPEG         {by['ortq, JPEG'].jobs_per_s / by['raw, JPEG'].jobs_per_s:6.2f}x")
    print(f"  direct JPEG / direct tensor  {by['direct, JPEG'].jobs_per_s / by['direct, tensor'].jobs_per_s:6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, same for every system")
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per system")
    parser.add_argument("--drain", type=int, default=300, help="jobs per drain burst")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality")
    parser.add_argument("--images", type=int, default=32, help="distinct images, sent in turn")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as server:
        jpeg, tensor = make_cases(Path(tmp), args.images, args.quality)
        sizes = [len(i["encoded"]) for i in jpeg.inputs]
        print(f"provider={args.provider} threads={args.threads} requests={args.requests} drain={args.drain} "
              f"onnxruntime={ort.__version__} onnxruntime-extensions={onnxruntime_extensions.__version__}")  # fmt: skip
        kb = f"{min(sizes) / 1000:.1f}-{max(sizes) / 1000:.1f} KB (request frame {jpeg.frame_bytes / 1000:.1f} KB)"
        print(f"{args.images} images 224x224x3: JPEG q{args.quality} {kb} vs the float32 tensor "
              f"(request frame {tensor.frame_bytes / 1000:.1f} KB)")  # fmt: skip
        common = (args.provider, args.threads, args.requests, args.drain)
        rows = [measure_direct(case, *common) for case in (tensor, jpeg)]
        rows += [measure_raw(case, server.url, *common) for case in (tensor, jpeg)]
        rows += [measure_ortq(case, server.url, *common) for case in (tensor, jpeg)]
        report(rows)


if __name__ == "__main__":
    main()
