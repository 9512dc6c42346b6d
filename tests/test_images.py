"""Jobs that carry encoded images: a JPEG's bytes as a uint8 vector, decoded inside the model by
onnxruntime-extensions' ``DecodeImage`` (``ortq worker --custom-ops onnxruntime_extensions``),
through real workers and a real pool, against a direct in-process ``session.run`` with the same
library; the refusals at start (no library for the model's operator, a missing package, a path that
is no library, batching), before any job is taken; and the check that keeps bytes which would end
the worker's process away from the decoder (ortq.worker.encoded_images), fuzzed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortq import keys, wire
from ortq.errors import EXIT_CONFIGURATION, InferenceFailed
from ortq.producer import Producer
from ortq.settings import Settings
from ortq.signature import TensorSpec
from ortq.worker.custom_ops import library_path
from ortq.worker.encoded_images import warmup_image
from tests import image_models
from tests.conftest import REPO, Pool, WorkerProcesses

ort_extensions = pytest.importorskip("onnxruntime_extensions", reason="the `images` extra (onnxruntime-extensions)")
pytest.importorskip("PIL", reason="Pillow (the `test` extra) writes the JPEGs")

#: Worker starts with and without the library: also under onnxruntime 1.20 (scripts/test.sh's second pass).
pytestmark = pytest.mark.rqcompat

#: Image sizes sent: the model's own, and two it resizes (one of them portrait).
SIZES = [(224, 224), (300, 200), (96, 160)]


@pytest.fixture(scope="module")
def decoding_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return image_models.decoding_conv_model(tmp_path_factory.mktemp("images") / "decoding_conv.onnx")


def direct(model: Path, encoded: np.ndarray) -> np.ndarray:
    """The model's logits by an in-process session with the same custom-op library."""
    options = ort.SessionOptions()
    options.register_custom_ops_library(ort_extensions.get_library_path())
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    [logits] = session.run(["logits"], {"encoded": encoded})
    return np.asarray(logits)


def jpegs() -> list[np.ndarray]:
    return [
        np.frombuffer(image_models.jpeg_bytes(image_models.synthetic_photo(h, w, seed=n)), np.uint8)
        for n, (h, w) in enumerate(SIZES)
    ]


def start_refused(*args: str) -> subprocess.CompletedProcess[str]:
    """``ortq worker`` expected to stop at start-up, before it reaches Redis (none at that port)."""
    command = [sys.executable, "-m", "ortq", "worker", "--name", "refused", "--redis-url", "redis://127.0.0.1:1/0",
               "--threads", "1", *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)


def test_the_wire_carries_encoded_bytes_of_any_length_and_the_signature_takes_them() -> None:
    spec = TensorSpec("encoded", "uint8", ("num_bytes",))
    for length in (1, 7, 22_645, 60_001):  # odd lengths: the frame pads tensors to 8 bytes
        data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
        [(name, decoded)] = wire.decode_request(wire.encode_request({"encoded": data})).inputs.items()
        assert name == "encoded" and decoded.dtype == np.uint8
        np.testing.assert_array_equal(decoded, data)
        spec.check(decoded)


def test_jpeg_bytes_through_a_worker_equal_direct_session_run(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, decoding_path: Path
) -> None:
    workers.serve(decoding_path, model_name, redis_url, 1, "--custom-ops", "onnxruntime_extensions")
    [record] = producer.workers(model_name)
    assert record["custom_ops"] == library_path("onnxruntime_extensions")
    signature = producer.signature(model_name)
    assert signature is not None and signature.inputs == (TensorSpec("encoded", "uint8", ("num_bytes",)),)
    images = jpegs()
    assert all(10_000 < image.size < 60_000 for image in images[:2]), [image.size for image in images]
    jobs = producer.submit_many(model_name, [{"encoded": image} for image in images])
    for image, job in zip(images, jobs, strict=True):
        logits = job.result(timeout=60)["logits"]
        assert logits.shape == (1, 10) and logits.dtype == np.float32
        np.testing.assert_allclose(logits, direct(decoding_path, image), rtol=1e-5, atol=1e-6)
    # The images differ, and so do their answers: the model looked at the pixels.
    assert not np.allclose(jobs[0].result(timeout=1)["logits"], jobs[1].result(timeout=1)["logits"])


#: Bytes on which onnxruntime-extensions 0.15.2's decoder ends the process (libjpeg's default error
#: handler calls exit) or never returns, each with what the worker's check says instead.
def _process_enders(jpeg: bytes) -> dict[str, tuple[bytes, str]]:
    noise = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    return {
        "no image": (bytes(100), "neither a JPEG nor a PNG file"),  # exit: Not a JPEG file
        "a cut header": (jpeg[:300], "has a bad length"),  # exit: Improper call to JPEG library
        "noise in the image data": (jpeg[:2000] + noise + jpeg[5000:], "which the decoder does not support"),
        "cut image data": (jpeg[: len(jpeg) // 2], "cut off before the JPEG's end marker"),  # loops forever
        "a bomb": (_declared_size(jpeg, 60_000, 60_000), "at most 89,478,485 are decoded"),  # 10.8 GB
    }


def _declared_size(jpeg: bytes, width: int, height: int) -> bytes:
    """``jpeg`` whose frame header (SOF0) declares another size."""
    at = jpeg.index(b"\xff\xc0") + 5
    return jpeg[:at] + height.to_bytes(2, "big") + width.to_bytes(2, "big") + jpeg[at + 4 :]


def test_bytes_that_would_end_the_decoder_fail_their_job_alone(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, decoding_path: Path
) -> None:
    workers.serve(decoding_path, model_name, redis_url, 1, "--custom-ops", "onnxruntime_extensions")
    [(process, _)] = workers.processes
    image = jpegs()[0]
    for what, (data, says) in _process_enders(image.tobytes()).items():
        with pytest.raises(InferenceFailed, match=says) as failed:
            producer.infer(model_name, {"encoded": np.frombuffer(data, np.uint8)}, timeout=30)
        assert failed.value.remote_type == "InvalidInput", what
    # A PNG's errors are the decoder's own, raised as run errors.
    with pytest.raises(InferenceFailed, match="Error during png creation"):
        producer.infer(model_name, {"encoded": np.frombuffer(b"\x89PNG\r\n\x1a\n" + bytes(200), np.uint8)}, timeout=30)
    assert process.poll() is None, workers.logs()
    np.testing.assert_allclose(
        producer.infer(model_name, {"encoded": image}, timeout=30)["logits"], direct(decoding_path, image),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


#: Mutations of each kind of JPEG run through the decoder in a child process (seeds 0 .. N-1).
FUZZ_CASES = 400
_FUZZ = """
import sys
import numpy as np, onnxruntime as ort, onnxruntime_extensions
from ortq.errors import InvalidInput
from ortq.worker.encoded_images import check_encoded_image
from tests import image_models
progressive, count, model = sys.argv[1] == "progressive", int(sys.argv[2]), sys.argv[3]
options = ort.SessionOptions()
options.register_custom_ops_library(onnxruntime_extensions.get_library_path())
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
base = image_models.jpeg_bytes(image_models.synthetic_photo(64, 64), 80, progressive)
accepted = 0
for seed in range(count):
    data = np.frombuffer(image_models.mutated(base, seed), np.uint8)
    try:
        check_encoded_image("encoded", data)
    except InvalidInput:
        continue
    accepted += 1
    print("decoding seed", seed, flush=True)
    try:
        session.run(None, {"encoded": data})
    except Exception:
        pass  # a run error is what a bad job may cause; ending the process is not
print("accepted", accepted, flush=True)
"""


@pytest.mark.parametrize("kind", ["baseline", "progressive"])
def test_the_check_lets_through_only_jpegs_the_decoder_survives(kind: str, tmp_path: Path) -> None:
    decoder = image_models.decoder_model(tmp_path / "decoder.onnx")
    command = [sys.executable, "-c", _FUZZ, kind, str(FUZZ_CASES), str(decoder)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the decoder hung after the check let through: {exc.stdout!r}"[-300:]) from None
    last = done.stdout.strip().splitlines()[-1:]
    assert done.returncode == 0, f"the decoder ended the process at {last}: {done.stderr[-300:]}"
    accepted = int(last[0].split()[-1])
    assert FUZZ_CASES // 5 < accepted < FUZZ_CASES, accepted  # the mutations hit both sides of the check


def test_batching_refuses_encoded_image_inputs(decoding_path: Path) -> None:
    done = start_refused(
        "--model", str(decoding_path), "--custom-ops", "onnxruntime_extensions", "--max-batch", "4",
        "--rows-independent",
    )  # fmt: skip
    assert done.returncode == EXIT_CONFIGURATION
    assert "--max-batch cannot join jobs whose input 'encoded' is an encoded image's bytes" in done.stderr


def test_a_worker_without_custom_ops_refuses_such_a_model_before_taking_a_job(
    redis_url: str, model_name: str, decoding_path: Path
) -> None:
    with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
        waiting = producer.submit(model_name, {"encoded": jpegs()[0]})
        command = [sys.executable, "-m", "ortq", "worker", "--model", str(decoding_path), "--name", model_name,
                   "--redis-url", redis_url, "--threads", "1"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
        assert done.returncode == EXIT_CONFIGURATION, done.stderr
        message = done.stderr.strip().splitlines()[-1]
        assert message.startswith("ortq: ModelLoadError: ONNX Runtime could not load"), message
        assert "operator DecodeImage of domain com.microsoft.extensions" in message
        assert "--custom-ops onnxruntime_extensions" in message
        assert waiting.status() == "queued"
        assert producer.connection.llen(keys.queue_key(model_name)) == 1


def test_custom_ops_that_cannot_load_stop_the_worker_at_start(tmp_path: Path, decoding_path: Path) -> None:
    model = ["--model", str(decoding_path)]
    missing = start_refused(*model, "--custom-ops", str(tmp_path / "libnothing.so"))
    assert missing.returncode == EXIT_CONFIGURATION
    assert f"ortq: CustomOpsUnavailable: --custom-ops {tmp_path / 'libnothing.so'}: no such file" in missing.stderr
    not_a_library = tmp_path / "notes.txt"
    not_a_library.write_text("not a shared library\n")
    bad = start_refused(*model, "--custom-ops", str(not_a_library))
    assert bad.returncode == EXIT_CONFIGURATION
    assert f"CustomOpsUnavailable: ONNX Runtime could not load the custom-op library {not_a_library}" in bad.stderr
    # The package not installed: an interpreter where importing it fails, as it does where it is absent.
    hidden = "import sys; sys.modules['onnxruntime_extensions'] = None; from ortq.cli import run; run()"
    command = [sys.executable, "-c", hidden, "worker", "--name", "refused", "--redis-url", "redis://127.0.0.1:1/0",
               *model, "--custom-ops", "onnxruntime_extensions"]  # fmt: skip
    absent = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert absent.returncode == EXIT_CONFIGURATION, absent.stderr
    assert "CustomOpsUnavailable: --custom-ops onnxruntime_extensions:" in absent.stderr
    assert "pip install 'ortq[images]'" in absent.stderr


def test_the_warm_up_image_is_a_png_the_decoder_reads(tmp_path: Path) -> None:
    decoder = image_models.decoder_model(tmp_path / "decoder.onnx")
    options = ort.SessionOptions()
    options.register_custom_ops_library(ort_extensions.get_library_path())
    session = ort.InferenceSession(str(decoder), options, providers=["CPUExecutionProvider"])
    [decoded] = session.run(["decoded"], {"encoded": warmup_image()})
    assert decoded.shape == (224, 224, 3) and len(np.unique(decoded)) > 100  # a gradient, not a flat image


def test_a_pool_serves_jpeg_bytes_with_custom_ops(
    tmp_path: Path, redis_url: str, model_name: str, producer: Producer, pools: list[Pool], decoding_path: Path
) -> None:
    # Measured first (measure_memory's default): the measuring session needs the library too.
    (tmp_path / "pool.toml").write_text(
        f'[[model]]\nname = "{model_name}"\npath = "{decoding_path}"\nthreads = 1\n'
        'custom_ops = "onnxruntime_extensions"\n[[model.workers]]\ncount = 1\n'
    )
    pool = Pool(tmp_path / "pool.toml", redis_url)
    pools.append(pool)
    producer.wait_for_workers(model_name, 1, timeout=120)
    image = jpegs()[1]
    np.testing.assert_allclose(
        producer.infer(model_name, {"encoded": image}, timeout=30)["logits"], direct(decoding_path, image),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    assert producer.workers(model_name)[0]["custom_ops"] == library_path("onnxruntime_extensions")
