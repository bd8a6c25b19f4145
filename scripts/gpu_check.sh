#!/usr/bin/env bash
# The GPU checks, as one command for a machine with CUDA (docs/testing.md, "GPUs"):
#   1. the CUDA tests (pytest -m cuda: the equivalence suite on the GPU, --graph's captured
#      graphs, chunking, fused, checkpoints that load on a CPU),
#   2. make bench's GPU table alone (fedcli's executors and --graph vs a plain GPU loop and the
#      GPU's floor, with the GPU-engine targets),
#   3. the demo's 40 FedPA rounds on the GPU with --graph (the per-round train time it prints).
# Needs fedcli's dependencies importable (pip install -e '.[dev]'). Writes its logs to $OUT
# (or ./gpu-check); exits non-zero when a step fails.
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt" || status=1
python -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$out/cuda-tests.txt" || status=1
python -m tests.benchmarks.run --skip flower,workloads,fedpa,tracking,startup,memory --out "$out/bench" \
    2>&1 | tee "$out/bench.txt" || true  # the GPU targets are reported, not an exit status
python -m fedcli train --algo fedpa --config examples/fedpa-femnist-demo.yaml --device cuda --graph \
    --root "$out/demo-runs" --no-mlflow 2>&1 | tee "$out/demo.txt" || status=1
exit $status
