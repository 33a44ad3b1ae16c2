"""The output head padded to a multiple of rows (`pretrain.model.vocab_multiple`): a speed path for training.

The chapter 5 bonus on training speed pads GPT-2's 50,257-word vocabulary to
50,304 (64 x 786), a size the GPU's matmul kernels tile without a ragged edge.
Here only the output head pads (the token embedding is a lookup: a padded row
would never be read), and the padding stays inside the model:

- the padded rows start at zero and their logits are cut off in `forward` (and
  in the chunked loss, training/chunked_loss.py, before its softmax), so neither
  the loss nor the samples ever see them; they get no gradient, and AdamW leaves
  zero weights with zero moments at zero;
- the state dict holds the real 50,257 rows (and loading pads them again), so
  checkpoints, resumed runs, exports and the fine-tunes built on them never
  see the padding.

`with_padded_vocab` pads a freshly built model without drawing anything: after
the same seed its real weights are those of the unpadded model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gptlab.model.fast_kernels import DecodeLinear
from gptlab.model.gpt import GPTModel


def padded_size(vocab_size: int, multiple: int) -> int:
    """`vocab_size` rounded up to a multiple of `multiple` (50,257 to 50,304 for 64)."""
    return -(-vocab_size // multiple) * multiple


def with_padded_vocab(model: GPTModel, multiple: int | None) -> GPTModel:
    """`model` (in place) with its language-model head padded to a multiple of `multiple` rows; None: as it is."""
    if multiple is None:
        return model
    head = model.out_head
    if not model.cfg.is_language_model or head.bias is not None:
        raise ValueError("only a language model's head (no bias) pads its vocabulary")
    model.out_head = PaddedVocabHead(head.weight, padded_size(model.cfg.vocab_size, multiple))
    return model


class PaddedVocabHead(DecodeLinear):
    """A bias-free output head computing `rows` logits (the real ones, then the padded) and returning the real ones.

    A DecodeLinear, so that samples decode as fast as the unpadded fused head.
    """

    def __init__(self, weight: torch.Tensor, rows: int) -> None:
        vocab_size, emb_dim = weight.shape
        with torch.device("meta"):  # nothing drawn: the weight is the real rows and zeros
            super().__init__(emb_dim, rows, bias=False)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(_padded(weight.detach(), rows), requires_grad=weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[..., : self.vocab_size]  # (..., rows) -> (..., vocab)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        weight = self.weight[: self.vocab_size]
        destination[prefix + "weight"] = weight if keep_vars else weight.detach()

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
        key = prefix + "weight"
        if key in state_dict and state_dict[key].shape[0] == self.vocab_size:
            state_dict = {**state_dict, key: _padded(state_dict[key], self.out_features)}
        super()._load_from_state_dict(state_dict, prefix, *args)


def _padded(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` (vocab, emb) followed by zero rows up to `rows`."""
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])
