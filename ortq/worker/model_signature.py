"""The signature a worker publishes for its model, and inputs built from a signature alone.

ONNX Runtime's view of a session's inputs and outputs gives each one's type and dims, but says
``[]`` both for a tensor declared 0-d and for one declared with no shape at all; the model file's
own declarations (ortq.worker.onnx_shapes) tell them apart, so that an input the model takes at
any rank is published as such (``TensorSpec.any_shape``) instead of as a scalar.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ortq.errors import ModelLoadError
from ortq.signature import Dim, ModelSignature, TensorSpec
from ortq.worker import encoded_images
from ortq.worker.onnx_shapes import DeclaredShapes

#: ONNX tensor element types ortq carries, as ONNX Runtime spells them, to numpy dtype names.
ORT_TENSOR_TYPES = {
    "tensor(bool)": "bool",
    "tensor(int8)": "int8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(uint8)": "uint8",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
}


def _tensor_spec(node: Any, what: str, shapeless: frozenset[str]) -> TensorSpec:
    dtype = ORT_TENSOR_TYPES.get(node.type)
    if dtype is None:
        raise ModelLoadError(
            f"{what} {node.name!r} has type {node.type}, which ortq cannot carry "
            f"(supported: {', '.join(sorted(ORT_TENSOR_TYPES))})"
        )
    if not node.shape and node.name in shapeless:  # both say so: ONNX Runtime's [] is no rank
        return TensorSpec(name=node.name, dtype=dtype, shape=(), any_shape=True)
    shape: tuple[Dim, ...] = tuple(d if isinstance(d, int | str) else None for d in node.shape)
    return TensorSpec(name=node.name, dtype=dtype, shape=shape)


def signature_of(session: Any, declared: DeclaredShapes | None = None) -> ModelSignature:
    """The session's inputs and outputs; with the model file's ``declared`` shapes
    (ortq.worker.onnx_shapes.declared_shapes), those it declares no shape for are of any shape.
    Without them (None: not read, or unreadable), such a tensor reads as 0-d, as ONNX Runtime says."""
    inputs = declared.shapeless("input") if declared is not None else frozenset()
    outputs = declared.shapeless("output") if declared is not None else frozenset()
    return ModelSignature(
        inputs=tuple(_tensor_spec(node, "input", inputs) for node in session.get_inputs()),
        outputs=tuple(_tensor_spec(node, "output", outputs) for node in session.get_outputs()),
    )


def encoded_inputs(signature: ModelSignature) -> tuple[str, ...]:
    """The inputs that carry an encoded image where a custom-op library is loaded: uint8 vectors of
    any length, and uint8 inputs of any shape (as a ``DecodeImage`` input declared with no shape
    is; treated alike, its bytes are checked before they can reach the decoder)."""
    return tuple(
        spec.name
        for spec in signature.inputs
        if encoded_images.takes_encoded_bytes(spec.dtype, spec.shape) or (spec.any_shape and spec.dtype == "uint8")
    )


def guessed_inputs(signature: ModelSignature, encoded: tuple[str, ...] = ()) -> list[str]:
    """The inputs :func:`warmup_inputs` has to guess a shape for: those of any shape (but encoded
    images, which get a real image)."""
    return [spec.name for spec in signature.inputs if spec.any_shape and spec.name not in encoded]


def warmup_inputs(signature: ModelSignature, seed: int = 0, encoded: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Inputs built from the signature alone: dynamic dims become 1, floats random, the rest zero;
    an input of any shape gets a 0-d tensor (a guess: the model may want another rank); the
    ``encoded`` inputs (LoadedModel.encoded_inputs) get a small PNG, which zeros would fail."""
    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray] = {}
    for spec in signature.inputs:
        if spec.name in encoded:
            inputs[spec.name] = encoded_images.warmup_image()
            continue
        shape = tuple(d if isinstance(d, int) and d >= 0 else 1 for d in spec.shape)
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            inputs[spec.name] = rng.standard_normal(shape).astype(dtype)
        else:
            inputs[spec.name] = np.zeros(shape, dtype=dtype)
    return inputs
