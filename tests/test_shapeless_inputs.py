"""Inputs and outputs a model declares with no shape at all (any rank), which ONNX Runtime reports
as ``[]``, as it does a declared 0-d one (docs/wire-format.md, section 5, "A tensor of any shape").

The worker reads the model file's protobuf bytes to tell the two apart (ortq/worker/onnx_shapes.py):
that reader must agree with ``onnx.load`` on real model files and never crash on bad bytes, which
leave the worker where it was before the reader (the tensor reads as 0-d). A real worker must then
answer an input of no shape at any rank exactly as a direct ``session.run`` does, still refuse a
wrong dtype, and still refuse a rank-1 tensor for a declared 0-d input; producers that predate
``any_shape`` must keep working (the digest leaves the key out); batching is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import redis
from onnx import TensorProto, helper, numpy_helper

from ortq import keys
from ortq.errors import ConfigurationError, CorruptRecord, InferenceFailed, InvalidInput, WireFormatError
from ortq.info import collect, format_info
from ortq.pool.measure import SessionFootprint, measure_session
from ortq.producer import Producer
from ortq.producer.checks import parse_signature
from ortq.settings import Settings
from ortq.signature import ModelSignature, TensorSpec
from ortq.worker.batch import check_batchable
from ortq.worker.onnx_shapes import DeclaredShapes, MalformedModel, declared_shapes, declared_shapes_in
from ortq.worker.session import SessionPlan, load_model, warm_up
from tests import onnx_models
from tests.test_worker_inprocess import Serving, make_worker, serving_of

CPU = SessionPlan("cpu", None, 1, allow_cpu_fallback=False)


@pytest.fixture(scope="module")
def shapeless_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return onnx_models.shapeless_model(tmp_path_factory.mktemp("shapeless") / "shapeless.onnx")


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings.from_url(redis_url, heartbeat_seconds=0.5)


@pytest.fixture
def serving(shapeless_path: Path, model_name: str, settings: Settings) -> Iterator[Serving]:
    yield from serving_of(shapeless_path, model_name, settings)


def onnx_view(model: onnx.ModelProto) -> DeclaredShapes:
    """What ``onnx`` says the reader should find: each tensor-typed input's and output's rank, None
    where its tensor type has no shape field."""

    def ranks(values: object) -> dict[str, int | None]:
        return {
            v.name: len(v.type.tensor_type.shape.dim) if v.type.tensor_type.HasField("shape") else None
            for v in values  # type: ignore[attr-defined]
            if v.type.HasField("tensor_type")
        }

    return DeclaredShapes(ranks(model.graph.input), ranks(model.graph.output))


def mixed_model() -> onnx.ModelProto:
    """Values of every kind the reader meets, in memory (not run): no shape, 0-d, fixed, symbolic,
    unknown (a dim with neither value nor name) and 5-d dims, a sequence (no tensor: left out),
    a name that is not ASCII, and an initializer listed among the inputs (as IR < 4 does)."""
    unknown_dim = helper.make_tensor_value_info("unknown", TensorProto.FLOAT, [None, 3])
    values = [
        helper.make_tensor_value_info("none", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("scalar", TensorProto.INT64, []),
        helper.make_tensor_value_info("fixed", TensorProto.UINT8, [2, 3]),
        helper.make_tensor_value_info("symbolic", TensorProto.FLOAT16, ["batch", "seq"]),
        unknown_dim,
        helper.make_tensor_value_info("five_d", TensorProto.DOUBLE, [1, "a", 3, None, 5]),
        helper.make_tensor_sequence_value_info("sequence", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("größe", TensorProto.BOOL, ["n"]),
        helper.make_tensor_value_info("weights", TensorProto.FLOAT, [4]),
    ]
    outputs = [helper.make_tensor_value_info("out_none", TensorProto.FLOAT, None)]
    weights = numpy_helper.from_array(np.arange(4, dtype=np.float32), "weights")
    graph = helper.make_graph([], "mixed", values, outputs, initializer=[weights])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# ------------------------------------------------------------------ the reader


@pytest.mark.parametrize(
    "build",
    [
        onnx_models.shapeless_model,  # no shape, and 0-d
        onnx_models.shapeless_matmul_model,
        onnx_models.multi_dtype_model,  # a 0-d input among 1- and 2-d ones
        onnx_models.tiny_model,  # symbolic and fixed dims
        onnx_models.fixed_batch_model,
        onnx_models.conv_model,  # weights between the inputs and outputs
        onnx_models.slow_model,  # a Loop: a subgraph, whose own inputs are not the model's
    ],
)
def test_the_reader_agrees_with_onnx_load(build: Callable[[Path], Path], tmp_path: Path) -> None:
    path = build(tmp_path / "model.onnx")
    found = declared_shapes(path)
    assert found == onnx_view(onnx.load(path))
    assert found.inputs and found.outputs


def test_the_reader_on_every_kind_of_value_and_on_external_weights(tmp_path: Path) -> None:
    model = mixed_model()
    found = declared_shapes_in(model.SerializeToString())
    assert found == onnx_view(model)
    assert found.inputs == {"none": None, "scalar": 0, "fixed": 2, "symbolic": 2, "unknown": 2, "five_d": 5,
                            "größe": 1, "weights": 1}  # fmt: skip
    assert found.shapeless("input") == {"none"} and found.shapeless("output") == {"out_none"}
    # Weights in a file beside the model: the model file is read alone, as it is.
    conv = onnx.load(onnx_models.conv_model(tmp_path / "conv.onnx"))
    onnx.save(conv, tmp_path / "external.onnx", save_as_external_data=True, location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").stat().st_size > 90_000
    assert declared_shapes(tmp_path / "external.onnx") == onnx_view(conv)


def test_the_reader_maps_a_large_model_and_copies_none_of_its_weights(tmp_path: Path) -> None:
    """32 MB of weights between the graph's inputs and outputs: skipped by their length, read
    through a memory map, so the walk allocates next to nothing."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    big = numpy_helper.from_array(np.ones(8 * 1024 * 1024, np.float32), "big")
    graph = helper.make_graph([helper.make_node("Add", ["x", "big"], ["y"])], "big", [x], [y], initializer=[big])
    path = tmp_path / "big.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert path.stat().st_size > 32 * 1024 * 1024
    tracemalloc.start()
    try:
        found = declared_shapes(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == DeclaredShapes({"x": None}, {"y": 1})
    assert peak < 256 * 1024, peak


def test_bad_bytes_raise_malformed_model_and_nothing_else(shapeless_path: Path) -> None:
    data = shapeless_path.read_bytes()
    good = declared_shapes_in(data)

    def read(candidate: bytes) -> DeclaredShapes | None:
        try:
            return declared_shapes_in(candidate)
        except MalformedModel:
            return None

    # Every truncation: refused, or (cut between fields) what it still holds, never more.
    for cut in range(len(data)):
        found = read(data[:cut])
        assert found is None or (
            found.inputs.items() <= good.inputs.items() and found.outputs.items() <= good.outputs.items()
        )
    # Bytes changed at random: whatever comes out, only MalformedModel is raised.
    rng = np.random.default_rng(0)
    for _ in range(3000):
        mutated = bytearray(data)
        for position in rng.integers(0, len(data), int(rng.integers(1, 4))):
            mutated[position] = int(rng.integers(0, 256))
        read(bytes(mutated))
    for bad, why in [
        (b"", "no ModelProto.graph"),
        (b"\x08" + b"\xff" * 11, "longer than 10 bytes"),
        (b"\x3a\x05ab", "runs past"),  # graph (7, length-delimited) of 5 bytes, 2 there
        (b"\x38\x01", "wire type 0"),  # graph as a varint
        (b"\x0b\x0c" + data, "wire type 3"),  # a group: ONNX has none
        (b"\x3a\x02\x00\x00", "field number 0"),
        (b"\x3a\x06\x5a\x04\x0a\x02\xff\xfe", "not UTF-8"),  # graph { input { name: b"\xff\xfe" } }
    ]:
        with pytest.raises(MalformedModel, match=why):
            declared_shapes_in(bad)


def test_a_file_it_cannot_read_is_none_and_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ortq.worker")
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "cut.onnx").write_bytes(onnx_models.conv_model(tmp_path / "conv.onnx").read_bytes()[:5000])
    for name in ("empty.onnx", "cut.onnx", "missing.onnx"):
        assert declared_shapes(tmp_path / name) is None
        assert f"could not read the declared shapes of {tmp_path / name}" in caplog.text


def test_a_model_the_reader_cannot_walk_is_served_as_before(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An unknown field in a group (wire types 3 and 4), which ONNX Runtime's protobuf skips and
    the reader refuses: the worker loads the model and publishes its shapeless input as 0-d."""
    caplog.set_level(logging.WARNING, "ortq.worker")
    path = onnx_models.shapeless_model(tmp_path / "shapeless.onnx")
    # Field 100 as a group (start a3 06, end a4 06) holding field 1 = 5 (08 05).
    path.write_bytes(path.read_bytes() + bytes.fromhex("a306 0805 a406"))
    model = load_model(path, CPU)
    assert model.signature.inputs == (TensorSpec("x", "float32", ()), TensorSpec("s", "float32", ()))
    assert "wire type 3" in caplog.text and "taken for a 0-d one" in caplog.text
    assert model.run({"x": np.array(2, np.float32), "s": np.array(3, np.float32)})["y"] == 3


# ------------------------------------------------------------------ the signature


def test_a_spec_of_any_shape_checks_the_dtype_alone() -> None:
    spec = TensorSpec("x", "float32", (), any_shape=True)
    for shape in [(), (0,), (5,), (2, 3, 4), (1,) * 32]:
        spec.check(np.zeros(shape, np.float32))
    spec.check(np.zeros((2, 3), np.dtype(">f4")))  # either byte order, as for any spec
    with pytest.raises(InvalidInput, match="has dtype float64, the model expects float32"):
        spec.check(np.zeros((2, 3), np.float64))
    # A declared 0-d input is still 0-d.
    with pytest.raises(InvalidInput, match="has rank 1"):
        TensorSpec("s", "float32", ()).check(np.zeros(1, np.float32))
    assert spec.describe() == "x: float32 (any shape)"
    with pytest.raises(ValueError, match="no dims"):
        TensorSpec("x", "float32", (2,), any_shape=True)


def test_the_record_keeps_readers_before_any_shape_working() -> None:
    new = ModelSignature(
        (TensorSpec("x", "float32", (), any_shape=True), TensorSpec("s", "float32", ())),
        (TensorSpec("y", "float32", (), any_shape=True), TensorSpec("t", "float32", ("batch", 2))),
    )
    record = new.to_json()
    assert record["inputs"] == [
        {"name": "x", "dtype": "float32", "shape": [], "any_shape": True},
        {"name": "s", "dtype": "float32", "shape": []},  # no key where it is false: records as before
    ]
    assert ModelSignature.from_json(json.loads(json.dumps(record))) == new
    # A reader that predates the key ignores it: it sees 0-d tensors, and the same digest.
    old_view = {kind: [{k: v for k, v in spec.items() if k != "any_shape"} for spec in specs]
                for kind, specs in record.items()}  # fmt: skip
    old = ModelSignature.from_json(old_view)
    assert old.inputs[0] == TensorSpec("x", "float32", ())
    assert (
        old.digest
        == new.digest
        == hashlib.sha256(json.dumps(old_view, separators=(",", ":")).encode()).hexdigest()[:16]
    )
    # Malformed values are a corrupt record, not a guess.
    for bad in ["yes", 1, None]:
        with pytest.raises(WireFormatError, match="any_shape"):
            TensorSpec.from_json({"name": "x", "dtype": "float32", "shape": [], "any_shape": bad})
    broken = json.dumps({"protocol": keys.PROTOCOL, "inputs": [{"name": "x", "dtype": "float32", "shape": [2],
                         "any_shape": True}], "outputs": []})  # fmt: skip
    with pytest.raises(CorruptRecord, match="any_shape"):
        parse_signature(broken, "m")


def test_batching_refuses_tensors_of_no_shape(shapeless_path: Path, model_name: str, settings: Settings) -> None:
    """Nothing says such a tensor's first dimension is its rows: a clear refusal at start, as for a
    0-d or fixed first dimension, not jobs joined along a dimension that may not be the batch."""
    with pytest.raises(ConfigurationError, match=r"declares no shape for input x: float32 \(any shape\)"):
        make_worker(shapeless_path, model_name, settings, max_batch=4, rows_independent=True)
    outputs_only = ModelSignature(
        (TensorSpec("x", "float32", ("batch", 4)),), (TensorSpec("y", "float32", (), any_shape=True),)
    )
    with pytest.raises(ConfigurationError, match="no shape for output y"):
        check_batchable(outputs_only)


def test_a_pool_measures_such_a_model_as_its_worker_would_start(tmp_path: Path, shapeless_path: Path) -> None:
    """The pool's measuring process (ortq.pool.measure) follows the worker: no failed guessed run
    (a footprint without one), and batching refused in the worker's words."""
    matmul = onnx_models.shapeless_matmul_model(tmp_path / "matmul.onnx")
    assert isinstance(measure_session(matmul, 1, 1), SessionFootprint)
    refused = measure_session(shapeless_path, 1, 4)
    assert isinstance(refused, str) and "ConfigurationError" in refused and "declares no shape for input x" in refused


# ------------------------------------------------------------------ a real worker


def direct(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def test_a_worker_answers_an_input_of_no_shape_at_any_rank(
    serving: Serving, shapeless_path: Path, model_name: str, settings: Settings, connection: redis.Redis
) -> None:
    record = json.loads(connection.get(keys.signature_key(model_name)) or b"{}")
    assert [spec.get("any_shape", False) for spec in record["inputs"] + record["outputs"]] == [True, False, True, False]
    table = format_info(collect(connection))
    assert "x: float32 (any shape), s: float32[]" in table and "y: float32 (any shape), t: float32[]" in table
    rng = np.random.default_rng(0)
    s = np.array(-1.5, np.float32)
    with Producer(settings=settings) as producer:
        assert producer.signature(model_name) == ModelSignature.from_json(record)
        for shape in [(), (1,), (7,), (2, 3, 4), (0, 5)]:
            inputs = {"x": rng.standard_normal(shape).astype(np.float32), "s": s}
            outputs = producer.infer(model_name, inputs, timeout=30)
            expected = direct(shapeless_path, inputs)
            assert outputs.keys() == expected.keys()
            for name, want in expected.items():
                assert outputs[name].shape == want.shape and outputs[name].dtype == want.dtype, (shape, name)
                np.testing.assert_array_equal(outputs[name], want)
        # Refused before anything is sent: a wrong dtype, and a rank-1 tensor for the 0-d input.
        for wrong, why in [({"x": np.zeros((2, 3)), "s": s}, "dtype float64"),
                           ({"x": np.zeros(3, np.float32), "s": s[None]}, "'s' has rank 1")]:  # fmt: skip
            with pytest.raises(InvalidInput, match=why):
                producer.infer(model_name, wrong, timeout=30)
    # ... and by the worker, sent unchecked.
    with Producer(settings=settings, validate=False) as unchecked:
        for wrong, why in [({"x": np.zeros((2, 3)), "s": s}, "dtype float64"),
                           ({"x": np.zeros(3, np.float32), "s": s[None]}, "'s' has rank 1")]:  # fmt: skip
            with pytest.raises(InferenceFailed, match=why) as failed:
                unchecked.infer(model_name, wrong, timeout=30)
            assert failed.value.remote_type == "InvalidInput"


def test_a_producer_that_predates_any_shape_still_gets_answers(
    serving: Serving, model_name: str, settings: Settings, connection: redis.Redis
) -> None:
    """Such a producer ignores the key: it sees x as 0-d, sends scalars for it as before the
    worker knew better, and checks the answers' digest against one it computed without the key."""
    key = keys.signature_key(model_name)
    record = json.loads(connection.get(key) or b"{}")
    for spec in record["inputs"] + record["outputs"]:
        spec.pop("any_shape", None)
    connection.set(key, json.dumps(record), keepttl=True)
    with Producer(settings=settings) as old:
        signature = old.signature(model_name)
        assert signature is not None and signature.inputs[0] == TensorSpec("x", "float32", ())
        outputs = old.infer(model_name, {"x": np.array(2, np.float32), "s": np.array(0, np.float32)}, timeout=30)
        assert outputs["y"] == 3  # no VersionMismatch: the answer's digest is the one it computed
        with pytest.raises(InvalidInput, match="rank 2"):
            old.infer(model_name, {"x": np.zeros((2, 2), np.float32), "s": np.array(0, np.float32)}, timeout=30)


def test_a_model_that_refuses_the_guessed_warm_up_input_still_serves(
    tmp_path: Path, model_name: str, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """``x @ W`` cannot run on the 0-d ``x`` the warm-up guesses: the worker says so and starts."""
    caplog.set_level(logging.INFO, "ortq.worker")
    path = onnx_models.shapeless_matmul_model(tmp_path / "matmul.onnx")
    assert warm_up(load_model(path, CPU)) is None
    assert "no warm-up run: the model declares no shape for x" in caplog.text
    caplog.clear()
    running = Serving(make_worker(path, model_name, settings))
    assert "no warm-up run: the model declares no shape for x" in caplog.text
    assert f"model {path} loaded on CPUExecutionProvider, no warm-up run" in caplog.text
    try:
        with Producer(settings=settings) as producer:
            producer.wait_for_workers(model_name, 1, timeout=30)
            for shape in [(4,), (3, 4), (2, 5, 4)]:
                x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
                got = producer.infer(model_name, {"x": x}, timeout=30)["y"]
                np.testing.assert_array_equal(got, direct(path, {"x": x})["y"])
            # A shape the model cannot take fails that job alone, with ONNX Runtime's words.
            with pytest.raises(InferenceFailed):
                producer.infer(model_name, {"x": np.zeros((3, 5), np.float32)}, timeout=30)
            assert producer.infer(model_name, {"x": np.ones(4, np.float32)}, timeout=30)["y"].shape == (2,)
    finally:
        assert running.stop() == 0


def test_an_encoded_image_input_of_no_shape_is_checked_as_one(tmp_path: Path) -> None:
    """A ``DecodeImage`` input declared with no shape (docs/wire-format.md, 6.7): with a custom-op
    library its bytes are an image file's, checked before the decoder, which a rank other than 1
    does not reach either."""
    pytest.importorskip("onnxruntime_extensions", reason="the `images` extra (onnxruntime-extensions)")
    from ortq.worker.custom_ops import library_path
    from ortq.worker.encoded_images import warmup_image
    from tests.image_models import EXTENSIONS_DOMAIN, EXTENSIONS_VERSION

    path = onnx_models._save(
        tmp_path / "decoder.onnx",
        "decoder",
        nodes=[helper.make_node("DecodeImage", ["encoded"], ["decoded"], domain=EXTENSIONS_DOMAIN)],
        inputs=[helper.make_tensor_value_info("encoded", TensorProto.UINT8, None)],
        outputs=[helper.make_tensor_value_info("decoded", TensorProto.UINT8, ["height", "width", 3])],
        domains={EXTENSIONS_DOMAIN: EXTENSIONS_VERSION},
        check=False,
    )
    plan = SessionPlan("cpu", None, 1, allow_cpu_fallback=False, custom_ops=library_path("onnxruntime_extensions"))
    model = load_model(path, plan)
    assert model.signature.inputs == (TensorSpec("encoded", "uint8", (), any_shape=True),)
    assert model.encoded_inputs == ("encoded",)
    assert warm_up(model) is not None  # on the PNG, not on a guess
    png = warmup_image()
    assert model.run({"encoded": png})["decoded"].ndim == 3
    for bad, why in [(png.reshape(1, -1), r"a 1-D uint8 tensor, not uint8\[1, "),
                     (np.array(7, np.uint8), r"not uint8\[\]"),
                     (np.zeros(100, np.uint8), "neither a JPEG nor a PNG")]:  # fmt: skip
        with pytest.raises(InvalidInput, match=why):
            model.run({"encoded": bad})
