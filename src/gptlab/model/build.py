"""Building the GPT-2 a ModelConfig describes: the book's model (gpt.py), computing as its settings say.

The book's model is built first and its modules then swapped for the speed
paths `kernels` and `attention` name (fast_kernels.py), so that after
`torch.manual_seed` a freshly built model holds the book's random weights
whatever the settings: the stand-ins take over the parameters already drawn.
"""

from __future__ import annotations

from gptlab.model.config import ModelConfig
from gptlab.model.fast_kernels import with_kernels
from gptlab.model.gpt import GPTModel


def build_gpt(cfg: ModelConfig) -> GPTModel:
    """The GPTModel `cfg` describes, computing with the kernels and attention it names."""
    return with_kernels(GPTModel(cfg), cfg.kernels, cfg.attention)
