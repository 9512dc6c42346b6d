"""deploy/pool.cpu.example.toml, the CPU pool to start from (issue 35, "What a new user met": there
was none): ``ortq pool --check`` accepts it as it is and with its commented batching keys, and a
pool started from it serves the bundled digits model. Real redis-server, real worker processes."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortq.demo import HOLDOUT_PATH, MODEL_PATH
from ortq.localredis import LocalRedis
from ortq.pool.config import PoolConfig
from ortq.producer import Producer
from ortq.settings import Settings
from tests.cli_support import invoke
from tests.conftest import REPO, Pool

pytestmark = pytest.mark.timeout(300)

EXAMPLE = REPO / "deploy" / "pool.cpu.example.toml"


def uncommented(text: str) -> str:
    """``text`` with its commented-out keys (``# key = value``) taken in."""
    return re.sub(r"^# (\w+ = )", r"\1", text, flags=re.M)


def copied(tmp_path: Path, text: str) -> Path:
    """``text`` as the example file of a copy of the repository's layout under ``tmp_path`` (the
    file names the bundled model by a path relative to its folder)."""
    model = tmp_path / "ortq" / "demo" / "digits.onnx"
    model.parent.mkdir(parents=True)
    model.write_bytes(MODEL_PATH.read_bytes())
    path = tmp_path / "deploy" / EXAMPLE.name
    path.parent.mkdir()
    path.write_text(text)
    return path


def test_check_accepts_the_cpu_example(redis_url: str) -> None:
    done = invoke("pool", "--config", str(EXAMPLE), "--check", "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("digits "))
    assert re.search(r"^digits\s+cpu\s+.+\s+2\s+\d+ MiB \(measured\)$", row), done.stdout
    config = PoolConfig.from_file(EXAMPLE)
    [model] = config.models
    assert (model.provider, model.path.resolve()) == ("cpu", MODEL_PATH.resolve())


def test_its_commented_keys_are_accepted_once_uncommented(tmp_path: Path, redis_url: str) -> None:
    text = EXAMPLE.read_text()
    path = copied(tmp_path, uncommented(text))
    assert path.read_text() != text  # there were keys to take in
    done = invoke("pool", "--config", str(path), "--check", "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    [model] = PoolConfig.from_file(path).models
    assert (model.max_batch, model.option("rows_independent"), model.option("max_wait_ms")) == (16, True, 2)


def test_a_pool_from_the_cpu_example_serves_the_digits(tmp_path: Path, pools: list[Pool]) -> None:
    """On a Redis of its own: the example's queue is ``digits``, which other tests may use."""
    path = copied(tmp_path, EXAMPLE.read_text())
    pixels = np.load(HOLDOUT_PATH)["pixels"][:8]
    session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    with LocalRedis() as server, Producer(settings=Settings.from_url(server.url)) as producer:
        pool = Pool(path, server.url)
        pools.append(pool)
        assert len(producer.wait_for_workers("digits", 2, timeout=120)) == 2
        jobs = producer.submit_many("digits", [{"pixels": row[None]} for row in pixels])
        for got, row in zip(producer.results(jobs, timeout=60), pixels, strict=True):
            np.testing.assert_array_equal(got["label"], session.run(["label"], {"pixels": row[None]})[0])
        pool.process.send_signal(signal.SIGTERM)
        assert pool.wait() == 0, pool.text()
    assert pool.text().splitlines()[-1].endswith("2 workers stopped cleanly; exit status 0"), pool.text()
