"""`gptlab chat "INSTRUCTION" [--input TEXT]`: ask the instruction-tuned model (chapter 7).

The instruction (and optional input) is put into the Alpaca prompt the model
was tuned on and answered greedily with the KV cache, stopping at
end-of-text: exactly how the instruct-finetune stage answered its test set
(`--temperature` samples instead, with `--top-k` and `--seed`, as a served model does).

The prompt and the answer must fit the model's context: an input too long for
it is cropped at its end (the instruction and the template never are), and the
answer is capped at the room left, each with a warning on stderr.

`--model` takes a checkpoint folder or a model logged in MLflow
(`models:/gptlab-instruct@champion`), whose own BPE files are then used.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gptlab.cli.inference_options import add_inference_arguments, load_for_inference
from gptlab.cli.model_source import ModelSource, bpe_folder, find_model
from gptlab.errors import InputError
from gptlab.files import require_folder
from gptlab.paths import INSTRUCT_MODEL
from gptlab.pipeline.params import load_params
from gptlab.tasks import request

# The heavy imports (torch, the model) happen once the command runs, so `gptlab --help` stays fast.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "instruction", metavar="INSTRUCTION", help='e.g. "Rewrite the sentence using a simile."'
    )
    parser.add_argument(
        "--input",
        default="",
        metavar="TEXT",
        help="the text the instruction is about, if any (default: none)",
    )
    parser.add_argument(
        "--model",
        metavar="DIR|URI",
        help="checkpoint written by `dvc repro instruct-finetune` (default: models/instruct) or by "
        "`dvc repro preference-finetune` (models/preference), or a model logged in MLflow, e.g. "
        "models:/gptlab-instruct@champion",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help="longest answer in tokens (default: the model's own: its MLflow signature's, else what "
        "its stage answered with; else instruct.max_new_tokens of params.yaml)",
    )
    parser.add_argument(
        "--raw-dir",
        type=Path,
        help="folder holding gpt2/vocab.bpe and gpt2/encoder.json (default: the MLflow model's own, "
        "else data.raw_dir of params.yaml, else $GPTLAB_MIRROR)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: the greedy answer the stage gives (default); 0.01 to 100: sample, higher is more varied",
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0, no limit)"
    )
    parser.add_argument("--seed", type=int, default=123, help="the sampling seed (default: %(default)s)")
    add_inference_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # The arguments first, before the model and torch load (seconds): a typo is one line at once.
    request.text(args.instruction, "the instruction", hint="say what the model should do")
    if args.max_new_tokens is not None:
        request.max_new_tokens(args.max_new_tokens, "--max-new-tokens")
    args.sampling = {
        "temperature": request.temperature(args.temperature, "--temperature"),
        "top_k": request.top_k(args.top_k, "--top-k"),
        "seed": request.seed(args.seed, "--seed"),
    }
    if args.raw_dir is not None:
        require_folder(args.raw_dir, "--raw-dir")
    with find_model(
        args.model, INSTRUCT_MODEL, command="chat", kind="instruction-tuned model", stage="instruct-finetune"
    ) as source:
        return _chat(args, source)


def _chat(args: argparse.Namespace, source: ModelSource) -> int:
    # torch on first use: keeps `gptlab --help` fast
    from gptlab.model.tokenizer import gpt2_tokenizer, load_tokenizer
    from gptlab.tasks.responses import fit_to_context, generate_response

    model_dir = source.checkpoint
    model, metadata = load_for_inference(model_dir, args)
    if not model.cfg.is_language_model:
        raise InputError(
            f"{args.model or model_dir} is a classifier, not a language model: point --model at models/instruct"
        )
    # The model's own answer length (its MLflow signature's default, else what its stage answered
    # with), else instruct.max_new_tokens of params.yaml.
    own = source.defaults.get("max_new_tokens") or metadata.get("generation", {}).get("max_new_tokens")
    max_new_tokens = args.max_new_tokens or own or load_params().instruct.max_new_tokens
    bpe_files = source.bpe_files if args.raw_dir is None else None
    entry = {"instruction": args.instruction, "input": args.input, "output": ""}
    if bpe_files is not None:
        tokenizer = gpt2_tokenizer(*bpe_files)
    else:
        tokenizer = load_tokenizer(bpe_folder(args.raw_dir))
    context = model.cfg.context_length
    fitted = fit_to_context(tokenizer, entry, context_length=context, max_new_tokens=max_new_tokens)
    if fitted.input_cropped:
        _warn(
            f"the input is {fitted.input_tokens} tokens, too long for the model's context of {context} "
            f"tokens with the instruction and room for the answer; cropped to its first "
            f"{fitted.input_tokens_kept} tokens (the instruction and the prompt template are kept whole)"
        )
    if fitted.max_new_tokens < max_new_tokens:
        asked = (
            "--max-new-tokens"
            if args.max_new_tokens is not None
            else "the model's max_new_tokens"
            if own
            else "instruct.max_new_tokens"
        )
        _warn(
            f"{asked} {max_new_tokens} capped at {fitted.max_new_tokens}: what the model's context of "
            f"{context} tokens leaves after the {fitted.prompt_tokens}-token prompt"
        )
    answer = generate_response(
        model, tokenizer, fitted.entry, max_new_tokens=fitted.max_new_tokens, **args.sampling
    )
    if not answer.strip():
        trained = f" after {metadata['steps']} training steps" if "steps" in metadata else ""
        # The knob of the stage that trained it: a DPO model's own, else the instruction tuning's.
        section = "preference" if metadata.get("stage") == "preference-finetune" else "instruct"
        _warn(
            f"the model answered nothing{trained}: its first token was end-of-text (or only "
            "whitespace came before it). A briefly trained model often does this; train it longer "
            f"({section}.train.epochs), or rephrase the instruction"
        )
    print(answer)
    return 0


def _warn(message: str) -> None:
    print(f"gptlab chat: warning: {message}", file=sys.stderr)
