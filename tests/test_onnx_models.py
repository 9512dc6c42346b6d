"""The test/bench model builders in tests/onnx_models.py and the shipped demo model load in
ONNX Runtime (CPU), expose the documented interface and compute the documented values."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from ortq.demo import HOLDOUT_PATH, MODEL_PATH
from tests import onnx_models

Interface = list[tuple[str, str, list[str | int]]]  # (name, ORT type string, shape)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _interface(args: list[ort.NodeArg]) -> Interface:
    return [(a.name, a.type, list(a.shape)) for a in args]


@pytest.mark.parametrize(
    ("builder", "inputs", "outputs"),
    [
        (
            onnx_models.tiny_model,
            [("x", "tensor(float)", ["batch", 4])],
            [("y", "tensor(float)", ["batch", 4])],
        ),
        (
            onnx_models.fixed_batch_model,
            [("x", "tensor(float)", [1, 4])],
            [("y", "tensor(float)", [1, 4])],
        ),
        (
            onnx_models.conv_model,
            [("image", "tensor(float)", ["batch", 3, 224, 224])],
            [("logits", "tensor(float)", ["batch", 10])],
        ),
        (
            onnx_models.multi_dtype_model,
            [
                ("f16", "tensor(float16)", ["n"]),
                ("i64", "tensor(int64)", ["n", 2]),
                ("u8", "tensor(uint8)", [3]),
                ("flag", "tensor(bool)", ["n"]),
                ("f64", "tensor(double)", []),
            ],
            [
                ("f16_out", "tensor(float16)", ["n"]),
                ("i64_out", "tensor(int64)", ["n", 2]),
                ("u8_out", "tensor(uint8)", [3]),
                ("flag_out", "tensor(bool)", ["n"]),
                ("f64_out", "tensor(double)", []),
            ],
        ),
        (
            onnx_models.slow_model,
            [("x", "tensor(float)", [1, 256])],
            [("y", "tensor(float)", [1, 256])],
        ),
        (
            onnx_models.image_model,
            [("image", "tensor(float)", ["batch", 3, 224, 224])],
            [("filtered", "tensor(float)", ["batch", 3, 224, 224])],
        ),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_builder_interface(
    tmp_path: Path, builder: Callable[[Path], Path], inputs: Interface, outputs: Interface
) -> None:
    path = builder(tmp_path / "sub" / "model.onnx")
    assert path == tmp_path / "sub" / "model.onnx"
    model = onnx.load(path)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    onnx.checker.check_model(model)
    session = _session(path)
    assert _interface(session.get_inputs()) == inputs
    assert _interface(session.get_outputs()) == outputs


def test_builders_are_deterministic(tmp_path: Path) -> None:
    for builder in (onnx_models.conv_model, onnx_models.slow_model, onnx_models.image_model):
        first, second = builder(tmp_path / "a.onnx"), builder(tmp_path / "b.onnx")
        assert first.read_bytes() == second.read_bytes()


@pytest.mark.parametrize("batch", [1, 5])
def test_tiny_model_values(tmp_path: Path, batch: int) -> None:
    session = _session(onnx_models.tiny_model(tmp_path / "tiny.onnx"))
    x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
    (y,) = session.run(["y"], {"x": x})
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x * np.float32(2) + np.float32(1))


def test_fixed_batch_model_values(tmp_path: Path) -> None:
    session = _session(onnx_models.fixed_batch_model(tmp_path / "fixed.onnx"))
    x = np.array([[0.0, 1.0, -2.5, 3.25]], dtype=np.float32)
    (y,) = session.run(["y"], {"x": x})
    np.testing.assert_array_equal(y, [[1.0, 3.0, -4.0, 7.5]])
    with pytest.raises(Exception, match="dimension"):
        session.run(["y"], {"x": np.zeros((2, 4), dtype=np.float32)})


def test_multi_dtype_model_passes_values_through(tmp_path: Path) -> None:
    session = _session(onnx_models.multi_dtype_model(tmp_path / "multi.onnx"))
    feeds: dict[str, np.ndarray] = {
        "f16": np.array([0.5, -1.25, 65504.0], dtype=np.float16),
        "i64": np.array([[1, -2], [2**62, -(2**63)], [0, 7]], dtype=np.int64),
        "u8": np.array([0, 128, 255], dtype=np.uint8),
        "flag": np.array([True, False, True]),
        "f64": np.array(np.pi, dtype=np.float64),
    }
    results: dict[str, np.ndarray] = dict(
        zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True)
    )
    assert set(results) == {f"{name}_out" for name in feeds}
    for name, value in feeds.items():
        out = results[f"{name}_out"]
        assert out.dtype == value.dtype
        assert out.shape == value.shape
        np.testing.assert_array_equal(out, value)


def test_conv_model_runs(tmp_path: Path) -> None:
    session = _session(onnx_models.conv_model(tmp_path / "conv.onnx"))
    image = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
    (logits,) = session.run(["logits"], {"image": image[:1]})
    assert logits.shape == (1, 10)
    assert logits.dtype == np.float32
    assert np.all(np.isfinite(logits))
    (batched,) = session.run(["logits"], {"image": image})
    assert batched.shape == (2, 10)
    np.testing.assert_allclose(batched[:1], logits, rtol=1e-4, atol=1e-5)


def test_image_model_matches_numpy(tmp_path: Path) -> None:
    path = onnx_models.image_model(tmp_path / "image.onnx")
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    image = np.random.default_rng(1).standard_normal((2, 3, 224, 224)).astype(np.float32)
    (filtered,) = _session(path).run(["filtered"], {"image": image})
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(image, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), (2, 3))
    want = np.einsum("bchwij,ocij->bohw", windows, weights["w"]) + weights["b"][:, None, None]
    np.testing.assert_allclose(filtered, want, rtol=1e-4, atol=1e-4)


def test_slow_model_matches_numpy(tmp_path: Path) -> None:
    loops = 3
    path = onnx_models.slow_model(tmp_path / "slow.onnx", loops)
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    assert int(weights["trip_count"]) == loops
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    state = np.tile(x, (256, 1))
    for _ in range(loops):
        state = np.tanh(state @ weights["w"])
    (y,) = _session(path).run(["y"], {"x": x})
    assert y.shape == (1, 256)
    np.testing.assert_allclose(y, state.mean(axis=0, keepdims=True), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="loops"):
        onnx_models.slow_model(tmp_path / "bad.onnx", 0)


def test_demo_model_interface() -> None:
    assert MODEL_PATH.stat().st_size <= 1_000_000
    model = onnx.load(MODEL_PATH)
    onnx.checker.check_model(model)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert "digits" in model.doc_string
    assert "train_demo_model.py" in model.doc_string
    session = _session(MODEL_PATH)
    assert _interface(session.get_inputs()) == [("pixels", "tensor(float)", ["batch", 64])]
    assert _interface(session.get_outputs()) == [
        ("probabilities", "tensor(float)", ["batch", 10]),
        ("label", "tensor(int64)", ["batch"]),
    ]


def test_demo_model_holdout_accuracy() -> None:
    with np.load(HOLDOUT_PATH) as holdout:
        assert sorted(holdout.files) == ["labels", "pixels"]
        pixels, labels = holdout["pixels"], holdout["labels"]
    assert pixels.dtype == np.float32
    assert labels.dtype == np.int64
    assert pixels.ndim == 2
    assert pixels.shape[1] == 64
    assert labels.shape == (pixels.shape[0],)
    assert pixels.min() >= 0
    assert pixels.max() <= 16
    assert set(labels.tolist()) == set(range(10))

    session = _session(MODEL_PATH)
    probabilities, label = session.run(["probabilities", "label"], {"pixels": pixels})
    assert probabilities.shape == (len(labels), 10)
    assert label.shape == labels.shape
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(label, probabilities.argmax(axis=1))
    assert float(np.mean(label == labels)) >= 0.95
    (single,) = session.run(["label"], {"pixels": pixels[:1]})
    assert single.tolist() == label[:1].tolist()
