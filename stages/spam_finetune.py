"""Stage `spam-finetune`: GPT-2 fine-tuned as an SMS spam classifier (chapter 6).

Reads the base model models/gpt2/<spam.base_model> (stage load-gpt2; with
`spam.base_weights: random` only its architecture, freshly drawn) and the spam
splits under data.processed_dir (stage tokenize; `spam.max_length` encodes the
messages again to another length). Swaps the LM head for a seeded 2-class head,
trains what `spam.trainable` selects with the shared loop (with `lora`, the
LoRA adapters of appendix E, added after the first accuracies as the book adds
them, and merged into the weights once trained), and writes models/spam/ (the
classifier, rebuildable alone) and reports/spam/:
metrics.json (accuracy, precision, recall, F1, losses: DVC metrics), counts.json
(steps, examples seen, trainable parameters, each split's confusion matrix),
losses.csv, accuracy.csv, predictions.csv and confusion_matrix.png. Everything
also goes to the stage's MLflow run, which links the load-gpt2 run that wrote
its base model.
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import dataclasses
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gptlab.data.spam import SPLITS, SUBDIR, SpamDataset
from gptlab.errors import InputError
from gptlab.files import write_csv, write_figure
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import load_model, read_config
from gptlab.model.gpt import GPTModel
from gptlab.model.lora import add_lora, has_lora, merge_lora
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import GPT2_MODELS, REPORTS, SPAM_MODEL
from gptlab.pipeline.params import Params
from gptlab.pipeline.plots import plot_accuracy, plot_confusion_matrix
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
    CLASS_NAMES,
    accuracy,
    classification_loss,
    classification_metrics,
    count_examples,
    make_classifier,
    predict,
)
from gptlab.tasks.config import SpamConfig
from gptlab.tasks.fine_tune import adds_lora, require_language_model
from gptlab.tasks.frozen_trunk import FrozenTrunk, spam_trunk
from gptlab.tracking.runs import StageRun, section
from gptlab.training.data_order import evaluation_loader
from gptlab.training.loop import TrainResult, require_one_batch
from gptlab.training.resume import RUNS_DIR
from gptlab.training.runtime import ordered_loader, resolve_device

STAGE = "spam-finetune"
REPORT_DIR = REPORTS / "spam"
LOSS_COLUMNS = ["step", "examples_seen", "train_loss", "val_loss"]
SCORES = ("accuracy", "precision", "recall", "f1")
# spam params no number depends on: left out of the resume folder's fingerprint.
OPERATIONAL = ("cache_frozen_trunk",)
Predictions = tuple[np.ndarray, np.ndarray, np.ndarray]  # actual, predicted, class probabilities


def run(params: Params) -> None:
    cfg = params.spam
    base_dir = GPT2_MODELS / cfg.base_model
    model, base_metadata, data = _classifier_and_data(params, base_dir)
    # The book's scores during training read the loaders of train.rng (under `book` its
    # shuffled training loader, drawing from the RNG); the final scores read each split in order.
    score_loaders = {
        split: evaluation_loader(dataset, cfg.train.batch_size, cfg.train.rng, shuffled=split == "train")
        for split, dataset in data.items()
    }

    def eval_accuracy(split: str, trained: nn.Module, num_batches: int = cfg.train.eval_iter) -> float:
        return accuracy(
            trained, score_loaders[split], cfg.pooling, num_batches=num_batches, precision=cfg.train.precision
        )

    with (
        _training_run(params, model, data, base_dir, base_metadata) as stage,
        spam_trunk(model, data, cfg, RUNS_DIR / STAGE) as trunk,
    ):
        _report_trunk(stage.tracker, trunk)
        # As the book prints before training: accuracy of the fresh head, seeded as the book seeds it.
        torch.manual_seed(cfg.train.seed)
        initial = {
            f"{s}_accuracy": eval_accuracy(s, trunk.view(model), cfg.initial_eval_batches) for s in SPLITS
        }
        stage.tracker.log_metrics(section("initial", initial), step=0)
        print("before training: " + _percentages(initial))
        if adds_lora(cfg.trainable):
            # Appendix E's order: the accuracies above, then the model frozen and every linear layer
            # wrapped; A is drawn from the RNG as it stands after them (B is zero: same accuracies).
            add_lora(model, cfg.lora.rank, cfg.lora.alpha)
        trainable = stage.report_trainable(model, cfg.base_model, cfg.trainable, cfg.lora)

        def on_epoch_end(epoch: int, trained: nn.Module) -> dict[str, float]:
            scores = {
                f"{split}_accuracy": eval_accuracy(split, trunk.view(trained)) for split in ("train", "val")
            }
            print(f"epoch {epoch}: " + _percentages(scores))
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
        predictions, final = _final_scores(trunk.view(model), data, cfg)
        metrics, counts = _metrics_and_counts(initial, final, result, trainable)
        _write_and_log_scores(stage.tracker, initial, result.epochs, final, data["test"], predictions["test"])
        metadata = _model_metadata(cfg, data["train"].max_length, base_metadata, trainable, metrics)
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
    cfg: SpamConfig, max_length: int, base_metadata: dict[str, Any], trainable: int, metrics: dict[str, Any]
) -> dict[str, Any]:
    """What the classifier's checkpoint records: labels, input length, pooling, base model, scores."""
    return {
        "labels": {str(index): name for index, name in enumerate(CLASS_NAMES)},
        "max_length": max_length,
        "pooling": cfg.pooling,
        "base_model": cfg.base_model,
        "base_weights": cfg.base_weights,
        "base_metadata": base_metadata,
        **trainable_metadata(cfg.trainable, trainable, cfg.lora),
        "metrics": {split: metrics[split] for split in SPLITS},
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
    model, base_metadata = _base_model(base_dir, cfg.base_weights, cfg.drop_rate, cfg.train.seed, device)
    model = make_classifier(
        model,
        len(CLASS_NAMES),
        trainable=cfg.trainable,
        trainable_blocks=cfg.trainable_blocks,
        seed=cfg.train.seed,
    )
    _fit_to_context(params, data, model.cfg.context_length, base_dir)
    return model, base_metadata, data


def _fit_to_context(
    params: Params, data: dict[str, SpamDataset], context_length: int, base_dir: Path
) -> None:
    """The splits encoded again to `spam.max_length` when it is set (in place), checked against the context."""
    cfg = params.spam
    if cfg.max_length is not None:
        length = context_length if cfg.max_length == "context" else cfg.max_length
        tokenizer = gpt2_tokenizer(*params.data.bpe_files())
        for dataset in data.values():
            dataset.reencode(tokenizer, length)
    max_length = data["train"].max_length
    if max_length > context_length:
        raise InputError(
            f"spam messages are padded to {max_length} tokens but {base_dir} reads at most "
            f"{context_length}: use a base model with a longer context, or set spam.max_length "
            'to at most that ("context" pads to the model\'s context length)'
        )


def _final_scores(
    model: nn.Module, data: dict[str, SpamDataset], cfg: SpamConfig
) -> tuple[dict[str, Predictions], dict[str, dict[str, Any]]]:
    """Predictions and scores over the full splits, as the book's last evaluation."""
    batch_size = cfg.train.eval_batch_size or cfg.train.batch_size
    predictions = {
        split: predict(
            model, ordered_loader(dataset, batch_size), cfg.pooling, desc=split, precision=cfg.train.precision
        )
        for split, dataset in data.items()
    }
    final = {
        split: classification_metrics(actual, predicted)
        for split, (actual, predicted, _) in predictions.items()
    }
    print("after training: " + _percentages({f"{s}_accuracy": m["accuracy"] for s, m in final.items()}))
    return predictions, final


def _metrics_and_counts(
    initial: dict[str, float], final: dict[str, dict[str, Any]], result: TrainResult, trainable: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """DVC's metrics (scores, last losses) and the counts beside them (steps, confusion matrices)."""
    metrics: dict[str, Any] = {
        "initial": initial,
        **{split: {name: scores[name] for name in SCORES} for split, scores in final.items()},
    }
    if result.history:
        metrics["final_train_loss"] = result.history[-1]["train_loss"]
        metrics["final_val_loss"] = result.history[-1]["val_loss"]
    counts = {
        "examples_seen": result.seen,
        "steps": result.steps,
        "trainable_params": trainable,
        "confusion_matrix": {split: _confusion_counts(scores) for split, scores in final.items()},
    }
    return metrics, counts


def _base_model(
    base_dir: Path, weights: str, drop_rate: float, seed: int, device: torch.device
) -> tuple[GPTModel, dict[str, Any]]:
    """The language model to fine-tune: the load-gpt2 checkpoint, or its architecture freshly drawn.

    `random` seeds, then builds the model on the CPU (the book's draws on any device) and
    moves it, as the bonus script's `--weights random` does.
    """
    if weights == "random":
        base_cfg, base_metadata = read_config(base_dir)
        require_language_model(base_cfg, base_dir, "spam.base_model")
        torch.manual_seed(seed)
        model = build_gpt(dataclasses.replace(base_cfg, drop_rate=drop_rate))
        return model.to(device).eval(), base_metadata
    model, base_metadata = load_model(base_dir, device, drop_rate=drop_rate)
    require_language_model(model.cfg, base_dir, "spam.base_model")
    return model, base_metadata


def _percentages(scores: dict[str, float]) -> str:
    return " | ".join(f"{name.replace('_', ' ')} {value * 100:.2f}%" for name, value in scores.items())


def _confusion_counts(scores: dict[str, Any]) -> dict[str, dict[str, int]]:
    """One split's confusion matrix keyed by label names (rows actual, columns predicted)."""
    return {
        f"actual_{CLASS_NAMES[i]}": {f"predicted_{CLASS_NAMES[j]}": n for j, n in enumerate(row)}
        for i, row in enumerate(scores["confusion_matrix"])
    }


def _write_and_log_scores(
    tracker: StageRun,
    initial: dict[str, float],
    epochs: list[dict[str, Any]],
    final: dict[str, dict[str, Any]],
    test_set: SpamDataset,
    test_predictions: Predictions,
) -> None:
    """Chapter 6's own reports: the accuracy curve (and its figure), the test predictions, the confusion matrices."""
    import pandas as pd  # at the end of the run, not with the stage

    # Epoch 0 is the fresh head, before any training step.
    start = {"epoch": 0, "train_accuracy": initial["train_accuracy"], "val_accuracy": initial["val_accuracy"]}
    curve = pd.DataFrame([start, *epochs], columns=["epoch", "train_accuracy", "val_accuracy"])
    write_csv(REPORT_DIR / "accuracy.csv", curve)
    tracker.log_figure(plot_accuracy(curve.to_dict("records")), "spam/accuracy.png")
    actual, predicted, probs = test_predictions
    names = np.array(CLASS_NAMES)
    write_csv(
        REPORT_DIR / "predictions.csv", pd.DataFrame({"actual": names[actual], "predicted": names[predicted]})
    )
    figure = plot_confusion_matrix(final["test"]["confusion_matrix"], CLASS_NAMES, "spam-finetune: test set")
    write_figure(REPORT_DIR / "confusion_matrix.png", figure)
    tracker.log_figure(figure, "spam/confusion_matrix.png")
    for split, scores in final.items():
        matrix = {"labels": list(CLASS_NAMES), "rows": "actual", "columns": "predicted"}
        tracker.log_dict(
            {**matrix, "matrix": scores["confusion_matrix"]}, f"spam/confusion_matrix_{split}.json"
        )
    table = {
        "text": test_set.texts,
        "actual": [CLASS_NAMES[i] for i in actual],
        "predicted": [CLASS_NAMES[i] for i in predicted],
        "spam_probability": probs[:, CLASS_NAMES.index("spam")],
    }
    tracker.log_table(pd.DataFrame(table), "spam/test_predictions.json")


if __name__ == "__main__":
    stage_main(run, __doc__)
