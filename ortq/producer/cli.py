"""The ``ortq infer`` command: one job from numpy files, or one job per file of a folder."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import click
import numpy as np

from ortq.cliopts import redis_url_option, shards_option
from ortq.errors import EXIT_JOB_FAILED, ConfigurationError, InferenceFailed, OrtqError, ResultTimeout
from ortq.producer import checks
from ortq.producer.bulk import cast_inputs, check_castable, infer_files, input_files, read_inputs, signature_for_cast
from ortq.producer.producer import InferenceJob, Producer
from ortq.settings import Settings

#: Seconds between two reads of a waited-for job's RQ status (one HGET each).
STATUS_POLL_SECONDS = 0.2


def _read_inputs(specs: tuple[str, ...]) -> dict[str, np.ndarray]:
    try:
        return read_inputs(specs)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--input") from exc


@click.command(
    epilog="""Examples:

\b
  ortq infer digits --input pixels=digit.npy
  ortq infer resnet --input image=cat.npy --output out.npz --timeout 10
  ortq infer detector --input inputs.npz                   # every array of the archive, by name
  ortq infer resnet --input image=cat64.npy --cast         # float64 data into a float32 model
  ortq infer resnet --input-dir images/ --output-dir out/  # bulk: one job per file
  ortq infer conv --input x=big.npy --shards conv=redis://redis-big:6379/0   # conv's queue on its own Redis

Exit status 0, 1 (Redis unreachable or --timeout passed), 2 (bad input or option) or 3 (the
worker failed the job; with --input-dir: any file failed).
"""
)
@click.argument("model_name")
@click.option(
    "--input",
    "input_specs",
    multiple=True,
    metavar="NAME=FILE.npy|FILE.npz",
    help="Inputs from numpy files (repeatable): NAME=FILE.npy is one named input; FILE.npz gives every array "
    "of the archive as the input of its name; NAME=FILE.npz the archive's array NAME (or its only one). "
    "Nothing is unpickled.",
)
@click.option(
    "--input-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Bulk mode: one job per .npy (the model's one input) or .npz (named inputs) file in this folder.",
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Bulk mode: write each file's outputs to OUTPUT_DIR/<name>.npz.",
)
@click.option("--input-name", default=None, help="Bulk mode: the input a .npy file holds (default: the only one).")
@click.option(
    "--cast",
    is_flag=True,
    help="Convert each input to the dtype of the model's published signature (float64 to float32, int64 to "
    "int32, ints to floats; never floats to ints, nor values that overflow).",
)
@click.option(
    "--output",
    "output_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the outputs to this .npz file and print only where (default: print a summary of each).",
)
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait for the result.")
@redis_url_option()
@shards_option()
def infer(
    model_name: str,
    input_specs: tuple[str, ...],
    input_dir: Path | None,
    output_dir: Path | None,
    input_name: str | None,
    cast: bool,
    output_path: Path | None,
    timeout: float,
    redis_url: str | None,
    shards: str | None,
) -> None:
    """Send one job to MODEL_NAME's queue and wait for its outputs (or, with --input-dir, one job
    per file, with a progress bar and a summary)."""
    if (input_dir is None) == (not input_specs):
        raise click.UsageError(
            "give --input NAME=FILE.npy or --input FILE.npz (one job) or --input-dir DIR (bulk), one of the two"
        )
    settings = Settings.from_env(redis_url=redis_url, redis_shards=shards)  # --shards, else $ORTQ_REDIS_SHARDS
    if input_dir is not None:
        _infer_folder(model_name, input_dir, output_dir, input_name, cast, timeout, settings)
        return
    inputs = _read_inputs(input_specs)
    with Producer(settings=settings) as producer:
        if cast:
            inputs = cast_inputs(inputs, signature_for_cast(producer, model_name))
        elif (signature := producer.signature(model_name)) is not None:
            check_castable(inputs, signature)
        outputs = _infer_showing_progress(producer, model_name, inputs, timeout)
    if output_path is not None:
        # The file holds the outputs: one line says where, rather than the arrays again.
        np.savez(output_path, **outputs)  # type: ignore[arg-type]
        click.echo(f"wrote {len(outputs)} output(s) to {output_path}")
        return
    for name, value in outputs.items():
        click.echo(f"{name}: {value.dtype}{list(value.shape)} {np.array2string(value, threshold=20)}")


def _infer_showing_progress(
    producer: Producer, model: str, inputs: Mapping[str, np.ndarray], timeout: float
) -> dict[str, np.ndarray]:
    """``producer.infer``, saying on stderr how the job goes while it waits: one line per change of
    its RQ status (queued, started; queued again if a dead worker's job was taken back), then done
    or failed. stdout stays the outputs'. The status is read on a thread of its own while this one
    waits for the reply as ``infer`` does; what it cannot read is left unsaid."""
    checks.wait_timeout(timeout)
    job = producer.submit(model, inputs)
    began = time.monotonic()
    _say(job, "queued", began)  # where submit put it
    answered = threading.Event()
    watcher = threading.Thread(target=_watch_status, args=(job, began, answered), daemon=True)
    watcher.start()
    try:
        outputs = job.result(timeout)
    except ResultTimeout as exc:
        _stop(watcher, answered)
        try:
            running = job.status() == "started"
        except OrtqError:
            running = False
        # As Producer.infer: no worker spends time on an answer nobody waits for. A job that was
        # running is stopped on its worker (it ran past the timeout: a worker serves the model).
        if job.cancel():
            _say(job, "was running: asked its worker to stop it" if running else "canceled, taken off the queue", began)
        if running:
            hint = "it was running when the timeout passed: raise --timeout"
        else:
            hint = f"is a worker serving {model!r}? see ortq info; or raise --timeout"
        raise ResultTimeout(f"{exc} ({hint})") from exc
    except InferenceFailed:
        _stop(watcher, answered)
        _say(job, "failed", began)  # the error's own line follows
        raise
    finally:
        _stop(watcher, answered)  # also on Ctrl-C or an unreachable Redis
    _say(job, "done", began)
    return outputs


def _watch_status(job: InferenceJob, began: float, answered: threading.Event) -> None:
    """Until ``answered``: the job's RQ status every STATUS_POLL_SECONDS, said when it changes.
    finished and failed are left to the waiting thread, which has the reply (it comes first)."""
    last = "queued"
    while not answered.wait(STATUS_POLL_SECONDS):
        try:
            status = job.status()
        except OrtqError:  # Redis away for a moment, the record gone: the wait says what matters
            continue
        if status != last and status not in ("finished", "failed") and not answered.is_set():
            last = status
            _say(job, status, began)


def _stop(watcher: threading.Thread, answered: threading.Event) -> None:
    answered.set()
    watcher.join()


def _say(job: InferenceJob, state: str, began: float) -> None:
    click.echo(f"job {job.id}: {state} ({time.monotonic() - began:.2f} s)", err=True)


def _infer_folder(
    model: str,
    folder: Path,
    output_dir: Path | None,
    input_name: str | None,
    cast: bool,
    timeout: float,
    settings: Settings,
) -> None:
    files = input_files(folder)
    with Producer(settings=settings) as producer:
        signature = signature_for_cast(producer, model) if cast else None
        with click.progressbar(length=len(files), label=model, file=sys.stderr) as bar:
            summary = infer_files(
                producer,
                model,
                files,
                output_dir,
                input_name=input_name,
                cast=signature,
                timeout=timeout,
                progress=bar.update,
            )
    click.echo(summary.describe())
    for name, reason in summary.failures[:20]:
        click.echo(f"  failed {name}: {reason}")
    if len(summary.failures) > 20:
        click.echo(f"  ... and {len(summary.failures) - 20} more")
    sys.exit(EXIT_JOB_FAILED if summary.failures else 0)
