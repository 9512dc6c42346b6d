"""``ortq infer``'s input files, for one job or a folder of them.

A ``.npy`` file holds one array (one input); a ``.npz`` archive holds named arrays (inputs by
name). Files are told apart by their first bytes, never unpickled (``allow_pickle=False``), and
anything else is refused with a message that says what the file is. In bulk mode each file is
one job and its outputs go to ``<stem>.npz``; bad files and failed jobs are reported, not fatal.
"""

from __future__ import annotations

import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortq.errors import ConfigurationError, InvalidInput, OrtqError, WireFormatError
from ortq.producer.producer import InferenceJob, Producer
from ortq.signature import ModelSignature

#: The first bytes of a .npy file (numpy.save) and of a zip archive (numpy.savez; an empty one).
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")


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


def read_array_file(path: Path) -> np.ndarray | dict[str, np.ndarray]:
    """The array of a ``.npy`` file, or the named arrays of a ``.npz`` archive, whatever the file's
    suffix. Raises ConfigurationError for anything else (text, images, pickles, object arrays,
    damaged files), saying what it is; nothing is ever unpickled."""
    try:
        with open(path, "rb") as file:
            head = file.read(len(_NPY_MAGIC))
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not head.startswith((_NPY_MAGIC, *_ZIP_MAGICS)):
        raise ConfigurationError(
            f"{path} is neither a .npy array (numpy.save) nor a .npz archive of named arrays (numpy.savez); "
            "ortq infer reads only those: convert the data with numpy first"
        )
    try:
        if head.startswith(_NPY_MAGIC):
            array: np.ndarray = np.load(path, allow_pickle=False)
            return array
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
            raise ConfigurationError(
                f"{path} holds Python objects (a pickled object array), which ortq never loads: "
                "save numeric arrays instead"
            ) from exc
        raise ConfigurationError(f"{path} is a damaged .npy/.npz file: {exc}") from exc
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigurationError(f"{path} is a damaged .npy/.npz file: {exc}") from exc


def load_inputs(path: Path, input_name: str | None) -> dict[str, np.ndarray]:
    """One job's inputs from a file: a .npz archive's arrays by name, or a .npy file's array as
    ``input_name``."""
    content = read_array_file(path)
    if isinstance(content, dict):
        if not content:
            raise ConfigurationError(f"{path.name}: the .npz archive holds no arrays")
        return content
    if input_name is None:
        raise ConfigurationError(f"{path.name}: a .npy file holds one array; say which input it is (--input-name)")
    return {input_name: content}


def named_input(spec: str) -> dict[str, np.ndarray]:
    """The inputs one ``--input`` of ``ortq infer`` gives: ``NAME=FILE`` (a .npy file's array, or the
    array NAME of a .npz archive, or its only array) or ``FILE.npz`` (every array of it, by name)."""
    name, sep, path = spec.partition("=")
    if not sep:
        content = read_array_file(Path(spec))
        if not isinstance(content, dict):
            raise ConfigurationError(f"{spec} holds one array with no name: give it one, --input NAME={spec}")
        if not content:
            raise ConfigurationError(f"{spec}: the .npz archive holds no arrays")
        return content
    if not name or not path:
        raise ConfigurationError(f"expected NAME=FILE.npy or FILE.npz, got {spec!r}")
    content = read_array_file(Path(path))
    if not isinstance(content, dict):
        return {name: content}
    if name in content:
        return {name: content[name]}
    if len(content) == 1:
        return {name: next(iter(content.values()))}
    raise ConfigurationError(
        f"{path} holds {len(content)} arrays ({', '.join(sorted(content))}) and none is called {name!r}: "
        f"give --input {path} to send them all by their names, or --input NAME={path} for one of them"
    )


def read_inputs(specs: Sequence[str]) -> dict[str, np.ndarray]:
    """The inputs of every ``--input`` (see :func:`named_input`); a name given twice is refused."""
    inputs: dict[str, np.ndarray] = {}
    for spec in specs:
        found = named_input(spec)
        if twice := sorted(inputs.keys() & found.keys()):
            raise ConfigurationError(f"input {', '.join(twice)} given twice (again by {spec})")
        inputs.update(found)
    return inputs


def check_castable(inputs: Mapping[str, np.ndarray], signature: ModelSignature) -> None:
    """Name ``--cast`` where it would help: InvalidInput for an input whose dtype :func:`cast_inputs`
    could convert to the model's."""
    for spec in signature.inputs:
        array = inputs.get(spec.name)
        if array is not None and array.dtype.name != spec.dtype and np.can_cast(array.dtype, spec.dtype, "same_kind"):
            raise InvalidInput(
                f"input {spec.name!r} has dtype {array.dtype.name}, the model expects {spec.dtype}: "
                "pass --cast to convert it"
            )


def signature_for_cast(producer: Producer, model: str) -> ModelSignature:
    """The signature ``--cast`` converts to: the one the model's workers published."""
    signature = producer.signature(model)
    if signature is None:
        raise ConfigurationError(
            f"--cast needs the signature {model!r}'s workers publish, and none has: is a worker serving "
            f"{model!r}? (ortq info)"
        )
    return signature


def cast_inputs(inputs: Mapping[str, np.ndarray], signature: ModelSignature) -> dict[str, np.ndarray]:
    """``inputs`` with each array converted to the dtype the model's signature gives it (``--cast``).

    Only numpy's ``same_kind`` conversions are made (float64 to float32, int64 to int32, any integer
    or bool to a float); float to int or anything to bool would silently change values and raises
    InvalidInput, as does a value that overflows the target type. Inputs the model does not have
    are left as they are (the signature check says so).
    """
    wanted = {spec.name: np.dtype(spec.dtype) for spec in signature.inputs}
    cast: dict[str, np.ndarray] = {}
    for name, array in inputs.items():
        dtype = wanted.get(name)
        if dtype is None or array.dtype == dtype:
            cast[name] = array
            continue
        if not np.can_cast(array.dtype, dtype, casting="same_kind"):
            raise InvalidInput(
                f"input {name!r} is {array.dtype.name}, the model takes {dtype.name}: --cast converts only "
                f"within a kind or from a narrower one, not {array.dtype.name} to {dtype.name} (convert it yourself)"
            )
        with np.errstate(over="ignore"):
            converted = array.astype(dtype, casting="same_kind")
        if dtype.kind == "f" and np.isinf(converted).sum() > np.isinf(array).sum():
            raise InvalidInput(f"input {name!r} has values too large for {dtype.name}; --cast refuses to make them inf")
        if dtype.kind in "iu" and not np.array_equal(converted, array):
            raise InvalidInput(f"input {name!r} has values outside {dtype.name}'s range; --cast refuses to wrap them")
        cast[name] = converted
    return cast


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
    cast: ModelSignature | None = None,
    chunk: int = 64,
    timeout: float = 300.0,
    progress: Callable[[int], None] = lambda done: None,
) -> BulkSummary:
    """Run every file (see :func:`input_files`) through ``model``, ``chunk`` jobs in flight at a
    time; ``progress(n)`` is called as each chunk of ``n`` files is done. With ``cast``, each
    file's arrays are first converted to that signature's dtypes (:func:`cast_inputs`)."""
    name = input_name or only_input_name(producer, model)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
    summary = BulkSummary(total=len(files))
    started = time.perf_counter()
    for at in range(0, len(files), chunk):
        submitted: list[tuple[Path, InferenceJob]] = []
        for path in files[at : at + chunk]:
            # A file's own faults (unreadable, wrong inputs, too large) are reported and the rest go
            # on; anything else (an unknown model, Redis unavailable, a refused permission) is the
            # whole run's: raised once, not once per file.
            try:
                inputs = load_inputs(path, name)
                inputs = inputs if cast is None else cast_inputs(inputs, cast)
            except OrtqError as exc:
                summary.failures.append((path.name, f"{type(exc).__name__}: {exc}"))
                continue
            try:
                submitted.append((path, producer.submit(model, inputs)))
            except (InvalidInput, WireFormatError) as exc:
                summary.failures.append((path.name, f"{type(exc).__name__}: {exc}"))
        jobs = [job for _, job in submitted]
        responses = producer.results_of(jobs, timeout) if jobs else []
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
