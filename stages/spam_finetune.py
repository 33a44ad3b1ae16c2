"""Stage `spam-finetune`: GPT-2 fine-tuned as an SMS spam classifier (chapter 6).

Reads the base model models/gpt2/<spam.base_model> (stage load-gpt2; with
`spam.base_weights: random` only its architecture, freshly drawn) and the spam
splits under data.processed_dir (stage tokenize; `spam.max_length` encodes the
messages again to another length). Swaps the LM head for a seeded 2-class head,
trains what `spam.trainable` selects with the shared loop (with `lora`, the
LoRA adapters of appendix E, added after the first accuracies as the book adds
them, and merged into the weights once trained), and writes models/spam/ (the
classifier, rebuildable alone, naming its MLflow run) and reports/spam/:
metrics.json (accuracy, precision, recall, F1, losses: DVC metrics), counts.json
(steps, examples seen, trainable parameters, each split's confusion matrix),
losses.csv, accuracy.csv, predictions.csv and confusion_matrix.png. Everything
also goes to the stage's MLflow run, which links the load-gpt2 run that wrote
its base model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import nn

from gptlab.checkpoint import load_model, read_config, save_model
from gptlab.classifier import (
    CLASS_NAMES,
    accuracy,
    classification_loss,
    classification_metrics,
    count_examples,
    count_trainable,
    make_classifier,
    predict,
)
from gptlab.config import Params
from gptlab.datasets.spam import SPLITS, SUBDIR, SpamDataset
from gptlab.distributed import is_main
from gptlab.errors import InputError
from gptlab.files import write_csv, write_figure, write_json
from gptlab.lora import add_lora, has_lora, merge_lora
from gptlab.model import GPTModel
from gptlab.paths import GPT2_MODELS, REPORTS, SPAM_MODEL
from gptlab.plots import plot_confusion_matrix
from gptlab.registry import log_model
from gptlab.runtime import ordered_loader, resolve_device
from gptlab.stage import stage_main
from gptlab.tokenizer import gpt2_tokenizer
from gptlab.tracking import StageRun, stage_run
from gptlab.train import evaluation_loader, fit
from gptlab.train_state import resume_folder
from gptlab.typed_config import flatten

STAGE = "spam-finetune"
REPORT_DIR = REPORTS / "spam"
LOSS_COLUMNS = ["step", "examples_seen", "train_loss", "val_loss"]


def run(params: Params) -> None:
    cfg = params.spam
    processed_dir = Path(params.data.processed_dir)
    base_dir = GPT2_MODELS / cfg.base_model
    device = resolve_device(cfg.train.device)
    model, base_metadata = _base_model(base_dir, cfg.base_weights, cfg.drop_rate, cfg.train.seed, device)
    model = make_classifier(
        model,
        len(CLASS_NAMES),
        trainable=cfg.trainable,
        trainable_blocks=cfg.trainable_blocks,
        seed=cfg.train.seed,
    )
    data = {split: SpamDataset(processed_dir, split) for split in SPLITS}
    if cfg.max_length is not None:
        length = model.cfg.context_length if cfg.max_length == "context" else cfg.max_length
        raw_dir = Path(params.data.raw_dir)
        tokenizer = gpt2_tokenizer(
            raw_dir / params.data.sources.gpt2_vocab_bpe.path,
            raw_dir / params.data.sources.gpt2_encoder_json.path,
        )
        for dataset in data.values():
            dataset.reencode(tokenizer, length)
    max_length = data["train"].max_length
    if max_length > model.cfg.context_length:
        raise InputError(
            f"spam messages are padded to {max_length} tokens but {base_dir} reads at most "
            f"{model.cfg.context_length}: use a base model with a longer context, or set spam.max_length "
            'to at most that ("context" pads to the model\'s context length)'
        )
    # The final scores read every split in order; the book's scores during training read the
    # loaders of train.rng (under `book` its shuffled training loader, drawing from the RNG).
    eval_batch = cfg.train.eval_batch_size or cfg.train.batch_size
    loaders = {split: ordered_loader(dataset, eval_batch) for split, dataset in data.items()}
    score_loaders = {
        split: evaluation_loader(dataset, cfg.train.batch_size, cfg.train.rng, shuffled=split == "train")
        for split, dataset in data.items()
    }
    fingerprint = {"spam": flatten(cfg), "model": model.cfg.to_dict()}
    inputs = [base_dir, processed_dir / SUBDIR]

    def eval_accuracy(split: str, trained: nn.Module, num_batches: int = cfg.train.eval_iter) -> float:
        return accuracy(trained, score_loaders[split], cfg.pooling, num_batches=num_batches)

    logged = {"data.processed_dir": params.data.processed_dir, **flatten(cfg, "spam")}
    with (
        stage_run(
            STAGE,
            params.tracking.experiment,
            logged,
            system_metrics=params.tracking.system_metrics,
            sweep=params.tracking.sweep,
            sweep_variant=params.tracking.sweep_variant,
        ) as tracker,
        resume_folder(STAGE, fingerprint, inputs) as run_dir,
    ):
        tracker.link_upstream(base_dir, base_metadata)
        tracker.log_input(
            "spam",
            processed_dir / SUBDIR,
            context="training",
            profile={f"{split}_rows": len(dataset) for split, dataset in data.items()},
        )
        # As the book prints before training: accuracy of the fresh head, seeded as the book seeds it.
        torch.manual_seed(cfg.train.seed)
        initial = {
            f"{split}_accuracy": eval_accuracy(split, model, cfg.initial_eval_batches) for split in SPLITS
        }
        tracker.log_metrics(flatten({"initial": initial}), step=0)
        print("before training: " + _percentages(initial))
        if cfg.trainable == "lora":
            # Appendix E's order: the accuracies above, then the model frozen and every linear layer
            # wrapped; A is drawn from the RNG as it stands after them (B is zero: same accuracies).
            add_lora(model, cfg.lora.rank, cfg.lora.alpha)
        trainable = count_trainable(model)
        tracker.set_tags({"gptlab.base_model": cfg.base_model, "gptlab.trainable_params": trainable})
        print(
            f"{cfg.base_model}: {trainable:,} of {sum(p.numel() for p in model.parameters()):,} params train"
            + (f" (LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g})" if cfg.trainable == "lora" else "")
        )

        def on_epoch_end(epoch: int, trained: nn.Module) -> dict[str, float]:
            scores = {f"{split}_accuracy": eval_accuracy(split, trained) for split in ("train", "val")}
            print(f"epoch {epoch}: " + _percentages(scores))
            return scores

        torch.manual_seed(cfg.train.seed)  # the book seeds again before the optimizer and training
        result = fit(
            model,
            data["train"],
            data["val"],
            cfg=cfg.train,
            loss_fn=classification_loss(cfg.pooling),
            run_dir=run_dir,
            seen_name="examples_seen",
            count_seen=count_examples,
            tracker=tracker,
            on_epoch_end=on_epoch_end,
        )
        if not is_main():  # another torchrun process: rank 0 writes the outputs
            return
        if has_lora(model):
            # The adapters folded into the weights: the model scored below is the one saved, a plain
            # classifier with GPT-2's tensor names that every reader of checkpoints loads as it is.
            merge_lora(model)

        # Final scores over the full splits, as the book's last evaluation.
        predictions = {split: predict(model, loaders[split], cfg.pooling, desc=split) for split in SPLITS}
        final = {
            split: classification_metrics(actual, predicted)
            for split, (actual, predicted, _) in predictions.items()
        }
        print("after training: " + _percentages({f"{s}_accuracy": m["accuracy"] for s, m in final.items()}))
        metrics: dict[str, Any] = {
            "initial": initial,
            **{
                split: {name: scores[name] for name in ("accuracy", "precision", "recall", "f1")}
                for split, scores in final.items()
            },
        }
        counts: dict[str, Any] = {
            "examples_seen": result.seen,
            "steps": result.steps,
            "trainable_params": trainable,
            "confusion_matrix": {split: _confusion_counts(scores) for split, scores in final.items()},
        }
        if result.history:
            metrics["final_train_loss"] = result.history[-1]["train_loss"]
            metrics["final_val_loss"] = result.history[-1]["val_loss"]

        save_model(
            model,
            SPAM_MODEL,
            {
                "labels": {str(index): name for index, name in enumerate(CLASS_NAMES)},
                "max_length": max_length,
                "pooling": cfg.pooling,
                "base_model": cfg.base_model,
                "base_weights": cfg.base_weights,
                "base_metadata": base_metadata,
                "trainable": cfg.trainable,
                "trainable_params": trainable,
                **(
                    {"lora": {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "merged": True}}
                    if cfg.trainable == "lora"
                    else {}
                ),
                "metrics": {split: metrics[split] for split in SPLITS},
                "stage": STAGE,
            },
        )
        tracker.record_checkpoint(SPAM_MODEL)
        test_actual, test_predicted, test_probs = predictions["test"]
        _write_reports(metrics, counts, result.history, result.epochs, initial, test_actual, test_predicted)
        figure = plot_confusion_matrix(
            final["test"]["confusion_matrix"], CLASS_NAMES, "spam-finetune: test set"
        )
        write_figure(REPORT_DIR / "confusion_matrix.png", figure)
        _log_run(
            tracker,
            metrics,
            counts,
            final,
            data["test"],
            (test_actual, test_predicted, test_probs),
            figure,
            step=result.global_step,
        )
        # Time is no DVC metric (it differs run to run): MLflow only, as the sweep table reads it.
        tracker.log_metrics(
            {"wall_seconds": result.wall_seconds, "examples_per_second": result.seen_per_second},
            step=result.global_step,
        )
        if params.tracking.log_models:
            log_model(
                tracker,
                "spam",
                SPAM_MODEL,
                experiment=params.tracking.experiment,
                bpe_files=(
                    Path(params.data.raw_dir) / params.data.sources.gpt2_vocab_bpe.path,
                    Path(params.data.raw_dir) / params.data.sources.gpt2_encoder_json.path,
                ),
                defaults={},
            )


def _base_model(
    base_dir: Path, weights: str, drop_rate: float, seed: int, device: torch.device
) -> tuple[GPTModel, dict[str, Any]]:
    """The language model to fine-tune: the load-gpt2 checkpoint, or its architecture freshly drawn.

    `random` seeds, then builds the model on the CPU (the book's draws on any device) and
    moves it, as the bonus script's `--weights random` does.
    """
    if weights == "random":
        base_cfg, base_metadata = read_config(base_dir)
        _check_language_model(base_cfg.num_classes, base_dir)
        torch.manual_seed(seed)
        model = GPTModel(dataclasses.replace(base_cfg, drop_rate=drop_rate))
        return model.to(device).eval(), base_metadata
    model, base_metadata = load_model(base_dir, device, drop_rate=drop_rate)
    _check_language_model(model.cfg.num_classes, base_dir)
    return model, base_metadata


def _check_language_model(num_classes: int | None, base_dir: Path) -> None:
    if num_classes is not None:
        raise InputError(
            f"{base_dir} is already a classifier: spam.base_model must name a GPT-2 language model"
        )


def _percentages(scores: dict[str, float]) -> str:
    return " | ".join(f"{name.replace('_', ' ')} {value * 100:.2f}%" for name, value in scores.items())


def _confusion_counts(scores: dict[str, Any]) -> dict[str, dict[str, int]]:
    """One split's confusion matrix keyed by label names (rows actual, columns predicted)."""
    return {
        f"actual_{CLASS_NAMES[i]}": {f"predicted_{CLASS_NAMES[j]}": n for j, n in enumerate(row)}
        for i, row in enumerate(scores["confusion_matrix"])
    }


def _write_reports(
    metrics: dict[str, Any],
    counts: dict[str, Any],
    history: list[dict[str, Any]],
    epochs: list[dict[str, Any]],
    initial: dict[str, float],
    actual: np.ndarray,
    predicted: np.ndarray,
) -> None:
    write_json(REPORT_DIR / "metrics.json", metrics)
    write_json(REPORT_DIR / "counts.json", counts)
    write_csv(REPORT_DIR / "losses.csv", pd.DataFrame(history, columns=LOSS_COLUMNS))
    # Epoch 0 is the fresh head, before any training step.
    start = {"epoch": 0, "train_accuracy": initial["train_accuracy"], "val_accuracy": initial["val_accuracy"]}
    curve = pd.DataFrame([start, *epochs], columns=["epoch", "train_accuracy", "val_accuracy"])
    write_csv(REPORT_DIR / "accuracy.csv", curve)
    names = np.array(CLASS_NAMES)
    write_csv(
        REPORT_DIR / "predictions.csv", pd.DataFrame({"actual": names[actual], "predicted": names[predicted]})
    )


def _log_run(
    tracker: StageRun,
    metrics: dict[str, Any],
    counts: dict[str, Any],
    final: dict[str, dict[str, Any]],
    test_set: SpamDataset,
    test_predictions: tuple[np.ndarray, np.ndarray, np.ndarray],
    figure: Figure,
    *,
    step: int,
) -> None:
    actual, predicted, probs = test_predictions
    # The initial accuracies were logged at step 0, before training; the final scores at the last step.
    tracker.log_metrics(flatten({k: v for k, v in metrics.items() if k != "initial"}), step=step)
    tracker.set_tags({f"gptlab.{name}": counts[name] for name in ("examples_seen", "steps")})
    for split, scores in final.items():
        tracker.log_dict(
            {
                "labels": list(CLASS_NAMES),
                "rows": "actual",
                "columns": "predicted",
                "matrix": scores["confusion_matrix"],
            },
            f"spam/confusion_matrix_{split}.json",
        )
    tracker.log_figure(figure, "spam/confusion_matrix.png")
    tracker.log_table(
        pd.DataFrame(
            {
                "text": test_set.texts,
                "actual": [CLASS_NAMES[i] for i in actual],
                "predicted": [CLASS_NAMES[i] for i in predicted],
                "spam_probability": probs[:, CLASS_NAMES.index("spam")],
            }
        ),
        "spam/test_predictions.json",
    )
    tracker.log_reports(REPORT_DIR, "spam/reports", skip=("confusion_matrix.png",))


if __name__ == "__main__":
    stage_main(run, __doc__)
