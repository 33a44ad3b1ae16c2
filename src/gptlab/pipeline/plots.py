"""Figures of training runs, built on matplotlib's object API (no pyplot global state).

matplotlib (and scikit-learn) are imported by the functions that draw: a stage plots at its
end, and its start-up need not load them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_losses(
    history: Sequence[Mapping[str, float]],
    steps_per_epoch: int,
    seen_key: str = "tokens_seen",
    seen_label: str = "Tokens seen",
) -> Figure:
    """The book's loss figure: train and validation loss against epochs, tokens seen on a twin axis.

    `history` rows carry step (0-based optimizer step), `seen_key`, train_loss
    and val_loss, as gptlab.training.loop.fit records them.
    """
    # matplotlib at a stage's end, not its start-up
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    assert steps_per_epoch > 0, "steps_per_epoch must be positive"
    epochs = [(row["step"] + 1) / steps_per_epoch for row in history]
    seen = [row[seen_key] for row in history]
    train = [row["train_loss"] for row in history]
    val = [row["val_loss"] for row in history]

    fig = Figure(figsize=(5, 3))
    ax = fig.add_subplot()
    ax.plot(epochs, train, label="Training loss")
    ax.plot(epochs, val, linestyle="-.", label="Validation loss")
    ax.set_xlabel("Epochs")
    ax.set_ylabel("Loss")
    ax.legend(loc="upper right")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # An invisible second plot against what was seen aligns the top axis with the bottom one.
    top = ax.twiny()
    top.plot(seen, train, alpha=0)
    top.set_xlabel(seen_label)
    fig.tight_layout()
    return fig


def plot_reward_margins(history: Sequence[Mapping[str, float]]) -> Figure:
    """The DPO notebook's reward figure: train and validation reward margins (chosen - rejected) against tokens seen.

    `history` rows carry tokens_seen and {train,val}_{chosen,rejected}_reward, as the
    preference stage's training loop records them.
    """
    # matplotlib at a stage's end, not its start-up
    from matplotlib.figure import Figure

    seen = [row["tokens_seen"] for row in history]
    fig = Figure(figsize=(5, 3))
    ax = fig.add_subplot()
    for split, label, style in (("train", "Training", "-"), ("val", "Validation", "-.")):
        margins = [row[f"{split}_chosen_reward"] - row[f"{split}_rejected_reward"] for row in history]
        ax.plot(seen, margins, linestyle=style, label=f"{label} reward margin")
    ax.set_xlabel("Tokens seen")
    ax.set_ylabel("Reward margin")
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig


def plot_accuracy(rows: Sequence[Mapping[str, float]]) -> Figure:
    """Chapter 6's accuracy figure: train and validation accuracy against epochs (epoch 0: the fresh head).

    `rows` carry epoch, train_accuracy and val_accuracy, one per epoch.
    """
    # matplotlib at a stage's end, not its start-up
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    epochs = [row["epoch"] for row in rows]
    fig = Figure(figsize=(5, 3))
    ax = fig.add_subplot()
    ax.plot(epochs, [row["train_accuracy"] for row in rows], label="Training accuracy")
    ax.plot(epochs, [row["val_accuracy"] for row in rows], linestyle="-.", label="Validation accuracy")
    ax.set_xlabel("Epochs")
    ax.set_ylabel("Accuracy")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def plot_confusion_matrix(matrix: list[list[int]], labels: Sequence[str], title: str) -> Figure:
    """A confusion matrix with counts in each cell: rows are actual, columns predicted."""
    # matplotlib and scikit-learn at a stage's end, not its start-up
    from matplotlib.figure import Figure
    from sklearn.metrics import ConfusionMatrixDisplay

    figure = Figure(figsize=(4.5, 4))
    ax = figure.add_subplot()
    ConfusionMatrixDisplay(np.array(matrix), display_labels=list(labels)).plot(
        ax=ax, colorbar=False, values_format="d"
    )
    ax.set_title(title)
    figure.tight_layout()
    return figure
