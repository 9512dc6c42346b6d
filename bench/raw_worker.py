"""The floor ortq is measured against: a bare LPUSH/BRPOP queue with the same codec and session.

``python -m bench.raw_worker --model M --redis-url U --queue K`` serves frames pushed to list
``K`` and pushes each response to ``K:reply``. No RQ, no side keys, no bookkeeping: what is
left is Redis transport, the frame codec and ``session.run``. ``--provider cuda`` runs the session
on GPU 0; ``--custom-ops LIBRARY`` registers a custom-op library first (bench/images.py).
"""

from __future__ import annotations

import argparse

import onnxruntime as ort
import redis

from ortq import wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--custom-ops", default=None, help="a custom-op shared library to register")
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    if args.custom_ops:
        options.register_custom_ops_library(args.custom_ops)
    providers = [("CUDAExecutionProvider", {"device_id": "0"})] if args.provider == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(args.model, sess_options=options, providers=providers)
    names = [o.name for o in session.get_outputs()]
    connection = redis.Redis.from_url(args.redis_url, socket_timeout=None)
    connection.set(args.queue + ":ready", 1)
    while True:
        _, frame = connection.brpop([args.queue], 0)  # type: ignore[misc]
        if frame == b"stop":
            return
        request = wire.decode_request(frame)
        outputs = dict(zip(names, session.run(names, request.inputs), strict=True))
        connection.lpush(args.queue + ":reply", wire.encode_response(outputs))


if __name__ == "__main__":
    main()
