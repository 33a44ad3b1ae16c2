"""The tracking store: where it is, whether it can be used, and why not, in one line.

`tracking_uri` names the store: MLFLOW_TRACKING_URI, else the project's SQLite
file. `check_reachable` fails fast when it cannot be used (a server that does
not answer, or not as MLflow; a SQLite file that cannot be opened), and
`store_errors` turns what MLflow raises for a store that fails later into one
line naming it and the fix, its password masked (`masked_uri`). mlflow itself is
imported on first use (`imported_mlflow`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from gptlab.environment import VERBOSE_ENV
from gptlab.errors import GptlabError
from gptlab.paths import project_root
from gptlab.tracking.ui import view_tags

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

DEFAULT_DB = "mlflow.db"
# Seconds to wait for a tracking server to answer: before a stage starts, and for its unsent logging at its end.
TIMEOUT_ENV = "GPTLAB_TRACKING_TIMEOUT"
# The REST call that tells an MLflow tracking server from any other HTTP server.
_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"
# The experiment tag MLflow's UI reads to open an experiment as "Model training", not GenAI.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI if set, else the project's local SQLite store, wherever in the project the command runs."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project_root() / DEFAULT_DB}"


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
    timeout = tracking_timeout()
    try:
        status, body = _ask(uri, _PROBE, timeout)
    except ConnectionError as exc:
        raise GptlabError(
            f"MLflow tracking server {masked_uri(uri)} is unreachable ({exc}; waited up to {timeout:g} s, "
            f"set {TIMEOUT_ENV} to wait longer): start it, or unset MLFLOW_TRACKING_URI to log to the "
            "local store (mlflow.db)"
        ) from None
    if status in (401, 403):
        return
    if not _mlflow_answer(body):
        raise GptlabError(
            f"MLFLOW_TRACKING_URI {masked_uri(uri)} answers, but not as an MLflow tracking server (GET {_PROBE.split('?')[0]}: "
            f"HTTP {status}): point it at an `mlflow server`, or unset it to log to the local store (mlflow.db)"
        )


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
        raise StoreError(_database_failure(uri, first_line(exc))) from None


def _mlflow_answer(body: bytes) -> bool:
    """MLflow's REST API answers a JSON object: the experiments, or an error with its `error_code`."""
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    return isinstance(answer, dict) and (not answer or "experiments" in answer or "error_code" in answer)


def _ask(uri: str, endpoint: str, timeout: float) -> tuple[int, bytes]:
    """The status and the first 64 KiB of the body of GET `endpoint`, asked once of the server at `uri`.

    Asked through MLflow's own REST client, so as MLflow's calls ask: with `user:password@` from
    the URI, else MLFLOW_TRACKING_USERNAME and PASSWORD, or MLFLOW_TRACKING_TOKEN, and its TLS
    settings (MLFLOW_TRACKING_INSECURE_TLS, _SERVER_CERT_PATH, _CLIENT_CERT_PATH). A server that
    does not answer is a ConnectionError saying why, in the socket's words ("[Errno 111] Connection
    refused", "timed out"), not the client's paragraph around them.
    """
    imported_mlflow()  # quieted, with its passwords masked, before its client can log
    # mlflow on first use: see imported_mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        response = http_request(
            get_default_host_creds(uri),
            endpoint,
            "GET",
            max_retries=0,
            retry_codes=(),
            timeout=timeout,
            stream=True,
        )
    except MlflowException as exc:
        raise ConnectionError(masked_uri(str(_innermost(exc)))) from None
    with response:
        return response.status_code, response.raw.read(1 << 16, decode_content=True)


def _innermost(exc: BaseException) -> BaseException:
    """The first cause of `exc`: what failed underneath the errors that wrapped it."""
    while (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
    return exc


def tracking_timeout() -> float:
    """The seconds to wait for a tracking server: GPTLAB_TRACKING_TIMEOUT, 10 by default."""
    return float(os.environ.get(TIMEOUT_ENV, "10"))


def create_store(uri: str) -> None:
    """Open the store once, creating a new SQLite store's tables under a lock: whoever comes second waits.

    MLflow creates a new store's tables, then runs its schema migrations, as a process first
    opens it; two doing so at once (two pipelines started together) break each other's
    ("duplicate column name: step"). The lock is an flock on the store's folder, so no lock
    file is left beside it; it is held while this process opens the store (MLflow keeps it open).
    """
    if not uri.startswith("sqlite:///"):
        return  # a server creates its own store, once, as it starts
    folder = Path(uri.removeprefix("sqlite:///").partition("?")[0]).absolute().parent
    if not folder.is_dir():
        return  # MLflow's own error says so
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        imported_mlflow().MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    finally:
        os.close(descriptor)  # and the lock with it


def prepare_store(experiments: list[str]) -> None:
    """Create the tracking store (a new SQLite file is migrated here, once) and the named experiments.

    Before stages start in parallel (`gptlab sweep --jobs N`): processes that find an empty
    SQLite file would each run MLflow's schema migrations on it at the same time, and fail.
    """
    uri = tracking_uri()
    check_reachable(uri)
    with store_errors(uri):
        create_store(uri)
        client = imported_mlflow().MlflowClient(tracking_uri=uri)
        for name in experiments:
            ensure_experiment(client, name)


def ensure_experiment(client: MlflowClient, name: str) -> str:
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


class TrackingLost(GptlabError):
    """The tracking server stopped answering during a run and its logging could not all be sent."""


class StoreError(GptlabError):
    """The tracking store cannot be used (read-only, damaged, locked, gone): one line naming it and the fix."""


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


def store_failure(uri: str, exc: BaseException) -> str | None:
    """The line saying why the store at `uri` failed with `exc`; None when `exc` is no store failure."""
    # mlflow on first use: see imported_mlflow
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException

    store = f"MLflow tracking store {masked_uri(uri)}"
    fix = "or set MLFLOW_TRACKING_URI to another store"
    if server_lost(exc):
        return (
            f"{store} does not answer ({first_line(exc)}; set {TIMEOUT_ENV} to wait longer): start it, {fix}"
        )
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sqlalchemy.exc.DBAPIError):
            return _database_failure(uri, first_line(seen.orig))
        if isinstance(seen, MlflowException) and seen.error_code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return (
                f"{store} refuses the credentials ({first_line(seen)}): give them as user:password@ in the URI, "
                "or set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
            )
        seen = seen.__cause__ or seen.__context__
    return None


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


def _database_failure(uri: str, detail: str) -> str:
    """The line for a database store that failed, saying `detail` (the database's own words)."""
    said = next((said for key, said in _STORE_FAILURES.items() if key in detail.lower()), "fails: check it")
    what, how = said.split(": ", 1)
    return f"MLflow tracking store {masked_uri(uri)} {what} ({detail}): {how}, or set MLFLOW_TRACKING_URI to another store"


def server_lost(exc: BaseException) -> bool:
    """Whether `exc` says the tracking server did not answer (MLflow wraps requests' errors, unchained)."""
    import requests  # loaded by mlflow, which raised `exc`

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, requests.exceptions.RequestException):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def server_answers(uri: str) -> bool:
    """Whether the server at `uri` answers HTTP at all (a quick look, before sending kept logging)."""
    try:
        _ask(uri, "/health", timeout=2)
    except ConnectionError:
        return False
    return True


def bound_http_calls() -> None:
    """MLflow's own HTTP calls give up within GPTLAB_TRACKING_TIMEOUT: one retry, at once.

    MLflow's defaults (7 retries, backoff factor 2, 120 s timeout) make a call to a dead server last
    minutes, and a lost server costs each kept call, the system metrics thread and the run's end one
    such wait. Values the user set for MLflow's variables are kept.
    """
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(tracking_timeout()))))


def first_line(exc: BaseException) -> str:
    """The first line of what `exc` says, its passwords masked: what a one-line error quotes of it."""
    return masked_uri(next(iter(str(exc).strip().splitlines()), type(exc).__name__))


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
