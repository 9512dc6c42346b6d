"""Bulk inference over a folder: each ``.npy`` (one input) or ``.npz`` (named inputs) file is one
job; outputs go to ``<stem>.npz`` files. Bad files and failed jobs are reported, not fatal."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortq.errors import ConfigurationError, OrtqError
from ortq.producer.producer import InferenceJob, Producer


@dataclass
class BulkSummary:
    """What a bulk run did: how many files, which failed and why, how long it took."""

    total: int = 0
    succeeded: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (file name, reason)
    seconds: float = 0.0

    def describe(self) -> str:
        rate = self.total / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{self.total} file(s): {self.succeeded} ok, {len(self.failures)} failed "
            f"in {self.seconds:.2f} s ({rate:.1f} jobs/s)"
        )


def input_files(folder: Path) -> list[Path]:
    """The folder's ``.npy``/``.npz`` files, sorted by name."""
    if not folder.is_dir():
        raise ConfigurationError(f"{folder} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix in (".npy", ".npz") and p.is_file())
    if not files:
        raise ConfigurationError(f"no .npy or .npz files in {folder}")
    return files


def load_inputs(path: Path, input_name: str | None) -> dict[str, np.ndarray]:
    """One job's inputs from a file (never unpickled: ``allow_pickle=False``)."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    if input_name is None:
        raise ConfigurationError(f"{path.name}: a .npy file holds one array; say which input it is (--input-name)")
    return {input_name: np.load(path, allow_pickle=False)}


def only_input_name(producer: Producer, model: str) -> str | None:
    """The model's input name when it has exactly one (from a worker's published signature)."""
    signature = producer.signature(model)
    if signature is not None and len(signature.inputs) == 1:
        return signature.inputs[0].name
    return None


def infer_files(
    producer: Producer,
    model: str,
    files: Sequence[Path],
    output_dir: Path | None = None,
    *,
    input_name: str | None = None,
    chunk: int = 64,
    timeout: float = 300.0,
    progress: Callable[[int], None] = lambda done: None,
) -> BulkSummary:
    """Run every file (see :func:`input_files`) through ``model``, ``chunk`` jobs in flight at a
    time; ``progress(n)`` is called as each chunk of ``n`` files is done."""
    name = input_name or only_input_name(producer, model)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
    summary = BulkSummary(total=len(files))
    started = time.perf_counter()
    for at in range(0, len(files), chunk):
        submitted: list[tuple[Path, InferenceJob]] = []
        for path in files[at : at + chunk]:
            try:
                submitted.append((path, producer.submit(model, load_inputs(path, name))))
            except (OrtqError, OSError, ValueError) as exc:
                summary.failures.append((path.name, f"{type(exc).__name__}: {exc}"))
        responses = producer.wait_responses([job.id for _, job in submitted], timeout) if submitted else []
        for (path, _), response in zip(submitted, responses, strict=True):
            if response.error is not None:
                summary.failures.append((path.name, f"{response.error.type}: {response.error.message}"))
                continue
            if output_dir is not None:
                np.savez(output_dir / (path.stem + ".npz"), **response.outputs)  # type: ignore[arg-type]
            summary.succeeded += 1
        progress(len(files[at : at + chunk]))
    summary.seconds = time.perf_counter() - started
    return summary
