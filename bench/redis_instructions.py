"""Redis's work per job counted in instructions, not seconds: the drain of bench/redis_profile.py
with redis-server run under valgrind's callgrind, counted from the worker's first take to its
last answer.

    python -m bench.redis_instructions [--jobs 3200] [--max-batch 32] [--before DIR [--rounds 2]]

A count of instructions is the same, run after run (within ~0.5% here: the batches a drain makes
vary a little), whatever else the machine does, where redis_profile's microseconds move 10% and
more on a busy 2-core VM: a change worth 2% of Redis's work a job can be seen, and judged, in one
run. It is a count, not a time: cache misses (Redis's key lookups) cost more than their share of
instructions, so a change's worth in seconds is still redis_profile's to say, on a quiet machine.

Printed: instructions a job in all, then the parts that callgrind names (inclusive: a command's
line holds what it calls): the scripts as a whole (``luaCallFunction``), the commands they call
(``scriptCall``: the commands themselves with Redis's per-call work around them), the largest
commands, Lua's string making (``lua_pushlstring``: Redis's Lua hashes every byte of a string it
makes) and number formatting (``__printf_fp``), and the calls to Redis per job.

``--before DIR`` runs this from DIR (a checkout of the commit before, with this tree's bench/) and
from here in turn, ``--rounds`` times each, and prints both medians and their ratio.

Needs valgrind (callgrind, callgrind_control, callgrind_annotate) and a redis-server on PATH.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.redis_profile import drain, fill, side_by_side
from ortq import keys
from ortq.localredis import LocalRedis
from ortq.settings import Settings

#: The functions shown, as callgrind names them (Debian's redis-server keeps these symbols).
PARTS = {
    "luaCallFunction": "the scripts, in all",
    "scriptCall": "  the commands they call, with Redis's per-call work",
    "xaddCommand": "    XADD",
    "hmgetCommand": "    HMGET",
    "hsetCommand": "    HSET",
    "zaddGenericCommand": "    ZADD",
    "getrangeCommand": "    GETRANGE",
    "expireGenericCommand": "    EXPIRE",
    "parseReply": "  the commands' replies made into Lua values",
    "lua_pushlstring": "  Lua strings made (every byte hashed)",
    "__printf_fp": "  numbers formatted (printf)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3200)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--before", help="another checkout of ortq, counted in turn with this one")
    parser.add_argument("--rounds", type=int, default=2, help="with --before: runs of each checkout")
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: install valgrind (apt-get install valgrind)")
    if args.before:
        measures = {"instructions": re.compile(r"^([0-9]+) instructions a job", re.M)}
        options = ["--jobs", str(args.jobs), "--max-batch", str(args.max_batch)]
        side_by_side(args.before, args.rounds, options, "bench.redis_instructions", measures, "instructions/job")
        return
    count(args.jobs, args.max_batch)


def count(jobs: int, max_batch: int) -> None:
    with tempfile.TemporaryDirectory(prefix="ortq-callgrind-") as tmp, _callgrind_redis(Path(tmp)) as out:
        with LocalRedis() as server:
            settings = Settings.from_url(server.url)
            fill(settings, jobs)
            connection = settings.connect()
            pid = str(connection.info("server")["process_id"])
            connection.config_resetstat()
            _control("-i", "on", pid)  # counting starts here: the queue is full, the worker not yet started
            drain(settings, max_batch)
            _control("-d", pid)
            _control("-i", "off", pid)
            stats = connection.info("commandstats")
            answered = connection.zcard(f"rq:finished:{keys.queue_name('digits')}")
            if answered != jobs or connection.llen(keys.queue_key("digits")):
                raise SystemExit(f"the drain answered {answered} of {jobs} jobs: no count is printed")
        dumps = sorted(glob.glob(f"{out}.*"))  # the dump made at -d (the first file: start-up, not counted)
        if not dumps:
            raise SystemExit("callgrind wrote no dump of the drain")
        inclusive, total = _inclusive(dumps[-1]), _total(dumps[-1])
    calls = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_evalsha", "cmdstat_blmove"))
    print(f"{total // jobs} instructions a job in redis-server ({jobs} digits jobs, --max-batch {max_batch}, "
          f"{calls / jobs:.2f} calls to Redis a job from the scripts)")  # fmt: skip
    for name, label in PARTS.items():
        if name in inclusive:
            print(f"  {label:56} {inclusive[name] // jobs:8} ({inclusive[name] / total:5.1%})")


@contextmanager
def _callgrind_redis(tmp: Path) -> Iterator[str]:
    """A PATH on which ``redis-server`` is the real one under callgrind, counting nothing until told
    (``--instr-atstart=no``); yields the dump files' prefix."""
    real = shutil.which("redis-server")
    if real is None:
        raise SystemExit("no redis-server on PATH")
    out = str(tmp / "callgrind.out")
    wrapper = tmp / "redis-server"
    wrapper.write_text(
        f'#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file={out} "{real}" "$@"\n'
    )
    wrapper.chmod(0o755)
    saved = os.environ["PATH"]
    os.environ["PATH"] = f"{tmp}{os.pathsep}{saved}"
    try:
        yield out
    finally:
        os.environ["PATH"] = saved


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True)


def _total(dump: str) -> int:
    with open(dump) as lines:
        for line in lines:
            if line.startswith("totals:"):
                return int(line.split()[1])
    raise SystemExit(f"no totals in {dump}")


def _inclusive(dump: str) -> dict[str, int]:
    """Each named function's inclusive instructions (callgrind_annotate --inclusive=yes)."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", dump], check=True, capture_output=True, text=True
    ).stdout
    found: dict[str, int] = {}
    for match in re.finditer(r"^\s*([0-9,]+) \([ 0-9.]+%\)\s+\S*?:(\w+)(?:'\d+)? \[", text, re.M):
        name, value = match.group(2), int(match.group(1).replace(",", ""))
        found[name] = max(found.get(name, 0), value)
    return found


if __name__ == "__main__":
    main()
