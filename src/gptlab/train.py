"""The one training loop of the pipeline: pretraining, spam and instruction fine-tuning.

This is the book's `train_model_simple` (chapter 5), which chapters 6 and 7
reuse with another loss: AdamW, an evaluation on a few batches every
`eval_freq` steps, tokens (or examples) seen, and a callback after each epoch
(the book's sample or accuracy). On top of it:

- determinism: the data order of epoch e is a permutation drawn from its own
  generator seeded with `seed + e`, loaders never touch the global RNG, and
  the global RNG (dropout) is seeded at the start and saved in checkpoints;
- exact resume: every `checkpoint_every` steps and at each epoch end, weights,
  optimizer, RNG states and the position in the epoch are saved; a rerun
  continues from the newest valid checkpoint and ends with the same numbers;
- safety: a non-finite loss stops with an error, keeping the last good
  checkpoint; each save is read back and checked before older ones go;
- data parallelism under `torchrun` (see `gptlab.distributed`): rank r takes
  every world_size-th batch of the same epoch order, gradients are averaged by
  DistributedDataParallel, and only rank 0 logs, prints and saves.
"""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from gptlab import checkpoint, distributed
from gptlab.config import TrainConfig
from gptlab.errors import InputError
from gptlab.losses import LossFn, average_loss, to_device
from gptlab.model import GPTModel
from gptlab.tracking import StageRun

STATE_FORMAT = 1

SeenFn = Callable[[Any], int]
EpochEndFn = Callable[[int, nn.Module], Mapping[str, float | str]]


def tokens(batch: Any) -> int:
    """Tokens in a batch's inputs: the book's `tokens_seen` (chapters 5 and 7)."""
    return batch[0].numel()


@dataclass
class TrainResult:
    """What a training run produced; the model itself is trained in place."""

    # One row per evaluation: step, seen, train_loss, val_loss, lr.
    history: list[dict[str, float]]
    # One row per epoch: epoch (1-based), step, and what on_epoch_end returned.
    epochs: list[dict[str, Any]]
    # The book's global_step: index of the last optimizer step (steps taken - 1).
    global_step: int
    seen: int
    # Optimizer steps that were restored from a checkpoint rather than run by this call.
    resumed_steps: int = 0
    # Wall time of this call's training loop and what it processed per second.
    wall_seconds: float = 0.0
    seen_per_second: float = 0.0

    @property
    def steps(self) -> int:
        return self.global_step + 1


@dataclass
class _Progress:
    """Where training stands; saved in every checkpoint."""

    steps: int = 0  # optimizer steps taken
    epoch: int = 0  # 0-based epoch in progress
    batch: int = 0  # batches of that epoch already trained on
    seen: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    """The device for `train.device`: auto picks cuda, then mps, then cpu."""
    if name == "auto":
        if torch.cuda.is_available():
            return distributed.local_device(torch.device("cuda"))
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("train.device: cuda was requested but no CUDA device is available; use auto or cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise InputError("train.device: mps was requested but MPS is not available; use auto or cpu")
    if name not in ("cpu", "cuda", "mps"):
        raise InputError(f"train.device: expected auto, cpu, cuda or mps, got {name!r}")
    return distributed.local_device(torch.device(name))


def learning_rate(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """LR of the optimizer step with 0-based index `step`.

    Linear warm-up to cfg.lr over warmup_steps, then constant (the book) or a
    cosine decay that reaches min_lr at the last step.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay_steps = max(total_steps - 1 - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def ordered_loader(
    dataset: Dataset, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None
) -> DataLoader:
    """Batches in dataset order, the last partial one kept: for evaluation.

    The loader has its own generator, so iterating it never draws from the
    global RNG (which would shift dropout masks and break exact resume).
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        drop_last=False,
        collate_fn=collate_fn,
        generator=torch.Generator(),
    )


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    """The shuffled example order of one epoch, a pure function of (seed, epoch)."""
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def rank_order(order: list[int], batch_size: int, world: distributed.World) -> list[int]:
    """This rank's share of an epoch order: every world.size-th batch, starting at batch world.rank.

    All ranks get the same number of whole batches (the remainder is dropped);
    with one process the order is returned as it is.
    """
    if world.size == 1:
        return order
    steps = len(order) // batch_size // world.size
    batches = range(world.rank, steps * world.size, world.size)
    return [i for b in batches for i in order[b * batch_size : (b + 1) * batch_size]]


def fit(
    model: GPTModel,
    train_data: Dataset,
    val_data: Dataset,
    *,
    cfg: TrainConfig,
    loss_fn: LossFn,
    checkpoint_dir: Path,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    count_seen: SeenFn = tokens,
    tracker: StageRun | None = None,
    on_epoch_end: EpochEndFn | None = None,
) -> TrainResult:
    """Train `model` in place (only parameters with requires_grad) and return its history.

    Resumes from the newest valid checkpoint in `checkpoint_dir`, if any. The
    evaluation losses average `eval_iter` batches: the first ones of the
    training data in order, and of the validation data. `on_epoch_end(epoch,
    model)` runs after each epoch (1-based; also after a partial last epoch
    cut short by max_steps) with its own RNG, so it can sample freely without
    changing the training run; numbers it returns are logged to the tracker.

    Under `torchrun` (WORLD_SIZE > 1) it trains data-parallel: each rank takes
    its share of every epoch's batches, evaluation losses are averaged and
    seen counts summed over ranks, and only rank 0 logs to `tracker`, prints,
    saves checkpoints and calls `on_epoch_end`.
    """
    return _Trainer(model, train_data, val_data, cfg, loss_fn, Path(checkpoint_dir), collate_fn).run(
        count_seen, tracker, on_epoch_end
    )


class _Trainer:
    def __init__(
        self,
        model: GPTModel,
        train_data: Dataset,
        val_data: Dataset,
        cfg: TrainConfig,
        loss_fn: LossFn,
        checkpoint_dir: Path,
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> None:
        self.cfg = cfg
        self.loss_fn = loss_fn
        self.checkpoint_dir = checkpoint_dir
        self.collate_fn = collate_fn
        self.train_data = train_data
        self.world = distributed.setup()
        self.main = self.world.rank == 0
        self.device = resolve_device(cfg.device)
        self.model = model.to(self.device)
        # Only the training step runs through DDP (it averages gradients); evaluation,
        # checkpoints and callbacks use the plain model, whose weights DDP keeps identical.
        self.ddp_model: nn.Module = model
        if self.world.size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp_model = DistributedDataParallel(model, device_ids=ids)
        self.batches_per_epoch = len(train_data) // cfg.batch_size // self.world.size  # type: ignore[arg-type]
        if self.batches_per_epoch == 0:
            ranks = f" per process ({self.world.size} processes)" if self.world.size > 1 else ""
            raise InputError(
                f"the training data has {len(train_data)} examples, fewer than one batch{ranks} of "  # type: ignore[arg-type]
                f"train.batch_size={cfg.batch_size}: lower the batch size or supply more data"
            )
        self.total_steps = cfg.epochs * self.batches_per_epoch
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise InputError("the model has no parameters with requires_grad=True: nothing to train")
        self.optimizer = _adamw(trainable, cfg)
        self.train_eval = ordered_loader(train_data, cfg.batch_size, collate_fn)
        self.val_eval = ordered_loader(val_data, cfg.batch_size, collate_fn)
        # A fixed batch whose loss proves a checkpoint holds exactly the weights in memory.
        probe_loader = self.val_eval if len(val_data) else self.train_eval  # type: ignore[arg-type]
        self.probe = to_device(next(iter(probe_loader)), self.device)

    # ------------------------------------------------------------------ #

    def run(
        self, count_seen: SeenFn, tracker: StageRun | None, on_epoch_end: EpochEndFn | None
    ) -> TrainResult:
        cfg = self.cfg
        seen_name = _seen_metric(count_seen)
        if not self.main:
            tracker, on_epoch_end = None, None
        progress = self._resume()
        if progress is None:
            progress = _Progress()
            _seed_everything(cfg.seed + self.world.rank)  # other dropout masks on each rank
        elif tracker is not None:
            tracker.set_tags({"gptlab.resumed_from_step": progress.steps})
            tracker.log_history([_rename_seen(row, seen_name) for row in progress.history])
            _log_epochs(tracker, progress.epochs)
        resumed_steps, start_seen = progress.steps, progress.seen
        bar = tqdm(
            total=self.total_steps,
            initial=progress.steps,
            unit="step",
            desc="train",
            file=sys.stderr,
            disable=not self.main,
        )
        started = time.perf_counter()
        self.model.train()
        while progress.steps < self.total_steps:
            order = epoch_order(len(self.train_data), cfg.seed, progress.epoch)  # type: ignore[arg-type]
            order = rank_order(order, cfg.batch_size, self.world)
            loader = DataLoader(
                self.train_data,
                batch_size=cfg.batch_size,
                sampler=order[progress.batch * cfg.batch_size :],  # skip what a resumed run already did
                drop_last=True,
                collate_fn=self.collate_fn,
                generator=torch.Generator(),
            )
            for batch in loader:
                step = progress.steps  # the book's global_step of this update
                lr = self._train_step(to_device(batch, self.device), step)
                progress.steps += 1
                progress.batch += 1
                progress.seen += distributed.all_sum(count_seen(batch))
                bar.update(1)
                if step % cfg.eval_freq == 0:
                    row = self._evaluate(step, progress, lr)
                    bar.set_postfix(train_loss=f"{row['train_loss']:.3f}", val_loss=f"{row['val_loss']:.3f}")
                    if self.main:
                        tqdm.write(
                            f"Ep {progress.epoch + 1} (Step {step:06d}): "
                            f"Train loss {row['train_loss']:.3f}, Val loss {row['val_loss']:.3f}",
                            file=sys.stderr,
                        )
                    if tracker is not None:
                        tracker.log_metrics(_rename_seen(row, seen_name, drop_step=True), step=step)
                epoch_done = progress.batch == self.batches_per_epoch
                finished = progress.steps == self.total_steps
                if epoch_done or finished:
                    self._end_epoch(step, progress, on_epoch_end, tracker)
                if epoch_done:
                    progress.epoch += 1
                    progress.batch = 0
                if progress.steps % cfg.checkpoint_every == 0 or epoch_done or finished:
                    self._save(progress)
                if finished:
                    break
        bar.close()
        wall = time.perf_counter() - started
        return TrainResult(
            history=progress.history,
            epochs=progress.epochs,
            global_step=progress.steps - 1,
            seen=progress.seen,
            resumed_steps=resumed_steps,
            wall_seconds=wall,
            seen_per_second=(progress.seen - start_seen) / wall if wall > 0 else 0.0,
        )

    # ------------------------------------------------------------------ #

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16")

    def _train_step(self, batch: Any, step: int) -> float:
        lr = learning_rate(step, self.cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            loss = self.loss_fn(self.ddp_model, batch)
        value = distributed.all_mean(loss.item())  # every rank stops together on a non-finite loss
        if not math.isfinite(value):
            newest = checkpoint.list_checkpoints(self.checkpoint_dir)
            kept = f"the last good checkpoint is {newest[-1]}" if newest else "no checkpoint was saved yet"
            raise FloatingPointError(
                f"training loss is {value} at step {step}: stopping ({kept}). "
                "Lower train.lr, set train.grad_clip, or use precision fp32, then rerun."
            )
        loss.backward()
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for g in self.optimizer.param_groups for p in g["params"]], self.cfg.grad_clip
            )
        self.optimizer.step()
        return lr

    def _eval_loss(self, model: nn.Module, loader: Any, num_batches: int | None) -> float:
        was_training = model.training
        model.eval()
        with self._autocast():
            loss = average_loss(model, loader, self.loss_fn, num_batches)
        model.train(was_training)
        return loss

    def _evaluate(self, step: int, progress: _Progress, lr: float) -> dict[str, float]:
        row = {
            "step": step,
            "seen": progress.seen,
            "train_loss": distributed.all_mean(
                self._eval_loss(self.model, self.train_eval, self.cfg.eval_iter)
            ),
            "val_loss": distributed.all_mean(self._eval_loss(self.model, self.val_eval, self.cfg.eval_iter)),
            "lr": lr,
        }
        progress.history.append(row)
        return row

    def _end_epoch(
        self, step: int, progress: _Progress, on_epoch_end: EpochEndFn | None, tracker: StageRun | None
    ) -> None:
        extra: Mapping[str, float | str] = {}
        if on_epoch_end is not None:
            with _forked_rng(self.device):
                extra = on_epoch_end(progress.epoch + 1, self.model)
            self.model.train()
        row = {"epoch": progress.epoch + 1, "step": step, **extra}
        progress.epochs.append(row)
        if tracker is not None:
            _log_epochs(tracker, [row])

    def _probe_loss(self, model: nn.Module) -> float:
        return self._eval_loss(model, [self.probe], None)

    # ------------------------------------------------------------------ #

    def _save(self, progress: _Progress) -> None:
        """Checkpoint, read it back, check it, and only then drop older ones.

        Under torchrun rank 0 writes it, with every rank's RNG state, while the others wait.
        """
        rank_rngs = distributed.gather(_rng_state()) if self.world.size > 1 else None
        with _forked_rng(self.device):  # nothing here may shift the training RNG
            probe_loss = self._probe_loss(self.model)
            if not math.isfinite(probe_loss):
                raise FloatingPointError(
                    f"after step {progress.steps - 1} the model's loss is {probe_loss}: the weights "
                    "diverged; not saving them. Lower train.lr or set train.grad_clip, then rerun."
                )
            if not self.main:
                distributed.barrier()
                return
            state = {
                "format": STATE_FORMAT,
                "train_config": dataclasses.asdict(self.cfg),
                "progress": dataclasses.asdict(progress),
                "optimizer": self.optimizer.state_dict(),
                "rng": _rng_state(),
                "probe_loss": probe_loss,
            }
            if rank_rngs is not None:
                state.update(world_size=self.world.size, rank_rngs=rank_rngs)
            path = checkpoint.save_training_checkpoint(self.checkpoint_dir, progress.steps, self.model, state)
            try:
                self._load_checked(path)
            except checkpoint.CheckpointError as exc:
                raise checkpoint.CheckpointError(
                    f"{path} does not read back as written ({exc}); is the disk full or failing?"
                ) from exc
        checkpoint.prune_checkpoints(self.checkpoint_dir, self.cfg.keep_checkpoints)
        distributed.barrier()

    def _same_loss(self, a: float, b: float) -> bool:
        # Bit-identical on CPU; GPU kernels may pick other reduction orders between calls.
        return a == b if self.device.type == "cpu" else math.isclose(a, b, rel_tol=1e-5)

    def _resume(self) -> _Progress | None:
        """Restore the newest checkpoint that loads and checks out; None to start afresh.

        Under torchrun rank 0 picks (and tidies) and the other ranks restore its pick.
        """
        if not self.main:
            path = distributed.broadcast(None)
            return None if path is None else self._restore(path)
        checkpoint.remove_partial_checkpoints(self.checkpoint_dir)
        refused: list[Path] = []
        progress, resumed_from = None, None
        for path in reversed(checkpoint.list_checkpoints(self.checkpoint_dir)):
            try:
                progress, resumed_from = self._restore(path), path
                break
            except checkpoint.CheckpointError as exc:
                print(f"warning: skipping checkpoint {path}: {exc}", file=sys.stderr)
                refused.append(path)
        for path in refused:  # newer than the one resumed from, and unusable: out of the way
            shutil.rmtree(path)
        if self.world.size > 1:
            distributed.broadcast(resumed_from)
        return progress

    def _restore(self, path: Path) -> _Progress:
        weights, state = self._load_checked(path)
        if state["train_config"] != dataclasses.asdict(self.cfg):
            raise checkpoint.CheckpointError("it was made with different train settings")
        if state.get("world_size", 1) != self.world.size:  # the ranks' data shares would differ
            raise checkpoint.CheckpointError(
                f"it was made by {state.get('world_size', 1)} processes, this run has {self.world.size}"
            )
        try:  # checks the parameter groups before changing anything
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise checkpoint.CheckpointError(f"its optimizer state does not fit ({exc})") from exc
        self.model.load_state_dict(weights)  # cannot fail: _load_checked built this model from them
        _set_rng_state(state["rank_rngs"][self.world.rank] if "rank_rngs" in state else state["rng"])
        progress = _Progress(**state["progress"])
        if self.main:
            print(f"resuming from {path} (step {progress.steps} of {self.total_steps})", file=sys.stderr)
        return progress

    def _load_checked(self, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A checkpoint's weights and state, once its weights give the loss recorded at save time.

        The check runs on a second model built around the loaded tensors, so the
        model being trained is untouched if the checkpoint turns out bad.
        """
        weights, state = checkpoint.load_training_checkpoint(path)
        if state.get("format") != STATE_FORMAT:
            raise checkpoint.CheckpointError(f"unknown training state format {state.get('format')!r}")
        with torch.device("meta"):
            reloaded = GPTModel(self.model.cfg)
        try:
            reloaded.load_state_dict(weights, assign=True)
        except RuntimeError as exc:
            raise checkpoint.CheckpointError(f"its weights do not fit this model ({exc})") from exc
        with _forked_rng(self.device):
            probe_loss = self._probe_loss(reloaded.to(self.device))
        if not self._same_loss(probe_loss, state["probe_loss"]):
            raise checkpoint.CheckpointError("its weights do not give the loss recorded at save time")
        return weights, state


# ---------------------------------------------------------------------- #


def _adamw(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over all trainable parameters, as the book: weight decay on every one."""
    if cfg.fused_adamw:
        try:
            return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        except RuntimeError:  # no fused kernel for this device: same update, slower
            pass
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds every CUDA device
    np.random.seed(seed)
    random.seed(seed)


def _rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values, so torch.load(weights_only=True) reads it."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    random.setstate(state["python"])


def _forked_rng(device: torch.device) -> Any:
    """A block whose use of torch's RNG (CPU and the training GPU) is undone when it ends."""
    return torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])


def _seen_metric(count_seen: SeenFn) -> str:
    """`tokens` -> tokens_seen, `examples` -> examples_seen: the book's names."""
    name = getattr(count_seen, "__name__", "")
    return f"{name}_seen" if name.isidentifier() else "seen"


def _rename_seen(row: Mapping[str, float], seen_name: str, drop_step: bool = False) -> dict[str, float]:
    renamed = {(seen_name if k == "seen" else k): v for k, v in row.items()}
    if drop_step:
        renamed.pop("step")
    return renamed


def _log_epochs(tracker: StageRun, rows: list[dict[str, Any]]) -> None:
    numeric = [{k: v for k, v in row.items() if isinstance(v, int | float)} for row in rows]
    if numeric:
        tracker.log_history(numeric, step_key="step")
