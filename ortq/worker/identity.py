"""What a worker publishes about itself besides its live state (``ortq:worker:<name>``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerIdentity:
    """The model it serves and what it runs on."""

    model: str
    model_path: str
    provider: str
    device_id: int | None
    fell_back_to_cpu: bool
    host: str
    pid: int
    #: The version of the model it serves: ``--model-version``, else its file's digest
    #: (ortq.worker.serve.file_version).
    version: str
    extra: dict[str, Any] = field(default_factory=dict)
