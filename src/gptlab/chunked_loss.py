"""The output head and cross entropy fused, a chunk of tokens at a time (`train.loss_kernel: chunked`).

The book computes all logits (tokens x 50,257) and hands them to cross
entropy, whose backward pass builds a gradient just as large. Here each chunk
of tokens gets its logits, their log-sum-exp, its share of the loss and at
once its gradients with respect to the hidden states and the head's weight,
so neither the full logits nor their gradient ever exist. Same maths as
`F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)`, summed in
another order (equal to ~1e-6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.losses import IGNORE_INDEX, LossFn, next_token_loss
from gptlab.model import GPTModel, Linear

# Logits per chunk: 2**25 fp32 values (134 MB, ~660 tokens of GPT-2's vocabulary). A pretraining
# batch (2 x 256 tokens) is one chunk, so its casts and matmuls are done once; an instruct batch
# (8 x up to 1,024 tokens) is a dozen, so its full logits (1.6 GB) never exist.
CHUNK_LOGITS = 2**25


def language_model_loss(kernel: str) -> LossFn:
    """The next-token loss that `train.loss_kernel` names: book or chunked."""
    return chunked_next_token_loss if kernel == "chunked" else next_token_loss


def chunked_next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`next_token_loss` without materialising the logits; falls back to it where the head is not plain.

    The fallback covers classifier heads, LoRA-wrapped heads and models wrapped
    by DistributedDataParallel (whose gradient hooks need its own forward).
    """
    if (
        not isinstance(model, GPTModel)
        or type(model.out_head) not in (nn.Linear, Linear)
        or model.out_head.bias is not None
    ):
        return next_token_loss(model, batch)
    inputs, targets = batch
    hidden = model.hidden_states(inputs).flatten(0, 1)  # (b * t, emb)
    return linear_cross_entropy(hidden, model.out_head.weight, targets.flatten())


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits `hidden @ weight.T` (n, vocab) against `targets` (n,), -100 skipped."""
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        with torch.no_grad():
            return _LinearCrossEntropy.loss_and_grads(hidden, weight, targets, want_grads=False)[0]
    return _LinearCrossEntropy.apply(hidden, weight, targets)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients chunk by chunk; backward only scales them."""

    @staticmethod
    def loss_and_grads(
        hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, want_grads: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        device_type = hidden.device.type
        # Under autocast the matmuls run in its dtype: cast the weight and hidden states once, not per chunk.
        dtype = (
            torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        )
        with torch.autocast(device_type, enabled=False):
            h_all, w = hidden.to(dtype), weight.to(dtype)
            kept = targets != IGNORE_INDEX
            count = kept.sum()
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if want_grads else None
            grad_weight: torch.Tensor | None = None
            chunk = max(1, CHUNK_LOGITS // weight.shape[0])
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h, t, keep = h_all[rows], targets[rows], kept[rows]
                logits = F.linear(h, w).float()  # (chunk, vocab); the softmax in fp32
                safe_t = torch.where(keep, t, 0)
                target_logit = logits.gather(1, safe_t.unsqueeze(1)).squeeze(1)
                # The log-sum-exp and the softmax from one pass of exp, in place (the logits are done).
                peak = logits.amax(dim=-1, keepdim=True)
                exps = logits.sub_(peak).exp_()
                sums = exps.sum(dim=-1)
                total += ((peak.squeeze(1) + sums.log() - target_logit) * keep).sum()
                if not want_grads:
                    continue
                # d loss_sum / d logits = softmax - one_hot(target), zero on skipped rows.
                probs = exps.mul_((keep / sums).unsqueeze(1))
                probs.scatter_add_(1, safe_t.unsqueeze(1), -keep.to(probs.dtype).unsqueeze(1))
                probs = probs.to(dtype)
                grad_hidden[rows] = probs @ w  # type: ignore[index]
                if grad_weight is None:
                    grad_weight = (probs.t() @ h).float()  # fp32 sums, whatever the matmul dtype
                elif probs.dtype == grad_weight.dtype:
                    grad_weight.addmm_(probs.t(), h)  # no (vocab, emb) temporary
                else:
                    grad_weight += probs.t() @ h
        denominator = count.clamp(min=1).float()
        loss = torch.where(count > 0, total / denominator, torch.nan)  # as F.cross_entropy: nan for none kept
        if not want_grads:
            return loss, None, None
        return loss, grad_hidden.div_(denominator), grad_weight.div_(denominator).to(weight.dtype)  # type: ignore[union-attr]

    @staticmethod
    def forward(ctx, hidden, weight, targets):  # type: ignore[no-untyped-def, override]
        loss, grad_hidden, grad_weight = _LinearCrossEntropy.loss_and_grads(hidden, weight, targets, True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[no-untyped-def, override]
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_output.item() == 1.0:  # the usual loss.backward(): no (vocab, emb) copy to scale by 1
            return grad_hidden, grad_weight, None
        return grad_hidden * grad_output, grad_weight * grad_output, None
