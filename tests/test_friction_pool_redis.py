"""Which Redis ``ortq pool`` gives its workers, and whether anyone is told: --redis-url, else the
file's [pool] redis_url, else $ORTQ_REDIS_URL, else the default; the pool logs which and where it
came from, warns when the file overrides a different $ORTQ_REDIS_URL, and the example file leaves
redis_url out so that a copy of it follows $ORTQ_REDIS_URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortq.demo import MODEL_PATH
from ortq.pool.config import PoolConfig
from tests.cli_support import Result, invoke
from tests.conftest import REPO

FILE_URL = "redis://queue-host:6379/0"
ENV_URL = "redis://ops:s3cret@other-host:6379/2"  # its password is never shown
SHOWN_ENV_URL = "redis://ops@other-host:6379/2"


def check(config: Path, *args: str, env_url: str | None) -> Result:
    """``ortq pool --check`` (plans, starts nothing, connects to nothing) with $ORTQ_REDIS_URL as given (None:
    unset), in this process: $ORTQ_REDIS_URL is read when the command runs, the log lines are on its stderr."""
    return invoke("pool", "--config", str(config), "--check", *args, env={"ORTQ_REDIS_URL": env_url})


@pytest.fixture
def pool_file(tmp_path: Path) -> Path:
    (tmp_path / "digits.onnx").write_bytes(MODEL_PATH.read_bytes())
    path = tmp_path / "pool.toml"
    path.write_text('[pool]\nmeasure_memory = false\n\n[[model]]\nname = "digits"\npath = "digits.onnx"\n'
                    "[[model.workers]]\ncount = 1\n")  # fmt: skip
    return path


def with_file_url(path: Path, url: str) -> Path:
    path.write_text(path.read_text().replace("[pool]\n", f'[pool]\nredis_url = "{url}"\n'))
    return path


def test_the_file_over_a_different_variable_is_said_not_silent(pool_file: Path) -> None:
    with_file_url(pool_file, FILE_URL)
    done = check(pool_file, env_url=ENV_URL)
    assert done.returncode == 0, done.stderr
    assert f"workers' Redis: {FILE_URL} (from {pool_file}: [pool] redis_url)" in done.stderr
    assert (
        f"WARNING {pool_file}: [pool] redis_url ({FILE_URL}) is used, not $ORTQ_REDIS_URL ({SHOWN_ENV_URL}): the "
        "file wins over the variable; --redis-url wins over both, or leave redis_url out of the file to use the "
        "variable"
    ) in done.stderr
    assert "s3cret" not in done.stderr + done.stdout
    # The same URL in both: nothing to warn about.
    same = check(pool_file, env_url=FILE_URL)
    assert same.returncode == 0 and "WARNING" not in same.stderr, same.stderr
    # --redis-url wins over both, said as such, and the file's URL is no surprise then.
    given = check(pool_file, "--redis-url", "redis://cli-host:6379/0", env_url=ENV_URL)
    assert given.returncode == 0, given.stderr
    assert "workers' Redis: redis://cli-host:6379/0 (from --redis-url)" in given.stderr
    assert "WARNING" not in given.stderr


def test_without_redis_url_in_the_file_the_variable_or_the_default_is_used_and_named(pool_file: Path) -> None:
    done = check(pool_file, env_url=ENV_URL)
    assert done.returncode == 0, done.stderr
    assert f"workers' Redis: {SHOWN_ENV_URL} (from $ORTQ_REDIS_URL)" in done.stderr and "WARNING" not in done.stderr
    default = check(pool_file, env_url=None)
    assert default.returncode == 0, default.stderr
    assert "workers' Redis: redis://127.0.0.1:6379/0 (from the default" in default.stderr


def test_a_bad_url_names_where_it_came_from(pool_file: Path) -> None:
    done = check(pool_file, env_url="localhost:6379")
    assert done.returncode == 2
    assert done.stderr.startswith("ortq: ConfigurationError: $ORTQ_REDIS_URL: redis_url 'localhost:6379' has no scheme")


def test_a_copy_of_the_example_follows_the_variable(tmp_path: Path) -> None:
    """The example's [pool] sets no redis_url: a pool made from it goes where $ORTQ_REDIS_URL says."""
    assert PoolConfig.from_file(REPO / "deploy" / "pool.example.toml").redis_url is None
    example = (REPO / "deploy" / "pool.example.toml").read_text()
    pool_tables = example[: example.index("[[model]]")].replace("measure_memory = true", "measure_memory = false")
    (tmp_path / "digits.onnx").write_bytes(MODEL_PATH.read_bytes())
    path = tmp_path / "pool.toml"
    path.write_text(pool_tables + '[[model]]\nname = "digits"\npath = "digits.onnx"\n[[model.workers]]\ncount = 1\n')
    done = check(path, env_url=ENV_URL)
    assert done.returncode == 0, done.stderr
    assert f"workers' Redis: {SHOWN_ENV_URL} (from $ORTQ_REDIS_URL)" in done.stderr and "WARNING" not in done.stderr
