"""Train the ortq demo model and write it to ``ortq/demo/``.

Re-run from the repository root with::

    python scripts/train_demo_model.py

It trains a small multilayer perceptron (scikit-learn ``MLPClassifier``, one
hidden layer of 64 ReLU units, Adam, fixed ``random_state``) on scikit-learn's
bundled handwritten-digits dataset (1797 8x8 images, pixel values 0..16, no
download needed), exports it by hand to ONNX with ``onnx.helper`` and writes:

* ``ortq/demo/digits.onnx``: input ``pixels`` float32 ``[batch, 64]`` (raw
  0..16 pixel values; the graph divides by 16 itself), outputs
  ``probabilities`` float32 ``[batch, 10]`` (softmax) and ``label`` int64
  ``[batch]`` (argmax).
* ``ortq/demo/digits_holdout.npz``: the stratified 20 % held-out split
  (``pixels`` float32 ``[n, 64]`` raw values, ``labels`` int64 ``[n]``).

Before writing, it checks the graph with ``onnx.checker``, runs it with
onnxruntime's CPU provider on the held-out split and verifies that it predicts
the same labels (and probabilities) as scikit-learn, then prints the held-out
accuracy. Everything is seeded, so running it twice gives byte-identical files.

It needs scikit-learn, onnx, onnxruntime and numpy. These are development-only
dependencies: the ortq package itself only ships the two generated files and
never imports scikit-learn or onnx.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO_ROOT / "ortq" / "demo"
MODEL_PATH = DEMO_DIR / "digits.onnx"
HOLDOUT_PATH = DEMO_DIR / "digits_holdout.npz"

SEED = 0
TEST_SIZE = 0.2
HIDDEN_UNITS = 64
PIXEL_MAX = 16.0  # digits pixels are integers 0..16
OPSET = 17
IR_VERSION = 8  # accepted by onnxruntime >= 1.14
MIN_ACCURACY = 0.95
MAX_MISMATCHES = 1  # ONNX Runtime (float32) vs scikit-learn (float64) argmax disagreements allowed
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed timestamp so the .npz is byte-reproducible


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return raw float32 pixels and int64 labels: (x_train, x_test, y_train, y_test)."""
    digits = load_digits()
    pixels = digits.data.astype(np.float32)
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        pixels, labels, test_size=TEST_SIZE, random_state=SEED, stratify=labels
    )
    return x_train, x_test, y_train, y_test


def train(x_train: np.ndarray, y_train: np.ndarray) -> MLPClassifier:
    clf = MLPClassifier(
        hidden_layer_sizes=(HIDDEN_UNITS,),
        activation="relu",
        solver="adam",
        max_iter=1000,
        random_state=SEED,
    )
    clf.fit(x_train.astype(np.float64) / PIXEL_MAX, y_train)
    return clf


def to_onnx(clf: MLPClassifier, accuracy: float, n_train: int, n_test: int) -> onnx.ModelProto:
    """Export the fitted MLP by hand: Div(16) -> (Gemm -> Relu)* -> Gemm -> Softmax / ArgMax."""
    initializers = [numpy_helper.from_array(np.array(PIXEL_MAX, dtype=np.float32), "pixel_max")]
    nodes = [helper.make_node("Div", ["pixels", "pixel_max"], ["scaled"], name="scale")]
    current = "scaled"
    n_layers = len(clf.coefs_)
    for i, (weight, bias) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True)):
        w_name, b_name, out = f"W{i}", f"B{i}", ("logits" if i == n_layers - 1 else f"dense{i}")
        initializers.append(numpy_helper.from_array(weight.astype(np.float32), w_name))
        initializers.append(numpy_helper.from_array(bias.astype(np.float32), b_name))
        nodes.append(helper.make_node("Gemm", [current, w_name, b_name], [out], name=f"gemm{i}"))
        current = out
        if i < n_layers - 1:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i}"], name=f"relu{i}"))
            current = f"relu{i}"
    nodes.append(helper.make_node("Softmax", ["logits"], ["probabilities"], name="softmax", axis=-1))
    nodes.append(helper.make_node("ArgMax", ["logits"], ["label"], name="argmax", axis=1, keepdims=0))

    n_classes = len(clf.classes_)
    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        inputs=[helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 64])],
        outputs=[
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", n_classes]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
        ],
        initializer=initializers,
    )
    hidden = "x".join(str(h) for h in clf.hidden_layer_sizes)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="ortq scripts/train_demo_model.py",
        model_version=1,
        doc_string=(
            "ortq demo model: handwritten digit classifier (0-9) for 8x8 images. "
            f"A scikit-learn MLPClassifier (64 -> {hidden} ReLU -> {n_classes}, Adam, random_state={SEED}) "
            f"trained on {n_train} images of scikit-learn's bundled digits dataset; stratified held-out "
            f"split of {n_test} images (test_size={TEST_SIZE}, random_state={SEED}), held-out accuracy "
            f"{accuracy:.4f}. Input 'pixels': float32 [batch, 64], raw row-major pixel values 0..16 "
            "(the graph divides by 16). Outputs 'probabilities': float32 [batch, 10] softmax, "
            "'label': int64 [batch] argmax. Regenerate with: python scripts/train_demo_model.py"
        ),
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def verify(model: onnx.ModelProto, clf: MLPClassifier, x_test: np.ndarray, y_test: np.ndarray) -> tuple[float, int]:
    """Run the graph with ONNX Runtime (CPU), compare it to scikit-learn; return (accuracy, mismatches)."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    probabilities, label = session.run(["probabilities", "label"], {"pixels": x_test})
    scaled = x_test.astype(np.float64) / PIXEL_MAX
    sk_label = clf.predict(scaled)
    mismatches = int(np.sum(label != sk_label))
    if mismatches > MAX_MISMATCHES:
        raise SystemExit(f"ONNX Runtime and scikit-learn disagree on {mismatches} held-out samples")
    if not np.array_equal(label, probabilities.argmax(axis=1)):
        raise SystemExit("'label' is not the argmax of 'probabilities'")
    max_diff = float(np.max(np.abs(probabilities - clf.predict_proba(scaled))))
    if max_diff > 1e-4:
        raise SystemExit(f"probabilities differ from scikit-learn's by up to {max_diff:g}")
    accuracy = float(np.mean(label == y_test))
    if accuracy < MIN_ACCURACY:
        raise SystemExit(f"held-out accuracy {accuracy:.4f} is below {MIN_ACCURACY}")
    return accuracy, mismatches


def npz_bytes(pixels: np.ndarray, labels: np.ndarray) -> bytes:
    """np.savez_compressed output with the zip entries' timestamps pinned, so the bytes are reproducible."""
    raw = io.BytesIO()
    np.savez_compressed(raw, pixels=pixels, labels=labels)
    fixed = io.BytesIO()
    with zipfile.ZipFile(raw) as src, zipfile.ZipFile(fixed, "w") as dst:
        for entry in src.infolist():
            info = zipfile.ZipInfo(entry.filename, date_time=ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = entry.external_attr
            dst.writestr(info, src.read(entry))
    return fixed.getvalue()


def main() -> None:
    x_train, x_test, y_train, y_test = load_split()
    clf = train(x_train, y_train)
    sk_accuracy = float(clf.score(x_test.astype(np.float64) / PIXEL_MAX, y_test))
    model = to_onnx(clf, sk_accuracy, len(x_train), len(x_test))
    accuracy, mismatches = verify(model, clf, x_test, y_test)

    DEMO_DIR.mkdir(parents=True, exist_ok=True)
    MODEL_PATH.write_bytes(model.SerializeToString())
    HOLDOUT_PATH.write_bytes(npz_bytes(x_test, y_test))

    print(f"trained on {len(x_train)} images in {clf.n_iter_} epochs")
    print(f"held-out accuracy (onnxruntime): {accuracy:.4f} on {len(x_test)} images")
    print(f"held-out accuracy (scikit-learn): {sk_accuracy:.4f}; argmax mismatches: {mismatches}")
    for path in (MODEL_PATH, HOLDOUT_PATH):
        print(f"wrote {path.relative_to(REPO_ROOT)} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
