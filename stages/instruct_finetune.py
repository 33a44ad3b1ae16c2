"""Stage `instruct-finetune`: chapter 7's instruction tuning of GPT-2, its answers and their scores.

Reads the load-gpt2 checkpoint models/gpt2/<instruct.base_model> and the
instruction splits of the tokenize stage; trains with the shared loop (the
collate function masks padding with -100) every weight, or with
`instruct.trainable: lora` only LoRA adapters on every linear layer (merged
into the weights once trained); then answers every test record greedily and
scores the answers against the references with ROUGE-L and, when
instruct.judge.enabled, with a larger judge model as the book does.

Writes models/instruct/ (naming its MLflow run) and, under reports/instruct/,
metrics.json (losses, ROUGE-L, the judge's mean: DVC metrics), counts.json (steps,
tokens seen, trainable parameters, test records, the judge's counts and histogram), losses.csv (the loss
curve, a DVC plot) and responses.json (the answers). The MLflow run links the
load-gpt2 run that wrote its base model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import tiktoken
import torch

from gptlab.checkpoint import load_model, read_config, save_model
from gptlab.chunked_loss import language_model_loss
from gptlab.config import InstructConfig, Params
from gptlab.datasets.instruct import (
    SPLITS,
    SUBDIR,
    InstructionDataset,
    instruction_collate,
    load_split,
    split_path,
)
from gptlab.distributed import is_main
from gptlab.errors import InputError
from gptlab.files import write_csv, write_json
from gptlab.judge import check_judge, judge_all, summarize
from gptlab.lora import add_lora, has_lora, merge_lora
from gptlab.losses import dataset_loss
from gptlab.model import GPTModel
from gptlab.paths import GPT2_MODELS, INSTRUCT_MODEL, REPORTS
from gptlab.registry import log_model
from gptlab.responses import generate_responses, rouge_l
from gptlab.runtime import autocast
from gptlab.stage import stage_main
from gptlab.tokenizer import gpt2_tokenizer
from gptlab.tracking import StageRun, stage_run
from gptlab.train import fit
from gptlab.train_state import resume_folder
from gptlab.typed_config import flatten

STAGE = "instruct-finetune"
REPORT_DIR = REPORTS / "instruct"
LOSS_COLUMNS = ["step", "tokens_seen", "train_loss", "val_loss"]


def run(params: Params) -> None:
    cfg = params.instruct
    processed_dir = Path(params.data.processed_dir)
    raw_dir = Path(params.data.raw_dir)
    base_dir = GPT2_MODELS / cfg.base_model
    # Fail before hours of training, not after: the judge, the base model, the data.
    if cfg.judge.enabled:
        check_judge(cfg.judge)
    base_cfg, base_metadata = read_config(base_dir)
    if base_cfg.num_classes is not None:
        raise InputError(f"{base_dir} is a classifier; instruct.base_model must name a GPT-2 language model")
    splits = {split: load_split(processed_dir, split) for split in SPLITS}
    tokenizer = gpt2_tokenizer(
        raw_dir / params.data.sources.gpt2_vocab_bpe.path,
        raw_dir / params.data.sources.gpt2_encoder_json.path,
    )
    datasets = {split: InstructionDataset(records, tokenizer) for split, records in splits.items()}
    collate = functools.partial(
        instruction_collate, allowed_max_length=cfg.allowed_max_length, mask_prompt=cfg.mask_prompt
    )
    # Resumable state is keyed by what determines training only: a crash while answering or
    # judging resumes after training, even if judge settings or the generation settings were changed.
    training = {
        k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("judge", "max_new_tokens", "generate")
    }
    inputs = [base_dir, *(split_path(processed_dir, split) for split in SPLITS)]
    with (
        stage_run(
            STAGE,
            params.tracking.experiment,
            flatten(cfg, "instruct"),
            system_metrics=params.tracking.system_metrics,
            sweep=params.tracking.sweep,
            sweep_variant=params.tracking.sweep_variant,
        ) as tracker,
        resume_folder(STAGE, training, inputs) as run_dir,
    ):
        tracker.link_upstream(base_dir, base_metadata)
        tracker.log_input(
            "instruct",
            processed_dir / SUBDIR,
            context="training",
            profile={f"{split}_records": len(records) for split, records in splits.items()},
        )
        model, _ = load_model(base_dir, drop_rate=cfg.drop_rate)
        if cfg.trainable == "lora":
            torch.manual_seed(cfg.train.seed)  # A's draws, reproducible
            add_lora(model, cfg.lora.rank, cfg.lora.alpha)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tracker.set_tags({"gptlab.trainable_params": trainable})
        print(
            f"{cfg.base_model}: {trainable:,} of {sum(p.numel() for p in model.parameters()):,} params train"
            + (f" (LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g})" if cfg.trainable == "lora" else "")
        )
        torch.manual_seed(cfg.train.seed)  # the book seeds just before training (chapter 7)
        result = fit(
            model,
            datasets["train"],
            datasets["val"],
            cfg=cfg.train,
            loss_fn=language_model_loss(cfg.train.loss_kernel),
            run_dir=run_dir,
            collate_fn=collate,
            tracker=tracker,
        )
        if not is_main():  # another torchrun process: rank 0 answers, scores and writes the outputs
            return
        if has_lora(model):  # answered and saved as a plain GPT-2: chat, export and MLflow load it as is
            merge_lora(model)
        responses, metrics = _answer_and_score(model, tokenizer, cfg, splits["test"], datasets, collate)
        metrics |= {
            # The last evaluation of training, over eval_iter batches: the book's reported losses.
            "final_train_loss": _finite(result.history[-1]["train_loss"]) if result.history else None,
            "final_val_loss": _finite(result.history[-1]["val_loss"]) if result.history else None,
        }
        # Counts are no metrics to compare across experiments: they go to counts.json.
        counts: dict[str, Any] = {
            "steps": result.steps,
            "tokens_seen": result.seen,
            "trainable_params": trainable,
            "test_records": metrics.pop("test_records"),
        }
        if "judge" in metrics:
            judge = metrics.pop("judge")
            metrics["judge"] = {"mean": judge["mean"]}
            counts["judge"] = {k: v for k, v in judge.items() if k != "mean"}
        save_model(
            model,
            INSTRUCT_MODEL,
            {
                "stage": STAGE,
                "base_model": cfg.base_model,
                "base_metadata": base_metadata,
                "steps": result.steps,
                "tokens_seen": result.seen,
                "trainable": cfg.trainable,
                "trainable_params": trainable,
                **(
                    {"lora": {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "merged": True}}
                    if cfg.trainable == "lora"
                    else {}
                ),
                "mask_prompt": cfg.mask_prompt,
                "allowed_max_length": cfg.allowed_max_length,
            },
        )
        tracker.record_checkpoint(INSTRUCT_MODEL)
        _write_reports(result.history, responses, metrics, counts)
        _log(tracker, responses, metrics, counts, judged=cfg.judge.enabled, step=result.global_step)
        tracker.log_metrics(
            {"wall_seconds": result.wall_seconds, "tokens_per_second": result.seen_per_second},
            step=result.global_step,
        )
        if params.tracking.log_models:
            log_model(
                tracker,
                "instruct",
                INSTRUCT_MODEL,
                experiment=params.tracking.experiment,
                bpe_files=(
                    raw_dir / params.data.sources.gpt2_vocab_bpe.path,
                    raw_dir / params.data.sources.gpt2_encoder_json.path,
                ),
                defaults={"max_new_tokens": cfg.max_new_tokens},
            )
    print(json.dumps(metrics | counts, indent=2, sort_keys=True))


def _answer_and_score(
    model: GPTModel,
    tokenizer: tiktoken.Encoding,
    cfg: InstructConfig,
    test_records: list[dict[str, str]],
    datasets: dict[str, InstructionDataset],
    collate: Callable[[list[Any]], Any],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Full validation and test losses, greedy answers to the test set, ROUGE-L and the judge's scores."""
    model.eval()
    device = next(model.parameters()).device
    # The precision training used also serves evaluation and answering (bf16 is ~2x faster on CPU).
    metrics: dict[str, Any] = {
        f"{split}_loss": _finite(
            dataset_loss(
                model,
                datasets[split],
                cfg.train.eval_batch_size or cfg.train.batch_size,
                precision=cfg.train.precision,
                collate_fn=collate,
            )
        )
        for split in ("val", "test")
    }
    with autocast(device, cfg.train.precision):
        responses = generate_responses(
            model,
            tokenizer,
            test_records,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.generate.batch_size,
        )
    rouge = rouge_l([r["output"] for r in responses], [r["model_response"] for r in responses])
    for record, score in zip(responses, rouge, strict=True):
        record["rougeL_f1"] = score
    metrics["rougeL_f1"] = statistics.fmean(rouge) if rouge else None
    metrics["test_records"] = len(responses)
    if cfg.judge.enabled:
        verdicts = judge_all(cfg.judge, responses)
        for record, verdict in zip(responses, verdicts, strict=True):
            record["judge_score"] = verdict.score
            record["judge_reply"] = verdict.reply
        metrics["judge"] = summarize([v.score for v in verdicts])
    return responses, metrics


def _write_reports(
    history: list[dict[str, Any]],
    responses: list[dict[str, Any]],
    metrics: dict[str, Any],
    counts: dict[str, Any],
) -> None:
    write_csv(REPORT_DIR / "losses.csv", pd.DataFrame(history, columns=LOSS_COLUMNS))
    write_json(REPORT_DIR / "responses.json", responses, sort_keys=False)
    write_json(REPORT_DIR / "metrics.json", metrics, allow_nan=False)
    write_json(REPORT_DIR / "counts.json", counts)


def _log(
    tracker: StageRun,
    responses: list[dict[str, Any]],
    metrics: dict[str, Any],
    counts: dict[str, Any],
    *,
    judged: bool,
    step: int,
) -> None:
    """The metrics (at the last step), a table of every answer with its scores, and the reports (the model: log_model)."""
    tracker.log_metrics({k: v for k, v in flatten(metrics).items() if v is not None}, step=step)
    tracker.set_tags({f"gptlab.{name}": counts[name] for name in ("steps", "tokens_seen", "test_records")})
    table: dict[str, list[Any]] = {
        "instruction": [r["instruction"] for r in responses],
        "input": [r["input"] for r in responses],
        "reference": [r["output"] for r in responses],
        "answer": [r["model_response"] for r in responses],
        "rougeL_f1": [r["rougeL_f1"] for r in responses],
    }
    if judged:
        table["judge_score"] = [r["judge_score"] for r in responses]
    tracker.log_table(table, "instruct/answers.json")
    tracker.log_artifact(REPORT_DIR, "reports")


def _finite(value: float) -> float | None:
    """None for a nan loss (an empty split), which JSON cannot hold."""
    return None if math.isnan(value) else value


if __name__ == "__main__":
    stage_main(run, __doc__)
