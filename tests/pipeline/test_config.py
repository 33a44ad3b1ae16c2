"""params.yaml and its typed configs: the repo's file loads, and every bad value is refused by name."""

from __future__ import annotations

import copy
import dataclasses
import re
import shlex
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from gptlab.data.config import SourceFile
from gptlab.model.config import ModelConfig
from gptlab.pipeline.params import Params, load_params
from gptlab.schema import ConfigError, flatten

from helpers import (
    PIPELINE_STAGES,
    PROJECT_ROOT,
    committed_params,
    committed_params_raw,
    committed_params_text,
)

DELETE = object()


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return committed_params_raw()


def edited(raw: dict[str, Any], tmp_path: Path, key: str, value: Any) -> Path:
    """A copy of params.yaml with one dotted key set to `value` (or removed)."""
    data = copy.deepcopy(raw)
    *parents, last = key.split(".")
    node = data
    for name in parents:
        node = node[name]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def refusal(raw: dict[str, Any], tmp_path: Path, key: str, value: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_params(edited(raw, tmp_path, key, value))
    return str(info.value)


def test_repo_params_load_with_their_values(raw: dict[str, Any]) -> None:
    params = committed_params()
    assert isinstance(params, Params)
    assert params.pretrain.train.lr == raw["pretrain"]["train"]["lr"]
    assert params.spam.train.lr == float(raw["spam"]["train"]["lr"])  # 5e-05: YAML reads it as a string
    assert params.eval.samples.keys() == raw["eval"]["samples"].keys()
    model = params.pretrain.model.resolve()
    assert model.context_length == raw["pretrain"]["model"]["context_length"]
    assert dataclasses.is_dataclass(params) and params.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_exponent_notation_is_a_number_for_integers_as_for_floats(
    raw: dict[str, Any], tmp_path: Path
) -> None:
    """Issue 65, item 18: YAML reads 1e9 as a string; "1e9" was a float for preference.beta but a
    type error for allowed_max_length. Now both fields read it as the number, and their own ranges judge it."""
    assert yaml.safe_load("1e9") == "1e9"  # the string the loader gets for an unquoted 1e9
    params = load_params(edited(raw, tmp_path, "preference.allowed_max_length", "1.024e3"))
    assert params.preference.allowed_max_length == 1024 and type(params.preference.allowed_max_length) is int
    for key in ("preference.beta", "preference.allowed_max_length"):
        message = refusal(raw, tmp_path, key, "1e9")
        assert message.startswith(f"{key}: expected") and "1000000000" in message, message
        assert "expected an integer" not in message and "expected a float" not in message, message
    # Not whole, or beyond any count: the integer's type error, naming the key and the value.
    for value in ("1.25e1", "1e-3", "1e999999999"):
        assert refusal(raw, tmp_path, "pretrain.train.batch_size", value) == (
            f"pretrain.train.batch_size: expected an integer, got '{value}' (not a whole number)"
        )
    # Quoted digits and a YAML float stay refused, as before.
    assert (
        refusal(raw, tmp_path, "spam.train.batch_size", "8")
        == "spam.train.batch_size: expected an integer, got '8'"
    )


def _fields_missing_from(cls: type, data: Any, path: str) -> list[str]:
    """Config fields with no key in `data` (defaults hide these from the loader's missing-key check)."""
    missing = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = f"{path}.{field.name}" if path else field.name
        if field.name not in data:
            missing.append(key)
            continue
        annotation = hints[field.name]
        if dataclasses.is_dataclass(annotation):
            missing += _fields_missing_from(annotation, data[field.name], key)
        elif typing.get_origin(annotation) is dict:
            value_type = typing.get_args(annotation)[1]
            if dataclasses.is_dataclass(value_type):
                for name, item in data[field.name].items():
                    missing += _fields_missing_from(value_type, item, f"{key}.{name}")
    return missing


def test_params_yaml_sets_every_config_field(raw: dict[str, Any]) -> None:
    # The loader refuses unknown keys and missing keys without defaults; this covers the
    # defaulted ones, so params.yaml stays the one place every knob is written down.
    missing = _fields_missing_from(Params, raw, "")
    optional_zip_member = {
        f"data.sources.{name}.member"
        for name, source in raw["data"]["sources"].items()
        if "member" not in source
    }
    assert SourceFile.__dataclass_fields__["member"].default is None
    assert set(missing) == optional_zip_member


def test_unknown_key_is_named(raw: dict[str, Any], tmp_path: Path) -> None:
    message = refusal(raw, tmp_path, "pretrain.train.lrr", 0.1)
    assert message.startswith("pretrain.train.lrr: unknown key")
    assert "'lr'" in message  # the valid keys are listed


def test_unknown_section_is_named(raw: dict[str, Any], tmp_path: Path) -> None:
    assert refusal(raw, tmp_path, "pretrian", {}).startswith("pretrian: unknown key")


def test_wrong_type_names_key_and_value(raw: dict[str, Any], tmp_path: Path) -> None:
    assert (
        refusal(raw, tmp_path, "pretrain.train.lr", "fast")
        == "pretrain.train.lr: expected a float, got 'fast'"
    )


def test_missing_key_is_named(raw: dict[str, Any], tmp_path: Path) -> None:
    assert refusal(raw, tmp_path, "spam.train.epochs", DELETE) == "spam.train.epochs: missing key"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("pretrain.train.batch_size", True, "pretrain.train.batch_size: expected an integer, got True"),
        ("pretrain.model.qkv_bias", 1, "pretrain.model.qkv_bias: expected true or false, got 1"),
        ("pretrain.train.lr", True, "pretrain.train.lr: expected a float, got True"),
        (
            "pretrain.train.max_steps",
            False,
            "pretrain.train.max_steps: expected an integer or null, got False",
        ),
        ("spam.train.batch_size", 8.0, "spam.train.batch_size: expected an integer, got 8.0"),
    ],
)
def test_bool_and_int_are_not_confused(
    raw: dict[str, Any], tmp_path: Path, key: str, value: Any, expected: str
) -> None:
    assert refusal(raw, tmp_path, key, value) == expected


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (
            "pretrain.train.device",
            "gpu",
            "pretrain.train.device: expected one of ['auto', 'cpu', 'cuda', 'mps'], got 'gpu'",
        ),
        (
            "spam.trainable",
            "everything",
            "spam.trainable: expected one of ['head', 'last_blocks', 'all', 'lora'], got 'everything'",
        ),
        (
            "spam.pooling",
            "max",
            "spam.pooling: expected one of ['last', 'first', 'mean', 'mean_all'], got 'max'",
        ),
        ("instruct.trainable", "some", "instruct.trainable: expected one of ['all', 'lora'], got 'some'"),
    ],
)
def test_bad_choice_lists_the_choices(
    raw: dict[str, Any], tmp_path: Path, key: str, value: str, expected: str
) -> None:
    """The one check of each word (the classifier takes them as given)."""
    assert refusal(raw, tmp_path, key, value) == expected


def test_a_moved_key_is_refused_naming_where_it_lives_now(raw: dict[str, Any], tmp_path: Path) -> None:
    message = refusal(raw, tmp_path, "spam.train.checkpoint_minutes", 5)
    assert message == "spam.train.checkpoint_minutes: moved to checkpoints.every_minutes"


def test_an_old_spelling_is_refused_naming_the_new_one(raw: dict[str, Any], tmp_path: Path) -> None:
    """One word for "train every weight" in both stages: instruct's former `full` is now `all`."""
    message = refusal(raw, tmp_path, "instruct.trainable", "full")
    assert message == "instruct.trainable: 'full' is now spelled 'all' (train every weight)"
    assert committed_params().instruct.trainable == "all"


@pytest.mark.parametrize("value", ["nan", float("inf")])
def test_non_finite_floats_are_refused(raw: dict[str, Any], tmp_path: Path, value: Any) -> None:
    assert refusal(raw, tmp_path, "spam.train.lr", value).startswith("spam.train.lr: expected a finite float")


def test_invalid_model_is_refused_at_load_time_naming_the_key(raw: dict[str, Any], tmp_path: Path) -> None:
    message = refusal(raw, tmp_path, "pretrain.model.emb_dim", 100)
    assert message.startswith("pretrain.model.emb_dim: 100 is not divisible by n_heads=12")


@pytest.mark.parametrize(
    ("key", "value", "prefix"),
    [
        ("spam.train.lr", -1.0, "spam.train.lr: expected a positive float"),
        ("pretrain.model.drop_rate", 1.0, "pretrain.model.drop_rate: expected a value in [0, 1)"),
        ("pretrain.model.preset", "gpt5", "pretrain.model.preset: unknown preset 'gpt5'"),
        ("instruct.train.max_steps", 0, "instruct.train.max_steps: expected a positive integer or null"),
    ],
)
def test_invalid_values_name_their_full_key(
    raw: dict[str, Any], tmp_path: Path, key: str, value: Any, prefix: str
) -> None:
    assert refusal(raw, tmp_path, key, value).startswith(prefix)


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="params.yaml"):
        load_params(tmp_path / "params.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pretrain: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(bad)
    bad.write_text("", encoding="utf-8")
    with pytest.raises(ConfigError, match="params.yaml: expected a mapping, got null"):
        load_params(bad)


def test_flatten_gives_dotted_keys(raw: dict[str, Any]) -> None:
    params = committed_params()
    flat = flatten(params.pretrain, "pretrain")
    assert flat["pretrain.train.lr"] == raw["pretrain"]["train"]["lr"]
    assert flat["pretrain.model.preset"] == raw["pretrain"]["model"]["preset"]
    assert all(key.startswith("pretrain.") for key in flat)
    assert not any(isinstance(value, dict) for value in flat.values())
    samples = flatten(params.eval, "eval")
    assert samples["eval.samples.greedy.prompt"] == raw["eval"]["samples"]["greedy"]["prompt"]


def test_model_config_round_trips_and_refuses_unknown_keys() -> None:
    config = ModelConfig.from_preset("gpt2-medium", context_length=256, num_classes=2)
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match=r"^model\.emb_dimm: unknown key"):
        ModelConfig.from_dict({**config.to_dict(), "emb_dimm": 8})
    with pytest.raises(ConfigError, match=r"^model\.num_classes: expected at least 2"):
        ModelConfig.from_dict({**config.to_dict(), "num_classes": 1})


@pytest.mark.slow
def test_every_stage_command_refuses_bad_params_before_any_work(raw: dict[str, Any], tmp_path: Path) -> None:
    # Run each stage exactly as dvc.yaml does, but from an empty folder outside the
    # project, so a stage that wrongly went ahead could not touch the project's outputs.
    # All at once: each start costs seconds of imports (torch, mlflow).
    stages = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    assert sorted(stages) == sorted(PIPELINE_STAGES)
    bad = edited(raw, tmp_path, "pretrain.train.lrr", 0.1)
    running = {}
    for stage in PIPELINE_STAGES:
        program, *args = shlex.split(stages[stage]["cmd"])
        assert program == "python", stages[stage]["cmd"]
        args = [str(PROJECT_ROOT / a) if a.startswith("stages/") else a for a in args]
        workdir = tmp_path / stage
        workdir.mkdir()
        running[stage] = subprocess.Popen(
            [sys.executable, *args, "--params", str(bad)],
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for stage, process in running.items():
        _, stderr = process.communicate(timeout=300)
        assert process.returncode != 0, stage
        assert "Traceback" not in stderr, f"{stage}: {stderr}"  # a clear message, not a crash
        assert "pretrain.train.lrr: unknown key" in stderr, f"{stage}: {stderr}"
        assert not any((tmp_path / stage).iterdir()), f"{stage} wrote files"


# Values that would train the model backwards, or fail only after hours of training: each is
# refused when params are loaded, naming the full key (issue: reliability).
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("pretrain.train.grad_clip", -1.0, "pretrain.train.grad_clip: expected a positive max gradient norm"),
        ("pretrain.train.min_lr", -0.01, "pretrain.train.min_lr: expected a value in [0, lr="),
        ("pretrain.train.min_lr", 0.01, "pretrain.train.min_lr: expected a value in [0, lr="),
        ("pretrain.train.weight_decay", -5.0, "pretrain.train.weight_decay: expected 0 or more"),
        ("spam.train.warmup_steps", -3, "spam.train.warmup_steps: expected 0 or more"),
        ("pretrain.model.context_length", 100000, "pretrain.model.context_length: expected 1 to 1024"),
        ("pretrain.data.max_length", 512, "pretrain.data.max_length: 512 exceeds model.context_length=256"),
        ("pretrain.sample.temperature", -1.0, "pretrain.sample.temperature: expected 0 (greedy)"),
        ("pretrain.sample.max_new_tokens", -1, "pretrain.sample.max_new_tokens: expected 0 or more"),
        ("eval.samples.greedy.top_k", 0, "eval.samples.greedy.top_k: expected a positive integer or null"),
        ("instruct.max_new_tokens", -1, "instruct.max_new_tokens: expected a positive integer"),
        ("instruct.allowed_max_length", 4096, "instruct.allowed_max_length: expected 30 to 1024"),
        (
            "preference.allowed_max_length",
            3,
            "preference.allowed_max_length: expected 30 to 1024, got 3: the prompt template alone takes 29 tokens",
        ),
        ("instruct.allowed_max_length", 29, "instruct.allowed_max_length: expected 30 to 1024, got 29"),
        ("spam.drop_rate", 1.5, "spam.drop_rate: expected a value in [0, 1)"),
        (
            "tokenize.spam.val_frac",
            0.4,
            "tokenize.spam.val_frac: expected a value in (0, 0.3), so that train_frac + val_frac stays "
            "below 1 and the test split is not empty, got 0.4",
        ),
        ("tokenize.spam.train_frac", 1.0, "tokenize.spam.train_frac: expected a value in (0, 1)"),
        ("tokenize.spam.max_rows", 0, "tokenize.spam.max_rows: expected a positive integer or null"),
        ("checkpoints.keep", 0, "checkpoints.keep: expected a positive integer"),
        ("checkpoints.every_minutes", -1, "checkpoints.every_minutes: expected a positive number or null"),
        (
            "tokenize.instruct.test_frac",
            0.2,
            "tokenize.instruct.test_frac: expected a value in (0, 0.15), so that train_frac + test_frac stays "
            "below 1 and the validation split is not empty, got 0.2",
        ),
        (
            "tokenize.instruct.max_records",
            0,
            "tokenize.instruct.max_records: expected a positive integer or null",
        ),
        ("tokenize.verdict.train_ratio", 1.0, "tokenize.verdict.train_ratio: expected a value in (0, 1)"),
        ("gpt2.batch_size", 0, "gpt2.batch_size: expected a positive integer"),
        ("corpus.name", "wikipedia", "corpus.name: expected one of ['verdict', 'gutenberg', 'files']"),
        ("corpus.gutenberg.max_books", 1, "corpus.gutenberg.max_books: expected an integer of at least 2"),
        ("corpus.gutenberg.books_per_author", 0, "corpus.gutenberg.books_per_author: expected a positive"),
        ("corpus.gutenberg.val_every", 1, "corpus.gutenberg.val_every: expected an integer of at least 2"),
        ("corpus.gutenberg.shard_tokens", 0, "corpus.gutenberg.shard_tokens: expected 65,536 to 268,435,456"),
        # Row 73: one file per token (4,416 files for 4 books) is refused, as is a buffer of GiBs.
        ("corpus.gutenberg.shard_tokens", 1, "corpus.gutenberg.shard_tokens: expected 65,536 to 268,435,456"),
        ("corpus.gutenberg.shard_tokens", 65_535, "corpus.gutenberg.shard_tokens: expected 65,536 to"),
        ("corpus.gutenberg.shard_tokens", 1 << 29, "corpus.gutenberg.shard_tokens: expected 65,536 to"),
        ("pretrain.train.eval_in_one_pass", True, "pretrain.train.eval_in_one_pass: needs rng: per_epoch"),
    ],
)
def test_values_that_cannot_work_are_refused_at_load_naming_the_key(
    raw: dict[str, Any], tmp_path: Path, key: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_params(edited(raw, tmp_path, key, value))
    assert str(info.value).startswith(message), str(info.value)


# Params that size memory or work, and values no training can use (issue 23, defect 4): refused at
# load, naming the key and the limit, before a download, an allocation or a minute of training.
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("pretrain.train.lr", 1e300, "pretrain.train.lr: expected a value in (0, 1], got 1e+300"),
        ("spam.train.weight_decay", 5.0, "spam.train.weight_decay: expected a value in [0, 1]"),
        ("pretrain.model.n_layers", 10**9, "pretrain.model.n_layers: expected 1 to 256, got 1000000000"),
        ("pretrain.model.emb_dim", 10**9, "pretrain.model.emb_dim: expected 1 to 8192, got 1000000000"),
        ("pretrain.model.n_heads", 10**9, "pretrain.model.n_heads: expected 1 to 8192, got 1000000000"),
        ("pretrain.train.batch_size", 10**12, "pretrain.train.batch_size: expected 1 to 65536"),
        ("instruct.train.eval_batch_size", 10**9, "instruct.train.eval_batch_size: expected 1 to 65536"),
        ("eval.batch_size", 10**9, "eval.batch_size: expected 1 to 65536"),
        ("gpt2.batch_size", 10**9, "gpt2.batch_size: expected 1 to 65536"),
        ("instruct.generate.batch_size", 10**9, "instruct.generate.batch_size: expected 1 to 65536"),
        ("spam.train.epochs", 10**9, "spam.train.epochs: expected 1 to 10000"),
        ("pretrain.train.eval_iter", 10**9, "pretrain.train.eval_iter: expected 1 to 10000"),
        ("spam.initial_eval_batches", 10**9, "spam.initial_eval_batches: expected 1 to 10000"),
        ("pretrain.sample.max_new_tokens", 10**9, "pretrain.sample.max_new_tokens: expected 0 to 10000"),
        ("instruct.max_new_tokens", 10**9, "instruct.max_new_tokens: expected 1 to 10000"),
        ("eval.samples.greedy.top_k", 10**6, "eval.samples.greedy.top_k: expected 1 to 50257 or null"),
        ("eval.samples.greedy.temperature", 1e-300, "eval.samples.greedy.temperature: expected 0 (greedy)"),
        ("eval.samples.greedy.temperature", 1e300, "eval.samples.greedy.temperature: expected 0 (greedy)"),
        ("spam.lora.rank", 10**9, "spam.lora.rank: expected 1 to 8192"),
        ("instruct.lora.alpha", 1e300, "instruct.lora.alpha: expected a value in (0, 10000]"),
        (
            "instruct.judge.timeout_s",
            1e300,
            "instruct.judge.timeout_s: expected a positive number of seconds",
        ),
        (
            "gpt2.weights.gpt2-small.sha256",
            "abc",
            "gpt2.weights.gpt2-small.sha256: expected 64 lowercase hex digits, got 'abc'",
        ),
        (
            "gpt2.weights.gpt2-small.size",
            0,
            "gpt2.weights.gpt2-small.size: expected a positive number of bytes",
        ),
        ("tracking.experiment", "", "tracking.experiment: expected a name of 1 to 250 characters, got ''"),
        ("tracking.experiment", "x" * 10_000, "tracking.experiment: expected a name of 1 to 250 characters"),
        ("tracking.sweep_variant", "v" * 10_000, "tracking.sweep_variant: expected a name of 1 to 250"),
        ("tracking.experiment", "gptlab\x00", "tracking.experiment: control character U+0000"),
        ("tracking.experiment", "gptlab\u202emoc", "tracking.experiment: control character U+202E"),
        ("tracking.sweep_variant", "a\nb", "tracking.sweep_variant: control character U+000A"),
        (
            "spam.trainable_blocks",
            999,
            "spam.trainable_blocks: expected 1 to 12 (the blocks of spam.base_model",
        ),
        (
            "spam.max_length",
            100000,
            "spam.max_length: expected 1 to 1024 (the context length of spam.base_model",
        ),
    ],
)
def test_params_that_size_memory_or_work_are_bounded_at_load(
    raw: dict[str, Any], tmp_path: Path, key: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_params(edited(raw, tmp_path, key, value))
    assert str(info.value).startswith(message), str(info.value)
    assert len(str(info.value)) < 400  # one line, even for a 10,000-character name


def test_fine_tune_limits_follow_the_base_model_the_params_build(raw: dict[str, Any], tmp_path: Path) -> None:
    """With gpt2.source pretrain the base model is pretrain.model: its blocks and context bound spam's."""
    data = copy.deepcopy(raw)
    data["gpt2"]["source"] = "pretrain"
    data["pretrain"]["model"].update(context_length=128, emb_dim=64, n_layers=2, n_heads=2)
    data["pretrain"]["data"].update(max_length=128, stride=128)
    data["spam"].update(trainable_blocks=2, max_length=128)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert load_params(path).spam.trainable_blocks == 2
    for key, value, message in [
        ("trainable_blocks", 3, "spam.trainable_blocks: expected 1 to 2 (the blocks of spam.base_model"),
        ("max_length", 129, "spam.max_length: expected 1 to 128 (the context length of spam.base_model"),
    ]:
        path.write_text(yaml.safe_dump({**data, "spam": {**data["spam"], key: value}}), encoding="utf-8")
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_params(path)


def test_every_profile_and_the_defaults_pass_the_bounds() -> None:
    from gptlab.experiments.profiles import profile_params

    for profile in sorted((PROJECT_ROOT / "profiles").glob("*.yaml")):
        assert isinstance(profile_params(profile, PROJECT_ROOT / "params.yaml"), Params), profile
    assert isinstance(committed_params(), Params)


def alias_bomb(levels: int = 9) -> str:
    """A 'billion laughs': each level an anchored list of nine aliases to the level below (9**levels)."""
    lines = ['  lol0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_in_params_is_refused_at_once_naming_the_file_and_the_limit(tmp_path: Path) -> None:
    from gptlab.experiments.profiles import load_overrides
    from gptlab.schema import MAX_YAML_NODES

    text = committed_params_text()
    params = tmp_path / "params.yaml"
    # Inside a section, as DVC (which parses params.yaml before any stage runs) spends minutes on it.
    params.write_text(text.replace("tokenize:\n", "tokenize:\n" + alias_bomb()), encoding="utf-8")
    profile = tmp_path / "profile.yaml"
    profile.write_text("gpt2:\n  batch_size: 4\n", encoding="utf-8")
    for read in (lambda: load_params(params), lambda: load_overrides(profile, params)):
        started = time.monotonic()
        with pytest.raises(ConfigError) as info:
            read()
        assert time.monotonic() - started < 5
        assert str(info.value).startswith(f"{params}: ")
        assert f"more than {MAX_YAML_NODES:,} nodes" in str(info.value)
    profile.write_text("pretrain:\n" + alias_bomb(), encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"{profile}: ")):
        load_overrides(profile, PROJECT_ROOT / "params.yaml")
    # Aliases that expand to little stay fine, and a recursive one is refused too.
    small = tmp_path / "small.yaml"
    small.write_text(text.replace("tracking:\n", "x: &x [1, 2]\ny: *x\ntracking:\n"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^x: unknown key"):
        load_params(small)
    small.write_text("a: &a [*a]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="refers to itself"):
        load_params(small)


def test_a_yaml_file_past_the_size_cap_is_refused_before_parsing(tmp_path: Path) -> None:
    """Parsing takes seconds a MB (a 50 MB string took minutes): the size is checked first."""
    from gptlab.experiments.profiles import load_overrides
    from gptlab.experiments.sweep import load_sweep
    from gptlab.schema import MAX_YAML_BYTES

    text = committed_params_text()
    huge = f"# {'x' * MAX_YAML_BYTES}\n"  # a comment: only the size is wrong with it
    params, profile, sweep = tmp_path / "params.yaml", tmp_path / "profile.yaml", tmp_path / "sweep.yaml"
    params.write_text(text + huge, encoding="utf-8")
    profile.write_text("gpt2:\n  batch_size: 4\n" + huge, encoding="utf-8")
    sweep.write_text("stage: spam-finetune\nvariants: {a: {}}\n" + huge, encoding="utf-8")
    refused = "larger than 1 MiB, far more than any params, profile or sweep file needs"
    with pytest.raises(ConfigError, match=re.escape(f"{params}: {refused}")):
        load_params(params)
    with pytest.raises(ConfigError, match=re.escape(f"{profile}: {refused}")):
        load_overrides(profile, PROJECT_ROOT / "params.yaml")
    with pytest.raises(ConfigError, match=re.escape(f"{sweep}: {refused}")):
        load_sweep(sweep, PROJECT_ROOT / "params.yaml")
    params.write_text(text + huge[: MAX_YAML_BYTES - len(text.encode()) - 1] + "\n", encoding="utf-8")
    assert load_params(params) == committed_params()  # at the cap: read


def test_the_configuration_chapter_names_the_yaml_limits() -> None:
    from gptlab.schema import MAX_YAML_BYTES, MAX_YAML_NODES

    chapter = (PROJECT_ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert f"{MAX_YAML_NODES:,} nodes" in chapter and f"{MAX_YAML_BYTES >> 20} MiB" in chapter


def test_params_that_are_not_a_file_are_named(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match=re.escape(f"{tmp_path}: is a directory, not a params file")):
        load_params(tmp_path)
