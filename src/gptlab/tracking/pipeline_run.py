"""A pipeline run as one MLflow run: the parent that every stage run of one `dvc repro` is nested under.

DVC runs each stage in a process of its own, so no process holds the parent for the
others: each stage finds it by the pipeline run's id (tag gptlab.pipeline_run, from
`lineage.pipeline_run_id`), or creates it, and opens its own run as the parent's child
(tag mlflow.parentRunId, as `mlflow.start_run(nested=True)` sets it). No stage list is
kept anywhere: whichever stages run, each joins its parent the same way.

The parent carries the whole params.yaml as its stages read it, flat (DVC's `-S` values
applied in an experiment: any two pipeline runs compare like with like), each stage's headline figures (`spam/test_accuracy`), the
loss figures, the DVC experiment's name and baseline commit. It is RUNNING while a stage
runs, and ends as the last stage to run ended (FINISHED, FAILED or KILLED).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gptlab.tracking.sweep_runs import SWEEP_TAG, SWEEP_VARIANT_TAG

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

PIPELINE_RUN_TAG = "gptlab.pipeline_run"
# The tag that tells the parent from its stages' runs (which carry gptlab.stage instead).
ROLE_TAG = "gptlab.role"
PIPELINE_ROLE = "pipeline"
# What MLflow's UI nests a run under: the parent's run id.
PARENT_TAG = "mlflow.parentRunId"
# The stage run's tags the parent shares: which pipeline run, code, experiment and sweep.
_SHARED_TAGS = (
    PIPELINE_RUN_TAG,
    "mlflow.source.git.commit",
    "gptlab.git_dirty",
    "gptlab.dvc_exp",
    "gptlab.dvc_baseline",
    "gptlab.host",
    SWEEP_TAG,
    SWEEP_VARIANT_TAG,
)


def open_parent(client: MlflowClient, experiment_id: str, stage_tags: Mapping[str, str], title: str) -> str:
    """The id of the pipeline run's MLflow run, found by its id or created (named `title`), marked RUNNING."""
    pipeline_run = stage_tags[PIPELINE_RUN_TAG].replace("'", "")
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PIPELINE_RUN_TAG}` = '{pipeline_run}' and tags.`{ROLE_TAG}` = '{PIPELINE_ROLE}'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    if found:
        parent = found[0].info.run_id
        if found[0].info.status != "RUNNING":
            client.update_run(parent, status="RUNNING")
        return parent
    tags = {key: stage_tags[key] for key in _SHARED_TAGS if key in stage_tags}
    return client.create_run(
        experiment_id, run_name=title, tags={**tags, ROLE_TAG: PIPELINE_ROLE}
    ).info.run_id


def end_parent(client: MlflowClient, parent_id: str, status: str) -> None:
    """The parent ends as its latest stage did; the next stage of the pipeline run opens it again."""
    client.set_terminated(parent_id, status=status)
