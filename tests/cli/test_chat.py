"""`gptlab chat`: the input is cropped, never the template; the answer is capped at the context;
an empty answer or an instruction longer than the context says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gptlab.cli.main import main
from gptlab.data.instruct import PREAMBLE
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import load_model, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.tasks import responses

from helpers import one_line_error, snapshot

CHAT_CONTEXT = 96


@pytest.fixture
def chat_model(tmp_path: Path) -> Path:
    """A tiny language model over GPT-2's vocabulary that never says end-of-text (answers run to the cap)."""
    torch.manual_seed(0)
    model = build_gpt(
        ModelConfig(context_length=CHAT_CONTEXT, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)
    )
    with torch.no_grad():  # the final norm outputs a fixed vector that the head maps to ","
        model.final_norm.scale.zero_()
        model.final_norm.shift.zero_()
        model.final_norm.shift[0] = 1.0
        model.out_head.weight.zero_()
        model.out_head.weight[11, 0] = 1.0  # "," is id 11
    return save_model(model.eval(), tmp_path / "instruct")


@pytest.fixture
def generate_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, int]]:
    calls: list[tuple[torch.Tensor, int]] = []
    real = responses.generate

    def spy(model: GPTModel, idx: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
        calls.append((idx.clone(), max_new_tokens))
        return real(model, idx, max_new_tokens, **kwargs)

    monkeypatch.setattr(responses, "generate", spy)
    return calls


def chat(model: Path, shared_data: Path, *args: str) -> int:
    return main(["chat", *args, "--model", str(model), "--raw-dir", str(shared_data)])


def test_chat_long_input_is_cropped_not_the_instruction(
    chat_model: Path,
    shared_data: Path,
    tokenizer: Any,
    capsys: pytest.CaptureFixture[str],
    generate_calls: list[tuple[torch.Tensor, int]],
) -> None:
    instruction = "Summarize the text."
    long_input = " ".join(f"word{i}" for i in range(400))
    before = snapshot(chat_model)

    assert chat(chat_model, shared_data, instruction, "--input", long_input, "--max-new-tokens", "20") == 0

    out, err = capsys.readouterr()
    assert out.strip().startswith(",")  # the model's answer
    assert "warning" in err and "input" in err and "cropped" in err and "Traceback" not in err
    ((idx, max_new),) = generate_calls
    prompt = tokenizer.decode(idx[0].tolist())
    assert prompt.startswith(f"{PREAMBLE}\n\n### Instruction:\n{instruction}\n\n### Input:\nword0 word1")
    assert idx.shape[1] + max_new <= CHAT_CONTEXT  # nothing slides out of the window
    assert max_new == 20  # the answer's room was kept; the input gave way
    assert snapshot(chat_model) == before


def test_chat_huge_max_new_tokens_is_capped(
    chat_model: Path,
    shared_data: Path,
    capsys: pytest.CaptureFixture[str],
    generate_calls: list[tuple[torch.Tensor, int]],
) -> None:
    assert chat(chat_model, shared_data, "Say something.", "--max-new-tokens", "10000") == 0
    err = capsys.readouterr().err
    ((idx, max_new),) = generate_calls
    assert idx.shape[1] + max_new == CHAT_CONTEXT
    assert f"--max-new-tokens 10000 capped at {max_new}" in err


@pytest.mark.parametrize(
    ("stage", "knob"),
    [("instruct-finetune", "instruct.train.epochs"), ("preference-finetune", "preference.train.epochs")],
)
def test_chat_empty_answer_says_why_naming_its_own_stages_knob(
    chat_model: Path, shared_data: Path, capsys: pytest.CaptureFixture[str], stage: str, knob: str
) -> None:
    model, metadata = load_model(chat_model)
    with torch.no_grad():  # the fixed vector now maps to end-of-text: the answer ends before it starts
        model.out_head.weight.zero_()
        model.out_head.weight[50256, 0] = 1.0
    save_model(model, chat_model, {**metadata, "steps": 3, "stage": stage})
    assert chat(chat_model, shared_data, "Name a color.", "--max-new-tokens", "5") == 0
    out, err = capsys.readouterr()
    assert out == "\n"
    assert "warning: the model answered nothing after 3 training steps" in err and "train it longer" in err
    assert f"({knob})" in err


def test_chat_instruction_longer_than_context_is_refused(
    chat_model: Path,
    shared_data: Path,
    capsys: pytest.CaptureFixture[str],
    generate_calls: list[tuple[torch.Tensor, int]],
) -> None:
    instruction = "Explain " + " ".join(["this"] * 200)
    assert chat(chat_model, shared_data, instruction, "--max-new-tokens", "5") == 2
    line = one_line_error(capsys, "chat")
    assert "instruction" in line and str(CHAT_CONTEXT) in line
    assert generate_calls == []


def test_chat_reads_gpt2s_files_from_the_mirror_without_raw_dir(
    chat_model: Path,
    shared_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No download stage has run here (no data/raw): GPTLAB_MIRROR holds the BPE files, as for the stages."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPTLAB_MIRROR", str(shared_data))
    args = ["chat", "Name a color.", "--model", str(chat_model), "--max-new-tokens", "3"]
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == ",,,"
    monkeypatch.delenv("GPTLAB_MIRROR")
    assert main(args) == 2
    line = one_line_error(capsys, "chat")
    assert "data/raw/gpt2/vocab.bpe not found" in line and "GPTLAB_MIRROR" in line
