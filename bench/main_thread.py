"""Where a worker's main thread spends a drain: its samples in a py-spy profile, by stage.

    py-spy record --subprocesses --threads --idle --nonblocking -r 1000 -f speedscope -o prof.json \\
        -- python -m bench.gpu.throughput --models DIR --workers 1 --workloads digits32 ...
    python -m bench.main_thread prof.json

py-spy (``pip install py-spy``; not one of ortq's dependencies) samples every thread of the bench
and of the workers it starts, idle ones too. This takes the worker's main thread (the one whose
stacks hold ``LoadedModel.run``), keeps its samples from its first run to its last (the drain:
before it the worker waited for the queue to be filled) and prints the share of each stage:
``Session.run`` (the run itself, and taking the GIL back once it ends: py-spy cannot tell them
apart without native stacks), waiting for the feeder's next batch, handing a batch to the replier,
the check, answering a batch itself, and the rest. docs/results/performance-history.md ("Ninth pass") has a run.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

#: (stage, a function whose frame in a stack puts the sample in it), first match wins.
STAGES = (
    ("Session.run (the run, and the GIL taken back)", "Session.run"),
    ("waiting for the feeder's next batch", "Queue.get"),
    ("handing a batch to the replier", "Threads.reply_later"),
    ("check (decode, the model's signature)", "check_batch"),
    ("answering a batch itself (finish script)", "Replier.answer"),
    ("joining inputs, splitting outputs, layouts", "Worker._run_group"),
)


def stage_of(names: list[str]) -> str:
    for stage, function in STAGES:
        if function in names:
            return stage
    return "other: " + " > ".join(names[-2:])


def main_thread_split(profile: dict[str, Any]) -> tuple[Counter[str], int]:
    """The worker main thread's samples during its runs, by stage, and how many there were."""
    frames = [frame["name"] for frame in profile["shared"]["frames"]]
    for thread in profile["profiles"]:
        stacks = [[frames[i] for i in sample] for sample in thread["samples"]]
        runs = [k for k, names in enumerate(stacks) if "LoadedModel.run" in names]
        if "MainThread" in thread["name"] and runs:
            drain = stacks[runs[0] : runs[-1] + 1]
            return Counter(stage_of(names) for names in drain), len(drain)
    raise SystemExit("no thread with LoadedModel.run in its stacks: is this a profile of a worker's drain?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="py-spy's speedscope JSON (-f speedscope)")
    args = parser.parse_args()
    split, total = main_thread_split(json.loads(args.profile.read_text()))
    print(f"the worker's main thread, {total} samples from its first run to its last:")
    for stage, count in split.most_common():
        print(f"  {100 * count / total:5.1f}%  {stage}")


if __name__ == "__main__":
    main()
