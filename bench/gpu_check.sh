#!/usr/bin/env bash
# The GPU checks in one go, on a machine with one CUDA GPU (docs/gpu-kernels.md):
#   1. the 1.5B-shape 16k-token step for each trainer.kernels choice, each profiled, the
#      first one on empty inductor and Triton caches (its first step is the compile figure);
#   2. the gpu-marked tests;
#   3. the same step with trainer.kernels=compile, in its own process.
# Usage: bash bench/gpu_check.sh OUT_DIR [BENCH_S] [TEST_S] [COMPILE_BENCH_S]
set -u
out=${1:-gpu-out}
bench_s=${2:-360}
test_s=${3:-150}
compile_s=${4:-150}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a "$out/gpu.txt"
bench() {  # $1: seconds, $2: trainer.kernels choices
    timeout -k 10 "$1" python3 bench/gpu_trainer.py --models qwen2.5-1.5b --rows 16384 \
        --attention flex --share false --kernels "$2" --profile --trace-dir "$out" \
        --warmup 2 --steps 3 2>&1 | tee -a "$out/kernels.jsonl"
}
bench "$bench_s" eager,liger  # liger's rotary patch is process-wide: compile runs apart
timeout -k 10 "$test_s" python3 -m pytest -m gpu tests/gpu -o addopts="" -p no:cacheprovider \
    -q -rs --durations=10 2>&1 | tee "$out/gpu-tests.txt"
bench "$compile_s" compile
for f in "$out"/trace-*.json; do [ -f "$f" ] && gzip -f "$f"; done
