"""The load-gpt2 stage end to end on a tmp project, with tiny random models standing in for OpenAI's."""

from __future__ import annotations

import hashlib
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

from gptlab.data.fetch import FetchError, sha256_file
from gptlab.data.verdict import GPTDatasetV1, encode, load_split, save_split, split_text
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import WEIGHTS_FILE, load_model, read_config, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.pipeline.params import load_params
from gptlab.schema import ConfigError
from gptlab.training.losses import average_loss, next_token_loss
from gptlab.training.runtime import ordered_loader
from stages.load_gpt2 import run

from helpers import PROJECT_ROOT, closed_url, committed_params_raw, hf_env, hf_hub_cache

NAMES = ("gpt2-medium", "gpt2-small")
MAX_LENGTH, STRIDE, BATCH = 32, 256, 2


def random_hf_model(seed: int) -> GPT2LMHeadModel:
    """A tiny GPT-2 with 64-dim heads (what a bare weights file implies) and every parameter random."""
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=1, n_positions=64, vocab_size=50257))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm_scale = ".ln_" in name and name.endswith("weight")
            param.normal_(1.0 if is_norm_scale else 0.0, 0.05, generator=generator)
    return model.eval()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_data: Path, tokenizer) -> Path:
    """A project folder with The Verdict's splits, a tiny pretrain checkpoint and params; cwd is set to it.

    The params keep pretrain's own windows (256 tokens): load-gpt2 takes the checkpoint's (MAX_LENGTH).
    """
    monkeypatch.chdir(tmp_path)
    train, val = split_text((shared_data / "the-verdict.txt").read_text(encoding="utf-8"), 0.9)
    save_split("data/processed", "train", encode(train, tokenizer))
    save_split("data/processed", "val", encode(val, tokenizer))
    tiny_pretrain_checkpoint()
    params = committed_params_raw()
    params["data"]["raw_dir"] = str(shared_data)  # the test inputs hold gpt2/vocab.bpe and gpt2/encoder.json
    params["gpt2"]["batch_size"] = BATCH
    params["gpt2"]["sample"]["max_new_tokens"] = 5
    params["spam"]["base_model"], params["instruct"]["base_model"] = "gpt2-small", "gpt2-medium"
    write_params(params)
    return tmp_path


def write_params(params: dict[str, Any]) -> None:
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")


def edit_params(**changes: Any) -> None:
    """Set dotted keys in the tmp project's params.yaml."""
    params = yaml.safe_load(Path("params.yaml").read_text(encoding="utf-8"))
    for dotted, value in changes.items():
        *parents, last = dotted.split("/")
        node = params
        for key in parents:
            node = node[key]
        node[last] = value
    write_params(params)


@pytest.fixture
def hf_mirror(project: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, GPT2LMHeadModel]:
    """Tiny HF models as the mirror's weights files, pinned in params by their real sha256 and size."""
    mirror = project / "mirror"
    monkeypatch.setenv("GPTLAB_MIRROR", str(mirror))
    models = {}
    for seed, name in enumerate(NAMES):
        models[name] = random_hf_model(seed)
        saved = project / "hf-save" / name
        models[name].save_pretrained(saved, safe_serialization=True)
        target = mirror / "gpt2-weights" / name / "model.safetensors"
        target.parent.mkdir(parents=True)
        shutil.move(saved / "model.safetensors", target)
        edit_params(
            **{
                f"gpt2/weights/{name}/repo_id": f"gptlab-test/not-on-the-hub-{name}",
                f"gpt2/weights/{name}/sha256": sha256_file(target),
                f"gpt2/weights/{name}/size": target.stat().st_size,
            }
        )
    return models


def hf_verdict_loss(model: GPT2LMHeadModel, split: str) -> float:
    """The Verdict loss computed by transformers itself, batch means averaged as the book does."""
    dataset = GPTDatasetV1(load_split("data/processed", split), MAX_LENGTH, STRIDE)
    losses = []
    with torch.no_grad():
        for inputs, targets in DataLoader(dataset, batch_size=BATCH):
            logits = model(inputs).logits  # (b, t, vocab)
            losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item())
    return sum(losses) / len(losses)


def stage_runs() -> list[Any]:
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("gptlab")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


@pytest.mark.slow
def test_huggingface_source_end_to_end(hf_mirror: dict[str, GPT2LMHeadModel]) -> None:
    run(load_params())

    report = json.loads(Path("reports/load-gpt2/metrics.json").read_text())
    samples = json.loads(Path("reports/load-gpt2/samples.json").read_text())
    assert sorted(report) == sorted(samples) == sorted(NAMES)
    ids = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(0))
    for name, hf in hf_mirror.items():
        model, metadata = load_model(Path("models/gpt2") / name)
        assert model.cfg.qkv_bias and model.cfg.context_length == 64 and model.cfg.n_heads == 1
        assert (model.cfg.attention, model.cfg.kernels) == ("masked_softmax", "book")  # the checkpoint's
        with torch.no_grad():
            torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-5)
        pin = load_params().gpt2.weights[name]
        assert metadata["source"] == "huggingface" and metadata["sha256"] == pin.sha256
        assert (
            metadata["url"]
            == f"https://huggingface.co/{pin.repo_id}/resolve/{pin.revision}/model.safetensors"
        )
        # The mirror's file was copied to the download folder, verified.
        assert sha256_file(Path("data/weights") / name / "model.safetensors") == pin.sha256
        for split in ("train", "val"):
            assert report[name][f"{split}_loss"] == pytest.approx(hf_verdict_loss(hf, split), abs=1e-4)
            assert report[name][f"{split}_perplexity"] == pytest.approx(
                math.exp(report[name][f"{split}_loss"])
            )
        assert samples[name].startswith("Every effort moves you") and len(samples[name]) > 22

    runs = stage_runs()
    assert sorted(r.data.tags["gptlab.base_model"] for r in runs) == sorted(NAMES)
    for r in runs:
        name = r.data.tags["gptlab.base_model"]
        assert r.info.run_name == f"load-gpt2 · {name}" and r.info.status == "FINISHED"
        assert r.data.metrics[f"load-gpt2/{name}_val_loss"] == pytest.approx(report[name]["val_loss"])
        # Each run is tagged with the weights it wrote; OpenAI's weights are its described source.
        assert r.data.tags["gptlab.checkpoint_sha256"] == sha256_file(
            Path("models/gpt2") / name / WEIGHTS_FILE
        )
        assert "huggingface.co" in r.data.tags["mlflow.note.content"]
        assert "gptlab.upstream_run_id" not in r.data.tags

    # Rerun with no mirror: the verified files in data/weights are used, and every output is byte-identical.
    before = {p: p.read_bytes() for p in sorted(Path("models/gpt2").rglob("*")) if p.is_file()}
    before_report = Path("reports/load-gpt2/metrics.json").read_text()
    shutil.rmtree("mirror")
    run(load_params())
    after = {p: p.read_bytes() for p in sorted(Path("models/gpt2").rglob("*")) if p.is_file()}
    assert after == before
    assert Path("reports/load-gpt2/metrics.json").read_text() == before_report


def damage_file(path: Path, damage: str) -> bytes:
    """Tamper with a weights file (a flipped bit inside a tensor: still readable, caught by the hash
    only) or truncate it to half; returns what it now holds."""
    data = bytearray(path.read_bytes())
    if damage == "tampered":
        data[-1] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize("damage", ["tampered", "truncated"])
def test_damaged_weights_are_refused(hf_mirror: dict[str, GPT2LMHeadModel], damage: str) -> None:
    damage_file(Path("mirror/gpt2-weights/gpt2-small/model.safetensors"), damage)
    store = Path(os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///"))
    untouched = store.read_bytes()  # the test's empty store

    with pytest.raises(FetchError) as info:
        run(load_params())
    message = str(info.value)
    assert load_params().gpt2.weights["gpt2-small"].sha256 in message
    assert "data/weights/gpt2-small/model.safetensors" in message  # where a hand-placed file is picked up
    assert "gpt2.source: pretrain" in message
    assert not list(Path("data/weights/gpt2-small").iterdir())  # nothing partial or unverified left
    assert not Path("models/gpt2").exists()
    # No MLflow run was opened: not even an experiment was written to the store.
    assert store.read_bytes() == untouched


def run_stage_script(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """stages/load_gpt2.py in a fresh interpreter, whose huggingface_hub reads `env` when imported."""
    return subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "stages" / "load_gpt2.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def entries_under(folder: Path) -> list[str]:
    """Every file, folder and symlink under `folder` (a Hugging Face cache holds all three)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


@pytest.fixture
def hf_home(project: Path) -> tuple[Path, GPT2LMHeadModel]:
    """A Hugging Face cache holding a tiny model as gpt2-small's file at the committed revision.

    Both fine-tunes start from gpt2-small, whose pin takes the tiny file's sha256 and size.
    """
    model = random_hf_model(0)
    model.save_pretrained(project / "hf-save", safe_serialization=True)
    data = (project / "hf-save" / "model.safetensors").read_bytes()
    pin = load_params().gpt2.weights["gpt2-small"]
    hf_hub_cache(project / "hf-home", pin.repo_id, pin.revision, pin.filename, data)
    edit_params(
        **{
            "spam/base_model": "gpt2-small",
            "instruct/base_model": "gpt2-small",
            "gpt2/weights/gpt2-small/sha256": hashlib.sha256(data).hexdigest(),
            "gpt2/weights/gpt2-small/size": len(data),
        }
    )
    return project / "hf-home", model


def cached_snapshot(hf_home: Path) -> Path:
    pin = load_params().gpt2.weights["gpt2-small"]
    return hf_home / "hub" / "models--openai-community--gpt2" / "snapshots" / pin.revision / pin.filename


@pytest.mark.slow
def test_weights_resolve_offline_from_the_hf_cache(hf_home: tuple[Path, GPT2LMHeadModel]) -> None:
    home, hf = hf_home
    before = entries_under(home)
    proc = run_stage_script(hf_env(home, GPTLAB_MIRROR=str(Path("no-mirror").absolute())))
    assert proc.returncode == 0, proc.stderr

    model, metadata = load_model(Path("models/gpt2/gpt2-small"))
    ids = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-5)
    assert metadata["sha256"] == load_params().gpt2.weights["gpt2-small"].sha256
    # Read where the hub client keeps it: nothing added to the cache, nothing copied out of it.
    assert entries_under(home) == before
    assert not Path("data/weights").exists()


def test_cached_weights_resolve_with_no_request(hf_home: tuple[Path, GPT2LMHeadModel]) -> None:
    """Offline, and online at a closed endpoint: a file cached at the pinned commit is used as it lies."""
    home, _ = hf_home
    before = entries_under(home)
    code = (
        "from gptlab.pipeline.params import load_params\n"
        "from gptlab.data.hub_weights import hub_file\n"
        "print(hub_file(load_params().gpt2.weights['gpt2-small'], 'gpt2.weights.gpt2-small', 'no other way'))\n"
    )
    for env in (hf_env(home), hf_env(home, HF_HUB_OFFLINE="0", HF_ENDPOINT=closed_url())):
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str(cached_snapshot(home))
    assert entries_under(home) == before  # nothing downloaded again


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["tampered", "truncated"])
def test_damaged_blob_in_the_hf_cache_is_refused(hf_home: tuple[Path, GPT2LMHeadModel], damage: str) -> None:
    home, _ = hf_home
    data = damage_file(cached_snapshot(home).resolve(), damage)

    proc = run_stage_script(hf_env(home, GPTLAB_MIRROR=str(Path("no-mirror").absolute())))
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    pin = load_params().gpt2.weights["gpt2-small"]
    assert line.startswith(
        f"error: gpt2.weights.gpt2-small: {cached_snapshot(home)} in the Hugging Face cache"
    )
    assert f"has sha256 {hashlib.sha256(data).hexdigest()} ({len(data):,} bytes)" in line
    assert f"not the pinned {pin.sha256} ({pin.size:,} bytes), and is not used" in line
    assert "--force-download" in line
    assert not Path("models/gpt2").exists() and not Path("data/weights").exists()


@pytest.mark.slow
def test_offline_with_an_empty_hf_cache_fails_in_one_line(project: Path) -> None:
    # Repos that do not exist: even if offline mode were ignored, this never downloads real weights.
    edit_params(**{f"gpt2/weights/{name}/repo_id": f"gptlab-test/not-on-the-hub-{name}" for name in NAMES})
    home = project / "empty-hf-home"
    proc = run_stage_script(hf_env(home, GPTLAB_MIRROR=str(project / "empty-mirror")))
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(
        "error: gpt2.weights.gpt2-medium: model.safetensors of gptlab-test/not-on-the-hub-"
    )
    assert f"is not in the Hugging Face cache ({home / 'hub'}) and HF_HUB_OFFLINE is set" in line
    assert "network access (https://huggingface.co/gptlab-test/not-on-the-hub-gpt2-medium/resolve/" in line
    assert "HF_ENDPOINT" in line and "gpt2.source: pretrain" in line
    assert "data/weights/gpt2-medium/model.safetensors" in line
    assert "empty-mirror/gpt2-weights/gpt2-medium/model.safetensors" in line
    assert not home.exists() and not Path("models/gpt2").exists()


def test_base_model_without_pinned_weights_is_a_config_error(project: Path) -> None:
    edit_params(**{"spam/base_model": "gpt2-large"})
    with pytest.raises(ConfigError, match=r"gpt2\.weights\.gpt2-large: missing key"):
        run(load_params())


def tiny_pretrain_checkpoint(
    context_length: int = 32, kernels: tuple[str, str] = ("masked_softmax", "book")
) -> GPTModel:
    """An untied, bias-free model like the pretrain stage's, saved as models/pretrain with the params
    the stage records: the book's kernels by default, windows of MAX_LENGTH tokens every STRIDE."""
    torch.manual_seed(7)
    attention, kernel = kernels
    cfg = ModelConfig(
        context_length=context_length,
        emb_dim=32,
        n_heads=2,
        n_layers=2,
        qkv_bias=False,
        attention=attention,
        kernels=kernel,
    )
    model = build_gpt(cfg).eval()
    recorded = {
        "pretrain.model.attention": attention,
        "pretrain.model.kernels": kernel,
        "pretrain.data.max_length": MAX_LENGTH,
        "pretrain.data.stride": STRIDE,
    }
    save_model(model, "models/pretrain", {"stage": "pretrain", "params": recorded})
    return model


@pytest.mark.slow
def test_pretrain_source_through_the_stage_script(project: Path) -> None:
    pretrained = tiny_pretrain_checkpoint()
    edit_params(**{"gpt2/source": "pretrain"})
    proc = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "stages" / "load_gpt2.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr

    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    expected = pretrained.state_dict()
    for name in NAMES:
        model, metadata = load_model(Path("models/gpt2") / name)
        assert model.cfg.qkv_bias and model.cfg.context_length == 32 and model.cfg.n_heads == 2
        # Every tensor of the checkpoint unchanged, its untied head included; no bias became a zero bias.
        state = model.state_dict()
        for key, tensor in state.items():
            if key in expected:
                assert torch.equal(tensor, expected[key]), key
            else:
                assert key.endswith(".bias") and ".att.W_" in key and not tensor.any(), key
        assert not torch.equal(model.out_head.weight, model.tok_emb.weight)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), pretrained(ids), rtol=0, atol=1e-6)
        assert metadata["source"] == "pretrain"
        assert metadata["checkpoint_sha256"] == sha256_file("models/pretrain/model.safetensors")
    report = json.loads(Path("reports/load-gpt2/metrics.json").read_text())
    assert sorted(report) == sorted(NAMES)
    for split in ("train", "val"):  # the pretrain checkpoint's own losses, as the eval stage computes them
        dataset = GPTDatasetV1(load_split("data/processed", split), MAX_LENGTH, STRIDE)
        own = average_loss(pretrained, ordered_loader(dataset, BATCH), next_token_loss)
        for name in NAMES:
            assert report[name][f"{split}_loss"] == pytest.approx(own, rel=0, abs=1e-6)
    assert not list(Path("data/weights").glob("*/*"))  # nothing downloaded


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [("masked_softmax", "book"), ("sdpa", "fused")])
def test_base_models_record_the_kernels_of_the_pretrain_checkpoint(
    project: Path, kernels: tuple[str, str]
) -> None:
    """The book's masked softmax and kernels, or the fast profile's, as pretrain computed; never the params'."""
    pretrained = tiny_pretrain_checkpoint(kernels=kernels)
    edit_params(**{"gpt2/source": "pretrain"})
    params = load_params()  # the book's kernels: the checkpoint, not these, decides
    assert (params.pretrain.model.attention, params.pretrain.model.kernels) == ("masked_softmax", "book")
    run(params)

    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    for name in NAMES:
        cfg, _ = read_config(Path("models/gpt2") / name)
        assert (cfg.attention, cfg.kernels) == kernels, name
        model, _ = load_model(Path("models/gpt2") / name)  # as the fine-tunes rebuild it
        with torch.no_grad():  # the same function, whichever kernels compute it
            torch.testing.assert_close(model(ids), pretrained(ids), rtol=0, atol=1e-5)
    (logged,) = {r.data.params["pretrain.model.attention"] for r in stage_runs()}
    assert logged == kernels[0]


@pytest.mark.parametrize("source", ["huggingface", "pretrain"])
def test_either_source_needs_the_pretrain_checkpoint(project: Path, source: str) -> None:
    """Its kernels and windows come from its config.json, OpenAI's weights or not."""
    edit_params(**{"gpt2/source": source})
    shutil.rmtree("models/pretrain")
    with pytest.raises(FileNotFoundError, match="models/pretrain"):
        run(load_params())


def test_a_pretrain_checkpoint_without_its_params_is_refused(project: Path) -> None:
    save_model(build_gpt(read_config("models/pretrain")[0]), "models/pretrain", {"stage": "pretrain"})
    with pytest.raises(ValueError, match=r"models/pretrain/config\.json: its metadata lacks params"):
        run(load_params())


def test_windows_longer_than_the_context_are_refused(project: Path) -> None:
    tiny_pretrain_checkpoint(context_length=16)
    edit_params(**{"gpt2/source": "pretrain"})
    with pytest.raises(ValueError, match="pretrain.data.max_length=32 exceeds the context length 16"):
        run(load_params())
