"""GPT-2 as a text classifier (chapter 6): head surgery, pooling, loss, accuracy and metrics.

The language-model head is swapped for a small `Linear(emb_dim, num_classes)`
and only the parts `spam.trainable` names keep gradients (gptlab.tasks.fine_tune).
A sequence's class logits come from its last token's output, as in the book
(under causal attention only the last position has seen the whole text), from
its first token's, from the mean over its non-padding positions, or from the
mean over every position, padding included (the "pooled embeddings" of chapter
6's bonus experiments).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import tiktoken
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from gptlab.data.spam import LABELS, SpamDataset, encode_texts, pad_ids
from gptlab.model.gpt import GPTModel
from gptlab.model.tokenizer import END_OF_TEXT_ID
from gptlab.tasks.config import Pooling, Trainable
from gptlab.tasks.fine_tune import select_trainable
from gptlab.training.config import TrainConfig
from gptlab.training.data_order import evaluation_loader
from gptlab.training.loop import TrainResult
from gptlab.training.runtime import Precision, autocast, ordered_loader

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]

# Padding id of the spam datasets (and of `gptlab classify`); mean pooling skips it.
PAD_TOKEN_ID = END_OF_TEXT_ID
# The SMS collection's class names by class id, ("ham", "spam"), as the tokenize stage labels the messages
# (your own file's are the datasets' `class_names`).
CLASS_NAMES: tuple[str, ...] = tuple(sorted(LABELS, key=LABELS.__getitem__))


def make_classifier(
    model: GPTModel, num_classes: int, *, trainable: Trainable, trainable_blocks: int, seed: int
) -> GPTModel:
    """Replace the LM head by a fresh classification head and choose what trains (in place).

    The head is created right after seeding so its initial weights are reproducible
    (the book seeds 123); `select_trainable` then lets what `trainable` names train
    (with `lora`, nothing yet: the stage adds the adapters). The config records
    `num_classes`, so a saved classifier is rebuilt with its head by
    `checkpoint.load_model`.
    """
    weight = model.final_norm.scale
    torch.manual_seed(seed)
    model.out_head = nn.Linear(model.cfg.emb_dim, num_classes).to(device=weight.device, dtype=weight.dtype)
    model.cfg = dataclasses.replace(model.cfg, num_classes=num_classes)
    select_trainable(model, trainable, trainable_blocks)
    return model


def count_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def class_logits(model: nn.Module, input_ids: torch.Tensor, pooling: Pooling = "last") -> torch.Tensor:
    """(b, num_classes) logits for token ids (b, t): of the last or first token, or a mean over tokens.

    `mean` averages the non-padding positions, `mean_all` every position (the bonus
    script's `--average_embeddings`, which averages the padding's outputs too).
    """
    logits = model(input_ids).float()  # (b, t, num_classes); fp32 even under bf16 autocast
    if pooling == "last":
        return logits[:, -1, :]
    if pooling == "first":
        return logits[:, 0, :]
    # The head is affine, so averaging logits equals classifying the averaged hidden state.
    if pooling == "mean_all":
        return logits.mean(dim=1)
    assert pooling == "mean", f"unknown pooling {pooling!r}"
    keep = (input_ids != PAD_TOKEN_ID).unsqueeze(-1).to(logits.dtype)  # (b, t, 1)
    return (logits * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)  # (b, num_classes)


def last_token_classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross entropy of the last token's class logits against the labels (the book's calc_loss_batch)."""
    input_ids, labels = batch
    return F.cross_entropy(class_logits(model, input_ids, "last"), labels)


def first_token_classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross entropy of the first token's class logits (the bonus script's `--trainable_token_pos first`)."""
    input_ids, labels = batch
    return F.cross_entropy(class_logits(model, input_ids, "first"), labels)


def mean_pooled_classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross entropy of the class logits averaged over non-padding tokens."""
    input_ids, labels = batch
    return F.cross_entropy(class_logits(model, input_ids, "mean"), labels)


def all_positions_classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross entropy of the class logits averaged over every position, padding included."""
    input_ids, labels = batch
    return F.cross_entropy(class_logits(model, input_ids, "mean_all"), labels)


def classification_loss(pooling: Pooling) -> LossFn:
    """The training loss for a pooling choice (spam.pooling, checked by the params schema), as the loop calls it."""
    losses: dict[str, LossFn] = {
        "last": last_token_classification_loss,
        "first": first_token_classification_loss,
        "mean": mean_pooled_classification_loss,
        "mean_all": all_positions_classification_loss,
    }
    return losses[pooling]


def count_examples(batch: Batch) -> int:
    """Examples in a batch: the progress measure of classification training (the book's examples_seen)."""
    return int(batch[0].shape[0])


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class SplitAccuracies:
    """The accuracies the book prints during training: a few batches of each split's loader.

    The loaders are those of `train.rng` (under `book` the shuffled training loader draws
    from the global RNG at each pass, as the book's does), made once and read again.
    """

    def __init__(
        self, datasets: dict[str, Dataset], train: TrainConfig, pooling: Pooling, num_batches: int
    ) -> None:
        self.loaders = {
            split: evaluation_loader(dataset, train.batch_size, train.rng, shuffled=split == "train")
            for split, dataset in datasets.items()
        }
        self.pooling, self.precision, self.num_batches = pooling, train.precision, num_batches

    def __call__(
        self, model: nn.Module, splits: Iterable[str], num_batches: int | None = None
    ) -> dict[str, float]:
        """`{split}_accuracy` of each split in turn, over `num_batches` (default: the configured number)."""
        batches = self.num_batches if num_batches is None else num_batches
        return {
            f"{split}_accuracy": accuracy(
                model, self.loaders[split], self.pooling, num_batches=batches, precision=self.precision
            )
            for split in splits
        }


@torch.inference_mode()
def accuracy(
    model: nn.Module,
    loader: Iterable[Batch],
    pooling: Pooling = "last",
    num_batches: int | None = None,
    precision: Precision = "fp32",
) -> float:
    """Share of correct predictions over the first `num_batches` batches (the book's calc_accuracy_loader).

    nan when there is nothing to score. The model's train/eval mode is restored afterwards.
    `precision` is the training's (`train.precision`): bf16 autocast scores ~2x faster where bf16 is fast.
    """
    was_training = model.training
    model.eval()
    device = _device(model)
    correct = seen = 0
    for i, (input_ids, labels) in enumerate(loader):
        if num_batches is not None and i >= num_batches:
            break
        with autocast(device, precision):
            predicted = class_logits(model, input_ids.to(device), pooling).argmax(dim=-1)
        correct += int((predicted == labels.to(device)).sum())
        seen += len(labels)
    model.train(was_training)
    return correct / seen if seen else float("nan")


@torch.inference_mode()
def predict(
    model: nn.Module,
    loader: Iterable[Batch],
    pooling: Pooling = "last",
    desc: str = "predict",
    precision: Precision = "fp32",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Actual labels, predicted labels and class probabilities (n, num_classes) over a whole loader.

    `precision` as in `accuracy`; the probabilities are computed in fp32 either way.
    """
    was_training = model.training
    model.eval()
    device = _device(model)
    actual, probs = [], []
    for input_ids, labels in tqdm(loader, desc=desc, leave=False):
        with autocast(device, precision):
            logits = class_logits(model, input_ids.to(device), pooling)
        probs.append(torch.softmax(logits.float(), dim=-1).cpu())
        actual.append(labels.cpu())
    model.train(was_training)
    probabilities = torch.cat(probs).numpy()
    return torch.cat(actual).numpy(), probabilities.argmax(axis=1), probabilities


@torch.inference_mode()
def classify_texts(
    model: GPTModel,
    tokenizer: tiktoken.Encoding,
    texts: Sequence[str],
    *,
    max_length: int,
    pooling: Pooling = "last",
    batch_size: int = 8,
) -> np.ndarray:
    """Class probabilities (n, num_classes) of raw texts, encoded, truncated and padded exactly as in training."""
    model.eval()
    device = _device(model)
    ids = torch.from_numpy(
        pad_ids(encode_texts(list(texts), tokenizer), max_length).astype(np.int64)
    )  # (n, max_length)
    probs = [
        torch.softmax(class_logits(model, chunk.to(device), pooling).float(), dim=-1).cpu()
        for chunk in ids.split(batch_size)
    ]
    return torch.cat(probs).numpy() if probs else np.empty((0, model.cfg.num_classes), dtype=np.float32)


def classification_metrics(
    actual: Sequence[int] | np.ndarray,
    predicted: Sequence[int] | np.ndarray,
    *,
    positive: int = 1,
    class_names: Sequence[str] = CLASS_NAMES,
) -> dict[str, Any]:
    """Accuracy, each class's precision/recall/F1 and their macro averages, with scikit-learn.

    With two classes also the precision/recall/F1 of the `positive` one (spam), as the book
    reports them. `confusion_matrix[i][j]` counts examples of actual class i predicted as j
    (scikit-learn's layout: rows actual, columns predicted, every class listed
    even when absent from this sample).
    """
    # Imported here, at the end of a spam run: scikit-learn takes over a second to load.
    from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

    labels = list(range(len(class_names)))
    precision, recall, f1, _ = precision_recall_fscore_support(
        actual, predicted, labels=labels, average=None, zero_division=0.0
    )
    scores: dict[str, Any] = {"accuracy": float(accuracy_score(actual, predicted))}
    if len(class_names) == 2:
        scores.update(
            precision=float(precision[positive]), recall=float(recall[positive]), f1=float(f1[positive])
        )
    macro = precision_recall_fscore_support(
        actual, predicted, labels=labels, average="macro", zero_division=0.0
    )
    scores.update(macro_precision=float(macro[0]), macro_recall=float(macro[1]), macro_f1=float(macro[2]))
    scores["classes"] = {
        name: {"precision": float(precision[i]), "recall": float(recall[i]), "f1": float(f1[i])}
        for i, name in enumerate(class_names)
    }
    scores["confusion_matrix"] = confusion_matrix(actual, predicted, labels=labels).tolist()
    return scores


Predictions = tuple[np.ndarray, np.ndarray, np.ndarray]  # actual, predicted, class probabilities


def score_splits(
    model: nn.Module,
    datasets: dict[str, SpamDataset],
    pooling: Pooling,
    batch_size: int,
    precision: Precision,
) -> tuple[dict[str, Predictions], dict[str, dict[str, Any]]]:
    """Predictions and scores over the full splits, each read in order: the book's last evaluation."""
    predictions = {
        split: predict(model, ordered_loader(dataset, batch_size), pooling, desc=split, precision=precision)
        for split, dataset in datasets.items()
    }
    final = {
        split: classification_metrics(actual, predicted, class_names=datasets[split].class_names)
        for split, (actual, predicted, _) in predictions.items()
    }
    return predictions, final


def metrics_and_counts(
    initial: dict[str, float],
    final: dict[str, dict[str, Any]],
    result: TrainResult,
    trainable: int,
    class_names: Sequence[str] = CLASS_NAMES,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """DVC's metrics (scores, last losses) and the counts beside them (steps, confusion matrices)."""
    metrics: dict[str, Any] = {
        "initial": initial,
        **{
            split: {name: value for name, value in scores.items() if name != "confusion_matrix"}
            for split, scores in final.items()
        },
    }
    if result.history:
        metrics["final_train_loss"] = result.history[-1]["train_loss"]
        metrics["final_val_loss"] = result.history[-1]["val_loss"]
    counts = {
        "examples_seen": result.seen,
        "steps": result.steps,
        "trainable_params": trainable,
        "confusion_matrix": {split: confusion_counts(scores, class_names) for split, scores in final.items()},
    }
    return metrics, counts


def headline_scores(scores: dict[str, Any]) -> dict[str, float]:
    """A split's scores as a checkpoint records them: the accuracy, and the positive class's scores
    (two classes, the book's) or else the macro averages."""
    names = (
        ("precision", "recall", "f1") if "f1" in scores else ("macro_precision", "macro_recall", "macro_f1")
    )
    return {name: scores[name] for name in ("accuracy", *names)}


def confusion_counts(
    scores: dict[str, Any], class_names: Sequence[str] = CLASS_NAMES
) -> dict[str, dict[str, int]]:
    """One split's confusion matrix keyed by label names (rows actual, columns predicted)."""
    return {
        f"actual_{class_names[i]}": {f"predicted_{class_names[j]}": n for j, n in enumerate(row)}
        for i, row in enumerate(scores["confusion_matrix"])
    }


def percentages(scores: dict[str, float]) -> str:
    """`train accuracy 97.21% | val accuracy 97.32%`: accuracies as the book prints them."""
    return " | ".join(f"{name.replace('_', ' ')} {value * 100:.2f}%" for name, value in scores.items())
