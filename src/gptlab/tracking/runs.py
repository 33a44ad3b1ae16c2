"""MLflow runs for every stage: `stage_run` opens one, the stage logs to it, and it ends as the stage does.

Default store: `mlflow.db` (SQLite) and `mlruns/` at the project's root (gptlab.paths.project_root:
the smoke workspace and DVC's temporary experiment copies log there too), no server
needed. Setting MLFLOW_TRACKING_URI points every stage at a team server instead
(the store, its checks and failures: gptlab.tracking.store).
Each stage execution is one run named after the stage, in one experiment per
pipeline, tagged so that the runs of one `dvc repro` can be found together
(the tags, dataset hashes and upstream links: gptlab.tracking.lineage), and
nested under the pipeline run's own MLflow run (gptlab.tracking.pipeline_run).
Runs are started with MLflow's fluent API, so they carry MLflow's standard tags
(`mlflow.user`, `mlflow.source.name`, ...) and, with `tracking.system_metrics`,
CPU, memory (and GPU, where MLflow can read it) use as `system/...` metrics.
A server that stops answering mid-run does not stop the training (the logging it
keeps meanwhile: gptlab.tracking.buffered_run); a stage whose logging is still unsent at
its end fails in one line naming the URI (a training stage keeps its resume folder,
so its rerun trains nothing again).
With store.py, buffered_run.py, lineage.py and registry.py (sweep_runs.py gets it from
store.imported_mlflow), the only modules of tracking that import mlflow, where it is used,
not at their top (`store.imported_mlflow` says why); above them, the serving layer's
specs.py, pyfunc_models.py and pyfunc_model_code.py (the models MLflow logs and serves)
import it at theirs.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab.files import process_alive
from gptlab.paths import project_root
from gptlab.tracking import lineage
from gptlab.tracking.buffered_run import NULL_RUN, StageRun, metric_prefix
from gptlab.tracking.pipeline_run import PARENT_TAG, end_parent, open_parent
from gptlab.tracking.store import (
    StoreError,
    TrackingLost,
    bound_http_calls,
    check_reachable,
    create_store,
    ensure_experiment,
    first_line,
    imported_mlflow,
    masked_uri,
    server_lost,
    store_errors,
    store_failure,
    tracking_uri,
)
from gptlab.tracking.sweep_runs import SWEEP_TAG, SWEEP_VARIANT_TAG
from gptlab.tracking.ui import KEY_PARAMS
from gptlab.training.distributed import is_main

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


@contextmanager
def stage_run(
    stage: str,
    experiment: str,
    params: Mapping[str, Any],
    *,
    system_metrics: bool = True,
    run_name: str | None = None,
    sweep: str | None = None,
    sweep_variant: str | None = None,
) -> Iterator[StageRun]:
    """Open one MLflow run for a stage execution; it ends FAILED if the block raises (KILLED on Ctrl-C).

    The run is started by MLflow's fluent API (standard tags, system metrics when `system_metrics`);
    metrics, params and tags still go out in batches through a client. Under torchrun only rank 0
    opens a run; the other processes get NULL_RUN. A run of a `gptlab sweep` variant (`sweep`,
    `sweep_variant`: tracking.sweep and tracking.sweep_variant) is tagged gptlab.sweep and
    gptlab.sweep_variant, so the UI lists a sweep's runs together. The run is named by
    `run_title`. Within a pipeline run (`dvc repro`, `dvc exp run`, `gptlab smoke`, a sweep's
    variant) it is nested under that run's parent (`pipeline ·` and the same label), which
    gets the whole params.yaml, flat, as the stage reads it (so two pipeline runs compare like with
    like) and the stage's key params (the runs table's columns: gptlab.tracking.ui); a stage run
    alone has no parent.
    """
    if not is_main():
        yield NULL_RUN
        return
    uri = tracking_uri()
    check_reachable(uri)
    bound_http_calls()
    mlflow = imported_mlflow()
    tags = lineage.run_tags(stage, params)
    if sweep is not None:
        tags[SWEEP_TAG] = sweep
        if sweep_variant is not None:
            tags[SWEEP_VARIANT_TAG] = sweep_variant
    if masked_uri(uri) != uri:  # MLflow would print the run's URL with the password: printed masked below
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    with store_errors(uri):
        create_store(uri)
        mlflow.set_tracking_uri(uri)
        client = mlflow.MlflowClient(tracking_uri=uri)
        experiment_id = ensure_experiment(client, experiment)
        _close_dead_runs(client, experiment_id, stage)
        label = sweep_variant if sweep is not None else None
        parent_id = None
        if not lineage.alone(tags["gptlab.pipeline_run"]):
            parent_id = open_parent(client, experiment_id, tags, run_title("pipeline", label))
            tags[PARENT_TAG] = parent_id
        run = mlflow.start_run(
            experiment_id=experiment_id,
            run_name=run_title(run_name or stage, label),
            tags=tags,
            log_system_metrics=system_metrics,
        )
    stage_run = StageRun(client, run.info.run_id, uri, prefix=metric_prefix(stage), parent_id=parent_id)
    try:
        stage_run.log_params(params)
        key_params = {key: params[key] for key in KEY_PARAMS if key in params}
        stage_run.log_pipeline_params({**lineage.effective_params(), **key_params})
        yield stage_run
        stage_run.ensure_sent(
            f"the stage's outputs are written; once the server answers, run {rerun_command(stage)}"
        )
    except KeyboardInterrupt:
        _end_run(stage_run, "KILLED", stage)
        raise
    except BaseException:
        _end_run(stage_run, "FAILED", stage)
        raise
    _end_run(stage_run, "FINISHED", stage)
    if masked_uri(uri) != uri:
        print(
            f"🏃 View run at: {masked_uri(uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run.info.run_id}"
        )


def run_title(name: str, variant: str | None = None) -> str:
    """`spam-finetune · lora-r16`, `pretrain · smoke-20261204-1200`: what ran, and in which variant.

    The sweep variant, else the DVC experiment (DVC_EXP_NAME, which `dvc exp run` sets); a
    plain `dvc repro` run is named by its stage alone. The UI's compare view heads each run's
    column with this name, so two runs of one stage are told apart there.
    """
    label = variant or os.environ.get("DVC_EXP_NAME")
    return f"{name} · {label}" if label else name


def rerun_command(stage: str) -> str:
    """The command, quoted, that reruns `stage` once a lost tracking server answers again.

    Under DVC it is forced (`dvc repro -f -s STAGE`): the failed run wrote the stage's outputs,
    which equal dvc.lock's when the stage ran before with the same params and data, so a plain
    `dvc repro` skips it and its logging is never sent. A workspace other than the project
    (the smoke's) is named with `cd`. Run alone, the stage's own command line.
    """
    if lineage.alone(lineage.pipeline_run_id()):
        script, *args = sys.argv or [""]
        if script in ("", "-c", "-m"):  # an interpreter's command, not a script's
            return "the stage again"
        program = ["python", script] if script.endswith(".py") else [Path(script).name]
        return f"`{shlex.join([*program, *args])}`"
    here = Path.cwd().resolve()
    cd = "" if here == project_root().resolve() else f"cd {shlex.quote(str(here))} && "
    return (
        f"`{cd}dvc repro -f -s {stage}` (forced: a plain `dvc repro` finds its outputs written and skips it)"
    )


def _end_run(run: StageRun, status: str, stage: str) -> None:
    """End the active run. On a lost server it ends here only (its rerun marks it KILLED there),
    and a run that would have FINISHED fails the stage."""
    try:
        imported_mlflow().end_run(status=status)
        if run.parent_id is not None:
            end_parent(run.client, run.parent_id, status)
    except Exception as exc:
        if not server_lost(exc):
            if (said := store_failure(run.uri, exc)) is not None:
                raise StoreError(said) from None
            raise
        if status == "FINISHED":
            raise TrackingLost(
                f"MLflow tracking server {masked_uri(run.uri)} stopped answering as the run ended ({first_line(exc)}): "
                f"the stage's outputs are written; once the server answers, run {rerun_command(stage)}"
            ) from None


def _close_dead_runs(client: MlflowClient, experiment_id: str, stage: str) -> None:
    """Mark KILLED the runs of `stage` left RUNNING by a process of this machine that no longer exists.

    A stage killed with SIGKILL cannot end its own run, nor its pipeline run's; its rerun (which
    resumes the training) does.
    """
    host = socket.gethostname()
    running = client.search_runs(
        [experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.`gptlab.stage` = '{stage}'"
    )
    for run in running:
        tags = run.data.tags
        if tags.get("gptlab.host") == host and not process_alive(int(tags.get("gptlab.pid", "0"))):
            client.set_terminated(run.info.run_id, status="KILLED")
            if PARENT_TAG in tags and client.get_run(tags[PARENT_TAG]).info.status == "RUNNING":
                end_parent(client, tags[PARENT_TAG], "KILLED")
