"""`gptlab export CHECKPOINT_DIR OUT_DIR`: a gptlab checkpoint as a Hugging Face GPT-2 folder.

The folder (config.json + model.safetensors) loads with
`transformers.GPT2LMHeadModel.from_pretrained(OUT_DIR)` and gives the same logits.
Models trained without qkv bias get zero biases (the same function). A head equal
to the token embedding is exported tied, as OpenAI's GPT-2; any other head is
written as `lm_head.weight` with `tie_word_embeddings: false`. --tie-head forces a
tied export: the embedding becomes the head and the checkpoint's own is dropped.
Classifier checkpoints (spam) have no language-model head and are refused.

OUT_DIR must be new or empty; --force replaces an earlier export (a folder holding
just config.json and model.safetensors), once the new export is complete. Any other
non-empty folder (a clone, notes), the checkpoint itself, a folder holding it and
any other gptlab checkpoint are refused even with --force.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", type=Path, metavar="CHECKPOINT_DIR", help="e.g. models/pretrain")
    parser.add_argument(
        "out_dir", type=Path, metavar="OUT_DIR", help="folder to write the Hugging Face model into"
    )
    parser.add_argument(
        "--tie-head",
        action="store_true",
        help="tie the head as OpenAI's GPT-2 does: the token embedding becomes the head and the "
        "checkpoint's own out_head is dropped (the logits change unless the two were equal); "
        "by default an untied head is kept as lm_head.weight",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUT_DIR if it holds an earlier export (only config.json and model.safetensors; "
        "never any other folder); the old export is deleted only once the new one is complete",
    )


def run(args: argparse.Namespace) -> int:
    from gptlab.model.hf_gpt2 import export_checkpoint  # torch: only when the command runs

    out_dir = export_checkpoint(args.checkpoint_dir, args.out_dir, tie_head=args.tie_head, force=args.force)
    print(f"wrote {out_dir}; load it with transformers.GPT2LMHeadModel.from_pretrained({str(out_dir)!r})")
    return 0
