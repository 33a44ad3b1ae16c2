"""Provenance of an MLflow run: the code, params and pipeline it came from, what it read, what it wrote.

A run's tags name its git commit (and dirty state), the `dvc repro` it belongs to,
its host and pid, a hash of its params and the DVC experiment. The whole params.yaml, as the
run reads it, is the pipeline run's own (`effective_params`): the values DVC set for an
experiment (`dvc exp run -S`) count as no uncommitted change. The datasets it
read carry DVC's content hash. The checkpoint it wrote is tagged by the sha256 of
its weights (as its manifest recorded it at save), by which a run that starts from
that checkpoint finds (and links) the run that wrote it. The functions here build
tags and inputs; `tracking.buffered_run.StageRun` logs them.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gptlab.environment import PIPELINE_RUN_ENV, SOURCE_COMMIT_ENV, SOURCE_DIRTY_ENV
from gptlab.paths import REPORTS
from gptlab.schema import flatten
from gptlab.tracking.ui import ui_link

if TYPE_CHECKING:  # mlflow is imported where it is used (tracking.store.imported_mlflow says why)
    from mlflow.entities import DatasetInput
    from mlflow.tracking import MlflowClient

# The tag naming the checkpoint a run wrote: the sha256 of its weights file.
CHECKPOINT_TAG = "gptlab.checkpoint_sha256"


def run_tags(stage: str, params: Mapping[str, Any]) -> dict[str, str]:
    """The tags a stage's run starts with: where its code, params and pipeline came from."""
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
    if os.environ.get("DVC_EXP_BASELINE_REV"):
        tags["gptlab.dvc_baseline"] = os.environ["DVC_EXP_BASELINE_REV"]
    return tags


# What names a dvc process in its command line: the `dvc` script, `python -m dvc`, gptlab's quiet dvc.
_DVC_COMMANDS = {"dvc", "gptlab.pipeline.dvc_quiet"}


def pipeline_run_id() -> str:
    """The same id for every stage that one `dvc repro` (or `dvc exp run`) executes.

    GPTLAB_PIPELINE_RUN wins when set (`gptlab smoke` and `gptlab run` set it: the DVC
    experiment's name and a random suffix). Otherwise the id is derived from the nearest
    ancestor `dvc` process (its pid and start time), which spawns every stage of its run,
    and the DVC experiment's name (DVC_EXP_NAME) where there is one: each queued experiment
    of a sweep runs in a `dvc exp exec-run` of its own. A stage run alone gets an id of its
    own, starting `single-` (`alone`).
    """
    if os.environ.get(PIPELINE_RUN_ENV):
        return os.environ[PIPELINE_RUN_ENV]
    pid = os.getppid()
    for _ in range(8):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            break
        if any(Path(part.decode(errors="replace")).name in _DVC_COMMANDS for part in cmdline[:3]):
            experiment = os.environ.get("DVC_EXP_NAME")
            name = f"{experiment}-" if experiment else ""
            return f"dvc-{name}{pid}-{stat[19]}"  # field 22 of /proc/pid/stat: start time
        pid = int(stat[1])  # parent pid
        if pid <= 1:
            break
    return f"{_ALONE}{uuid.uuid4().hex[:12]}"


_ALONE = "single-"


def alone(pipeline_run: str) -> bool:
    """Whether the id is a stage's run outside any pipeline run (no `dvc` above it, no id set)."""
    return pipeline_run.startswith(_ALONE)


def _git_state() -> tuple[str, bool]:
    """The commit the code came from and whether it had uncommitted changes.

    GPTLAB_SOURCE_COMMIT (and GPTLAB_SOURCE_DIRTY) win when set: `gptlab smoke` runs a copy of the
    project in a throwaway repository whose own commit means nothing to a user. What the
    pipeline writes itself (dvc.lock, reports/) is no uncommitted change, nor is params.yaml
    inside a DVC experiment (DVC_EXP_NAME): DVC applied its `-S` values there and records them
    as the experiment's params (so does the pipeline run's MLflow run: `effective_params`).
    """
    if os.environ.get(SOURCE_COMMIT_ENV):
        return os.environ[SOURCE_COMMIT_ENV], os.environ.get(SOURCE_DIRTY_ENV, "false").lower() == "true"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "-z", "--no-renames", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown", True
    changed = [Path(entry[3:]) for entry in status.split("\0") if entry]  # "XY path", relative to the root
    return commit, any(not _written_by_the_pipeline(path) for path in changed)


def _written_by_the_pipeline(path: Path) -> bool:
    """dvc.lock, reports/... (the stages' outputs), and params.yaml as DVC set it for an experiment."""
    if path == Path("dvc.lock") or path.parts[:1] == (REPORTS.name,):
        return True
    return path == Path("params.yaml") and bool(os.environ.get("DVC_EXP_NAME"))


def effective_params(params_file: Path = Path("params.yaml")) -> dict[str, Any]:
    """The whole of params.yaml as the run reads it, flat; {} where there is none (a stage run alone).

    Inside `dvc exp run -S key=value` it holds the values DVC set. Every pipeline run logs all of
    it, so any two compare like with like: the UI's compare view shows only what differs.
    """
    try:
        return flatten(yaml.safe_load(params_file.read_text(encoding="utf-8")) or {})
    except (OSError, yaml.YAMLError, AttributeError):
        return {}


def dataset_input(
    name: str, path: Path | str, *, context: str, profile: Mapping[str, Any] | None = None
) -> DatasetInput:
    """A dataset a run read: its path, DVC content hash (the digest) and split sizes (profile).

    The digest is what DVC writes to dvc.lock for the path (see `dvc_md5`), computed here
    because dvc.lock's entry for a stage's dependency is only updated after the stage has run.
    """
    # mlflow on first use: see tracking.store.imported_mlflow
    from mlflow.entities import Dataset, DatasetInput, InputTag

    path = Path(path)
    dataset = Dataset(
        name=name,
        digest=dvc_md5(path),
        source_type="local",
        source=json.dumps({"uri": path.resolve().as_uri()}),
        profile=json.dumps(dict(profile or {}), sort_keys=True),
    )
    tags = [InputTag("mlflow.data.context", context), InputTag("gptlab.path", path.as_posix())]
    return DatasetInput(dataset, tags)


# The context of a dataset of the user's own (not the book's), and the prefix of the tags naming it.
OWN_DATA_CONTEXT = "own"
OWN_DATA_TAG = "gptlab.data."


def own_data_tags(name: str, path: Path | str, digest: str) -> dict[str, str]:
    """The tag naming a dataset of the user's own on a run: `gptlab.data.<name>` = "path (DVC md5)"."""
    return {f"{OWN_DATA_TAG}{name}": f"{Path(path).as_posix()} ({digest})"}


def checkpoint_tags(checkpoint: Path | str) -> dict[str, str]:
    """The tag naming a run as the writer of `checkpoint`: the sha256 of its weights (`weights_digest`).

    The checkpoint itself does not name the run: a retrain with the same params
    must write the same bytes (DVC then reruns nothing downstream), and the
    weights' hash finds the run just as well.
    """
    return {CHECKPOINT_TAG: weights_digest(checkpoint)}


def upstream_tags(
    client: MlflowClient, checkpoint: Path | str, metadata: Mapping[str, Any]
) -> dict[str, str]:
    """Tags naming the run that wrote `checkpoint` (found by its weights' hash) and a note linking it.

    Each run links one step up, so the UI walks instruct -> load-gpt2 -> pretrain.
    """
    stage = str(metadata.get("stage") or "unknown")
    digest = weights_digest(checkpoint)
    checkpoint = Path(checkpoint).as_posix()
    tags = {"gptlab.upstream_checkpoint": checkpoint, "gptlab.upstream_stage": stage}
    experiments = [e.experiment_id for e in client.search_experiments()]
    writers = client.search_runs(
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
        link = ui_link(f"experiments/{upstream.experiment_id}/runs/{upstream.run_id}")
        note = f"Started from `{checkpoint}`, written by the run [{upstream.run_name or stage}]({link})."
    tags["mlflow.note.content"] = note
    return tags


def weights_digest(checkpoint: Path | str) -> str:
    """The sha256 of a checkpoint's weights, what identifies a model across runs, as its manifest recorded it.

    Read, not computed again: saving the checkpoint hashed its weights once, and whatever loads
    them checks them against this digest. Read here, not through gptlab.model.checkpoint, which
    would bring torch, and the model's code as dvc.yaml deps, to every stage that logs.
    """
    manifest = json.loads((Path(checkpoint) / "manifest.json").read_text(encoding="utf-8"))
    return manifest["sha256"]["model.safetensors"]


def dvc_md5(path: Path | str) -> str:
    """DVC's content hash of a file or folder, as dvc.lock records it.

    The md5 of a file, or for a folder the md5 of its sorted file list with their md5s, suffixed `.dir`.
    """
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
