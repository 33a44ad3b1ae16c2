#!/usr/bin/env bash
# The GPU check, on one CUDA GPU in under 10 minutes: the training-step
# benchmark (book, ours default, ours fast, transformers) and one epoch of the
# pretrain stage's training with the fast profile (bf16 autocast, TF32, SDPA,
# fused AdamW, chunked loss), each with tokens/s and MFU against PEAK_TFLOPS: by
# default the H200's bf16 dense peak, 989 TFLOP/s (an H100 SXM's is also 989; set
# it for others); then every stage of the smoke profile on the GPU (`train.device:
# auto` picks CUDA, printed first), timed; its metrics are not checked (the
# baselines are CPU runs'). The package need not be installed: src/ is on PYTHONPATH.
#
#   GPTLAB_MIRROR=/path/to/mirror bash benchmarks/gpu.sh   # or with data/raw filled by `dvc repro download`
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PEAK_TFLOPS="${PEAK_TFLOPS:-989}"

python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: gpu.sh checks a GPU")'
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
echo "MFU against a peak of ${PEAK_TFLOPS} TFLOP/s (bf16 dense)"
timeout 180 python benchmarks/bench_train_step.py --device cuda --rounds 10 --batch-size 8 --peak-tflops "$PEAK_TFLOPS"
timeout 120 python benchmarks/bench_pretrain_epoch.py --device cuda --peak-tflops "$PEAK_TFLOPS"

workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
python -c 'from gptlab.training.runtime import resolve_device; print("train.device: auto ->", resolve_device("auto"))'
start=$(date +%s)
timeout 600 python -m gptlab.cli.main smoke --no-check --workdir "$workdir/smoke"
echo "smoke profile on CUDA, every stage: $(( $(date +%s) - start )) s"
