"""The fast profile's kernels against the book's: fused model kernels, the chunked loss, precision auto."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.dropout import Dropout, dropout, keep_mask
from gptlab.model.fast_kernels import DecodeLinear, FusedQKVAttention, with_kernels
from gptlab.model.generate import generate
from gptlab.model.gpt import GPTModel, MultiHeadAttention
from gptlab.training import chunked_loss
from gptlab.training.chunked_loss import (
    chunked_next_token_loss,
    language_model_loss,
    linear_cross_entropy,
)
from gptlab.training.compilation import COMPILE_CACHE
from gptlab.training.losses import IGNORE_INDEX, next_token_loss
from gptlab.training.runtime import bf16_is_fast, resolve_precision
from tests.training.test_train import TRAIN, run_fit

SMALL = ModelConfig(vocab_size=503, context_length=64, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0)


def twin_models(**overrides: object) -> tuple[GPTModel, GPTModel]:
    """The same weights under the book's kernels and the fused ones."""
    torch.manual_seed(123)
    book = build_gpt(dataclasses.replace(SMALL, **overrides)).eval()
    fused = build_gpt(dataclasses.replace(book.cfg, kernels="fused")).eval()
    fused.load_state_dict(book.state_dict())
    return book, fused


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_fused_kernels_give_the_books_logits_and_greedy_tokens(qkv_bias: bool) -> None:
    book, fused = twin_models(qkv_bias=qkv_bias)
    assert list(book.state_dict()) == list(fused.state_dict())  # same names: checkpoints and HF conversion
    ids = torch.randint(0, SMALL.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), book(ids), atol=1e-5, rtol=0)
    prompt = ids[:1, :5]
    assert torch.equal(generate(fused, prompt, 20), generate(book, prompt, 20))


def decoding_weights(model: GPTModel) -> list[torch.Tensor]:
    """The (in, out) copies its decoding steps multiply by: one for each attention's Q/K/V, one a layer else."""
    attentions = [m for m in model.modules() if isinstance(m, FusedQKVAttention)]
    qkv = {id(p) for att in attentions for p in (att.W_query, att.W_key, att.W_value)}
    projections = [att.decoding_qkv() for att in attentions]
    projections += [
        m.decoding_projection() for m in model.modules() if type(m) is DecodeLinear and id(m) not in qkv
    ]
    return [p.weight_t for p in projections]


def test_decoding_steps_follow_every_change_of_the_weights() -> None:
    """The (in, out) copies a decoding step uses are remade after an in-place update, a load, a move."""
    book, fused = twin_models()
    token = torch.tensor([[7]])
    with torch.inference_mode():
        before = fused(token)  # builds the copies
        torch.testing.assert_close(before, book(token), atol=1e-5, rtol=0)
    copies = decoding_weights(fused)
    for model in (book, fused):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.5)  # in place, as an optimizer step
    with torch.inference_mode():
        torch.testing.assert_close(fused(token), book(token), atol=1e-5, rtol=0)
        assert not torch.allclose(fused(token), before, atol=1e-3)
    # Rewritten in place: no new memory to fault in at every epoch-end sample.
    refreshed = decoding_weights(fused)
    assert copies and all(a is b for a, b in zip(copies, refreshed, strict=True))
    fused.load_state_dict(twin_models()[0].state_dict())
    with torch.inference_mode():
        torch.testing.assert_close(fused(token), before, atol=1e-5, rtol=0)
        torch.testing.assert_close(fused.double()(token), before.double(), atol=1e-5, rtol=0)


def test_fused_kernels_train_to_the_books_gradients() -> None:
    book, fused = twin_models()
    ids = torch.randint(0, SMALL.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    batch = (ids[:, :-1], ids[:, 1:])
    for model in (book, fused):
        next_token_loss(model.train(), batch).backward()
    for (name, p_book), p_fused in zip(book.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(p_fused.grad, p_book.grad, atol=1e-5, rtol=1e-4, msg=name)


class Scaled(nn.Module):
    """A stand-in for a LoRA wrapper: it replaces a Linear and changes what the projection computes."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.linear(x)


def test_wrapped_projections_are_not_fused_away() -> None:
    book, fused = twin_models()
    for model in (book, fused):
        model.trf_blocks[0].att.W_key = Scaled(model.trf_blocks[0].att.W_key)
    ids = torch.randint(0, SMALL.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), book(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("rows_per_chunk", "vocab_block"), [(None, None), (10, None), (None, 64), (10, 64)])
def test_chunked_loss_equals_cross_entropy_with_ignored_rows(
    rows_per_chunk: int | None, vocab_block: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One chunk (the default's size), 37 rows in chunks of 10 (the last one short), each with the
    vocabulary of 211 in one block or in blocks of 64 (the last one short)."""
    rows = 37
    if rows_per_chunk is not None:
        monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 211 * rows_per_chunk)
    if vocab_block is not None:
        monkeypatch.setattr(chunked_loss, "VOCAB_BLOCK", vocab_block)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(rows, 16, generator=generator, requires_grad=True)
    weight = torch.randn(211, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 211, (rows,), generator=generator)
    targets[::3] = IGNORE_INDEX
    (2 * linear_cross_entropy(hidden, weight, targets)).backward()  # grad_output 2 is passed through
    chunked = (hidden.grad, weight.grad)
    hidden.grad = weight.grad = None
    reference = F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE_INDEX)
    (2 * reference).backward()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets), reference)
    torch.testing.assert_close(chunked[0], hidden.grad)
    torch.testing.assert_close(chunked[1], weight.grad)


@pytest.mark.slow
def test_chunked_loss_compiles_as_one_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.compile with the chunked loss: no graph break (fullgraph raises on one), the eager gradients."""
    torch._dynamo.reset()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    _, model = twin_models()
    ids = torch.randint(0, SMALL.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4))
    batch = (ids[:, :-1], ids[:, 1:])
    (2 * torch.compile(chunked_next_token_loss, fullgraph=True)(model, batch)).backward()
    compiled = [parameter.grad for parameter in model.parameters()]
    model.zero_grad(set_to_none=True)
    (2 * chunked_next_token_loss(model, batch)).backward()
    for grad, parameter in zip(compiled, model.parameters(), strict=True):
        torch.testing.assert_close(grad, parameter.grad)
    torch._dynamo.reset()


def test_chunks_of_gpt2s_vocabulary_hold_a_multiple_of_the_alignment(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's 50,257 logits a token: 640 tokens a chunk (not 667), within the logits' budget."""
    tokens = chunked_loss._chunk_tokens(50257)
    assert tokens % chunked_loss.CHUNK_ALIGN == 0
    assert tokens * 50257 <= chunked_loss.CHUNK_LOGITS < (tokens + chunked_loss.CHUNK_ALIGN) * 50257
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 211 * 10)  # below the alignment: as many as fit
    assert chunked_loss._chunk_tokens(211) == 10
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 211 * 70)  # 64 tokens a chunk: 37 + 70 rows in two
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(107, 16, generator=generator)
    weight = torch.randn(211, 16, generator=generator)
    targets = torch.randint(0, 211, (107,), generator=generator)
    torch.testing.assert_close(
        linear_cross_entropy(hidden, weight, targets), F.cross_entropy(hidden @ weight.T, targets)
    )


@pytest.mark.parametrize(("rows_per_chunk", "vocab_block"), [(None, None), (10, 64)])
def test_chunked_loss_under_bf16_autocast_matches_cross_entropy_under_it(
    rows_per_chunk: int | None, vocab_block: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The casts done once per call give what autocast's per-op casts give, within bf16's rounding."""
    if rows_per_chunk is not None:
        monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 211 * rows_per_chunk)
    if vocab_block is not None:
        monkeypatch.setattr(chunked_loss, "VOCAB_BLOCK", vocab_block)
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = torch.randn(211, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 211, (37,), generator=generator)
    grads = []
    for loss_of in (
        lambda: linear_cross_entropy(hidden, weight, targets),
        lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets),
    ):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of()
        loss.backward()
        grads.append((loss.detach(), hidden.grad, weight.grad))
        hidden.grad = weight.grad = None
    (loss_c, hidden_c, weight_c), (loss_r, hidden_r, weight_r) = grads
    assert hidden_c.dtype == hidden.dtype and weight_c.dtype == weight.dtype
    torch.testing.assert_close(loss_c, loss_r, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(hidden_c, hidden_r, atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(weight_c, weight_r, atol=2e-3, rtol=2e-2)


def test_chunked_loss_of_only_ignored_targets_is_nan_like_cross_entropy() -> None:
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    targets = torch.full((4,), IGNORE_INDEX)
    assert torch.isnan(linear_cross_entropy(hidden, weight, targets))
    assert torch.isnan(F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE_INDEX))


def test_chunked_next_token_loss_on_the_model_and_its_fallback() -> None:
    assert language_model_loss("book") is next_token_loss
    assert language_model_loss("chunked") is chunked_next_token_loss
    book, _ = twin_models()
    ids = torch.randint(0, SMALL.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4))
    batch = (ids[:, :-1], ids[:, 1:])
    chunked = chunked_next_token_loss(book, batch)
    reference = next_token_loss(book, batch)
    torch.testing.assert_close(chunked, reference)
    torch.manual_seed(0)
    classifier = build_gpt(dataclasses.replace(SMALL, num_classes=3)).eval()
    labels = torch.randint(0, 3, (2, 32), generator=torch.Generator().manual_seed(5))
    # A classifier head falls back to the plain loss instead of failing.
    assert torch.equal(
        chunked_next_token_loss(classifier, (ids[:, :-1], labels)),
        next_token_loss(classifier, (ids[:, :-1], labels)),
    )


def test_precision_auto_resolves_by_hardware() -> None:
    cpu = torch.device("cpu")
    assert resolve_precision(cpu, "fp32") == "fp32" and resolve_precision(cpu, "bf16") == "bf16"
    has_bf16 = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    fast = has_bf16 and torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert bf16_is_fast(cpu) == fast
    assert resolve_precision(cpu, "auto") == ("bf16" if fast else "fp32")


def test_precision_auto_is_fp32_where_torch_is_held_to_avx2() -> None:
    """On an AVX-512 BF16 or AMX CPU too: held to AVX2 kernels, torch emulates bf16, 6x slower."""
    code = (
        "import torch; from gptlab.training.runtime import resolve_precision; "
        "print(torch.backends.cpu.get_cpu_capability(), resolve_precision(torch.device('cpu'), 'auto'))"
    )
    held = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=held, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["AVX2", "fp32"]


@pytest.mark.slow  # torch.compile, or a training run: seconds each
def test_fit_with_the_fast_settings_trains(tmp_path: Path) -> None:
    """precision auto and the chunked loss run through the real training loop, resumable as ever."""
    cfg = dataclasses.replace(TRAIN, precision="auto", loss_kernel="chunked", max_steps=4)
    _, result = run_fit(tmp_path, cfg, loss_fn=chunked_next_token_loss)
    assert result.steps == 4
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]


@pytest.mark.slow  # torch.compile, or a training run: seconds each
@pytest.mark.parametrize("named", [None, "own-cache"])
def test_compiled_code_is_cached_in_the_project_unless_the_user_names_a_folder(
    tmp_path: Path, named: str | None
) -> None:
    """In a fresh process, as a stage starts: inductor's default folder in /tmp is not kept."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if named is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / named)
    code = (
        "import os; from gptlab.training.compilation import CompiledOrEager; "
        "CompiledOrEager(lambda model, batch: None); print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    expected = tmp_path / named if named is not None else (tmp_path / COMPILE_CACHE).resolve()
    assert shown.stdout.strip() == str(expected)


@pytest.mark.slow  # torch.compile, or a training run: seconds each
def test_a_compile_that_fails_trains_eager_after_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A machine without a working C++ compiler: inductor fails, the run goes on eager."""
    torch._dynamo.reset()  # nothing compiled earlier in this process may stand in for the compile
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    with torch._inductor.config.patch({"cpp.cxx": (str(tmp_path / "no-such-compiler"),)}):
        _, result = run_fit(tmp_path / "run", dataclasses.replace(TRAIN, max_steps=3, compile=True))
    torch._dynamo.reset()
    assert result.steps == 3
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.compile:")]
    assert len(lines) == 1 and "torch.compile failed, training eager instead" in lines[0], lines


@pytest.mark.slow
def test_fit_compiled_matches_the_eager_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """...and keeps its compiled code in the project's git-ignored compile cache."""
    torch._dynamo.reset()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = dataclasses.replace(TRAIN, max_steps=3)
    _, eager = run_fit(tmp_path / "eager", cfg)
    _, compiled = run_fit(tmp_path / "compiled", dataclasses.replace(cfg, compile=True))
    # Compiled dropout draws its own masks, so the runs agree closely but not exactly.
    for a, b in zip(eager.history, compiled.history, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=0.1)
    assert compiled.history[-1]["train_loss"] < compiled.history[0]["train_loss"]
    torch._dynamo.reset()
    assert any((tmp_path / COMPILE_CACHE).rglob("*")), "nothing in the compile cache"
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == (tmp_path / COMPILE_CACHE).resolve()


def test_keep_mask_keeps_one_minus_p_of_the_elements_from_the_seeded_generator() -> None:
    torch.manual_seed(5)
    mask = keep_mask(torch.Size([1000, 1000]), 0.1)
    assert mask.dtype == torch.bool and mask.shape == (1000, 1000)
    # 1e6 draws: the kept share's standard deviation is 3e-4; p is 6554 / 2^16 = 0.100006.
    assert float(mask.float().mean()) == pytest.approx(1 - 6554 / 2**16, abs=2e-3)
    # Independent along both axes: no row or column stands out.
    assert float(mask.float().mean(0).std()) == pytest.approx(0.3 / 1000**0.5, rel=0.2)
    assert float(mask.float().mean(1).std()) == pytest.approx(0.3 / 1000**0.5, rel=0.2)
    torch.manual_seed(5)
    assert torch.equal(keep_mask(torch.Size([1000, 1000]), 0.1), mask)
    assert not torch.equal(keep_mask(torch.Size([1000, 1000]), 0.1), mask)
    assert float(keep_mask(torch.Size([7, 3]), 0.5).float().mean()) < 1  # an odd count, p = 1/2


def test_dropout_zeroes_the_dropped_scales_the_kept_and_passes_their_gradients() -> None:
    x = torch.randn(64, 33, requires_grad=True)
    torch.manual_seed(1)
    y = dropout(x, 0.25, training=True)
    torch.manual_seed(1)
    keep = keep_mask(x.shape, 0.25)
    torch.testing.assert_close(y, torch.where(keep, x / 0.75, 0), rtol=1e-6, atol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, keep / 0.75)
    assert dropout(x, 0.25, training=False) is x
    torch.testing.assert_close(Dropout(0.25).eval()(x), x)


def test_fused_attention_in_training_drops_its_weights_with_keep_mask() -> None:
    """SDPA's internal mask is bernoulli_'s: in training on the CPU the fused model uses keep_mask's."""
    torch.manual_seed(0)
    attention = with_kernels(
        MultiHeadAttention(32, 32, dropout=0.2, num_heads=4), kernels="fused", attention="sdpa"
    ).train()
    x = torch.randn(2, 9, 32, requires_grad=True)
    torch.manual_seed(3)
    out = attention(x)
    (grad_x,) = torch.autograd.grad(out.square().sum(), x)
    torch.manual_seed(3)
    q, k, v = (
        p(x).view(2, 9, 4, 8).transpose(1, 2) for p in (attention.W_query, attention.W_key, attention.W_value)
    )
    scores = (q @ k.transpose(2, 3)).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -torch.inf)
    weights = torch.softmax(scores / 8**0.5, dim=-1) * keep_mask(scores.shape, 0.2) / 0.8
    expected = attention.out_proj((weights @ v).transpose(1, 2).reshape(2, 9, 32))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    # The mask and scale inside one baddbmm pass the same gradients back.
    torch.testing.assert_close(
        grad_x, torch.autograd.grad(expected.square().sum(), x)[0], atol=1e-5, rtol=1e-4
    )
    x = x.detach()
    with torch.no_grad():  # in eval mode: SDPA without dropout, the masked softmax's result
        torch.testing.assert_close(
            attention.eval()(x),
            attention.out_proj(
                (torch.softmax(scores / 8**0.5, dim=-1) @ v).transpose(1, 2).reshape(2, 9, 32)
            ),
            atol=1e-6,
            rtol=1e-5,
        )
