#!/usr/bin/env bash
# The GPU checks in one go, on a machine with one CUDA GPU (docs/gpu-kernels.md):
#   1. the gpu-marked tests, on empty inductor and Triton caches, the families' attention
#      and LoRA on CUDA first (tests/gpu);
#   2. the 1.5B-shape 16k-token step with trainer.kernels=liger, every weight trained and
#      rank-16 LoRA, each profiled (GPU time per kernel class), in one process.
# Wheels the card's image lacks or holds at other versions (transformers, peft,
# liger-kernel) travel in .whl/ and are installed under /tmp/site first, when present.
# Usage: bash bench/gpu_check.sh OUT_DIR [TEST_S] [BENCH_S]
set -u
out=${1:-gpu-out}
test_s=${2:-240}
bench_s=${3:-260}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton, peft; print(torch.__version__, transformers.__version__, triton.__version__, peft.__version__)" 2>&1 | tee -a "$out/gpu.txt"
python3 -c "import liger_kernel; print('liger-kernel present')" 2>&1 | tail -1 | tee -a "$out/gpu.txt"
t0=$(date +%s)
timeout -k 10 "$test_s" python3 -m pytest -m gpu tests/gpu/test_cuda_families.py \
    tests/gpu/test_cuda_lora.py tests/gpu/test_cuda_ipc.py tests/gpu/test_trainer_step_cuda.py \
    tests/gpu/test_cuda_attention.py -o addopts="" -p no:cacheprovider -p no:randomly \
    -q -rs --durations=15 2>&1 | tee "$out/gpu-tests.txt"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$out/gpu.txt"
t0=$(date +%s)
timeout -k 10 "$bench_s" python3 bench/gpu_trainer.py --models qwen2.5-1.5b --rows 16384 \
    --attention flex --share false --kernels liger --lora 0,16 --profile \
    --warmup 1 --steps 3 >"$out/kernels.jsonl" 2>"$out/bench-stderr.txt"
rc=$?
echo "bench: $(( $(date +%s) - t0 )) s, exit $rc" | tee -a "$out/gpu.txt"
tail -5 "$out/bench-stderr.txt"
cut -c1-400 "$out/kernels.jsonl"
