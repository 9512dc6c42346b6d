"""ortq's one job function and the RQ job class that refuses every other callable.

RQ resolves a job's ``func_name`` (and its callback names) with ``import_attribute``:
whoever can write a job hash can make a worker import and call anything. An ortq
worker loads every job through :class:`OrtqJob`, which resolves nothing but
:data:`ortq.keys.JOB_FUNC` and has no callbacks, on every RQ code path that touches a
job (dequeue, registry cleanup, failure handling).
"""

from __future__ import annotations

from typing import Any

from rq.job import Job

from ortq.errors import UnknownJobFunction
from ortq.keys import JOB_FUNC


def infer(model: str) -> None:
    """The function every ortq job names. Its work is done by ``ortq worker`` itself, which reads
    the request tensors from their side key; a plain ``rq worker`` that picked the job up ends here.
    """
    raise RuntimeError(f"ortq jobs for model {model!r} must be run by `ortq worker`, not by a plain RQ worker")


class OrtqJob(Job):
    """An RQ job that can only ever name :func:`infer`."""

    def forbidden_reason(self) -> str | None:
        """Why this job must not run, or None when it is a well-formed ortq job."""
        try:
            func_name = self.func_name
        except Exception as exc:  # RQ raises DeserializationError for undecodable data
            return f"job data cannot be decoded with ortq's msgpack serializer ({type(exc).__name__})"
        if func_name != JOB_FUNC:
            return f"job names {func_name!r}; an ortq worker only runs {JOB_FUNC}"
        if self._instance is not None:
            return "job names a bound method; an ortq worker only runs a plain function"
        for attr in ("_success_callback_name", "_failure_callback_name", "_stopped_callback_name"):
            if getattr(self, attr, None):
                return f"job names a callback ({attr.strip('_')}); ortq jobs have none"
        return None

    @property
    def func(self) -> Any:
        reason = self.forbidden_reason()
        if reason is not None:
            raise UnknownJobFunction(reason)
        return infer

    # RQ would import these by name; an ortq job never has any.
    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None
