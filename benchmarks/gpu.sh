#!/usr/bin/env bash
# One GPU, one command: a 1.34 B model (configs/gpt-1b.yaml at tp 1: d_model 2048,
# 24 layers, 16 heads, seq 2048) in bf16 under the DeepSpeed engine, SDPA flash
# attention; prints tokens/s, MFU (against the GPU's dense bf16 peak) and peak memory.
#
#   benchmarks/gpu.sh                      # eager
#   benchmarks/gpu.sh --compile            # torch.compile per block
#   benchmarks/gpu.sh --compile --ac       # + activation checkpointing per block
#   benchmarks/gpu.sh --micro-batch 8 --steps 30
#   benchmarks/gpu.sh --tiny               # CPU smoke run of the same code path
#
# Other flags: see `python benchmarks/gpu_bench.py --help`. The whole run is capped at
# 8 minutes (GPU_BENCH_TIMEOUT seconds, default 480).
set -euo pipefail
cd "$(dirname "$0")/.."

tiny=0
for arg in "$@"; do [[ "$arg" == "--tiny" ]] && tiny=1; done
if [[ $tiny == 0 ]]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu.sh: no CUDA device found (nvidia-smi missing or it lists no GPU)." >&2
    echo "        Run this on a machine with an NVIDIA GPU, or add --tiny for a CPU smoke run." >&2
    exit 2
  fi
fi

PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
limit=${GPU_BENCH_TIMEOUT:-480}
set +e
timeout --signal=TERM --kill-after=15 "$limit" "$PYTHON" benchmarks/gpu_bench.py "$@"
rc=$?
set -e
if [[ $rc == 124 ]]; then
  echo "gpu.sh: stopped after ${limit} s (GPU_BENCH_TIMEOUT); try fewer --steps or drop --compile" >&2
fi
exit $rc
