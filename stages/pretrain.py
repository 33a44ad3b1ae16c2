"""Stage `pretrain`: GPT-2 trained from random weights on The Verdict (chapter 5).

Reads the tokenize stage's data/processed/verdict/{train,val}.npy and writes
the model to models/pretrain/ (its config, final metrics and MLflow run id travel
with it), reports/pretrain/metrics.json (DVC metrics: the losses and perplexities),
reports/pretrain/counts.json (steps, epochs, tokens seen), reports/pretrain/losses.csv
(a DVC plot) and reports/pretrain/loss.png (the book's figure). A greedy sample is
printed after each epoch. Interrupted runs resume from .gptlab/runs/pretrain/.
Under `torchrun --nproc_per_node=N` every process trains; only rank 0 logs and writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.data import Dataset

from gptlab.checkpoint import save_model
from gptlab.chunked_loss import language_model_loss
from gptlab.config import Params, TrainConfig
from gptlab.datasets.verdict import SUBDIR, GPTDatasetV1, load_split, split_path
from gptlab.distributed import is_main
from gptlab.files import write_csv, write_figure, write_json
from gptlab.generate import generate_text
from gptlab.losses import dataset_loss, perplexity
from gptlab.model import GPTModel
from gptlab.paths import PRETRAIN_MODEL, REPORTS
from gptlab.plots import plot_losses
from gptlab.registry import log_model
from gptlab.runtime import resolve_device
from gptlab.stage import stage_main
from gptlab.timing import LapClock
from gptlab.tokenizer import gpt2_tokenizer
from gptlab.tracking import stage_run
from gptlab.train import fit
from gptlab.train_state import resume_folder
from gptlab.typed_config import flatten

STAGE = "pretrain"
REPORT_DIR = REPORTS / "pretrain"
SPLITS = ("train", "val")
LOSS_COLUMNS = ["step", "tokens_seen", "train_loss", "val_loss"]


def run(params: Params) -> None:
    clock = LapClock()
    cfg = params.pretrain
    processed_dir = Path(params.data.processed_dir)
    raw_dir = Path(params.data.raw_dir)
    model_cfg = cfg.model.resolve()
    tokens = {split: load_split(processed_dir, split) for split in SPLITS}
    data = {split: GPTDatasetV1(tokens[split], cfg.data.max_length, cfg.data.stride) for split in SPLITS}
    tokenizer = gpt2_tokenizer(
        raw_dir / params.data.sources.gpt2_vocab_bpe.path,
        raw_dir / params.data.sources.gpt2_encoder_json.path,
    )
    fingerprint = {"pretrain": flatten(cfg), "model": model_cfg.to_dict()}
    inputs = [split_path(processed_dir, split) for split in SPLITS]
    logged = {"data.processed_dir": params.data.processed_dir, **flatten(cfg, "pretrain")}
    with (
        stage_run(
            STAGE, params.tracking.experiment, logged, system_metrics=params.tracking.system_metrics
        ) as tracker,
        resume_folder(STAGE, fingerprint, inputs) as run_dir,
    ):
        tracker.log_input(
            "verdict",
            processed_dir / SUBDIR,
            context="training",
            profile={
                **{f"{split}_tokens": len(ids) for split, ids in tokens.items()},
                **{f"{split}_windows": len(dataset) for split, dataset in data.items()},
            },
        )
        # The book's order: seed, then build the model, so its initial weights are the book's.
        torch.manual_seed(cfg.train.seed)
        model = GPTModel(model_cfg).to(resolve_device(cfg.train.device))
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters; {len(data['train'])} windows")
        clock.lap("setup")
        initial = split_losses(model, data, cfg.train)
        clock.lap("initial_losses")
        print(f"before training: train loss {initial['train_loss']:.3f}, val loss {initial['val_loss']:.3f}")
        tracker.log_metrics({f"initial_{name}": value for name, value in initial.items()}, step=0)

        def on_epoch_end(epoch: int, trained: nn.Module) -> dict[str, str]:
            text = generate_text(trained, tokenizer, cfg.sample)
            print(f"epoch {epoch} sample: {text!r}")
            return {"sample": text}

        result = fit(
            model,
            data["train"],
            data["val"],
            cfg=cfg.train,
            loss_fn=language_model_loss(cfg.train.loss_kernel),
            run_dir=run_dir,
            tracker=tracker,
            on_epoch_end=on_epoch_end,
        )
        clock.lap("training")
        if not is_main():  # another torchrun process: rank 0 writes the outputs
            return
        final = split_losses(model, data, cfg.train)
        clock.lap("final_losses")
        metrics: dict[str, Any] = {
            **{f"initial_{name}": value for name, value in initial.items()},
            **{f"final_{name}": value for name, value in final.items()},
            **{f"final_{split}_perplexity": perplexity(final[f"{split}_loss"]) for split in SPLITS},
            # The last in-training evaluation (eval_iter batches): what the book reports.
            "last_eval_train_loss": result.history[-1]["train_loss"],
            "last_eval_val_loss": result.history[-1]["val_loss"],
        }
        counts = {"steps": result.steps, "epochs": len(result.epochs), "tokens_seen": result.seen}
        save_model(
            model,
            PRETRAIN_MODEL,
            {
                "stage": STAGE,
                "params": flatten(cfg, "pretrain"),
                "metrics": metrics,
                "counts": counts,
            },
        )
        tracker.record_checkpoint(PRETRAIN_MODEL)
        figure = plot_losses(result.history, len(data["train"]) // cfg.train.batch_size)
        write_json(REPORT_DIR / "metrics.json", metrics)
        write_json(REPORT_DIR / "counts.json", counts)
        write_csv(REPORT_DIR / "losses.csv", pd.DataFrame(result.history, columns=LOSS_COLUMNS))
        write_figure(REPORT_DIR / "loss.png", figure)

        samples = "\n\n".join(
            f"epoch {row['epoch']} (step {row['step']}):\n{row['sample']}" for row in result.epochs
        )
        # The initial losses went out at step 0, before training; the rest at the last step.
        final_metrics = {k: v for k, v in metrics.items() if not k.startswith("initial_")}
        tracker.log_metrics(final_metrics, step=result.global_step)
        tracker.log_metrics(
            {"wall_seconds": result.wall_seconds, "tokens_per_second": result.seen_per_second},
            step=result.global_step,
        )
        tracker.set_tags({f"gptlab.{name}": value for name, value in counts.items()})
        tracker.log_figure(figure, "pretrain/loss.png")
        tracker.log_text(samples, "pretrain/samples.txt")
        tracker.log_reports(REPORT_DIR, "pretrain/reports", skip=("loss.png",))
        if params.tracking.log_models:
            log_model(
                tracker,
                "pretrain",
                PRETRAIN_MODEL,
                experiment=params.tracking.experiment,
                bpe_files=(
                    raw_dir / params.data.sources.gpt2_vocab_bpe.path,
                    raw_dir / params.data.sources.gpt2_encoder_json.path,
                ),
                defaults={
                    "max_new_tokens": cfg.sample.max_new_tokens,
                    "temperature": cfg.sample.temperature,
                    "top_k": cfg.sample.top_k,
                    "seed": cfg.sample.seed,
                },
            )
        clock.lap("outputs_and_logging")
        timings = {**clock.metrics(), **LapClock.as_metrics(result.phase_seconds, "seconds_training_")}
        tracker.log_metrics(timings, step=result.global_step)
        print(f"seconds by phase: {json.dumps(timings)}", file=sys.stderr)
    print(json.dumps(metrics | counts, indent=2, sort_keys=True))


def split_losses(model: nn.Module, data: dict[str, Dataset], cfg: TrainConfig) -> dict[str, float]:
    """Mean loss over every window of each split, in eval mode (no dropout)."""
    return {
        f"{split}_loss": dataset_loss(
            model, dataset, cfg.eval_batch_size or cfg.batch_size, precision=cfg.precision
        )
        for split, dataset in data.items()
    }


if __name__ == "__main__":
    stage_main(run, __doc__)
