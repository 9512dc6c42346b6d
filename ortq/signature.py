"""A model's input/output signature: what a worker publishes and a producer checks against.

Dims are ints (fixed), strings (symbolic, e.g. ``"batch"``) or None (unknown); both of the
last two accept any size. The record is JSON so that ``redis-cli`` and services in other
languages can read it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
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

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TensorSpec:
        shape = tuple(d if isinstance(d, int | str) or d is None else str(d) for d in obj["shape"])
        return cls(name=str(obj["name"]), dtype=str(obj["dtype"]), shape=shape)

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"

    def check(self, array: np.ndarray) -> None:
        """Raise InvalidInput unless ``array`` has this spec's dtype, rank and fixed dims."""
        if array.dtype.name != self.dtype:
            raise InvalidInput(f"input {self.name!r} has dtype {array.dtype.name}, the model expects {self.dtype}")
        if array.ndim != len(self.shape):
            raise InvalidInput(
                f"input {self.name!r} has rank {array.ndim} (shape {list(array.shape)}), "
                f"the model expects rank {len(self.shape)} ({self.describe()})"
            )
        for axis, (got, want) in enumerate(zip(array.shape, self.shape, strict=True)):
            if isinstance(want, int) and want >= 0 and got != want:
                raise InvalidInput(
                    f"input {self.name!r} has size {got} on axis {axis}, the model expects {want} ({self.describe()})"
                )


@dataclass(frozen=True)
class ModelSignature:
    """Inputs and outputs of one model, in the model's order."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Raise InvalidInput unless ``inputs`` holds exactly the model's inputs, each fitting its spec."""
        expected = {spec.name for spec in self.inputs}
        missing = sorted(expected - inputs.keys())
        unknown = sorted(inputs.keys() - expected)
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if unknown:
                parts.append(f"unknown {unknown}")
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
        try:
            return cls(
                inputs=tuple(TensorSpec.from_json(spec) for spec in obj["inputs"]),
                outputs=tuple(TensorSpec.from_json(spec) for spec in obj["outputs"]),
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
