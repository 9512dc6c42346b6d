"""``python -m tests.rqcontract show|dump FILE|compare A B``: RQ's reference writes, outside pytest.

``show`` prints every scenario's snapshots for the installed RQ; ``dump`` saves them as JSON;
``compare`` prints the differences between two dumps, e.g. one made under RQ 2.12 and one
under RQ 3 (each run in its own venv).
"""

from __future__ import annotations

import sys
from pathlib import Path

import redis
import rq

from ortq.localredis import LocalRedis
from tests.rqcontract import reference
from tests.rqcontract.snapshot import diff, dumps, loads


def main(argv: list[str]) -> int:
    if argv[:1] == ["compare"] and len(argv) == 3:
        ours, theirs = (loads(Path(p).read_text()) for p in argv[1:])
        print(f"ours = {argv[1]}, theirs = {argv[2]}")
        for scenario in reference.SCENARIOS:
            stages_a, stages_b = ours.get(scenario, {}), theirs.get(scenario, {})
            for stage in [*stages_a, *(s for s in stages_b if s not in stages_a)]:
                if stage not in stages_a or stage not in stages_b:
                    print(f"== {scenario}/{stage}: only in one dump")
                    continue
                lines = diff(stages_a[stage], stages_b[stage])
                print(f"== {scenario}/{stage}: {len(lines)} difference(s)")
                for line in lines:
                    print(f"  {line}")
        return 0
    if argv[:1] not in (["show"], ["dump"]) or len(argv) != (2 if argv[0] == "dump" else 1):
        print(__doc__, file=sys.stderr)
        return 2
    with LocalRedis() as server:
        runs = reference.run_all(redis.Redis.from_url(server.url))
    if argv[0] == "dump":
        Path(argv[1]).write_text(dumps(runs))
        return 0
    print(f"rq {rq.__version__}")
    for scenario, stages in runs.items():
        for stage, snap in stages.items():
            print(f"\n=== {scenario} / {stage}\n{snap.render()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
