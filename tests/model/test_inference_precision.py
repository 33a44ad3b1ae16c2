"""The opt-in inference precision: bf16 weights for `chat`, `classify`, the instruct answers and MLflow models.

The quality check: on a fixed prompt set, bf16 weights' logits stay within
LOGIT_BOUND of the fp32 logits' spread (their standard deviation), at every
position, for both kernels; and the commands answer with exactly what a bf16
copy of the model answers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from gptlab.cli.main import main as gptlab_main
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import load_model, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.kv_cache import KVCache
from gptlab.tasks.classifier import classify_texts
from gptlab.tasks.responses import generate_response
from gptlab.training.runtime import bf16_is_fast, inference_dtype
from tests.tracking.test_logged_models import tiny_classifier

# bf16 keeps 8 significant bits (relative error 2^-9 per rounding); through two blocks and the
# head the logits move by a few hundredths of their spread, far less than the bound.
LOGIT_BOUND = 0.1
PROMPTS = torch.randint(0, 50257, (4, 24), generator=torch.Generator().manual_seed(3))
MESSAGES = ["Free entry in 2 a wkly comp to win FA Cup final tkts 21st May 2005", "ok see you at dinner"]


def test_auto_means_bf16_exactly_where_bf16_is_fast() -> None:
    cpu = torch.device("cpu")
    assert inference_dtype(cpu, "fp32") == torch.float32
    assert inference_dtype(cpu, "bf16") == torch.bfloat16
    assert inference_dtype(cpu, "auto") == (torch.bfloat16 if bf16_is_fast(cpu) else torch.float32)


@pytest.mark.parametrize("kernels", ["book", "fused"])
def test_bf16_logits_stay_within_the_bound_of_fp32(kernels: str) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(context_length=32, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0, kernels=kernels)
    model = build_gpt(cfg).eval()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        full, half = model(PROMPTS), bf16(PROMPTS)
        # The decoding path too: the last token alone against the cached prefix (one row a step;
        # with kernels: fused, against the (in, out) weight copies).
        cache = KVCache(cfg.n_layers, PROMPTS.shape[1])
        bf16(PROMPTS[:1, :-1], cache)
        decoded = bf16(PROMPTS[:1, -1:], cache)[0, -1]
    assert half.dtype == decoded.dtype == torch.bfloat16
    difference = (half.float() - full).abs().max() / full.std()
    assert 0 < difference < LOGIT_BOUND  # not a no-op, and close
    assert (decoded.float() - full[0, -1]).abs().max() / full.std() < LOGIT_BOUND


def test_classify_with_bf16_weights_gives_the_bf16_copys_probabilities(
    tmp_path: Path, shared_data: Path, tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_classifier(tmp_path / "clf")
    args = ["classify", *MESSAGES, "--model", str(tmp_path / "clf"), "--raw-dir", str(shared_data), "--json"]

    assert gptlab_main([*args, "--precision", "bf16"]) == 0
    half_rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert gptlab_main(args) == 0
    full_rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        expected = classify_texts(bf16, tokenizer, MESSAGES, max_length=12, pooling="last")
    for half, full, probs in zip(half_rows, full_rows, expected, strict=True):
        assert half["probability"] == pytest.approx(float(probs.max()), abs=1e-6)
        assert half["probability"] == pytest.approx(full["probability"], abs=0.02)
    # The checkpoint on disk stays fp32.
    assert load_model(tmp_path / "clf")[0].out_head.weight.dtype == torch.float32


def test_chat_with_bf16_weights_answers_what_the_bf16_copy_answers(
    tmp_path: Path, shared_data: Path, tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(context_length=128, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0, kernels="fused")
    model = build_gpt(cfg).eval()
    save_model(model, tmp_path / "lm", {"source": "test"})
    entry = {"instruction": "Name a color.", "input": "", "output": ""}
    args = ["chat", entry["instruction"], "--model", str(tmp_path / "lm"), "--raw-dir", str(shared_data)]

    assert gptlab_main([*args, "--max-new-tokens", "6", "--precision", "bf16"]) == 0

    expected = generate_response(copy.deepcopy(model).to(torch.bfloat16), tokenizer, entry, max_new_tokens=6)
    assert capsys.readouterr().out == expected + "\n"


def test_an_unknown_precision_is_refused_by_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gptlab_main(["classify", "hi", "--precision", "fp16"])
    assert exit_info.value.code == 2
    assert "--precision: invalid choice: 'fp16'" in capsys.readouterr().err
