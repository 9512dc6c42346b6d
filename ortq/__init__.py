"""ortq: a Redis job queue that runs ONNX models, one ONNX Runtime session per worker process.

Producers (``ortq.Producer``) need only numpy, msgpack and redis; workers (``ortq worker``)
add ONNX Runtime. The wire format is in docs/wire-format.md.
"""

from ortq.errors import (
    InferenceFailed,
    InvalidInput,
    OrtqError,
    ResultTimeout,
)
from ortq.producer import InferenceJob, Producer
from ortq.settings import Settings

__version__ = "0.1.0"

__all__ = [
    "InferenceFailed",
    "InferenceJob",
    "InvalidInput",
    "OrtqError",
    "Producer",
    "ResultTimeout",
    "Settings",
    "__version__",
]
