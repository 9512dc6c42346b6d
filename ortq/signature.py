"""A model's input/output signature: what a worker publishes and a producer checks against.

Dims are ints (fixed), strings (symbolic, e.g. ``"batch"``) or None (unknown); both of the
last two accept any size. A tensor the model declares with no shape at all takes any rank
(``any_shape``). The record is JSON so that ``redis-cli`` and services in other languages can
read it (docs/wire-format.md, section 5).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ortq.errors import InvalidInput, WireFormatError

Dim = int | str | None


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a model: its numpy dtype name and its shape."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]
    #: The model declares no shape at all for it: any rank and any dims fit (``shape`` is then
    #: ``()``, which readers that predate this flag take for a 0-d tensor, as workers used to).
    any_shape: bool = False

    def __post_init__(self) -> None:
        if self.any_shape and self.shape:
            raise ValueError(f"tensor {self.name!r}: a spec of any shape has no dims, got {list(self.shape)}")

    def to_json(self) -> dict[str, Any]:
        """Its record; ``any_shape`` only where set, so that the records of every other tensor (and
        the digest, :meth:`digest_json`) are what they were before the flag."""
        if self.any_shape:
            return {**self.digest_json(), "any_shape": True}
        return self.digest_json()

    def digest_json(self) -> dict[str, Any]:
        """The keys the signature's digest covers: those every reader knows. ``any_shape`` is left
        out, so that a producer that predates it, which drops the key and recomputes the digest
        from the rest, still agrees with the digest in the worker's answers."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TensorSpec:
        shape = tuple(d if isinstance(d, int | str) or d is None else str(d) for d in obj["shape"])
        any_shape = obj.get("any_shape", False)
        if not isinstance(any_shape, bool) or (any_shape and shape):
            raise WireFormatError(
                f"malformed model signature record: tensor {str(obj['name'])[:80]!r} has any_shape "
                f"{str(any_shape)[:20]!r} with shape {str(list(shape))[:80]} (any_shape is true or false; "
                "true goes with the shape [])"
            )
        return cls(name=str(obj["name"]), dtype=str(obj["dtype"]), shape=shape, any_shape=any_shape)

    def describe(self) -> str:
        if self.any_shape:
            return f"{self.name}: {self.dtype} (any shape)"
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"

    @cached_property
    def _expected(self) -> tuple[np.dtype[Any] | None, tuple[tuple[int, int], ...]]:
        """The numpy dtype (None if numpy has no such name) and the (axis, size) of the fixed dims:
        worked out once, as every job is checked against them."""
        try:
            dtype: np.dtype[Any] | None = np.dtype(self.dtype)
        except TypeError:
            dtype = None
        fixed = tuple((axis, d) for axis, d in enumerate(self.shape) if isinstance(d, int) and d >= 0)
        return dtype, fixed

    def check(self, array: np.ndarray) -> None:
        """Raise InvalidInput unless ``array`` has this spec's dtype, rank and fixed dims (of a spec
        of any shape: its dtype alone)."""
        dtype, fixed = self._expected
        if array.dtype != dtype and array.dtype.name != self.dtype:  # the name: either byte order
            raise InvalidInput(f"input {self.name!r} has dtype {array.dtype.name}, the model expects {self.dtype}")
        if self.any_shape:
            return
        if array.ndim != len(self.shape):
            raise InvalidInput(
                f"input {self.name!r} has rank {array.ndim} (shape {list(array.shape)}), "
                f"the model expects rank {len(self.shape)} ({self.describe()})"
            )
        shape = array.shape
        for axis, want in fixed:
            if shape[axis] != want:
                raise InvalidInput(
                    f"input {self.name!r} has size {shape[axis]} on axis {axis}, the model expects {want} "
                    f"({self.describe()})"
                )


@dataclass(frozen=True)
class ModelSignature:
    """Inputs and outputs of one model, in the model's order."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    #: The version of the model this is the signature of, as its published record says (None: a
    #: record from workers before model versions, or a signature read from a model file).
    version: str | None = field(default=None, compare=False)
    #: The largest request frame the worker that published the record reads (its max_frame_bytes;
    #: None: a record from workers before it was published, or a signature read from a model file).
    max_frame_bytes: int | None = field(default=None, compare=False)

    @cached_property
    def digest(self) -> str:
        """What names this signature in a response's ``served_by`` and a job's checks: the first 16
        hex digits of the SHA-256 of its JSON (inputs and outputs, compact, in the model's order;
        each tensor's :meth:`TensorSpec.digest_json`)."""
        covered = {
            "inputs": [spec.digest_json() for spec in self.inputs],
            "outputs": [spec.digest_json() for spec in self.outputs],
        }
        return hashlib.sha256(json.dumps(covered, separators=(",", ":")).encode()).hexdigest()[:16]

    @cached_property
    def _input_names(self) -> frozenset[str]:
        return frozenset(spec.name for spec in self.inputs)

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Raise InvalidInput unless ``inputs`` holds exactly the model's inputs, each fitting its spec."""
        expected = self._input_names
        if inputs.keys() != expected:
            missing = sorted(expected - inputs.keys())
            unknown = sorted(inputs.keys() - expected)
            parts = [f"missing {missing}"] if missing else []
            parts += [f"unknown {unknown}"] if unknown else []
            wanted = "; ".join(spec.describe() for spec in self.inputs)
            raise InvalidInput(f"inputs do not match the model: {', '.join(parts)} (the model takes {wanted})")
        for spec in self.inputs:
            spec.check(inputs[spec.name])

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [spec.to_json() for spec in self.inputs],
            "outputs": [spec.to_json() for spec in self.outputs],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ModelSignature:
        version = obj.get("version")
        if version is not None and not (isinstance(version, str) and 0 < len(version) <= 64):
            raise WireFormatError(f"malformed model signature record: version {str(version)[:80]!r}")
        limit = obj.get("max_frame_bytes")
        if limit is not None and not (type(limit) is int and limit > 0):
            raise WireFormatError(f"malformed model signature record: max_frame_bytes {str(limit)[:80]!r}")
        try:
            return cls(
                inputs=tuple(TensorSpec.from_json(spec) for spec in obj["inputs"]),
                outputs=tuple(TensorSpec.from_json(spec) for spec in obj["outputs"]),
                version=version,
                max_frame_bytes=limit,
            )
        except (KeyError, TypeError) as exc:
            raise WireFormatError(f"malformed model signature record: {exc!r}") from exc

    @classmethod
    def loads(cls, raw: bytes | str) -> ModelSignature:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise WireFormatError(f"model signature record is not JSON: {exc!r}"[:200]) from exc
        if not isinstance(obj, dict):
            raise WireFormatError("model signature record is not a JSON object")
        return cls.from_json(obj)
