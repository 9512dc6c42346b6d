"""Every error ortq raises, in one tree under :class:`OrtqError`.

A worker that fails a job sends the error's class name and message to the producer
inside the response frame (see docs/wire-format.md); the producer raises
:class:`InferenceFailed` carrying both.
"""

from __future__ import annotations


class OrtqError(Exception):
    """Base class of every error ortq raises on purpose."""


class ConfigurationError(OrtqError):
    """A setting, CLI flag or environment variable has a value ortq cannot use."""


class UnknownModel(ConfigurationError):
    """No worker has published a signature for the model a job was submitted to (a mistyped name,
    or no worker started yet): nothing was enqueued. The message lists the models that have workers.
    A producer made with ``allow_unknown_models=True`` enqueues anyway, for workers that start later."""


class WireFormatError(OrtqError):
    """Bytes that are not a valid ortq frame: garbage, truncated, wrong version or inconsistent header.
    ``plain``: what is wrong in fixed words, nothing quoted from the frame (None: not said), which a
    worker may put in an unproven answer (docs/wire-format.md, 4.3)."""

    def __init__(self, message: str, plain: str | None = None) -> None:
        super().__init__(message)
        self.plain = plain


class PayloadTooLarge(WireFormatError):
    """A frame is larger than the configured maximum; it was refused before being decoded."""


class InvalidInput(OrtqError):
    """Input tensors that do not fit the model: unknown or missing names, wrong dtype, rank or fixed dim."""


class UnsupportedDtype(InvalidInput):
    """An array whose dtype has no ONNX tensor type ortq carries (object, str, complex, datetime, ...)."""


class QueueFull(OrtqError):
    """The model's queue already holds ``max_queue_length`` jobs; nothing was enqueued."""


class InferenceFailed(OrtqError):
    """The worker could not run the job; ``remote_type`` and ``remote_message`` say why."""

    def __init__(self, job_id: str, remote_type: str, remote_message: str) -> None:
        super().__init__(f"job {job_id} failed: {remote_type}: {remote_message}")
        self.job_id = job_id
        self.remote_type = remote_type
        self.remote_message = remote_message


class BrokerUnavailable(OrtqError):
    """Redis could not be reached (refused, reset or timed out). For a submit it is unknown whether the
    jobs were enqueued when the connection dropped during the write (``maybe_enqueued``); waits give
    up at their timeout."""

    #: A submit's write had begun: its jobs may be in Redis (False: nothing was enqueued).
    maybe_enqueued: bool = False


class CorruptRecord(OrtqError):
    """A Redis key ortq reads or writes holds something ortq did not write there (a value of the
    wrong type, written by someone else with access to the same Redis); the message names it."""


class ResponseMismatch(OrtqError):
    """A response does not answer this producer's request: it does not carry the proof made from the
    request's random nonce and the model (docs/wire-format.md, "The proof"). Someone with write
    access to Redis replaced the request frame or pushed the job onto another model's queue; the
    outputs are not returned."""


class JobStopped(OrtqError):
    """The job was stopped at its producer's request (``cancel()`` of a started job) or an
    operator's (RQ's stop-job command) before or while it ran: RQ's status ``stopped``, no outputs."""


class JobExists(OrtqError):
    """A submit named a job id that a job already has (queued, running, or answered while its reply
    lives; or another model's job): nothing of that job was overwritten or enqueued again. With
    ``unique=True`` a submit returns the existing job of its own model instead. ``enqueued``: the
    handles of the jobs of the same submit that were enqueued."""

    def __init__(self, message: str, enqueued: list[object] | None = None) -> None:
        super().__init__(message)
        self.enqueued = enqueued or []


class VersionMismatch(OrtqError):
    """A job was answered by a version of its model other than the one it may be answered by: the
    version it was pinned to, or one whose signature is the one its inputs were checked against
    (during a rollout that changes the signature, a job checked against the old one and taken by a
    new worker). The outputs are not returned; submitting it again checks it against the current
    signature."""


class ProtocolMismatch(ConfigurationError):
    """The model's workers speak another ortq protocol (docs/wire-format.md) than this producer: jobs
    would never be answered. Nothing was enqueued; upgrade producers and workers together."""


class ResultTimeout(OrtqError):
    """No result arrived within the time the caller was willing to wait; the job may still run later."""


class JobNotFound(OrtqError):
    """The job id is unknown to Redis: never enqueued, or its records have expired."""


class UnknownJobFunction(OrtqError):
    """A job names a callable other than ortq's inference function; it is failed without importing it."""


class InvalidJob(OrtqError):
    """A job record that is no well-formed ortq job (fields RQ cannot read, a zlib bomb, an id outside
    ``[A-Za-z0-9_-]+``): failed or dropped without running, and the worker goes on."""


class JobTimeout(OrtqError):
    """The run took longer than the job's ``job_timeout``; ONNX Runtime was told to stop it."""


class RequestExpired(OrtqError):
    """The job's request tensors were gone when a worker took it (its ttl passed before it started)."""


class ProviderUnavailable(OrtqError):
    """The requested execution provider could not be created, and falling back to the CPU was not allowed."""


class AdapterNotFound(ConfigurationError):
    """No adapter of the requested provider matches the ``--adapter`` spec; the message lists them all."""


class AmbiguousAdapter(ConfigurationError):
    """Several adapters match the ``--adapter`` spec; the message lists them all."""


class CanaryMismatch(OrtqError):
    """The chosen provider's output on the warm-up input differs from the CPU's: it would serve wrong answers."""


class RuntimeConflict(OrtqError):
    """More than one ONNX Runtime distribution is installed; they overwrite each other's ``onnxruntime``."""


class RuntimeMissing(OrtqError):
    """No ONNX Runtime distribution is installed; a worker needs ``ortq[worker]`` or ``ortq[cuda]``."""


class ModelLoadError(OrtqError):
    """The model file could not be read or ONNX Runtime refused it."""


class CustomOpsUnavailable(ConfigurationError):
    """The ``--custom-ops`` library cannot be used: its package is not installed, its path is no file,
    or ONNX Runtime could not load it as a custom-op library."""


class ProviderOptionRejected(ConfigurationError):
    """A ``--provider-option`` is malformed, names an option ortq sets itself (``device_id``: use
    ``--adapter``), or is not among the options the execution provider reports it took."""


class DeviceLost(OrtqError):
    """The GPU under the session is gone (DirectML device removed or reset, a CUDA failure): the session
    cannot run again. The worker puts its jobs back on the queue and exits with :data:`EXIT_DEVICE_LOST`
    so that its supervisor starts a fresh process with a fresh session."""


#: Exit status of ``ortq worker`` after :class:`DeviceLost` (EX_TEMPFAIL: restart me, now).
EXIT_DEVICE_LOST = 75
#: Exit status of ``ortq`` for a configuration or usage error: a bad flag, URL, file or input, a refused
#: login or permission, a server that is not Redis, a worker that cannot start (provider unavailable,
#: ...). Running the same command again will not help.
EXIT_CONFIGURATION = 2
#: Exit status of ``ortq worker`` when an unexpected error ended its work loop (restart it, with backoff).
EXIT_CRASHED = 1
#: Exit status of the other commands when Redis could not be reached or a wait ran out
#: (BrokerUnavailable, ResultTimeout, QueueFull): it may pass, so the same command may work later.
EXIT_UNAVAILABLE = 1
#: Exit status of ``ortq infer`` when a worker ran the job and it failed (InferenceFailed), or, with
#: ``--input-dir``, when any file failed.
EXIT_JOB_FAILED = 3


def exit_status(exc: OrtqError) -> int:
    """The exit status of an ``ortq`` command that ``exc`` ended (the table in ``ortq --help`` and
    docs/operations.md): 1 for what may pass, 3 for a job the worker failed, else 2."""
    if isinstance(exc, BrokerUnavailable | ResultTimeout | QueueFull):
        return EXIT_UNAVAILABLE
    if isinstance(exc, InferenceFailed):
        return EXIT_JOB_FAILED
    return EXIT_CONFIGURATION
