"""Building the GPT-2 a ModelConfig describes: the book's model (gpt.py), computing as its settings say.

The book's model is built first and its modules then swapped for the speed
paths `kernels` and `attention` name (fast_kernels.py), and its head padded to
`vocab_multiple` rows where a training asks for it (padded_vocab.py), so that
after `torch.manual_seed` a freshly built model holds the book's random weights
whatever the settings: the stand-ins take over the parameters already drawn.
"""

from __future__ import annotations

from gptlab.model.config import ModelConfig
from gptlab.model.fast_kernels import with_kernels
from gptlab.model.gpt import GPTModel
from gptlab.model.padded_vocab import with_padded_vocab


def build_gpt(cfg: ModelConfig, vocab_multiple: int | None = None) -> GPTModel:
    """The GPTModel `cfg` describes, computing with the kernels and attention it names; with `vocab_multiple`,
    its head padded to a multiple of that many rows (checkpoints still hold the real vocabulary)."""
    return with_padded_vocab(with_kernels(GPTModel(cfg), cfg.kernels, cfg.attention), vocab_multiple)
