"""The floor ortq is measured against: a bare LPUSH/BRPOP queue with the same codec and session.

``python -m bench.raw_worker --model M --redis-url U --queue K`` serves frames pushed to list
``K`` and pushes each response to ``K:reply``. No RQ, no side keys, no bookkeeping: what is
left is Redis transport, the frame codec and ``session.run``.
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
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(args.model, sess_options=options, providers=["CPUExecutionProvider"])
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
