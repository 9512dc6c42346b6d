"""Everything a producer checks before it enqueues anything, with no I/O of its own: the submit
options, the model (a published signature, or UnknownModel), the inputs against that signature,
the frame size and the queue's room. ``Producer`` and ``AsyncProducer`` fetch what these read.

A submit that fails here leaves nothing in Redis.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from ortq import keys, tracing, wire
from ortq.errors import (
    ConfigurationError,
    CorruptRecord,
    InvalidInput,
    PayloadTooLarge,
    ProtocolMismatch,
    QueueFull,
    UnknownModel,
    WireFormatError,
)
from ortq.producer.enqueue import MAX_SECONDS, PRIORITIES, JobOptions
from ortq.settings import Settings
from ortq.signature import ModelSignature

#: The most retries a job may have, as many as a worker honours (``ortq.rqjob.MAX_RETRIES``).
MAX_RETRIES = 100
#: Seconds a fetched model signature is trusted before it is read again.
SIGNATURE_CACHE_SECONDS = 5.0


def _number(value: object) -> float | None:
    """``value`` as a float when it is a real number (not a bool; an int too large for a float is
    infinite), else None."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf  # type: ignore[operator]


def seconds(name: str, value: object, *, zero: bool = False) -> int:
    """``value`` as whole seconds for a job hash: a number, fractions rounded up (RQ stores whole
    seconds, and a worker would fail a job whose record holds ``0.5``), positive (or 0 with ``zero``),
    at most MAX_SECONDS. Raises ConfigurationError naming ``name`` otherwise."""
    number = _number(value)
    if number is None:
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}")
    if math.isnan(number) or number < 0 or (number == 0 and not zero):
        raise ConfigurationError(f"{name} must be {'>= 0' if zero else 'positive'}, got {value!r}")
    if number > MAX_SECONDS:
        raise ConfigurationError(f"{name} must be at most a year ({MAX_SECONDS} s), got {value!r}")
    return math.ceil(number)


def job_options(
    settings: Settings,
    *,
    ttl: object = None,
    job_timeout: object = None,
    retries: object = 0,
    retry_backoff: object = 0,
    priority: object = "normal",
    version: object = None,
    reply: str = "",
) -> JobOptions:
    """The per-job options of a submit, checked (ConfigurationError says which one is wrong);
    ``reply``: the name of the producer's reply stream its answers go to (keys.new_reply_name)."""
    if isinstance(retries, bool) or not isinstance(retries, numbers.Integral):
        raise ConfigurationError(f"retries must be a whole number, got {retries!r}")
    if not 0 <= int(retries) <= MAX_RETRIES:
        raise ConfigurationError(f"retries must be 0 to {MAX_RETRIES}, got {retries!r}")
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise ConfigurationError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    return JobOptions(
        request_ttl=settings.request_ttl,
        result_ttl=settings.result_ttl,
        failure_ttl=settings.failure_ttl,
        ttl=None if ttl is None else seconds("ttl", ttl),
        job_timeout=None if job_timeout is None else seconds("job_timeout", job_timeout),
        retries=int(retries),
        retry_backoff=seconds("retry_backoff", retry_backoff, zero=True),
        priority=priority,
        version=None if version is None else keys.check_version_name(version),
        reply=reply,
    )


def unique_needs_ids(unique: object, job_ids: object) -> None:
    """ConfigurationError for ``unique=True`` without chosen ids: uniqueness is by id, and a job
    without one gets a fresh random id, so the flag would be accepted and do nothing."""
    if unique and job_ids is None:
        raise ConfigurationError(
            "unique=True needs a job_id (job_ids for submit_many): a job is unique by the id you choose, and "
            "without one each submit gets a new random id; nothing was enqueued"
        )


def wait_timeout(timeout: object) -> float:
    """A ``timeout`` to wait for results: seconds >= 0 (``math.inf``: as long as it takes)."""
    number = _number(timeout)
    if number is None or math.isnan(number) or number < 0:
        raise ConfigurationError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    return number


def parse_signature(raw: bytes | str | None, model: str) -> ModelSignature | None:
    """The signature stored for ``model`` (None when none is), or CorruptRecord; ProtocolMismatch
    when the workers that published it speak another ortq protocol (keys.PROTOCOL)."""
    if raw is None:
        return None
    try:
        signature = ModelSignature.loads(raw)
    except WireFormatError as exc:
        key = keys.signature_key(model)
        raise CorruptRecord(f"the published signature of {model!r} ({key}) cannot be read: {exc}") from exc
    protocol = json.loads(raw).get("protocol", 2)  # workers before protocol 3 did not say
    if protocol != keys.PROTOCOL:
        raise ProtocolMismatch(
            f"the workers of {model!r} speak ortq protocol {protocol!r} and this producer {keys.PROTOCOL}: their "
            "jobs would never be answered, so nothing was enqueued; upgrade producers and workers together"
        )
    return signature


class SignatureCache:
    """Signatures read in the last SIGNATURE_CACHE_SECONDS. A missing one is never kept: the first
    submit after a worker starts must see it."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, ModelSignature]] = {}

    def get(self, model: str, now: float) -> ModelSignature | None:
        entry = self._entries.get(model)
        return entry[1] if entry is not None and now - entry[0] < SIGNATURE_CACHE_SECONDS else None

    def put(self, model: str, signature: ModelSignature | None, now: float) -> None:
        if signature is not None:
            self._entries[model] = (now, signature)


def encode_job(inputs: object, signature: ModelSignature | None, nonce: bytes, max_bytes: int) -> bytes:
    """One job's request frame; InvalidInput unless ``inputs`` fit ``signature`` (when there is one),
    PayloadTooLarge over ``max_bytes`` (workers would refuse it)."""
    if not isinstance(inputs, Mapping):
        raise InvalidInput(f"inputs must be a mapping of input name to array, got {type(inputs).__name__}")
    arrays = {name: wire.as_wire_array(name, value) for name, value in inputs.items()}
    if signature is not None:
        signature.check_inputs(arrays)
    frame = wire.encode_request(arrays, tracing.request_options(nonce))  # the nonce, after any trace context
    if len(frame) > max_bytes:
        raise PayloadTooLarge(
            f"the request is {len(frame)} bytes, over max_frame_bytes ({max_bytes}, the smaller of this "
            "producer's and the one the model's workers publish): workers would refuse it"
        )
    return frame


def check_room(model: str, queued: int, adding: int, limit: int) -> None:
    """QueueFull when ``adding`` more jobs would pass ``max_queue_length`` (``limit``; 0: none)."""
    if limit and queued + adding > limit:
        raise QueueFull(
            f"queue {keys.queue_name(model)} holds {queued} jobs; {adding} more would pass max_queue_length ({limit})"
        )


def worker_names(raw_names: Iterable[object]) -> list[str]:
    """The names read from ``ortq:workers`` (SRANDMEMBER of at most ``control.MAX_WORKERS``), as
    ``ortq.control.worker_records`` takes them: anything but a short byte string is skipped."""
    return sorted({n.decode(errors="replace") for n in raw_names if isinstance(n, bytes) and len(n) <= 256})


def live_records(raws: Iterable[object]) -> list[dict[str, Any]]:
    """The worker records (MGET of ``ortq:worker:<name>``) that are there and are JSON objects of at
    most 1 MiB; anything else (expired, or not written by a worker) is left out, as
    ``ortq.control.worker_records`` does."""
    records = []
    for raw in raws:
        if not isinstance(raw, bytes) or len(raw) > 1 << 20:
            continue
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def unknown_model(
    model: str, records: Iterable[Mapping[str, Any]], shard: str | None = None, version: str | None = None
) -> UnknownModel:
    """The error for a submit to ``model``, which has no published signature; ``records``: the
    live workers, whose models are listed (and the closest one suggested). ``shard``: the Redis the
    shard map gives the model (password left out), named because a worker started on another one
    looks exactly like this. ``version``: the version the submit pinned, which no worker served."""
    if version is not None:
        versions = sorted({str(r.get("version")) for r in records if r.get("model") == model and r.get("version")})
        live = f"live workers of {model!r} serve {', '.join(versions)}" if versions else f"no worker of {model!r} runs"
        return UnknownModel(
            f"no worker has served version {version!r} of model {model!r} (it has no published signature); nothing "
            f"was enqueued ({live}). Start one with ortq worker --name {model} --model-version {version}, or make the "
            "producer with allow_unknown_models=True to enqueue for workers that start later"
        )
    served = sorted({str(r["model"]) for r in records if isinstance(r.get("model"), str)})
    close = difflib.get_close_matches(model, served, n=1)
    found = f"Models with workers: {', '.join(served)}." if served else "No worker is running."
    if shard is not None:
        found = f"{found[:-1]} on {shard}, the Redis the shard map gives {model!r} (are its workers on another?)."
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return UnknownModel(
        f"no worker has served model {model!r} (it has no published signature); nothing was enqueued. "
        f"{found}{hint} Start a worker for it (ortq worker --model FILE --name {model}), or make the producer "
        "with allow_unknown_models=True to enqueue for workers that start later"
    )
