"""Trained checkpoints as MLflow models: logged by their run, registered, promoted, read back.

Each training stage's checkpoint becomes a pyfunc model of its run (the `PyfuncSpec`
that gptlab.serving.specs builds for it), registered as a new version of
`<experiment>-<kind>` (gptlab-spam, ...); `promote` points the `champion` alias at
one version, and `downloaded_model` fetches a logged model's files for the CLI. The
registry is the tracking store's (`tracking.store.tracking_uri`). A checkpoint is
logged only once its files have the sizes its manifest records (the manifest goes
along, and the SHA-256 it records, computed once as the checkpoint was saved, is
checked whenever the model loads), and a model whose files cannot all be written
(a full disk) leaves none behind.
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from gptlab.errors import GptlabError
from gptlab.tracking.buffered_run import StageRun
from gptlab.tracking.store import (
    StoreError,
    check_reachable,
    imported_mlflow,
    masked_uri,
    store_errors,
    store_failure,
    tracking_uri,
)
from gptlab.tracking.ui import ui_link

if TYPE_CHECKING:
    from mlflow.models import ModelSignature

# The kinds of model the training stages register, each as `<experiment>-<kind>`.
MODEL_KINDS = ("pretrain", "spam", "instruct", "preference")
CHAMPION = "champion"
# Artifact names inside a logged model (MLmodel's python_function.artifacts).
CHECKPOINT = "checkpoint"
VOCAB_BPE = "vocab_bpe"
ENCODER_JSON = "encoder_json"

# MLflow draws a progress bar for every artifact download: one for a model's 87 files when the CLI
# loads models:/..., another inside pyfunc.log_model when a stage logs one. Noise in a terminal and
# in a stage's log, so off wherever gptlab logs or loads a model (an explicit setting wins).
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


@dataclass(frozen=True)
class PyfuncSpec:
    """Everything `mlflow.pyfunc` needs to log one checkpoint as a model (gptlab.serving.specs builds it)."""

    python_model: str  # the models-from-code file
    model_config: dict[str, str]
    artifacts: dict[str, str]  # CHECKPOINT, VOCAB_BPE and ENCODER_JSON: their local paths
    code_paths: list[str]
    signature: ModelSignature
    input_example: Any
    pip_requirements: list[str]


def registered_model_name(experiment: str, kind: str) -> str:
    """`gptlab-spam` for the spam model of experiment `gptlab`; another experiment gets its own names."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}: expected one of {MODEL_KINDS}")
    return f"{experiment}-{kind}"


def log_model(
    run: StageRun, kind: str, spec: PyfuncSpec, *, experiment: str, headline: Mapping[str, float]
) -> str | None:
    """Log a checkpoint folder as `run`'s MLflow pyfunc model and register it as a new version.

    `kind` is pretrain, spam, instruct or preference; `spec` the pyfunc model of its checkpoint;
    `headline` the run's final metrics, quoted in the version's description. The model
    holds the checkpoint's files as artifacts (their one copy in MLflow) and is registered
    as `<experiment>-<kind>` (gptlab-spam, ...). Returns the model's URI (models:/<model_id>),
    or None for the disabled run (torchrun ranks other than 0), which logs nothing. A checkpoint
    cut short (a file not of its manifest's size, or no manifest) is refused; a write that fails in
    the artifact store is one line naming it, and the failed model's partial files are deleted.
    """
    if run.run_id is None:
        return None
    # torch with it: here, not at the top, so that `gptlab promote` does not wait for it
    from gptlab.model.checkpoint import recorded_digests

    recorded_digests(spec.artifacts[CHECKPOINT])  # complete as saved; its digests are checked as it loads
    with store_errors(run.uri):
        return _log_model(run, kind, spec, experiment, headline)


def _log_model(
    run: StageRun, kind: str, spec: PyfuncSpec, experiment: str, headline: Mapping[str, float]
) -> str:
    mlflow = imported_mlflow()
    # mlflow on first use: see tracking.store.imported_mlflow
    from mlflow.models import Model

    name = registered_model_name(experiment, kind)
    # Model.log creates the model through the fluent API: its store, and the run's experiment.
    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment(experiment_id=run.client.get_run(run.run_id).info.experiment_id)
    try:
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
    except OSError as exc:  # MLflow's own message names the temporary copy it was writing from
        raise _unwritten_model(mlflow, run, kind, exc) from None
    version = info.registered_model_version
    client = mlflow.MlflowClient(tracking_uri=tracking_uri(), registry_uri=tracking_uri())
    client.update_model_version(name, version, description=version_description(kind, run, headline))
    run.set_tags({"gptlab.model_uri": info.model_uri, "gptlab.registered_model": f"{name}/{version}"})
    print(f"logged model {info.model_uri}, registered as models:/{name}/{version}")
    return info.model_uri


def _unwritten_model(mlflow: ModuleType, run: StageRun, kind: str, exc: OSError) -> GptlabError:
    """The error of a model whose files could not all be written, once its partial copy is deleted.

    MLflow has marked the model FAILED; one of this run's FAILED models only, never another's.
    It writes the model into a temporary folder first, then copies that into the artifact store.
    """
    # mlflow on first use: see tracking.store.imported_mlflow
    from mlflow.entities import LoggedModelStatus
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    reason = exc.strerror or str(exc)
    failed = mlflow.last_logged_model()
    if failed is None or failed.source_run_id != run.run_id or failed.status != LoggedModelStatus.FAILED:
        return GptlabError(f"cannot log the {kind} model: {reason}")
    get_artifact_repository(failed.artifact_location, tracking_uri=tracking_uri()).delete_artifacts()
    written = exc.filename2 or exc.filename  # a copy's error names its source, then its destination
    store = urllib.parse.urlsplit(failed.artifact_location)
    if written and store.scheme == "file" and not Path(written).is_relative_to(store.path):
        return GptlabError(f"cannot log the {kind} model: cannot write {written}: {reason}")
    return GptlabError(
        f"cannot log the {kind} model into the artifact store {masked_uri(failed.artifact_location)}: "
        f"{reason} (its partial copy is deleted, model {failed.model_id} stays FAILED); "
        "free space there, then rerun the stage"
    )


def version_description(kind: str, run: StageRun, headline: Mapping[str, float]) -> str:
    """What the registry page shows of a version: its stage, base model, figures and source run."""
    assert run.client is not None and run.run_id is not None
    logged = run.client.get_run(run.run_id)
    base = logged.data.tags.get("gptlab.base_model", "none (random initial weights)")
    figures = "\n".join(f"- `{name}`: {value:.4g}" for name, value in headline.items())
    stage = logged.data.tags.get("gptlab.stage", kind)
    source = ui_link(f"experiments/{logged.info.experiment_id}/runs/{run.run_id}")
    return (
        f"**{stage}** stage, {kind} model. Base model: {base}.\n\n"
        f"{figures}\n\nSource run: [{logged.info.run_name}]({source}) (`{run.run_id}`)."
    )


@contextmanager
def downloaded_model(uri: str) -> Iterator[tuple[dict[str, Path], dict[str, Any]]]:
    """A logged gptlab model's artifacts, downloaded into a temporary folder for the block.

    Yields local paths by artifact name: `checkpoint` (the folder `checkpoint.load_model`
    reads), `vocab_bpe` and `encoder_json` (GPT-2's BPE files); and the defaults of the
    params in its signature (max_new_tokens, ...).
    """
    mlflow = imported_mlflow()
    # mlflow on first use: see tracking.store.imported_mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    store = tracking_uri()
    _require_store(store, uri)
    check_reachable(store)
    with tempfile.TemporaryDirectory(prefix="gptlab-model-") as tmp, store_errors(store):
        try:
            local = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=uri, dst_path=tmp, tracking_uri=store, registry_uri=store
                )
            )
        except MlflowException as exc:
            if (said := store_failure(store, exc)) is not None:
                raise StoreError(said) from None
            hint = (
                " (set the alias with `gptlab promote NAME VERSION`)"
                if "@" in uri and uri.startswith("models:/")
                else ""
            )
            raise GptlabError(f"{uri}: no such model in {masked_uri(store)}: {exc.message}{hint}") from None
        model = Model.load(local)
        artifacts = model.flavors.get("python_function", {}).get("artifacts", {})
        found = {name: local / entry["path"] for name, entry in artifacts.items()}
        if not {CHECKPOINT, VOCAB_BPE, ENCODER_JSON} <= found.keys():
            raise GptlabError(f"{uri} is not a gptlab model: it lacks a checkpoint and GPT-2's BPE files")
        params = model.signature.params if model.signature is not None else None
        yield found, {spec.name: spec.default for spec in params.params} if params is not None else {}


def _require_store(store: str, uri: str) -> None:
    """A look-up reads a store, never makes one: a local SQLite store that is not there holds no model.

    MLflow would create an empty `mlflow.db` (in the folder the command runs in, outside a project).
    """
    if store.startswith("sqlite:///") and not (path := Path(store.removeprefix("sqlite:///"))).is_file():
        raise GptlabError(
            f"{uri}: no such model: there is no tracking store at {path} (no stage has logged there); "
            "run the stage that logs it here, or set MLFLOW_TRACKING_URI to the store that holds it"
        )


def promote(name: str, version: str, alias: str = CHAMPION) -> str:
    """Point `alias` of registered model `name` at `version`; returns the models:/NAME@ALIAS URI."""
    mlflow = imported_mlflow()
    # mlflow on first use: see tracking.store.imported_mlflow
    from mlflow.exceptions import MlflowException

    store = tracking_uri()
    check_reachable(store)
    with store_errors(store):
        client = mlflow.MlflowClient(tracking_uri=store, registry_uri=store)
        try:
            client.get_model_version(name, version)
        except MlflowException as exc:
            if (said := store_failure(store, exc)) is not None:
                raise StoreError(said) from None
            try:
                client.get_registered_model(name)
            except MlflowException:
                names = sorted(model.name for model in client.search_registered_models(max_results=50))
                raise GptlabError(
                    f"no registered model {name!r} in {masked_uri(store)}: the registered models are "
                    f"{', '.join(names) or 'none yet'} (each successful training stage registers its model)"
                ) from None
            versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
            known = f"its versions are {', '.join(map(str, versions))}" if versions else "it has no versions"
            raise GptlabError(
                f"no version {version} of registered model {name!r} in {masked_uri(store)}: {known} "
                "(each successful training stage registers one)"
            ) from None
        client.set_registered_model_alias(name, alias, version)
    return f"models:/{name}@{alias}"
