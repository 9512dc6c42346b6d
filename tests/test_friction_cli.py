"""What a newcomer meets first on the command line: ``ortq --version``, usage errors said in one
line with the command whose --help helps, and ``ortq infer`` saying how its job goes while it
waits (stderr) without touching what it prints (stdout). Real Redis, real workers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import ortq as ortq_package
from tests import onnx_models
from tests.cli_support import Result, invoke
from tests.conftest import WorkerProcesses
from tests.test_cli import ortq


#: click 8.1 words an unknown option "No such option: --jsn", 8.2 and later "No such option '--jsn'"
#: (ortq passes click's words on): either is the line's start.
def _no_such_option(name: str) -> re.Pattern[str]:
    return re.compile(f"No such option(: {name}| '{name}')")


#: A bad use of each command, and the command whose --help the line points to.
MISUSES: list[tuple[list[str], str, str | re.Pattern[str]]] = [
    (["--bogus"], "ortq", _no_such_option("--bogus")),
    (["bogus"], "ortq", "No such command 'bogus'"),
    (["worker", "--name", "m"], "ortq worker", "Missing option '--model'"),
    (["worker", "--model", "m.onnx", "--name", "m", "--provider", "gpu"], "ortq worker",
     "Invalid value for '--provider': 'gpu' is not one of 'dml', 'cuda', 'cpu'"),
    (["worker", "--model", "m.onnx", "--name", "m", "--adapter", "0", "--device-id", "0"], "ortq worker",
     "give --adapter or --device-id, not both"),
    (["adapters", "--ep-name", "X"], "ortq adapters", "--ep-name needs --ep-library"),
    (["info", "--jsn"], "ortq info", _no_such_option("--jsn")),
    (["stop"], "ortq stop", "say which workers: --model, --worker and/or --host"),
    (["stop", "--model", "m", "--wait", "-1"], "ortq stop", "Invalid value for '--wait'"),
    (["demo", "--workers", "9"], "ortq demo", "Invalid value for '--workers'"),
    (["infer"], "ortq infer", "Missing argument 'MODEL_NAME'"),
    (["infer", "m"], "ortq infer", "give --input NAME=FILE.npy or --input FILE.npz (one job) or --input-dir DIR"),
    (["infer", "m", "--input", "no-equals-sign"], "ortq infer",
     "Invalid value for --input: cannot read no-equals-sign"),
    (["infer", "m", "--input-dir", "/nonexistent-dir"], "ortq infer",
     "Invalid value for '--input-dir': Directory '/nonexistent-dir' does not exist"),
    (["infer", "m", "--input", "x=a.npy", "--timeout", "soon"], "ortq infer",
     "Invalid value for '--timeout': 'soon' is not a valid float"),
    (["pool"], "ortq pool", "Missing option '--config'"),
    (["dashboard", "--port", "70000"], "ortq dashboard", "Invalid value for '--port': 70000 is not in the range"),
    (["dashboard", "--auth", "no-colon"], "ortq dashboard", "Invalid value for --auth: --auth / $ORTQ_DASHBOARD_AUTH"),
]  # fmt: skip


def test_version_prints_the_package_version() -> None:
    done = ortq("--version")  # python -m ortq itself: its exit status and all it prints
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"ortq {ortq_package.__version__}\n" and done.stderr == ""


@pytest.mark.rqcompat  # also under click 8.1, whose words differ (pass 2)
@pytest.mark.parametrize(("args", "command", "message"), MISUSES, ids=[" ".join(m[0]) for m in MISUSES])
def test_a_usage_error_is_one_line_and_status_2(args: list[str], command: str, message: str | re.Pattern[str]) -> None:
    done = invoke(*args)
    assert done.no_traceback(), done.stderr
    assert_one_usage_error_line(done, command, message)


def test_a_usage_error_from_python_m_ortq_is_one_line_and_status_2() -> None:
    """One of MISUSES from the interpreter itself (the rest run in this process): its exit status and output."""
    args, command, message = MISUSES[2]
    assert_one_usage_error_line(ortq(*args), command, message)


def assert_one_usage_error_line(
    done: subprocess.CompletedProcess[str] | Result, command: str, message: str | re.Pattern[str]
) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()  # click's own is four: usage, hint, blank, error
    assert line.startswith("ortq: UsageError: "), line
    said = line[len("ortq: UsageError: ") :]
    assert said.startswith(message) if isinstance(message, str) else message.match(said), line
    assert line.endswith(f" (see '{command} --help')"), line


def test_infer_says_how_its_job_goes_on_stderr_and_prints_only_outputs(
    workers: WorkerProcesses, redis_url: str, model_name: str, models_dir: Path, tmp_path: Path
) -> None:
    slow = onnx_models.timed_slow_model(models_dir / "slow-progress.onnx", 1.5)
    workers.serve(slow, model_name, redis_url)
    np.save(tmp_path / "x.npy", np.ones((1, 256), np.float32))
    done = invoke("infer", model_name, "--input", f"x={tmp_path / 'x.npy'}", "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    # The outputs alone: one output, printed as numpy prints it.
    assert done.stdout.startswith("y: float32[1, 256] [[") and done.stdout.count("y: ") == 1, done.stdout
    assert "job " not in done.stdout and done.stdout.endswith("]]\n"), done.stdout
    lines = done.stderr.splitlines()
    [job_id] = {line.split(":")[0].removeprefix("job ") for line in lines}
    states = [re.fullmatch(rf"job {job_id}: (\w+) \((\d+\.\d\d) s\)", line) for line in lines]
    assert all(states), lines
    assert [m.group(1) for m in states if m] == ["queued", "started", "done"], lines  # one line per change
    seconds = [float(m.group(2)) for m in states if m]
    assert seconds == sorted(seconds) and seconds[2] - seconds[1] >= 1.0, lines  # the run is what it waited for


def test_infer_of_a_job_the_worker_fails_ends_with_the_one_error_line(
    workers: WorkerProcesses, redis_url: str, model_name: str, models_dir: Path, tmp_path: Path
) -> None:
    gather = onnx_models.gather_model(models_dir / "progress-gather.onnx")
    workers.serve(gather, model_name, redis_url)
    np.save(tmp_path / "idx.npy", np.array([1, 7], np.int64))  # 7: Gather fails at run time
    failed = invoke("infer", model_name, "--input", f"idx={tmp_path / 'idx.npy'}", "--redis-url", redis_url)
    assert failed.returncode == 3 and failed.stdout == "", failed.stderr
    *progress, error = failed.stderr.splitlines()
    assert re.fullmatch(r"job \S+: queued \(\d+\.\d\d s\)", progress[0]), failed.stderr
    assert re.fullmatch(r"job \S+: failed \(\d+\.\d\d s\)", progress[-1]), failed.stderr
    assert error.startswith("ortq: InferenceFailed: job "), failed.stderr


def test_infer_that_times_out_takes_its_job_off_the_queue_and_says_so(
    redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path, workers: WorkerProcesses
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    workers.stop_all()  # its signature stays published: the job is enqueued, and nobody takes it
    np.save(tmp_path / "x.npy", np.ones((1, 4), np.float32))
    late = invoke(
        "infer", model_name, "--input", f"x={tmp_path / 'x.npy'}", "--timeout", "0.5", "--redis-url", redis_url
    )
    assert late.returncode == 1 and late.stdout == "", late.stderr
    queued, canceled, error = late.stderr.splitlines()
    assert re.fullmatch(r"job \S+: queued \(0\.\d\d s\)", queued), late.stderr
    assert re.fullmatch(r"job \S+: canceled, taken off the queue \(0\.\d\d s\)", canceled), late.stderr
    assert error.startswith("ortq: ResultTimeout: no result for job ") and "raise --timeout" in error


def test_infer_that_times_out_on_a_running_job_says_it_was_stopped_on_its_worker(
    redis_url: str, model_name: str, models_dir: Path, tmp_path: Path, workers: WorkerProcesses
) -> None:
    """The job ran past --timeout on a worker: the CLI says it asked that worker to stop it and
    hints at --timeout, not that the job was taken off the queue or that no worker may serve it."""
    slow = onnx_models.timed_slow_model(models_dir / "cli-slow-4s.onnx", 4.0)
    workers.serve(slow, model_name, redis_url)
    np.save(tmp_path / "x.npy", np.ones((1, 256), np.float32))
    args = ("infer", model_name, "--input", f"x={tmp_path / 'x.npy'}", "--redis-url", redis_url)
    late = invoke(*args, "--timeout", "1.5")
    assert late.returncode == 1 and late.stdout == "", late.stderr
    lines = late.stderr.splitlines()
    assert any(re.fullmatch(r"job \S+: started \(\d+\.\d\d s\)", line) for line in lines), late.stderr
    assert re.fullmatch(r"job \S+: was running: asked its worker to stop it \(\d+\.\d\d s\)", lines[-2]), late.stderr
    assert "it was running when the timeout passed: raise --timeout" in lines[-1], late.stderr
    assert "is a worker serving" not in late.stderr


def test_bulk_infer_keeps_its_progress_bar_and_no_job_lines(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"x{i}.npy", np.full((1, 4), i, np.float32))
    done = invoke("infer", model_name, "--input-dir", str(folder), "--output-dir", str(tmp_path / "out"),
                  "--redis-url", redis_url)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"3 file\(s\): 3 ok, 0 failed in \S+ s \(\S+ jobs/s\)\n", done.stdout), done.stdout
    assert "job " not in done.stderr and model_name in done.stderr  # click's bar, labelled with the model
