"""The ``ortq`` command as a user runs it: infer, info, demo, and the README's two commands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortq.producer import Producer
from ortq.worker.serve import file_version
from tests.cli_support import invoke
from tests.conftest import REPO, WorkerProcesses

pytestmark = pytest.mark.rqcompat  # also in the second pass: the oldest click allowed


def ortq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m ortq ARGS`` in a process of its own (most commands run in-process: tests/cli_support.py)."""
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
    done = invoke(
        "infer", model_name, "--input", f"x={tmp_path / 'x.npy'}", "--output", str(out), "--redis-url", redis_url
    )
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(out)["y"], x * 2 + 1)
    assert done.stdout == f"wrote 1 output(s) to {out}\n"  # where it went, not the outputs again

    table = invoke("info", "--redis-url", redis_url)
    assert table.returncode == 0, table.stderr
    name = re.escape(model_name)
    version = re.escape(file_version(tiny_path))  # a worker started with no --model-version: its file's digest
    # One row per model (version, queued, parked, running, finished, failed, workers, signature), one per worker.
    assert re.search(
        rf"^{name}\s+{version}\s+0\s+0\s+0\s+1\s+0\s+1\s+x: float32\[batch, 4\]\s+y: float32\[batch, 4\]$",
        table.stdout,
        re.M,
    )
    assert re.search(
        rf"^{name}\.\S+\s+{name}\s+{version}\s+idle\s+CPUExecutionProvider\s+cpu\s+\S+\s+\d+\s+1\s+0\s+\d+\.\d s ago$",
        table.stdout,
        re.M,
    )

    as_json = json.loads(invoke("info", "--json", "--redis-url", redis_url).stdout)
    [model] = [m for m in as_json["models"] if m["model"] == model_name]
    assert model["finished"] == 1 and model["queued"] == 0
    assert model["workers"][0]["provider"] == "CPUExecutionProvider"
    assert model["workers"][0]["state"] == "idle" and 0 <= model["workers"][0]["heartbeat_age"] < 15
    assert model["signature"]["outputs"] == [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]
    assert model["signature"]["version"] == model["workers"][0]["version"] == file_version(tiny_path)


def test_infer_reports_bad_input_clearly(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    np.save(tmp_path / "x.npy", np.zeros((1, 5), np.float32))
    done = invoke("infer", model_name, "--input", f"x={tmp_path / 'x.npy'}", "--redis-url", redis_url)
    assert done.returncode == 2
    assert "InvalidInput" in done.stderr and "size 5 on axis 1" in done.stderr
    assert "Traceback" not in done.stderr and done.no_traceback()
    assert invoke("infer", model_name, "--input", "no-equals-sign").returncode == 2


def test_bulk_infer_over_a_folder(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    folder, out = tmp_path / "in", tmp_path / "out"
    folder.mkdir()
    rng = np.random.default_rng(3)
    arrays = {f"img{i:02d}": rng.standard_normal((i % 3 + 1, 4)).astype(np.float32) for i in range(6)}
    for stem, array in arrays.items():
        np.save(folder / f"{stem}.npy", array)
    np.savez(folder / "named.npz", x=arrays["img00"])
    np.save(folder / "wrong.npy", np.zeros((1, 5), np.float32))
    (folder / "notes.txt").write_text("not an input")
    done = invoke("infer", model_name, "--input-dir", str(folder), "--output-dir", str(out), "--redis-url", redis_url)
    assert done.returncode == 3, done.stderr  # one file failed
    assert "8 file(s): 7 ok, 1 failed" in done.stdout
    assert re.search(r"failed wrong\.npy: InvalidInput: .*size 5 on axis 1", done.stdout)
    for stem, array in arrays.items():
        np.testing.assert_array_equal(np.load(out / f"{stem}.npz")["y"], array * 2 + 1)
    np.testing.assert_array_equal(np.load(out / "named.npz")["y"], arrays["img00"] * 2 + 1)
    assert not (out / "wrong.npz").exists()
    assert invoke("infer", model_name, "--redis-url", redis_url).returncode == 2  # neither --input nor --input-dir
    # A model nobody serves is the whole run's error: said once, exit 2.
    mistyped = invoke("infer", model_name + "z", "--input-dir", str(folder), "--output-dir", str(tmp_path / "none"),
                      "--redis-url", redis_url)  # fmt: skip
    assert mistyped.returncode == 2, mistyped.stdout + mistyped.stderr
    assert mistyped.stderr.count("UnknownModel") == 1


def test_stop_asks_the_chosen_workers_to_stop(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, producer: Producer
) -> None:
    workers.serve(tiny_path, model_name, redis_url, 2)
    other = model_name + "-other"
    workers.serve(tiny_path, other, redis_url, 1)
    done = invoke("stop", "--model", model_name, "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": stopped") == 2
    assert [p.wait(30) for p, _ in workers.processes[:2]] == [0, 0]
    assert producer.workers(model_name) == []
    assert len(producer.workers(other)) == 1 and workers.processes[2][0].poll() is None
    assert invoke("stop", "--model", model_name, "--redis-url", redis_url).returncode == 1  # none left
    assert invoke("stop", "--redis-url", redis_url).returncode == 2  # says which


def test_every_command_has_help_with_examples() -> None:
    for command in ("worker", "infer", "info", "demo", "adapters", "pool", "dashboard", "stop"):
        done = invoke(command, "--help")
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
