"""The DPO loss and the pair scores on a tiny model: what they compute, checked against plain arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.tasks.preference import DpoLoss, PairScores, pair_metrics, response_logprobs

TINY = ModelConfig(vocab_size=50, context_length=16, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)


def tiny(seed: int):
    torch.manual_seed(seed)
    return build_gpt(TINY)


def batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ids = {key: torch.randint(0, 50, (3, 10)) for key in ("chosen", "rejected")}
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[:, 4:8] = True
    return {**ids, "chosen_mask": mask, "rejected_mask": mask.roll(1, dims=1)}


def test_response_logprobs_is_the_mean_over_the_masked_in_tokens() -> None:
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    log_probs = F.log_softmax(logits, dim=-1)
    expected = [
        sum(log_probs[b, t - 1, ids[b, t]].item() for t in range(5) if mask[b, t]) / int(mask[b, 1:].sum())
        for b in range(2)
    ]
    assert response_logprobs(logits, ids, mask).tolist() == pytest.approx(expected, abs=1e-6)


def test_the_policy_as_its_own_reference_has_loss_log_2_and_no_reward() -> None:
    out = DpoLoss(tiny(1), beta=0.1)(tiny(1), batch())
    assert out["loss"].item() == pytest.approx(math.log(2))
    assert out["chosen_reward"].item() == out["rejected_reward"].item() == 0.0


def test_the_loss_follows_the_reward_margin_and_only_the_policy_gets_gradients() -> None:
    policy, reference = tiny(1), tiny(2)
    out = DpoLoss(reference, beta=0.5)(policy, batch())
    margin = out["chosen_reward"] - out["rejected_reward"]
    assert margin.item() != 0.0
    out["loss"].backward()
    assert all(p.grad is not None for p in policy.parameters())
    assert all(not p.requires_grad and p.grad is None for p in reference.parameters())


def test_pair_metrics_against_the_reference_scores() -> None:
    reference = PairScores(chosen=[-2.0, -3.0], rejected=[-2.5, -1.0])
    policy = PairScores(chosen=[-1.5, -3.5], rejected=[-2.5, -1.0])  # rewards: +0.5 / -0.5 chosen, 0 rejected
    got = pair_metrics(policy, reference, beta=0.1)
    assert got["chosen_reward"] == 0.0 and got["rejected_reward"] == 0.0
    assert got["reward_margin"] == 0.0 and got["reward_accuracy"] == 0.5
    softplus = [math.log1p(math.exp(-0.1 * m)) for m in (0.5, -0.5)]
    assert got["loss"] == pytest.approx(sum(softplus) / 2)
    assert reference.prefers_chosen() == 0.5 and policy.prefers_chosen() == 0.5
