"""Dynamic batching: which jobs may share one ``session.run``, and how their tensors are
joined along dim 0 and split back.

Jobs are batch-compatible when they carry the same input names with the same dtypes and the
same dims after the first. Order is kept: jobs are grouped in arrival order and each group's
rows are in arrival order, so a producer's jobs keep their order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import TypeVar

import numpy as np

from ortq.errors import ConfigurationError, OrtqError
from ortq.signature import ModelSignature

T = TypeVar("T")
Tensors = dict[str, np.ndarray]
BatchKey = tuple[tuple[str, str, tuple[int, ...]], ...]


class BatchSplitError(OrtqError):
    """A batched run returned outputs whose first dimension is not the batch's total rows."""


def check_batchable(signature: ModelSignature) -> None:
    """Raise ConfigurationError unless every input and output has a dynamic first dimension. A
    tensor of no declared shape is refused too: nothing says its first dimension is its rows (it
    may as well be a parameter vector, whose joined values would mix jobs), and a worker that ran
    such jobs one a run instead would silently ignore --max-batch."""
    for kind, specs in (("input", signature.inputs), ("output", signature.outputs)):
        for spec in specs:
            if spec.any_shape:
                raise ConfigurationError(
                    f"batching needs a dynamic first dimension, but the model declares no shape for {kind} "
                    f"{spec.describe()}; give it a shape whose first dimension is the batch (e.g. ['batch', ...]) "
                    "or run without --max-batch"
                )
            if not spec.shape:
                raise ConfigurationError(f"batching needs a first dimension, but {kind} {spec.describe()} is 0-d")
            first = spec.shape[0]
            if isinstance(first, int) and first >= 0:
                raise ConfigurationError(
                    f"batching needs a dynamic first dimension, but {kind} {spec.describe()} fixes it to {first}; "
                    "export the model with a dynamic batch axis or run without --max-batch"
                )


def batch_key(inputs: Tensors) -> BatchKey:
    if len(inputs) == 1:  # most models': nothing to sort
        for name, value in inputs.items():
            return ((name, value.dtype.str, value.shape[1:]),)
    return tuple(sorted((name, value.dtype.str, tuple(value.shape[1:])) for name, value in inputs.items()))


def group(items: Sequence[T], key: Callable[[T], BatchKey], max_rows: int, rows: Callable[[T], int]) -> list[list[T]]:
    """Compatible items together, in arrival order, at most ``max_rows`` rows a group (a single
    item with more rows than that is a group of its own)."""
    open_groups: dict[BatchKey, tuple[list[T], list[int]]] = {}  # the group, and its rows so far
    groups: list[list[T]] = []
    for item in items:
        k, n = key(item), rows(item)
        current = open_groups.get(k)
        if current is None or current[1][0] + n > max_rows:
            current = ([], [0])
            open_groups[k] = current
            groups.append(current[0])
        current[0].append(item)
        current[1][0] += n
    return groups


def concat(many: Sequence[Tensors]) -> Tensors:
    if len(many) == 1:
        return many[0]
    return {name: np.concatenate([inputs[name] for inputs in many], axis=0) for name in many[0]}


def split(outputs: Tensors, sizes: Sequence[int]) -> list[Tensors]:
    """Each job's rows of ``outputs``, as views (no copy). Jobs of as many rows each (a producer's
    jobs mostly are) get theirs by one reshape of each output to (jobs, rows, ...), whose rows numpy
    lists as views; others by slicing at their rows' offsets."""
    total = sum(sizes)
    for name, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != total:
            raise BatchSplitError(
                f"output {name!r} has shape {list(value.shape)} for a batch of {total} rows: "
                "its first dimension is not the batch"
            )
    n = len(sizes)
    per_job: list[Tensors] = [{} for _ in range(n)]
    if n and sizes.count(sizes[0]) == n:  # cutting dim 0 in two is a view, whatever the strides
        size = sizes[0]
        for name, value in outputs.items():
            for mine, part in zip(per_job, value.reshape(n, size, *value.shape[1:]), strict=True):
                mine[name] = part
        return per_job
    ends = list(accumulate(sizes))
    bounds = [slice(start, end) for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    for name, value in outputs.items():
        for mine, rows in zip(per_job, bounds, strict=True):
            mine[name] = value[rows]
    return per_job
