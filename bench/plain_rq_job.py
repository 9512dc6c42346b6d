"""What a user would write with plain RQ: tensors in the job's arguments, a session per worker.

Run by ``rq worker --worker-class rq.SimpleWorker`` (no fork, so the session stays loaded); the
model path comes from ``BENCH_MODEL``. Only for bench/latency.py: it pickles, as RQ does.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnxruntime as ort

_session: Any = None


def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    global _session  # noqa: PLW0603  # one session per worker process, created on first use
    if _session is None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(os.environ.get("BENCH_THREADS", "1"))
        _session = ort.InferenceSession(os.environ["BENCH_MODEL"], sess_options=options)
    names = [o.name for o in _session.get_outputs()]
    return dict(zip(names, _session.run(names, inputs), strict=True))
