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
from gptlab.tasks.classifier import Predictions
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
    class_names = test_set.class_names
    names = np.array(class_names)
    write_csv(
        report_dir / "predictions.csv", pd.DataFrame({"actual": names[actual], "predicted": names[predicted]})
    )
    figure = plot_confusion_matrix(final["test"]["confusion_matrix"], class_names, "spam-finetune: test set")
    write_figure(report_dir / "confusion_matrix.png", figure)
    tracker.log_figure(figure, "spam/confusion_matrix.png")
    for split, scores in final.items():
        matrix = {"labels": list(class_names), "rows": "actual", "columns": "predicted"}
        tracker.log_dict(
            {**matrix, "matrix": scores["confusion_matrix"]}, f"spam/confusion_matrix_{split}.json"
        )
    # The served model's answer: spam's probability (ham/spam), else the predicted class's.
    # serving.specs on first use: it loads mlflow and pandas, which the stage's start-up must not
    from gptlab.serving.specs import probability_column

    column = probability_column(class_names)
    shown = probs[:, class_names.index("spam")] if column == "spam_probability" else probs.max(axis=1)
    table = {"text": test_set.texts, "actual": names[actual], "predicted": names[predicted], column: shown}
    tracker.log_table(pd.DataFrame(table), "spam/test_predictions.json")
