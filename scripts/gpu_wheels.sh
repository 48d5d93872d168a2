#!/usr/bin/env bash
# Download the wheels bench/gpu.py installs on a GPU machine that has torch (a CUDA build) but no network.
#
#   scripts/gpu_wheels.sh [DEST]     # default bench/gpu-wheels: carry that folder beside bench/gpu.py
#   scripts/gpu_wheels.sh --check    # only resolve them (pip install --dry-run): a few KB of metadata, no wheels
#
# What: every requirement of pyproject.toml's [project] dependencies and of its torch extra but torch (onnx), and
# their own dependencies, as wheels for the
# GPU machine's interpreter, whatever this machine runs: CPython $GPU_PYTHON (default 3.12) on manylinux x86_64
# (GPU_PLATFORMS to change). Not torch: the GPU machine's own CUDA build stays, and bench/gpu.py installs only what
# its interpreter lacks, into a virtual environment over the system's packages, with pip --no-index.
# Needs network access and a pip >= 22.2 (PYTHON, default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
GPU_PYTHON=${GPU_PYTHON:-3.12}
GPU_PLATFORMS=${GPU_PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}
abi="cp${GPU_PYTHON/./}"

mapfile -t reqs < <("$PYTHON" -c '
import tomllib
with open("pyproject.toml", "rb") as f:
    doc = tomllib.load(f)["project"]
# the base dependencies, and those of the torch extra but torch (onnx: the converter rewrites campplus.onnx)
extra = [r for r in doc["optional-dependencies"]["torch"] if not r.startswith("torch")]
print("\n".join(doc["dependencies"] + extra))
')
target=(--only-binary=:all: --implementation cp --python-version "$GPU_PYTHON" --abi "$abi" --abi abi3 --abi none)
for p in $GPU_PLATFORMS; do
    target+=(--platform "$p")
done

if [ "${1:-}" = "--check" ]; then
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    "$PYTHON" -m pip install --dry-run --ignore-installed --quiet --disable-pip-version-check \
        --target "$scratch/target" --report "$scratch/report.json" "${target[@]}" "${reqs[@]}"
    "$PYTHON" - "$scratch/report.json" "CPython $GPU_PYTHON ($abi) on ${GPU_PLATFORMS// /, }" <<'EOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
for item in sorted(items, key=lambda i: i["metadata"]["name"].lower()):
    meta, url = item["metadata"], item["download_info"]["url"]
    print(f"{meta['name']}=={meta['version']}  {url.rsplit('/', 1)[-1]}")
print(f"{len(items)} wheels resolve for {sys.argv[2]}")
EOF
    exit 0
fi

dest=${1:-bench/gpu-wheels}
mkdir -p "$dest"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$dest" "${target[@]}" "${reqs[@]}"
echo "wrote $(find "$dest" -name '*.whl' | wc -l) wheels ($(du -sh "$dest" | cut -f1)) to $dest for CPython $GPU_PYTHON"
