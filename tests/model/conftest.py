"""What the generation and KV-cache tests share: a tiny language model under both attentions, and prompts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel

from helpers import TINY_LM


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: these matrices are tiny, and extra threads only wait on a busy CPU (10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["sdpa", "masked_softmax"])
def model(request: pytest.FixtureRequest) -> GPTModel:
    torch.manual_seed(7)
    return build_gpt(ModelConfig(**TINY_LM, attention=request.param)).eval()


@pytest.fixture
def prompts() -> torch.Tensor:
    return torch.randint(0, TINY_LM["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(2))
