"""The life of a training run's resume folder: locked, saved into, verified, resumed, removed.

A training run keeps its state under `.gptlab/runs/<stage>/<fingerprint>/`,
outside DVC's outputs (DVC deletes those before rerunning a stage), keyed by a
hash of everything that determines the run's numbers, so changed params or data
never resume a stale one (and operational settings, such as how often to save,
never keep one from resuming). The number of processes under torchrun is one of
them (each trains its share of the batches): a run of N > 1 processes keeps its
folder apart (`<fingerprint>-<N>procs`), so relaunching it with another count
trains beside it and deletes nothing; a checkpoint of another count found in a
run's folder (one saved before the folders were apart) is refused, kept. The folder is

- created and locked when a stage starts training (`resume_folder`); a second
  process training the same run is refused, and the lock dies with its process;
- filled by `Checkpointer.save`: the training state copied to the CPU, then
  written (in gptlab.model.checkpoint's format) in a background thread while training
  goes on, read back and checked against the copy's SHA-256 before older saves
  are pruned (a failure surfaces at the next save or at `wait`);
- read by `Checkpointer.resume` after a crash, checked again by its digests and
  by recomputing a loss, so the rerun ends with the same numbers as an
  uninterrupted run;
- removed once the stage has published its outputs: a finished run never resumes.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptlab.errors import InputError
from gptlab.files import exclusive_lock, sha256_file
from gptlab.model.checkpoint import (
    STATE_FORMAT,
    CheckpointError,
    Progress,
    cpu_copy,
    cpu_weights,
    list_checkpoints,
    load_training_checkpoint,
    prune_checkpoints,
    remove_partial_checkpoints,
    save_training_checkpoint,
)
from gptlab.model.gpt import GPTModel
from gptlab.training import distributed
from gptlab.training.data_order import forked_rng, rng_state, set_rng_state

# Resumable training runs, one folder per stage and fingerprint (gitignored).
RUNS_DIR = Path(".gptlab") / "runs"


def run_fingerprint(config: Mapping[str, Any], inputs: Iterable[Path | str] = ()) -> str:
    """A hash of `config` (as JSON) and the content of every input file (folders are walked)."""
    digests: dict[str, str] = {}
    for item in inputs:
        item = Path(item)
        if not item.exists():
            raise FileNotFoundError(f"{item} not found: run the stages before this one first")
        files = sorted(p for p in item.rglob("*") if p.is_file()) if item.is_dir() else [item]
        for path in files:
            digests[path.as_posix()] = sha256_file(path)
    payload = json.dumps({"config": config, "inputs": digests}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@contextmanager
def resume_folder(stage: str, config: Mapping[str, Any], inputs: Iterable[Path | str] = ()) -> Iterator[Path]:
    """The resume folder of this run of `stage`, locked for the block and removed when it succeeds.

    The block trains and publishes the stage's outputs; if it raises (or the
    process dies) the folder stays, so a rerun resumes. Under torchrun rank 0
    owns the lock and the removal, and the folder is that process count's own.
    """
    fingerprint = run_fingerprint(config, inputs)
    processes = distributed.world().size
    folder = RUNS_DIR / stage / (fingerprint if processes == 1 else f"{fingerprint}-{processes}procs")
    if not distributed.is_main():
        yield folder
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    for other in sorted(folder.parent.glob(f"{fingerprint}*")):
        if other.is_dir() and other != folder and list_checkpoints(other):
            print(
                f"note: {other} holds this run interrupted with another number of processes; this one "
                f"({processes}) trains apart and leaves it: relaunch with that number to resume it",
                file=sys.stderr,
            )
    lock = folder.with_name(f"{folder.name}.lock")
    busy = f"another process ({{}}) is training into {folder}: wait for it to finish, or stop it, then rerun"
    with exclusive_lock(lock, f"pid {os.getpid()}", lambda holder: busy.format(holder or "pid unknown")):
        yield folder
        shutil.rmtree(folder, ignore_errors=True)
        lock.unlink(missing_ok=True)  # still held here, so no one else is training into the folder


class OtherProcessCount(CheckpointError):
    """A checkpoint made by another number of processes: the right launch resumes it, so it is kept."""


class Checkpointer:
    """Saves the training state of one run into its folder and restores the newest good one.

    `probe_loss(model)` computes a fixed batch's loss, recorded at save time: a
    checkpoint is resumed from only once its weights, read back, give that loss.
    Saves run in a background thread, one at a time; `wait` ends the one in
    flight and raises its error, if any.
    """

    def __init__(
        self,
        folder: Path,
        model: GPTModel,
        optimizer: torch.optim.Optimizer,
        train_config: Mapping[str, Any],
        probe_loss: Callable[[nn.Module], float],
        *,
        keep: int,
        world: distributed.World,
        device: torch.device,
    ) -> None:
        self.folder = Path(folder)
        self.model = model
        self.optimizer = optimizer
        self.train_config = dict(train_config)
        self.probe_loss = probe_loss
        self.keep = keep
        self.world = world
        self.device = device
        self.main = world.rank == 0
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None

    def save(self, progress: Progress, *, finished: bool = False) -> None:
        """Copy the training state to the CPU now; write, read back, check and prune in the background.

        Under torchrun rank 0 writes it, with every rank's RNG state. A `finished` run's
        save leaves out the optimizer's moments: no step is left to take with them (its
        train settings, the number of steps among them, must match to resume), and for
        AdamW they are twice the weights' size to copy, write and check.
        """
        self.wait()
        rank_rngs = distributed.gather(rng_state()) if self.world.size > 1 else None
        with forked_rng(self.device):  # nothing here may shift the training RNG
            probe_loss = self.probe_loss(self.model)
        if not math.isfinite(probe_loss):
            raise FloatingPointError(
                f"after step {progress.steps - 1} the model's loss is {probe_loss}: the weights "
                "diverged; not saving them. Lower train.lr or set train.grad_clip, then rerun."
            )
        if not self.main:
            return
        state = {
            "format": STATE_FORMAT,
            "train_config": self.train_config,
            "progress": dataclasses.asdict(progress),
            "optimizer": cpu_copy(optimizer_state(self.optimizer, moments=not finished)),
            "rng": rng_state(),
            "probe_loss": probe_loss,
        }
        if rank_rngs is not None:
            state.update(world_size=self.world.size, rank_rngs=rank_rngs)
        weights = cpu_weights(self.model)
        self._writer = threading.Thread(
            target=self._write, args=(progress.steps, weights, state), name="checkpoint-writer"
        )
        self._writer.start()

    @contextmanager
    def saving(self, later: ExitStack | None = None) -> Iterator[None]:
        """A block that saves: on leaving it the save in flight ends, and its failure is raised.

        If the block itself raises, the save still ends (so the checkpoint is there
        to resume from), and the block's error is the one that propagates. With
        `later`, a block that ends normally leaves its last save running until
        `later` closes.
        """
        try:
            yield
        except BaseException:
            self.settle()
            raise
        if later is None:
            self.wait()
        else:
            later.enter_context(self.saving())

    def wait(self) -> None:
        """Let the save in flight finish; raise what it raised. Under torchrun every rank waits for it."""
        failure = self.settle()
        distributed.barrier()
        if failure is not None:
            raise failure

    def settle(self) -> BaseException | None:
        """Let the save in flight finish, on this process alone; return what it raised (training is failing)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        failure, self._failure = self._failure, None
        return failure

    def _write(self, steps: int, weights: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        try:
            path = save_training_checkpoint(self.folder, steps, self.model.cfg, weights, state)
            try:  # the digests were taken from the copy in memory; reading checks them
                load_training_checkpoint(path, mmap=True)
            except CheckpointError as exc:
                raise CheckpointError(
                    f"{path} does not read back as written ({exc}); is the disk full or failing?"
                ) from exc
            prune_checkpoints(self.folder, self.keep)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._failure = exc

    def resume(self) -> Progress | None:
        """Restore the newest checkpoint that loads and checks out; None to start afresh.

        Under torchrun rank 0 picks (and tidies) and the other ranks restore its pick.
        """
        if not self.main:
            path = distributed.broadcast(None)
            return None if path is None else self._restore(path)
        remove_partial_checkpoints(self.folder)
        refused: list[Path] = []
        progress, resumed_from = None, None
        for path in reversed(list_checkpoints(self.folder)):
            try:
                progress, resumed_from = self._restore(path), path
                break
            except OtherProcessCount as exc:  # never deleted: a launch with its count resumes it
                raise InputError(f"{path}: {exc}") from exc
            except CheckpointError as exc:
                print(f"warning: skipping checkpoint {path}: {exc}", file=sys.stderr)
                refused.append(path)
        for path in refused:  # newer than the one resumed from, and unusable: out of the way
            shutil.rmtree(path)
        if self.world.size > 1:
            distributed.broadcast(resumed_from)
        return progress

    def newest(self) -> Path | None:
        """The newest complete checkpoint, once the save in flight is done, if any (for error messages)."""
        self.settle()
        found = list_checkpoints(self.folder)
        return found[-1] if found else None

    def _restore(self, path: Path) -> Progress:
        weights, state = self._load_checked(path)
        if state["train_config"] != self.train_config:
            raise CheckpointError("it was made with different train settings")
        made_by = state.get("world_size", 1)
        if made_by != self.world.size:  # the ranks' data shares would differ
            raise OtherProcessCount(
                f"it was made by {made_by} processes, this run has {self.world.size}: relaunch with "
                f"{made_by} (distributed.nproc_per_node x nnodes), or delete {self.folder} to train afresh"
            )
        try:  # checks the parameter groups before changing anything
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"its optimizer state does not fit ({exc})") from exc
        self.model.load_state_dict(weights)  # cannot fail: _load_checked built this model from them
        set_rng_state(state["rank_rngs"][self.world.rank] if "rank_rngs" in state else state["rng"])
        progress = Progress(**state["progress"])
        if self.main:
            print(f"resuming from {path} (step {progress.steps})", file=sys.stderr)
        return progress

    def _same_loss(self, a: float, b: float) -> bool:
        # Bit-identical on CPU; GPU kernels may pick other reduction orders between calls.
        return a == b if self.device.type == "cpu" else math.isclose(a, b, rel_tol=1e-5)

    def _load_checked(self, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A checkpoint's weights and state, once its weights give the loss recorded at save time.

        The check runs on a second model built around the loaded tensors, so the
        model being trained is untouched if the checkpoint turns out bad.
        """
        weights, state = load_training_checkpoint(path)
        if state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"unknown training state format {state.get('format')!r}")
        reloaded = meta_twin(self.model)
        try:
            reloaded.load_state_dict(weights, assign=True)
        except RuntimeError as exc:
            raise CheckpointError(f"its weights do not fit this model ({exc})") from exc
        with forked_rng(self.device):
            probe_loss = self.probe_loss(reloaded.to(self.device))
        if not self._same_loss(probe_loss, state["probe_loss"]):
            raise CheckpointError("its weights do not give the loss recorded at save time")
        return weights, state


def optimizer_state(optimizer: torch.optim.Optimizer, *, moments: bool) -> dict[str, Any]:
    """The optimizer's state dict; without `moments`, its parameter groups alone (it loads as a fresh one)."""
    state = optimizer.state_dict()
    return state if moments else {**state, "state": {}}


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers live on the meta device (no storage).

    The same modules as the model being trained, whatever wraps its layers (LoRA adapters
    included), to load a checkpoint's tensors into with `assign=True`.
    """
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)
