#!/usr/bin/env bash
# Run HERE, on a machine that reaches a package registry: put into .whl/ (git-ignored)
# the wheels benchmarks/gpu_session.sh installs on a GPU machine that reaches none.
# That machine's image already has CUDA torch, numpy, psutil, tokenizers, tensorboard,
# safetensors, pyarrow, tqdm, ninja, msgpack, py-cpuinfo, nvidia-ml-py, einops; what it
# lacks is DeepSpeed, OmegaConf and their pure-Python dependencies, plus pydantic-core
# (compiled: fetched for CPython 3.12 x86-64, the GPU image's python3).
#
#   bash benchmarks/gpu_wheels.sh          # then carry .whl along with the working tree
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
dest=.whl
mkdir -p "$dest"
pure=(omegaconf==2.4.0 hjson==3.1.0 pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5)
"$PYTHON" -m pip download --quiet --no-deps -d "$dest" "${pure[@]}"
# sdists become wheels here: the GPU machine could not fetch their build requirements.
"$PYTHON" -m pip wheel --quiet --no-deps -w "$dest" "antlr4-python3-runtime==4.9.*"
"$PYTHON" -m pip download --quiet --no-deps -d "$dest" --only-binary=:all: \
  --platform manylinux2014_x86_64 --python-version 3.12 --implementation cp pydantic-core==2.50.5
# DeepSpeed ships as an sdist: build a pure-Python wheel (no ops pre-built; loomtrain
# passes a torch AdamW, so none is JIT-compiled either).
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$dest" deepspeed==0.19.8
ls -l "$dest"
du -sh "$dest"
