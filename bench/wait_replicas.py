"""What ``wait_replicas`` costs (ortq/replication.py: a PUBLISH and a WAIT after each submit and
each answered batch), side by side in one run on a primary with one replica on 127.0.0.1: direct
``session.run``, a raw LPUSH/BRPOP queue, ortq with wait_replicas 0 and 1, sequential requests
(p50, p99) and a drain (jobs/s), for the tiny model, one worker, batched and not.

    python -m bench.wait_replicas [--requests 300] [--drain 2000]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import redis

from bench.latency import measure_direct, measure_ortq, measure_raw, report
from ortq.localredis import LocalRedis
from tests import onnx_models


def main() -> None:
    parser = argparse.ArgumentParser(description="ortq with and without wait_replicas, against direct and raw")
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per system")
    parser.add_argument("--drain", type=int, default=2000, help="jobs per drain burst")
    parser.add_argument("--max-batch", type=int, default=32, help="the batched rows' --max-batch")
    args = parser.parse_args()
    inputs = {"x": np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)}
    print(f"requests={args.requests} drain={args.drain} onnxruntime={ort.__version__}; one replica")
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as primary:
        replica_args = ("--replicaof", "127.0.0.1", str(primary.port))
        with LocalRedis(extra_args=replica_args):
            client = redis.Redis.from_url(primary.url)
            client.set("bench:replicated", 1)
            while client.wait(1, 1000) < 1:  # the replica's first sync
                pass
            model = onnx_models.tiny_model(Path(tmp) / "tiny.onnx")
            common = (1, args.requests, args.drain)
            rows = [measure_direct(model, inputs, *common), measure_raw(model, inputs, primary.url, *common)]
            for max_batch in (1, args.max_batch):
                for wait in (0, 1):
                    rows.append(measure_ortq(model, inputs, primary.url, *common, 1, max_batch, wait_replicas=wait))
            report("tiny model, input 1x4, primary + 1 replica", rows)
            client.close()


if __name__ == "__main__":
    main()
