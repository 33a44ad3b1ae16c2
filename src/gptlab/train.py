"""The one training loop of the pipeline: pretraining, spam and instruction fine-tuning.

This is the book's `train_model_simple` (chapter 5), which chapters 6 and 7
reuse with another loss: AdamW, an evaluation on a few batches every
`eval_freq` steps, tokens (or examples) seen, and a callback after each epoch
(the book's sample or accuracy). On top of it:

- two ways to draw randomness (`train.rng`). `book` (the default) draws it
  exactly as the book's scripts do: a shuffled training loader and a
  validation loader without generators, so every pass over them (training
  epochs, evaluations, the chapter 6 accuracies) draws from the global RNG,
  which the stage seeds where the chapter does; same params, same numbers as
  the book's own code on the same machine. `per_epoch` draws the order of
  epoch e from its own generator seeded with `seed + e`, evaluates in data
  order, and seeds the global RNG (dropout) itself: the scheme torchrun uses;
- exact resume: every `checkpoint_every` steps and at each epoch end, or once
  `checkpoint_minutes` have passed since the last save, and after the last
  step, the training state is saved in the background (gptlab.train_state); a
  rerun continues from the newest valid checkpoint and ends with the same numbers;
- safety: a non-finite loss stops with an error, keeping the last good checkpoint;
- data parallelism under `torchrun` (see `gptlab.distributed`): rank r takes
  every world_size-th batch of the same epoch order, gradients are averaged by
  DistributedDataParallel, and only rank 0 logs, prints and saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from gptlab import distributed
from gptlab.config import TrainConfig
from gptlab.errors import InputError
from gptlab.losses import LossFn, average_loss
from gptlab.model import GPTModel
from gptlab.runtime import autocast, ordered_loader, resolve_device, to_device, use_precision
from gptlab.timing import LapClock
from gptlab.tracking import NULL_RUN, StageRun
from gptlab.train_state import Checkpointer, Progress, forked_rng, rng_state, seed_everything, set_rng_state

SeenFn = Callable[[Any], int]
EpochEndFn = Callable[[int, nn.Module], Mapping[str, float | str]]


def count_tokens(batch: Any) -> int:
    """Tokens in a batch's inputs: the book's `tokens_seen` (chapters 5 and 7)."""
    return batch[0].numel()


@dataclass
class TrainResult:
    """What a training run produced; the model itself is trained in place."""

    # One row per evaluation: step, <seen_name>, train_loss, val_loss, lr.
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
    loss_fn: LossFn,
    run_dir: Path,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    seen_name: str = "tokens_seen",
    count_seen: SeenFn = count_tokens,
    tracker: StageRun = NULL_RUN,
    on_epoch_end: EpochEndFn | None = None,
) -> TrainResult:
    """Train `model` in place (only parameters with requires_grad) and return its history.

    Resumes from the newest valid checkpoint in `run_dir`, if any. Every
    `eval_freq` steps the mean losses of `eval_iter` batches of the training and
    the validation data are recorded (read through `evaluation_loader`), with
    `count_seen` summed as `seen_name`. `on_epoch_end(epoch, model)` runs after
    each epoch (1-based; also after a partial last epoch cut short by max_steps)
    and what it returns is logged to the tracker: under `rng: book` it draws from
    the RNG like the book's end-of-epoch code, under `per_epoch` its draws are
    undone so it cannot change the training run.

    Under `torchrun` (WORLD_SIZE > 1) it trains data-parallel: each rank takes
    its share of every epoch's batches, evaluation losses are averaged and
    seen counts summed over ranks, and only rank 0 prints, saves checkpoints
    and calls `on_epoch_end`.
    """
    world = distributed.setup()
    main = world.rank == 0
    device = resolve_device(cfg.device)
    precision = use_precision(device, cfg.precision)
    if cfg.precision == "auto":
        tracker.set_tags({"gptlab.precision": precision})
        if main:
            print(f"train.precision: auto resolved to {precision} on {device.type}", file=sys.stderr)
    model.to(device)
    # Only the training step runs through DDP (it averages gradients); evaluation,
    # checkpoints and callbacks use the plain model, whose weights DDP keeps identical.
    ddp_model: nn.Module = model
    if world.size > 1:
        ddp_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    batches_per_epoch = len(train_data) // cfg.batch_size // world.size  # type: ignore[arg-type]
    if batches_per_epoch == 0:
        ranks = f" per process ({world.size} processes)" if world.size > 1 else ""
        raise InputError(
            f"the training data has {len(train_data)} examples, fewer than one batch{ranks} of "  # type: ignore[arg-type]
            f"train.batch_size={cfg.batch_size}: lower the batch size or supply more data"
        )
    total_steps = cfg.epochs * batches_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise InputError("the model has no parameters with requires_grad=True: nothing to train")
    optimizer = make_adamw(trainable, cfg)
    # Only the training step is compiled: evaluation (eval mode, other shapes) would recompile.
    step_loss = torch.compile(loss_fn) if cfg.compile else loss_fn

    def eval_loss(m: nn.Module, loader: Any, num_batches: int | None) -> float:
        was_training = m.training
        m.eval()
        with autocast(device, cfg.precision):
            loss = average_loss(m, loader, loss_fn, num_batches)
        m.train(was_training)
        return loss

    protocol = cfg.rng if world.size == 1 else "per_epoch"  # the book's draws assume one process
    if protocol != cfg.rng and main:
        print(
            f"train.rng: {cfg.rng} needs one process; {world.size} processes use per_epoch", file=sys.stderr
        )
    train_eval = evaluation_loader(train_data, cfg.batch_size, protocol, shuffled=True, collate_fn=collate_fn)
    val_eval = evaluation_loader(val_data, cfg.batch_size, protocol, shuffled=False, collate_fn=collate_fn)
    # A fixed batch whose loss proves a checkpoint holds exactly the weights in memory.
    probe_data = val_data if len(val_data) else train_data  # type: ignore[arg-type]
    probe = to_device(next(iter(ordered_loader(probe_data, cfg.batch_size, collate_fn))), device)
    checkpointer = Checkpointer(
        run_dir,
        model,
        optimizer,
        dataclasses.asdict(cfg),
        lambda m: eval_loss(m, [probe], None),
        keep=cfg.keep_checkpoints,
        world=world,
        device=device,
    )

    progress = checkpointer.resume()
    if progress is None:
        progress = Progress()
        if protocol == "per_epoch":  # under `book` the stage has seeded where the chapter does
            seed_everything(cfg.seed + world.rank)  # other dropout masks on each rank
    else:
        tracker.set_tags({"gptlab.resumed_from_step": progress.steps})
        tracker.log_history(progress.history)
        _log_epochs(tracker, progress.epochs)
    resumed_steps, start_seen = progress.steps, progress.seen
    bar = tqdm(
        total=total_steps,
        initial=progress.steps,
        unit="step",
        desc="train",
        file=sys.stderr,
        disable=not main,
    )
    started = last_save = time.perf_counter()
    clock = LapClock()
    model.train()
    with checkpointer.saving():  # a save in flight ends before the loop is left
        while progress.steps < total_steps:
            if protocol == "book":
                batches = _book_epoch(train_eval, progress)
            else:
                order = rank_order(
                    epoch_order(len(train_data), cfg.seed, progress.epoch), cfg.batch_size, world
                )  # type: ignore[arg-type]
                batches = iter(
                    DataLoader(
                        train_data,
                        batch_size=cfg.batch_size,
                        sampler=order[
                            progress.batch * cfg.batch_size :
                        ],  # skip what a resumed run already did
                        drop_last=True,
                        collate_fn=collate_fn,
                        generator=torch.Generator(),
                    )
                )
            for batch in batches:
                step = progress.steps  # the book's global_step of this update
                lr = learning_rate(step, cfg, total_steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.zero_grad(set_to_none=True)
                with autocast(device, cfg.precision):
                    loss = step_loss(ddp_model, to_device(batch, device))
                value = distributed.all_mean(loss.item())  # every rank stops together on a non-finite loss
                if not math.isfinite(value):
                    newest = checkpointer.newest()
                    kept = (
                        f"the last good checkpoint is {newest}" if newest else "no checkpoint was saved yet"
                    )
                    raise FloatingPointError(
                        f"training loss is {value} at step {step}: stopping ({kept}). "
                        "Lower train.lr, set train.grad_clip, or use precision fp32, then rerun."
                    )
                loss.backward()
                if cfg.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
                optimizer.step()
                progress.steps += 1
                progress.batch += 1
                progress.seen += distributed.all_sum(count_seen(batch))
                bar.update(1)
                clock.lap("step")

                if step % cfg.eval_freq == 0:
                    row = {
                        "step": step,
                        seen_name: progress.seen,
                        "train_loss": distributed.all_mean(eval_loss(model, train_eval, cfg.eval_iter)),
                        "val_loss": distributed.all_mean(eval_loss(model, val_eval, cfg.eval_iter)),
                        "lr": lr,
                    }
                    progress.history.append(row)
                    bar.set_postfix(train_loss=f"{row['train_loss']:.3f}", val_loss=f"{row['val_loss']:.3f}")
                    if main:
                        tqdm.write(
                            f"Ep {progress.epoch + 1} (Step {step:06d}): "
                            f"Train loss {row['train_loss']:.3f}, Val loss {row['val_loss']:.3f}",
                            file=sys.stderr,
                        )
                    tracker.log_metrics({k: v for k, v in row.items() if k != "step"}, step=step)
                    clock.lap("evaluation")

                epoch_done = progress.batch == batches_per_epoch
                finished = progress.steps == total_steps
                if epoch_done or finished:
                    extra: Mapping[str, float | str] = {}
                    if on_epoch_end is not None and main:
                        # The book's end-of-epoch evaluation draws from the RNG like the rest of its
                        # loop; under per_epoch the callback must not shift the training run.
                        with forked_rng(device) if protocol == "per_epoch" else contextlib.nullcontext():
                            extra = on_epoch_end(progress.epoch + 1, model)
                        model.train()
                    epoch_row = {"epoch": progress.epoch + 1, "step": step, **extra}
                    progress.epochs.append(epoch_row)
                    _log_epochs(tracker, [epoch_row])
                    clock.lap("epoch_end")
                if epoch_done:
                    progress.epoch += 1
                    progress.batch = 0
                if finished or checkpoint_due(
                    cfg, progress.steps, epoch_done, time.perf_counter() - last_save
                ):
                    checkpointer.save(progress)
                    last_save = time.perf_counter()
                    clock.lap("checkpoint")
                if finished:
                    break
    clock.lap("checkpoint")  # waiting for the last save
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
        phase_seconds=dict(clock.seconds),
    )


def checkpoint_due(cfg: TrainConfig, steps: int, epoch_done: bool, seconds_since_save: float) -> bool:
    """Whether to checkpoint after `steps` steps: by step count (and epoch ends), or by time.

    Under torchrun rank 0's clock decides for all, so every rank saves together.
    """
    by_steps = cfg.checkpoint_every is not None and (steps % cfg.checkpoint_every == 0 or epoch_done)
    by_time = cfg.checkpoint_minutes is not None and seconds_since_save >= 60 * cfg.checkpoint_minutes
    return bool(distributed.broadcast(by_steps or by_time))


def evaluation_loader(
    dataset: Dataset,
    batch_size: int,
    protocol: str,
    *,
    shuffled: bool,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """What evaluation (and the stages' per-epoch scores) read of a split under `train.rng`.

    book: the book's own loaders, with no generator, so each pass draws from the
    global RNG as the book's do: the training split shuffled with drop_last (the
    very loader it trains on), the others in order. per_epoch: in data order,
    on a private generator.
    """
    if protocol == "book":
        return DataLoader(
            dataset, batch_size=batch_size, shuffle=shuffled, drop_last=shuffled, collate_fn=collate_fn
        )
    return ordered_loader(dataset, batch_size, collate_fn)


def _book_epoch(train_loader: DataLoader, progress: Progress) -> Iterator[Any]:
    """This epoch's batches from the book's shuffled loader, replayed up to where a resumed run stopped.

    Iterating the loader draws its order from the global RNG, so the RNG state
    as the epoch began is kept; a run resumed mid-epoch restores it, draws the
    same order, skips the batches already trained on, and goes on from the
    RNG state saved at its last step.
    """
    if progress.batch == 0:
        progress.epoch_rng = rng_state()
        return iter(train_loader)
    assert progress.epoch_rng is not None, "a checkpoint taken mid-epoch keeps the epoch's RNG state"
    at_step = rng_state()
    set_rng_state(progress.epoch_rng)
    batches = iter(train_loader)
    for _ in range(progress.batch):
        next(batches)
    set_rng_state(at_step)
    return batches


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


def make_adamw(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over all trainable parameters, as the book: weight decay on every one."""
    if cfg.fused_adamw:
        try:
            return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        except RuntimeError:  # no fused kernel for this device: same update, slower
            pass
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _log_epochs(tracker: StageRun, rows: list[dict[str, Any]]) -> None:
    numeric = [{k: v for k, v in row.items() if isinstance(v, int | float)} for row in rows]
    if numeric:
        tracker.log_history(numeric, step_key="step")
