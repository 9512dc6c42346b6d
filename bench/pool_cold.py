"""Many models, few workers: an elastic pool under a memory budget against one that keeps every
model resident, side by side on one Redis (docs/pool.md, "Many models, one GPU").

    python -m bench.pool_cold [--models 4] [--budget-workers 2] [--rounds 3] [--jobs 20]
                              [--provider cpu]

Both pools serve the same N copies of the bundled digits model, each copy its own queue. The
elastic pool's groups have ``max_workers = 1`` under a budget of ``--budget-workers`` workers
(each worker's memory as the plan measures it); the resident pool has ``count = 1`` for every
model, all loaded before the first job. The driver sends ``--jobs`` jobs to one model at a time,
the models in turn, ``--rounds`` times round the list, and waits for each batch's answers before
the next: the pattern a budget of fewer workers than models serves worst, as every turn may find
its model evicted. Printed per pool: time to first answer of a turn (median, max), jobs/s over the
whole run, and for the elastic pool its cold starts, evictions and model load times (its record,
ortq.pool.status), with the memory each needs (the plan's figures). Every answer is compared with
an in-process ``session.run``; the exit status is 0 when all agree.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ortq.demo import HOLDOUT_PATH, MODEL_PATH
from ortq.localredis import LocalRedis
from ortq.pool import status
from ortq.pool.config import PoolConfig
from ortq.pool.devices import enumerate_for
from ortq.pool.plan import make_plan
from ortq.producer import Producer
from ortq.settings import Settings


def pool_file(folder: Path, model: Path, names: list[str], elastic: bool, budget_mib: int, provider: str) -> Path:
    text = "[pool]\ngrace_seconds = 60\n"
    if elastic:
        text += f"memory_budget_mib = {budget_mib}\nmin_residency_seconds = 1\n"
    for name in names:
        group = "max_workers = 1\nidle_seconds = 600\n" if elastic else "count = 1\n"
        text += (
            textwrap.dedent(f"""
            [[model]]
            name = "{name}"
            path = "{model}"
            provider = "{provider}"
            threads = 1
            [[model.workers]]
            """)
            + group
        )
    path = folder / ("elastic.toml" if elastic else "resident.toml")
    path.write_text(text)
    return path


def worker_mib(path: Path) -> tuple[int, int]:
    """One worker's memory and the whole pool's, as the plan measures them (MiB)."""
    config = PoolConfig.from_file(path)
    adapters, notes, plugins = enumerate_for(config)
    plan = make_plan(config, adapters, notes, plugins=plugins)
    one = plan.placements[0].estimate.bytes
    return one // 2**20, sum(p.estimate.bytes * p.group.count for p in plan.placements) // 2**20


def drive(producer: Producer, names: list[str], rows: np.ndarray, rounds: int, jobs: int) -> dict[str, Any]:
    """Jobs to one model at a time, in turn; the time to each turn's first answer."""
    session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    expected = session.run(["probabilities"], {"pixels": rows})[0]
    firsts, agree, started = [], True, time.perf_counter()
    for _ in range(rounds):
        for name in names:
            sent = time.perf_counter()
            handles = producer.submit_many(name, [{"pixels": row[None]} for row in rows[:jobs]])
            first = handles[0].result(timeout=600)
            firsts.append(time.perf_counter() - sent)
            got = [first, *producer.results(handles[1:], timeout=600)]
            agree &= all(np.allclose(g["probabilities"][0], e, rtol=1e-5) for g, e in zip(got, expected, strict=False))
    seconds = time.perf_counter() - started
    return {"firsts": firsts, "jobs_per_s": rounds * len(names) * jobs / seconds, "agree": agree}


def run_pool(
    url: str, path: Path, names: list[str], rows: np.ndarray, args: argparse.Namespace, elastic: bool
) -> dict[str, Any]:
    log = path.with_suffix(".log")
    with open(log, "wb") as out:
        pool = subprocess.Popen([sys.executable, "-m", "ortq", "pool", "--config", str(path), "--redis-url", url],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        with Producer(settings=Settings.from_url(url), allow_unknown_models=True) as producer:
            if not elastic:  # every model resident before the first job: no load in its figures
                for name in names:
                    producer.wait_for_workers(name, 1, timeout=300)
            result = drive(producer, names, rows, args.rounds, args.jobs)
            result["pools"] = status.read_pools(producer.connection)
    finally:
        pool.terminate()
        pool.wait(120)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--budget-workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--provider", default="cpu")
    args = parser.parse_args()
    rows = np.load(HOLDOUT_PATH)["pixels"][: args.jobs]
    ok = True
    with tempfile.TemporaryDirectory() as folder, LocalRedis() as redis_server:
        where = Path(folder)
        one_mib, resident_mib = worker_mib(pool_file(where, MODEL_PATH, ["probe"], False, 0, args.provider))
        resident_mib *= args.models
        budget = one_mib * args.budget_workers
        results = {}
        for elastic in (True, False):
            names = [f"{'e' if elastic else 'r'}{n}" for n in range(args.models)]
            path = pool_file(where, MODEL_PATH.resolve(), names, elastic, budget, args.provider)
            results[elastic] = run_pool(redis_server.url, path, names, rows, args, elastic)
            ok &= results[elastic]["agree"]
    print(f"{args.models} models, {args.rounds} rounds of {args.jobs} jobs a turn, one model at a time; "
          f"one worker {one_mib} MiB (the plan's figure)")  # fmt: skip
    print(
        f"{'pool':28} {'memory':>10} {'first answer p50':>17} {'max':>8} {'jobs/s':>8}  evictions, cold starts, loads"
    )
    for elastic, label, memory in ((True, f"elastic, budget {args.budget_workers} workers", budget),
                                   (False, "resident, 1 worker a model", resident_mib)):  # fmt: skip
        r = results[elastic]
        firsts = r["firsts"]
        extra = ""
        if elastic and r["pools"]:
            record = r["pools"][0]
            loads = [v["seconds"] / v["count"] for v in record["loads"].values() if v["count"]]
            mean = statistics.mean(loads) if loads else 0.0
            extra = f"{record['evictions']}, {record['cold_starts']}, mean load {mean:.2f} s"
        print(f"{label:28} {memory:>6} MiB {1e3 * statistics.median(firsts):>14.0f} ms {1e3 * max(firsts):>5.0f} ms "
              f"{r['jobs_per_s']:>8.0f}  {extra}")  # fmt: skip
    e, r = results[True], results[False]
    first = statistics.median(e["firsts"]) / statistics.median(r["firsts"])
    print(f"elastic / resident: first answer p50 {first:.1f}x, "
          f"jobs/s {e['jobs_per_s'] / r['jobs_per_s']:.2f}x, memory {budget / resident_mib:.2f}x")  # fmt: skip
    print("outputs agree with session.run" if ok else "OUTPUTS DIFFER from session.run")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
