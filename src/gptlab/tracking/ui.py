"""What the MLflow UI shows first: model-training mode, and the runs table's key columns.

MLflow 3's UI reads both from a page's URL. `workflowType=machine_learning` opens it in
model-training mode (without it, the UI follows the browser's last choice: GenAI for a
browser new to MLflow 3). `viewStateShareKey=K` loads the view stored in the experiment's
tag `mlflow.sharedViewState.K`, as the UI's own *Share* button does: here, the runs
table with each stage's key params and headline metrics as columns, where MLflow shows
none by default. Every link gptlab writes carries the first; links to an experiment's
runs carry both, and every experiment the stages log to holds the view (`view_tags`).
"""

from __future__ import annotations

import json

MODEL_TRAINING_QUERY = "workflowType=machine_learning"
# The view's key, and the experiment tag that holds it (the prefix MLflow's UI reads).
VIEW_KEY = "gptlab"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
# The params a run is told apart by, and the figure each stage is judged by (a run has the
# columns of its own stage; the others stay empty). MLflow's defaults come first.
KEY_PARAMS = (
    "pretrain.train.lr",
    "spam.trainable",
    "spam.train.lr",
    "instruct.trainable",
    "instruct.train.lr",
    "preference.beta",
)
HEADLINE_METRICS = (
    "final/val_loss",  # pretrain, instruct-finetune, preference-finetune (its DPO loss)
    "eval/val_loss",  # eval, load-gpt2
    "eval/val_perplexity",
    "final/test.accuracy",  # spam-finetune
    "final/rougeL_f1",  # instruct-finetune
    "final/val_reward_margin",  # preference-finetune
    "final/test.after.reward_accuracy",
)
_DEFAULT_COLUMNS = ("attributes.`Source`", "attributes.`Models`", "attributes.`Dataset`")


def ui_link(page: str) -> str:
    """The UI's route to `page` (`experiments/1/runs/<id>`), opened in model-training mode."""
    return f"#/{page}?{MODEL_TRAINING_QUERY}"


def runs_link(experiment_id: str) -> str:
    """The UI's route to an experiment's runs, in model-training mode, with gptlab's columns."""
    return f"{ui_link(f'experiments/{experiment_id}/runs')}&viewStateShareKey={VIEW_KEY}"


def view_state() -> dict[str, object]:
    """The runs table's columns as the UI stores a view: `<kind>.`<key>`` per column."""
    columns = [
        *_DEFAULT_COLUMNS,
        *(f"params.`{key}`" for key in KEY_PARAMS),
        *(f"metrics.`{key}`" for key in HEADLINE_METRICS),
    ]
    return {"selectedColumns": columns}


def view_tags() -> dict[str, str]:
    """The experiment tag holding gptlab's view of the runs table."""
    return {VIEW_TAG: json.dumps(view_state())}
