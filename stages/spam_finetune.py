"""Stage `spam-finetune`: GPT-2 fine-tuned as an SMS spam classifier (chapter 6).

Reads the base model models/gpt2/<spam.base_model> (stage load-gpt2; with
`spam.base_weights: random` only its architecture, freshly drawn) and the spam
splits under data.processed_dir (stage tokenize: the SMS collection's ham and spam,
or the classes of your own file; `spam.max_length` encodes the
messages again to another length). Swaps the LM head for a seeded head of one
output per class,
trains what `spam.trainable` selects with the shared loop (with `lora`, the
LoRA adapters of appendix E, added after the first accuracies as the book adds
them, and merged into the weights once trained), and writes models/spam/ (the
classifier, rebuildable alone) and reports/spam/:
metrics.json (accuracy; precision, recall and F1 of spam (of the second class
with two); each class's and their macro averages; losses: DVC metrics), counts.json
(steps, examples seen, trainable parameters, each split's N x N confusion matrix),
losses.csv, accuracy.csv, predictions.csv and confusion_matrix.png. Everything
also goes to the stage's MLflow run, which links the load-gpt2 run that wrote
its base model.
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptlab.data.spam import SPLITS, SUBDIR, SpamDataset, fit_to_context
from gptlab.model.gpt import GPTModel
from gptlab.model.lora import add_lora, has_lora, merge_lora
from gptlab.paths import GPT2_MODELS, REPORTS, SPAM_MODEL
from gptlab.pipeline.classifier_reports import write_and_log_scores
from gptlab.pipeline.params import Params
from gptlab.pipeline.training_stage import (
    DatasetRead,
    Reports,
    TrainingRun,
    loss_table,
    trainable_metadata,
    training_run,
)
from gptlab.schema import flatten
from gptlab.tasks.classifier import (
    SplitAccuracies,
    classification_loss,
    count_examples,
    headline_scores,
    make_classifier,
    metrics_and_counts,
    percentages,
    score_splits,
)
from gptlab.tasks.config import SpamConfig
from gptlab.tasks.fine_tune import adds_lora, base_language_model
from gptlab.tasks.frozen_trunk import FrozenTrunk, spam_trunk
from gptlab.tracking.buffered_run import StageRun
from gptlab.training.loop import require_one_batch
from gptlab.training.resume import RUNS_DIR
from gptlab.training.runtime import resolve_device

STAGE = "spam-finetune"
REPORT_DIR = REPORTS / "spam"
LOSS_COLUMNS = ["step", "examples_seen", "train_loss", "val_loss"]
# spam params no number depends on: left out of the resume folder's fingerprint.
OPERATIONAL = ("cache_frozen_trunk",)


def run(params: Params) -> None:
    cfg = params.spam
    base_dir = GPT2_MODELS / cfg.base_model
    model, base_metadata, data = _classifier_and_data(params, base_dir)
    accuracies = SplitAccuracies(data, cfg.train, cfg.pooling, cfg.train.eval_iter)
    with (
        _training_run(params, model, data, base_dir, base_metadata) as stage,
        spam_trunk(model, data, cfg, RUNS_DIR / STAGE) as trunk,
    ):
        _report_trunk(stage.tracker, trunk)
        # As the book prints before training: accuracy of the fresh head, seeded as the book seeds it.
        torch.manual_seed(cfg.train.seed)
        initial = accuracies(trunk.view(model), SPLITS, cfg.initial_eval_batches)
        stage.tracker.log_values(initial, "initial", step=0)
        print("before training: " + percentages(initial))
        if adds_lora(cfg.trainable):
            # Appendix E's order: the accuracies above, then the model frozen and every linear layer
            # wrapped; A is drawn from the RNG as it stands after them (B is zero: same accuracies).
            add_lora(model, cfg.lora.rank, cfg.lora.alpha)
        base = {"source": "random"} if cfg.base_weights == "random" else base_metadata
        trainable = stage.report_trainable(model, cfg.base_model, cfg.trainable, cfg.lora, base)

        def on_epoch_end(epoch: int, trained: nn.Module) -> dict[str, float]:
            scores = accuracies(trunk.view(trained), ("train", "val"))
            print(f"epoch {epoch}: " + percentages(scores))
            return scores

        torch.manual_seed(cfg.train.seed)  # the book seeds again before the optimizer and training
        result = stage.fit(
            model,
            data["train"],
            data["val"],
            cfg.train,
            trunk.loss(classification_loss(cfg.pooling)),
            seen_name="examples_seen",
            count_seen=count_examples,
            on_epoch_end=on_epoch_end,
        )
        if not stage.main:  # another torchrun process: rank 0 writes the outputs
            return
        if has_lora(model):
            # The adapters folded into the weights: the model scored below is the one saved, a plain
            # classifier with GPT-2's tensor names that every reader of checkpoints loads as it is.
            merge_lora(model)
        batch_size = cfg.train.eval_batch_size or cfg.train.batch_size
        predictions, final = score_splits(
            trunk.view(model), data, cfg.pooling, batch_size, cfg.train.precision
        )
        print("after training: " + percentages({f"{s}_accuracy": m["accuracy"] for s, m in final.items()}))
        class_names = data["train"].class_names
        metrics, counts = metrics_and_counts(initial, final, result, trainable, class_names)
        write_and_log_scores(
            stage.tracker, REPORT_DIR, initial, result.epochs, final, data["test"], predictions["test"]
        )
        metadata = _model_metadata(cfg, data["train"], base_metadata, trainable, metrics)
        reports = Reports(REPORT_DIR, metrics, counts, loss_table(result.history, LOSS_COLUMNS))
        stage.publish(
            model,
            SPAM_MODEL,
            metadata,
            reports,
            result,
            kind="spam",
            model_defaults={},
            skip=("confusion_matrix.png",),
        )


def _training_run(
    params: Params,
    model: GPTModel,
    data: dict[str, SpamDataset],
    base_dir: Path,
    base_metadata: dict[str, Any],
) -> AbstractContextManager[TrainingRun]:
    """The stage's MLflow run and resume folder, keyed by what determines its numbers."""
    cfg = params.spam
    spam_dir = Path(params.data.processed_dir) / SUBDIR
    return training_run(
        STAGE,
        params,
        logged={"data.processed_dir": params.data.processed_dir, **flatten(cfg, "spam")},
        fingerprint={
            "spam": {k: v for k, v in flatten(cfg).items() if k not in OPERATIONAL},
            "model": model.cfg.to_dict(),
        },
        inputs=[base_dir, spam_dir],
        dataset=DatasetRead("spam", spam_dir, {f"{s}_rows": len(d) for s, d in data.items()}),
        upstream=(base_dir, base_metadata),
    )


def _report_trunk(tracker: StageRun, trunk: FrozenTrunk) -> None:
    """Which path the stage takes, and why: the frozen trunk computed once, or every pass."""
    tracker.log_params({"spam.frozen_trunk_cache": trunk.summary})
    took = f" in {trunk.seconds:.1f} s" if trunk.cached else ""
    print(f"frozen trunk cache {trunk.summary}{took}")


def _model_metadata(
    cfg: SpamConfig,
    train: SpamDataset,
    base_metadata: dict[str, Any],
    trainable: int,
    metrics: dict[str, Any],
) -> dict[str, Any]:
    """What the classifier's checkpoint records: labels, input length, pooling, base model, scores."""
    return {
        "labels": {str(index): name for index, name in enumerate(train.class_names)},
        "max_length": train.max_length,
        "pooling": cfg.pooling,
        "base_model": cfg.base_model,
        "base_weights": cfg.base_weights,
        "base_metadata": base_metadata,
        **trainable_metadata(cfg.trainable, trainable, cfg.lora),
        "metrics": {split: headline_scores(metrics[split]) for split in SPLITS},
        "stage": STAGE,
    }


def _classifier_and_data(
    params: Params, base_dir: Path
) -> tuple[GPTModel, dict[str, Any], dict[str, SpamDataset]]:
    """The base model with its new seeded head (and its metadata), and the splits it reads."""
    cfg = params.spam
    data = {split: SpamDataset(Path(params.data.processed_dir), split) for split in SPLITS}
    require_one_batch(len(data["train"]), cfg.train.batch_size, "spam.train.batch_size")  # before the model
    device = resolve_device(cfg.train.device)
    model, base_metadata = base_language_model(
        base_dir, cfg.base_weights, cfg.drop_rate, cfg.train.seed, device, "spam.base_model"
    )
    model = make_classifier(
        model,
        len(data["train"].class_names),
        trainable=cfg.trainable,
        trainable_blocks=cfg.trainable_blocks,
        seed=cfg.train.seed,
    )
    fit_to_context(data, cfg.max_length, model.cfg.context_length, params.data.bpe_files(), base_dir)
    return model, base_metadata, data


if __name__ == "__main__":
    stage_main(run, __doc__, trains=True)
