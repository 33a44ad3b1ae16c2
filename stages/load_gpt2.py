"""Stage `load-gpt2`: the base models of both fine-tunes, from OpenAI's GPT-2 or from our own.

For each distinct base model the fine-tune stages name (spam.base_model,
instruct.base_model), writes a gptlab checkpoint to models/gpt2/<name>/:
- gpt2.source huggingface: OpenAI's weights file, pinned by revision and sha256,
  taken from gpt2.download_dir/<name>/ if already there, else the mirror
  (GPTLAB_MIRROR/gpt2-weights/<name>/), else the Hugging Face cache through the
  hub client (hub_weights.py); then converted.
- gpt2.source pretrain: this pipeline's models/pretrain taken through the same
  export -> import path (its own output head kept as `lm_head.weight`, so the
  model has exactly the checkpoint's logits), so both fine-tunes can run with no
  network at all.
What it takes of our pretrained model, it reads from the pretrain checkpoint's
config.json, never from the pretrain params: a weights file says nothing of how
to compute, so each base model's config records the attention and other kernels
our pretrained model computes with (the book's masked softmax and kernels by
default, SDPA and fused ones on the fast profile), and the fine-tunes, which
rebuild their model from that config, compute as it says. Each model is then
checked as the book does: loss and perplexity on The Verdict's windows the
pretrained model was trained on (the metric names of the eval stage) and a
seeded sample. One MLflow run per model, named `load-gpt2 · <name>` and tagged
gptlab.base_model=<name>, so each sits beside the eval stage's run of our
pretrained model in the UI with the same metric columns; all of it also goes to
reports/load-gpt2/{metrics,samples}.json. With
gpt2.source pretrain the run links the pretrain run that wrote models/pretrain, and
each checkpoint's metadata names its own load-gpt2 run, for the fine-tunes to link.
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptlab.data.fetch import mirror_dir, sha256_file
from gptlab.data.hub_weights import resolve_weights, weights_url
from gptlab.data.inputs import WEIGHTS_SUBDIR
from gptlab.data.verdict import SPLITS, SUBDIR, GPTDatasetV1, load_split
from gptlab.errors import InputError
from gptlab.files import write_json
from gptlab.model.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    cpu_weights,
    load_model,
    read_config,
    save_weights,
)
from gptlab.model.config import ModelConfig
from gptlab.model.generate import generate_text
from gptlab.model.gpt import GPTModel
from gptlab.model.hf_gpt2 import load_hf_weights, roundtrip_checkpoint
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import GPT2_MODELS, PRETRAIN_MODEL, REPORTS
from gptlab.pipeline.params import Params, PretrainData
from gptlab.schema import ConfigError, build, flatten
from gptlab.tracking.buffered_run import section
from gptlab.tracking.runs import stage_run
from gptlab.training.losses import dataset_loss, perplexity
from gptlab.training.runtime import resolve_device

REPORT_DIR = REPORTS / "load-gpt2"


@dataclass(frozen=True)
class Pretrained:
    """What load-gpt2 takes of our pretrained model, all from the checkpoint's config.json."""

    config: ModelConfig  # its attention and kernels: how every base model computes
    metadata: dict[str, Any]
    windows: PretrainData  # The Verdict's windows it was trained on: every base model is scored on them


def read_pretrained(directory: Path = PRETRAIN_MODEL) -> Pretrained:
    """The pretrain checkpoint's config and the params its stage recorded in it; a clear error if missing."""
    config, metadata = read_config(directory)
    recorded = metadata.get("params", {})
    keys = {"max_length": "pretrain.data.max_length", "stride": "pretrain.data.stride"}
    missing = [key for key in keys.values() if key not in recorded]
    if missing:
        raise InputError(
            f"{directory / CONFIG_FILE}: its metadata lacks params {missing} (the pretrain stage records "
            "them): run the pretrain stage again"
        )
    windows = build(PretrainData, {name: recorded[key] for name, key in keys.items()}, "pretrain.data")
    return Pretrained(config, metadata, windows)


def base_model_names(params: Params) -> list[str]:
    """The distinct base models the fine-tune stages ask for, in a stable order."""
    return sorted({params.spam.base_model, params.instruct.base_model})


def obtain_weights(name: str, params: Params) -> Path:
    """OpenAI's pinned weights file for `name`: present, mirror, then the HF cache; FetchError says what to do."""
    if name not in params.gpt2.weights:
        raise ConfigError(
            f"gpt2.weights.{name}: missing key; a fine-tune names {name!r} as its base model, so pin its "
            f"weights here (known: {sorted(params.gpt2.weights)}) or set gpt2.source: pretrain"
        )
    pin = params.gpt2.weights[name]
    mirror = mirror_dir()
    return resolve_weights(
        pin,
        f"gpt2.weights.{name}",
        Path(params.gpt2.download_dir) / name / pin.filename,
        mirror / WEIGHTS_SUBDIR / name / pin.filename if mirror else None,
        or_else="run fully offline on this pipeline's own pretrained model: set `gpt2.source: pretrain` "
        "in params.yaml (the fine-tunes then start from models/pretrain)",
    ).path


def import_base_model(name: str, params: Params, weights: Path | None) -> tuple[GPTModel, dict[str, Any]]:
    """The base model `name` and the metadata that records where it came from."""
    if params.gpt2.source == "huggingface":
        assert weights is not None, "huggingface source needs its weights file"
        pin = params.gpt2.weights[name]
        metadata = {
            "stage": "load-gpt2",
            "source": "huggingface",
            "name": name,
            "url": weights_url(pin),
            **dataclasses.asdict(pin),
        }
        return load_hf_weights(weights), metadata
    metadata = {
        "stage": "load-gpt2",
        "source": "pretrain",
        "name": name,
        "checkpoint": PRETRAIN_MODEL.as_posix(),
        "checkpoint_sha256": sha256_file(PRETRAIN_MODEL / WEIGHTS_FILE),
        "head": "the checkpoint's own out_head, kept through export -> import (same logits)",
    }
    return roundtrip_checkpoint(PRETRAIN_MODEL), metadata


def write_base_model(name: str, params: Params, weights: Path | None, kernels: ModelConfig) -> dict[str, Any]:
    """models/gpt2/<name>, computing with the attention and kernels of `kernels`; returns its metadata."""
    model, metadata = import_base_model(name, params, weights)
    cfg = dataclasses.replace(model.cfg, attention=kernels.attention, kernels=kernels.kernels)
    save_weights(cpu_weights(model), cfg, GPT2_MODELS / name, metadata)
    return metadata


def verdict_losses(model: GPTModel, params: Params, windows: PretrainData, desc: str) -> dict[str, float]:
    """Loss and perplexity on The Verdict's splits, in order, every window (the eval stage's names)."""
    if windows.max_length > model.cfg.context_length:
        raise InputError(
            f"pretrain.data.max_length={windows.max_length} exceeds the context length "
            f"{model.cfg.context_length} of {desc}; lower it"
        )
    metrics: dict[str, float] = {}
    for split in ("train", "val"):
        dataset = GPTDatasetV1(
            load_split(params.data.processed_dir, split), windows.max_length, windows.stride
        )
        loss = dataset_loss(model, dataset, params.gpt2.batch_size, desc=f"{desc} {split} loss")
        metrics[f"{split}_loss"] = loss
        metrics[f"{split}_perplexity"] = perplexity(loss)
    return metrics


def run(params: Params) -> None:
    cfg = params.gpt2
    names = base_model_names(params)
    # Every input first: a missing one fails before minutes of converting the others.
    pretrained = read_pretrained()
    if cfg.source == "huggingface":
        weights: dict[str, Path | None] = {name: obtain_weights(name, params) for name in names}
    else:
        weights = dict.fromkeys(names)
    tokenizer = gpt2_tokenizer(*params.data.bpe_files())
    device = resolve_device("auto")
    logged = {
        **flatten(cfg, "gpt2"),
        "spam.base_model": params.spam.base_model,
        "instruct.base_model": params.instruct.base_model,
        # As the pretrain checkpoint records them: what every base model takes of it.
        "pretrain.model.attention": pretrained.config.attention,
        "pretrain.model.kernels": pretrained.config.kernels,
        **flatten(pretrained.windows, "pretrain.data"),
        "data.processed_dir": params.data.processed_dir,
    }
    report: dict[str, dict[str, float]] = {}
    samples: dict[str, str] = {}
    for name in names:
        with stage_run(
            "load-gpt2",
            params.tracking.experiment,
            logged,
            system_metrics=params.tracking.system_metrics,
            run_name=f"load-gpt2 · {name}",
        ) as tracker:
            tracker.set_tags({"gptlab.base_model": name, "gptlab.source": cfg.source})
            if cfg.source == "pretrain":
                tracker.link_upstream(PRETRAIN_MODEL, pretrained.metadata)
            else:
                url = weights_url(cfg.weights[name])
                tracker.set_tags({"mlflow.note.content": f"OpenAI's {name} weights from <{url}>."})
            tracker.log_input(
                "verdict",
                Path(params.data.processed_dir) / SUBDIR,
                context="evaluation",
                profile={
                    f"{split}_tokens": len(load_split(params.data.processed_dir, split)) for split in SPLITS
                },
            )
            metadata = write_base_model(name, params, weights[name], pretrained.config)
            tracker.record_checkpoint(GPT2_MODELS / name)
            model, _ = load_model(GPT2_MODELS / name, device)  # checked as the fine-tunes will read it
            report[name] = verdict_losses(model, params, pretrained.windows, name)
            samples[name] = generate_text(model, tokenizer, cfg.sample)
            tracker.log_metrics(section("eval", report[name]))
            tracker.log_text(samples[name], "load-gpt2/sample.txt")
            tracker.log_dict(
                {"model": model.cfg.to_dict(), "metadata": metadata}, "load-gpt2/base_model.json"
            )
            del model
        print(f"{name}: {json.dumps(report[name], sort_keys=True)}\n{samples[name]!r}")
    write_json(REPORT_DIR / "metrics.json", report)
    write_json(REPORT_DIR / "samples.json", samples)


if __name__ == "__main__":
    stage_main(run, __doc__)
