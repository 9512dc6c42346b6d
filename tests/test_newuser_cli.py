"""What a new user met at the command line (issue 35): ``ortq demo --help`` named 6379 as its
default Redis, where it really starts a redis-server of its own."""

from __future__ import annotations

import re

from tests.cli_support import invoke


def option_help(command: str, option: str) -> str:
    """The help of ``option`` in ``ortq COMMAND --help``, its wrapped lines joined (a line may break
    after a hyphen, so that break is joined without a space)."""
    done = invoke(command, "--help")
    assert done.returncode == 0, done.stderr
    options = done.stdout.split("Options:\n", 1)[1]
    found = re.search(rf"^  {re.escape(option)} \S+\s+(.*?)(?=^  -)", options, re.M | re.S)
    assert found, done.stdout
    return re.sub(r"-\s+", "-", " ".join(found.group(1).split()))


def test_demo_help_says_it_starts_its_own_redis_by_default() -> None:
    said = option_help("demo", "--redis-url")
    assert said.startswith("Redis to use (default: $ORTQ_REDIS_URL, else a redis-server of its own"), said
    assert "6379" not in said, said
    # The commands that do use 127.0.0.1:6379 by default still say so.
    assert "else redis://127.0.0.1:6379/0" in option_help("info", "--redis-url")
