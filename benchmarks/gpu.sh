#!/usr/bin/env bash
# The GPU check, on one CUDA GPU in about 15 minutes (an H100 or H200; each step has a timeout):
#  1. bench_corpus_pretrain.py at profiles/gutenberg.yaml's settings (GPT-2 124M, context 1,024,
#     micro-batches of 32, bf16 autocast, TF32, SDPA, fused AdamW, torch.compile): our step on
#     memory-mapped shards and on ids in memory beside the book's optimized single-GPU step
#     (benchmarks/book_speed_bonus.py) at the same model, context and micro-batch; tokens/s and MFU
#     against the GPU's dense bf16 peak (PEAK_TFLOPS overrides it; targets: >= 1.1x the book, >= 45 %);
#  2. `gptlab run --profile gutenberg pretrain`: download, tokenize and one epoch of pretraining on
#     the 171 mirrored books as a DVC experiment, timed (the stage prints its tokens/s and MFU);
#  3. every stage of profiles/gutenberg-smoke.yaml, timed;
#  4. the default pipeline, timed: download..eval (the reference run's stages); with FULL_DEFAULT=1
#     all seven stages (load-gpt2 needs OpenAI's weights: network or the Hugging Face cache).
# Metrics are not checked (the baselines are CPU runs'). The package need not be installed: src/ is
# on PYTHONPATH. Run it from a git clone (`gptlab run` makes DVC experiments).
#
#   GPTLAB_MIRROR=/path/to/mirror bash benchmarks/gpu.sh   # or with data/raw filled by `dvc repro download`
#   bash benchmarks/gpu.sh 1      # only the steps named: step 1 needs no inputs, DVC or MLflow
set -euo pipefail
cd "$(dirname "$0")/.."
steps=("$@")
if [[ ${#steps[@]} == 0 ]]; then steps=(1 2 3 4); fi
for step in "${steps[@]}"; do
  if [[ ! "$step" =~ ^[1-4]$ ]]; then
    echo "gpu.sh: no step '$step': the steps are 1 to 4 (see the top of $0)" >&2
    exit 2
  fi
done
wanted() { [[ " ${steps[*]} " == *" $1 "* ]]; }
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
peak=()
if [[ -n "${PEAK_TFLOPS:-}" ]]; then peak=(--peak-tflops "$PEAK_TFLOPS"); fi

python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: gpu.sh checks a GPU")'
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
timed() {  # timed LABEL SECONDS COMMAND...: run with a timeout, print the wall time
  local label=$1 limit=$2 start
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@"
  echo "$label: $(($(date +%s) - start)) s"
}

if wanted 1; then
  timed "1. ours beside the book's optimized step" 360 python benchmarks/bench_corpus_pretrain.py \
    --profile profiles/gutenberg.yaml --device cuda --book --warmup 3 --steps 5 --rounds 3 "${peak[@]}"
fi
if wanted 2; then
  timed "2. gutenberg profile: download, tokenize, pretrain (171 books)" 420 \
    python -m gptlab.cli.main run --profile gutenberg --name "gutenberg-gpu-$(date +%H%M%S)" pretrain
fi
if wanted 3; then
  timed "3. gutenberg-smoke profile, every stage" 300 \
    python -m gptlab.cli.main smoke --profile profiles/gutenberg-smoke.yaml --no-check --workdir "$workdir/gutenberg-smoke"
fi
if wanted 4; then
  printf 'tracking:\n  experiment: gptlab-gpu-default\n' >"$workdir/default.yaml"
  if [[ "${FULL_DEFAULT:-0}" == 1 ]]; then
    timed "4. default pipeline, every stage" 900 \
      python -m gptlab.cli.main smoke --profile "$workdir/default.yaml" --no-check --workdir "$workdir/default"
  else
    timed "4. default pipeline, download..eval" 300 \
      python -m gptlab.cli.main run --profile "$workdir/default.yaml" --name "default-gpu-$(date +%H%M%S)" eval
  fi
fi
