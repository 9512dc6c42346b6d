"""Builders for the small ONNX models that ortq's tests and benchmarks run.

Every builder takes the path to write to, builds its graph with ``onnx.helper`` (opset 17,
IR version 8, weights drawn from a seeded numpy generator so the files are deterministic),
checks it with ``onnx.checker`` and returns the path. Needs ``onnx`` (a dev dependency).

* :func:`tiny_model` -- ``y = 2x + 1``, dynamic batch; microseconds per run.
* :func:`conv_model` -- a 4-layer CNN on 224x224 RGB images; ~2.3-2.8 ms (p50) per single-image CPU run.
* :func:`fixed_batch_model` -- ``y = 2x + 1`` with a fully fixed ``[1, 4]`` input.
* :func:`multi_dtype_model` -- Identity pass-through of float16/int64/uint8/bool/float64 inputs.
* :func:`slow_model` -- a Loop of 256x256 MatMuls; ``loops`` sets how long one run takes
  (:func:`timed_slow_model`: loops measured to last a given time on this machine).
* :func:`hang_model` -- ``y = 2x + 1``, but a run with an input above :data:`HANG_ABOVE` never
  returns (a stand-in for a hung GPU driver).
* :func:`gather_model` -- ``y = table[idx]``; an out-of-range index fails the run itself.
* :func:`job_gather_model`, :func:`centered_model` -- ``x[idx]`` and ``x - mean(x, axis=0)``: models
  whose rows are not independent, which batching must not join.
* :func:`shapeless_model` -- ``y = x + 1`` with ``x`` declared with no shape at all (any rank),
  beside ``t = s`` with ``s`` declared 0-d; :func:`shapeless_matmul_model`: ``y = x @ W``, ``x``
  of no declared shape, which a 0-d ``x`` cannot run.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
SEED = 0

#: :func:`slow_model`'s default ``loops``: one CPU run takes roughly 0.5-1 s on a 2-core machine
#: (each loop iteration is one [256, 256] x [256, 256] MatMul + Tanh, ~0.3-0.4 ms).
SLOW_MODEL_LOOPS = 2000

# (out_channels, stride) of conv_model's 3x3 convolutions, each followed by Relu.
_CONV_LAYERS = ((16, 1), (32, 2), (32, 2), (32, 2))


def _save(
    path: Path,
    name: str,
    *,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: dict[str, np.ndarray] | None = None,
    domains: dict[str, int] | None = None,
    check: bool = True,
) -> Path:
    """Assemble a graph into an opset-17 / IR-8 model, check it, write it to ``path``; ``domains``:
    the versions of other operator domains it imports (custom ops: tests/image_models.py).
    ``check=False`` for a model with a graph input or output of no shape, which ``onnx.checker``
    refuses (it wants a shape on each) and ONNX Runtime loads: such models exist."""
    graph = helper.make_graph(
        nodes,
        name,
        inputs,
        outputs,
        initializer=[numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)]
        + [helper.make_opsetid(domain, version) for domain, version in (domains or {}).items()],
        producer_name="ortq tests/onnx_models.py",
        doc_string=f"ortq test model '{name}'",
    )
    model.ir_version = IR_VERSION
    if check:
        onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def _f32(value: float) -> np.ndarray:
    return np.array(value, dtype=np.float32)


def _affine(path: Path, name: str, batch: str | int, scale: float = 2.0) -> Path:
    """``y = x * scale + 1`` with input ``x`` float32 ``[batch, 4]``."""
    return _save(
        path,
        name,
        nodes=[helper.make_node("Mul", ["x", "two"], ["x2"]), helper.make_node("Add", ["x2", "one"], ["y"])],
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])],
        initializers={"two": _f32(scale), "one": _f32(1.0)},
    )


def retrained_tiny_model(path: Path, scale: float) -> Path:
    """:func:`tiny_model`'s signature with other weights, ``y = scale * x + 1``: a new version of it."""
    return _affine(path, "tiny", "batch", scale)


def tiny_model(path: Path) -> Path:
    """Input ``x`` float32 ``["batch", 4]`` -> output ``y`` float32 ``["batch", 4]``, ``y = 2x + 1``."""
    return _affine(path, "tiny", "batch")


def fixed_batch_model(path: Path) -> Path:
    """Like :func:`tiny_model` but with a fully fixed input shape ``[1, 4]`` (no dynamic dim)."""
    return _affine(path, "fixed_batch", 1)


def conv_model(path: Path) -> Path:
    """Input ``image`` float32 ``["batch", 3, 224, 224]`` -> output ``logits`` float32 ``["batch", 10]``.

    Four 3x3 convolutions (3->16->32->32->32 channels, strides 1, 2, 2, 2) with Relu, then
    GlobalAveragePool, Flatten and a Gemm to 10 classes. About 230 MFLOP per image: a direct
    onnxruntime CPU ``session.run`` on one image takes ~2.3-2.8 ms (p50) on a 2-core machine.
    """
    nodes, weights = conv_layers("image")
    return _save(
        path,
        "conv",
        nodes=nodes,
        inputs=[helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        outputs=[helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializers=weights,
    )


def conv_layers(first: str) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    """:func:`conv_model`'s nodes and weights from the float32 NCHW tensor ``first`` to ``logits``,
    for models that compute that tensor themselves (tests/image_models.py: from a JPEG's bytes)."""
    rng = np.random.default_rng(SEED)
    nodes: list[onnx.NodeProto] = []
    weights: dict[str, np.ndarray] = {}
    current, in_ch = first, 3
    for i, (out_ch, stride) in enumerate(_CONV_LAYERS):
        fan_in = in_ch * 9
        weights[f"conv{i}_w"] = (rng.standard_normal((out_ch, in_ch, 3, 3)) * np.sqrt(2 / fan_in)).astype(np.float32)
        weights[f"conv{i}_b"] = np.zeros(out_ch, dtype=np.float32)
        nodes.append(
            helper.make_node(
                "Conv",
                [current, f"conv{i}_w", f"conv{i}_b"],
                [f"conv{i}"],
                kernel_shape=[3, 3],
                pads=[1, 1, 1, 1],
                strides=[stride, stride],
            )
        )
        nodes.append(helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"]))
        current, in_ch = f"relu{i}", out_ch
    weights["fc_w"] = (rng.standard_normal((in_ch, 10)) / np.sqrt(in_ch)).astype(np.float32)
    weights["fc_b"] = np.zeros(10, dtype=np.float32)
    nodes += [
        helper.make_node("GlobalAveragePool", [current], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
    ]
    return nodes, weights


def image_model(path: Path) -> Path:
    """Input ``image`` float32 ``["batch", 3, 224, 224]`` -> output ``filtered`` of the same shape: one
    3x3 convolution (3 -> 3 channels, padded). Its answers are as large as its requests (602 KB a
    frame), for measuring large tensors both ways (bench/gpu/throughput.py's ``image``)."""
    rng = np.random.default_rng(SEED)
    weights = {
        "w": (rng.standard_normal((3, 3, 3, 3)) / np.sqrt(27)).astype(np.float32),
        "b": np.zeros(3, dtype=np.float32),
    }
    node = helper.make_node("Conv", ["image", "w", "b"], ["filtered"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    shape: list[str | int] = ["batch", 3, 224, 224]
    return _save(
        path,
        "image",
        nodes=[node],
        inputs=[helper.make_tensor_value_info("image", TensorProto.FLOAT, shape)],
        outputs=[helper.make_tensor_value_info("filtered", TensorProto.FLOAT, shape)],
        initializers=weights,
    )


#: multi_dtype_model's inputs: name -> (ONNX element type, shape). Output names add ``_out``.
MULTI_DTYPE_INPUTS: dict[str, tuple[int, list[str | int]]] = {
    "f16": (TensorProto.FLOAT16, ["n"]),
    "i64": (TensorProto.INT64, ["n", 2]),
    "u8": (TensorProto.UINT8, [3]),
    "flag": (TensorProto.BOOL, ["n"]),
    "f64": (TensorProto.DOUBLE, []),
}


def multi_dtype_model(path: Path) -> Path:
    """Inputs ``f16`` float16 ``["n"]``, ``i64`` int64 ``["n", 2]``, ``u8`` uint8 ``[3]``,
    ``flag`` bool ``["n"]``, ``f64`` float64 ``[]`` (0-d), each copied by Identity to ``<name>_out``."""
    specs = MULTI_DTYPE_INPUTS.items()
    return _save(
        path,
        "multi_dtype",
        nodes=[helper.make_node("Identity", [name], [f"{name}_out"]) for name, _ in specs],
        inputs=[helper.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in specs],
        outputs=[helper.make_tensor_value_info(f"{name}_out", dtype, shape) for name, (dtype, shape) in specs],
    )


def slow_model(path: Path, loops: int = SLOW_MODEL_LOOPS) -> Path:
    """Input ``x`` float32 ``[1, 256]`` -> output ``y`` float32 ``[1, 256]``, deliberately slow.

    ``x`` is tiled to a ``[256, 256]`` state, then a Loop runs ``loops`` times
    ``state = Tanh(state @ W)`` (W: 256x256, ~34 MFLOP per iteration) and ``y`` is the mean of
    the final state's rows. Run time grows linearly with ``loops``: ~0.3-0.4 ms per iteration on
    a 2-core CPU, so the default :data:`SLOW_MODEL_LOOPS` (2000) takes roughly 0.6-0.8 s.
    """
    if loops < 1:
        raise ValueError(f"loops must be >= 1, got {loops}")
    rng = np.random.default_rng(SEED)
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["state_in", "w"], ["product"]),
            helper.make_node("Tanh", ["product"], ["state_out"]),
        ],
        "slow_body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("state_in", TensorProto.FLOAT, [256, 256]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [256, 256]),
        ],
    )
    return _save(
        path,
        "slow",
        nodes=[
            helper.make_node("Tile", ["x", "repeats"], ["state0"]),
            helper.make_node("Loop", ["trip_count", "", "state0"], ["state"], body=body),
            helper.make_node("ReduceMean", ["state"], ["y"], axes=[0], keepdims=1),
        ],
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])],
        initializers={
            "w": (rng.standard_normal((256, 256)) / 16).astype(np.float32),
            "repeats": np.array([256, 1], dtype=np.int64),
            "trip_count": np.array(loops, dtype=np.int64),
        },
    )


#: Steps of :func:`hang_model`'s endless Loop: at a microsecond or more a step, weeks.
HANG_STEPS = 10**12
#: :func:`hang_model` hangs on inputs with an element above this (warm-up and canary inputs are
#: standard normal: they never do).
HANG_ABOVE = 1000.0


def hang_model(path: Path) -> Path:
    """Input ``x`` float32 ``[batch, 4]`` -> ``y = 2x + 1``, except that when any element of ``x``
    is above :data:`HANG_ABOVE` the run enters a Loop of :data:`HANG_STEPS` steps that add zero: it never returns,
    and no timeout is set on it, as a GPU driver that hangs inside ``Run``."""
    zero, two, one = (helper.make_node("Constant", [], [n], value=numpy_helper.from_array(_f32(v), n))
                      for n, v in (("zero", 0.0), ("two", 2.0), ("one", 1.0)))  # fmt: skip
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            zero,
            helper.make_node("Add", ["s_in", "zero"], ["s_out"]),
        ],
        "hang_body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_in", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, None),
        ],
    )
    steps = helper.make_node(
        "Constant", [], ["steps"], value=numpy_helper.from_array(np.array(HANG_STEPS, np.int64), "steps")
    )
    hang = helper.make_graph(
        [steps, helper.make_node("Loop", ["steps", "", "x"], ["forever"], body=body)],
        "hang",
        [],
        [helper.make_tensor_value_info("forever", TensorProto.FLOAT, None)],
    )
    affine = helper.make_graph(
        [two, one, helper.make_node("Mul", ["x", "two"], ["x2"]), helper.make_node("Add", ["x2", "one"], ["plus"])],
        "affine",
        [],
        [helper.make_tensor_value_info("plus", TensorProto.FLOAT, None)],
    )
    return _save(
        path,
        "hang",
        nodes=[
            helper.make_node("ReduceMax", ["x"], ["largest"], keepdims=0),
            helper.make_node("Greater", ["largest", "limit"], ["positive"]),
            helper.make_node("If", ["positive"], ["y"], then_branch=hang, else_branch=affine),
        ],
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializers={"limit": _f32(HANG_ABOVE)},
    )


def gather_model(path: Path) -> Path:
    """``y = table[idx]`` over a 4-entry float table: an index outside [-4, 3] makes the *run* fail
    (ONNX Runtime checks Gather's indices at run time), which the device-loss tests use as a
    real ``session.run`` error of a known text."""
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    table = np.array([10.0, 20.0, 30.0, 40.0], np.float32)
    return _save(
        path,
        "gather",
        nodes=[helper.make_node("Gather", ["table", "idx"], ["y"], axis=0)],
        inputs=[idx],
        outputs=[y],
        initializers={"table": table},
    )


def job_gather_model(path: Path) -> Path:
    """``y = x[idx]``, both from the job: rows are NOT independent. Batched, one job's indices
    would point at the rows of the jobs before it (docs/pool.md, "Batching")."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    return _save(path, "job_gather", nodes=[helper.make_node("Gather", ["x", "idx"], ["y"], axis=0)], inputs=[x, idx],
                 outputs=[y])  # fmt: skip


def centered_model(path: Path) -> Path:
    """``y = x - mean(x, axis=0)``: rows are NOT independent. Batched, each job's outputs would
    depend on every job that shared its run (docs/pool.md, "Batching")."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),
        helper.make_node("Sub", ["x", "mean"], ["y"]),
    ]
    return _save(path, "centered", nodes=nodes, inputs=[x], outputs=[y])


def shapeless_model(path: Path) -> Path:
    """Input ``x`` float32 with no shape at all (its ValueInfoProto's tensor type has no ``shape``
    field: any rank) and ``s`` float32 ``[]`` (0-d), which ONNX Runtime both reports as ``[]``;
    outputs ``y = x + 1`` (no shape either) and ``t = s`` (0-d)."""
    return _save(
        path,
        "shapeless",
        nodes=[helper.make_node("Add", ["x", "one"], ["y"]), helper.make_node("Identity", ["s"], ["t"])],
        inputs=[
            helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
        ],
        outputs=[
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, []),
        ],
        initializers={"one": _f32(1.0)},
        check=False,
    )


def shapeless_matmul_model(path: Path) -> Path:
    """``y = x @ W`` (``W`` float32 ``[4, 2]``), ``x`` float32 of no declared shape: it runs on
    ``[..., 4]`` tensors, not on the 0-d one a worker's warm-up guesses for it."""
    weights = np.random.default_rng(SEED).standard_normal((4, 2)).astype(np.float32)
    return _save(
        path,
        "shapeless_matmul",
        nodes=[helper.make_node("MatMul", ["x", "W"], ["y"])],
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializers={"W": weights},
        check=False,
    )


def timed_slow_model(path: Path, seconds: float) -> Path:
    """:func:`slow_model` with as many loops as make one single-threaded CPU run last about
    ``seconds`` on this machine (measured on a short model first), so that tests relying on a run
    outlasting something hold on fast and slow machines alike; a loaded machine only lengthens it.
    The probe's runs are timed in CPU time of the thread that runs them (ONNX Runtime runs a
    single-threaded session on the caller's thread): wall time, taken while other processes share
    the CPU (tests in parallel), would count their time too and make the model too short."""
    import onnxruntime as ort  # the test side has it; model builders do not otherwise need it

    probe = slow_model(path.with_name(path.stem + "-probe.onnx"), SLOW_MODEL_LOOPS // 4)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(probe), options, providers=["CPUExecutionProvider"])
    x = {"x": np.ones((1, 256), np.float32)}
    session.run(None, x)
    took = []
    for _ in range(2):
        started = time.thread_time()
        session.run(None, x)
        took.append(time.thread_time() - started)
    per_loop = min(took) / (SLOW_MODEL_LOOPS // 4)
    return slow_model(path, max(1, round(seconds / per_loop)))
