"""MLflow runs for every stage, and the store they go to.

Default store: `mlflow.db` (SQLite) and `mlruns/` at the project's root (gptlab.paths.project_root:
the smoke workspace and DVC's temporary experiment copies log there too), no server
needed. Setting MLFLOW_TRACKING_URI points every stage at a team server instead.
Each stage execution is one run named after the stage, in one experiment per
pipeline, tagged so that the runs of one `dvc repro` can be found together
(the tags, dataset hashes and upstream links: gptlab.tracking.lineage).
Runs are started with MLflow's fluent API, so they carry MLflow's standard tags
(`mlflow.user`, `mlflow.source.name`, ...) and, with `tracking.system_metrics`,
CPU, memory (and GPU, where MLflow can read it) use as `system/...` metrics.
A server that stops answering mid-run does not stop the training: what the run
logs is kept in memory and sent once the server answers again (tried at most
every RETRY_S seconds); a stage whose logging is still unsent at its end waits
GPTLAB_TRACKING_TIMEOUT seconds for the server, then fails in one line naming
the URI (a training stage keeps its resume folder, so its rerun trains nothing again).
With lineage.py, registry.py (logged models) and pyfunc_models.py / pyfunc_model_code.py
(the models MLflow serves), the only modules that import mlflow. The first three import it
where it is used, not at their top (`imported_mlflow` says why); pyfunc_models is loaded by
name, only when a model is logged or served.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import math
import os
import re
import socket
import sqlite3
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing, contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

from gptlab.environment import VERBOSE_ENV
from gptlab.errors import GptlabError
from gptlab.files import process_alive
from gptlab.paths import project_root
from gptlab.tracking import lineage
from gptlab.tracking.ui import view_tags
from gptlab.training.distributed import is_main

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

DEFAULT_DB = "mlflow.db"
# Seconds to wait for a tracking server to answer: before a stage starts, and for its unsent logging at its end.
TIMEOUT_ENV = "GPTLAB_TRACKING_TIMEOUT"
# While the server is lost, the least seconds between two tries to send the logging kept meanwhile.
RETRY_S = 30.0
# The REST call that tells an MLflow tracking server from any other HTTP server.
_PROBE = "api/2.0/mlflow/experiments/search?max_results=1"
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


def imported_mlflow() -> ModuleType:
    """mlflow, imported at its first use rather than with this module, its INFO lines quieted.

    `import mlflow` takes over a second (its __init__ loads mlflow.genai, mlflow.artifacts,
    mlflow.models and pandas, whichever part is used) that `--help`, a bad params file, and the
    torchrun processes that log nothing need not wait for. MLflow's INFO lines (system metrics
    monitor started and stopped, input example validated) bury a stage's own output: warnings
    only, unless `gptlab -v` or GPTLAB_VERBOSE=1 asks for them. MLflow sets its logger's level
    as it is imported, so the level is set after. Its lines pass PasswordsMasked on the way out.
    """
    import mlflow  # on first use: the docstring says why

    mlflow_logger = logging.getLogger("mlflow")
    if not os.environ.get(VERBOSE_ENV):
        mlflow_logger.setLevel(logging.WARNING)
        # A database error is logged there with its traceback, then raised: store_errors says it in one line.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    # A child logger's record skips its parents' filters, not their handlers'.
    for handler in mlflow_logger.handlers:
        if not any(isinstance(f, PasswordsMasked) for f in handler.filters):
            handler.addFilter(PasswordsMasked())
    return mlflow


# The MLflow UI draws each `/` prefix of a metric's name as a section of charts, sections sorted
# by name and unprefixed metrics last: curves first, then the single values under eval/, final/,
# initial/ (gptlab.tracking.runs.section), and system/ on its own tab.
CURVES = "curves"


def section(name: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """`metrics` under `name/` (initial_val_loss -> initial/val_loss): one section of the UI's charts."""
    return {f"{name}/{key.removeprefix(name + '_')}": value for key, value in metrics.items()}


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI if set, else the project's local SQLite store, wherever in the project the command runs."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project_root() / DEFAULT_DB}"


# The password of a URI's userinfo (scheme://user:PASSWORD@host); the last `@` ends it, as in urllib.
_PASSWORD = re.compile(r"(?P<user>[A-Za-z][A-Za-z0-9+.\-]*://[^/?#\s:@]*):[^/?#\s]*@")


def masked_uri(uri: str) -> str:
    """`uri` with its password shown as *** (http://alice:***@host:port), fit to print; other URIs unchanged.

    Also masks every URI within a longer text (an error message quoting the URI it called).
    """
    return _PASSWORD.sub(r"\g<user>:***@", uri)


class PasswordsMasked(logging.Filter):
    """Masks the password of every URI in a log line: MLflow's own warnings quote the URL they called
    (the system metrics monitor's "Failed to get mlflow run: API request to http://user:pw@host/...")."""

    def filter(self, record: logging.LogRecord) -> bool:
        said = record.getMessage()
        if masked_uri(said) != said:
            record.msg, record.args = masked_uri(said), None
        return True


class TrackingLost(GptlabError):
    """The tracking server stopped answering during a run and its logging could not all be sent."""


class StoreError(GptlabError):
    """The tracking store cannot be used (read-only, damaged, locked, gone): one line naming it and the fix."""


# What a database store's failure says (sqlite's words, lowercased) -> what is wrong and how to fix it.
_STORE_FAILURES = {
    "not a database": "is damaged: move its file aside (a new store starts empty) or restore a copy",
    "malformed": "is damaged: move its file aside (a new store starts empty) or restore a copy",
    "readonly": "cannot be written: make its file and folder writable",
    "read-only": "cannot be written: make its file and folder writable",
    "unable to open": "cannot be opened or created: make its folder writable",
    "locked": "is locked by another process: rerun once that one (a stage, a sweep, `mlflow ui`) is done, "
    "or log to an `mlflow server`, which processes share",
    "disk is full": "cannot grow: its disk is full",
    "disk i/o error": "cannot be read or written (a disk error): check its disk",
}


@contextmanager
def store_errors(uri: str) -> Iterator[None]:
    """Within the block, a tracking store that cannot be used is a StoreError: one line, exit code 2.

    What MLflow raises for it (SQLAlchemy's and sqlite's errors, the server's refusals, a server
    gone) would otherwise end the command with a traceback of a hundred lines or more.
    """
    try:
        yield
    except GptlabError:
        raise
    except Exception as exc:
        said = store_failure(uri, exc)
        if said is None:
            raise
        raise StoreError(said) from None


def _database_failure(uri: str, detail: str) -> str:
    """The line for a database store that failed, saying `detail` (the database's own words)."""
    said = next((said for key, said in _STORE_FAILURES.items() if key in detail.lower()), "fails: check it")
    what, how = said.split(": ", 1)
    return f"MLflow tracking store {masked_uri(uri)} {what} ({detail}): {how}, or set MLFLOW_TRACKING_URI to another store"


def _check_sqlite(uri: str) -> None:
    """A local SQLite store that cannot be opened, read or created fails at once (MLflow would retry for 100 s)."""
    path = Path(uri.removeprefix("sqlite:///").partition("?")[0]).absolute()
    if not path.exists():
        folder = next(parent for parent in path.parents if parent.exists())
        if not os.access(folder, os.W_OK):  # also False on a read-only disk, even for root
            raise StoreError(
                _database_failure(uri, f"unable to open database file: {folder} is not writable")
            )
        return
    # Read-write where we may write: a process killed mid-transaction leaves a hot journal, which only
    # a writing connection rolls back (a read-only one would call the store read-only).
    mode = "rw" if os.access(path, os.W_OK) and os.access(path.parent, os.W_OK) else "ro"
    try:
        with closing(sqlite3.connect(f"{path.as_uri()}?mode={mode}", uri=True)) as db:
            db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as exc:
        raise StoreError(_database_failure(uri, _first_line(exc))) from None


def store_failure(uri: str, exc: BaseException) -> str | None:
    """The line saying why the store at `uri` failed with `exc`; None when `exc` is no store failure."""
    # mlflow on first use: see imported_mlflow
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException

    store = f"MLflow tracking store {masked_uri(uri)}"
    fix = "or set MLFLOW_TRACKING_URI to another store"
    if server_lost(exc):
        return (
            f"{store} does not answer ({_first_line(exc)}; set {TIMEOUT_ENV} to wait longer): start it, {fix}"
        )
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sqlalchemy.exc.DBAPIError):
            return _database_failure(uri, _first_line(seen.orig))
        if isinstance(seen, MlflowException) and seen.error_code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return (
                f"{store} refuses the credentials ({_first_line(seen)}): give them as user:password@ in the URI, "
                "or set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
            )
        seen = seen.__cause__ or seen.__context__
    return None


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


def server_lost(exc: BaseException) -> bool:
    """Whether `exc` says the tracking server did not answer (MLflow wraps requests' errors, unchained)."""
    import requests  # loaded by mlflow, which raised `exc`

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, requests.exceptions.RequestException):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class StageRun:
    """A stage's MLflow run. Metrics go out in batches: one call per evaluation step.

    Without a run (client and run_id None: NULL_RUN, the tracker of a torchrun process
    other than rank 0) every method does nothing. While the server does not answer,
    the calls are kept (`unsent`) and sent in order once it does.
    """

    def __init__(self, client: MlflowClient | None, run_id: str | None, uri: str = "") -> None:
        self.client = client
        self.run_id = run_id
        self.uri = uri
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
            if not _answers(self.uri):
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
                        f"and its logging is kept to send once the server answers ({_first_line(exc)})",
                        file=sys.stderr,
                    )
                self.lost = _first_line(exc)
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
        deadline = time.monotonic() + _timeout()
        while not (_answers(self.uri) and self._send_unsent()):
            if time.monotonic() >= deadline:
                raise TrackingLost(
                    f"MLflow tracking server {masked_uri(self.uri)} stopped answering during the run ({self.lost}) and "
                    f"{len(self.unsent)} logging calls could not be sent (waited {_timeout():g} s, set "
                    f"{TIMEOUT_ENV} to wait longer): {rerun}"
                )
            time.sleep(1)

    @_live
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        # mlflow on first use: see imported_mlflow
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        for i in range(0, len(entries), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=entries[i : i + _MAX_METRICS])

    @_live
    def log_history(self, rows: list[Mapping[str, float]], step_key: str = "step") -> None:
        """Log curves (train_loss, val_loss, lr ... per step) under curves/, in as few calls as possible."""
        # mlflow on first use: see imported_mlflow
        from mlflow.entities import Metric

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
        # mlflow on first use: see imported_mlflow
        from mlflow.entities import Param

        entries = [Param(k, _param_value(v)) for k, v in params.items()]
        for i in range(0, len(entries), _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=entries[i : i + _MAX_PARAMS])

    @_live
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        # mlflow on first use: see imported_mlflow
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
        """Record a dataset the run read: its path, DVC content hash and split sizes (lineage.dataset_input).

        MLflow looks the dataset up, then inserts it: a parallel stage (a sweep's other variant) that
        inserted it in between breaks the store's unique key. Then the look-up finds it: once more.
        """
        # mlflow on first use: see imported_mlflow
        from mlflow.exceptions import MlflowException

        inputs = [lineage.dataset_input(name, path, context=context, profile=profile)]
        try:
            self.client.log_inputs(self.run_id, datasets=inputs)
        except MlflowException as exc:
            if server_lost(exc):
                raise
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
    gptlab.sweep_variant, so the UI lists a sweep's runs together. The run is named by
    `run_title`.
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
        mlflow.set_tracking_uri(uri)
        client = mlflow.MlflowClient(tracking_uri=uri)
        experiment_id = _experiment_id(client, experiment)
        _close_dead_runs(client, experiment_id, stage)
        run = mlflow.start_run(
            experiment_id=experiment_id,
            run_name=run_title(run_name or stage, sweep_variant if sweep is not None else None),
            tags=tags,
            log_system_metrics=system_metrics,
        )
    stage_run = StageRun(client, run.info.run_id, uri)
    try:
        stage_run.log_params(params)
        yield stage_run
        stage_run.ensure_sent("the stage's outputs are written; rerun it once the server answers")
    except KeyboardInterrupt:
        _end_run(stage_run, "KILLED")
        raise
    except BaseException:
        _end_run(stage_run, "FAILED")
        raise
    _end_run(stage_run, "FINISHED")
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


def _end_run(run: StageRun, status: str) -> None:
    """End the active run. On a lost server it ends here only (its rerun marks it KILLED there),
    and a run that would have FINISHED fails the stage."""
    try:
        imported_mlflow().end_run(status=status)
    except Exception as exc:
        if not server_lost(exc):
            if (said := store_failure(run.uri, exc)) is not None:
                raise StoreError(said) from None
            raise
        if status == "FINISHED":
            raise TrackingLost(
                f"MLflow tracking server {masked_uri(run.uri)} stopped answering as the run ended ({_first_line(exc)}): "
                "the stage's outputs are written; rerun it once the server answers"
            ) from None


def bound_http_calls() -> None:
    """MLflow's own HTTP calls give up within GPTLAB_TRACKING_TIMEOUT: one retry, at once.

    MLflow's defaults (7 retries, backoff factor 2, 120 s timeout) make a call to a dead server last
    minutes, and a lost server costs each kept call, the system metrics thread and the run's end one
    such wait. Values the user set for MLflow's variables are kept.
    """
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(_timeout()))))


def _timeout() -> float:
    return float(os.environ.get(TIMEOUT_ENV, "10"))


def _first_line(exc: BaseException) -> str:
    return masked_uri(next(iter(str(exc).strip().splitlines()), type(exc).__name__))


def _answers(uri: str) -> bool:
    """Whether the server at `uri` answers HTTP at all (a quick look, before sending kept logging)."""
    try:
        _get(uri, "health", timeout=2).close()
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False
    return True


def _get(uri: str, path: str, timeout: float) -> Any:
    """GET `path` of the server at `uri` with the credentials MLflow would send, opened as urllib does.

    MLflow (through requests) takes `user:password@` from the URI, else MLFLOW_TRACKING_USERNAME and
    PASSWORD, or MLFLOW_TRACKING_TOKEN; urllib would read the userinfo as part of the host. Its TLS
    settings (MLFLOW_TRACKING_INSECURE_TLS, MLFLOW_TRACKING_SERVER_CERT_PATH) are kept too.
    """
    parts = urllib.parse.urlsplit(uri)
    netloc = parts.netloc.rpartition("@")[2]
    request = urllib.request.Request(
        urllib.parse.urlunsplit(parts._replace(netloc=netloc, path=f"{parts.path.rstrip('/')}/{path}"))
    )
    user = (
        urllib.parse.unquote(parts.username) if parts.username else os.environ.get("MLFLOW_TRACKING_USERNAME")
    )
    password = (
        urllib.parse.unquote(parts.password) if parts.password else os.environ.get("MLFLOW_TRACKING_PASSWORD")
    )
    if user and password:
        basic = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {basic}")
    elif token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {token}")
    context = None
    if parts.scheme == "https":
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("true", "1"):
            context = ssl._create_unverified_context()  # noqa: S323 - what the user asked MLflow for
        elif cert := os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            context = ssl.create_default_context(cafile=cert)
    return urllib.request.urlopen(request, timeout=timeout, context=context)  # noqa: S310 - http(s) only


def check_reachable(uri: str) -> None:
    """Fail fast, naming the URI, when a tracking server does not answer, or not as MLflow does.

    The wait is GPTLAB_TRACKING_TIMEOUT seconds (default 10). MLflow's answer to a search of
    experiments is JSON; a server asking for credentials (401, 403) is left to MLflow's own calls.
    A local SQLite store is opened and read once (_check_sqlite).
    """
    if uri.startswith("sqlite:///"):
        _check_sqlite(uri)
    if not uri.startswith(("http://", "https://")):
        return
    timeout = _timeout()
    try:
        with _get(uri, _PROBE, timeout) as response:
            status, body = response.status, response.read(1 << 16)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return
        status, body = exc.code, exc.read(1 << 16)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GptlabError(
            f"MLflow tracking server {masked_uri(uri)} is unreachable ({reason}; waited up to {timeout:g} s, "
            f"set {TIMEOUT_ENV} to wait longer): start it, or unset MLFLOW_TRACKING_URI to log to the "
            "local store (mlflow.db)"
        ) from None
    if not _mlflow_answer(body):
        raise GptlabError(
            f"MLFLOW_TRACKING_URI {masked_uri(uri)} answers, but not as an MLflow tracking server (GET /{_PROBE.split('?')[0]}: "
            f"HTTP {status}): point it at an `mlflow server`, or unset it to log to the local store (mlflow.db)"
        )


def _mlflow_answer(body: bytes) -> bool:
    """MLflow's REST API answers a JSON object: the experiments, or an error with its `error_code`."""
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    return isinstance(answer, dict) and (not answer or "experiments" in answer or "error_code" in answer)


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
    """The experiment named `name`, created if needed, tagged for model training and gptlab's view.

    MLflow 3's UI opens an experiment without the kind tag in GenAI mode (an empty traces
    page); the view (gptlab.tracking.ui) gives the runs table its columns. One created before
    either tag, or with an older view, gets them on its next run.
    """
    existing = client.get_experiment_by_name(name)
    if existing is None:
        # mlflow on first use: see imported_mlflow
        from mlflow.exceptions import MlflowException

        try:
            return client.create_experiment(
                name,
                artifact_location=_artifact_location(),
                tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING, **view_tags()},
            )
        except MlflowException:  # created meanwhile by a parallel stage
            existing = client.get_experiment_by_name(name)
            assert existing is not None, f"experiment {name!r} could neither be created nor found"
    for key, value in {EXPERIMENT_KIND_TAG: MODEL_TRAINING, **view_tags()}.items():
        if existing.tags.get(key) != value:
            client.set_experiment_tag(existing.experiment_id, key, value)
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
    with store_errors(uri):
        client = imported_mlflow().MlflowClient(tracking_uri=uri)
        for name in experiments:
            _experiment_id(client, name)


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
