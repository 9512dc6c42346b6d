"""A batch's check through remembered headers (ortq.worker.jobs.check_batch: one verdict per header
a batch, inputs joined from the frames) decides for every job exactly what the full checks of its
frame on its own decide, whatever the batch mixes: producers' frames of several shapes and dtypes,
frames that differ from a remembered one in any byte, cut short or longer, bytes or bytearray.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ortq import keys, knownheaders, wire
from ortq.rqcompat.book import StartedJob
from ortq.rqcompat.layout import utcnow
from ortq.settings import Settings
from ortq.signature import ModelSignature, TensorSpec
from ortq.worker import jobs
from ortq.worker.batch import group
from ortq.worker.intake import Taken
from tests.test_fuzz import job_fields

SIGNATURE = ModelSignature(inputs=(TensorSpec("x", "float32", (None, 4)),), outputs=())
SETTINGS = Settings.from_url("redis://127.0.0.1:1/0", max_frame_bytes=4096)  # never connects
#: The shapes and dtypes producers send here: two that fit the model, three that do not.
KINDS = [((2, 4), np.float32), ((1, 4), np.float32), ((1, 5), np.float32), ((2, 4), np.int64), ((1, 2, 4), np.float32)]
#: A job hash of model "m" that names the reply stream its producer reads (else it fails InvalidJob).
FIELDS = {**job_fields("m"), b"ortq_reply": keys.new_reply_name(60).encode()}


def producer_frame(kind: int, seed: int) -> bytes:
    shape, dtype = KINDS[kind]
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape) * 10
    # The nonce from the seed too: hypothesis replays a case only if every draw (the byte to change
    # is drawn unlike the one there) sees the same frame again.
    return wire.encode_request({"x": values.astype(dtype)}, {"nonce": rng.bytes(16)})


def alone(frame: bytes | bytearray) -> tuple[Any, ...]:
    """What the full checks decide for ``frame``, with nothing remembered."""
    knownheaders.KNOWN.clear()
    try:
        request = wire.decode_request(frame, max_bytes=SETTINGS.max_frame_bytes)
        SIGNATURE.check_inputs(request.inputs)
        proof = None if request.nonce is None else wire.proof_of("m", request.nonce)
        return "ok", jobs.rows_of(request.inputs), request.inputs, proof
    except Exception as exc:
        return "failed", f"{type(exc).__name__}: {str(exc) or type(exc).__name__}"


def damaged_frame(data: st.DataObject, seed: int) -> bytes | bytearray:
    """A producer's frame of a drawn kind, as sent or with one byte changed, cut short or longer; as
    bytes or as a bytearray."""
    frame = bytearray(producer_frame(data.draw(st.integers(0, len(KINDS) - 1)), seed))
    how = data.draw(st.sampled_from(["as sent", "as sent", "byte", "truncate", "append"]))
    if how == "byte":
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] = data.draw(st.integers(0, 255).filter(lambda b, old=frame[at]: b != old))
    elif how == "truncate":
        del frame[data.draw(st.integers(0, len(frame) - 1)) :]
    elif how == "append":
        frame += data.draw(st.binary(min_size=1, max_size=16))
    return data.draw(st.sampled_from([bytes, bytearray]))(frame)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_batch_decides_for_each_job_what_its_frame_alone_decides(data: st.DataObject) -> None:
    frames = [damaged_frame(data, seed) for seed in range(data.draw(st.integers(1, 10)))]
    taken = [
        Taken(StartedJob(f"job-{i}", uuid.uuid4().hex, FIELDS, None, 60, utcnow(), len(f)), f)
        for i, f in enumerate(frames)
    ]
    knownheaders.KNOWN.clear()
    for kind in data.draw(st.lists(st.integers(0, len(KINDS) - 1), max_size=3)):  # headers seen before
        wire.decode_request(producer_frame(kind, 99))
    pending, failures = jobs.check_batch(taken, "m", SIGNATURE, SETTINGS, True, 0.0)

    decided: dict[str, tuple[Any, ...]] = {p.started.job_id: ("ok", p.rows, p.tensors(), p.proof) for p in pending}
    decided.update((f.started.job_id, ("failed", f.reason)) for f in failures)
    for item in taken:
        got, expected = decided[item.started.job_id], alone(item.frame)  # type: ignore[arg-type]
        assert got[0] == expected[0] and len(got) == len(expected), (got, expected)
        if got[0] == "failed":
            assert got == expected
            continue
        assert got[1] == expected[1] and got[3] == expected[3]
        assert got[2].keys() == expected[2].keys()
        for name, array in got[2].items():
            assert array.dtype == expected[2][name].dtype and array.shape == expected[2][name].shape
            np.testing.assert_array_equal(array, expected[2][name])
    # Each run's inputs: its members' own, joined in order.
    for members in group(pending, lambda p: p.key, 8, lambda p: p.rows):
        joined = jobs.group_inputs(members)
        for name, array in joined.items():
            np.testing.assert_array_equal(array, np.concatenate([m.tensors()[name] for m in members]))
