"""What a checkpoint is on disk: a model's (weights + config JSON) and a training run's.

A model checkpoint (a model folder: models/spam, ...) is `model.safetensors` plus
`config.json` holding the model's config and metadata, so downstream stages
rebuild the model from the checkpoint alone, never by re-reading another stage's
params, and `manifest.json` with each file's size and SHA-256 (as sha256sum prints
it): `read_config` and `load_model` check the file they read against it, so a
damaged or edited file is refused, naming it, even where its values stay finite.
A training checkpoint
(`step-XXXXXXX/` in a run's resume folder, see gptlab.training.resume) adds the optimizer,
the RNG states and the loop's `Progress` (`state.pt`, tensors and plain values
only), and its manifest records the SHA-256 of what was to be written instead
(`content_digest`), which reading it back checks. Every
file is written to a temporary name and renamed, so a crash never leaves a
half-written checkpoint behind.
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab.errors import InputError
from gptlab.files import WriteError, atomic_path, fsync_dir, naming_write_failures, sha256_file
from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.schema import ConfigError

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
STATE_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{7,})$")


class CheckpointError(InputError):
    """A checkpoint (model folder or training checkpoint) that is incomplete, damaged or does not fit."""


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    steps: int = 0  # optimizer steps taken
    epoch: int = 0  # 0-based epoch in progress
    batch: int = 0  # batches of that epoch already trained on
    seen: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    # rng: book: the RNG state as the epoch in progress began, to replay its data order on resume.
    epoch_rng: dict[str, Any] | None = None


# ---------------------------------------------------------------------- #
# Model checkpoints
# ---------------------------------------------------------------------- #


def save_model(model: GPTModel, directory: Path | str, metadata: dict[str, Any] | None = None) -> Path:
    """Write `model.safetensors` and `config.json` into `directory`; returns the directory."""
    return save_weights(cpu_weights(model), model.cfg, directory, metadata)


def cpu_weights(model: GPTModel) -> dict[str, torch.Tensor]:
    """A copy of the model's weights on the CPU, as safetensors wants them: contiguous and unshared."""
    # clone breaks tied weights.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def save_weights(
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    directory: Path | str,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write weights taken by `cpu_weights`, their config and the manifest of both; returns the directory.

    The manifest goes last (an earlier save's first out): a save cut short leaves none, and is refused.
    """
    directory = Path(directory)
    manifest = directory / MANIFEST_FILE
    if manifest.exists():
        with naming_write_failures(manifest):
            manifest.unlink()
    _write_model_files(weights, cfg, directory, metadata)
    write_model_manifest(directory)
    return directory


def write_model_manifest(directory: Path) -> None:
    """Record the size and SHA-256 of a model folder's files, as they are now, in its manifest."""
    files = (WEIGHTS_FILE, CONFIG_FILE)
    write_manifest(directory, files, {name: sha256_file(directory / name) for name in files})


def _write_model_files(
    weights: dict[str, torch.Tensor], cfg: ModelConfig, directory: Path, metadata: dict[str, Any] | None
) -> None:
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file(weights, str(tmp), metadata={"format": "pt"})
    payload = {"model": cfg.to_dict(), "metadata": metadata or {}}
    with atomic_path(directory / CONFIG_FILE) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_config(directory: Path | str) -> tuple[ModelConfig, dict[str, Any]]:
    """The model config and metadata stored beside a checkpoint's weights, checked against its manifest."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {directory} a gptlab checkpoint? Run its stage first.")
    verify_model_file(Path(directory), CONFIG_FILE)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        return ModelConfig.from_dict(payload["model"]), dict(payload.get("metadata", {}))
    except (json.JSONDecodeError, KeyError, ConfigError) as exc:
        raise InputError(f"{path}: not a valid gptlab checkpoint config ({exc})") from exc


def recorded_digests(directory: Path | str) -> dict[str, str]:
    """The SHA-256 of a model folder's files as its manifest recorded them at save, each file at its recorded size.

    What publishing a model tags and logs it by: the save hashed its files once, and whatever
    loads them checks them against these digests (verify_model_file), so they are not read again.
    """
    directory = Path(directory)
    return {name: _recorded_digest(directory, name) for name in (CONFIG_FILE, WEIGHTS_FILE)}


def verify_model_file(directory: Path, name: str) -> None:
    """Refuse `directory/name` unless its size and SHA-256 are those its manifest recorded at save."""
    recorded = _recorded_digest(directory, name)
    path = directory / name
    if sha256_file(path) != recorded:  # read_manifest found it, at its recorded size
        raise CheckpointError(
            f"{path}: its SHA-256 is not the one recorded in {MANIFEST_FILE} when it was saved (a damaged "
            f"or edited file); rebuild it: {_rebuild_hint(directory)}"
        )


def _recorded_digest(directory: Path, name: str) -> str:
    """The SHA-256 that `directory`'s manifest records for `name`, once the files it lists have their recorded sizes.

    A folder without a manifest was written before model folders had one: rebuilt, never trusted.
    """
    path = directory / name
    if not (directory / MANIFEST_FILE).is_file():
        raise CheckpointError(
            f"{directory}: no {MANIFEST_FILE}, so its files cannot be checked (a model folder from an "
            f"older gptlab, or a save cut short); rebuild it: {_rebuild_hint(directory)}"
        )
    recorded = read_manifest(directory).get(name)
    if recorded is None:
        raise CheckpointError(
            f"{path}: {directory / MANIFEST_FILE} records no SHA-256 of it (not a model folder, or an edited "
            f"manifest); rebuild it: {_rebuild_hint(directory)}"
        )
    return recorded


def _rebuild_hint(directory: Path) -> str:
    """`dvc repro <stage>` for the stage its config names (unverified: only to say which), else a rerun."""
    try:
        stage = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))["metadata"]["stage"]
    except (OSError, ValueError, KeyError, TypeError):
        stage = None
    return f"`dvc repro {stage}`" if isinstance(stage, str) and stage else "rerun the stage that wrote it"


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
    verify_model_file(directory, WEIGHTS_FILE)
    try:
        state = load_file(str(weights), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{weights}: corrupted or truncated weights file ({exc}); rerun the stage") from exc
    require_finite(state, weights)
    model = build_gpt(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if wrong := [
        name for name, shape in shapes.items() if name in state and tuple(state[name].shape) != shape
    ]:
        name = wrong[0]
        raise InputError(
            f"{directory}: {CONFIG_FILE} does not match {WEIGHTS_FILE}: {name} is "
            f"{list(state[name].shape)} in the weights but {list(shapes[name])} by the config "
            f"({len(wrong)} of {len(shapes)} tensors differ); was config.json edited? rerun the stage that wrote it"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(
            f"{weights} does not match its config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model.to(device).eval(), metadata


def require_finite(weights: Mapping[str, torch.Tensor], path: Path) -> None:
    """Refuse weights holding a NaN or an infinity (one pass): such a model answers nan, never an error."""
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InputError(
                f"{path}: tensor {name} holds NaN or infinite values (a damaged file, or training that "
                "diverged); rerun the stage that wrote it"
            )


# ---------------------------------------------------------------------- #
# Training checkpoints
# ---------------------------------------------------------------------- #


def checkpoint_name(steps: int) -> str:
    """Folder name of the checkpoint taken after `steps` optimizer steps."""
    return f"step-{steps:07d}"


def list_checkpoints(folder: Path | str) -> list[Path]:
    """Complete (renamed into place) training checkpoints, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def remove_partial_checkpoints(folder: Path | str) -> None:
    """Delete the temporary folders a killed save left behind (they were never renamed into place)."""
    folder = Path(folder)
    if folder.is_dir():
        for path in folder.glob(".step-*.tmp"):
            shutil.rmtree(path, ignore_errors=True)


def prune_checkpoints(folder: Path | str, keep: int) -> None:
    """Delete all but the newest `keep` training checkpoints."""
    assert keep >= 1, "at least one checkpoint must be kept"
    for path in list_checkpoints(folder)[:-keep]:
        shutil.rmtree(path)


def save_training_checkpoint(
    folder: Path | str,
    steps: int,
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    state: Mapping[str, Any],
) -> Path:
    """Write weights (from `cpu_weights`) + training state as `folder/step-XXXXXXX/`, all or nothing.

    Everything goes into a temporary folder that is renamed into place last, so
    a `kill -9` at any moment leaves either the complete checkpoint or none.
    `state` holds only tensors and plain Python values (weights_only loading).
    The manifest records each file's size and the SHA-256 of what was to be
    written (`content_digest`), which loading checks.
    """
    folder = Path(folder)
    final = folder / checkpoint_name(steps)
    with naming_write_failures(final):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=folder))
    try:
        _write_checkpoint_files(tmp, cfg, weights, state)
        with naming_write_failures(final):
            _swap_into_place(tmp, final)
        return final
    except WriteError as exc:  # name the file as it would have been, not its temporary folder
        raise exc.moved(tmp, final) from exc.__cause__
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_checkpoint_files(
    tmp: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor], state: Mapping[str, Any]
) -> None:
    """The weights, config, training state and manifest of a checkpoint, into its temporary folder."""
    _write_model_files(weights, cfg, tmp, None)
    with atomic_path(tmp / STATE_FILE) as state_tmp, state_tmp.open("wb") as fh:
        torch.save(dict(state), fh)  # through a Python file: a full disk is an OSError, not "unexpected pos"
    digests = {WEIGHTS_FILE: content_digest(weights), STATE_FILE: content_digest(dict(state))}
    write_manifest(tmp, (CONFIG_FILE, WEIGHTS_FILE, STATE_FILE), digests)


def write_manifest(directory: Path, files: tuple[str, ...], sha256: Mapping[str, str]) -> None:
    """`manifest.json`: the size of each of `files` (written already) and the `sha256` digests given.

    Sizes catch truncated copies cheaply; the digests any other change of content.
    """
    sizes = {name: (directory / name).stat().st_size for name in files}
    manifest = {"sizes": sizes, "sha256": dict(sha256)}
    with atomic_path(directory / MANIFEST_FILE) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def read_manifest(directory: Path) -> dict[str, str]:
    """The SHA-256 digests a folder's manifest records, once each file it lists has its recorded size."""
    manifest_path = directory / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        sizes, digests = dict(manifest["sizes"]), dict(manifest["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path}: missing or unreadable manifest ({exc})") from exc
    for name, size in sizes.items():
        path = directory / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            raise CheckpointError(
                f"{path}: expected {size} bytes, found {'no file' if actual is None else f'{actual} bytes'}"
            )
    return digests


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete folder `tmp` to `final`, replacing one from an earlier attempt at this step."""
    folder = final.parent
    if final.exists():  # move it aside, then swap
        replaced = folder / f".{final.name}.replaced.tmp"
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
        os.replace(tmp, final)
        shutil.rmtree(replaced)
    else:
        os.replace(tmp, final)
    fsync_dir(folder)


def load_training_checkpoint(
    directory: Path | str, device: torch.device | str = "cpu", *, mmap: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights (state dict) and training state of a checkpoint; CheckpointError if damaged.

    `mmap` maps the training state instead of reading it into memory: for checking a
    save, whose pages are still cached (~2 s less for GPT-2 small's AdamW state).
    """
    directory = Path(directory)
    digests = read_manifest(directory)
    weights_path = directory / WEIGHTS_FILE
    try:
        weights = load_file(str(weights_path), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{weights_path}: unreadable weights ({exc})") from exc
    state_path = directory / STATE_FILE
    try:
        state = torch.load(state_path, map_location=device, weights_only=True, mmap=mmap)
    # RuntimeError: a damaged zip; UnpicklingError: anything but tensors and plain values.
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"{state_path}: unreadable training state ({exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_path}: expected a dict of training state, got {type(state).__name__}")
    for path, content in ((weights_path, weights), (state_path, state)):
        if content_digest(content) != digests.get(path.name):
            raise CheckpointError(
                f"{path}: its content does not match the SHA-256 recorded when it was saved"
            )
    return weights, state


def content_digest(value: Any) -> str:
    """SHA-256 of a nest of dicts, lists and tuples of tensors and plain values, as loaded back.

    Tensors count by dtype, shape and bytes, on any device; dicts in key order
    (safetensors does not keep the order they were saved in).
    """
    digest = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            data = item.detach().to("cpu").contiguous()
            digest.update(f"tensor {data.dtype} {tuple(data.shape)};".encode())
            digest.update(data.reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(item, Mapping):
            digest.update(f"dict {len(item)};".encode())
            for key in sorted(item, key=repr):
                feed(key)
                feed(item[key])
        elif isinstance(item, list | tuple):
            digest.update(f"{type(item).__name__} {len(item)};".encode())
            for element in item:
                feed(element)
        else:
            digest.update(f"{type(item).__name__} {item!r};".encode())

    feed(value)
    return digest.hexdigest()


def cpu_copy(value: Any) -> Any:
    """A copy of a nest of dicts, lists and tuples whose tensors are cloned to the CPU (and detached)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {key: cpu_copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(cpu_copy(item) for item in value)
    return value
