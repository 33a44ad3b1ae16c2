#!/usr/bin/env bash
# The GPU check, on one CUDA GPU in under 5 minutes: the training-step
# benchmark (book, ours default, ours fast, transformers) and one epoch of the
# pretrain stage's training with the fast profile (bf16 autocast, TF32, SDPA,
# fused AdamW, chunked loss), each with MFU against PEAK_TFLOPS: by default the
# H200's bf16 dense peak, 989 TFLOP/s (an H100 SXM's is also 989; set it for others).
#
#   GPTLAB_MIRROR=/path/to/mirror bash benchmarks/gpu.sh   # or with data/raw filled by `dvc repro download`
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PEAK_TFLOPS="${PEAK_TFLOPS:-989}"

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
echo "MFU against a peak of ${PEAK_TFLOPS} TFLOP/s (bf16 dense)"
timeout 180 python benchmarks/bench_train_step.py --device cuda --rounds 10 --batch-size 8 --peak-tflops "$PEAK_TFLOPS"
timeout 120 python benchmarks/bench_pretrain_epoch.py --device cuda --peak-tflops "$PEAK_TFLOPS"
