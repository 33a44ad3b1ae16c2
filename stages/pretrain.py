"""Stage `pretrain`: GPT-2 trained from random weights on The Verdict (chapter 5) or a corpus.

With pretrain.init other than random it continues pretraining instead: from OpenAI's GPT-2
(a name), a model folder or a models:/NAME/VERSION URI (gptlab.pipeline.init_model).

Reads the tokenize stage's data/processed/verdict/{train,val}.npy (corpus.name verdict)
or the corpus's token shards, data/processed/gutenberg/{train,val}-*.bin, and writes
the model to models/pretrain/ (its config and final metrics travel with it),
reports/pretrain/metrics.json (DVC metrics: the losses and perplexities),
reports/pretrain/counts.json (steps, epochs, tokens seen), reports/pretrain/losses.csv
(a DVC plot; a corpus's also has the validation perplexity) and reports/pretrain/loss.png
(the book's figure). A greedy sample is printed after each epoch (and, with a token budget,
at its end). Interrupted runs resume from .gptlab/runs/pretrain/.
Under `torchrun --nproc_per_node=N` every process trains; only rank 0 logs and writes.
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import json
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import Dataset

from gptlab.model.build import build_gpt
from gptlab.model.generate import generate_text
from gptlab.model.gpt import GPTModel
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import PRETRAIN_MODEL, REPORTS
from gptlab.pipeline.init_model import initial_model
from gptlab.pipeline.params import Params
from gptlab.pipeline.pretrain_data import pretrain_windows, with_perplexity
from gptlab.pipeline.training_stage import DatasetRead, Reports, TrainingRun, loss_table, training_run
from gptlab.schema import flatten
from gptlab.training.chunked_loss import language_model_loss
from gptlab.training.config import TrainConfig
from gptlab.training.loop import require_one_batch
from gptlab.training.losses import LossFn, dataset_loss, perplexity
from gptlab.training.runtime import Precision, resolve_device, resolve_precision
from gptlab.training.throughput import flops_per_token, mfu, peak_flops
from gptlab.training.timing import LapClock

if TYPE_CHECKING:
    import pandas as pd

STAGE = "pretrain"
REPORT_DIR = REPORTS / "pretrain"
SPLITS = ("train", "val")
LOSS_COLUMNS = ["step", "tokens_seen", "train_loss", "val_loss"]


def run(params: Params) -> None:
    clock = LapClock()
    cfg = params.pretrain
    model_cfg = cfg.model.resolve()
    data = pretrain_windows(params)
    require_one_batch(len(data.train), cfg.train.batch_size, "pretrain.train.batch_size")
    tokenizer = gpt2_tokenizer(*params.data.bpe_files())
    corpus = {} if params.corpus.name == "verdict" else flatten(params.corpus, "corpus")
    init = initial_model(params)  # None: the book's random weights; else a checkpoint that fits the params
    started = {} if init is None else {"init_sha256": init.sha256}
    with training_run(
        STAGE,
        params,
        logged={"data.processed_dir": params.data.processed_dir, **flatten(cfg, "pretrain"), **corpus},
        fingerprint={"pretrain": flatten(cfg), "model": model_cfg.to_dict(), **corpus, **started},
        inputs=data.inputs,
        dataset=DatasetRead(data.name, data.folder, data.profile),
        upstream=None if init is None else init.upstream,
        swept=False,
    ) as stage:
        # The book's order: seed, then build the model, so its initial weights are the book's.
        torch.manual_seed(cfg.train.seed)
        model = build_gpt(model_cfg, cfg.model.vocab_multiple)
        if init is not None:  # continued pretraining: the same draws, then the checkpoint's weights
            init.load_into(model)
            stage.tracker.set_tags(init.tags())
        model = model.to(resolve_device(cfg.train.device))
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters; {len(data.train)} windows")
        clock.lap("setup")
        loss_fn = language_model_loss(cfg.train.loss_kernel)
        initial = split_losses(model, data.scored, cfg.train, loss_fn)
        clock.lap("initial_losses")
        print(f"before training: train loss {initial['train_loss']:.3f}, val loss {initial['val_loss']:.3f}")
        stage.tracker.log_values(initial, "initial", step=0)

        def on_epoch_end(epoch: int, trained: nn.Module) -> dict[str, str]:
            text = generate_text(trained, tokenizer, cfg.sample)
            print(f"epoch {epoch} sample: {text!r}")
            return {"sample": text}

        result = stage.fit(
            model, data.train, data.scored["val"], cfg.train, loss_fn, on_epoch_end=on_epoch_end
        )
        clock.lap("training")
        if not stage.main:  # another torchrun process: rank 0 writes the outputs
            return
        final = split_losses(model, data.scored, cfg.train, loss_fn)
        clock.lap("final_losses")
        metrics = {
            **{f"initial_{name}": value for name, value in initial.items()},
            **{f"final_{name}": value for name, value in final.items()},
            **{f"final_{split}_perplexity": perplexity(final[f"{split}_loss"]) for split in SPLITS},
            # The last in-training evaluation (eval_iter batches): what the book reports.
            "last_eval_train_loss": result.history[-1]["train_loss"],
            "last_eval_val_loss": result.history[-1]["val_loss"],
        }
        counts = {"steps": result.steps, "epochs": len(result.epochs), "tokens_seen": result.seen}
        report_throughput(stage, model, result.seen_per_second, cfg.train.precision)
        samples = (f"epoch {row['epoch']} (step {row['step']}):\n{row['sample']}" for row in result.epochs)
        stage.tracker.log_text("\n\n".join(samples), "pretrain/samples.txt")
        stage.publish(
            model,
            PRETRAIN_MODEL,
            {"stage": STAGE, "params": flatten(cfg, "pretrain"), "metrics": metrics, "counts": counts},
            Reports(REPORT_DIR, metrics, counts, losses(params, result.history), figure_file="loss.png"),
            result,
            kind="pretrain",
            model_defaults={
                "max_new_tokens": cfg.sample.max_new_tokens,
                "temperature": cfg.sample.temperature,
                "top_k": cfg.sample.top_k,
                "seed": cfg.sample.seed,
            },
        )
        clock.lap("outputs_and_logging")
        timings = {**clock.metrics(), **LapClock.as_metrics(result.phase_seconds, "seconds_training_")}
        stage.tracker.log_dict(timings, "pretrain/stage_seconds.json")
        print(f"seconds by phase: {json.dumps(timings)}", file=sys.stderr)
    print(json.dumps(metrics | counts, indent=2, sort_keys=True))


def report_throughput(
    stage: TrainingRun, model: GPTModel, tokens_per_second: float, precision: Precision
) -> None:
    """Print the training's tokens/s, and tag its MFU where the device's peak is known (no metric:
    it varies run to run, as the tokens/s tag beside it)."""
    device = next(model.parameters()).device
    peak = peak_flops(device, resolve_precision(device, precision))
    parameters = sum(p.numel() for p in model.parameters())
    utilisation = mfu(tokens_per_second, flops_per_token(model.cfg, parameters), peak)
    if utilisation is not None:
        stage.tracker.set_tags({"gptlab.mfu": f"{utilisation:.4f}"})
    shown = "" if utilisation is None else f", MFU {utilisation:.1%}"
    print(f"training: {tokens_per_second:,.0f} tokens/s{shown}", file=sys.stderr)


def losses(params: Params, history: list[dict[str, float]]) -> pd.DataFrame:
    """losses.csv: the book's columns; a corpus's also the validation perplexity."""
    if params.corpus.name == "verdict":
        return loss_table(history, LOSS_COLUMNS)
    return loss_table(with_perplexity(history), [*LOSS_COLUMNS, "val_perplexity"])


def split_losses(
    model: nn.Module, data: dict[str, Dataset], cfg: TrainConfig, loss_fn: LossFn
) -> dict[str, float]:
    """Mean loss over every window of each split, in eval mode (no dropout), by the training's loss kernel."""
    return {
        f"{split}_loss": dataset_loss(
            model,
            dataset,
            cfg.eval_batch_size or cfg.batch_size,
            loss_fn=loss_fn,
            precision=cfg.precision,
        )
        for split, dataset in data.items()
    }


if __name__ == "__main__":
    stage_main(run, __doc__, trains=True)
