"""A stage's MLflow run as the stage logs to it: `StageRun`, whose logging outlives a lost server.

Metrics, params and tags go out in batches through MLflow's client. A server
that stops answering mid-run does not stop the training: what the run logs is
kept in memory and sent once the server answers again (tried at most every
RETRY_S seconds); `ensure_sent` waits GPTLAB_TRACKING_TIMEOUT seconds for what
is still unsent at the stage's end, then fails in one line naming the URI.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

from gptlab.schema import flatten
from gptlab.tracking import lineage
from gptlab.tracking.store import (
    TIMEOUT_ENV,
    StoreError,
    TrackingLost,
    first_line,
    masked_uri,
    server_answers,
    server_lost,
    store_failure,
    tracking_timeout,
)

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

# While the server is lost, the least seconds between two tries to send the logging kept meanwhile.
RETRY_S = 30.0
# The most entries MLflow accepts in one log_batch call, per kind.
_MAX_PARAMS = 100
_MAX_METRICS = 1000
_MAX_TAGS = 100

_P = ParamSpec("_P")


def _live(method: Callable[Concatenate[StageRun, _P], None]) -> Callable[Concatenate[StageRun, _P], None]:
    """The method goes through `StageRun.send`: kept while the server is lost, nothing on NULL_RUN."""

    @functools.wraps(method)
    def guarded(self: StageRun, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        # Copies of the containers passed: one sent later must log what they held now.
        frozen = [_snapshot(arg) for arg in args]
        self.send(functools.partial(method, self, *frozen, **{k: _snapshot(v) for k, v in kwargs.items()}))

    return guarded


def _snapshot(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_snapshot(item) for item in value]
    return value


class StageRun:
    """A stage's MLflow run. Metrics go out in batches: one call per evaluation step.

    Without a run (client and run_id None: NULL_RUN, the tracker of a torchrun process
    other than rank 0) every method does nothing. While the server does not answer,
    the calls are kept (`unsent`) and sent in order once it does. Its metrics are named
    under `prefix/` (`metric_prefix`); `parent_id` is the pipeline run's MLflow run it is
    nested under (gptlab.tracking.pipeline_run), which gets its headline figures and loss figure.
    """

    def __init__(
        self,
        client: MlflowClient | None,
        run_id: str | None,
        uri: str = "",
        *,
        prefix: str = "",
        parent_id: str | None = None,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.uri = uri
        self.prefix = prefix
        self.parent_id = parent_id
        self.unsent: list[Callable[[], object]] = []
        self.lost: str | None = None  # why the server stopped answering, while it does not
        self._next_try = 0.0
        self._sending = False

    def send(self, action: Callable[[], object]) -> None:
        """Run `action` (calls to the tracking server) now, or keep it while the server is lost."""
        if self.run_id is None:
            return
        if self._sending:  # called by an action being sent (record_checkpoint's set_tags): part of it
            action()
            return
        self.unsent.append(action)
        if self.lost is not None:
            if time.monotonic() < self._next_try:
                return
            self._next_try = time.monotonic() + RETRY_S
            if not server_answers(self.uri):
                return
        self._send_unsent()

    def _send_unsent(self) -> bool:
        """Send the kept calls in order; False, the server marked lost, when it does not answer."""
        while self.unsent:
            self._sending = True
            try:
                self.unsent[0]()
            except Exception as exc:
                if not server_lost(exc):
                    self.unsent.pop(0)  # a bug or a refused call, not a lost server: never sent again
                    if (said := store_failure(self.uri, exc)) is not None:
                        raise StoreError(said) from None
                    raise
                if self.lost is None:
                    print(
                        f"warning: MLflow tracking server {masked_uri(self.uri)} stopped answering; the stage goes on "
                        f"and its logging is kept to send once the server answers ({first_line(exc)})",
                        file=sys.stderr,
                    )
                self.lost = first_line(exc)
                self._next_try = time.monotonic() + RETRY_S
                return False
            finally:
                self._sending = False
            self.unsent.pop(0)
        if self.lost is not None:
            print(
                f"MLflow tracking server {masked_uri(self.uri)} answers again: the kept logging is sent",
                file=sys.stderr,
            )
            self.lost = None
        return True

    def ensure_sent(self, rerun: str) -> None:
        """Send what is kept, waiting up to GPTLAB_TRACKING_TIMEOUT s for the server; else TrackingLost.

        `rerun` says what a rerun of the stage does; it ends the error's line.
        """
        if not self.unsent:
            return
        deadline = time.monotonic() + tracking_timeout()
        while not (server_answers(self.uri) and self._send_unsent()):
            if time.monotonic() >= deadline:
                raise TrackingLost(
                    f"MLflow tracking server {masked_uri(self.uri)} stopped answering during the run ({self.lost}) and "
                    f"{len(self.unsent)} logging calls could not be sent (waited {tracking_timeout():g} s, set "
                    f"{TIMEOUT_ENV} to wait longer): {rerun}"
                )
            time.sleep(1)

    @_live
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Metrics under the names given (`log_values` names them by the stage)."""
        self._log_batch(self.run_id, metrics, step)

    @_live
    def log_values(self, metrics: Mapping[str, Any], section: str = "", step: int | None = None) -> None:
        """Single values (nested as in the stage's metrics.json) under the stage's names (`stage_metrics`)."""
        self._log_batch(self.run_id, stage_metrics(self.prefix, metrics, section), step)

    @_live
    def log_headline(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """The stage's figures as its metrics.json holds them: on its run and on the pipeline run's."""
        named = stage_metrics(self.prefix, metrics)
        for run_id in filter(None, (self.run_id, self.parent_id)):
            self._log_batch(run_id, named, step)

    def _log_batch(self, run_id: str | None, metrics: Mapping[str, float], step: int | None) -> None:
        # mlflow on first use: see store.imported_mlflow
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        for i in range(0, len(entries), _MAX_METRICS):
            self.client.log_batch(run_id, metrics=entries[i : i + _MAX_METRICS])

    @_live
    def log_history(self, rows: list[Mapping[str, float]], step_key: str = "step") -> None:
        """Log curves (train_loss, val_loss, lr ... per step) under `<prefix>/curves/`, in as few calls as possible."""
        # mlflow on first use: see store.imported_mlflow
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        curves = f"{self.prefix}/{CURVES}" if self.prefix else CURVES
        entries = [
            Metric(f"{curves}/{k}", float(v), now, int(row[step_key]))
            for row in rows
            for k, v in row.items()
            if k != step_key and v is not None
        ]
        for i in range(0, len(entries), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=entries[i : i + _MAX_METRICS])

    @_live
    def log_pipeline_params(self, params: Mapping[str, Any]) -> None:
        """Params of the pipeline run's MLflow run (the whole params.yaml, flat: `lineage.effective_params`).

        A param an earlier stage logged there stays as it is: MLflow refuses to change one, and a
        value written another way (`1` and `1.0`) is the same value.
        """
        # mlflow on first use: see store.imported_mlflow
        from mlflow.entities import Param

        if self.parent_id is None:
            return
        logged = self.client.get_run(self.parent_id).data.params
        entries = [Param(k, _param_value(v)) for k, v in params.items() if k not in logged]
        for i in range(0, len(entries), _MAX_PARAMS):
            self.client.log_batch(self.parent_id, params=entries[i : i + _MAX_PARAMS])

    @_live
    def log_params(self, params: Mapping[str, Any]) -> None:
        # mlflow on first use: see store.imported_mlflow
        from mlflow.entities import Param

        entries = [Param(k, _param_value(v)) for k, v in params.items()]
        for i in range(0, len(entries), _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=entries[i : i + _MAX_PARAMS])

    @_live
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        # mlflow on first use: see store.imported_mlflow
        from mlflow.entities import RunTag

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
    def log_figure(self, figure: Any, artifact_file: str, *, pipeline: bool = False) -> None:
        """A figure of the run; with `pipeline`, of the pipeline run's too (the loss figures).

        The pipeline run's copy lies at the top of its artifacts (`pretrain/loss.png` as
        `pretrain_loss.png`): MLflow's compare view shows the files that runs share there only.
        """
        self.client.log_figure(self.run_id, figure, artifact_file)
        if pipeline and self.parent_id is not None:
            self.client.log_figure(self.parent_id, figure, artifact_file.replace("/", "_"))

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
        """Record a dataset the run read: its path, DVC content hash and split sizes (lineage.dataset_input).

        MLflow looks the dataset up, then inserts it: a parallel stage (a sweep's other variant) that
        inserted it in between breaks the store's unique key. Then the look-up finds it: once more.
        """
        self._log_inputs(self.run_id, [lineage.dataset_input(name, path, context=context, profile=profile)])

    @_live
    def log_own_data(self, name: str, path: Path | str, *, profile: Mapping[str, Any] | None = None) -> None:
        """Record a dataset of the user's own (not the book's) that the stage read, where runs are compared.

        It is a dataset input of this run and of the pipeline run's (context `own`, digest DVC's
        md5 of the file or folder), and both runs are tagged `gptlab.data.<name>` = "path (md5)":
        the runs table shows which data each run trained on, and two runs on two datasets differ there.
        """
        dataset = lineage.dataset_input(name, path, context=lineage.OWN_DATA_CONTEXT, profile=profile)
        tags = lineage.own_data_tags(name, path, dataset.dataset.digest)
        for run_id in (self.run_id, self.parent_id):
            if run_id is not None:
                self._log_inputs(run_id, [dataset])
                for key, value in tags.items():
                    self.client.set_tag(run_id, key, value)

    def _log_inputs(self, run_id: str, inputs: list[Any]) -> None:
        """MLflow's log_inputs, once more if a parallel stage inserted the dataset meanwhile."""
        # mlflow on first use: see store.imported_mlflow
        from mlflow.exceptions import MlflowException

        try:
            self.client.log_inputs(run_id, datasets=inputs)
        except MlflowException as exc:
            if server_lost(exc):
                raise
            self.client.log_inputs(run_id, datasets=inputs)

    @_live
    def record_checkpoint(self, checkpoint: Path | str) -> None:
        """Tag this run as the writer of `checkpoint`, by the sha256 of its weights."""
        self.set_tags(lineage.checkpoint_tags(checkpoint))

    @_live
    def link_upstream(self, checkpoint: Path | str, metadata: Mapping[str, Any]) -> None:
        """Tag (and link in the description) the run that wrote `checkpoint`, this run's upstream."""
        self.set_tags(lineage.upstream_tags(self.client, checkpoint, metadata))


NULL_RUN = StageRun(None, None)


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


# The MLflow UI draws one chart per metric name, in sections by prefix, and system/ on its own tab.
# Every metric of a stage is named under its prefix, so no chart mixes stages: its curves (every
# point, by step) under `<prefix>/curves/`, its single values as `<prefix>/<name in metrics.json>`.
CURVES = "curves"


def metric_prefix(stage: str) -> str:
    """A stage's metric names start with its reports folder's name: `spam` for spam-finetune."""
    return stage.removesuffix("-finetune")


def stage_metrics(prefix: str, metrics: Mapping[str, Any], section: str = "") -> dict[str, float]:
    """`metrics` as MLflow names them: `{test: {accuracy: 0.9}}` -> `spam/test_accuracy`.

    The names of the stage's metrics.json, flattened with `_`; a `section` (`initial`) leads
    each name that lacks it. None (a loss of an empty split) is no metric.
    """
    lead = f"{section}_" if section else ""
    return {
        f"{prefix}/{key if key.startswith(lead) else lead + key}".replace(".", "_"): value
        for key, value in flatten(dict(metrics)).items()
        if value is not None
    }
