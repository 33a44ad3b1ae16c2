"""MLflow tracking for every stage; the only module that imports mlflow.

Default store: `mlflow.db` (SQLite) and `mlruns/` in the project, no server
needed. Setting MLFLOW_TRACKING_URI points every stage at a team server instead.
Each stage execution is one run named after the stage, in one experiment per
pipeline, tagged so that the runs of one `dvc repro` can be found together.
Runs are started with MLflow's fluent API, so they carry MLflow's standard tags
(`mlflow.user`, `mlflow.source.name`, ...) and, with `tracking.system_metrics`,
CPU, memory (and GPU, where MLflow can read it) use as `system/...` metrics.
Each run records the datasets it read (`log_input`, with DVC's content hash) and
the run that produced the checkpoint it started from (`link_upstream`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from gptlab.distributed import is_main
from gptlab.errors import GptlabError

DEFAULT_DB = "mlflow.db"
# Seconds to wait for a tracking server to answer before a stage starts.
TIMEOUT_ENV = "GPTLAB_TRACKING_TIMEOUT"
# The commit (and dirty flag) runs are tagged with when the code runs outside its own checkout,
# e.g. `gptlab smoke` in its throwaway workspace: the project's real commit.
SOURCE_COMMIT_ENV = "GPTLAB_SOURCE_COMMIT"
SOURCE_DIRTY_ENV = "GPTLAB_SOURCE_DIRTY"
# The key of a checkpoint's metadata that names the MLflow run which wrote it.
# The tag naming the checkpoint a run wrote: the sha256 of its weights file.
CHECKPOINT_TAG = "gptlab.checkpoint_sha256"
# The tags grouping the runs of one `gptlab sweep` (the UI filters `tags.gptlab.sweep = 'spam'`).
SWEEP_TAG = "gptlab.sweep"
SWEEP_VARIANT_TAG = "gptlab.sweep_variant"
# The most entries MLflow accepts in one log_batch call, per kind.
_MAX_PARAMS = 100
_MAX_METRICS = 1000
_MAX_TAGS = 100


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI if set, else the project's local SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / DEFAULT_DB}"


class StageRun:
    """A live MLflow run. Metrics go out in batches: one call per evaluation step."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client = client
        self.run_id: str | None = run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        for i in range(0, len(entries), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=entries[i : i + _MAX_METRICS])

    def log_history(self, rows: list[Mapping[str, float]], step_key: str = "step") -> None:
        """Log a metric history (e.g. a loss curve) in as few calls as possible."""
        now = int(time.time() * 1000)
        entries = [
            Metric(k, float(v), now, int(row[step_key]))
            for row in rows
            for k, v in row.items()
            if k != step_key and v is not None
        ]
        for i in range(0, len(entries), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=entries[i : i + _MAX_METRICS])

    def log_params(self, params: Mapping[str, Any]) -> None:
        entries = [Param(k, _param_value(v)) for k, v in params.items()]
        for i in range(0, len(entries), _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=entries[i : i + _MAX_PARAMS])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        entries = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(entries), _MAX_TAGS):
            self.client.log_batch(self.run_id, tags=entries[i : i + _MAX_TAGS])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        self.client.log_figure(self.run_id, figure, artifact_file)

    def log_table(self, data: Any, artifact_file: str) -> None:
        """A table (dict of columns or pandas DataFrame) the MLflow UI shows in its evaluation view."""
        self.client.log_table(self.run_id, data=data, artifact_file=artifact_file)

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_reports(self, folder: Path | str, artifact_path: str, skip: tuple[str, ...] = ()) -> None:
        """The files of a stage's reports folder, except those (figures) already logged on their own."""
        for path in sorted(Path(folder).iterdir()):
            if path.is_file() and path.name not in skip:
                self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_input(
        self, name: str, path: Path | str, *, context: str, profile: Mapping[str, Any] | None = None
    ) -> None:
        """Record a dataset the run read: its path, DVC content hash (the digest) and split sizes (profile).

        The digest is what DVC writes to dvc.lock for the path: the md5 of a file, or for a folder
        the md5 of its sorted file list with their md5s, suffixed `.dir` (computed here, because
        dvc.lock's entry for a stage's dependency is only updated after the stage has run).
        """
        path = Path(path)
        dataset = Dataset(
            name=name,
            digest=dvc_md5(path),
            source_type="local",
            source=json.dumps({"uri": path.resolve().as_uri()}),
            profile=json.dumps(dict(profile or {}), sort_keys=True),
        )
        tags = [InputTag("mlflow.data.context", context), InputTag("gptlab.path", path.as_posix())]
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(dataset, tags)])

    def record_checkpoint(self, checkpoint: Path | str) -> None:
        """Tag this run as the writer of `checkpoint`, by the sha256 of its weights.

        The checkpoint itself does not name the run: a retrain with the same params
        must write the same bytes (DVC then reruns nothing downstream), and the
        weights' hash finds the run just as well.
        """
        self.set_tags({CHECKPOINT_TAG: weights_sha256(checkpoint)})

    def link_upstream(self, checkpoint: Path | str, metadata: Mapping[str, Any]) -> None:
        """Tag the run that wrote `checkpoint` (found by its weights' hash) and link it in the description.

        Each run links one step up, so the UI walks instruct -> load-gpt2 -> pretrain.
        """
        stage = str(metadata.get("stage") or "unknown")
        digest = weights_sha256(checkpoint)
        checkpoint = Path(checkpoint).as_posix()
        tags = {"gptlab.upstream_checkpoint": checkpoint, "gptlab.upstream_stage": stage}
        experiments = [e.experiment_id for e in self.client.search_experiments()]
        writers = self.client.search_runs(
            experiments,
            filter_string=f"tags.`{CHECKPOINT_TAG}` = '{digest}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not writers:
            note = f"Started from `{checkpoint}` (stage {stage}), written by no run in this MLflow store."
        else:
            upstream = writers[0].info
            tags["gptlab.upstream_run_id"] = upstream.run_id
            link = f"#/experiments/{upstream.experiment_id}/runs/{upstream.run_id}"
            note = f"Started from `{checkpoint}`, written by the run [{upstream.run_name or stage}]({link})."
        tags["mlflow.note.content"] = note
        self.set_tags(tags)

    def log_model(self, kind: str, checkpoint: Path | str, params: Any) -> str | None:
        """The checkpoint as this run's MLflow model, registered; see `log_model` below."""
        return log_model(self, kind, checkpoint, params)


class NullRun(StageRun):
    """The tracker of a torchrun process other than rank 0: it logs nothing (rank 0 logs for all)."""

    def __init__(self) -> None:
        self.run_id = None

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        pass

    def log_history(self, rows: list[Mapping[str, float]], step_key: str = "step") -> None:
        pass

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_dict(self, data: Any, artifact_file: str) -> None:
        pass

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        pass

    def log_table(self, data: Any, artifact_file: str) -> None:
        pass

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        pass

    def log_reports(self, folder: Path | str, artifact_path: str, skip: tuple[str, ...] = ()) -> None:
        pass

    def log_input(
        self, name: str, path: Path | str, *, context: str, profile: Mapping[str, Any] | None = None
    ) -> None:
        pass

    def record_checkpoint(self, checkpoint: Path | str) -> None:
        pass

    def link_upstream(self, checkpoint: Path | str, metadata: Mapping[str, Any]) -> None:
        pass

    def log_model(self, kind: str, checkpoint: Path | str, params: Any) -> str | None:
        return None


NULL_RUN = NullRun()


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
    tags = _run_tags(stage, params)
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
        if tags.get("gptlab.host") == host and not _process_alive(int(tags.get("gptlab.pid", "0"))):
            client.set_terminated(run.info.run_id, status="KILLED")


def _process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _experiment_id(client: MlflowClient, name: str) -> str:
    existing = client.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    try:
        return client.create_experiment(name, artifact_location=_artifact_location())
    except mlflow.exceptions.MlflowException:  # created meanwhile by a parallel stage
        existing = client.get_experiment_by_name(name)
        assert existing is not None, f"experiment {name!r} could neither be created nor found"
        return existing.experiment_id


def _artifact_location() -> str | None:
    """Keep a local SQLite store's artifacts beside its database, not in whatever cwd is."""
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        return None  # a server decides
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlruns").resolve().as_uri()


def _run_tags(stage: str, params: Mapping[str, Any]) -> dict[str, str]:
    commit, dirty = _git_state()
    params_json = json.dumps({k: params[k] for k in sorted(params)}, default=str)
    tags = {
        "gptlab.stage": stage,
        "gptlab.pipeline_run": pipeline_run_id(),
        "gptlab.params_hash": hashlib.sha256(params_json.encode()).hexdigest()[:16],
        "mlflow.source.git.commit": commit,
        "gptlab.git_dirty": str(dirty).lower(),
        "gptlab.host": socket.gethostname(),
        "gptlab.pid": str(os.getpid()),
    }
    if os.environ.get("DVC_EXP_NAME"):
        tags["gptlab.dvc_exp"] = os.environ["DVC_EXP_NAME"]
    return tags


def pipeline_run_id() -> str:
    """The same id for every stage that one `dvc repro` (or `dvc exp run`) executes.

    GPTLAB_PIPELINE_RUN wins when set. Otherwise the id is derived from the
    ancestor `dvc` process (its pid and start time), which spawns every stage.
    """
    if os.environ.get("GPTLAB_PIPELINE_RUN"):
        return os.environ["GPTLAB_PIPELINE_RUN"]
    pid = os.getppid()
    for _ in range(8):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            break
        if any(Path(part.decode(errors="replace")).name == "dvc" for part in cmdline[:2]):
            return f"dvc-{pid}-{stat[19]}"  # field 22 of /proc/pid/stat: start time
        pid = int(stat[1])  # parent pid
        if pid <= 1:
            break
    return f"single-{uuid.uuid4().hex[:12]}"


def _git_state() -> tuple[str, bool]:
    """The commit the code came from and whether it had uncommitted changes.

    GPTLAB_SOURCE_COMMIT (and GPTLAB_SOURCE_DIRTY) win when set: `gptlab smoke` runs a copy of the
    project in a throwaway repository whose own commit means nothing to a user.
    """
    if os.environ.get(SOURCE_COMMIT_ENV):
        return os.environ[SOURCE_COMMIT_ENV], os.environ.get(SOURCE_DIRTY_ENV, "false").lower() == "true"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
        return commit, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", True


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


def weights_sha256(checkpoint: Path | str) -> str:
    """sha256 of a checkpoint folder's weights file: what identifies a model across runs."""
    with (Path(checkpoint) / "model.safetensors").open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def dvc_md5(path: Path | str) -> str:
    """DVC's content hash of a file or folder, as dvc.lock records it (md5; folders end in `.dir`)."""
    path = Path(path)
    if path.is_file():
        return _md5_file(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} not found")
    entries = sorted(
        (
            {"md5": _md5_file(p), "relpath": p.relative_to(path).as_posix()}
            for p in path.rglob("*")
            if p.is_file()
        ),
        key=lambda entry: entry["relpath"],
    )
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"  # noqa: S324


def _md5_file(path: Path) -> str:
    digest = hashlib.md5()  # noqa: S324 - DVC's content hash, not security
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
                "wall_seconds": run.data.metrics.get("wall_seconds"),
            }
    return found


# --- Logged models, the model registry, and models read back from MLflow (issue 12) ---

# Stage model kind -> (registered model name under the experiment, pyfunc kind of gptlab.pyfunc_models).
MODEL_KINDS: dict[str, tuple[str, str]] = {
    "pretrain": ("pretrain", "lm"),
    "spam": ("spam", "spam"),
    "instruct": ("instruct", "instruct"),
}
CHAMPION = "champion"


def registered_model_name(experiment: str, kind: str) -> str:
    """`gptlab-spam` for the spam model of experiment `gptlab`; another experiment gets its own names."""
    return f"{experiment}-{MODEL_KINDS[kind][0]}"


def log_model(run: StageRun, kind: str, checkpoint: Path | str, params: Any) -> str | None:
    """Log a checkpoint folder as this run's MLflow pyfunc model and register it as a new version.

    `kind` is pretrain, spam or instruct; `params` the stage's Params. The model
    holds the checkpoint's files as artifacts (their one copy in MLflow) and is
    registered as `<tracking.experiment>-<kind>` (gptlab-spam, ...). Nothing is
    logged when `tracking.log_models` is false: DVC keeps the checkpoint. Returns
    the model's URI (models:/<model_id>), or None.
    """
    if not params.tracking.log_models:
        return None
    import importlib

    # By name: gptlab.pyfunc_models (and mlflow.pyfunc) stay out of the stages' import closure.
    pyfunc_models = importlib.import_module("gptlab.pyfunc_models")
    from mlflow.models import Model

    raw_dir = Path(params.data.raw_dir)
    defaults: dict[str, Any] = {}
    if kind == "instruct":
        defaults = {"max_new_tokens": params.instruct.max_new_tokens}
    elif kind == "pretrain":
        sample = params.pretrain.sample
        defaults = {
            "max_new_tokens": sample.max_new_tokens,
            "temperature": sample.temperature,
            "top_k": sample.top_k,
            "seed": sample.seed,
        }
    spec = pyfunc_models.model_spec(
        MODEL_KINDS[kind][1],
        checkpoint,
        raw_dir / params.data.sources.gpt2_vocab_bpe.path,
        raw_dir / params.data.sources.gpt2_encoder_json.path,
        defaults,
    )
    name = registered_model_name(params.tracking.experiment, kind)
    # Model.log creates the model through the fluent API: its store, and the run's experiment.
    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment(experiment_id=run.client.get_run(run.run_id).info.experiment_id)
    info = Model.log(
        None,  # artifact_path: deprecated for name
        name=name,
        flavor=mlflow.pyfunc,
        run_id=run.run_id,
        registered_model_name=name,
        python_model=spec.python_model,
        model_config=spec.model_config,
        artifacts=spec.artifacts,
        code_paths=spec.code_paths,
        signature=spec.signature,
        input_example=spec.input_example,
        pip_requirements=spec.pip_requirements,
        tags={"gptlab.kind": kind},
    )
    version = info.registered_model_version
    run.set_tags({"gptlab.model_uri": info.model_uri, "gptlab.registered_model": f"{name}/{version}"})
    print(f"logged model {info.model_uri}, registered as models:/{name}/{version}")
    return info.model_uri


@contextmanager
def downloaded_model(uri: str) -> Iterator[tuple[dict[str, Path], dict[str, Any]]]:
    """A logged gptlab model's artifacts, downloaded into a temporary folder for the block.

    Yields local paths by artifact name: `checkpoint` (the folder `checkpoint.load_model`
    reads), `vocab_bpe` and `encoder_json` (GPT-2's BPE files); and the defaults of the
    params in its signature (max_new_tokens, ...).
    """
    import tempfile

    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    store = tracking_uri()
    check_reachable(store)
    with tempfile.TemporaryDirectory(prefix="gptlab-model-") as tmp:
        try:
            local = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=uri, dst_path=tmp, tracking_uri=store, registry_uri=store
                )
            )
        except MlflowException as exc:
            hint = (
                " (set the alias with `gptlab promote NAME VERSION`)"
                if "@" in uri and uri.startswith("models:/")
                else ""
            )
            raise GptlabError(f"{uri}: no such model in {store}: {exc.message}{hint}") from None
        model = Model.load(local)
        artifacts = model.flavors.get("python_function", {}).get("artifacts", {})
        found = {name: local / entry["path"] for name, entry in artifacts.items()}
        if not {"checkpoint", "vocab_bpe", "encoder_json"} <= found.keys():
            raise GptlabError(f"{uri} is not a gptlab model: it lacks a checkpoint and GPT-2's BPE files")
        params = model.signature.params if model.signature is not None else None
        yield found, {spec.name: spec.default for spec in params.params} if params is not None else {}


def promote(name: str, version: str, alias: str = CHAMPION) -> str:
    """Point `alias` of registered model `name` at `version`; returns the models:/NAME@ALIAS URI."""
    from mlflow.exceptions import MlflowException

    store = tracking_uri()
    check_reachable(store)
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    try:
        client.get_model_version(name, version)
    except MlflowException:
        try:
            versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        except MlflowException:
            versions = []
        known = f"its versions are {', '.join(map(str, versions))}" if versions else "it has no versions"
        raise GptlabError(
            f"no version {version} of registered model {name!r} in {store}: {known} "
            "(each successful training stage registers one)"
        ) from None
    client.set_registered_model_alias(name, alias, version)
    return f"models:/{name}@{alias}"
