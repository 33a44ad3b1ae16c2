"""MLflow runs for every stage, and the store they go to.

Default store: `mlflow.db` (SQLite) and `mlruns/` in the project, no server
needed. Setting MLFLOW_TRACKING_URI points every stage at a team server instead.
Each stage execution is one run named after the stage, in one experiment per
pipeline, tagged so that the runs of one `dvc repro` can be found together
(the tags, dataset hashes and upstream links: gptlab.lineage).
Runs are started with MLflow's fluent API, so they carry MLflow's standard tags
(`mlflow.user`, `mlflow.source.name`, ...) and, with `tracking.system_metrics`,
CPU, memory (and GPU, where MLflow can read it) use as `system/...` metrics.
With lineage.py, registry.py (logged models) and pyfunc_models.py / pyfunc_model_code.py
(the models MLflow serves), the only modules that import mlflow.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Concatenate, ParamSpec

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from gptlab import lineage
from gptlab.distributed import is_main
from gptlab.environment import VERBOSE_ENV
from gptlab.errors import GptlabError
from gptlab.files import process_alive

DEFAULT_DB = "mlflow.db"
# Seconds to wait for a tracking server to answer before a stage starts.
TIMEOUT_ENV = "GPTLAB_TRACKING_TIMEOUT"
# The experiment tag MLflow's UI reads to open an experiment as "Model training", not GenAI.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
# The tags grouping the runs of one `gptlab sweep` (the UI filters `tags.gptlab.sweep = 'spam'`).
SWEEP_TAG = "gptlab.sweep"
SWEEP_VARIANT_TAG = "gptlab.sweep_variant"
# The most entries MLflow accepts in one log_batch call, per kind.
_MAX_PARAMS = 100
_MAX_METRICS = 1000
_MAX_TAGS = 100

_P = ParamSpec("_P")

# MLflow's INFO lines (system metrics monitor started and stopped, input example validated) bury
# a stage's own output: warnings only, unless `gptlab -v` or GPTLAB_VERBOSE=1 asks for them.
if not os.environ.get(VERBOSE_ENV):
    logging.getLogger("mlflow").setLevel(logging.WARNING)


# The MLflow UI draws each `/` prefix of a metric's name as a section of charts, sections sorted
# by name and unprefixed metrics last: curves first, then the single values under eval/, final/,
# initial/ (gptlab.tracking.section), and system/ on its own tab.
CURVES = "curves"


def section(name: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """`metrics` under `name/` (initial_val_loss -> initial/val_loss): one section of the UI's charts."""
    return {f"{name}/{key.removeprefix(name + '_')}": value for key, value in metrics.items()}


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI if set, else the project's local SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / DEFAULT_DB}"


def _live(method: Callable[Concatenate[StageRun, _P], None]) -> Callable[Concatenate[StageRun, _P], None]:
    """The method does nothing on a run without an MLflow run (NULL_RUN): rank 0 logs for all."""

    @functools.wraps(method)
    def guarded(self: StageRun, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        if self.run_id is not None:
            method(self, *args, **kwargs)

    return guarded


class StageRun:
    """A stage's MLflow run. Metrics go out in batches: one call per evaluation step.

    Without a run (client and run_id None: NULL_RUN, the tracker of a torchrun process
    other than rank 0) every method does nothing.
    """

    def __init__(self, client: MlflowClient | None, run_id: str | None) -> None:
        self.client = client
        self.run_id = run_id

    @_live
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        for i in range(0, len(entries), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=entries[i : i + _MAX_METRICS])

    @_live
    def log_history(self, rows: list[Mapping[str, float]], step_key: str = "step") -> None:
        """Log curves (train_loss, val_loss, lr ... per step) under curves/, in as few calls as possible."""
        now = int(time.time() * 1000)
        entries = [
            Metric(f"{CURVES}/{k}", float(v), now, int(row[step_key]))
            for row in rows
            for k, v in row.items()
            if k != step_key and v is not None
        ]
        for i in range(0, len(entries), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=entries[i : i + _MAX_METRICS])

    @_live
    def log_params(self, params: Mapping[str, Any]) -> None:
        entries = [Param(k, _param_value(v)) for k, v in params.items()]
        for i in range(0, len(entries), _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=entries[i : i + _MAX_PARAMS])

    @_live
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        entries = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(entries), _MAX_TAGS):
            self.client.log_batch(self.run_id, tags=entries[i : i + _MAX_TAGS])

    @_live
    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    @_live
    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    @_live
    def log_figure(self, figure: Any, artifact_file: str) -> None:
        self.client.log_figure(self.run_id, figure, artifact_file)

    @_live
    def log_table(self, data: Any, artifact_file: str) -> None:
        """A table (dict of columns or pandas DataFrame) the MLflow UI shows in its evaluation view."""
        self.client.log_table(self.run_id, data=data, artifact_file=artifact_file)

    @_live
    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    @_live
    def log_reports(self, folder: Path | str, artifact_path: str, skip: tuple[str, ...] = ()) -> None:
        """The files of a stage's reports folder, except those (figures) already logged on their own."""
        for path in sorted(Path(folder).iterdir()):
            if path.is_file() and path.name not in skip:
                self.client.log_artifact(self.run_id, str(path), artifact_path)

    @_live
    def log_input(
        self, name: str, path: Path | str, *, context: str, profile: Mapping[str, Any] | None = None
    ) -> None:
        """Record a dataset the run read: its path, DVC content hash and split sizes (lineage.dataset_input)."""
        inputs = [lineage.dataset_input(name, path, context=context, profile=profile)]
        self.client.log_inputs(self.run_id, datasets=inputs)

    @_live
    def record_checkpoint(self, checkpoint: Path | str) -> None:
        """Tag this run as the writer of `checkpoint`, by the sha256 of its weights."""
        self.set_tags(lineage.checkpoint_tags(checkpoint))

    @_live
    def link_upstream(self, checkpoint: Path | str, metadata: Mapping[str, Any]) -> None:
        """Tag (and link in the description) the run that wrote `checkpoint`, this run's upstream."""
        self.set_tags(lineage.upstream_tags(self.client, checkpoint, metadata))


NULL_RUN = StageRun(None, None)


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
    gptlab.sweep_variant and named <stage>/<variant>, so the UI lists a sweep's runs together.
    """
    if not is_main():
        yield NULL_RUN
        return
    uri = tracking_uri()
    check_reachable(uri)
    # Bounded retries: a server that stops answering mid-run fails the stage in seconds, not minutes.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    experiment_id = _experiment_id(client, experiment)
    _close_dead_runs(client, experiment_id, stage)
    tags = lineage.run_tags(stage, params)
    if sweep is not None:
        tags[SWEEP_TAG] = sweep
        if sweep_variant is not None:
            tags[SWEEP_VARIANT_TAG] = sweep_variant
            run_name = run_name or f"{stage}/{sweep_variant}"
    run = mlflow.start_run(
        experiment_id=experiment_id,
        run_name=run_name or stage,
        tags=tags,
        log_system_metrics=system_metrics,
    )
    stage_run = StageRun(client, run.info.run_id)
    try:
        stage_run.log_params(params)
        yield stage_run
    except KeyboardInterrupt:
        mlflow.end_run(status="KILLED")
        raise
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    mlflow.end_run(status="FINISHED")


def check_reachable(uri: str) -> None:
    """Fail fast, naming the URI, when a tracking server does not answer (local stores always do).

    The wait is GPTLAB_TRACKING_TIMEOUT seconds (default 10); any HTTP answer counts as reachable.
    """
    if not uri.startswith(("http://", "https://")):
        return
    timeout = float(os.environ.get(TIMEOUT_ENV, "10"))
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout).close()  # noqa: S310 - http(s) only
    except urllib.error.HTTPError:
        return  # something answered: MLflow's own calls will say what is wrong
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GptlabError(
            f"MLflow tracking server {uri} is unreachable ({reason}; waited up to {timeout:g} s, "
            f"set {TIMEOUT_ENV} to wait longer): start it, or unset MLFLOW_TRACKING_URI to log to the "
            "local store (mlflow.db)"
        ) from None


def _close_dead_runs(client: MlflowClient, experiment_id: str, stage: str) -> None:
    """Mark KILLED the runs of `stage` left RUNNING by a process of this machine that no longer exists.

    A stage killed with SIGKILL cannot end its own run; its rerun (which resumes the training) does.
    """
    host = socket.gethostname()
    running = client.search_runs(
        [experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.`gptlab.stage` = '{stage}'"
    )
    for run in running:
        tags = run.data.tags
        if tags.get("gptlab.host") == host and not process_alive(int(tags.get("gptlab.pid", "0"))):
            client.set_terminated(run.info.run_id, status="KILLED")


def _experiment_id(client: MlflowClient, name: str) -> str:
    """The experiment named `name`, created if needed, and tagged for model training.

    MLflow 3's UI opens an experiment without the kind tag in GenAI mode (an empty traces
    page); one created before the tag existed gets it on its next run.
    """
    existing = client.get_experiment_by_name(name)
    if existing is None:
        try:
            return client.create_experiment(
                name, artifact_location=_artifact_location(), tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING}
            )
        except mlflow.exceptions.MlflowException:  # created meanwhile by a parallel stage
            existing = client.get_experiment_by_name(name)
            assert existing is not None, f"experiment {name!r} could neither be created nor found"
    if existing.tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING:
        client.set_experiment_tag(existing.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return existing.experiment_id


def _artifact_location() -> str | None:
    """Keep a local SQLite store's artifacts beside its database, not in whatever cwd is."""
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        return None  # a server decides
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlruns").resolve().as_uri()


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


def prepare_store(experiments: list[str]) -> None:
    """Create the tracking store (a new SQLite file is migrated here, once) and the named experiments.

    Before stages start in parallel (`gptlab sweep --jobs N`): processes that find an empty
    SQLite file would each run MLflow's schema migrations on it at the same time, and fail.
    """
    uri = tracking_uri()
    check_reachable(uri)
    client = MlflowClient(tracking_uri=uri)
    for name in experiments:
        _experiment_id(client, name)


def sweep_runs(experiments: list[str], sweep: str, stage: str) -> dict[str, dict[str, Any]]:
    """The newest run of `stage` per variant of `sweep` (tag gptlab.sweep), in the named MLflow experiments.

    Each: its run id, status and `wall_seconds` (the training loop's time), keyed by variant.
    """
    client = MlflowClient(tracking_uri=tracking_uri())
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
