"""Which graph inputs and outputs of an ONNX model declare a shape, read from the model file itself.

ONNX Runtime's ``NodeArg.shape`` is ``[]`` both for a tensor declared 0-d and for one declared
with no shape at all (a ``TypeProto.Tensor`` without its ``shape`` field: the model takes any
rank), and workers do not depend on the ``onnx`` package. So this reads the few protobuf fields
that tell the two apart, straight from the file's bytes:

    ModelProto.graph (7) -> GraphProto.input (11) / output (12)
    -> ValueInfoProto.name (1), type (2) -> TypeProto.tensor_type (1)
    -> TypeProto.Tensor.shape (2) -> TensorShapeProto.dim (1, counted: the rank)

Every other field is skipped by its length, unread: the file is memory-mapped, so a model of
hundreds of MB (its weights are GraphProto.initializer, field 5) is never copied into Python
objects; only the names of the graph's inputs and outputs are. The walk is bounded by the
file's length (every field advances it) and by the fixed depth above; bytes it cannot read
raise :class:`MalformedModel`, which :func:`declared_shapes` turns into None and a log line.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ortq.worker")

# Protobuf wire types (https://protobuf.dev/programming-guides/encoding/); ONNX uses no groups (3, 4).
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_MAX_VARINT_BYTES = 10

# Field numbers, from onnx/onnx.proto3.
_MODEL_GRAPH = 7
_GRAPH_INPUT, _GRAPH_OUTPUT = 11, 12
_VALUE_INFO_NAME, _VALUE_INFO_TYPE = 1, 2
_TYPE_TENSOR = 1
_TENSOR_SHAPE = 2
_SHAPE_DIM = 1

#: What the walk reads from: a model file's mapping, or a model's bytes. Both index to an int and
#: slice to a copy (bytes), so nothing keeps the mapping exported once the walk ends.
ModelBytes = bytes | bytearray | mmap.mmap


class MalformedModel(ValueError):
    """The bytes are not a ModelProto this reader can walk (truncated, corrupt, or not ONNX)."""


@dataclass(frozen=True)
class DeclaredShapes:
    """The rank each tensor-typed graph input and output declares, by name; None where it declares
    no shape at all. Values of other types (sequences, maps) are left out."""

    inputs: dict[str, int | None]
    outputs: dict[str, int | None]

    def shapeless(self, kind: str) -> frozenset[str]:
        """The names of the inputs (``kind`` "input") or outputs ("output") with no declared shape."""
        ranks = self.inputs if kind == "input" else self.outputs
        return frozenset(name for name, rank in ranks.items() if rank is None)


def declared_shapes(model_path: Path) -> DeclaredShapes | None:
    """The model file's declared shapes; None (and a warning) where the file cannot be read as a
    ModelProto: callers then go by ONNX Runtime's view alone, as workers did before this reader."""
    try:
        with model_path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return declared_shapes_in(mapped)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped; MalformedModel
        log.warning(
            "could not read the declared shapes of %s's inputs and outputs (%s): an input with no declared "
            "shape is taken for a 0-d one, as ONNX Runtime reports it",
            model_path,
            exc,
        )
        return None


def declared_shapes_in(data: ModelBytes) -> DeclaredShapes:
    """The declared shapes in a serialized ModelProto; MalformedModel where it cannot be walked."""
    inputs: dict[str, int | None] = {}
    outputs: dict[str, int | None] = {}
    found_graph = False
    for field, wire_type, start, end in _fields(data, 0, len(data)):
        if field != _MODEL_GRAPH:
            continue
        _expect_message(wire_type, "ModelProto.graph")
        found_graph = True  # a message field met twice is merged: both occurrences' values count
        for graph_field, graph_wire_type, value_start, value_end in _fields(data, start, end):
            if graph_field in (_GRAPH_INPUT, _GRAPH_OUTPUT):
                _expect_message(graph_wire_type, "GraphProto.input/output")
                value = _value_info(data, value_start, value_end)
                if value is not None:
                    (inputs if graph_field == _GRAPH_INPUT else outputs)[value[0]] = value[1]
    if not found_graph:
        raise MalformedModel("no ModelProto.graph field")
    return DeclaredShapes(inputs, outputs)


def _value_info(data: ModelBytes, start: int, end: int) -> tuple[str, int | None] | None:
    """A ValueInfoProto's name and declared rank (None: no shape); None where it is no tensor."""
    name: str | None = None
    tensor: tuple[bool, int] | None = None  # (has a shape, rank) of its tensor type, once met
    for field, wire_type, field_start, field_end in _fields(data, start, end):
        if field == _VALUE_INFO_NAME:
            _expect_message(wire_type, "ValueInfoProto.name")
            try:
                name = data[field_start:field_end].decode("utf-8")  # a copy: the mapping stays unexported
            except UnicodeDecodeError as exc:
                raise MalformedModel(f"a value's name is not UTF-8 ({exc})") from exc
        elif field == _VALUE_INFO_TYPE:
            _expect_message(wire_type, "ValueInfoProto.type")
            for type_field, type_wire, tensor_start, tensor_end in _fields(data, field_start, field_end):
                if type_field == _TYPE_TENSOR:
                    _expect_message(type_wire, "TypeProto.tensor_type")
                    has_shape, rank = _tensor_shape(data, tensor_start, tensor_end)
                    if tensor is not None:  # met again: protobuf merges the two
                        has_shape, rank = has_shape or tensor[0], rank + tensor[1]
                    tensor = has_shape, rank
    if name is None or tensor is None:
        return None
    return name, tensor[1] if tensor[0] else None


def _tensor_shape(data: ModelBytes, start: int, end: int) -> tuple[bool, int]:
    """Whether a TypeProto.Tensor has its shape field (present even when empty: a declared 0-d
    tensor), and the number of dims it declares."""
    has_shape, rank = False, 0
    for field, wire_type, shape_start, shape_end in _fields(data, start, end):
        if field == _TENSOR_SHAPE:
            _expect_message(wire_type, "TypeProto.Tensor.shape")
            has_shape = True
            rank += sum(1 for dim in _fields(data, shape_start, shape_end) if dim[0] == _SHAPE_DIM)
    return has_shape, rank


def _expect_message(wire_type: int, what: str) -> None:
    if wire_type != _LENGTH_DELIMITED:
        raise MalformedModel(f"{what} has wire type {wire_type}, not a length-delimited one")


def _fields(data: ModelBytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """The fields of the message in ``data[pos:end]``: (field number, wire type, start, end) of
    each value, a length-delimited one's payload without its length."""
    while pos < end:
        key, pos = _varint(data, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise MalformedModel(f"field number 0 at byte {pos}")
        if wire_type == _VARINT:
            after = _varint(data, pos, end)[1]
        elif wire_type == _FIXED64:
            after = pos + 8
        elif wire_type == _FIXED32:
            after = pos + 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _varint(data, pos, end)
            after = pos + length
        else:
            raise MalformedModel(f"wire type {wire_type} at byte {pos} (ONNX has no groups)")
        if after > end:
            raise MalformedModel(f"field {field} at byte {pos} runs past the end of its message")
        yield field, wire_type, pos, after
        pos = after


def _varint(data: ModelBytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    value = 0
    for shift in range(0, 7 * _MAX_VARINT_BYTES, 7):
        if pos >= end:
            raise MalformedModel("a varint runs past the end of its message")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    raise MalformedModel(f"a varint longer than {_MAX_VARINT_BYTES} bytes at byte {pos}")
