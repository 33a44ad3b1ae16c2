"""Model checkpoints: weights as safetensors plus a JSON of the config and metadata.

The model's config travels with its weights, so downstream stages rebuild the
model from the checkpoint alone, never by re-reading another stage's params.
Files are written to a temporary name and renamed, so a crash never leaves a
half-written checkpoint behind.

Training checkpoints (for resuming) add the optimizer, RNG states and data
position as `state.pt`, read back with `torch.load(weights_only=True)`. They
live under `.gptlab/runs/<stage>/<fingerprint>/`, outside DVC's outputs (DVC
deletes those before rerunning a stage), keyed by a hash of everything that
determines the run so that changed params never resume a stale one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab.config import ConfigError, ModelConfig
from gptlab.errors import InputError
from gptlab.model import GPTModel

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
# Resumable training runs, one folder per stage and fingerprint (gitignored).
RUNS_DIR = Path(".gptlab") / "runs"
_STEP_DIR = re.compile(r"^step-(\d{7,})$")
# The process's umask (reading it means setting it, so set it straight back).
_UMASK = os.umask(0)
os.umask(_UMASK)


class CheckpointError(InputError):
    """A training checkpoint that is incomplete, corrupted or does not fit the run."""


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """A temporary path beside `target` that replaces it only if the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with tmp_path.open("rb") as fh:
            os.fsync(fh.fileno())
        # mkstemp makes the file private (0600); give it the mode any new file would get.
        os.chmod(tmp_path, 0o666 & ~_UMASK)
        os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)


def save_model(model: GPTModel, directory: Path | str, metadata: dict[str, Any] | None = None) -> Path:
    """Write `model.safetensors` and `config.json` into `directory`; returns the directory."""
    directory = Path(directory)
    # Tensors must be contiguous and unshared for safetensors; clone breaks tied weights.
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    payload = {"model": model.cfg.to_dict(), "metadata": metadata or {}}
    with atomic_path(directory / CONFIG_FILE) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return directory


def read_config(directory: Path | str) -> tuple[ModelConfig, dict[str, Any]]:
    """The model config and metadata stored beside a checkpoint's weights."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {directory} a gptlab checkpoint? Run its stage first.")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        return ModelConfig.from_dict(payload["model"]), dict(payload.get("metadata", {}))
    except (json.JSONDecodeError, KeyError, ConfigError) as exc:
        raise InputError(f"{path}: not a valid gptlab checkpoint config ({exc})") from exc


def load_model(
    directory: Path | str, device: torch.device | str = "cpu", **overrides: Any
) -> tuple[GPTModel, dict[str, Any]]:
    """Rebuild a GPTModel from a checkpoint directory; returns it (eval mode) and its metadata.

    `overrides` change config fields that do not alter the weights' shapes,
    such as `drop_rate` for fine-tuning or `attention`.
    """
    directory = Path(directory)
    cfg, metadata = read_config(directory)
    cfg = dataclasses.replace(cfg, **overrides)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found: the checkpoint in {directory} is incomplete")
    try:
        state = load_file(str(weights), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{weights}: corrupted or truncated weights file ({exc}); rerun the stage") from exc
    model = GPTModel(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(
            f"{weights} does not match its config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model.to(device).eval(), metadata


# --------------------------------------------------------------------------- #
# Training checkpoints (resumable state)
# --------------------------------------------------------------------------- #


def checkpoint_name(steps: int) -> str:
    """Folder name of the checkpoint taken after `steps` optimizer steps."""
    return f"step-{steps:07d}"


def list_checkpoints(checkpoint_dir: Path | str) -> list[Path]:
    """Complete (renamed into place) training checkpoints, oldest first."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in checkpoint_dir.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def remove_partial_checkpoints(checkpoint_dir: Path | str) -> None:
    """Delete the temporary folders a killed save left behind (they were never renamed into place)."""
    checkpoint_dir = Path(checkpoint_dir)
    if checkpoint_dir.is_dir():
        for path in checkpoint_dir.glob(".step-*.tmp"):
            shutil.rmtree(path, ignore_errors=True)


def save_training_checkpoint(
    checkpoint_dir: Path | str,
    steps: int,
    model: GPTModel,
    state: Mapping[str, Any],
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write weights + training state as `checkpoint_dir/step-XXXXXXX/`, all or nothing.

    Everything goes into a temporary folder that is renamed into place last, so
    a `kill -9` at any moment leaves either the complete checkpoint or none.
    `state` holds only tensors and plain Python values (weights_only loading).
    """
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(steps)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=checkpoint_dir))
    try:
        save_model(model, tmp, metadata)
        with atomic_path(tmp / STATE_FILE) as state_tmp:
            torch.save(dict(state), state_tmp)
        # Sizes catch truncated copies cheaply; content is checked on load by recomputing a loss.
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        with atomic_path(tmp / MANIFEST_FILE) as manifest_tmp:
            manifest_tmp.write_text(json.dumps({"sizes": sizes}, indent=2, sort_keys=True) + "\n")
        final = checkpoint_dir / name
        if final.exists():  # from an earlier attempt at this step: move it aside, then swap
            replaced = checkpoint_dir / f".{name}.replaced.tmp"
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
            os.replace(tmp, final)
            shutil.rmtree(replaced)
        else:
            os.replace(tmp, final)
        _fsync_dir(checkpoint_dir)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_training_checkpoint(
    directory: Path | str, device: torch.device | str = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights (state dict) and training state of a checkpoint; CheckpointError if damaged."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    try:
        sizes = json.loads(manifest_path.read_text(encoding="utf-8"))["sizes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path}: missing or unreadable manifest ({exc})") from exc
    for name, size in sizes.items():
        path = directory / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            raise CheckpointError(
                f"{path}: expected {size} bytes, found {'no file' if actual is None else f'{actual} bytes'}"
            )
    weights_path = directory / WEIGHTS_FILE
    try:
        weights = load_file(str(weights_path), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{weights_path}: unreadable weights ({exc})") from exc
    state_path = directory / STATE_FILE
    try:
        state = torch.load(state_path, map_location=device, weights_only=True)
    # RuntimeError: a damaged zip; UnpicklingError: anything but tensors and plain values.
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"{state_path}: unreadable training state ({exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_path}: expected a dict of training state, got {type(state).__name__}")
    return weights, state


def prune_checkpoints(checkpoint_dir: Path | str, keep: int) -> None:
    """Delete all but the newest `keep` training checkpoints."""
    assert keep >= 1, "at least one checkpoint must be kept"
    for path in list_checkpoints(checkpoint_dir)[:-keep]:
        shutil.rmtree(path)


def run_dir(stage: str, config: Mapping[str, Any], inputs: Iterable[Path | str] = ()) -> Path:
    """`.gptlab/runs/<stage>/<fingerprint>/` for a training run of `stage`.

    The fingerprint hashes `config` (the stage's params and model config, as
    JSON) and the content of every input file (folders are walked), so a run
    resumes only from checkpoints made with exactly the same settings and data.
    """
    digests: dict[str, str] = {}
    for item in inputs:
        item = Path(item)
        if not item.exists():
            raise FileNotFoundError(f"{item} not found: run the stages before this one first")
        files = sorted(p for p in item.rglob("*") if p.is_file()) if item.is_dir() else [item]
        for path in files:
            with path.open("rb") as fh:
                digests[path.as_posix()] = hashlib.file_digest(fh, "sha256").hexdigest()
    payload = json.dumps({"config": config, "inputs": digests}, sort_keys=True, default=str)
    return RUNS_DIR / stage / hashlib.sha256(payload.encode()).hexdigest()[:16]


def finish_run(checkpoint_dir: Path | str) -> None:
    """Delete a run's resumable state once its outputs are written: a finished run never resumes."""
    shutil.rmtree(checkpoint_dir, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
