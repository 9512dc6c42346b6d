"""The progress watchdog's decisions (ortq.worker.watchdog) and its options; a real hung run ends
its worker in tests/test_device_lost.py::test_a_hung_run_hands_its_jobs_on_and_the_pool_starts_a_fresh_worker."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ortq.errors import ConfigurationError
from ortq.worker.serve import WorkerConfig
from ortq.worker.watchdog import DEFAULT_STALL_SECONDS, Progress
from tests.conftest import REPO


def test_only_a_run_in_flight_past_the_limit_is_a_stall() -> None:
    progress = Progress(0.2)
    assert progress.stalled_for() is None  # no run: an idle worker is not stalled
    progress.run_began()
    assert progress.stalled_for() is None
    time.sleep(0.25)
    lasted = progress.stalled_for()
    assert lasted is not None and lasted > 0.2
    progress.run_ended()
    assert progress.stalled_for() is None
    never = Progress(0)
    never.run_began()
    time.sleep(0.01)
    assert never.stalled_for() is None  # 0: the watchdog is off


def test_the_options_are_checked(tiny_path: Path) -> None:
    assert WorkerConfig(tiny_path, "m").stall_seconds == DEFAULT_STALL_SECONDS == 600
    assert WorkerConfig(tiny_path, "m", job_timeout=30).job_timeout == 30
    assert WorkerConfig(tiny_path, "m", stall_seconds=0, job_timeout=9000).stall_seconds == 0
    for options, message in [
        ({"stall_seconds": -1}, "--stall-seconds must be >= 0"),
        ({"job_timeout": 0}, "--job-timeout must be a positive number"),
        ({"job_timeout": 600}, "--job-timeout \\(600 s\\) must be shorter than --stall-seconds \\(600 s\\)"),
    ]:
        with pytest.raises(ConfigurationError, match=message):
            WorkerConfig(tiny_path, "m", **options)  # type: ignore[arg-type]


def test_the_command_line_refuses_a_job_timeout_past_the_stall_limit_in_one_line(tiny_path: Path) -> None:
    command = [sys.executable, "-m", "ortq", "worker", "--model", str(tiny_path), "--name", "m",
               "--stall-seconds", "5", "--job-timeout", "10"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--job-timeout (10 s) must be shorter than --stall-seconds (5 s)" in done.stderr
