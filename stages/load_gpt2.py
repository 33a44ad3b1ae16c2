"""Stage `load-gpt2`: the base models of both fine-tunes, from OpenAI's GPT-2 or from our own.

For each distinct base model the fine-tune stages name (spam.base_model,
instruct.base_model), writes a gptlab checkpoint to models/gpt2/<name>/:
- gpt2.source huggingface: OpenAI's weights file, pinned by revision and sha256,
  taken from gpt2.download_dir/<name>/ if already there, else the mirror
  (GPTLAB_MIRROR/gpt2-weights/<name>/), else the Hugging Face cache through the
  hub client (hub_weights.py); then converted.
- gpt2.source pretrain: this pipeline's models/pretrain taken through the same
  export -> import path (its own output head kept as `lm_head.weight`, so the
  model has exactly the checkpoint's logits), so both fine-tunes can run with no
  network at all.
What it takes of our pretrained model, it reads from the pretrain checkpoint's
config.json, never from the pretrain params: a weights file says nothing of how
to compute, so each base model's config records the attention and other kernels
our pretrained model computes with (the book's masked softmax and kernels by
default, SDPA and fused ones on the fast profile), and the fine-tunes, which
rebuild their model from that config, compute as it says. Each model is then
checked as the book does: loss and perplexity on The Verdict's windows the
pretrained model was trained on (the metric names of the eval stage) and a
seeded sample. One MLflow run per model, named `load-gpt2 · <name>` (`load-gpt2 · pretrain as
<name>` with gpt2.source pretrain: our own model, whatever its folder's name) and tagged
gptlab.base_model=<name>, so each sits beside the eval stage's run of our
pretrained model in the UI with the same metric columns; all of it also goes to
reports/load-gpt2/{metrics,samples}.json. With
gpt2.source pretrain the run links the pretrain run that wrote models/pretrain, and
each checkpoint's metadata names its own load-gpt2 run, for the fine-tunes to link.
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import json
from pathlib import Path

from gptlab.data.hub_weights import weights_url
from gptlab.data.verdict import SPLITS, SUBDIR, load_split
from gptlab.files import write_json
from gptlab.model.checkpoint import load_model
from gptlab.model.generate import generate_text
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import GPT2_MODELS, PRETRAIN_MODEL, REPORTS
from gptlab.pipeline.base_models import (
    base_model_names,
    obtain_weights,
    read_pretrained,
    verdict_losses,
    write_base_model,
)
from gptlab.pipeline.params import Params
from gptlab.schema import flatten
from gptlab.tracking.runs import stage_run
from gptlab.training.runtime import resolve_device

REPORT_DIR = REPORTS / "load-gpt2"


def run(params: Params) -> None:
    cfg = params.gpt2
    names = base_model_names(params)
    # Every input first: a missing one fails before minutes of converting the others.
    pretrained = read_pretrained()
    if cfg.source == "huggingface":
        weights: dict[str, Path | None] = {name: obtain_weights(name, params) for name in names}
    else:
        weights = dict.fromkeys(names)
    tokenizer = gpt2_tokenizer(*params.data.bpe_files())
    device = resolve_device("auto")
    logged = {
        **flatten(cfg, "gpt2"),
        "spam.base_model": params.spam.base_model,
        "instruct.base_model": params.instruct.base_model,
        # As the pretrain checkpoint records them: what every base model takes of it.
        "pretrain.model.attention": pretrained.config.attention,
        "pretrain.model.kernels": pretrained.config.kernels,
        **flatten(pretrained.windows, "pretrain.data"),
        "data.processed_dir": params.data.processed_dir,
    }
    report: dict[str, dict[str, float]] = {}
    samples: dict[str, str] = {}
    for name in names:
        # With gpt2.source pretrain, the folder's GPT-2 name holds our own pretrained model.
        label = name if cfg.source == "huggingface" else f"pretrain as {name}"
        with stage_run(
            "load-gpt2",
            params.tracking.experiment,
            logged,
            system_metrics=params.tracking.system_metrics,
            run_name=f"load-gpt2 · {label}",
        ) as tracker:
            tracker.set_tags({"gptlab.base_model": name, "gptlab.source": cfg.source})
            if cfg.source == "pretrain":
                tracker.link_upstream(PRETRAIN_MODEL, pretrained.metadata)
            else:
                url = weights_url(cfg.weights[name])
                tracker.set_tags({"mlflow.note.content": f"OpenAI's {name} weights from <{url}>."})
            tracker.log_input(
                "verdict",
                Path(params.data.processed_dir) / SUBDIR,
                context="evaluation",
                profile={
                    f"{split}_tokens": len(load_split(params.data.processed_dir, split)) for split in SPLITS
                },
            )
            metadata = write_base_model(name, params, weights[name], pretrained.config)
            tracker.record_checkpoint(GPT2_MODELS / name)
            model, _ = load_model(GPT2_MODELS / name, device)  # checked as the fine-tunes will read it
            report[name] = verdict_losses(model, params, pretrained.windows, name)
            samples[name] = generate_text(model, tokenizer, cfg.sample)
            tracker.log_headline({name: report[name]})  # load-gpt2/<name>_val_loss ...
            tracker.log_text(samples[name], "load-gpt2/sample.txt")
            tracker.log_dict(
                {"model": model.cfg.to_dict(), "metadata": metadata}, "load-gpt2/base_model.json"
            )
            del model
        print(f"{label}: {json.dumps(report[name], sort_keys=True)}\n{samples[name]!r}")
    write_json(REPORT_DIR / "metrics.json", report)
    write_json(REPORT_DIR / "samples.json", samples)


if __name__ == "__main__":
    stage_main(run, __doc__)
