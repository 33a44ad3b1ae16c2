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
from torch import nn

from gptlab.model.fast_kernels import DecodeLinear
from gptlab.model.gpt import GPTModel
from gptlab.model.padded_vocab import PaddedVocabHead
from gptlab.training.losses import IGNORE_INDEX, LossFn, next_token_loss

# Logits per chunk: at most 2**25 fp32 values (134 MB, 640 tokens of GPT-2's vocabulary). A
# pretraining batch (2 x 256 tokens) is one chunk, so its casts and matmuls are done once; an
# instruct batch (8 x up to 1,024 tokens) is a dozen, so its full logits (1.6 GB) never exist.
CHUNK_LOGITS = 2**25
# Tokens per chunk are a multiple of this: the reductions over (vocab, tokens) logits vectorise
# along the tokens. On the Zen 4 CPU measured, 667 tokens (2**25 // 50,257) made amax 3-4x and the
# sum 2x slower than 640, and a 3,072-token loss without gradients 1.14x (bf16) to 1.33x (fp32)
# slower (benchmarks/README.md).
CHUNK_ALIGN = 64

# Vocabulary rows per matmul. The logits are computed transposed, (vocab, tokens), one block of the
# head's rows at a time into contiguous slices, and the weight's gradient likewise. On the Zen 4 CPU
# measured, 50,257 columns in one (tokens, vocab) product ran the fp32 logits 1.5x and the bf16
# weight gradient 1.2x slower than these blocks (benchmarks/README.md).
VOCAB_BLOCK = 8192


def language_model_loss(kernel: str) -> LossFn:
    """The next-token loss that `train.loss_kernel` names: book or chunked."""
    return chunked_next_token_loss if kernel == "chunked" else next_token_loss


def chunked_next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`next_token_loss` without materialising the logits; falls back to it where the head is not plain.

    The fallback covers classifier heads, LoRA-wrapped heads and models wrapped
    by DistributedDataParallel (whose gradient hooks need its own forward). A
    padded head (padded_vocab.py) multiplies by all its rows, and the logits of
    the padded ones are cut off before the softmax.
    """
    head = model.out_head if isinstance(model, GPTModel) else None
    if type(head) not in (nn.Linear, DecodeLinear, PaddedVocabHead) or head.bias is not None:
        return next_token_loss(model, batch)
    inputs, targets = batch
    hidden = model.hidden_states(inputs).flatten(0, 1)  # (b * t, emb)
    return linear_cross_entropy(hidden, head.weight, targets.flatten(), vocab=model.cfg.vocab_size)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int | None = None
) -> torch.Tensor:
    """Mean cross entropy of logits `hidden @ weight.T` (n, vocab) against `targets` (n,), -100 skipped.

    `vocab`: the weight's first rows that are the vocabulary (None: all); the logits of the rows
    after them (a padded head's) are computed, for the matmuls' shapes, and go no further.
    """
    vocab = weight.shape[0] if vocab is None else vocab
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        with torch.no_grad():
            return _LinearCrossEntropy.loss_and_grads(hidden, weight, targets, vocab, want_grads=False)[0]
    return _LinearCrossEntropy.apply(hidden, weight, targets, vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients chunk by chunk; backward only scales them."""

    @staticmethod
    def loss_and_grads(
        hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, want_grads: bool
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
            denominator = count.clamp(min=1).float()
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if want_grads else None
            grad_weight = torch.empty_like(weight, dtype=torch.float32) if want_grads else None
            chunk = _chunk_tokens(weight.shape[0])
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h, t, keep = h_all[rows], targets[rows], kept[rows]
                all_logits = _transposed_logits(h, w)  # (weight rows, chunk), fp32 for the softmax
                logits = all_logits[:vocab]  # (vocab, chunk): a padded head's extra rows go no further
                tokens = torch.arange(len(t), device=t.device)
                safe_t = torch.where(keep, t, 0)
                target_logit = logits[safe_t, tokens]
                # The log-sum-exp and the softmax from one pass of exp, in place (the logits are done).
                peak = logits.amax(dim=0)
                exps = logits.sub_(peak).exp_()
                sums = exps.sum(dim=0)
                total += ((peak + sums.log() - target_logit) * keep).sum()
                if not want_grads:
                    continue
                # d loss / d logits = (softmax - one_hot(target)) / kept tokens, zero on skipped rows.
                probs = exps.mul_(keep / (sums * denominator))
                probs.index_put_((safe_t, tokens), keep / -denominator, accumulate=True)
                all_logits[vocab:] = 0  # the padded rows' gradient: none (their weights stay zero)
                probs = all_logits.to(dtype)  # (weight rows, chunk): probs, then the zeros
                grad_hidden[rows] = probs.t() @ w  # type: ignore[index]
                _weight_gradient(probs, h, into=grad_weight, accumulate=start > 0)  # type: ignore[arg-type]
        loss = torch.where(count > 0, total / denominator, torch.nan)  # as F.cross_entropy: nan for none kept
        if not want_grads:
            return loss, None, None
        return loss, grad_hidden, grad_weight.to(weight.dtype)  # type: ignore[union-attr]

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab):  # type: ignore[no-untyped-def, override]
        loss, grad_hidden, grad_weight = _LinearCrossEntropy.loss_and_grads(
            hidden, weight, targets, vocab, True
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[no-untyped-def, override]
        grad_hidden, grad_weight = ctx.saved_tensors
        # The usual loss.backward() passes 1: no (vocab, emb) copy to scale by it. Compiled code
        # scales always, since reading the value would break torch.compile's graph.
        if not torch.compiler.is_compiling() and grad_output.item() == 1.0:
            return grad_hidden, grad_weight, None, None
        return grad_hidden * grad_output, grad_weight * grad_output, None, None


def _chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: as many as CHUNK_LOGITS holds, rounded down to a multiple of CHUNK_ALIGN."""
    tokens = max(1, CHUNK_LOGITS // vocab)
    return tokens // CHUNK_ALIGN * CHUNK_ALIGN if tokens >= CHUNK_ALIGN else tokens


def _transposed_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fp32 logits of `h @ w.T` laid out (vocab, tokens), computed `VOCAB_BLOCK` vocabulary rows at a time."""
    h_t = h.t().contiguous()
    logits = torch.empty(w.shape[0], h.shape[0], dtype=torch.float32, device=h.device)
    if w.dtype == logits.dtype:
        for start in range(0, w.shape[0], VOCAB_BLOCK):
            torch.mm(w[start : start + VOCAB_BLOCK], h_t, out=logits[start : start + VOCAB_BLOCK])
        return logits
    # A narrower matmul dtype: each block is widened into the logits while it is still in cache.
    block = torch.empty(min(VOCAB_BLOCK, w.shape[0]), h.shape[0], dtype=w.dtype, device=h.device)
    for start in range(0, w.shape[0], VOCAB_BLOCK):
        rows = slice(start, start + VOCAB_BLOCK)
        logits[rows].copy_(torch.mm(w[rows], h_t, out=block[: logits[rows].shape[0]]))
    return logits


def _weight_gradient(probs: torch.Tensor, h: torch.Tensor, into: torch.Tensor, accumulate: bool) -> None:
    """Write (or add) `probs @ h`, the head weight's gradient (vocab, emb), into fp32 `into`, by vocabulary blocks."""
    for start in range(0, probs.shape[0], VOCAB_BLOCK):
        rows = slice(start, start + VOCAB_BLOCK)
        if probs.dtype != into.dtype and accumulate:
            into[rows].add_(probs[rows] @ h)
        elif probs.dtype != into.dtype:
            into[rows].copy_(probs[rows] @ h)
        elif accumulate:
            into[rows].addmm_(probs[rows], h)
        else:
            torch.mm(probs[rows], h, out=into[rows])
