"""Chapter 5's demos before training: the untrained model's text and losses, and the toy vocabulary's
sampling (section 5.3). The pretraining run's own figures come from the pretrain stage's reports."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from gptlab.book.figures.ch4 import seeded_model
from gptlab.book.figures.inputs import FigureInputs, raw_dir, tokenizer, tokenizer_of
from gptlab.model.config import ModelConfig

__all__ = [
    "untrained_text",
    "two_example_batch",
    "uniform_loss",
    "toy_top_k",
    "toy_probabilities",
    "toy_next_word",
    "toy_sample_counts",
]

# Section 5.1.2's batch: "every effort moves" -> "effort moves you", "I really like" -> "really like chocolate".
INPUT_TEXTS = ("every effort moves", "I really like")
TARGET_TEXTS = (" effort moves you", " really like chocolate")

# Section 5.3.1's toy vocabulary and the next-token logits it draws from.
TOY_VOCAB = ("closer", "every", "effort", "forward", "inches", "moves", "pizza", "toward", "you")
TOY_LOGITS = (4.51, 0.89, -1.90, 6.75, 1.63, -1.62, -1.89, 6.28, 1.79)


def _chapter5_model(seed: int) -> Any:
    """GPT_CONFIG_124M with chapter 5's context of 256 tokens, built after `seed`."""
    return seeded_model(ModelConfig.from_preset("gpt2-small", context_length=256), seed)


def untrained_text(run: FigureInputs | None, prompt: str, max_new_tokens: int, seed: int) -> str:
    """Section 5.1.1: the untrained model's greedy continuation of the prompt, decoded."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.model.generate import generate

    bpe = tokenizer(run)
    ids = generate(_chapter5_model(seed), torch.tensor([bpe.encode(prompt)]), max_new_tokens)
    return bpe.decode(ids[0].tolist())


def two_example_batch(run: FigureInputs | None, seed: int, step: str) -> Any:
    """Section 5.1.2 on the untrained model: the token `ids` of inputs and targets, the argmax
    `predicted` ids, the `target_probabilities`, the `log_probabilities`, the cross entropy (`loss`,
    the pipeline's next-token loss) and its `perplexity`."""
    return _two_example_results(raw_dir(run), seed)[step]


@functools.cache
def _two_example_results(folder: Path, seed: int) -> dict[str, Any]:
    """One forward pass of the batch, every figure of the section from it."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.training.losses import next_token_loss, perplexity

    bpe = tokenizer_of(folder)
    inputs = torch.tensor([bpe.encode(text) for text in INPUT_TEXTS])
    targets = torch.tensor([bpe.encode(text) for text in TARGET_TEXTS])
    model = _chapter5_model(seed)
    with torch.no_grad():
        loss = next_token_loss(model, (inputs, targets)).item()
        probas = torch.softmax(model(inputs), dim=-1)  # (2, 3, vocab)
    target_probas = probas.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (2, 3)
    return {
        "ids": [inputs.tolist(), targets.tolist()],
        "predicted": probas.argmax(dim=-1).tolist(),
        "target_probabilities": target_probas.tolist(),
        "log_probabilities": torch.log(target_probas).flatten().tolist(),
        "loss": loss,
        "perplexity": perplexity(loss),
    }


def uniform_loss(run: FigureInputs | None) -> float:
    """ln(vocabulary size): the cross entropy of a model that spreads probability evenly."""
    return math.log(tokenizer(run).n_vocab)


def toy_top_k(run: FigureInputs | None, k: int) -> list[Any]:
    """[the top k logits, their positions, their words] of the toy logits (section 5.3.2)."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    values, positions = torch.topk(torch.tensor(TOY_LOGITS), k)
    return [values.tolist(), positions.tolist(), [TOY_VOCAB[i] for i in positions.tolist()]]


def toy_probabilities(run: FigureInputs | None, temperature: float, top_k: int | None = None) -> list[float]:
    """The toy distribution generate() samples from: top-k filtered, then temperature-scaled softmax."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.model.generate import next_token_probabilities

    return next_token_probabilities(torch.tensor(TOY_LOGITS), temperature, top_k).tolist()


def toy_next_word(run: FigureInputs | None, seed: int | None = None) -> str:
    """The toy vocabulary's next word: greedy (argmax) without a seed, else one multinomial draw after it."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    probas = torch.softmax(torch.tensor(TOY_LOGITS), dim=0)
    if seed is None:
        return TOY_VOCAB[int(torch.argmax(probas))]
    torch.manual_seed(seed)
    return TOY_VOCAB[int(torch.multinomial(probas, num_samples=1))]


def toy_sample_counts(run: FigureInputs | None, seed: int, draws: int, temperature: float = 1.0) -> list[int]:
    """How often each toy word comes up in `draws` single multinomial draws after `seed` (section 5.3.1)."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.model.generate import next_token_probabilities

    probas = next_token_probabilities(torch.tensor(TOY_LOGITS), temperature)
    torch.manual_seed(seed)
    samples = [int(torch.multinomial(probas, num_samples=1)) for _ in range(draws)]
    return torch.bincount(torch.tensor(samples), minlength=len(TOY_VOCAB)).tolist()
