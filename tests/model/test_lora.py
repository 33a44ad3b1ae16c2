"""LoRA as appendix E builds it: frozen base, the book's trainable count, B = 0, merge and export parity."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import GPT2LMHeadModel

from gptlab.model import checkpoint
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import load_model, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.model.hf_gpt2 import export_checkpoint
from gptlab.model.lora import (
    LinearWithLoRA,
    LoRALayer,
    add_lora,
    has_lora,
    lora_parameter_count,
    merge_lora,
    replace_linear_with_lora,
)
from gptlab.tasks.classifier import class_logits, count_trainable, make_classifier
from gptlab.training.loop import fit
from gptlab.training.losses import next_token_loss
from tests.training.test_train import TRAIN

from helpers import checkpoint_config

TINY = ModelConfig(vocab_size=300, context_length=32, emb_dim=32, n_heads=2, n_layers=2, qkv_bias=True)
# Per block: W_query, W_key, W_value, out_proj (d -> d) and the feed-forward's d -> 4d -> d.
LINEARS_PER_BLOCK = 6


def tiny_model(seed: int = 0, cfg: ModelConfig = TINY) -> GPTModel:
    torch.manual_seed(seed)
    return build_gpt(cfg).eval()


def randomize_b(model: nn.Module, seed: int = 1) -> None:
    """As if trained: every B random, so the adapters change the function."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALayer):
                module.B.copy_(torch.randn(module.B.shape, generator=generator) * 0.05)


def ids(n: int = 2, t: int = 32, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (n, t), generator=torch.Generator().manual_seed(seed))


def expected_lora_count(cfg: ModelConfig, rank: int, head_out: int) -> int:
    d = cfg.emb_dim
    per_block = 4 * rank * (d + d) + rank * (d + 4 * d) + rank * (4 * d + d)
    return cfg.n_layers * per_block + rank * (d + head_out)


def test_lora_layer_is_the_books() -> None:
    torch.manual_seed(123)
    layer = LoRALayer(24, 10, rank=4, alpha=8)
    torch.manual_seed(123)
    expected_a = torch.empty(24, 4)
    nn.init.kaiming_uniform_(expected_a, a=math.sqrt(5))
    assert torch.equal(layer.A, expected_a)  # A: nn.Linear's own initialisation, as the book's
    assert layer.B.shape == (4, 10) and not layer.B.any()  # B: zeros
    layer.B.data.normal_()
    x = torch.randn(3, 24)
    torch.testing.assert_close(layer(x), (8 / 4) * (x @ layer.A @ layer.B))  # alpha / rank, listing E.5


def test_every_linear_is_wrapped_and_only_the_adapters_train() -> None:
    model = tiny_model()
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == LINEARS_PER_BLOCK * TINY.n_layers + 1  # + the output head
    add_lora(model, rank=4, alpha=4)
    wrapped = {name for name, m in model.named_modules() if isinstance(m, LinearWithLoRA)}
    assert wrapped == set(linears)
    assert not any(isinstance(m, nn.Linear) and name in linears for name, m in model.named_modules())
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(name.endswith((".lora.A", ".lora.B")) for name in trainable)
    assert count_trainable(model) == lora_parameter_count(model) == expected_lora_count(TINY, 4, 300)

    # Gradients reach the adapters only: the base weights stay frozen through a step.
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss = next_token_loss(model.train(), (ids(), ids(seed=4)))
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n in base)
    optimizer.step()
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    with pytest.raises(ValueError, match="already has LoRA"):
        add_lora(model, rank=4, alpha=4)


def test_gpt2_small_trainable_counts_at_rank_16() -> None:
    """The book's appendix E: 124,441,346 trainable before, 0 frozen, 2,666,528 with LoRA (rank 16)."""
    cfg = ModelConfig.from_preset("gpt2-small", context_length=1024, qkv_bias=True)
    with torch.device("meta"):  # shapes only: no memory
        classifier = build_gpt(cfg)
        classifier.out_head = nn.Linear(cfg.emb_dim, 2)  # the book's new head, trainable as created
        assert count_trainable(classifier) == 124_441_346
        add_lora(classifier, rank=16, alpha=16)
        assert count_trainable(classifier) == lora_parameter_count(classifier) == 2_666_528

        # The same adapters on the language model (the instruction fine-tune): its head is 768 -> 50,257.
        language_model = build_gpt(cfg)
        add_lora(language_model, rank=16, alpha=16)
        assert count_trainable(language_model) == 3_470_608
        assert count_trainable(language_model) == expected_lora_count(cfg, 16, cfg.vocab_size)


def test_zero_b_gives_the_base_models_logits_exactly() -> None:
    model = tiny_model()
    before = model(ids())
    add_lora(model, rank=8, alpha=16)
    assert torch.equal(model(ids()), before)

    base = make_classifier(tiny_model(), 2, trainable="lora", trainable_blocks=1, seed=123).eval()
    scores = class_logits(base, ids())
    assert count_trainable(base) == 0  # `lora` freezes everything, the new head too
    add_lora(base, rank=8, alpha=16)
    assert torch.equal(class_logits(base, ids()), scores)


def test_merge_folds_the_update_into_plain_linears() -> None:
    model = tiny_model()
    plain_names = set(model.state_dict())
    add_lora(model, rank=4, alpha=8)
    randomize_b(model)
    unmerged = model(ids()).detach()
    assert not torch.allclose(unmerged, tiny_model()(ids()), atol=1e-3)  # the adapters matter

    merge_lora(model)
    assert not has_lora(model)
    assert set(model.state_dict()) == plain_names  # GPT-2's tensor names again
    torch.testing.assert_close(model(ids()), unmerged, rtol=0, atol=1e-5)


def test_merged_lora_exports_to_transformers_with_the_unmerged_logits(tmp_path: Path) -> None:
    """The saved (merged) model through `gptlab export`: transformers gives the unmerged model's logits."""
    model = tiny_model()
    add_lora(model, rank=4, alpha=8)
    randomize_b(model)
    unmerged = model(ids()).detach()

    save_model(merge_lora(model), tmp_path / "ckpt", {"lora": {"rank": 4, "alpha": 8, "merged": True}})
    reloaded, _ = load_model(tmp_path / "ckpt")  # a plain checkpoint: classify, chat, MLflow read it as is
    torch.testing.assert_close(reloaded(ids()), unmerged, rtol=0, atol=1e-5)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids()).logits, unmerged, rtol=0, atol=1e-5)


def test_replace_linear_with_lora_recurses_like_the_books() -> None:
    net = nn.Sequential(nn.Linear(4, 5), nn.Sequential(nn.ReLU(), nn.Linear(5, 3)))
    replace_linear_with_lora(net, rank=2, alpha=2)
    assert isinstance(net[0], LinearWithLoRA) and isinstance(net[1][1], LinearWithLoRA)
    assert net[0].linear.weight.requires_grad  # freezing is add_lora's, as in the book


@pytest.mark.slow
def test_training_with_lora_checkpoints_and_resumes(tmp_path: Path) -> None:
    """The resumable training checkpoints hold the adapters; a rerun resumes from them exactly."""
    cfg = dataclasses.replace(TRAIN, batch_size=2, lr=1e-2, eval_iter=1)
    every_2 = checkpoint_config(every_steps=2, keep=5)
    data = torch.utils.data.TensorDataset(ids(8, 16, seed=5), ids(8, 16, seed=6))
    val = torch.utils.data.TensorDataset(ids(2, 16, seed=8), ids(2, 16, seed=9))

    def lora_model() -> GPTModel:
        model = tiny_model()
        torch.manual_seed(11)
        return add_lora(model, rank=4, alpha=8)

    reference = lora_model()
    run_dir = tmp_path / "run"
    full = fit(reference, data, val, cfg=cfg, checkpoints=every_2, loss_fn=next_token_loss, run_dir=run_dir)
    checkpoints = checkpoint.list_checkpoints(run_dir)
    assert [p.name for p in checkpoints] == ["step-0000002", "step-0000004", "step-0000006", "step-0000008"]
    weights = checkpoint.load_training_checkpoint(checkpoints[0])[0]
    assert any(name.endswith(".lora.B") for name in weights)  # the adapters, not merged weights
    for path in checkpoints[1:]:  # as if killed after step 2
        shutil.rmtree(path)

    resumed_model = lora_model()
    resumed = fit(
        resumed_model, data, val, cfg=cfg, checkpoints=every_2, loss_fn=next_token_loss, run_dir=run_dir
    )
    assert resumed.resumed_steps == 2
    assert resumed.history == full.history
    for (name, a), b in zip(resumed_model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
