"""The runs of a `gptlab sweep`: the tags that group them, and the query that finds them again."""

from __future__ import annotations

from typing import Any

from gptlab.tracking.store import imported_mlflow, store_errors, tracking_uri

# The tags grouping the runs of one `gptlab sweep` (the UI filters `tags.gptlab.sweep = 'spam'`).
SWEEP_TAG = "gptlab.sweep"
SWEEP_VARIANT_TAG = "gptlab.sweep_variant"


def sweep_runs(experiments: list[str], sweep: str, stage: str) -> dict[str, dict[str, Any]]:
    """The newest run of `stage` per variant of `sweep` (tag gptlab.sweep), in the named MLflow experiments.

    Each: its run id, status and `wall_seconds` (the training loop's time), keyed by variant.
    """
    uri = tracking_uri()
    with store_errors(uri):
        client = imported_mlflow().MlflowClient(tracking_uri=uri)
        ids = [found.experiment_id for name in experiments if (found := client.get_experiment_by_name(name))]
        if not ids:
            return {}
        runs = client.search_runs(
            ids,
            filter_string=f"tags.`{SWEEP_TAG}` = '{sweep}' and tags.`gptlab.stage` = '{stage}'",
            order_by=["attributes.start_time DESC"],
        )
    found: dict[str, dict[str, Any]] = {}
    for run in runs:
        variant = run.data.tags.get(SWEEP_VARIANT_TAG)
        if variant and variant not in found:
            found[variant] = {
                "run_id": run.info.run_id,
                "status": run.info.status,
                "wall_seconds": _float_tag(run.data.tags.get("gptlab.wall_seconds")),
            }
    return found


def _float_tag(value: str | None) -> float | None:
    return None if value is None else float(value)
