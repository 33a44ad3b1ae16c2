"""Direct preference optimization (the chapter 7 bonus notebook): the loss, and how a model ranks answer pairs.

A response's score is its mean log-probability over the tokens its mask keeps
(the notebook's compute_logprobs). The policy's reward for a response is its
score minus the frozen reference's; the DPO loss is -log sigmoid(beta * (chosen
reward - rejected reward)), averaged over the batch, as compute_dpo_loss. The
reference model is a fixed part of the loss: it never trains, and runs without
gradients.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tiktoken
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from gptlab.data.preference import ANSWERS
from gptlab.model.gpt import GPTModel
from gptlab.tasks.config import AnswerGeneration
from gptlab.tasks.responses import generate_responses
from gptlab.training.runtime import Precision, autocast, inference_dtype, ordered_loader, to_device


def response_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean log-probability of each sequence's masked-in tokens: (b, t, vocab), (b, t), (b, t) -> (b,).

    Token i is predicted by position i - 1, so the first token, and the last position's
    logits, take no part (the notebook's compute_logprobs).
    """
    log_probs = F.log_softmax(logits[:, :-1, :].float(), dim=-1)  # (b, t - 1, vocab)
    picked = torch.gather(log_probs, -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (b, t - 1)
    kept = mask[:, 1:]
    return (picked * kept).sum(-1) / kept.sum(-1)


def answer_logprobs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's mean log-probability of each chosen and each rejected answer, (b,) each."""
    return {key: response_logprobs(model(batch[key]), batch[key], batch[f"{key}_mask"]) for key in ANSWERS}


class DpoLoss:
    """The DPO loss of a batch against `reference`, with the mean chosen and rejected rewards beside it.

    A loss function of the shared training loop: called with the policy and a batch of
    preference_collate, it returns {"loss", "chosen_reward", "rejected_reward"}, which the
    loop's evaluations average per split (train_chosen_reward, ...).
    """

    def __init__(self, reference: nn.Module, beta: float) -> None:
        self.reference = reference.eval().requires_grad_(False)
        self.beta = beta

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        policy = answer_logprobs(model, batch)
        with torch.no_grad():
            reference = answer_logprobs(self.reference, batch)
        chosen_rewards = (policy["chosen"] - reference["chosen"]).detach()
        rejected_rewards = (policy["rejected"] - reference["rejected"]).detach()
        logits = (policy["chosen"] - policy["rejected"]) - (reference["chosen"] - reference["rejected"])
        return {
            "loss": -F.logsigmoid(self.beta * logits).mean(),
            "chosen_reward": chosen_rewards.mean(),
            "rejected_reward": rejected_rewards.mean(),
        }


def count_chosen_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The notebook's tokens_seen: the chosen answers' padded batch, its rejected ones not counted."""
    return batch["chosen"].numel()


@dataclass(frozen=True)
class PairScores:
    """A model's mean log-probability of each pair's chosen and rejected answer, in data order."""

    chosen: list[float]
    rejected: list[float]

    def prefers_chosen(self) -> float:
        """Share of pairs whose chosen answer gets the higher mean log-probability."""
        return _share([c > r for c, r in zip(self.chosen, self.rejected, strict=True)])


def score_pairs(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int,
    collate_fn: Any,
    precision: Precision = "fp32",
    desc: str | None = None,
) -> PairScores:
    """Every pair of `dataset` scored in order by `model` in eval mode (no dropout); the mode is restored."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    chosen: list[float] = []
    rejected: list[float] = []
    loader = ordered_loader(dataset, batch_size, collate_fn)
    with torch.inference_mode(), autocast(device, precision):
        for batch in tqdm(loader, desc=desc, leave=False, disable=desc is None):
            logprobs = answer_logprobs(model, to_device(batch, device))
            chosen += logprobs["chosen"].tolist()
            rejected += logprobs["rejected"].tolist()
    model.train(was_training)
    return PairScores(chosen, rejected)


def pair_metrics(policy: PairScores, reference: PairScores, beta: float) -> dict[str, float]:
    """The policy against the reference over all pairs: mean DPO loss, rewards, margin, reward accuracy.

    Means over pairs (the training log averages per-batch means of eval_iter batches instead).
    reward_accuracy: share of pairs whose chosen answer gets the higher reward.
    """
    chosen = [p - r for p, r in zip(policy.chosen, reference.chosen, strict=True)]
    rejected = [p - r for p, r in zip(policy.rejected, reference.rejected, strict=True)]
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    # -log sigmoid(x) = softplus(-x)
    losses = F.softplus(-beta * torch.tensor(margins, dtype=torch.float64)).tolist() if margins else []
    return {
        "loss": _mean(losses),
        "chosen_reward": _mean(chosen),
        "rejected_reward": _mean(rejected),
        "reward_margin": _mean(margins),
        "reward_accuracy": _share([m > 0 for m in margins]),
    }


def preference_metrics(
    last_evaluation: Mapping[str, float], before: PairScores, after: PairScores, beta: float
) -> dict[str, Any]:
    """The stage's DVC metrics: the last evaluation's losses and reward margins, and the test split's pairs.

    `before` are the test pairs' scores by the reference, which is the policy before training
    (its rewards are 0: "before" is the baseline), `after` by the trained policy. nan (an empty
    split) becomes None, which JSON can hold.
    """
    metrics: dict[str, Any] = {
        "final_train_loss": last_evaluation.get("train_loss", math.nan),
        "final_val_loss": last_evaluation.get("val_loss", math.nan),
    }
    for split in ("train", "val"):
        if f"{split}_chosen_reward" in last_evaluation:
            margin = last_evaluation[f"{split}_chosen_reward"] - last_evaluation[f"{split}_rejected_reward"]
            metrics[f"final_{split}_reward_margin"] = margin
    metrics["test"] = {
        "before": pair_metrics(before, before, beta) | {"prefers_chosen": before.prefers_chosen()},
        "after": pair_metrics(after, before, beta) | {"prefers_chosen": after.prefers_chosen()},
    }
    return _nan_as_none(metrics)


def _nan_as_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _nan_as_none(item) for key, item in value.items()}
    return None if isinstance(value, float) and math.isnan(value) else value


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else math.nan


def answers_before_after(
    models: Mapping[str, GPTModel],
    tokenizer: tiktoken.Encoding,
    records: list[dict[str, str]],
    *,
    max_new_tokens: int,
    generate: AnswerGeneration,
) -> list[dict[str, str]]:
    """Each test record with the greedy answer of each model, as `response_<name>` (before, after)."""
    answered = [
        {key: record[key] for key in ("instruction", "input", "chosen", "rejected")} for record in records
    ]
    for name, model in models.items():
        model.eval()
        dtype = inference_dtype(next(model.parameters()).device, generate.precision)
        # A bf16 copy answers: the model itself stays fp32, as it is saved.
        answering = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        responses = generate_responses(
            answering, tokenizer, records, max_new_tokens=max_new_tokens, batch_size=generate.batch_size
        )
        for row, response in zip(answered, responses, strict=True):
            row[f"response_{name}"] = response["model_response"]
    return answered
