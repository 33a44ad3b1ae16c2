"""Model checkpoints and resumable training checkpoints: round trips, atomicity, damage, fingerprints."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlab.errors import GptlabError
from gptlab.files import atomic_path
from gptlab.model import checkpoint
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import (
    CheckpointError,
    cpu_weights,
    list_checkpoints,
    load_model,
    load_training_checkpoint,
    prune_checkpoints,
    read_config,
    remove_partial_checkpoints,
    save_model,
    save_training_checkpoint,
)
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.training.resume import resume_folder, run_fingerprint

TINY = ModelConfig(context_length=8, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)


def tiny_model(seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return build_gpt(TINY)


def save_checkpoint_of(folder: Path, steps: int, model: GPTModel, state: dict) -> Path:
    return save_training_checkpoint(folder, steps, model.cfg, cpu_weights(model), state)


def test_model_round_trip_keeps_weights_config_and_metadata(tmp_path: Path) -> None:
    model = tiny_model()
    save_model(model, tmp_path, {"stage": "test", "metrics": {"loss": 1.5}})
    loaded, metadata = load_model(tmp_path)
    assert loaded.cfg == TINY and not loaded.training
    assert metadata == {"stage": "test", "metrics": {"loss": 1.5}}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert read_config(tmp_path)[0] == TINY
    assert load_model(tmp_path, drop_rate=0.2)[0].cfg.drop_rate == 0.2


def test_truncated_weights_are_refused_naming_the_file(tmp_path: Path) -> None:
    save_model(tiny_model(), tmp_path)
    weights = tmp_path / checkpoint.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: expected \d+ bytes, found 1000 bytes"):
        load_model(tmp_path)


def test_atomic_path_leaves_nothing_when_the_block_fails(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.txt"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert list((tmp_path / "sub").iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole" and list((tmp_path / "sub").iterdir()) == [target]
    plain = tmp_path / "plain.txt"
    plain.write_text("")
    assert target.stat().st_mode == plain.stat().st_mode  # not mkstemp's private 0600


def training_state() -> dict:
    return {
        "progress": {"steps": 3, "history": [{"step": 0, "train_loss": float("nan")}]},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "numpy_keys": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
        "optimizer": torch.optim.AdamW(tiny_model().parameters()).state_dict(),
    }


def test_training_checkpoint_round_trip_with_weights_only(tmp_path: Path) -> None:
    model = tiny_model()
    path = save_checkpoint_of(tmp_path, 3, model, training_state())
    assert path == tmp_path / "step-0000003"
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "state.pt",
    ]
    weights, state = load_training_checkpoint(path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert state["progress"]["steps"] == 3
    assert state["rng"]["python"] == random.getstate()
    assert torch.equal(state["rng"]["torch"], torch.get_rng_state())


def test_a_save_over_an_existing_step_replaces_it(tmp_path: Path) -> None:
    save_checkpoint_of(tmp_path, 3, tiny_model(0), training_state())
    save_checkpoint_of(tmp_path, 3, tiny_model(1), training_state())
    weights, _ = load_training_checkpoint(tmp_path / "step-0000003")
    assert torch.equal(weights["tok_emb.weight"], tiny_model(1).tok_emb.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000003"]


def test_pickled_objects_are_refused_by_weights_only_loading(tmp_path: Path) -> None:
    path = save_checkpoint_of(tmp_path, 1, tiny_model(), {"ok": 1})
    state = path / checkpoint.STATE_FILE
    torch.save({"evil": Path("x")}, state)
    manifest = path / checkpoint.MANIFEST_FILE
    recorded = json.loads(manifest.read_text())
    recorded["sizes"]["state.pt"] = state.stat().st_size
    manifest.write_text(json.dumps(recorded))
    with pytest.raises(CheckpointError, match=r"state\.pt: unreadable training state"):
        load_training_checkpoint(path)


def test_listing_pruning_and_partial_saves(tmp_path: Path) -> None:
    for steps in (10, 2, 30):
        save_checkpoint_of(tmp_path, steps, tiny_model(), {"steps": steps})
    (tmp_path / ".step-0000040.x1y2.tmp").mkdir()  # a save killed before its rename
    (tmp_path / "notes").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000002", "step-0000010", "step-0000030"]
    prune_checkpoints(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000010", "step-0000030"]
    remove_partial_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-0000010", "step-0000030"]
    assert list_checkpoints(tmp_path / "missing") == []


def test_fingerprint_changes_with_settings_and_input_content(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "a.npy").write_bytes(b"one")
    first = run_fingerprint({"lr": 0.1}, [data])
    assert run_fingerprint({"lr": 0.1}, [data]) == first
    assert run_fingerprint({"lr": 0.2}, [data]) != first
    (data / "sub" / "a.npy").write_bytes(b"two")
    assert run_fingerprint({"lr": 0.1}, [data]) != first
    with pytest.raises(FileNotFoundError, match="missing.npy not found"):
        run_fingerprint({}, [tmp_path / "missing.npy"])


def test_resume_folder_is_kept_on_failure_and_removed_once_outputs_are_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError), resume_folder("pretrain", {"lr": 0.1}) as folder:
        assert folder.parent == Path(".gptlab") / "runs" / "pretrain"
        (folder / "step-0000010").mkdir(parents=True)
        raise RuntimeError("killed mid-run")
    assert (folder / "step-0000010").is_dir()  # a rerun resumes from it
    with resume_folder("pretrain", {"lr": 0.1}) as again:
        assert again == folder
    assert not folder.exists()  # finished: nothing left to resume
    assert list(folder.parent.iterdir()) == []  # nor its lock file


def test_a_second_trainer_of_the_same_run_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with resume_folder("spam-finetune", {"lr": 0.1}) as folder:
        with pytest.raises(GptlabError, match=f"another process .* is training into {folder}"):  # noqa: SIM117
            with resume_folder("spam-finetune", {"lr": 0.1}):
                pass
        with resume_folder("spam-finetune", {"lr": 0.2}):  # another run of the stage is fine
            pass


def test_content_digest_tells_apart_what_reads_back_differently() -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "steps": 3, "rng": (1, [2.5, None])}
    same = {"rng": (1, [2.5, None]), "steps": 3, "w": torch.arange(6.0).reshape(2, 3).clone()}
    assert checkpoint.content_digest(state) == checkpoint.content_digest(same)  # key order does not count
    for other in (
        {**state, "w": torch.arange(6.0).reshape(3, 2)},  # same bytes, other shape
        {**state, "w": torch.arange(6.0).reshape(2, 3).double()},
        {**state, "steps": 4},
        {**state, "rng": (1, (2.5, None))},
    ):
        assert checkpoint.content_digest(other) != checkpoint.content_digest(state)
