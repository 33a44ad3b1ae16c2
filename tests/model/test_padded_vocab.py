"""pretrain.model.vocab_multiple: a padded head trains, scores and samples as the unpadded one, and saves the real rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import WEIGHTS_FILE, load_model, save_model
from gptlab.model.config import GPT2_VOCAB_SIZE, ModelConfig, ModelSpec
from gptlab.model.generate import generate
from gptlab.model.gpt import GPTModel
from gptlab.model.hf_gpt2 import HEAD, PREFIX, gptlab_to_hf
from gptlab.model.padded_vocab import PaddedVocabHead
from gptlab.schema import ConfigError, build
from gptlab.training.chunked_loss import chunked_next_token_loss
from gptlab.training.losses import next_token_loss
from gptlab.training.resume import meta_twin

# GPT-2's vocabulary at toy width: 50,257 rows pad to 50,304.
GPT2_ROWS = ModelConfig(context_length=8, emb_dim=8, n_heads=2, n_layers=1, drop_rate=0.0)
# A small vocabulary (97 rows pad to 128) for the losses, gradients and samples.
SMALL = ModelConfig(vocab_size=97, context_length=16, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
LOSSES = {"book": next_token_loss, "chunked": chunked_next_token_loss}


def built(cfg: ModelConfig, vocab_multiple: int | None = None, seed: int = 123) -> GPTModel:
    torch.manual_seed(seed)
    return build_gpt(cfg, vocab_multiple)


def batch(cfg: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.context_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def make_padded_rows_huge(model: GPTModel) -> None:
    with torch.no_grad():
        model.out_head.weight[model.cfg.vocab_size :] = 1e4


def test_null_builds_the_books_model_and_padding_draws_nothing() -> None:
    book = built(GPT2_ROWS)
    after_book = torch.get_rng_state()
    unpadded = built(GPT2_ROWS, None)
    assert type(unpadded.out_head) is nn.Linear and torch.equal(torch.get_rng_state(), after_book)
    padded = built(GPT2_ROWS, 64)
    assert torch.equal(torch.get_rng_state(), after_book)  # the same draws, nothing more
    head = padded.out_head
    assert isinstance(head, PaddedVocabHead) and head.weight.shape == (50304, 8)
    assert padded.tok_emb.weight.shape[0] == GPT2_VOCAB_SIZE  # only the head pads
    assert not head.weight[GPT2_VOCAB_SIZE:].any()
    for state in (unpadded.state_dict(), padded.state_dict()):
        assert list(state) == list(book.state_dict())
        for name, tensor in book.state_dict().items():
            assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("kernels", ["book", "fused"])
def test_loss_and_gradients_equal_the_unpadded_models_and_never_see_the_padded_logits(
    loss: str, kernels: str
) -> None:
    cfg = dataclasses.replace(SMALL, kernels=kernels)
    loss_fn, data = LOSSES[loss], batch(cfg)
    unpadded, padded = built(cfg), built(cfg, 64)
    assert padded.out_head.weight.shape[0] == 128
    expected = loss_fn(unpadded, data)
    expected.backward()
    got = loss_fn(padded, data)
    got.backward()
    torch.testing.assert_close(got, expected)
    grads = dict(padded.named_parameters())
    for name, parameter in unpadded.named_parameters():
        torch.testing.assert_close(grads[name].grad[: parameter.shape[0]], parameter.grad, msg=name)
    assert not padded.out_head.weight.grad[cfg.vocab_size :].any()  # the padded rows learn nothing
    # Huge padded rows would dominate any softmax they reached: the loss is the same bit for bit.
    make_padded_rows_huge(padded)
    with torch.no_grad():
        assert torch.equal(loss_fn(padded, data), got.detach())


@pytest.mark.parametrize("kernels", ["book", "fused"])
def test_greedy_samples_are_the_unpadded_models_and_never_a_padded_row(kernels: str) -> None:
    cfg = dataclasses.replace(SMALL, kernels=kernels)
    unpadded, padded = built(cfg).eval(), built(cfg, 64).eval()
    make_padded_rows_huge(padded)
    prompt = batch(cfg)[0][:2, :4]
    for use_cache in (True, False):
        expected = generate(unpadded, prompt, 10, use_cache=use_cache)
        assert torch.equal(generate(padded, prompt, 10, use_cache=use_cache), expected)
    torch.manual_seed(0)
    sampled = generate(padded, prompt, 10, temperature=2.0)  # flat: any row the sampler saw could come up
    assert sampled.max() < cfg.vocab_size
    with torch.no_grad():
        logits = padded(prompt)
    assert logits.shape[-1] == cfg.vocab_size and logits.abs().max() < 1e3


def test_training_keeps_the_padded_rows_at_zero_and_the_real_weights_with_the_unpadded_run() -> None:
    cfg = dataclasses.replace(SMALL, kernels="fused")
    models = built(cfg), built(cfg, 64)
    for model in models:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        for step in range(3):
            optimizer.zero_grad()
            chunked_next_token_loss(model, batch(cfg, seed=step)).backward()
            optimizer.step()
    unpadded, padded = models
    assert not padded.out_head.weight[cfg.vocab_size :].any()
    trained = padded.state_dict()
    for name, tensor in unpadded.state_dict().items():
        torch.testing.assert_close(trained[name], tensor, msg=name)


def test_checkpoints_exports_and_resumes_hold_the_real_vocabulary(tmp_path: Path) -> None:
    padded = built(GPT2_ROWS, 64).eval()
    with torch.no_grad():
        padded.out_head.weight.normal_()  # a trained head: every real row its own
    real_head = padded.out_head.weight[:GPT2_VOCAB_SIZE].detach().clone()
    folder = save_model(padded, tmp_path / "model")
    assert load_file(str(folder / WEIGHTS_FILE))["out_head.weight"].shape == (GPT2_VOCAB_SIZE, 8)
    loaded, _ = load_model(folder)
    assert type(loaded.out_head) is nn.Linear and torch.equal(loaded.out_head.weight, real_head)
    ids = batch(GPT2_ROWS)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), padded(ids))
    exported = gptlab_to_hf(padded)
    assert exported[HEAD].shape == exported[PREFIX + "wte.weight"].shape == (GPT2_VOCAB_SIZE, 8)
    # A resumed run loads the real rows back into a padded head (resume.py's twin and in place).
    state = padded.state_dict()
    for target, assign in ((meta_twin(padded), True), (built(GPT2_ROWS, 64, seed=7), False)):
        target.load_state_dict(state, assign=assign)
        weight = target.out_head.weight
        assert weight.shape == (50304, 8) and torch.equal(weight[:GPT2_VOCAB_SIZE], real_head)
        assert not weight[GPT2_VOCAB_SIZE:].any()


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (0, "expected a positive integer or null, got 0"),
        (-64, "expected a positive integer or null, got -64"),
        (4096, "expected 1 to 1024 or null, got 4096"),
        ("64", "expected an integer or null, got '64'"),
    ],
)
def test_vocab_multiple_is_a_positive_integer_or_null(value: object, problem: str) -> None:
    spec = {
        "preset": "gpt2-small",
        "context_length": 32,
        "drop_rate": 0.1,
        "qkv_bias": False,
        "attention": "sdpa",
        "kernels": "fused",
    }
    assert build(ModelSpec, {**spec, "vocab_multiple": None}, "pretrain.model").vocab_multiple is None
    assert build(ModelSpec, {**spec, "vocab_multiple": 64}, "pretrain.model").vocab_multiple == 64
    with pytest.raises(ConfigError) as refused:
        build(ModelSpec, {**spec, "vocab_multiple": value}, "pretrain.model")
    assert str(refused.value) == f"pretrain.model.vocab_multiple: {problem}"
