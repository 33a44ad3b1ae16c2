"""The one training loop of the pipeline: pretraining, spam and instruction fine-tuning.

`fit` is the book's `train_model_simple` (chapter 5), which chapters 6 and 7
reuse with another loss: AdamW, an evaluation on a few batches every
`eval_freq` steps, tokens (or examples) seen, and a callback after each epoch
(the book's sample or accuracy). Around it, as calls:

- the data order and randomness of `train.rng` (gptlab.training.data_order);
- exact resume (gptlab.training.resume): the state is saved on the `checkpoints`
  cadence and after the last step; a rerun continues from the newest valid
  save and ends with the same numbers;
- safety: a non-finite loss stops with an error, keeping the last good checkpoint;
- data parallelism under `torchrun` (gptlab.training.distributed): rank r takes every
  world_size-th batch of the same epoch order, DistributedDataParallel
  averages gradients, and only rank 0 logs, prints and saves;
- a global batch in tokens (`train.global_batch_tokens`): each optimizer step
  accumulates the gradients of several micro-batches, so N processes take the
  same steps as one process accumulating N times as many; and a token budget
  (`train.max_tokens`) instead of epochs, for corpora read once or less.

The loop logs through a `Tracker` it is handed; it knows nothing of MLflow.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from gptlab.errors import InputError
from gptlab.model.checkpoint import Progress
from gptlab.model.gpt import GPTModel
from gptlab.training import distributed
from gptlab.training.compilation import CompiledOrEager
from gptlab.training.config import CheckpointConfig, TrainConfig
from gptlab.training.data_order import Collate, DataOrder
from gptlab.training.losses import LossFn, average_terms, loss_terms
from gptlab.training.resume import Checkpointer
from gptlab.training.runtime import autocast, ordered_loader, resolve_device, to_device, use_precision
from gptlab.training.timing import LapClock

SeenFn = Callable[[Any], int]
EpochEndFn = Callable[[int, nn.Module], Mapping[str, float | str]]


def require_one_batch(
    examples: int, batch_size: int, key: str = "train.batch_size", processes: int = 1
) -> None:
    """Refuse training data smaller than one batch per process; stages call it before building a model."""
    if examples // batch_size // processes == 0:
        ranks = f" per process ({processes} processes)" if processes > 1 else ""
        raise InputError(
            f"the training data has {examples} examples, fewer than one batch{ranks} of "
            f"{key}={batch_size}: lower the batch size or supply more data"
        )


class Tracker(Protocol):
    """What the loop logs through: a stage's MLflow run, or nothing."""

    def log_history(self, rows: list[Mapping[str, float]], step_key: str = "step") -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...


class Untracked:
    """The tracker of a loop that logs nowhere (tests, benchmarks)."""

    def log_history(self, rows: list[Mapping[str, float]], step_key: str = "step") -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass


def count_tokens(batch: Any) -> int:
    """Tokens in a batch's inputs: the book's `tokens_seen` (chapters 5 and 7)."""
    return batch[0].numel()


@dataclass
class TrainResult:
    """What a training run produced; the model itself is trained in place."""

    # One row per evaluation: step, <seen_name>, train_loss, val_loss (and {split}_{term} for a loss
    # function's other terms, such as DPO's rewards), lr.
    history: list[dict[str, float]]
    # One row per epoch: epoch (1-based), step, and what on_epoch_end returned.
    epochs: list[dict[str, Any]]
    # The book's global_step: index of the last optimizer step (steps taken - 1).
    global_step: int
    seen: int
    # What `seen` counts, as fit was told: tokens_seen (the book's chapters 5 and 7) or examples_seen.
    seen_name: str = "tokens_seen"
    # Optimizer steps that were restored from a checkpoint rather than run by this call.
    resumed_steps: int = 0
    # Wall time of this call's training loop and what it processed per second.
    wall_seconds: float = 0.0
    seen_per_second: float = 0.0
    # Where the loop's wall time went: step (with data loading), evaluation, epoch_end, checkpoint.
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def steps(self) -> int:
        return self.global_step + 1


def fit(
    model: GPTModel,
    train_data: Dataset,
    val_data: Dataset,
    *,
    cfg: TrainConfig,
    checkpoints: CheckpointConfig,
    loss_fn: LossFn,
    run_dir: Path,
    collate_fn: Collate = None,
    seen_name: str = "tokens_seen",
    count_seen: SeenFn = count_tokens,
    tracker: Tracker | None = None,
    on_epoch_end: EpochEndFn | None = None,
    finish_saving: ExitStack | None = None,
) -> TrainResult:
    """Train `model` in place (only parameters with requires_grad) and return its history.

    Resumes from the newest valid checkpoint in `run_dir`, if any. Every `eval_freq` steps the
    mean losses of `eval_iter` batches of each split are recorded with `count_seen` summed as
    `seen_name`; `on_epoch_end(epoch, model)` runs after each epoch (1-based; also after a last
    one cut short by max_steps) and what it returns is logged. Under torchrun only rank 0
    prints, saves and calls `on_epoch_end`. With `finish_saving`, the save after the last step
    goes on while the caller scores and publishes; closing that stack waits for it.
    """
    tracker = tracker or Untracked()
    example_seen = count_seen(next(iter(ordered_loader(train_data, 1, collate_fn))))
    run = setup_training(model, train_data, cfg, loss_fn, tracker, example_seen)
    order = DataOrder(train_data, val_data, cfg, run.world, collate_fn)
    if order.protocol != cfg.rng and run.main:
        print(f"train.rng: {cfg.rng} needs one process; {run.world.size} use per_epoch", file=sys.stderr)
    probe_data = val_data if len(val_data) else train_data  # type: ignore[arg-type]
    checkpointer = _checkpointer(model, run, probe_data, collate_fn, run_dir, checkpoints.keep)
    progress = _resume(checkpointer, order, tracker, cfg)
    resumed_steps, start_seen = progress.steps, progress.seen
    bar = tqdm(
        total=run.total_steps,
        initial=progress.steps,
        unit="step",
        desc="train",
        file=sys.stderr,
        disable=not run.main,
    )
    started = last_save = time.perf_counter()
    clock = LapClock()
    model.train()
    with checkpointer.saving(finish_saving):  # the last save ends on leaving the loop or with finish_saving
        while progress.steps < run.total_steps:
            for batches in micro_batches(order.epoch_batches(progress), run.accumulation):
                step = progress.steps  # the book's global_step of this update
                lr = learning_rate(step, cfg, run.total_steps)
                run.train_step(batches, lr, step, checkpointer)
                progress.steps += 1
                progress.batch += len(batches)
                progress.seen += distributed.all_sum(sum(count_seen(batch) for batch in batches))
                bar.update(1)
                clock.lap("step")
                if step % cfg.eval_freq == 0:
                    losses = _eval_losses(model, run, order)
                    progress.history.append({"step": step, seen_name: progress.seen, **losses, "lr": lr})
                    _log_evaluation(progress, bar, tracker, run.main, cfg)
                    clock.lap("evaluation")
                epoch_done = progress.batch == run.batches_per_epoch
                finished = progress.steps == run.total_steps
                if epoch_done or finished:
                    _end_epoch(model, progress, step, order, run, on_epoch_end, tracker)
                    clock.lap("epoch_end")
                if epoch_done:
                    progress.epoch, progress.batch = progress.epoch + 1, 0
                if finished or checkpoint_due(
                    checkpoints, progress.steps, epoch_done, time.perf_counter() - last_save
                ):
                    checkpointer.save(progress, finished=finished)
                    last_save = time.perf_counter()
                    clock.lap("checkpoint")
                if finished:
                    break
    clock.lap("checkpoint")  # waiting for the last save, unless the caller will
    bar.close()
    return _result(progress, seen_name, resumed_steps, start_seen, time.perf_counter() - started, clock)


@dataclass
class TrainingSetup:
    """What `fit` trains with, set up once: this process's place, the device, the optimizer, the step."""

    cfg: TrainConfig
    world: distributed.World
    device: torch.device
    ddp_model: nn.Module  # the model, wrapped by DDP under torchrun (only the step runs through it)
    trainable: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    step_loss: LossFn  # loss_fn, compiled with train.compile (eager if compiling fails)
    accumulation: int  # micro-batches per optimizer step on each process (1: the book's step)
    batches_per_epoch: int  # micro-batches per epoch on each process, a multiple of accumulation
    total_steps: int

    @property
    def main(self) -> bool:
        return self.world.rank == 0

    def train_step(self, batches: list[Any], lr: float, step: int, checkpointer: Checkpointer) -> None:
        """One optimizer step at `lr` on the mean loss of `batches` (one: the book's step).

        Each micro-batch's gradient is accumulated as it goes (its activations freed);
        DDP averages over processes once, at the last one. A non-finite loss stops every
        rank, naming the last good save.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            syncing = last or not isinstance(self.ddp_model, DistributedDataParallel)
            with nullcontext() if syncing else self.ddp_model.no_sync():
                with autocast(self.device, self.cfg.precision):
                    loss = loss_terms(self.step_loss(self.ddp_model, to_device(batch, self.device)))[
                        "loss"
                    ] / len(batches)
                loss.backward()
            total += loss.detach()
        value = distributed.all_mean(float(total))  # every rank stops together on a non-finite loss
        if not math.isfinite(value):
            newest = checkpointer.newest()
            kept = f"the last good checkpoint is {newest}" if newest else "no checkpoint was saved yet"
            raise FloatingPointError(
                f"training loss is {value} at step {step}: stopping ({kept}). "
                "Lower train.lr, set train.grad_clip, or use precision fp32, then rerun."
            )
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.grad_clip)
        self.optimizer.step()

    def eval_losses(
        self, model: nn.Module, loaders: dict[str, Any], num_batches: int | None
    ) -> dict[str, dict[str, float]]:
        """Mean loss (and the loss function's other terms) of `num_batches` batches of each loader.

        In eval mode (no dropout), at the training precision; one autocast block for all
        of them, so bf16 casts the weights once.
        """
        was_training = model.training
        model.eval()
        with autocast(self.device, self.cfg.precision):
            losses = {
                name: average_terms(model, loader, self.loss_fn, num_batches)
                for name, loader in loaders.items()
            }
        model.train(was_training)
        return losses


def setup_training(
    model: GPTModel,
    train_data: Dataset,
    cfg: TrainConfig,
    loss_fn: LossFn,
    tracker: Tracker,
    example_seen: int = 1,
) -> TrainingSetup:
    """Join torchrun's process group, place the model, wrap it for DDP, build AdamW, compile the step.

    `example_seen` is what one example counts as seen (a window's tokens): it turns the global
    batch and the token budget into micro-batches and steps.
    """
    world = distributed.setup()
    device = resolve_device(cfg.device)
    precision = use_precision(device, cfg.precision)
    if cfg.precision == "auto":
        tracker.set_tags({"gptlab.precision": precision})
        if world.rank == 0:
            print(f"train.precision: auto resolved to {precision} on {device.type}", file=sys.stderr)
    model.to(device)
    # Evaluation, checkpoints and callbacks use the plain model, whose weights DDP keeps identical.
    ddp_model: nn.Module = model
    if world.size > 1:
        ddp_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    examples = len(train_data)  # type: ignore[arg-type]
    require_one_batch(examples, cfg.batch_size, processes=world.size)
    accumulation = accumulation_steps(cfg, world.size, example_seen)
    batches = examples // cfg.batch_size // world.size
    if batches < accumulation:
        raise InputError(
            f"the training data has {batches} batches per process, fewer than the {accumulation} "
            "micro-batches of one train.global_batch_tokens step: lower it or supply more data"
        )
    batches_per_epoch = batches - batches % accumulation
    step_seen = example_seen * cfg.batch_size * accumulation * world.size
    total_steps = cfg.epochs * batches_per_epoch // accumulation
    if cfg.max_tokens is not None:
        total_steps = math.ceil(cfg.max_tokens / step_seen)
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise InputError("the model has no parameters with requires_grad=True: nothing to train")
    return TrainingSetup(
        cfg=cfg,
        world=world,
        device=device,
        ddp_model=ddp_model,
        trainable=trainable,
        optimizer=make_adamw(trainable, cfg),
        loss_fn=loss_fn,
        # Only the training step is compiled: evaluation (eval mode, other shapes) would recompile.
        step_loss=CompiledOrEager(loss_fn) if cfg.compile else loss_fn,
        accumulation=accumulation,
        batches_per_epoch=batches_per_epoch,
        total_steps=total_steps,
    )


def accumulation_steps(cfg: TrainConfig, processes: int, example_seen: int) -> int:
    """Micro-batches each process accumulates per optimizer step to reach train.global_batch_tokens."""
    if cfg.global_batch_tokens is None:
        return 1
    micro = cfg.batch_size * example_seen * processes
    if cfg.global_batch_tokens % micro:
        raise InputError(
            f"train.global_batch_tokens={cfg.global_batch_tokens} is no multiple of one micro-batch over "
            f"all processes ({cfg.batch_size} x {example_seen} tokens x {processes}): pick a multiple of {micro}"
        )
    return cfg.global_batch_tokens // micro


def micro_batches(batches: Iterator[Any], accumulation: int) -> Iterator[list[Any]]:
    """The epoch's batches in groups of `accumulation`, one group an optimizer step (a short last one dropped)."""
    while group := list(itertools.islice(batches, accumulation)):
        if len(group) == accumulation:
            yield group


def _checkpointer(
    model: GPTModel, run: TrainingSetup, probe_data: Dataset, collate_fn: Collate, run_dir: Path, keep: int
) -> Checkpointer:
    """The run's checkpointer; a fixed batch's loss proves a save holds exactly the weights in memory."""
    probe = to_device(next(iter(ordered_loader(probe_data, run.cfg.batch_size, collate_fn))), run.device)
    return Checkpointer(
        run_dir,
        model,
        run.optimizer,
        dataclasses.asdict(run.cfg),
        lambda m: run.eval_losses(m, {"probe": [probe]}, None)["probe"]["loss"],
        keep=keep,
        world=run.world,
        device=run.device,
    )


def _resume(checkpointer: Checkpointer, order: DataOrder, tracker: Tracker, cfg: TrainConfig) -> Progress:
    """Where training starts: the newest good checkpoint (its history logged again), or afresh."""
    progress = checkpointer.resume()
    if progress is None:
        order.start_afresh()
        return Progress()
    tracker.set_tags({"gptlab.resumed_from_step": progress.steps})
    tracker.log_history(_logged(progress.history, cfg))
    _log_epochs(tracker, progress.epochs)
    return progress


def _eval_losses(model: nn.Module, run: TrainingSetup, order: DataOrder) -> dict[str, float]:
    """The book's evaluation: mean losses of `eval_iter` batches of each split (averaged over ranks).

    `{split}_loss`, and `{split}_{term}` for the loss function's other terms (DPO's rewards).
    """
    terms = run.eval_losses(model, {"train": order.train_eval, "val": order.val_eval}, order.eval_batches)
    return {
        f"{split}_{term}": distributed.all_mean(value)
        for split, values in terms.items()
        for term, value in values.items()
    }


def _logged(rows: list[dict[str, float]], cfg: TrainConfig) -> list[dict[str, float]]:
    """The evaluation rows as the tracker gets them: the lr only where warm-up or a schedule varies it.

    A constant lr is a param of the run (train.lr); drawn as a curve it would be a flat line
    on an axis the UI stretches around it.
    """
    if cfg.warmup_steps or cfg.lr_schedule != "constant":
        return rows
    return [{key: value for key, value in row.items() if key != "lr"} for row in rows]


def _log_evaluation(progress: Progress, bar: tqdm, tracker: Tracker, main: bool, cfg: TrainConfig) -> None:
    """Show the newest evaluation as the book prints it, and log it."""
    row = progress.history[-1]
    bar.set_postfix(train_loss=f"{row['train_loss']:.3f}", val_loss=f"{row['val_loss']:.3f}")
    if main:
        tqdm.write(
            f"Ep {progress.epoch + 1} (Step {int(row['step']):06d}): "
            f"Train loss {row['train_loss']:.3f}, Val loss {row['val_loss']:.3f}",
            file=sys.stderr,
        )
    tracker.log_history(_logged([row], cfg))


def _end_epoch(
    model: nn.Module,
    progress: Progress,
    step: int,
    order: DataOrder,
    run: TrainingSetup,
    on_epoch_end: EpochEndFn | None,
    tracker: Tracker,
) -> None:
    """The epoch's row: the callback's figures (the book's sample or accuracies), on rank 0."""
    extra: Mapping[str, float | str] = {}
    if on_epoch_end is not None and run.main:
        with order.callback_rng(run.device):
            extra = on_epoch_end(progress.epoch + 1, model)
        model.train()
    row = {"epoch": progress.epoch + 1, "step": step, **extra}
    progress.epochs.append(row)
    _log_epochs(tracker, [row])


def _result(
    progress: Progress, seen_name: str, resumed_steps: int, start_seen: int, wall: float, clock: LapClock
) -> TrainResult:
    return TrainResult(
        history=progress.history,
        epochs=progress.epochs,
        global_step=progress.steps - 1,
        seen=progress.seen,
        seen_name=seen_name,
        resumed_steps=resumed_steps,
        wall_seconds=wall,
        seen_per_second=(progress.seen - start_seen) / wall if wall > 0 else 0.0,
        phase_seconds=dict(clock.seconds),
    )


def checkpoint_due(
    checkpoints: CheckpointConfig, steps: int, epoch_done: bool, seconds_since_save: float
) -> bool:
    """Whether to checkpoint after `steps` steps: by step count (and epoch ends), or by time.

    Under torchrun rank 0's clock decides for all, so every rank saves together.
    """
    every_steps, every_minutes = checkpoints.every_steps, checkpoints.every_minutes
    by_steps = every_steps is not None and (steps % every_steps == 0 or epoch_done)
    by_time = every_minutes is not None and seconds_since_save >= 60 * every_minutes
    return bool(distributed.broadcast(by_steps or by_time))


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


def make_adamw(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over all trainable parameters, as the book: weight decay on every one."""
    if cfg.fused_adamw:
        try:
            return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        except RuntimeError:  # no fused kernel for this device: same update, slower
            pass
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _log_epochs(tracker: Tracker, rows: list[dict[str, Any]]) -> None:
    # The epoch counter is no curve: the epoch rows' figures (accuracies ...) are.
    numeric = [{k: v for k, v in row.items() if isinstance(v, int | float) and k != "epoch"} for row in rows]
    if numeric:
        tracker.log_history(numeric, step_key="step")
