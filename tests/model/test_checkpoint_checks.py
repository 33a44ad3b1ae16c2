"""Checkpoints checked before use: files as their manifest recorded them, finite weights and a config
within the caps, refused in one line naming the file (and the tensor or key) before a model is built
or a label printed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptlab.cli.main import main
from gptlab.files import sha256_file
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    load_model,
    save_model,
    write_model_manifest,
)
from gptlab.tasks.classifier import make_classifier

from helpers import TINY_GPT, flip_tensor_bits, one_line_error


def _damage_tensor(folder: Path, name: str, value: float) -> None:
    """Overwrite the first values of one tensor of a saved checkpoint, as a diverged run would save them."""
    weights = load_file(str(folder / WEIGHTS_FILE))
    weights[name][:4] = value
    save_file(weights, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    write_model_manifest(folder)  # saved so: only the values tell


@pytest.fixture
def classifier(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = make_classifier(build_gpt(TINY_GPT), 2, trainable="head", trainable_blocks=1, seed=123).eval()
    metadata = {
        "labels": {"0": "ham", "1": "spam"},
        "max_length": 8,
        "pooling": "last",
        "stage": "spam-finetune",
    }
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
        write_model_manifest(checkpoint)  # written so: only the caps tell
        assert main(["classify", "--model", str(checkpoint), "hello"]) == 2
        line = one_line_error(capsys, "classify")
        assert str(checkpoint / CONFIG_FILE) in line and f"model.{key}: expected 1 to " in line
    many = {**config["model"], "emb_dim": 8192, "n_heads": 8, "n_layers": 256, "vocab_size": 50257}
    (checkpoint / CONFIG_FILE).write_text(json.dumps({**config, "model": many}))
    write_model_manifest(checkpoint)
    assert main(["classify", "--model", str(checkpoint), "hello"]) == 2
    assert "parameters, over the cap of 4,000,000,000" in one_line_error(capsys, "classify")


def test_an_intact_model_folder_records_each_files_sha256_and_loads(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    files = (CONFIG_FILE, WEIGHTS_FILE)
    assert manifest["sha256"] == {name: sha256_file(checkpoint / name) for name in files}  # as sha256sum
    assert manifest["sizes"] == {name: (checkpoint / name).stat().st_size for name in files}
    model, metadata = load_model(checkpoint)
    assert model.cfg == TINY_GPT and metadata == {"stage": "pretrain"}


def test_classify_chat_and_export_refuse_finite_bit_flips_naming_the_file(
    classifier: Path, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Flipped bits that leave every value finite: the classifier would answer, wrongly, with exit 0."""
    for folder in (classifier, checkpoint):
        for name in ("final_norm.scale", "out_head.weight"):
            flip_tensor_bits(folder / WEIGHTS_FILE, name)
        assert all(bool(t.isfinite().all()) for t in load_file(str(folder / WEIGHTS_FILE)).values())
    assert main(["classify", "--model", str(classifier), "You won a free prize"]) == 2
    line = one_line_error(capsys, "classify")
    assert f"{classifier / WEIGHTS_FILE}: its SHA-256 is not the one recorded" in line
    assert "`dvc repro spam-finetune`" in line
    assert capsys.readouterr().out == ""  # no label printed
    assert main(["chat", "--model", str(checkpoint), "--max-new-tokens", "2", "Say hi"]) == 2
    assert f"{checkpoint / WEIGHTS_FILE}: its SHA-256" in one_line_error(capsys, "chat")
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out)]) == 2
    assert f"{checkpoint / WEIGHTS_FILE}: its SHA-256" in one_line_error(capsys, "export")
    assert not out.exists()


def test_an_edited_config_and_a_truncated_weights_file_are_refused(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = checkpoint / CONFIG_FILE
    config.write_text(config.read_text().replace('"pretrain"', '"pretraiN"'))  # same size, other bytes
    assert main(["chat", "--model", str(checkpoint), "Say hi"]) == 2
    assert f"{config}: its SHA-256 is not the one recorded" in one_line_error(capsys, "chat")
    config.write_text(config.read_text().replace('"pretraiN"', '"pretrain"'))
    weights = checkpoint / WEIGHTS_FILE
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["chat", "--model", str(checkpoint), "Say hi"]) == 2
    assert f"{weights}: expected {size} bytes, found 1000 bytes" in one_line_error(capsys, "chat")


def test_a_model_folder_without_a_manifest_is_refused_with_the_stage_to_rerun(
    classifier: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder from before the manifests (or a save cut short): its files cannot be checked."""
    (checkpoint / MANIFEST_FILE).unlink()
    assert main(["chat", "--model", str(checkpoint), "Say hi"]) == 2
    line = one_line_error(capsys, "chat")
    assert line == (
        f"gptlab chat: {checkpoint}: no {MANIFEST_FILE}, so its files cannot be checked (a model folder "
        "from an older gptlab, or a save cut short); rebuild it: `dvc repro pretrain`"
    )
    (classifier / MANIFEST_FILE).unlink()
    assert main(["classify", "--model", str(classifier), "hi"]) == 2
    assert one_line_error(capsys, "classify").endswith("rebuild it: `dvc repro spam-finetune`")


def test_a_config_that_disagrees_with_its_weights_is_one_line_naming_the_folder_and_tensor(
    classifier: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """emb_dim doubled in config.json and the manifest written again: the sizes, not a torch traceback."""
    for folder in (classifier, checkpoint):
        config = json.loads((folder / CONFIG_FILE).read_text())
        config["model"]["emb_dim"] *= 2
        (folder / CONFIG_FILE).write_text(json.dumps(config))
        write_model_manifest(folder)  # written so: only the weights' shapes tell
    emb_dim = TINY_GPT.emb_dim
    expected = f"tok_emb.weight is [{TINY_GPT.vocab_size}, {emb_dim}] in the weights but [{TINY_GPT.vocab_size}, {2 * emb_dim}] by the config"
    assert main(["classify", "--model", str(classifier), "You won a free prize"]) == 2
    line = one_line_error(capsys, "classify")
    assert f"{classifier}: config.json does not match model.safetensors" in line and expected in line
    assert main(["chat", "--model", str(checkpoint), "--max-new-tokens", "2", "Say hi"]) == 2
    line = one_line_error(capsys, "chat")
    assert f"{checkpoint}: config.json does not match model.safetensors" in line and expected in line
