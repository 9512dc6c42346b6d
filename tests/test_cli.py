"""The ``ortq`` command as a user runs it: infer, info, demo, and the README's two commands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import REPO, WorkerProcesses


def ortq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ortq", *args], check=False, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_infer_and_info(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    x = np.array([[1, 2, 3, 4]], dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out.npz"
    done = ortq(
        "infer", model_name, "--input", f"x={tmp_path / 'x.npy'}", "--output", str(out), "--redis-url", redis_url
    )
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(out)["y"], x * 2 + 1)

    table = ortq("info", "--redis-url", redis_url)
    assert table.returncode == 0, table.stderr
    assert f"model {model_name}" in table.stdout
    assert "x: float32[batch, 4]" in table.stdout
    assert re.search(
        rf"worker {re.escape(model_name)}\.\S+: idle, CPUExecutionProvider, host \S+ pid \d+, 1 ok", table.stdout
    )

    as_json = json.loads(ortq("info", "--json", "--redis-url", redis_url).stdout)
    [model] = [m for m in as_json["models"] if m["model"] == model_name]
    assert model["finished"] == 1 and model["queued"] == 0
    assert model["workers"][0]["provider"] == "CPUExecutionProvider"
    assert model["signature"]["outputs"] == [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]


def test_infer_reports_bad_input_clearly(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    np.save(tmp_path / "x.npy", np.zeros((1, 5), np.float32))
    done = ortq("infer", model_name, "--input", f"x={tmp_path / 'x.npy'}", "--redis-url", redis_url)
    assert done.returncode == 2
    assert "InvalidInput" in done.stderr and "size 5 on axis 1" in done.stderr
    assert "Traceback" not in done.stderr
    assert ortq("infer", model_name, "--input", "no-equals-sign").returncode == 2


def test_every_command_has_help_with_examples() -> None:
    for command in ("worker", "infer", "info", "demo"):
        done = ortq(command, "--help")
        assert done.returncode == 0 and "Examples:" in done.stdout, command


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- quick-start -->\s*```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert block, "README has no quick-start block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_quick_start_is_what_ci_runs_and_the_demo_works() -> None:
    demo, tests = readme_commands()
    assert tests in (REPO / ".ci" / "run").read_text()
    # Reuses the .venv that the test command created (or creates it), starts its own Redis.
    done = subprocess.run(demo, shell=True, check=False, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "outputs equal direct onnxruntime session.run: True" in done.stdout
    accuracy = float(re.search(r"accuracy: ([0-9.]+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert accuracy >= 0.95
