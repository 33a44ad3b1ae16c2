"""What the MLflow UI shows first: model-training mode, and the runs table's view.

MLflow 3's UI reads both from a page's URL. `workflowType=machine_learning` opens it in
model-training mode (without it, the UI follows the browser's last choice: GenAI for a
browser new to MLflow 3). `viewStateShareKey=K` loads the view stored in the experiment's
tag `mlflow.sharedViewState.K`, as the UI's own *Share* button does: here, one row per
pipeline run (its stages' runs nested under it, collapsed), the headline metrics of every
stage as the first columns, then the key params, and none of MLflow's Source, Models and
Dataset columns; the chart view draws every run (MLflow's default draws the first 10).
Every link gptlab writes carries the first; links to an experiment's runs carry both, and
every experiment the stages log to holds the view (`view_tags`). MLflow's Assistant panel
is the browser's own choice (closed until a user opens it): no server setting or view
stored here opens or closes it.
"""

from __future__ import annotations

import json

MODEL_TRAINING_QUERY = "workflowType=machine_learning"
# The view's key, and the experiment tag that holds it (the prefix MLflow's UI reads).
VIEW_KEY = "gptlab"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
# The figure each stage is judged by, as its metrics.json names it under the stage's prefix
# (gptlab.tracking.buffered_run.stage_metrics), and the params a pipeline run is told apart by:
# the pipeline run's MLflow run carries both (each stage's run, its own stage's).
HEADLINE_METRICS = (
    "pretrain/final_val_loss",
    "eval/val_perplexity",
    "spam/test_accuracy",
    "instruct/rougeL_f1",
    "instruct/val_loss",
    "preference/val_reward_margin",
    "preference/test_after_reward_accuracy",
)
KEY_PARAMS = (
    "pretrain.train.lr",
    "spam.trainable",
    "spam.train.lr",
    "instruct.trainable",
    "instruct.train.lr",
    "preference.beta",
)
# MLflow's own `runsHiddenMode` that draws every run in the chart view (its default: FIRST_10_RUNS).
SHOW_ALL_RUNS = "SHOW_ALL"


def ui_link(page: str) -> str:
    """The UI's route to `page` (`experiments/1/runs/<id>`), opened in model-training mode."""
    return f"#/{page}?{MODEL_TRAINING_QUERY}"


def runs_link(experiment_id: str) -> str:
    """The UI's route to an experiment's runs, in model-training mode, with gptlab's view."""
    return f"{ui_link(f'experiments/{experiment_id}/runs')}&viewStateShareKey={VIEW_KEY}"


def view_state() -> dict[str, object]:
    """The runs table as the UI stores a view: its columns (`<kind>.`<key>``) in order, parents collapsed."""
    columns = [
        *(f"metrics.`{key}`" for key in HEADLINE_METRICS),
        *(f"params.`{key}`" for key in KEY_PARAMS),
    ]
    return {
        "selectedColumns": columns,
        "columnOrder": columns,
        "runsExpanded": {},
        "runsHiddenMode": SHOW_ALL_RUNS,
    }


def view_tags() -> dict[str, str]:
    """The experiment tag holding gptlab's view of the runs table."""
    return {VIEW_TAG: json.dumps(view_state())}
