"""`gptlab sweep`: sweep files, the DVC queue, the table, the MLflow grouping; one tiny sweep end to end."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
import yaml

from gptlab.errors import GptlabError, InputError
from gptlab.experiments.dvc_commands import Dvc, QueueStatus
from gptlab.experiments.dvc_commands import ExperimentRow as Experiment
from gptlab.experiments.sweep import (
    Stopped,
    Sweep,
    coincidences,
    collect,
    load_sweep,
    queue,
    run_queue,
    settle_stopped,
    to_csv,
    to_markdown,
)
from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.lora import add_lora
from gptlab.pipeline.stage import Terminated
from gptlab.schema import ConfigError, flatten
from gptlab.tasks.classifier import count_trainable, make_classifier

from helpers import (
    PROJECT_ROOT,
    commit_as_fresh_clone,
    copy_project,
    dvc,
    dvc_exp_show,
    git,
    project_env,
    write_committed_params,
)

PARAMS = PROJECT_ROOT / "params.yaml"


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def with_table(data: dict[str, Any]) -> dict[str, Any]:
    """A sweep file's data with the `table:` of the committed sweep file of its stage (sweeps/<task>.yaml)."""
    committed = PROJECT_ROOT / "sweeps" / f"{data['stage'].removesuffix('-finetune')}.yaml"
    return {**data, "table": yaml.safe_load(committed.read_text())["table"]}


def changes(sweep: Sweep) -> dict[str, dict[str, Any]]:
    """What each variant of the file itself sets, flat."""
    return {variant: flatten(overrides) for variant, overrides in sweep.file.variants.items()}


def table_rows(sweep: Sweep) -> list[dict[str, Any]]:
    """The table's rows of variants DVC does not know yet: what they will run with, no results."""
    return collect(sweep, {}, PROJECT_ROOT, {})


def test_committed_spam_sweep_holds_the_books_variants() -> None:
    sweep = load_sweep(PROJECT_ROOT / "sweeps" / "spam.yaml", PARAMS)
    assert sweep.file.stage == "spam-finetune" and sweep.name == "spam"
    variants = sweep.variants
    # Every variant sets every swept key: params.yaml's value where the file gives none.
    swept = {key for own in changes(sweep).values() for key in own}
    assert all(swept <= set(overrides) for overrides in variants.values())
    trainables = {(v["spam.trainable"], v["spam.trainable_blocks"]) for v in variants.values()}
    assert {("head", 1), ("last_blocks", 1), ("last_blocks", 2), ("all", 1), ("lora", 1)} <= trainables
    assert {"last", "first", "mean", "mean_all"} == {v["spam.pooling"] for v in variants.values()}
    assert changes(sweep)["lora_appendix_e"] == {
        "spam.trainable": "lora",
        "spam.lora.rank": 16,
        "spam.lora.alpha": 16,
        "spam.train.lr": 0.0008,
    }
    assert variants["last_block"]["spam.train.lr"] == 5e-05  # the schema's float, not YAML's '5e-05'
    assert set(sweep.file.notes) <= set(sweep.variants)
    load_sweep(PROJECT_ROOT / "sweeps" / "instruct.yaml", PARAMS)


def test_on_the_smoke_profile_each_spam_variant_is_what_its_name_says() -> None:
    """The smoke profile trains every layer (spam.trainable: all): the variants override it, each its own way."""
    sweep = load_sweep(
        PROJECT_ROOT / "sweeps" / "spam.yaml", PARAMS, PROJECT_ROOT / "profiles" / "smoke.yaml"
    )
    assert sweep.name == "spam-smoke" and sweep.profile == "smoke"
    # `all` is all_layers' setting: the others take params.yaml's; the tiny model's lr is no variant's.
    assert sweep.profile_overridden == {"spam.trainable": "last_blocks"}
    trains = {v: (p["spam.trainable"], p["spam.trainable_blocks"]) for v, p in sweep.effective.items()}
    assert trains["last_block"] == ("last_blocks", 1) and trains["last_two_blocks"] == ("last_blocks", 2)
    assert trains["all_layers"] == ("all", 1)
    assert sweep.effective["last_block"]["spam.train.lr"] == 0.002  # the smoke profile's
    assert sweep.effective["lora_appendix_e"]["spam.train.lr"] == 0.0008
    assert sweep.effective["lora"]["gpt2.source"] == "pretrain"  # the profile's other keys stay
    assert sweep.effective["lora"]["spam.train.epochs"] == 4
    # Each variant differs from chapter 6's setting in exactly what the file says it changes.
    base = sweep.effective["last_block"]
    for variant, params in sweep.effective.items():
        differ = {k for k in params if params[k] != base[k] and not k.startswith("tracking.")}
        assert differ == {k for k, v in changes(sweep)[variant].items() if base[k] != v}, variant
    # The table's rows differ, and say which two train the same model under gpt2.source: pretrain.
    text = to_markdown(sweep, table_rows(sweep), commit=None, csv_name="x.csv")
    table = [line.split(" | ", 1)[1] for line in text.splitlines() if line.startswith("| `")]
    assert len(set(table)) == len(table) == 12
    assert (
        "| `last_block` | last 1 block + final norm + head | models/pretrain (as gpt2-small) | last |" in text
    )
    said = coincidences(sweep, sweep.effective)
    assert [p for p in said if "train the same model" in p] == [
        "`last_block` and `gpt2_medium` train the same model: with `gpt2.source: pretrain` every base "
        "model is this pipeline's own models/pretrain, converted by load-gpt2 under each name."
    ]
    assert "`last_block` and `gpt2_medium` train the same model" in text
    assert "The `smoke` profile's `spam.trainable` is a setting this sweep compares" in text


TABLE = {"settings": [], "trains": {}, "described": {}, "columns": []}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"stage": "spam-finetune", "variants": {"a": {}}, "grid": {}}, "s.yaml: grid: unknown key"),
        ({"stage": "pretrain", "variants": {"a": {}}}, "s.yaml: stage: expected one of"),
        ({"stage": "spam-finetune", "variants": {}}, "variants: expected a mapping"),
        ({"stage": "spam-finetune", "variants": [1]}, "variants: expected a mapping, got a list"),
        ({"stage": "spam-finetune", "variants": {"Bad-Name": {}}}, "variants.Bad-Name: a variant name"),
        ({"stage": "spam-finetune", "variants": {"a": 3}}, "variants.a: expected a mapping, got 3"),
        (
            {"stage": "spam-finetune", "variants": {"a": {"spam": {"trainable": "some"}}}},
            "s.yaml: variants.a: spam.trainable: expected one of",
        ),
        (
            {"stage": "spam-finetune", "variants": {"a": {"spam": {"lora": {"rank": 0}}}}},
            "variants.a: spam.lora.rank: expected a positive integer",
        ),
        (
            {"stage": "spam-finetune", "variants": {"a": {"tracking": {"sweep": "x"}}}},
            "variants.a: tracking.sweep is set by the sweep itself",
        ),
        ({"stage": "spam-finetune", "variants": {"a": {}}, "notes": {"b": "x"}}, "notes: 'b' is not one"),
        ({"stage": "spam-finetune", "variants": {"a": {}}, "notes": {"a": 1}}, "notes.a: expected a string"),
        ({"stage": "spam-finetune", "base": [1], "variants": {"a": {}}}, "base: expected a mapping"),
        (["stage"], "s.yaml: expected a mapping with `stage` and `variants`"),
        (
            {
                "stage": "spam-finetune",
                "variants": {"a": {}},
                "table": {**TABLE, "described": {"pooling": {"param": "spam.pooling"}}},
            },
            "s.yaml: table.described.pooling.param: expected one of `settings`",
        ),
        (
            {"stage": "spam-finetune", "variants": {"a": {}}, "table": {**TABLE, "settings": "spam.pooling"}},
            "s.yaml: table.settings: expected a list, got 'spam.pooling'",
        ),
        (
            {"stage": "spam-finetune", "variants": {"a": {}}, "table": {**TABLE, "columns": [{"name": "x"}]}},
            r"s.yaml: table.columns\[0\].title: missing key",
        ),
        (
            {
                "stage": "spam-finetune",
                "variants": {"a": {}},
                "table": {**TABLE, "settings": ["spam.polling"]},
            },
            "s.yaml: table.settings: 'spam.polling' is not a param of params.yaml",
        ),
    ],
)
def test_sweep_file_mistakes_are_refused_naming_the_key_and_the_file(
    tmp_path: Path, data: Any, message: str
) -> None:
    with pytest.raises((InputError, ConfigError), match=message.replace(".", r"\.").replace("(", r"\(")):
        load_sweep(write_yaml(tmp_path / "s.yaml", data), PARAMS)


def test_variants_lay_their_overrides_over_the_base_and_the_profile(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "mine.yaml",
        {
            "stage": "spam-finetune",
            "base": {"spam": {"train": {"epochs": 2}}},
            "variants": {
                "plain": {},
                "lora": {"spam": {"trainable": "lora", "train": {"epochs": 3}}},
                "first": {"spam": {"pooling": "first"}},
            },
        },
    )
    profile = write_yaml(
        tmp_path / "ours.yaml",
        {
            "gpt2": {"source": "pretrain"},
            "spam": {"trainable": "lora", "pooling": "mean", "train": {"lr": 0.01, "epochs": 7}},
        },
    )
    sweep = load_sweep(path, PARAMS, profile)
    assert sweep.name == "mine-ours" and load_sweep(path, PARAMS, profile, "theirs").name == "theirs"
    # Every swept key is pinned: the profile's trainable is lora's, so plain takes params.yaml's;
    # the base's epochs win over the profile's; the profile's pooling is no variant's, so it stays.
    assert sweep.variants["plain"] == {
        "gpt2.source": "pretrain",
        "spam.trainable": "last_blocks",
        "spam.pooling": "mean",
        "spam.train.lr": 0.01,
        "spam.train.epochs": 2,
    }
    assert sweep.profile_overridden == {"spam.trainable": "last_blocks"}
    assert sweep.variants["lora"]["spam.train.epochs"] == 3 and changes(sweep)["lora"] == {
        "spam.trainable": "lora",
        "spam.train.epochs": 3,
    }
    assert sweep.effective["first"]["spam.trainable_blocks"] == 1  # params.yaml's, untouched by anyone
    assert sweep.experiment("lora") == "mine-ours-lora"


@pytest.mark.parametrize(
    ("variants", "profile", "message"),
    [
        # b sets params.yaml's own value.
        ({"a": {}, "b": {"spam": {"trainable": "last_blocks"}}}, None, "variants a and b run with"),
        # The profile's trainable is b's setting, so a takes params.yaml's, which b sets as well.
        (
            {"a": {}, "b": {"spam": {"trainable": "last_blocks"}}},
            {"spam": {"trainable": "last_blocks", "train": {"epochs": 4}}},
            "variants a and b run with the same params on the p profile",
        ),
    ],
)
def test_variants_that_would_run_with_the_same_params_are_refused_naming_both(
    tmp_path: Path, variants: dict[str, Any], profile: dict[str, Any] | None, message: str
) -> None:
    path = write_yaml(tmp_path / "twins.yaml", {"stage": "spam-finetune", "variants": variants})
    with pytest.raises(InputError, match=message):
        load_sweep(path, PARAMS, write_yaml(tmp_path / "p.yaml", profile) if profile else None)


class FakeDvc:
    """The dvc commands a sweep runs, answered from a script of the variants' states, one per poll."""

    def __init__(self, states: list[dict[str, str] | GptlabError], workers: tuple[int, int] = (1, 0)) -> None:
        self.states = states
        self.calls: list[tuple[str, ...]] = []  # the commands that change the queue
        self.queries: list[tuple[str, ...]] = []  # those that read it
        self._workers = workers

    def __call__(self, *args: str, check: bool = True) -> str:
        self.calls.append(args)
        if args[:2] == ("exp", "remove"):
            self.states = [{}] + self.states[1:]
        return ""

    def _next(self) -> dict[str, str]:
        state = self.states[0] if len(self.states) == 1 else self.states.pop(0)
        if isinstance(state, GptlabError):
            raise state
        return state

    def experiments(self) -> dict[str, Experiment]:
        self.queries.append(("exp", "show", "--json"))
        return {
            name: Experiment(name, value, f"rev-{name}", {"spam.trainable": "all"})
            for name, value in self._next().items()
        }

    def queue_status(self) -> QueueStatus:
        self.queries.append(("queue", "status"))
        return QueueStatus(self._next(), self._workers)


@pytest.fixture
def tiny_sweep(tmp_path: Path) -> Sweep:
    variants = {"a": {}, "b": {"spam": {"trainable": "lora"}}}
    return load_sweep(
        write_yaml(tmp_path / "s.yaml", {"stage": "spam-finetune", "variants": variants}), PARAMS
    )


def test_names_taken_by_earlier_experiments_need_replace(
    tiny_sweep: Sweep, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeDvc([{"s-a": "success"}])
    with pytest.raises(GptlabError, match="pass --replace"):
        queue(tiny_sweep, fake)
    assert not fake.calls

    fake = FakeDvc([{"s-a": "failed"}, {}])
    queue(tiny_sweep, fake, replace=True)
    assert fake.calls[0] == ("exp", "remove", "s-a")
    queued = [c for c in fake.calls if c[:3] == ("exp", "run", "--queue")]
    assert [c[4] for c in queued] == ["s-a", "s-b"] and all(c[-1] == "spam-finetune" for c in queued)
    # Each variant pins the swept key and carries the sweep's tags.
    assert queued[0][5:-1] == (
        "-S",
        'spam.trainable="last_blocks"',
        "-S",
        'tracking.sweep="s"',
        "-S",
        'tracking.sweep_variant="a"',
    )
    assert 'spam.trainable="lora"' in queued[1]
    out = capsys.readouterr().out
    assert "removed the earlier s-a" in out and "queued s-a: the base settings" in out
    assert 'queued s-b: spam.trainable="lora"' in out

    with pytest.raises(GptlabError, match="are running"):
        queue(tiny_sweep, FakeDvc([{"s-b": "running"}]), replace=True)


class SignalledDvc(FakeDvc):
    """A FakeDvc whose second `dvc exp run --queue` gets a real signal sent to this process while it runs."""

    def __init__(self, signum: int, removal_fails: bool = False) -> None:
        super().__init__([{}])
        self.signum, self.removal_fails = signum, removal_fails

    def __call__(self, *args: str, check: bool = True) -> str:
        super().__call__(*args, check=check)
        if args[:3] == ("exp", "run", "--queue") and args[4] == "s-b":
            os.kill(os.getpid(), self.signum)  # the command in flight goes on: its handler only records it
        if args[:2] == ("queue", "remove") and self.removal_fails:
            raise GptlabError("`dvc queue remove s-a s-b ...` failed (exit 255): ERROR: lock held")
        return ""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_sweep_stopped_while_queuing_removes_what_it_queued(
    tiny_sweep: Sweep, signum: int, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {
        signal.SIGTERM: signal.getsignal(signal.SIGTERM),
        signal.SIGINT: signal.getsignal(signal.SIGINT),
    }
    fake = SignalledDvc(signum)
    with pytest.raises(Stopped) as stopped:
        queue(tiny_sweep, fake)
    # The queuing in flight finished, then what was queued left the queue, and nothing was started.
    assert fake.calls[-1] == ("queue", "remove", "s-a", "s-b")
    assert not [c for c in fake.calls if c[:2] == ("queue", "start")]
    assert stopped.value.signum == signum and stopped.value.note == "removed s-a, s-b from DVC's queue"
    assert {sig: signal.getsignal(sig) for sig in before} == before  # the handlers are back as they were
    assert "queued s-b" in capsys.readouterr().out


def test_a_stopped_sweep_that_cannot_remove_its_tasks_says_the_command_that_does(tiny_sweep: Sweep) -> None:
    with pytest.raises(Stopped) as stopped:
        queue(tiny_sweep, SignalledDvc(signal.SIGTERM, removal_fails=True))
    assert stopped.value.note.startswith("s-a, s-b are still queued (`dvc queue remove")
    assert stopped.value.note.endswith("remove them with `dvc queue remove s-a s-b`")


def test_a_failure_while_queuing_removes_what_was_queued(tiny_sweep: Sweep) -> None:
    class FailingDvc(FakeDvc):
        def __call__(self, *args: str, check: bool = True) -> str:
            super().__call__(*args, check=check)
            if args[:3] == ("exp", "run", "--queue") and args[4] == "s-b":
                raise GptlabError("`dvc exp run --queue --name ...` failed (exit 1): ERROR: no space left")
            return ""

    fake = FailingDvc([{}])
    with pytest.raises(GptlabError, match=r"no space left; removed s-a from DVC's queue$"):
        queue(tiny_sweep, fake)
    assert fake.calls[-1] == ("queue", "remove", "s-a")


def test_the_rerun_after_a_stopped_sweep_names_the_command_that_clears_its_queued_tasks(
    tiny_sweep: Sweep,
) -> None:
    with pytest.raises(GptlabError) as refused:
        queue(tiny_sweep, FakeDvc([{"s-a": "queued", "s-b": "queued"}]))
    assert "`dvc queue remove s-a s-b` removes them" in str(refused.value)
    assert "pass --replace" in str(refused.value)
    with pytest.raises(GptlabError) as refused:
        queue(tiny_sweep, FakeDvc([{"s-a": "success"}]))
    assert "dvc queue remove" not in str(refused.value)


def test_the_queue_runs_the_jobs_asked_for_until_every_variant_is_done(
    tiny_sweep: Sweep, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeDvc(
        [
            {"s-a": "queued", "s-b": "queued"},
            {"s-a": "running", "s-b": "queued"},
            {"s-a": "success", "s-b": "queued"},
            {"s-a": "success", "s-b": "failed"},
        ]
    )
    found = run_queue(tiny_sweep, fake, jobs=3, poll_seconds=0)
    assert {name: e.state for name, e in found.items()} == {"s-a": "success", "s-b": "failed"}
    assert [c for c in fake.calls if c[:2] == ("queue", "start")] == [("queue", "start", "--jobs", "3")]
    assert "s-b: failed (2/2 done)" in capsys.readouterr().out
    # The wait polls the queue (no experiment's files read out of git); the experiments are read once.
    assert fake.queries == [("queue", "status")] * 4 + [("exp", "show", "--json")]


def test_a_passing_queue_status_failure_while_workers_start_is_polled_again(tiny_sweep: Sweep) -> None:
    vanished = GptlabError(
        "`dvc queue status ...` failed (exit 1): directory '.dvc/tmp/exps/x/.dvc' does not exist"
    )
    fake = FakeDvc([{"s-a": "running", "s-b": "queued"}, vanished, {"s-a": "success", "s-b": "success"}])
    found = run_queue(tiny_sweep, fake, jobs=2, poll_seconds=0)
    assert {name: e.state for name, e in found.items()} == {"s-a": "success", "s-b": "success"}

    with pytest.raises(GptlabError, match="does not exist"):
        run_queue(tiny_sweep, FakeDvc([{"s-a": "running"}, *[vanished] * 6]), jobs=2, poll_seconds=0)


def test_a_queue_without_workers_is_an_error_not_a_hang(tiny_sweep: Sweep) -> None:
    fake = FakeDvc([{"s-a": "queued", "s-b": "queued"}], workers=(0, 0))
    with pytest.raises(GptlabError, match="no worker"):
        run_queue(tiny_sweep, fake, jobs=1, poll_seconds=0)


CHAPTER_6 = {  # the effective params a row holds (those the table reads)
    "spam.trainable": "last_blocks",
    "spam.trainable_blocks": 1,
    "spam.lora.rank": 16,
    "spam.lora.alpha": 16,
    "spam.base_model": "gpt2-small",
    "spam.base_weights": "pretrained",
    "gpt2.source": "huggingface",
    "spam.pooling": "last",
    "spam.max_length": None,
}


def test_table_shows_each_variants_effective_settings_and_marks_failures(tmp_path: Path) -> None:
    variants = {"a": {}, "b": {"spam": {"trainable": "lora", "train": {"lr": 0.001}}}}
    sweep = load_sweep(
        write_yaml(tmp_path / "s.yaml", with_table({"stage": "spam-finetune", "variants": variants})), PARAMS
    )
    metrics = {"reports/spam/metrics.json": {"train": {"accuracy": 0.5}, "test": {"accuracy": 0.25}}}
    found = {
        "s-a": Experiment("s-a", "success", "no-such-rev", {**CHAPTER_6, "spam.train.lr": 5e-05}, metrics),
        "s-b": Experiment(
            "s-b", "failed", None, {**CHAPTER_6, "spam.trainable": "lora", "spam.train.lr": 0.001}
        ),
    }
    rows = collect(sweep, found, tmp_path, {"a": {"wall_seconds": 3.21, "run_id": "r1"}})
    parsed = list(csv.DictReader(io.StringIO(to_csv(rows))))
    # Every param the settings read, then the others that differ; the stage's values; the MLflow run.
    assert list(parsed[0]) == [
        "variant",
        "experiment",
        "status",
        *CHAPTER_6,
        "spam.train.lr",
        "trainable_params",
        "train_accuracy",
        "val_accuracy",
        "test_accuracy",
        "wall_seconds",
        "mlflow_run_id",
    ]
    assert parsed[0]["spam.trainable"] == "last_blocks" and parsed[1]["spam.train.lr"] == "0.001"
    assert parsed[0]["spam.max_length"] == "" and parsed[0]["trainable_params"] == ""  # no commit to read
    assert parsed[0]["test_accuracy"] == "0.25" and parsed[0]["wall_seconds"] == "3.21"
    assert parsed[0]["mlflow_run_id"] == "r1" and parsed[1]["mlflow_run_id"] == ""
    assert parsed[1]["status"] == "failed" and parsed[1]["test_accuracy"] == ""
    rows[0]["trainable_params"] = 1234
    markdown = to_markdown(sweep, rows, commit="abc1234", csv_name="s.csv")
    assert markdown.startswith("# Sweep `s`: spam-finetune, 2 variants\n\nWritten by `gptlab sweep` from `")
    assert "baseline commit abc1234; 1 of 2 variants succeeded." in markdown
    assert (
        "| variant | trains | base model | pooling | max length | `spam.train.lr` | trainable params | "
        "train acc | val acc | test acc | training time | status |\n|" + "---|" * 12
    ) in markdown
    assert (
        "| `a` | last 1 block + final norm + head | OpenAI's gpt2-small | last | longest training message "
        "| 5e-05 | 1,234 | 50.00 % | — | 25.00 % | 3.2 s | success |"
    ) in markdown
    assert "| `b` | LoRA rank 16, alpha 16 | OpenAI's gpt2-small |" in markdown
    assert "failed (`dvc queue logs s-b`)" in markdown
    assert "tags.gptlab.sweep = 's'" in markdown
    assert "train the same model" not in markdown  # OpenAI's gpt2-small is no stand-in

    # With our own pretrained model as every base, gpt2-medium names the same weights: the table says so.
    ours = {**CHAPTER_6, "gpt2.source": "pretrain", "spam.train.lr": 5e-05}
    found = {
        "s-a": Experiment("s-a", "success", None, ours),
        "s-b": Experiment("s-b", "success", None, {**ours, "spam.base_model": "gpt2-medium"}),
    }
    markdown = to_markdown(sweep, collect(sweep, found, tmp_path, {}), commit=None, csv_name="s.csv")
    assert "| `b` | last 1 block + final norm + head | models/pretrain (as gpt2-medium) |" in markdown
    assert "`a` and `b` train the same model: with `gpt2.source: pretrain`" in markdown
    # A variant DVC does not know is a row all the same, with what it would run with.
    rows = collect(sweep, {}, tmp_path, {})
    assert [row["status"] for row in rows] == ["missing", "missing"] and rows[1]["spam.trainable"] == "lora"


def test_the_table_of_a_sweep_with_notes_and_a_description(tmp_path: Path) -> None:
    data = {
        "stage": "instruct-finetune",
        "description": "Every weight against LoRA.",
        "variants": {"all": {}, "lora": {"instruct": {"trainable": "lora"}}},
        "notes": {"lora": "appendix E | adapters"},
    }
    sweep = load_sweep(write_yaml(tmp_path / "i.yaml", with_table(data)), PARAMS)
    markdown = to_markdown(sweep, table_rows(sweep), commit=None, csv_name="i.csv")
    assert markdown.startswith("# Sweep `i`: instruct-finetune, 2 variants\n\nEvery weight against LoRA.\n\n")
    assert (
        "| variant | trains | base model | max length | trainable params | val loss | test loss | ROUGE-L F1 "
        "| training time | status | note |"
    ) in markdown
    assert (
        "| `all` | every weight | OpenAI's gpt2-medium | 1024 tokens | — | — | — | — | — | missing |  |"
        in markdown
    )
    assert "| missing | appendix E \\| adapters |" in markdown


def test_a_sweep_file_without_a_table_shows_the_params_that_differ(tmp_path: Path) -> None:
    variants = {"a": {}, "b": {"spam": {"pooling": "first"}}}
    sweep = load_sweep(
        write_yaml(tmp_path / "s.yaml", {"stage": "spam-finetune", "variants": variants}), PARAMS
    )
    rows = table_rows(sweep)
    assert list(rows[0]) == [
        "variant",
        "experiment",
        "status",
        "spam.pooling",
        "wall_seconds",
        "mlflow_run_id",
    ]
    markdown = to_markdown(sweep, rows, commit=None, csv_name="s.csv")
    assert "| variant | `spam.pooling` | training time | status |\n|---|---|---|---|\n" in markdown
    assert "| `b` | first | — | missing |" in markdown


def test_sweep_outside_a_git_repository_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gptlab.cli.main import main

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "sweeps").mkdir()
    write_yaml(tmp_path / "sweeps" / "s.yaml", {"stage": "spam-finetune", "variants": {"a": {}}})
    write_committed_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert main(["sweep", "s"]) == 2
    assert "which start from a git commit" in capsys.readouterr().err


def test_a_sweep_on_a_profile_that_sets_a_swept_key_runs_each_variant_as_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gptlab sweep --profile`: the profile trains every layer, yet each variant trains what it says."""
    from gptlab.cli.main import main

    (tmp_path / "sweeps").mkdir()
    sweep_file = write_yaml(
        tmp_path / "sweeps" / "blocks.yaml",
        with_table(
            {
                "stage": "spam-finetune",
                "variants": {
                    "last_block": {},
                    "last_two_blocks": {"spam": {"trainable_blocks": 2}},
                    "all_layers": {"spam": {"trainable": "all"}},
                },
            }
        ),
    )
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "everything.yaml").write_text("spam:\n  trainable: all\n")
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    write_committed_params(tmp_path)
    git(tmp_path, "init", "-q")
    dvc(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "a project")
    monkeypatch.chdir(tmp_path)

    # What each variant is queued with: the swept keys pinned, over the profile's.
    everything = tmp_path / "profiles" / "everything.yaml"
    sweep = load_sweep(sweep_file, tmp_path / "params.yaml", everything, name="blocks")
    fake = FakeDvc([{}])
    queue(sweep, fake)
    queued = {c[4]: c for c in fake.calls if c[:3] == ("exp", "run", "--queue")}
    assert {"-S", 'spam.trainable="last_blocks"', "spam.trainable_blocks=1"} <= set(
        queued["blocks-last_block"]
    )
    assert 'spam.trainable="last_blocks"' in queued["blocks-last_two_blocks"]

    # The command itself, writing the table of the (not yet run) variants: three distinct rows.
    assert main(["sweep", "blocks", "--profile", "everything", "--collect", "--out", "tables"]) == 1
    err = capsys.readouterr().err
    assert "note: The `everything` profile's `spam.trainable` is a setting this sweep compares" in err
    assert 'the variants that set no `spam.trainable` take params.yaml\'s `"last_blocks"` instead' in err
    rows = {row["variant"]: row for row in csv.DictReader((tmp_path / "tables/blocks-everything.csv").open())}
    assert [(rows[v]["spam.trainable"], rows[v]["spam.trainable_blocks"]) for v in rows] == [
        ("last_blocks", "1"),
        ("last_blocks", "2"),
        ("all", "1"),
    ]
    markdown = (tmp_path / "tables/blocks-everything.md").read_text()
    for variant, trains in [
        ("last_block", "last 1 block + final norm + head"),
        ("last_two_blocks", "last 2 blocks + final norm + head"),
        ("all_layers", "every weight"),
    ]:
        assert f"| `{variant}` | {trains} | OpenAI's gpt2-small | last |" in markdown

    # A variant that adds nothing to the profile's setting is refused before anything is queued.
    write_yaml(
        sweep_file,
        {"stage": "spam-finetune", "variants": {"mine": {}, "again": {"spam": {"pooling": "last"}}}},
    )
    assert main(["sweep", "blocks", "--profile", "everything"]) == 2
    assert (
        "variants mine and again run with the same params on the everything profile"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "mlflow.db").exists()


# --------------------------------------------------------------------------- end to end

# Smaller than the smoke profile: a 1-layer model pretrained for 2 steps, 16 messages per split.
TINY_PARAMS = {
    "tracking": {"experiment": "gptlab-sweep-test", "system_metrics": False, "log_models": False},
    "checkpoints": {"every_steps": 20},
    "tokenize": {"spam": {"max_rows": 16}, "instruct": {"max_records": 8}},
    "pretrain": {
        "model": {"context_length": 128, "emb_dim": 32, "n_layers": 1, "n_heads": 2},
        "data": {"max_length": 128, "stride": 128},
        "train": {"epochs": 1, "max_steps": 2},
        "sample": {"max_new_tokens": 4},
    },
    "gpt2": {"source": "pretrain"},
    "spam": {"trainable": "all", "train": {"epochs": 1, "lr": 0.002, "eval_freq": 1, "eval_iter": 1}},
}
# Two variants, so that `--jobs 2` runs them in one round; between them they change two keys.
VARIANTS = {
    "all": {},
    "lora": {"spam": {"trainable": "lora", "lora": {"rank": 4, "alpha": 8}, "pooling": "mean_all"}},
}


def expected_trainable() -> dict[str, int]:
    """The tiny classifier's trainable parameters: all of them, or LoRA's (load-gpt2 adds qkv biases)."""
    cfg = ModelConfig(vocab_size=50257, context_length=128, emb_dim=32, n_heads=2, n_layers=1, qkv_bias=True)
    counts = {}
    for variant in ("all", "lora"):
        with torch.device("meta"):
            model = make_classifier(build_gpt(cfg), 2, trainable=variant, trainable_blocks=1, seed=0)
            if variant == "lora":
                add_lora(model, 4, 8)
        counts[variant] = count_trainable(model)
    return counts


@pytest.mark.slow
def test_sweep_through_the_dvc_queue_writes_the_table_and_groups_the_mlflow_runs(
    tmp_path: Path, shared_data: Path, isolated_tools: str
) -> None:
    """A fresh clone, nothing run, a profile: the shared stages run once, then the variants in DVC's queue."""
    project = tmp_path / "project"
    copy_project(project)
    write_yaml(project / "profiles" / "tiny.yaml", TINY_PARAMS)
    write_yaml(project / "sweeps" / "tiny.yaml", with_table({"stage": "spam-finetune", "variants": VARIANTS}))
    env = project_env(project, OMP_NUM_THREADS="1")  # tiny models: threads only add overhead on a shared CPU
    commit_as_fresh_clone(project)

    gptlab = [str(Path(sys.executable).with_name("gptlab")), "sweep", "tiny", "--profile", "tiny"]
    gptlab += ["--name", "check"]
    proc = subprocess.run(
        [*gptlab, "--jobs", "2"], cwd=project, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "note:" not in proc.stderr, proc.stderr  # no variant trains the same model as another
    shared = "running the shared stages once for every variant (download, tokenize, pretrain, load-gpt2;"
    assert shared in proc.stdout, proc.stdout

    # The table: one row per variant, its params, trainable count, accuracies and time.
    rows = {row["variant"]: row for row in csv.DictReader((project / "reports/sweeps/check.csv").open())}
    assert set(rows) == set(VARIANTS)
    trainable = expected_trainable()
    for variant, row in rows.items():
        assert row["status"] == "success" and row["experiment"] == f"check-{variant}"
        assert row["gpt2.source"] == "pretrain"
        assert int(row["trainable_params"]) == trainable[variant], variant
        for split in ("train", "val", "test"):
            assert 0.0 <= float(row[f"{split}_accuracy"]) <= 1.0
        assert float(row["wall_seconds"]) > 0
    assert [rows[v]["spam.trainable"] for v in VARIANTS] == ["all", "lora"]
    assert [rows[v]["spam.pooling"] for v in VARIANTS] == ["last", "mean_all"]
    markdown = (project / "reports/sweeps/check.md").read_text()
    assert all(f"| `{variant}` |" in markdown for variant in VARIANTS)

    # DVC lists every variant as an experiment, with the sweep's params.
    shown = json.loads(dvc_exp_show(project, "--json", env=env))
    experiments = {e["name"]: e for row in shown for e in (row.get("experiments") or [])}
    assert {f"check-{v}" for v in VARIANTS} <= set(experiments)
    params = experiments["check-lora"]["revs"][0]["data"]["params"]["params.yaml"]["data"]
    assert params["tracking"]["sweep"] == "check" and params["spam"]["lora"]["rank"] == 4

    # MLflow: one run per variant, tagged with the sweep, named after the variant.
    client = mlflow.MlflowClient(tracking_uri=isolated_tools)
    experiment = client.get_experiment_by_name("gptlab-sweep-test")
    tagged = client.search_runs([experiment.experiment_id], filter_string="tags.`gptlab.sweep` = 'check'")
    runs = [r for r in tagged if "gptlab.stage" in r.data.tags]
    assert sorted(r.data.tags["gptlab.sweep_variant"] for r in runs) == sorted(VARIANTS)
    # Each variant is a pipeline run of its own, its stage's run nested under it.
    parents = {r.info.run_id: r for r in tagged if r.data.tags.get("gptlab.role") == "pipeline"}
    for run in runs:
        parent = parents[run.data.tags["mlflow.parentRunId"]]
        variant = run.data.tags["gptlab.sweep_variant"]
        assert parent.info.run_name == f"pipeline · {variant}" and "spam/test_accuracy" in parent.data.metrics
    assert len(parents) == len(VARIANTS)
    assert {r.info.run_name for r in runs} == {f"spam-finetune · {v}" for v in VARIANTS}
    assert {r.info.status for r in runs} == {"FINISHED"}
    by_variant = {r.data.tags["gptlab.sweep_variant"]: r for r in runs}
    for variant, row in rows.items():
        run = by_variant[variant]
        assert row["mlflow_run_id"] == run.info.run_id
        assert float(row["wall_seconds"]) == pytest.approx(float(run.data.tags["gptlab.wall_seconds"]))
        assert int(run.data.tags["gptlab.trainable_params"]) == trainable[variant]
    # Issue 65, item 18: the variants took the shared stages from DVC's run-cache; pretrain ran once,
    # before them (each variant ran it again before), and the scratch worktree is gone.
    pretrain = client.search_runs(
        [experiment.experiment_id], filter_string="tags.`gptlab.stage` = 'pretrain'"
    )
    assert len(pretrain) == 1
    for variant in VARIANTS:
        logs = dvc(project, "queue", "logs", f"check-{variant}", env=env).stdout
        assert "Stage 'pretrain' is cached - skipping run, checking out outputs" in logs, logs[-3000:]
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=project, capture_output=True, text=True)
    assert worktrees.stdout.count("\n") == 1, worktrees.stdout

    # A second run under the same name is refused unless asked to replace the first.
    again = subprocess.run(gptlab, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "--replace" in again.stderr


def test_a_sweep_file_and_a_profile_may_come_through_pipes(tmp_path: Path) -> None:
    """`gptlab sweep <(...) --profile <(...)`: pipes are read like files; their names say nothing, so --name."""
    from gptlab.experiments.profiles import load_overrides, profile_path
    from gptlab.experiments.sweep import sweep_path

    opened: list[int] = []

    def piped(text: str) -> Path:
        read_end, write_end = os.pipe()
        os.write(write_end, text.encode())
        os.close(write_end)
        opened.append(read_end)
        return Path(f"/dev/fd/{read_end}")

    spec = {"stage": "spam-finetune", "variants": {"a": {}, "b": {"spam": {"trainable": "lora"}}}}
    smoke = PROJECT_ROOT / "profiles" / "smoke.yaml"
    try:
        sweep_pipe, profile_pipe = piped(yaml.safe_dump(spec)), piped(smoke.read_text())
        with pytest.raises(
            InputError, match=r"/dev/fd/\d+ is a pipe, whose name says nothing: name the sweep with --name"
        ):
            load_sweep(sweep_path(sweep_pipe), PARAMS, profile_path(profile_pipe))
        piped_sweep = load_sweep(sweep_path(sweep_pipe), PARAMS, profile_path(profile_pipe), "tiny")
        assert load_overrides(profile_path(piped(smoke.read_text())), PARAMS) == load_overrides(smoke, PARAMS)
    finally:
        for fd in opened:
            os.close(fd)
    from_files = load_sweep(write_yaml(tmp_path / "s.yaml", spec), PARAMS, smoke, "tiny")
    assert piped_sweep.name == "tiny" and piped_sweep.variants == from_files.variants
    assert sweep_path("-") == profile_path("-") == Path("/dev/stdin")


@pytest.mark.slow
def test_a_real_sweep_stopped_by_sigterm_while_queuing_leaves_nothing_queued(tmp_path: Path) -> None:
    """`gptlab sweep` with the real dvc: SIGTERM once it has queued a variant; then a leftover blocks a rerun."""
    project = tmp_path / "project"
    copy_project(project)
    variants = {f"v{n}": {"spam": {"train": {"seed": n}}} for n in range(5)}
    write_yaml(project / "sweeps" / "tiny.yaml", {"stage": "spam-finetune", "variants": variants})
    commit_as_fresh_clone(project)
    env = project_env(project)
    gptlab = [str(Path(sys.executable).with_name("gptlab")), "sweep", "tiny", "--name", "stop"]
    sweep = subprocess.Popen(
        gptlab, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert sweep.stdout is not None
        for line in sweep.stdout:  # each variant takes a `dvc exp run --queue` of its own: seconds
            if line.startswith("queued stop-v0"):
                sweep.send_signal(signal.SIGTERM)
                break
        out, err = sweep.communicate(timeout=300)
    finally:
        sweep.kill()
    assert sweep.returncode == 143, out + err
    stopped = err.strip().splitlines()[-1]
    assert "Traceback" not in err and stopped.startswith(
        "stopped by SIGTERM while queuing the variants: removed stop-v0"
    )
    assert stopped.endswith("from DVC's queue") and "queued stop-v4" not in out
    # Nothing of the sweep is left in DVC's queue, and the workspace is as committed.
    shown = json.loads(dvc_exp_show(project, "--json", env=env))
    assert not [
        e
        for row in shown
        for e in (row.get("experiments") or [])
        if (e.get("name") or "").startswith("stop-")
    ]
    assert "stop-" not in dvc(project, "queue", "status", env=env).stdout
    status = subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True)
    assert status.stdout == ""

    # A task left queued (as by a sweep killed with SIGKILL) blocks the rerun, which names the fix.
    dvc(
        project,
        "exp",
        "run",
        "--queue",
        "--name",
        "stop-v1",
        "-S",
        "spam.train.seed=1",
        "spam-finetune",
        env=env,
    )
    again = subprocess.run(gptlab, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert "`dvc queue remove stop-v1` removes them" in again.stderr
    dvc(project, "queue", "remove", "stop-v1", env=env)
    assert "stop-v1" not in dvc(project, "queue", "status", env=env).stdout


# --------------------------------------------------------------------------- bounded waits (issue 23, case 8)


def test_a_second_sweep_is_refused_at_once_while_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gptlab.cli.main import main

    project = tmp_path / "project"
    copy_project(project)
    commit_as_fresh_clone(project)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from gptlab.experiments.sweep import sweep_lock\n"
            "with sweep_lock(Path(sys.argv[1]), 'spam'):\n    print('held', flush=True); time.sleep(120)",
            str(project),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        monkeypatch.chdir(project)
        started = time.monotonic()
        assert main(["sweep", "spam", "--name", "other"]) == 2
        assert time.monotonic() - started < 30
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"another gptlab sweep is running in this project (sweep spam, pid {holder.pid})" in err


def test_a_dvc_command_that_hangs_is_stopped_naming_it(tmp_path: Path) -> None:
    hanging = tmp_path / "dvc"
    hanging.write_text("#!/bin/sh\nexec sleep 600\n")  # a dvc that waits forever, as on a held lock
    hanging.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(GptlabError, match=r"`dvc exp show --json \.\.\.` did not finish within 1 s"):
        Dvc(tmp_path, dict(os.environ), str(hanging), timeout=1).experiments()
    assert time.monotonic() - started < 10


def test_a_queue_without_progress_is_given_up_after_the_timeout(tiny_sweep: Sweep) -> None:
    fake = FakeDvc([{"s-a": "running", "s-b": "queued"}])
    started = time.monotonic()
    with pytest.raises(
        GptlabError, match=r"did not finish within 0.3 s \(--timeout\); its experiments go on"
    ):
        run_queue(tiny_sweep, fake, jobs=1, poll_seconds=0.01, timeout=0.3)
    assert time.monotonic() - started < 5


def test_the_sweep_commands_wait_has_a_default_bound() -> None:
    from gptlab.cli.main import build_parser

    assert build_parser().parse_args(["sweep", "spam"]).timeout == 24 * 3600


def test_a_sweep_stopped_while_waiting_leaves_its_variants_to_a_live_worker_else_removes_them(
    tiny_sweep: Sweep,
) -> None:
    """No worker alive (stopped with the sweep, or never started): the queued variants would wait forever."""
    alive = FakeDvc([{"s-a": "queued", "s-b": "queued"}], workers=(1, 0))
    assert settle_stopped(tiny_sweep, alive, poll_seconds=0).startswith("the variants go on in DVC's queue")
    assert not [c for c in alive.calls if c[:2] == ("queue", "remove")]
    orphaned = FakeDvc([{"s-a": "success", "s-b": "queued"}], workers=(0, 0))
    said = settle_stopped(tiny_sweep, orphaned, poll_seconds=0)
    assert (
        said == "no DVC worker was running the variants, so nothing would have: removed s-b from DVC's queue"
    )
    assert orphaned.calls == [("queue", "remove", "s-b")]
    assert orphaned.queries == [("queue", "status")] * 3  # a worker just started gets polls to show up


def test_sigterm_while_the_queue_starts_lets_dvc_start_its_worker_then_stops(tiny_sweep: Sweep) -> None:
    class SignalledStart(FakeDvc):
        def __call__(self, *args: str, check: bool = True) -> str:
            super().__call__(*args, check=check)
            if args[:2] == ("queue", "start"):
                os.kill(os.getpid(), signal.SIGTERM)  # held: `dvc queue start` is not killed halfway
            return ""

    fake = SignalledStart([{"s-a": "queued", "s-b": "queued"}])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        run_queue(tiny_sweep, fake, jobs=1, poll_seconds=0)
    assert fake.calls == [("queue", "start", "--jobs", "1")] and not fake.queries
    assert signal.getsignal(signal.SIGTERM) is before
