"""pretrain.init: continued pretraining from a GPT-2 weights file, a model folder or a models:/ URI, on a tiny GPT.

The GPT-2 file is one the test makes itself: a tiny transformers GPT2LMHeadModel (64-dim heads, as a
bare weights file implies) trained a few steps on The Verdict, so its loss is far below ln(50257).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from mlflow.tracking import MlflowClient
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from gptlab.data.fetch import sha256_file
from gptlab.data.verdict import GPTDatasetV1, encode, load_split, save_split, split_text
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import save_model
from gptlab.model.config import ModelConfig
from gptlab.pipeline.init_model import initial_model
from gptlab.pipeline.params import load_params
from gptlab.schema import ConfigError
from stages import pretrain as pretrain_stage

from helpers import PROJECT_ROOT, committed_params_raw

CONTEXT, BATCH = 32, 8
# The dims params give a tiny model: a GPT-2 file of 64-dim heads, 1 head, 2 blocks, 32 positions.
TINY_MODEL = dict(context_length=CONTEXT, emb_dim=64, n_layers=2, n_heads=1, qkv_bias=True)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_data: Path, tokenizer) -> Path:
    """A project folder with The Verdict's splits and tiny pretrain params; cwd is set to it."""
    monkeypatch.chdir(tmp_path)
    train, val = split_text((shared_data / "the-verdict.txt").read_text(encoding="utf-8"), 0.9)
    save_split("data/processed", "train", encode(train, tokenizer))
    save_split("data/processed", "val", encode(val, tokenizer))
    params = committed_params_raw()
    params["data"]["raw_dir"] = str(shared_data)  # gpt2/vocab.bpe and gpt2/encoder.json
    pretrain = params["pretrain"]
    pretrain["model"].update(TINY_MODEL)
    pretrain["data"].update(max_length=CONTEXT, stride=48)
    pretrain["train"].update(batch_size=BATCH, epochs=1, max_steps=4, eval_freq=2, eval_iter=1, device="cpu")
    pretrain["sample"]["max_new_tokens"] = 3
    write_params(params)
    return tmp_path


def write_params(params: dict[str, Any]) -> None:
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")


def edit_params(**changes: Any) -> None:
    """Set keys (`pretrain/init`) in the project's params.yaml."""
    params = yaml.safe_load(Path("params.yaml").read_text(encoding="utf-8"))
    for dotted, value in changes.items():
        *parents, last = dotted.split("/")
        node = params
        for key in parents:
            node = node[key]
        node[last] = value
    write_params(params)


def trained_gpt2_file(target: Path) -> GPT2LMHeadModel:
    """A tiny GPT-2 trained 40 steps on The Verdict's train split, saved as a bare (tied) weights file."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=1, n_positions=CONTEXT, vocab_size=50257))
    ids = torch.as_tensor(load_split("data/processed", "train")[:4096], dtype=torch.long)
    windows = ids[: len(ids) // CONTEXT * CONTEXT].view(-1, CONTEXT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(40):
        batch = windows[torch.randint(0, len(windows), (BATCH,))]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    saved = target.parent / "hf-save"
    model.save_pretrained(saved, safe_serialization=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(saved / "model.safetensors", target)
    return model.eval()


def hf_loss(model: GPT2LMHeadModel, split: str, stride: int) -> float:
    """The split's loss by transformers itself, batch means averaged as the stage does."""
    dataset = GPTDatasetV1(load_split("data/processed", split), CONTEXT, stride)
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item()
            for inputs, targets in DataLoader(dataset, batch_size=BATCH)
        ]
    return sum(losses) / len(losses)


def metrics() -> dict[str, float]:
    return json.loads(Path("reports/pretrain/metrics.json").read_text(encoding="utf-8"))


def newest_run() -> Any:
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("gptlab")
    return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])[0]


def registry_description(name: str, version: str) -> str:
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    return client.get_model_version(name, version).description


@pytest.mark.slow
def test_continued_pretraining_from_gpt2_then_a_logged_model_then_a_folder(project: Path) -> None:
    """Each init's first loss is its checkpoint's (not ln(50257)), and MLflow records where it started."""
    weights = (
        project / "data" / "weights" / "gpt2-small" / "model.safetensors"
    )  # hand-placed, as load-gpt2 reads
    gpt2 = trained_gpt2_file(weights)
    pin = {
        "repo_id": "gptlab-test/not-on-the-hub",
        "sha256": sha256_file(weights),
        "size": weights.stat().st_size,
    }
    edit_params(**{f"gpt2/weights/gpt2-small/{key}": value for key, value in pin.items()})
    edit_params(**{"pretrain/init": "gpt2-small"})
    pretrain_stage.run(load_params())
    first = metrics()
    expected = hf_loss(gpt2, "train", stride=48)
    assert expected < math.log(50257) - 2.5  # a checkpoint that learned something: ~6, not 10.8
    assert first["initial_train_loss"] == pytest.approx(expected, rel=1e-4)
    assert first["initial_val_loss"] == pytest.approx(hf_loss(gpt2, "val", stride=48), rel=1e-4)
    curve = Path("reports/pretrain/losses.csv").read_text().splitlines()
    assert float(curve[1].split(",")[2]) < math.log(50257) - 2.5  # the first evaluation's train loss, too
    run = newest_run()
    assert run.data.params["pretrain.init"] == "gpt2-small"
    assert run.data.tags["gptlab.init_sha256"] == pin["sha256"]
    assert run.data.tags["gptlab.base_model"].startswith("gpt2-small (OpenAI's GPT-2 weights")
    assert "Base model: gpt2-small (OpenAI's GPT-2 weights" in registry_description("gptlab-pretrain", "1")

    # The model the first run logged and registered, by its immutable version: its final loss is where this starts.
    edit_params(**{"pretrain/init": "models:/gptlab-pretrain/1"})
    pretrain_stage.run(load_params())
    second = metrics()
    assert second["initial_train_loss"] == pytest.approx(first["final_train_loss"], rel=1e-6)
    assert newest_run().data.tags["gptlab.init"] == "models:/gptlab-pretrain/1"
    assert "Base model: models:/gptlab-pretrain/1 (a checkpoint" in registry_description(
        "gptlab-pretrain", "2"
    )

    # A model folder: a copy of the second run's model; the run that wrote it is linked upstream.
    shutil.copytree("models/pretrain", "models/base")
    edit_params(**{"pretrain/init": "models/base", "pretrain/model/drop_rate": 0.0})
    pretrain_stage.run(load_params())
    assert metrics()["initial_train_loss"] == pytest.approx(second["final_train_loss"], rel=1e-6)
    tags = newest_run().data.tags
    assert tags["gptlab.upstream_checkpoint"] == "models/base"
    assert (
        tags["gptlab.upstream_run_id"]
        and tags["gptlab.init_sha256"]
        == json.loads(Path("models/base/manifest.json").read_text())["sha256"]["model.safetensors"]
    )


def saved_model(folder: str, **dims: Any) -> Path:
    """A gptlab checkpoint of GPT-2's vocabulary and the tiny dims (changed by `dims`) at `folder`."""
    torch.manual_seed(1)
    cfg = ModelConfig(**{**TINY_MODEL, **dims})
    return save_model(build_gpt(cfg), folder, {"stage": "pretrain"})


def test_a_folder_that_fits_loads_its_weights_positions_cut_to_the_context(project: Path) -> None:
    saved = saved_model("models/base")
    edit_params(
        **{
            "pretrain/init": "models/base",
            "pretrain/model/context_length": 16,  # fewer positions than the checkpoint's 32: its first rows
            "pretrain/data/max_length": 16,
            "pretrain/model/drop_rate": 0.0,  # how it trains: free to differ
            "pretrain/model/attention": "sdpa",
        }
    )
    params = load_params()
    init = initial_model(params)
    assert init is not None and init.upstream == (Path("models/base"), {"stage": "pretrain"})
    model = build_gpt(params.pretrain.model.resolve())
    init.load_into(model)
    ours, theirs = model.state_dict(), init.weights
    assert torch.equal(ours["pos_emb.weight"], theirs["pos_emb.weight"][:16])
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs if name != "pos_emb.weight")
    assert init.sha256 == json.loads((saved / "manifest.json").read_text())["sha256"]["model.safetensors"]
    assert initial_model(load_params()) is not None
    edit_params(**{"pretrain/init": "random"})
    assert initial_model(load_params()) is None


@pytest.mark.parametrize(
    ("saved", "params", "message"),
    [
        (
            {},
            {"pretrain/model/emb_dim": None, "pretrain/model/n_heads": None},
            "pretrain.model.emb_dim: 768 (preset gpt2-small) in params, but 64 in the init model models/base; "
            "set it to 64",
        ),
        ({"n_layers": 3}, {}, "pretrain.model.n_layers: 2 in params, but 3 in the init model models/base"),
        ({"qkv_bias": False}, {}, "pretrain.model.qkv_bias: True in params, but False in the init model"),
        (
            {"context_length": 16},
            {},
            "pretrain.model.context_length: 32 in params exceeds the 16 positions of the init model models/base; "
            "set it to 16 or less",
        ),
        (
            {"vocab_size": 300},
            {},
            "pretrain.init: the vocabulary of models/base has 300 tokens, GPT-2's tokenizer 50,257",
        ),
        ({"num_classes": 2}, {}, "pretrain.init: models/base is a classifier (num_classes=2)"),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_one_line_naming_both(
    project: Path, saved: dict[str, Any], params: dict[str, Any], message: str
) -> None:
    saved_model("models/base", **saved)
    edit_params(**{"pretrain/init": "models/base", **params})
    with pytest.raises(ConfigError) as raised:
        initial_model(load_params())
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_inits_that_name_nothing_usable_are_refused(project: Path) -> None:
    edit_params(**{"pretrain/init": "models/pretrain"})
    with pytest.raises(
        ConfigError, match=r"is what this stage writes; copy it first \(cp -r models/pretrain"
    ):
        initial_model(load_params())
    edit_params(**{"pretrain/init": "models/nothing-here"})
    with pytest.raises(ConfigError, match="is not random, a GPT-2 name .* or a model folder"):
        initial_model(load_params())
    edit_params(**{"pretrain/init": "gpt2-xl"})  # no pin in gpt2.weights
    with pytest.raises(ConfigError, match="gpt2.weights.gpt2-xl: missing key; pretrain.init names 'gpt2-xl'"):
        initial_model(load_params())
    for uri in ("models:/gptlab-pretrain@champion", "models:/gptlab-pretrain/latest", "runs:/abc/model"):
        edit_params(**{"pretrain/init": uri})
        with pytest.raises(ConfigError, match="pretrain.init: .* name a registered version by its number"):
            load_params()


def test_the_stage_stops_with_exit_2_before_any_run(project: Path) -> None:
    """A misfit through the stage script: one line, exit 2, no model, no MLflow run."""
    saved_model("models/base", n_layers=3)
    edit_params(**{"pretrain/init": "models/base"})
    proc = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "stages" / "pretrain.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: pretrain.model.n_layers: 2 in params, but 3 in the init model models/base; set it to 3"
    )
    assert not Path("models/pretrain").exists() and not Path("reports").exists()
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    assert client.get_experiment_by_name("gptlab") is None or not client.search_runs(
        [client.get_experiment_by_name("gptlab").experiment_id]
    )
