"""A training stage's publishing: the checkpoint, its reports and its MLflow model, the weights hashed once."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gptlab.files import sha256_file
from gptlab.model.checkpoint import WEIGHTS_FILE
from gptlab.pipeline.training_stage import Reports, TrainingRun, loss_table
from gptlab.tracking.runs import stage_run
from gptlab.training.loop import TrainResult
from tests.tracking.test_logged_models import tiny_classifier

from helpers import committed_params

SPAM_METADATA = {"labels": {"0": "ham", "1": "spam"}, "max_length": 12, "pooling": "last"}


@pytest.mark.slow
def test_one_publish_reads_the_weights_once_to_hash_them(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving hashes the weights for the manifest; the run's tag and the registry take that digest.

    Every SHA-256 of a file in gptlab is hashlib.file_digest (files.sha256_file): each call is
    counted, by the file it read. MLflow's check of the logged model loads its own copy of the
    checkpoint (another file), and a load checks the digest, as it must.
    """
    monkeypatch.chdir(tmp_path)
    model = tiny_classifier(tmp_path / "scratch")
    params = committed_params()
    params = dataclasses.replace(params, data=dataclasses.replace(params.data, raw_dir=str(shared_data)))
    model_dir = tmp_path / "models" / "spam"
    reports = Reports(
        tmp_path / "reports" / "spam",
        metrics={"test_accuracy": 0.5},
        counts={"train_rows": 4},
        losses=loss_table([], ["step", "train_loss", "val_loss"]),
    )
    (tmp_path / "reports" / "spam").mkdir(parents=True)
    hashed: list[Path] = []
    file_digest = hashlib.file_digest

    def counted(fileobj: Any, digest: Any, /, **kwargs: Any) -> Any:
        hashed.append(Path(fileobj.name).resolve())
        return file_digest(fileobj, digest, **kwargs)

    with (
        monkeypatch.context() as patched,
        stage_run("spam-finetune", params.tracking.experiment, {}) as tracker,
        ExitStack() as saving,
    ):
        patched.setattr(hashlib, "file_digest", counted)
        run = TrainingRun(params, tracker, tmp_path / "run", saving)
        run.publish(
            model,
            model_dir,
            SPAM_METADATA,
            reports,
            TrainResult([], [], 0, 0),
            kind="spam",
            model_defaults={},
        )

    weights = (model_dir / WEIGHTS_FILE).resolve()
    assert hashed.count(weights) == 1, hashed
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    tags = client.get_run(tracker.run_id).data.tags
    assert tags["gptlab.checkpoint_sha256"] == sha256_file(weights)
    assert tags["gptlab.registered_model"] == f"{params.tracking.experiment}-spam/1"
