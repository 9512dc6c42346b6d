"""bench/redis_instructions.py counts a real drain under callgrind (docs/performance.md's
instruction table comes from it): it runs, every job is answered, and its parts are found."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")


def test_a_drain_is_counted_in_instructions_with_its_parts() -> None:
    command = [sys.executable, "-m", "bench.redis_instructions", "--jobs", "96", "--max-batch", "32"]
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = r"^([0-9]+) instructions a job in redis-server .* ([0-9.]+) calls to Redis a job"
    total = re.search(line, done.stdout, re.M)
    assert total, done.stdout
    # A digits job is several calls a job (start's and finish's), each thousands of instructions.
    assert int(total.group(1)) > 10_000 and float(total.group(2)) > 3, done.stdout
    parts = dict(re.findall(r"^\s+(\S.*?)\s{2,}([0-9]+) \(", done.stdout, re.M))
    assert {"the scripts, in all", "XADD", "HMGET"} <= parts.keys(), done.stdout
    assert int(parts["the scripts, in all"]) <= int(total.group(1))
