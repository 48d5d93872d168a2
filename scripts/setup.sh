#!/usr/bin/env bash
# Set up cosyserve from nothing and run the main job once:
#   1. a virtual environment in .venv with cosyserve, its dev tools and Ray Serve (torch pinned to the CPU build 2.13.0),
#   2. a tiny random-weight model in the official layout (out/tiny-model),
#   3. a synthesis from it to out/hello.wav (random weights: it is noise, not speech).
# Pass --no-demo to stop after step 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch requirement resolves to a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
# torch: the torch runtime (already installed, pinned, above); dev: tests and linters; aac: PyAV, for
# response_format aac (and its tests); ray: Ray Serve, for
# cosyserve.deploy.ray_serve and its test
.venv/bin/python -m pip install -q -e '.[torch,dev,ray,aac]'
[ "${1:-}" = "--no-demo" ] && exit 0
.venv/bin/cosyserve make-test-model out/tiny-model --size tiny --force
.venv/bin/cosyserve speakers --model out/tiny-model
.venv/bin/cosyserve synth --model out/tiny-model --speaker 英文女 --text "Hello world, this is a test." --seed 1 --out out/hello.wav
