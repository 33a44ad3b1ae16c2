"""Chapter 6's own reports beside the shared ones (pipeline/training_stage.py): the accuracy curve,
the test predictions and the confusion matrices, as files under reports/spam/ and in the stage's run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gptlab.data.spam import SpamDataset
from gptlab.files import write_csv, write_figure
from gptlab.pipeline.plots import plot_accuracy, plot_confusion_matrix
from gptlab.tasks.classifier import CLASS_NAMES, Predictions
from gptlab.tracking.buffered_run import StageRun


def write_and_log_scores(
    tracker: StageRun,
    report_dir: Path,
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
    write_csv(report_dir / "accuracy.csv", curve)
    tracker.log_figure(plot_accuracy(curve.to_dict("records")), "spam/accuracy.png")
    actual, predicted, probs = test_predictions
    names = np.array(CLASS_NAMES)
    write_csv(
        report_dir / "predictions.csv", pd.DataFrame({"actual": names[actual], "predicted": names[predicted]})
    )
    figure = plot_confusion_matrix(final["test"]["confusion_matrix"], CLASS_NAMES, "spam-finetune: test set")
    write_figure(report_dir / "confusion_matrix.png", figure)
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
