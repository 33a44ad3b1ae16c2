"""Stage `instruct-finetune`: chapter 7's instruction tuning of GPT-2, its answers and their scores.

Reads the load-gpt2 checkpoint models/gpt2/<instruct.base_model> and the
instruction splits of the tokenize stage; trains with the shared loop (the
collate function masks padding with -100) every weight, or with
`instruct.trainable: lora` only LoRA adapters on every linear layer (merged
into the weights once trained); then answers every test record greedily and
scores the answers against the references with ROUGE-L and, when
instruct.judge.enabled, with a larger judge model as the book does.

Writes models/instruct/ and, under reports/instruct/,
metrics.json (losses, ROUGE-L, the judge's mean: DVC metrics), counts.json (steps,
tokens seen, trainable parameters, test records, the judge's counts and histogram), losses.csv (the loss
curve, a DVC plot) and responses.json (the answers). The MLflow run links the
load-gpt2 run that wrote its base model.
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import torch

from gptlab.data.instruct import (
    SPLITS,
    SUBDIR,
    InstructionDataset,
    instruction_collate,
    load_split,
    require_room,
    split_path,
)
from gptlab.files import write_json
from gptlab.model.checkpoint import load_model, read_config
from gptlab.model.lora import add_lora, has_lora, merge_lora
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import GPT2_MODELS, INSTRUCT_MODEL, REPORTS
from gptlab.pipeline.params import Params
from gptlab.pipeline.training_stage import DatasetRead, Reports, loss_table, trainable_metadata, training_run
from gptlab.schema import flatten
from gptlab.tasks.fine_tune import adds_lora, require_language_model, select_trainable
from gptlab.tasks.instruction_scores import answer_and_score, metrics_and_counts
from gptlab.tasks.judge import check_judge
from gptlab.tracking.buffered_run import StageRun
from gptlab.training.chunked_loss import language_model_loss
from gptlab.training.loop import require_one_batch

STAGE = "instruct-finetune"
REPORT_DIR = REPORTS / "instruct"
LOSS_COLUMNS = ["step", "tokens_seen", "train_loss", "val_loss"]
# What answering and judging read: a crash while answering resumes after training even if they changed.
NOT_TRAINING = ("judge", "max_new_tokens", "generate")
# The test answers shown as chapter 7 prints them after training, in instruct/answer_examples.txt.
ANSWER_EXAMPLES = 3


def run(params: Params) -> None:
    cfg = params.instruct
    processed_dir = Path(params.data.processed_dir)
    base_dir = GPT2_MODELS / cfg.base_model
    # Fail before hours of training, not after: the judge, the base model, the data.
    if cfg.judge.enabled:
        check_judge(cfg.judge)
    base_cfg, base_metadata = read_config(base_dir)
    require_language_model(base_cfg, base_dir, "instruct.base_model")
    splits = {split: load_split(processed_dir, split) for split in SPLITS}
    tokenizer = gpt2_tokenizer(*params.data.bpe_files())
    datasets = {split: InstructionDataset(records, tokenizer) for split, records in splits.items()}
    require_one_batch(len(datasets["train"]), cfg.train.batch_size, "instruct.train.batch_size")
    lengths = {split: datasets[split].prompt_lengths for split in ("train", "val")}
    require_room(lengths, cfg.allowed_max_length, "instruct.allowed_max_length")
    collate = functools.partial(
        instruction_collate, allowed_max_length=cfg.allowed_max_length, mask_prompt=cfg.mask_prompt
    )
    with training_run(
        STAGE,
        params,
        logged=flatten(cfg, "instruct"),
        fingerprint={k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_TRAINING},
        inputs=[base_dir, *(split_path(processed_dir, split) for split in SPLITS)],
        dataset=DatasetRead(
            "instruct", processed_dir / SUBDIR, {f"{s}_records": len(r) for s, r in splits.items()}
        ),
        upstream=(base_dir, base_metadata),
    ) as stage:
        model, _ = load_model(base_dir, drop_rate=cfg.drop_rate)
        select_trainable(model, cfg.trainable)
        if adds_lora(cfg.trainable):
            torch.manual_seed(cfg.train.seed)  # A's draws, reproducible
            add_lora(model, cfg.lora.rank, cfg.lora.alpha)
        trainable = stage.report_trainable(model, cfg.base_model, cfg.trainable, cfg.lora, base_metadata)
        torch.manual_seed(cfg.train.seed)  # the book seeds just before training (chapter 7)
        loss_fn = language_model_loss(cfg.train.loss_kernel)
        result = stage.fit(model, datasets["train"], datasets["val"], cfg.train, loss_fn, collate_fn=collate)
        if not stage.main:  # another torchrun process: rank 0 answers, scores and writes the outputs
            return
        if has_lora(model):  # answered and saved as a plain GPT-2: chat, export and MLflow load it as is
            merge_lora(model)
        responses, metrics = answer_and_score(model, tokenizer, cfg, splits["test"], datasets, collate)
        metrics, counts = metrics_and_counts(metrics, result, trainable)
        write_json(REPORT_DIR / "responses.json", responses, sort_keys=False)
        _log_answers(stage.tracker, responses, judged=cfg.judge.enabled)
        metadata = {
            "stage": STAGE,
            "base_model": cfg.base_model,
            "base_metadata": base_metadata,
            "steps": result.steps,
            "tokens_seen": result.seen,
            **trainable_metadata(cfg.trainable, trainable, cfg.lora),
            "mask_prompt": cfg.mask_prompt,
            "allowed_max_length": cfg.allowed_max_length,
            "generation": {"max_new_tokens": cfg.max_new_tokens},  # how it answered: `gptlab chat`'s default
        }
        stage.publish(
            model,
            INSTRUCT_MODEL,
            metadata,
            Reports(REPORT_DIR, metrics, counts, loss_table(result.history, LOSS_COLUMNS)),
            result,
            kind="instruct",
            model_defaults={"max_new_tokens": cfg.max_new_tokens},
        )
    print(json.dumps(metrics | counts, indent=2, sort_keys=True))


def _log_answers(tracker: StageRun, responses: list[dict[str, Any]], *, judged: bool) -> None:
    """A table of every answer with its scores, which the MLflow UI shows in its evaluation view,
    and the first answers as chapter 7 prints them, a text file the UI shows as it is."""
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
    examples = (
        "\n".join(filter(None, [r["instruction"], r["input"]]))
        + f"\n\nCorrect response:\n>> {r['output']}\n\n"
        f"Model response:\n>> {r['model_response'].strip()}"
        for r in responses[:ANSWER_EXAMPLES]
    )
    tracker.log_text(("\n" + "-" * 37 + "\n").join(examples) + "\n", "instruct/answer_examples.txt")


if __name__ == "__main__":
    stage_main(run, __doc__, trains=True)
