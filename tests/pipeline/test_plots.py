"""The book's figures that every training run logs: loss against epochs and what was seen, spam's accuracy."""

from __future__ import annotations

from gptlab.pipeline.plots import plot_accuracy
from gptlab.pipeline.training_stage import loss_figure
from gptlab.training.loop import TrainResult


def test_a_fine_tunes_loss_figure_counts_examples_on_its_top_axis() -> None:
    history = [
        {
            "step": step,
            "examples_seen": (step + 1) * 8,
            "train_loss": 1.0 - step / 10,
            "val_loss": 1.1 - step / 10,
        }
        for step in range(0, 8, 2)
    ]
    epochs = [{"epoch": 1, "step": 3}, {"epoch": 2, "step": 7}]
    result = TrainResult(history=history, epochs=epochs, global_step=7, seen=64, seen_name="examples_seen")
    bottom, top = loss_figure(result).axes
    assert [line.get_label() for line in bottom.lines] == ["Training loss", "Validation loss"]
    assert list(bottom.lines[0].get_xdata()) == [0.25, 0.75, 1.25, 1.75]  # 4 steps an epoch
    assert (bottom.get_xlabel(), top.get_xlabel()) == ("Epochs", "Examples seen")
    assert list(top.lines[0].get_xdata()) == [8, 24, 40, 56]


def test_the_accuracy_figure_starts_at_the_fresh_head() -> None:
    rows = [
        {"epoch": 0, "train_accuracy": 0.5, "val_accuracy": 0.45},
        {"epoch": 1, "train_accuracy": 0.9, "val_accuracy": 0.85},
    ]
    (ax,) = plot_accuracy(rows).axes
    train, val = ax.lines
    assert list(train.get_xdata()) == [0, 1] and list(val.get_ydata()) == [0.45, 0.85]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("Epochs", "Accuracy")
