"""Where Redis's time goes per job: a worker (in this process, burst) drains a queue of digits jobs
filled beforehand, then Redis's ``INFO commandstats`` is divided by the job count.

    python -m bench.redis_profile [--jobs 6000] [--max-batch 32] [--rq-results on,off]
                                  [--rq-executions on,off] [--stream-node-max-bytes 4096,512]
                                  [--split] [--before DIR [--rounds 3]]

``evalsha`` is the scripts' whole time; the commands they call are also listed on their own
(their sum is the part of ``evalsha`` spent inside commands; the rest is Lua itself: the
interpreter, argument and reply conversion). ``--split`` also says which script the time went to
(start, finish, ...): Redis's SLOWLOG records every call meanwhile, and ``evalsha``'s total is
shared out in proportion to each script's logged time (logging every call slows Redis a little, so
the totals of a ``--split`` run are a little higher than those of a run without it).

``--before DIR`` compares two checkouts side by side: this script runs from DIR (e.g. a git
worktree of the commit before) and from here in turn, ``--rounds`` times each, alternating which
goes first, and prints both medians and their ratio (the scripts' time and redis-server's CPU, a
job), so that a noisy machine's drift falls on both alike.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import subprocess
import sys
from collections import Counter
from typing import Any

import numpy as np

from ortq.demo import MODEL_PATH
from ortq.localredis import STREAM_NODE_MAX_BYTES, LocalRedis
from ortq.producer import Producer
from ortq.rqcompat.book import SCRIPTS, script_source
from ortq.settings import Settings
from ortq.worker.serve import WorkerConfig, build_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=6000)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument(
        "--rq-results", default="on", help="on, off or on,off: with RQ's result record per job (ORTQ_RQ_RESULTS) or not"
    )
    parser.add_argument(
        "--rq-executions",
        default="on",
        help="on, off or on,off: with RQ's execution records per job (ORTQ_RQ_EXECUTIONS) or not",
    )
    parser.add_argument(
        "--stream-node-max-bytes",
        default=str(STREAM_NODE_MAX_BYTES),
        help="Redis's setting, or several (4096,512) run one after the other (docs/operations.md)",
    )
    parser.add_argument("--split", action="store_true", help="share the scripts' time out by script (SLOWLOG)")
    parser.add_argument("--before", help="another checkout of ortq, profiled in turn with this one")
    parser.add_argument("--rounds", type=int, default=3, help="with --before: runs of each checkout")
    args = parser.parse_args()
    if args.before:
        options = ["--jobs", str(args.jobs), "--max-batch", str(args.max_batch)]
        return side_by_side(args.before, args.rounds, options, "bench.redis_profile", _MEASURES)
    for node_bytes in args.stream_node_max_bytes.split(","):
        for results in args.rq_results.split(","):
            for executions in args.rq_executions.split(","):
                records = {"rq_results": ON_OFF[results], "rq_executions": ON_OFF[executions]}
                profile(args.jobs, args.max_batch, records, int(node_bytes), args.split)


ON_OFF = {"on": True, "off": False}


def profile(jobs: int, max_batch: int, records: dict[str, bool], node_bytes: int, split: bool = False) -> None:
    with LocalRedis(stream_node_max_bytes=node_bytes) as server:
        settings = Settings.from_url(server.url, **records)
        fill(settings, jobs)
        connection = settings.connect()
        connection.config_resetstat()
        if split:
            connection.config_set("slowlog-log-slower-than", 0)
            connection.config_set("slowlog-max-len", 1_000_000)
            connection.slowlog_reset()
        cpu_before = _cpu_seconds(connection)
        drain(settings, max_batch)
        stats = connection.info("commandstats")
        cpu = _cpu_seconds(connection) - cpu_before
        shares = _script_shares(connection) if split else {}
    rows = sorted(((v["usec"] / jobs, v["calls"] / jobs, k[8:]) for k, v in stats.items()), reverse=True)
    scripts = sum(usec for usec, _, name in rows if name in ("evalsha", "eval", "fcall"))
    inside = sum(usec for usec, _, name in rows if name not in ("evalsha", "eval", "fcall", "blmove", "lmove"))
    print(f"{jobs} digits jobs, --max-batch {max_batch}, ", end="")
    print(", ".join(f"{name} {'on' if on else 'off'}" for name, on in records.items()), end=", ")
    print(f"stream-node-max-bytes {node_bytes}: ", end="")
    print(f"the scripts {scripts:.1f} us/job,")
    print(f"of which the commands they call {inside:.1f} and Lua itself {scripts - inside:.1f};")
    print(f"redis-server's CPU in all (INFO cpu: commands, network, the rest) {cpu / jobs * 1e6:.1f} us/job")
    for name, share in sorted(shares.items(), key=lambda item: -item[1]):
        print(f"  script {name:17} {scripts * share:7.2f} us/job")
    for usec, calls, name in rows:
        if usec >= 0.05:
            print(f"  {name:24} {usec:7.2f} us/job {calls:6.2f} calls/job")


def fill(settings: Settings, jobs: int) -> None:
    """Queue ``jobs`` digits jobs (8 distinct inputs in turn) through a real producer."""
    with Producer(settings=settings, allow_unknown_models=True) as producer:
        rng = np.random.default_rng(0)
        inputs = [{"pixels": rng.standard_normal((1, 64)).astype(np.float32)} for _ in range(8)]
        producer.submit_many("digits", [inputs[i % 8] for i in range(jobs)])


def drain(settings: Settings, max_batch: int) -> None:
    """One real worker, in this process, answers every queued digits job and stops (burst)."""
    config = WorkerConfig(MODEL_PATH, "digits", threads=1, max_batch=max_batch, rows_independent=True, burst=True)
    build_worker(config, settings).serve(handle_signals=False)


_MEASURES = {
    "scripts": re.compile(r"the scripts ([0-9.]+) us/job"),
    "redis-server CPU": re.compile(r"redis-server's CPU in all .*? ([0-9.]+) us/job"),
}


def side_by_side(
    before: str,
    rounds: int,
    options: list[str],
    module: str,
    measures: dict[str, re.Pattern[str]],
    unit: str = "us/job",
) -> None:
    """The bench ``module`` run from ``before`` and from here, alternated; the medians of each of
    ``measures`` (a pattern whose first group is the number in its output) and their ratio."""
    trees = {"before": before, "after": "."}
    found: dict[str, dict[str, list[float]]] = {tag: {name: [] for name in measures} for tag in trees}
    for round_ in range(rounds):
        for tag in list(trees) if round_ % 2 == 0 else list(reversed(trees)):
            command = [sys.executable, "-m", module, *options]
            text = subprocess.run(command, cwd=trees[tag], check=True, capture_output=True, text=True).stdout
            for name, pattern in measures.items():
                if match := pattern.search(text):
                    found[tag][name].append(float(match.group(1)))
            print(f"round {round_ + 1} {tag}: {text.splitlines()[0] if text else ''}")
            print("  " + "; ".join(f"{name} {values[-1]:.1f} {unit}" for name, values in found[tag].items() if values))
    for name in measures:
        medians = {tag: statistics.median(found[tag][name]) for tag in trees if found[tag][name]}
        if len(medians) == 2:
            ratio = medians["after"] / medians["before"]
            print(f"{name}: before {medians['before']:.1f}, after {medians['after']:.1f} {unit} (median of {rounds}): "
                  f"after / before {ratio:.2f}")  # fmt: skip


def _script_shares(connection: Any) -> dict[str, float]:
    """Each ortq script's part of the scripts' time logged in SLOWLOG (by its sha)."""
    names = {hashlib.sha1(script_source(name).encode()).hexdigest(): name for name in SCRIPTS}
    logged: Counter[str] = Counter()
    for entry in connection.slowlog_get(1_000_000):
        words = entry["command"].split()
        if len(words) > 1 and words[0].lower() in (b"evalsha", "evalsha"):
            sha = words[1].decode() if isinstance(words[1], bytes) else words[1]
            logged[names.get(sha, sha[:12])] += entry["duration"]
    total = sum(logged.values()) or 1
    return {name: usec / total for name, usec in logged.items()}


def _cpu_seconds(connection: Any) -> float:
    """redis-server's CPU time so far, user and system, all threads (``INFO cpu``)."""
    info = connection.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


if __name__ == "__main__":
    main()
