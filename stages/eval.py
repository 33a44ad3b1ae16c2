"""Stage `eval`: the pretrained model's loss, perplexity and samples (end of chapter 5).

Rebuilds the model from models/pretrain/ alone (its own config, not the
pretrain params), scores every window of The Verdict's train and validation
splits (windows and stride = the model's context length; a corpus: the fixed
sample of pretrain.data.eval_windows windows of each split), and generates the
samples of params `eval.samples`. Writes reports/eval/metrics.json and
reports/eval/samples.json; the MLflow run (and its pipeline run's) logs them as
eval/train_loss, eval/val_loss, eval/train_perplexity and eval/val_perplexity.
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import json

from gptlab.files import write_json
from gptlab.model.checkpoint import load_model
from gptlab.model.generate import generate_text
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import PRETRAIN_MODEL, REPORTS
from gptlab.pipeline.params import Params
from gptlab.pipeline.pretrain_data import pretrain_windows
from gptlab.schema import flatten
from gptlab.tracking.runs import stage_run
from gptlab.training.losses import split_losses
from gptlab.training.runtime import resolve_device

STAGE = "eval"
REPORT_DIR = REPORTS / "eval"


def run(params: Params) -> None:
    cfg = params.eval
    model, checkpoint_metadata = load_model(PRETRAIN_MODEL, resolve_device("auto"))
    tokenizer = gpt2_tokenizer(*params.data.bpe_files())
    data = pretrain_windows(params, length=model.cfg.context_length)
    logged = {"data.processed_dir": params.data.processed_dir, **flatten(cfg, "eval")}
    with stage_run(
        STAGE, params.tracking.experiment, logged, system_metrics=params.tracking.system_metrics
    ) as tracker:
        tracker.set_tags({"gptlab.checkpoint": PRETRAIN_MODEL.as_posix()})
        tracker.link_upstream(PRETRAIN_MODEL, checkpoint_metadata)
        tracker.log_input(data.name, data.folder, context="evaluation", profile=data.profile)
        metrics = split_losses(model, data.scored, cfg.batch_size)
        samples = {
            name: {**flatten(sample), "text": generate_text(model, tokenizer, sample)}
            for name, sample in cfg.samples.items()
        }
        for name, sample in samples.items():
            print(f"{name}: {sample['text']!r}")
        write_json(REPORT_DIR / "metrics.json", metrics)
        write_json(REPORT_DIR / "samples.json", samples)
        tracker.log_headline(metrics)
        tracker.log_dict(samples, "eval/samples.json")
        for name, sample in samples.items():
            tracker.log_text(sample["text"], f"eval/samples/{name}.txt")
    print(json.dumps(metrics, indent=2, sort_keys=True))


if __name__ == "__main__":
    stage_main(run, __doc__)
