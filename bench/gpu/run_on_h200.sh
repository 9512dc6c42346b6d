#!/usr/bin/env bash
# On the lent H200 (device tool), after the onnxruntime-gpu wheel was reassembled into /tmp/w
# (../shared/gpu/README.md; bench/gpu/prepare.sh builds everything carried): a clean venv with
# only ortq's dependencies (the image's own CPU onnxruntime would otherwise make the worker
# refuse to start: two ONNX Runtime distributions),
# a redis-server from .gpurun/bin, then bench/gpu/cuda_e2e.py. Carried: .whl (wheels), .gpurun.
set -euo pipefail
# (A second run on the same warm machine finds the wheel already checked and renamed.)
cd /tmp/w && { [ -f "$(cat NAME)" ] || { echo "$(cat SHA256)  ort.whl" | sha256sum -c - && mv ort.whl "$(cat NAME)"; }; } && cd - >/dev/null
python3 -m venv --without-pip /tmp/v
site=$(/tmp/v/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl "/tmp/w/$(cat /tmp/w/NAME)"
# SWITCH=<seconds>: every Python of this venv (the bench and the workers it starts) runs with that
# GIL switch interval (sys.setswitchinterval; CPython's default is 0.005), for docs/performance.md's
# experiment on the GIL's hand-back after session.run; unset, the default. A .pth file's import
# line runs at every start-up (a sitecustomize.py could be shadowed by the system's own).
if [ -n "${SWITCH:-}" ]; then
    echo 'import os, sys; sys.setswitchinterval(float(os.environ.get("SWITCH") or 0.005))' > "$site/ortq_switch.pth"
else
    rm -f "$site/ortq_switch.pth"
fi
# CUDA/cuDNN libraries come from the image's nvidia-* packages.
export LD_LIBRARY_PATH=$(python3 -c "import os,glob,nvidia;r=os.path.dirname(nvidia.__path__[0]);print(':'.join(sorted({os.path.dirname(p) for p in glob.glob(r+'/nvidia/**/lib*.so*',recursive=True)})))"):${LD_LIBRARY_PATH:-}
export PATH=$PWD/.gpurun/bin:$PATH PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv
# What to run: bench/gpu/cuda_e2e.py (one worker per adapter spec), bench/gpu/pool_e2e.py (ortq
# pool, workers per GPU), bench/gpu/throughput.py (issue 14's yardsticks), bench/gpu/webgpu_vs_cuda.py;
# default the first two. Each writes its JSON report to $OUT/<name>$ORTQ_GPU_BENCH_TAG.json;
# ORTQ_GPU_BENCH_ARGS is added to each one's arguments (e.g. "--workloads conv --io-threads 4").
status=0
for what in ${ORTQ_GPU_BENCH:-cuda_e2e pool_e2e}; do
    # shellcheck disable=SC2086  # ORTQ_GPU_BENCH_ARGS is a list of arguments
    /tmp/v/bin/python -m "bench.gpu.$what" --models .gpurun/models \
        --out "${OUT:-/tmp}/$what${ORTQ_GPU_BENCH_TAG:-}.json" ${ORTQ_GPU_BENCH_ARGS:-} || status=1
done
exit $status
