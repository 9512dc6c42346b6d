"""ortq: a Redis job queue that runs ONNX models, one ONNX Runtime session per worker process.

Producers (``ortq.Producer``, and ``ortq.AsyncProducer`` for asyncio) need only numpy, msgpack
and redis; workers (``ortq worker``) add ONNX Runtime. The wire format is in docs/wire-format.md.
"""

from ortq.errors import (
    InferenceFailed,
    InvalidInput,
    OrtqError,
    ResultTimeout,
    UnknownModel,
)
from ortq.producer import AsyncInferenceJob, AsyncProducer, InferenceJob, Producer
from ortq.settings import Settings

__version__ = "0.1.0"

__all__ = [
    "AsyncInferenceJob",
    "AsyncProducer",
    "InferenceFailed",
    "InferenceJob",
    "InvalidInput",
    "OrtqError",
    "Producer",
    "ResultTimeout",
    "Settings",
    "UnknownModel",
    "__version__",
]
