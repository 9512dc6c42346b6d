#!/usr/bin/env bash
# Here, after bench/gpu/prepare.sh, before a WebGPU run on the lent H200: add what --provider webgpu
# needs there (all ignored by git, carried by the device tool): the onnxruntime-ep-webgpu wheel in .whl
# (run_on_h200.sh installs every wheel there) and the Vulkan loader's .deb in .gl (the device image has
# no libvulkan.so.1; the device README's recipe, reduced to the one package Vulkan needs).
# Then run on the device, carrying [".whl", ".gpurun", ".gl"]:
#   for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; ORTQ_GPU_BENCH=webgpu_vs_cuda bash bench/gpu/run_on_h200.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.gl/" .git/info/exclude || echo "/.gl/" >> .git/info/exclude
[ -d .whl ] || { echo "run bench/gpu/prepare.sh first (it builds .whl and .gpurun)" >&2; exit 1; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl "onnxruntime-ep-webgpu==0.4.0"
rm -rf .gl && mkdir -p .gl /tmp/amd64/partial
apt_amd64=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64)
apt-get "${apt_amd64[@]}" update -qq
(cd .gl && apt-get "${apt_amd64[@]}" download libvulkan1)
du -sh .whl .gl
