#!/usr/bin/env bash
# Every check that needs a GPU, in one prepared pass for a short device lease.
#
#   bash benchmarks/gpu_wheels.sh                 # HERE first: wheels into .whl/ (git-ignored)
#   then on the GPU machine, from the repository root, with .whl carried along:
#   bash benchmarks/gpu_session.sh                # ~8 minutes; logs in $OUT (else /tmp/gpu-session)
#
# Installs DeepSpeed/OmegaConf from .whl next to the machine's own CUDA torch (no
# registry needed), puts this checkout on the path as `loomtrain`, then runs, most
# important first, each under its own time limit and skipped when the remaining budget
# (GPU_SESSION_BUDGET seconds, default 540) cannot hold it:
#   eager      benchmarks/gpu.sh: the 1.34 B model, bf16, DeepSpeed ZeRO-1, flash SDPA
#   tests      tests/unit/test_gpu.py: the fused loss on CUDA (same numbers, less memory), bf16
#              training, fp16 training with DeepSpeed's dynamic loss scaling
#   compile    the eager benchmark with torch.compile per block (parallel.compile)
#   loss       benchmarks/output_layer.py at that model's output layer (fused vs plain)
#   mb8        the eager benchmark at micro batch 8
#   ac         compile + activation checkpointing at micro batch 16
# and prints a summary line per step (rc, the figures line).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
budget=${GPU_SESSION_BUDGET:-540}
start=$SECONDS

# The image's python3 is itself a venv holding CUDA torch, so install beside it, not a
# venv over it: the wheels (no dependency resolution: what they need is already there)
# into a target folder, and this checkout as `loomtrain`, both on PYTHONPATH.
PYTHON=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
deps=/tmp/loomtrain-deps
"$PYTHON" -m pip install --quiet --no-index --no-deps --target "$deps" "$wheels"/*.whl >"$out/install.log" 2>&1 \
  || { echo "install failed:"; tail -5 "$out/install.log"; exit 1; }
mkdir -p /tmp/loomtrain-path && ln -sfn "$repo" /tmp/loomtrain-path/loomtrain
export PYTHONPATH=/tmp/loomtrain-path:$deps${PYTHONPATH:+:$PYTHONPATH} PYTHON PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch-extensions GPU_BENCH_TIMEOUT=600
{ nvidia-smi -L; "$PYTHON" -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'deepspeed', deepspeed.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"; } 2>&1 | tee "$out/env.log"

summary=()
step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local left=$((budget - (SECONDS - start)))
  if ((left < limit)); then summary+=("$name: skipped ($left s left of the budget, needs $limit)"); return; fi
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$out/$name.log"
  summary+=("$name: rc=$rc | $(grep -E 'tokens/s|speed vs plain|done: step|passed|failed|skipped' "$out/$name.log" | tail -n 3 | tr '\n' ' ')")
}

step eager 150 bash benchmarks/gpu.sh
step tests 150 env DS_ACCELERATOR=cuda "$PYTHON" -m pytest -q -rs -s -p no:cacheprovider tests/unit/test_gpu.py
step compile 210 bash benchmarks/gpu.sh --compile
step loss 60 "$PYTHON" benchmarks/output_layer.py --device cuda --precision bf16 --tokens 16384 \
  --d-model 2048 --vocab 32768 --rows 512 4096
step mb8 90 bash benchmarks/gpu.sh --micro-batch 8
step ac 150 bash benchmarks/gpu.sh --compile --ac --micro-batch 16

echo
echo "summary ($((SECONDS - start)) s; logs in $out)"
printf '  %s\n' "${summary[@]}" | tee "$out/summary.txt"
