"""Fuzzing that runs in CI, with no atheris: the kept corpus replayed, and hostile jobs for a real worker.

(a) Every input in tests/fuzz/corpus/wire (seeds plus what the atheris harness found; see
    tests/fuzz/README.md) goes through the same checks the fuzzer ran: a frame is refused with
    WireFormatError or decodes consistently, and ``JobRecord.parse`` never raises.
(b) Hostile jobs are written straight into Redis, as anyone who can reach it could, and served
    by a real ``ortq worker``: each must be answered with a typed failure (or, where it is in fact
    a valid request, with the outputs of a direct ``session.run``), its RQ status must say so, and
    the worker must stay up and go on serving good jobs correctly.
"""

from __future__ import annotations

import math
import re
import struct
import subprocess
import time
import tracemalloc
import uuid
import zlib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import msgpack
import numpy as np
import onnxruntime as ort
import pytest
import redis
from hypothesis import HealthCheck, Phase, event, example, given, note, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ortq import keys, wire
from ortq.errors import OrtqError, WireFormatError
from ortq.producer.responses import UNPROVEN_ERRORS
from ortq.rqjob import JobRecord
from ortq.signature import ModelSignature
from tests.conftest import WorkerProcesses, eventually
from tests.fuzz.seeds import raw_frame
from tests.fuzz.targets import check_input

CORPUS = sorted((Path(__file__).parent / "fuzz" / "corpus" / "wire").iterdir())


def _subclasses(cls: type) -> set[type]:
    return {cls} | {s for c in cls.__subclasses__() for s in _subclasses(c)}


#: The reasons a worker may give for failing a job: ortq's own error classes.
TYPED_REASONS = {cls.__name__ for cls in _subclasses(OrtqError)}
MAX_FRAME_BYTES = 4096  # the worker's limit here, so that PayloadTooLarge is cheap to reach
#: The job ids RQ accepts (rq.job.JOB_ID_PATTERN); only such jobs can be answered through RQ.
RQ_JOB_ID = re.compile(r"[A-Za-z0-9_-]+")


# --- (a) the corpus ------------------------------------------------------------------------------


def test_the_corpus_is_kept_small() -> None:
    sizes = [path.stat().st_size for path in CORPUS]
    assert 10 <= len(sizes) <= 200 and sum(sizes) <= 512 * 1024


@pytest.mark.parametrize("path", CORPUS, ids=lambda path: path.name[:12])
def test_corpus_input_is_refused_or_decoded_consistently(path: Path) -> None:
    check_input(path.read_bytes())


def _nested_header_frame(depth: int) -> bytes:
    """A request whose version is a list nested ``depth`` deep (msgpack allows up to 1023)."""
    nested = b"\x91" * depth + b"\x01"
    return raw_frame(b"\x82" + msgpack.packb("v") + nested + msgpack.packb("kind") + msgpack.packb("request"))


def test_a_header_nested_too_deeply_to_show_is_a_wire_format_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by fuzzing: repr() of the bad value for the error message raised RecursionError.
    for depth in (900, 1000, 1023):
        with pytest.raises(WireFormatError, match="unsupported wire version"):
            wire.decode_request(_nested_header_frame(depth))
    # The replay catches that bug: with the decoder's old repr it is a crash, not a refusal.
    monkeypatch.setattr(wire, "_short", repr)
    with pytest.raises(RecursionError):
        check_input(_nested_header_frame(1000))


def test_a_zlib_bomb_in_the_job_data_is_refused_without_inflating_it() -> None:
    bomb = zlib.compress(bytes(64 << 20))  # 64 KB that inflate to 64 MB
    tracemalloc.start()
    try:
        record = JobRecord.parse("bomb", {b"data": bomb})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert record.forbidden is not None
    assert peak < 8 << 20, f"parsing a {len(bomb)}-byte field took {peak >> 20} MB"


def test_a_deeply_nested_signature_record_is_a_wire_format_error() -> None:
    with pytest.raises(WireFormatError):
        ModelSignature.loads("[" * 100_000)


# --- (b) hostile jobs for a real worker ----------------------------------------------------------

GOOD_X = np.arange(8, dtype=np.float32).reshape(2, 4)
GOOD_FRAME = wire.encode_request({"x": GOOD_X})
FORGED_FUNC = "tests.canary.tripwire"  # importing or calling it leaves $ORTQ_CANARY_FILE behind


def _job_data(func: object, instance: object = None, args: object = ()) -> bytes:
    return msgpack.packb([func, instance, list(args), {}], use_bin_type=True)


def job_fields(model: str, reply: str | None = None) -> dict[bytes, bytes]:
    """The hash docs/wire-format.md tells a producer to write, as raw bytes: answered in the reply
    stream ``reply`` names (a new one, unless given: each job hash written by hand its own)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ").encode()
    return {
        b"status": b"queued",
        b"origin": keys.queue_name(model).encode(),
        b"data": _job_data(keys.JOB_FUNC, None, [model]),
        b"description": f"{keys.JOB_FUNC}({model!r})".encode(),
        b"created_at": now,
        b"enqueued_at": now,
        b"result_ttl": b"600",
        b"failure_ttl": b"600",
        b"ortq_reply": (keys.new_reply_name(600) if reply is None else reply).encode(),
    }


#: What keys.reply_keep takes for a reply name, on the raw bytes of a field anyone may have written.
_REPLY_NAME = re.compile(rb"[A-Za-z0-9_\-]{1,64}\.[1-9][0-9]{0,7}")


def answers(r: redis.Redis, model: str, job_id: str) -> list[tuple[bytes, bytes]]:
    """(entry id, response frame) of every entry answering ``job_id`` in the reply stream its job
    hash names (``ortq_reply``; an empty frame is a large answer's, read from the job's own key,
    keys.large_reply_key): one for a job answered once, none for one not answered (yet), or whose
    record names no reply stream or is no hash."""
    job_key = keys.job_key(job_id)
    if r.type(job_key) != b"hash":
        return []
    name = r.hget(job_key, "ortq_reply")
    if name is None or not _REPLY_NAME.fullmatch(name):
        return []
    stream = keys.reply_key(model, name.decode())
    if r.type(stream) != b"stream":
        return []
    found = []
    for entry_id, fields in r.xrange(stream):
        if fields.get(keys.REPLY_ID_FIELD) == job_id.encode():
            frame = fields.get(keys.REPLY_FRAME_FIELD, b"")
            if not frame:
                large = r.xrange(keys.large_reply_key(model, job_id))
                assert len(large) == 1, f"the large answer of job {job_id}: {large!r:.200}"
                frame = large[0][1][keys.REPLY_FRAME_FIELD]
            found.append((entry_id, bytes(frame)))
    return found


def answer(r: redis.Redis, model: str, job_id: str) -> bytes | None:
    """The response frame of ``job_id``, as a reader that did not follow its stream finds it
    (docs/wire-format.md, section 4.1): the entry its hash's ``ortq_answer`` names, which must be
    the one entry with its id in the stream its ``ortq_reply`` names (a job is answered once);
    None until ``ortq_answer`` is written."""
    job_key = keys.job_key(job_id)
    entry = r.hget(job_key, "ortq_answer") if r.type(job_key) == b"hash" else None
    if entry is None:
        return None
    found = answers(r, model, job_id)
    assert [entry_id for entry_id, _ in found] == [entry], (
        f"job {job_id} answered by {entry!r}, in its stream: {found!r:.300}"
    )
    return found[0][1]


HostileJob = tuple[str | bytes, dict[bytes, bytes], bytes | None]  # id, hash, request frame (None: not written)
#: What a job must end as: failed with this error type, run (None), either of the two (EITHER),
#: not started and never answered (SKIPPED: its record names another queue), or failed and answered
#: nowhere (NOWHERE: its record names no reply stream, ``ortq_reply``).
Expected = str | None
EITHER = "either"
SKIPPED = "skipped"
NOWHERE = "nowhere"


def push(r: redis.Redis, model: str, jobs: list[HostileJob]) -> None:
    """Enqueue ``jobs`` with raw commands in one MULTI/EXEC, so that a batching worker takes them together."""
    with r.pipeline(transaction=True) as pipe:
        for job_id, fields, frame in jobs:
            raw_id = job_id.encode() if isinstance(job_id, str) else job_id
            if frame is not None:
                pipe.set(keys.request_key(model, "").encode() + raw_id, frame, ex=600)
            pipe.hset(b"rq:job:" + raw_id, mapping=fields)  # type: ignore[arg-type]
            pipe.sadd(keys.RQ_QUEUES_SET, keys.queue_key(model))
            pipe.rpush(keys.queue_key(model), raw_id)
        pipe.execute()


def wait_reply(
    r: redis.Redis, model: str, job_id: str, worker: subprocess.Popen[bytes], logs: Callable[[], str]
) -> bytes:
    """The job's response frame; fails at once if the worker exits, and after 30 s if it hangs."""
    deadline = time.monotonic() + 30  # a bound on a hang, not a timing: a reply takes milliseconds
    while time.monotonic() < deadline:
        frame = answer(r, model, job_id)
        if frame is not None:
            return frame
        if worker.poll() is not None:
            raise AssertionError(f"the worker exited with status {worker.returncode}:\n{logs()[-6000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no reply to job {job_id} in 30 s: the worker hung\n{logs()[-6000:]}")


def expected_failure(frame: bytes | None, record: str, signature: ModelSignature) -> str | None:
    """The error type the worker must answer with (None: it must run), found with ortq's own
    decoder and signature check: the worker must agree with the library it is built on. The
    request is read before the record (``record``: "ours", "forbidden" or "other model") is judged."""
    if frame is None:
        return "RequestExpired"
    try:
        inputs = wire.decode_request(frame, max_bytes=MAX_FRAME_BYTES).inputs
    except OrtqError as exc:
        return type(exc).__name__
    if record != "ours":
        return {"forbidden": "UnknownJobFunction", "other model": "InvalidJob"}[record]
    try:
        signature.check_inputs(inputs)
    except OrtqError as exc:
        return type(exc).__name__
    return None


def readable(frame: bytes | None) -> bool:
    """Whether ``frame`` is a request that decodes (the worker reads its nonce before anything else)."""
    try:
        return frame is not None and wire.decode_request(frame, max_bytes=MAX_FRAME_BYTES) is not None
    except OrtqError:
        return False


class Served:
    """A worker serving the tiny model, and what the checks of one hostile job need."""

    def __init__(self, workers: WorkerProcesses, redis_url: str, model: str, tiny_path: Path) -> None:
        workers.serve(tiny_path, model, redis_url, 1, "--max-batch", "4", "--rows-independent", "--max-wait-ms", "5")
        self.workers = workers
        self.worker = workers.processes[0][0]
        self.model = model
        self.r = redis.Redis.from_url(redis_url, socket_timeout=10)
        self.signature = ModelSignature.loads(self.r.get(keys.signature_key(model)) or b"")
        self.session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])

    def good_job(self) -> HostileJob:
        return str(uuid.uuid4()), job_fields(self.model), GOOD_FRAME

    def check_answer(self, job_id: str, frame: bytes | None, error_type: Expected) -> None:
        """The job was answered once, as ``error_type`` says, and its RQ status agrees. Its answer
        carries the proof of its request when the request had a nonce, and is else one of the
        errors a worker gives without reading the request."""
        job_key = keys.job_key(job_id)
        failed = f"rq:failed:{keys.queue_name(self.model)}"
        if error_type == SKIPPED:  # its record names another queue: left as it was, unanswered
            assert answers(self.r, self.model, job_id) == [] and self.r.hget(job_key, "ortq_answer") is None
            assert not self.r.exists(keys.large_reply_key(self.model, job_id))
            assert self.r.hget(job_key, "status") not in (b"started", b"finished", b"failed")
            return
        if error_type == NOWHERE:  # it names no reply stream: failed before it ran, answered nowhere
            eventually(lambda: self.r.hget(job_key, "status") == b"failed")
            eventually(lambda: self.r.zscore(failed, job_id) is not None)
            assert self.r.hget(job_key, "ortq_answer") is None
            assert not self.r.exists(keys.large_reply_key(self.model, job_id))
            eventually(lambda: not self.r.exists(keys.request_key(self.model, job_id)))
            return
        response = wire.decode_response(wait_reply(self.r, self.model, job_id, self.worker, self.workers.logs))
        if readable(frame):
            nonce = wire.decode_request(frame, max_bytes=MAX_FRAME_BYTES).nonce  # type: ignore[arg-type]
            assert response.proof == (None if nonce is None else wire.proof_of(self.model, nonce))
        else:  # answered without reading it: no proof, and one of the errors a producer then accepts
            assert response.proof is None and response.error is not None
            assert response.error.type in UNPROVEN_ERRORS, response.error
        if error_type == EITHER:
            error_type = None if response.error is None else response.error.type
        if error_type is None:
            assert response.error is None, response.error
            assert frame is not None
            x = wire.decode_request(frame).inputs["x"]
            np.testing.assert_array_equal(response.outputs["y"], self.session.run(None, {"x": x})[0])
            eventually(lambda: self.r.hget(job_key, "status") == b"finished")
        else:
            assert error_type in TYPED_REASONS
            assert response.error is not None and response.error.type == error_type, response.error
            eventually(lambda: self.r.hget(job_key, "status") == b"failed")
            eventually(lambda: self.r.zscore(failed, job_id) is not None)
        assert len(answers(self.r, self.model, job_id)) == 1
        eventually(lambda: not self.r.exists(keys.request_key(self.model, job_id)))  # side keys do not outlive jobs

    def run_then_serve_a_good_job(self, jobs: list[tuple[HostileJob, Expected]]) -> None:
        """Push ``jobs`` (each with how it must end) and a good job in one go, and check them all;
        a job whose id RQ would refuse need not be answered, but must not stop the worker."""
        good = self.good_job()
        # Hypothesis may draw the same id (and reply name) twice: start each example from a clean
        # slate (a job in its queue's finished or failed registry is not run again: a replay).
        queue = keys.queue_name(self.model)
        for (job_id, fields, _), _ in jobs:
            raw = job_id.encode() if isinstance(job_id, str) else job_id
            with self.r.pipeline(transaction=True) as pipe:
                pipe.delete(b"rq:job:" + raw, keys.request_key(self.model, "").encode() + raw)
                pipe.delete(keys.large_reply_key(self.model, "").encode() + raw)
                if _REPLY_NAME.fullmatch(fields.get(b"ortq_reply", b"")):
                    pipe.delete(keys.reply_key(self.model, "").encode() + fields[b"ortq_reply"])
                pipe.zrem(f"rq:finished:{queue}", raw)
                pipe.zrem(f"rq:failed:{queue}", raw)
                pipe.execute()
        push(self.r, self.model, [job for job, _ in jobs] + [good])
        self.check_answer(str(good[0]), good[2], None)  # after the others: the worker took them first
        for (job_id, _, frame), error_type in jobs:
            if isinstance(job_id, str) and RQ_JOB_ID.fullmatch(job_id):
                self.check_answer(job_id, frame, error_type)
        assert self.worker.poll() is None, self.workers.logs()


def _declared_frame(draw: st.DrawFn) -> bytes:
    """A request whose descriptor may disagree with its bytes: shape vs nbytes, offsets past the
    data, absurd and negative dims, unknown dtypes, odd names; sometimes exactly consistent."""
    dtype = draw(st.sampled_from([*wire.SUPPORTED_DTYPES, "complex64", "float", "<f4"]))
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 4, 3, -1, 2**31, 2**62, 2**64 - 1]), max_size=4))
    count = math.prod(shape)
    itemsize = np.dtype(dtype).itemsize if dtype in wire.SUPPORTED_DTYPES else 4
    declared = count * itemsize if -(2**63) <= count * itemsize < 2**64 else 2**64 - 1  # what msgpack can carry
    nbytes = draw(st.just(declared) | st.integers(0, 64) | st.just(2**64 - 1))
    offset = draw(st.integers(0, 16) | st.just(2**63))
    consistent = 0 <= offset <= 16 and 0 <= nbytes <= 256 and draw(st.booleans())
    data = draw(st.binary(min_size=offset + nbytes, max_size=offset + nbytes) if consistent else st.binary(max_size=64))
    name = draw(st.sampled_from(["x", "x", "y", "", "x\x00"]))
    header = {"v": 1, "kind": "request", "inputs": {name: {"dtype": dtype, "shape": shape, "offset": offset,
                                                           "nbytes": nbytes}}}  # fmt: skip
    return raw_frame(header, data)


def _mutated(draw: st.DrawFn) -> bytes:
    frame = bytearray(GOOD_FRAME)
    for index, value in draw(st.lists(st.tuples(st.integers(0, len(frame) - 1), st.integers(0, 255)), max_size=4)):
        frame[index] = value
    return bytes(frame)


encoded_requests = st.dictionaries(
    st.sampled_from(["x", "x", "X", "y"]),
    hnp.arrays(
        st.sampled_from([np.float32, np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_]),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4) | st.sampled_from([(3, 4), (1, 4), (0, 4)]),
    ),
    min_size=1,
    max_size=2,
).map(wire.encode_request)

hostile_frames = st.one_of(
    st.binary(max_size=80),  # garbage
    st.binary(max_size=80).map(lambda rest: wire.MAGIC + rest),  # garbage after the magic
    st.integers(0, len(GOOD_FRAME) - 1).map(lambda n: GOOD_FRAME[:n]),  # truncated
    st.composite(_mutated)(),
    st.composite(_declared_frame)(),
    encoded_requests,  # well-formed frames with wrong names, dtypes, ranks and dims (or right ones)
    st.integers(250, 270).map(lambda n: wire.encode_request({"x": np.ones((n, 4), np.float32)})),  # near the limit
    st.sampled_from([wire.MAGIC + struct.pack("<I", 2**32 - 1), _nested_header_frame(1000)]),
    st.none(),  # the request frame was never written (or is gone)
)


def _data_variants(model: str) -> st.SearchStrategy[tuple[dict[bytes, bytes], str]]:
    """Overrides of the job hash's function fields, and what they make of the record: "ours",
    "forbidden" (another function, a method, callbacks, garbage) or "other model"."""
    ours = _job_data(keys.JOB_FUNC, None, [model])
    forged = _job_data(FORGED_FUNC)
    runnable = st.sampled_from(
        [
            ({}, "ours"),
            ({b"data": zlib.compress(ours)}, "ours"),  # RQ compresses the data it writes
            ({b"data": _job_data(keys.JOB_FUNC, None, ["other"])}, "other model"),  # another model's job
            ({b"data": _job_data(keys.JOB_FUNC, None, [model, 1])}, "other model"),  # no one model named
        ]
    )
    forbidden = st.sampled_from(
        [
            ({b"data": forged}, "forbidden"),
            ({b"data": zlib.compress(forged)}, "forbidden"),
            ({b"data": _job_data(keys.JOB_FUNC.encode(), None, [model])}, "forbidden"),  # a name as bytes
            ({b"data": _job_data(keys.JOB_FUNC, "tests.canary", [model])}, "forbidden"),  # a bound method
            ({b"data": b"\x80\x04\x95" + forged}, "forbidden"),  # pickle
            ({b"data": b""}, "forbidden"),
            ({b"success_callback_name": FORGED_FUNC.encode()}, "forbidden"),
            ({b"failure_callback_name": FORGED_FUNC.encode()}, "forbidden"),
            ({b"stopped_callback_name": FORGED_FUNC.encode()}, "forbidden"),
        ]
    ) | st.binary(min_size=1, max_size=24).map(lambda garbage: ({b"data": garbage}, "forbidden"))
    # Most jobs name ortq's function, so that their frames get to be checked.
    return st.sampled_from([runnable, runnable, runnable, forbidden]).flatmap(lambda variants: variants)


FUZZ = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_hostile_frames_and_functions_fail_typed_and_the_worker_serves_on(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    canary = tmp_path / "canary"
    monkeypatch.setenv("ORTQ_CANARY_FILE", str(canary))
    monkeypatch.setenv("ORTQ_MAX_FRAME_BYTES", str(MAX_FRAME_BYTES))
    served = Served(workers, redis_url, model_name, tiny_path)
    variants = _data_variants(model_name)

    @FUZZ
    @given(st.lists(st.tuples(hostile_frames, variants), min_size=1, max_size=3))
    def one_batch(jobs: list[tuple[bytes | None, tuple[dict[bytes, bytes], str]]]) -> None:
        hostile = []
        for frame, (overrides, record) in jobs:
            job: HostileJob = (str(uuid.uuid4()), {**job_fields(model_name), **overrides}, frame)
            outcome = expected_failure(frame, record, served.signature)
            event(f"a job that must end as {outcome or 'a run'}")  # --hypothesis-show-statistics
            hostile.append((job, outcome))
        note(f"jobs and the failures expected: {hostile}")
        served.run_then_serve_a_good_job(hostile)

    one_batch()
    assert not canary.exists(), "a forged job's function was imported or called"


# RQ's job hash fields (those RQ's Job.restore parses, and ortq's), and values a forged hash may hold.
HASH_FIELDS = [b"created_at", b"enqueued_at", b"started_at", b"timeout", b"ttl", b"result_ttl", b"failure_ttl",
               b"status", b"origin", b"description", b"retries_left", b"retry_intervals", b"meta",
               b"dependency_ids", b"number_of_retries", b"success_callback_timeout", b"enqueue_at_front",
               b"group_id", b"exc_info", b"result", b"repeats_left", b"ortq_recoveries"]  # fmt: skip
ODD_VALUES = st.sampled_from(
    [
        b"",
        b"abc",
        b"-1",
        b"0",
        b"1.5",
        b"1e3",
        b"99999999999999999999",
        b"inf",
        b"nan",
        b"\xff\xfe",
        b"[",
        b"{}",
        b"2026-13-45T99:99:99Z",
        b"5m",
    ]
) | st.binary(max_size=12)
#: Values of ``ortq_reply`` (the reply stream a job is answered in): names that are none (too
#: long, no keep, a keep of 0, with a leading zero or of 9 digits, odd characters) and a few that
#: are (a 64-character token, a keep over a year: taken as a year).
ODD_REPLY_NAMES = st.sampled_from(
    [b"", b"a", b"a.", b".5", b"a.0", b"a.05", b"a.5.5", b"a b.5", b"a:b.5", b"\xc3\xbc.5", b"a.123456789",
     b"x" * 65 + b".5", b"a.5\n", b"x" * 64 + b".5", b"a.99999999", b"a-_Z9.31536001"]
) | st.text("ab.-_:0123456789", max_size=12).map(str.encode)  # fmt: skip
mutations = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(HASH_FIELDS), ODD_VALUES),
    st.tuples(st.just("set"), st.just(b"ortq_reply"), ODD_REPLY_NAMES),
    st.tuples(
        st.just("drop"),
        st.sampled_from([b"data", b"status", b"origin", b"created_at", b"enqueued_at", b"ortq_reply"]),
        st.just(b""),
    ),
)
odd_ids = st.sampled_from(["a:b", "job.1", "job 1", "ünï", ""]) | st.binary(min_size=1, max_size=6)
job_ids = st.uuids().map(str) | odd_ids


def test_hostile_job_hashes_and_ids_never_stop_the_worker(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    served = Served(workers, redis_url, model_name, tiny_path)

    # Shrinking is off: once the worker is gone every example fails, and shrinking would only
    # find the smallest of those instead of the job that stopped it.
    @settings(FUZZ, phases=(Phase.explicit, Phase.reuse, Phase.generate))
    @given(job_ids, st.lists(mutations, min_size=1, max_size=3))
    @example(str(uuid.uuid4()), [("drop", b"data", b"")])
    @example(str(uuid.uuid4()), [("set", b"created_at", b"garbage")])
    @example(str(uuid.uuid4()), [("set", b"timeout", b"99999999999999999999")])
    @example(str(uuid.uuid4()), [("drop", b"data", b""), ("set", b"ortq_recoveries", b"garbage")])
    @example("job.1", [("set", b"description", b"fine")])
    @example(b"\xff", [("set", b"description", b"fine")])
    @example(str(uuid.uuid4()), [("drop", b"ortq_reply", b"")])  # a producer of protocol 3
    @example(str(uuid.uuid4()), [("set", b"ortq_reply", b"a.0")])
    @example(str(uuid.uuid4()), [("set", b"ortq_reply", b"a.99999999")])
    def one_job(job_id: str | bytes, changes: list[tuple[str, bytes, bytes]]) -> None:
        fields = job_fields(model_name)
        for what, field, value in changes:
            if what == "drop":
                fields.pop(field, None)
            else:
                fields[field] = value
        # A record naming another queue is no job of this model's: skipped. One naming no reply
        # stream is failed and answered nowhere. Without its data the job names no function; any
        # other odd field may be ignored or refused.
        if fields.get(b"origin") != keys.queue_name(model_name).encode():
            expected = SKIPPED
        elif not _REPLY_NAME.fullmatch(fields.get(b"ortq_reply", b"")):
            expected = NOWHERE
        else:
            expected = "UnknownJobFunction" if b"data" not in fields else EITHER
        served.run_then_serve_a_good_job([((job_id, fields, GOOD_FRAME), expected)])

    one_job()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80) | st.text(max_size=80).map(str.encode) | ODD_REPLY_NAMES)
@example(b"\xff.5")  # not UTF-8: a worker's check raised UnicodeDecodeError, failing its whole batch
@example(b"a.5")
def test_a_reply_name_of_any_bytes_is_read_or_refused_without_raising(name: bytes) -> None:
    """``ortq_reply`` is whatever anyone wrote into the job hash: JobRecord.parse (a worker's check
    of every job of a batch) and keys.reply_keep take it as a reply name or refuse it, never raise."""
    valid = _REPLY_NAME.fullmatch(name)
    keep = None if valid is None else min(int(name.split(b".")[1]), keys.MAX_REPLY_KEEP)
    assert keys.reply_keep(name) == keep
    record = JobRecord.parse("fuzz", {**job_fields("m"), b"ortq_reply": name})
    assert record.reply == (None if valid is None else name.decode()) and record.forbidden is None
    if keep is not None:
        assert record.reply_keep == keep
