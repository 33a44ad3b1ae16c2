"""Checkpoints checked before use: finite weights and a config within the caps, refused in one line
naming the file (and the tensor or key) before a model is built or a label printed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptlab.cli.main import main
from gptlab.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, save_model
from gptlab.model.fast_kernels import build_gpt
from gptlab.tasks.classifier import make_classifier

from helpers import TINY_GPT, one_line_error


def _damage_tensor(folder: Path, name: str, value: float) -> None:
    """Overwrite the first values of one tensor of a saved checkpoint, as a bad disk or a diverged run would."""
    weights = load_file(str(folder / WEIGHTS_FILE))
    weights[name][:4] = value
    save_file(weights, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})


@pytest.fixture
def classifier(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = make_classifier(build_gpt(TINY_GPT), 2, trainable="head", trainable_blocks=1, seed=123).eval()
    metadata = {"labels": {"0": "ham", "1": "spam"}, "max_length": 8, "pooling": "last"}
    return save_model(model, tmp_path / "models" / "spam", metadata)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_classify_and_chat_refuse_weights_holding_nan_or_inf(
    classifier: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str], value: float
) -> None:
    _damage_tensor(classifier, "final_norm.scale", value)
    assert main(["classify", "--model", str(classifier), "You won a free prize"]) == 2
    line = one_line_error(capsys, "classify")
    assert str(classifier / WEIGHTS_FILE) in line and "final_norm.scale" in line
    assert "NaN or infinite" in line
    assert capsys.readouterr().out == ""  # no label printed
    _damage_tensor(checkpoint, "tok_emb.weight", value)
    assert main(["chat", "--model", str(checkpoint), "--max-new-tokens", "2", "Say hi"]) == 2
    line = one_line_error(capsys, "chat")
    assert str(checkpoint / WEIGHTS_FILE) in line and "tok_emb.weight" in line


def test_a_checkpoint_config_beyond_the_caps_is_refused_before_the_model_is_built(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads((checkpoint / CONFIG_FILE).read_text())
    # Cheapest first: without the caps, the 1000 small blocks are built, and refused only then.
    for key, value in (("n_layers", 1000), ("n_layers", 10**9), ("emb_dim", 10**7)):
        (checkpoint / CONFIG_FILE).write_text(
            json.dumps({**config, "model": {**config["model"], key: value}})
        )
        assert main(["classify", "--model", str(checkpoint), "hello"]) == 2
        line = one_line_error(capsys, "classify")
        assert str(checkpoint / CONFIG_FILE) in line and f"model.{key}: expected 1 to " in line
    many = {**config["model"], "emb_dim": 8192, "n_heads": 8, "n_layers": 256, "vocab_size": 50257}
    (checkpoint / CONFIG_FILE).write_text(json.dumps({**config, "model": many}))
    assert main(["classify", "--model", str(checkpoint), "hello"]) == 2
    assert "parameters, over the cap of 4,000,000,000" in one_line_error(capsys, "classify")
