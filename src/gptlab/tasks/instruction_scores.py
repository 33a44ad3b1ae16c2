"""How an instruction-tuned model is scored (chapter 7): its losses, its greedy answers to the test
set, their ROUGE-L against the references and, when enabled, a judge model's scores.
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import tiktoken
import torch

from gptlab.data.instruct import InstructionDataset
from gptlab.model.gpt import GPTModel
from gptlab.tasks.config import InstructConfig
from gptlab.tasks.judge import judge_all, summarize
from gptlab.tasks.responses import answer_room, generate_responses, prompt_ids, rouge_l
from gptlab.training.loop import TrainResult
from gptlab.training.losses import dataset_loss
from gptlab.training.runtime import inference_dtype


def answer_and_score(
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
    # The precision training used also serves the losses; the answers use instruct.generate.precision.
    metrics: dict[str, Any] = {
        f"{split}_loss": finite(
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
    warn_of_capped_answers(tokenizer, test_records, cfg, model.cfg.context_length)
    answer_dtype = inference_dtype(device, cfg.generate.precision)
    # A bf16 copy answers: the model itself stays fp32, as it is saved.
    answering = model if answer_dtype == torch.float32 else copy.deepcopy(model).to(answer_dtype)
    responses = generate_responses(
        answering,
        tokenizer,
        test_records,
        max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.generate.batch_size,
    )
    del answering
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


def warn_of_capped_answers(
    tokenizer: tiktoken.Encoding, records: list[dict[str, str]], cfg: InstructConfig, context_length: int
) -> None:
    """Say when the base model's context leaves less room than instruct.max_new_tokens (as `gptlab chat` does)."""
    lengths = [len(ids) for ids in prompt_ids(tokenizer, records)]
    rooms = answer_room(lengths, context_length=context_length, max_new_tokens=cfg.max_new_tokens)
    capped = [room for room in rooms if room < cfg.max_new_tokens]
    if capped:
        print(
            f"warning: instruct.max_new_tokens {cfg.max_new_tokens} capped for {len(capped)} of "
            f"{len(rooms)} test answers at what the context of the base model {cfg.base_model} "
            f"({context_length} tokens) leaves after their prompts: {min(capped)} to {max(capped)} tokens; "
            "a longer context (OpenAI's GPT-2 reads 1,024 tokens; with gpt2.source: pretrain it is "
            "pretrain.model.context_length) or a lower instruct.max_new_tokens avoids it",
            file=sys.stderr,
            flush=True,
        )


def metrics_and_counts(
    scores: dict[str, Any], result: TrainResult, trainable: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """DVC's metrics (losses, ROUGE-L, the judge's mean) and the counts beside them."""
    metrics = {
        **scores,
        # The last evaluation of training, over eval_iter batches: the book's reported losses.
        "final_train_loss": finite(result.history[-1]["train_loss"]) if result.history else None,
        "final_val_loss": finite(result.history[-1]["val_loss"]) if result.history else None,
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
    return metrics, counts


def finite(value: float) -> float | None:
    """None for a nan loss (an empty split), which JSON cannot hold."""
    return None if math.isnan(value) else value
