"""Sweeps: a sweep file's variants of one stage as queued DVC experiments, then the table comparing them.

DVC queues, runs and records the experiments. What it cannot know is here, one section each: the
sweep file (its schema, that its variants differ), the queue (one sweep at a time, nothing left
queued by a stop), the table in the book's words (its stage's columns named by the sweep file),
and `gptlab sweep` going through them.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from gptlab.errors import GptlabError, InputError, describe_failure
from gptlab.experiments import profiles
from gptlab.experiments.compare import markdown_grid
from gptlab.experiments.dvc_commands import Dvc, ExperimentRow, signals_held
from gptlab.experiments.smoke import source_commit_env
from gptlab.experiments.sweep_upstream import run_shared_stages, shared_lock
from gptlab.files import atomic_path, exclusive_lock
from gptlab.paths import REPORTS
from gptlab.pipeline.params import Params
from gptlab.pipeline.stage import Terminated, sigterm_stops
from gptlab.schema import ConfigError, FieldError, build, flatten, nested, read_yaml, require
from gptlab.tracking.store import masked_uri, prepare_store
from gptlab.tracking.sweep_runs import sweep_runs

T = TypeVar("T")
SWEEPS_DIR, SWEEP_REPORTS, SWEEP_LOCK = Path("sweeps"), REPORTS / "sweeps", Path(".gptlab") / "sweep.lock"
QUEUE_TIMEOUT_S = 24 * 3600.0  # the default `gptlab sweep --timeout`
POLL_ATTEMPTS = 5  # consecutive failed `dvc queue status` polls before the wait gives up
DONE = ("success", "failed")  # the states a variant's experiment ends in
PRETRAIN_SOURCE = "pretrain"  # gpt2.source: every base model is this pipeline's models/pretrain
_NAME = re.compile(r"[a-z0-9][a-z0-9_]*")
_OWN_KEYS = ("tracking.sweep", "tracking.sweep_variant")  # the sweep's and the variant's names

# --------------------------------------------------------------------------- the sweep file


@dataclass(frozen=True)
class Column:
    """A result: a value of a report of the variant's experiment, a DVC metrics file or its commit's."""

    name: str  # in the CSV
    title: str  # in the Markdown table
    file: str
    key: str  # dotted, in that JSON file
    percent: bool = False  # a fraction, shown as a percentage


@dataclass(frozen=True)
class Described:
    """A first column: a param's value in words (`{}` stands for the value)."""

    param: str
    words: dict[str | None, str] = field(default_factory=dict)  # by value
    other: str = "{}"  # any other value's

    def said(self, params: Mapping[str, Any]) -> str:
        value = params.get(self.param)
        return self.words.get(value, self.other).format(value)


@dataclass(frozen=True)
class Table:
    """A sweep file's `table:`, its stage's columns: what each variant ran with, in words, then its results."""

    settings: list[str] = field(default_factory=list)  # the params those read: the CSV's first
    trains: dict[str, str] = field(default_factory=dict)  # by <task>.trainable; {blocks}{s}, {rank}, {alpha}
    described: dict[str, Described] = field(default_factory=dict)  # by title, after trains and base model
    columns: list[Column] = field(default_factory=list)  # the results

    def __post_init__(self) -> None:
        for title, described in self.described.items():  # a row holds these params alone
            require(
                described.param in self.settings, f"described.{title}.param", "expected one of `settings`"
            )


@dataclass(frozen=True)
class SweepFile:
    """sweeps/<name>.yaml: a stage, overrides its variants share, the variants, notes, its table's columns."""

    stage: Literal["spam-finetune", "instruct-finetune", "preference-finetune"]
    variants: dict[str, dict[str, Any]]  # each overrides laid out like params.yaml
    base: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    description: str = ""
    table: Table | None = None  # none: the table shows the params that differ, no settings, no results

    def __post_init__(self) -> None:
        require(bool(self.variants), "variants", "expected a mapping of variant name to overrides")
        for name, overrides in self.variants.items():
            where = f"variants.{name}"
            require(bool(_NAME.fullmatch(name)), where, "a variant name is lowercase letters, digits and '_'")
            if taken := sorted(set(_OWN_KEYS) & {*flatten(self.base), *flatten(overrides)}):
                raise FieldError(where, f"{taken[0]} is set by the sweep itself (the variant's name)")
        for name in self.notes:
            require(name in self.variants, "notes", f"{name!r} is not one of the variants")


@dataclass(frozen=True)
class Sweep:
    """A checked sweep file: each variant's overrides as queued, and the params it runs with."""

    name: str
    file: SweepFile
    source: Path
    profile: str | None
    variants: dict[str, dict[str, Any]]  # flat: profile <- base <- the swept keys pinned <- its own
    effective: dict[str, dict[str, Any]]  # flat: params.yaml <- the above, as the schema reads them
    profile_overridden: dict[str, Any]  # the profile's keys the sweep compares -> what replaced them

    def experiment(self, variant: str) -> str:
        return f"{self.name}-{variant}"


def sweep_path(name_or_path: str | Path) -> Path:
    """A sweep file: the path itself, or sweeps/<name>.yaml for a bare name such as `spam`."""
    return profiles.named_yaml(name_or_path, SWEEPS_DIR, "sweep file", "sweeps")


def load_sweep(path: Path, params_file: Path, profile: Path | None = None, name: str | None = None) -> Sweep:
    """Read a sweep file, pin its swept keys in every variant and check each against the params schema.

    The sweep is `name`, else the file's name, plus -PROFILE on a profile (laid under every variant).
    """
    if name is None and (piped := [str(p) for p in (path, profile) if p and not p.is_file()]):
        raise InputError(
            f"{piped[0]} is a pipe, whose name says nothing: name the sweep with --name (it prefixes the DVC experiment names)"
        )
    raw, params = read_yaml(path), read_yaml(params_file)
    name = name or "-".join(p.stem for p in (path, profile) if p)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with `stage` and `variants`")
    spec = _built(SweepFile, raw, str(path))
    if not _NAME.fullmatch(name.replace("-", "_")):
        raise InputError(
            f"sweep name {name!r}: use lowercase letters, digits, '_' and '-' (it prefixes the DVC experiment names)"
        )

    def typed(overrides: dict[str, Any], where: str) -> dict[str, Any]:
        return flatten(_built(Params, profiles.merge_overrides(params, overrides), f"{path}: {where}"))

    own = {variant: flatten(changes) for variant, changes in spec.variants.items()}
    swept: dict[str, set[str]] = {}  # each key some variant sets -> the values they set, as read
    for variant, changes in spec.variants.items():
        values = typed(changes, f"variants.{variant}")
        for key in own[variant]:
            swept.setdefault(key, set()).add(_canonical(values.get(key)))
    profiled = profiles.load_overrides(profile, params_file) if profile else {}
    common = profiles.merge_overrides(nested(profiled), spec.base)
    anyway, unprofiled = typed(common, "base"), typed(spec.base, "base")  # with and without the profile
    if unknown := [key for key in (spec.table or Table()).settings if key not in anyway]:
        raise ConfigError(f"{path}: table.settings: {unknown[0]!r} is not a param of params.yaml")
    # A variant that sets no value for a swept key runs with the one it would have anyway, unless
    # that is the profile's and some variant's: then with params.yaml's, so it is what its name says.
    restored = {
        key: unprofiled[key]
        for key in swept
        if key in profiled and key not in flatten(spec.base) and _canonical(anyway.get(key)) in swept[key]
    }
    pins = {key: restored.get(key, anyway[key]) for key in swept if key in anyway}
    variants, effective, seen = {}, {}, {}
    for variant, changes in spec.variants.items():
        unset = nested({key: value for key, value in pins.items() if key not in own[variant]})
        layered = profiles.merge_overrides(profiles.merge_overrides(common, unset), changes)
        variants[variant], effective[variant] = flatten(layered), typed(layered, f"variants.{variant}")
        if (twin := seen.setdefault(_canonical(effective[variant]), variant)) != variant:
            on = f" on the {profile.stem} profile" if profile else ""
            raise InputError(
                f"{path}: variants {twin} and {variant} run with the same params{on}: give one of them a setting of its own, or drop it"
            )
    return Sweep(name, spec, path, profile.stem if profile else None, variants, effective, restored)


def _built(cls: type[T], data: Any, where: str) -> T:
    try:
        return build(cls, data, "")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


# --------------------------------------------------------------------------- DVC's queue


def sweep_lock(project: Path, name: str) -> contextlib.AbstractContextManager[None]:
    """One sweep at a time: sweeps share DVC's queue and its locks, and a second could wait forever."""
    (lock := project / SWEEP_LOCK).parent.mkdir(parents=True, exist_ok=True)
    refusal = "another gptlab sweep is running in this project ({}): sweeps share DVC's queue, so run one at a time; wait for it (`dvc queue status`) or stop it, then rerun"
    holder = f"sweep {name}, pid {os.getpid()}"
    return exclusive_lock(lock, holder, lambda held: refusal.format(held or "another process"))


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM while the sweep queued its variants; `note` says what became of those it queued."""

    def __init__(self, signum: int, note: str = "nothing was queued") -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.note = signum, note


def queue(sweep: Sweep, dvc: Dvc, *, replace: bool = False) -> None:
    """Queue each variant with `dvc exp run --queue`; names taken already need `replace`.

    Stopped (SIGINT, SIGTERM) or failing halfway, it removes what it queued from DVC's queue, or
    says the command that does: a sweep's leftovers in the queue block its rerun.
    """
    queued: list[str] = []
    try:
        with signals_held() as received:
            _free_names(sweep, dvc, replace)
            for variant, overrides in sweep.variants.items():
                if received:
                    break
                name, own = sweep.experiment(variant), flatten(sweep.file.variants[variant])
                tags = {"tracking.sweep": sweep.name, "tracking.sweep_variant": variant}
                arguments = profiles.set_arguments(overrides | tags)
                dvc("exp", "run", "--queue", "--name", name, *arguments, sweep.file.stage)
                queued.append(name)
                said = " ".join(f"{key}={json.dumps(value)}" for key, value in own.items())
                print(f"queued {name}: {said or 'the base settings'}", flush=True)
    except GptlabError as exc:
        if not queued:
            raise
        raise GptlabError(f"{exc}; {_withdraw(dvc, queued)}") from None
    if received:
        raise Stopped(received[0], _withdraw(dvc, queued)) if queued else Stopped(received[0])


def _free_names(sweep: Sweep, dvc: Dvc, replace: bool) -> None:
    """Remove the earlier experiments of the sweep's names (`replace`), else refuse: DVC would queue a
    name twice, as it checks finished experiments only."""
    names = {sweep.experiment(variant) for variant in sweep.variants}
    for _attempt in range(5):
        if not (taken := sorted(names & (found := dvc.experiments()).keys())):
            return
        if running := [name for name in taken if found[name].state == "running"]:
            raise GptlabError(
                f"experiments {', '.join(running)} are running: wait for them (`dvc queue status`) or stop them (`dvc queue kill NAME`) first"
            )
        if not replace:
            waiting = [name for name in taken if found[name].state == "queued"]
            left = f" ({', '.join(waiting)} queued, never run: a stopped sweep's; `dvc queue remove {' '.join(waiting)}` removes them)"
            raise GptlabError(
                f"experiments named {', '.join(taken)} exist already{left if waiting else ''}: pass --replace to remove them and run the sweep again, or --name to run it under another name"
            )
        dvc("exp", "remove", *taken)
        print(f"removed the earlier {', '.join(taken)}", flush=True)
    raise GptlabError(f"could not remove the earlier experiments named {', '.join(sorted(names))}")


def _withdraw(dvc: Dvc, queued: Sequence[str]) -> str:
    """`dvc queue remove` the experiments a stopped sweep queued: what it did, else the command to run."""
    command = f"`dvc queue remove {' '.join(queued)}`"
    try:
        dvc("queue", "remove", *queued)
    except GptlabError as exc:
        return f"{', '.join(queued)} are still queued ({exc}): remove them with {command}"
    except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: stop now, and say what is left
        return f"{', '.join(queued)} may still be queued: remove them with {command}"
    return f"removed {', '.join(queued)} from DVC's queue"


def run_queue(
    sweep: Sweep, dvc: Dvc, *, jobs: int, poll_seconds: float = 5.0, timeout: float = QUEUE_TIMEOUT_S
) -> dict[str, ExperimentRow]:
    """`dvc queue start --jobs N`, then wait until every variant succeeded or failed, saying each change.

    It polls `dvc queue status` and reads the experiments (`dvc exp show`) once, at the end. Fails
    after `timeout` seconds (the experiments go on) or when the queue has no worker left for them.
    """
    names = [sweep.experiment(variant) for variant in sweep.variants]
    with signals_held() as received:  # a worker is started whole, or not at all: never killed halfway
        dvc("queue", "start", "--jobs", str(jobs))
    if received:
        raise Terminated("stopped by SIGTERM") if received[0] == signal.SIGTERM else KeyboardInterrupt()
    started, seen, idle_polls, failed_polls = time.monotonic(), dict.fromkeys(names, ""), 0, 0
    while True:
        try:
            status, failed_polls = dvc.queue_status(), 0
        except GptlabError:  # a folder can vanish under it as a worker sets up or removes its workspace
            if (failed_polls := failed_polls + 1) >= POLL_ATTEMPTS:
                raise
            time.sleep(poll_seconds)
            continue
        for name in names:
            if seen[name] != (state := status.states.get(name, "queued")):
                seen[name] = state
                done = sum(s in DONE for s in seen.values())
                print(f"  {name}: {state} ({done}/{len(names)} done)", flush=True)
        if all(state in DONE for state in seen.values()):
            return dvc.experiments()
        if time.monotonic() - started > timeout:
            raise GptlabError(
                f"the sweep did not finish within {timeout:g} s (--timeout); its experiments go on in DVC's queue (`dvc queue status`); rerun `gptlab sweep` with --collect to write the table once done"
            )
        idle = "running" not in seen.values() and status.workers == (0, 0)
        if (idle_polls := idle_polls + 1 if idle else 0) >= 3:  # started workers get a moment to show up
            raise GptlabError(
                f"DVC's queue has no worker while variants are still queued: start one with `dvc queue start --jobs {jobs}`, then rerun `gptlab sweep` with --collect"
            )
        time.sleep(poll_seconds)


def settle_stopped(sweep: Sweep, dvc: Dvc, *, polls: int = 3, poll_seconds: float = 2.0) -> str:
    """What becomes of a sweep's variants once it stops waiting for them, said as done.

    With a DVC worker alive (or a variant running), they go on without the sweep. Without one,
    nothing would ever run them: those still queued are removed, so none waits forever. A worker
    just started gets a few polls to show up.
    """
    names = [sweep.experiment(variant) for variant in sweep.variants]
    with signals_held():  # a second Ctrl-C or SIGTERM does not cut the check short
        for poll in range(polls):
            try:
                status = dvc.queue_status()
            except GptlabError as exc:
                return f"could not read DVC's queue ({exc}): see `dvc queue status`"
            queued = [name for name in names if status.states.get(name) == "queued"]
            if queued and status.workers is None:  # a `dvc queue status` that names no workers
                return f"{', '.join(queued)} are still queued, and DVC's queue did not say whether a worker runs them: see `dvc queue status`"
            alive = sum(status.workers or (0, 0)) > 0 or "running" in status.states.values()
            if alive or not queued:
                return (
                    "the variants go on in DVC's queue, run by its worker (`dvc queue status`; stop them with "
                    f"`dvc queue kill NAME`); `gptlab sweep {sweep.source} --name {sweep.name} --collect` "
                    "writes the table once they are done"
                )
            if poll + 1 < polls:
                time.sleep(poll_seconds)
        return f"no DVC worker was running the variants, so nothing would have: {_withdraw(dvc, queued)}"


# --------------------------------------------------------------------------- the table


def settings(sweep: Sweep, p: Mapping[str, Any]) -> dict[str, str]:
    """What a variant ran with, in the chapter's words, by column title: the table's first columns."""
    if (table := sweep.file.table) is None:
        return {}
    task = sweep.file.stage.removesuffix("-finetune")
    trainable, blocks = p.get(f"{task}.trainable"), p.get(f"{task}.trainable_blocks")
    lora = {"rank": p.get(f"{task}.lora.rank"), "alpha": p.get(f"{task}.lora.alpha")}
    plural = "" if blocks == 1 else "s"
    trains = table.trains.get(trainable, str(trainable)).format(blocks=blocks, s=plural, **lora)
    described = {title: d.said(p) for title, d in table.described.items()}
    if (name := p.get(f"{task}.base_model")) is None:  # preference: it tunes the instruct stage's model
        return {"trains": trains, "base model": "models/instruct", **described}
    # load-gpt2 converts this pipeline's own pretrained model under every base model's name
    model = f"models/pretrain (as {name})" if p.get("gpt2.source") == PRETRAIN_SOURCE else f"OpenAI's {name}"
    model += ": its architecture, random weights" if p.get(f"{task}.base_weights") == "random" else ""
    return {"trains": trains, "base model": model, **described}


def collect(
    sweep: Sweep, found: Mapping[str, ExperimentRow], project: Path, runs: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The table's rows: each variant's experiment and state, its params, its results, its time.

    The params (the dotted keys) are what it ran with (not run: what it will): those the settings
    read, then the others some variant sets whose values differ between the rows.
    """
    named = {variant: sweep.experiment(variant) for variant in sweep.variants}
    exps = {variant: found.get(name) or ExperimentRow(name, "missing") for variant, name in named.items()}
    params = {variant: exp.params or sweep.effective[variant] for variant, exp in exps.items()}
    table, rows = sweep.file.table or Table(), []
    keys = list(table.settings)
    for key in dict.fromkeys(key for overrides in sweep.variants.values() for key in overrides):
        if key not in keys and len({_canonical(p.get(key, "<unset>")) for p in params.values()}) > 1:
            keys.append(key)
    for variant, exp in exps.items():
        row = {"variant": variant, "experiment": exp.name, "status": exp.state or "unknown"}
        row |= {key: params[variant].get(key) for key in keys}
        for column in table.columns:
            report = _report(project, exp, column.file) if exp.state == "success" else None
            row[column.name] = flatten(report).get(column.key) if isinstance(report, dict) else None
        run = runs.get(variant) or {}
        rows.append(row | {"wall_seconds": run.get("wall_seconds"), "mlflow_run_id": run.get("run_id")})
    return rows


def _report(project: Path, exp: ExperimentRow, file: str) -> Any:
    """A JSON report of an experiment: a DVC metrics file, else as its commit holds it (a plain output)."""
    if exp.metrics.get(file):
        return exp.metrics[file]
    shown = subprocess.run(["git", "show", f"{exp.rev}:{file}"], cwd=project, capture_output=True, text=True)
    with contextlib.suppress(json.JSONDecodeError):
        return json.loads(shown.stdout) if shown.returncode == 0 else None
    return None


def coincidences(sweep: Sweep, params: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What variants run with that their names do not say: profile keys replaced, models that coincide.

    With gpt2.source pretrain, load-gpt2 converts this pipeline's models/pretrain under every base
    model's name, so variants that differ in that name alone train the same model.
    """
    said = [
        f"The `{sweep.profile}` profile's `{key}` is a setting this sweep compares: the variants that set no `{key}` take params.yaml's `{json.dumps(value)}` instead, so each row is the variant its name says."
        for key, value in sweep.profile_overridden.items()
    ]
    base_model, alike = f"{sweep.file.stage.removesuffix('-finetune')}.base_model", {}
    for variant, values in params.items():  # grouped by their params but the base model's name
        if values.get("gpt2.source") == PRETRAIN_SOURCE:
            alike.setdefault(_canonical({**values, base_model: None}), []).append(f"`{variant}`")
    same = "train the same model: with `gpt2.source: pretrain` every base model is this pipeline's own models/pretrain, converted by load-gpt2 under each name."
    return said + [f"{' and '.join(group)} {same}" for group in alike.values() if len(group) > 1]


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    writer = csv.writer(buffer := io.StringIO(), lineterminator="\n")
    writer.writerows([list(rows[0]), *(map(_csv_value, row.values()) for row in rows)])
    return buffer.getvalue()


def _csv_value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return "" if value is None else json.dumps(value) if isinstance(value, bool) else str(value)


def to_markdown(sweep: Sweep, rows: Sequence[Mapping[str, Any]], *, commit: str | None, csv_name: str) -> str:
    stage, notes, table = sweep.file.stage, sweep.file.notes, sweep.file.table or Table()
    others = [key for key in rows[0] if "." in key and key not in table.settings]  # params: dotted keys
    heading = ["variant", *settings(sweep, rows[0]), *(f"`{key}`" for key in others)]
    heading += [*(column.title for column in table.columns), "training time", "status"]
    cells = []
    for row in rows:
        logs = f" (`dvc queue logs {row['experiment']}`)" if row["status"] == "failed" else ""
        took = "—" if row["wall_seconds"] is None else f"{row['wall_seconds']:.1f} s"
        line = [f"`{row['variant']}`", *settings(sweep, row).values(), *map(_md_param, map(row.get, others))]
        line += [*(_md_number(row[c.name], c.percent) for c in table.columns), took, row["status"] + logs]
        cells.append(line + ([notes.get(row["variant"], "")] if notes else []))
    on = f" on the `{sweep.profile}` profile" if sweep.profile else ""
    done = sum(row["status"] == "success" for row in rows)
    params = {row["variant"]: {key: value for key, value in row.items() if "." in key} for row in rows}
    paragraphs = [
        f"# Sweep `{sweep.name}`: {stage}, {len(rows)} variants",
        sweep.file.description.strip(),
        f"Written by `gptlab sweep` from `{sweep.source.as_posix()}`{on}; baseline commit {commit or 'unknown'}; {done} of {len(rows)} variants succeeded. The same rows, with full precision and every param as it is, are in `{csv_name}`.",
        f"Each row is one DVC experiment, `{sweep.name}-<variant>` in `dvc exp show`. Its {stage} run in MLflow is tagged `gptlab.sweep = {sweep.name}` and named `{stage}/<variant>`: filter the runs with `tags.gptlab.sweep = '{sweep.name}'` and press Compare to see their params and curves side by side. The first columns are what each variant ran with (its params.yaml, profile and overrides together), then the other params that differ between variants; trainable params counts what the optimizer updated (LoRA: the adapters only); training time is the training loop's wall time, from the MLflow run (it varies run to run).",
        *coincidences(sweep, params),
        markdown_grid(heading + (["note"] if notes else []), cells),
    ]
    return "\n\n".join(filter(None, paragraphs)) + "\n"


def _md_param(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


def _md_number(value: Any, percent: bool) -> str:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "—" if value is None else str(value)
    return f"{value * 100:.2f} %" if percent else f"{value:,}" if isinstance(value, int) else f"{value:.4f}"


def write_table(
    sweep: Sweep, rows: Sequence[Mapping[str, Any]], out: Path, *, commit: str | None
) -> tuple[Path, Path]:
    """<out>/<sweep>.csv and .md, each replaced in one step."""
    csv_path, md_path = out / f"{sweep.name}.csv", out / f"{sweep.name}.md"
    markdown = to_markdown(sweep, rows, commit=commit, csv_name=csv_path.name)
    for path, text in ((csv_path, to_csv(rows)), (md_path, markdown)):
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return csv_path, md_path


# --------------------------------------------------------------------------- `gptlab sweep`


def run(
    file: str,
    profile: str | None,
    name: str | None,
    *,
    jobs: int,
    replace: bool,
    collect_only: bool,
    timeout: float,
    out: Path | None,
) -> int:
    """`gptlab sweep`: queue the variants and wait for them (unless `collect_only`), then write their table.

    The exit code: 0 once every variant succeeded, 1 if one did not, 128 + the signal that stopped it.
    """
    if not ((project := Path.cwd()) / "dvc.yaml").is_file():
        raise GptlabError("dvc.yaml not found: run `gptlab sweep` from the project root")
    head = ["git", "rev-parse", "--short", "HEAD"]
    if not (commit := subprocess.run(head, cwd=project, capture_output=True, text=True).stdout.strip()):
        raise GptlabError(
            "gptlab sweep runs DVC experiments, which start from a git commit: run it in a git repository with at least one commit"
        )
    path, profile_file = sweep_path(file), profiles.profile_path(profile) if profile else None
    sweep = load_sweep(path, project / "params.yaml", profile_file, name)
    env = {**profiles.experiment_env(project), **source_commit_env(project)}
    dvc = Dvc(project, env, profiles.dvc_executable())
    print(f"sweep {sweep.name}: {len(sweep.variants)} variants of {sweep.file.stage} from {path}", flush=True)
    for note in coincidences(sweep, sweep.effective):
        print(f"note: {note}", file=sys.stderr, flush=True)
    if collect_only:
        found = dvc.experiments()
    else:
        waiting = False
        try:  # SIGTERM stops it as Ctrl-C does; the lock first: a second sweep is refused at once
            with sigterm_stops(), sweep_lock(project, sweep.name):
                # The MLflow store and experiments exist before stages log to them in parallel (the
                # experiments' store is this process's: MLFLOW_TRACKING_URI, else the project's).
                prepare_store(sorted({str(p["tracking.experiment"]) for p in sweep.effective.values()}))
                shared = {}
                if sweep.profile is not None:  # its shared stages once, for the variants to check out
                    _free_names(sweep, dvc, replace)  # first: it can refuse the sweep
                    first = next(iter(sweep.variants.values()))
                    shared = run_shared_stages(project, dvc, sweep.file.stage, first, timeout=timeout)
                with shared_lock(project, shared):
                    queue(sweep, dvc, replace=replace)
                waiting = True
                found = run_queue(sweep, dvc, jobs=jobs, timeout=timeout)
        except Stopped as stop:
            print(f"\nstopped by {stop} while queuing the variants: {stop.note}", file=sys.stderr)
            return 128 + stop.signum
        except KeyboardInterrupt as stop:
            said = (
                f"stopped waiting; {settle_stopped(sweep, dvc)}"
                if waiting
                else "stopped before any variant was queued"
            )
            print(f"\n{said}", file=sys.stderr)
            return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
    rows = collect(sweep, found, project, _training_times(sweep, found))
    csv_path, md_path = write_table(sweep, rows, out or SWEEP_REPORTS, commit=commit)
    print(f"\nwrote {md_path} and {csv_path}")
    print(
        f"compare them with `dvc exp show` (experiments {sweep.name}-*) or in the MLflow UI: filter `tags.gptlab.sweep = '{sweep.name}'`"
    )
    for row in (failed := [row for row in rows if row["status"] != "success"]):
        hint = f"`dvc queue logs {row['experiment']}`" if row["status"] == "failed" else "not run"
        print(f"variant {row['variant']}: {row['status']} ({hint})", file=sys.stderr)
    return 1 if failed else 0


def _training_times(sweep: Sweep, found: Mapping[str, ExperimentRow]) -> dict[str, dict[str, Any]]:
    """Each variant's MLflow run and training time; without them the table is written all the same."""
    ran = sorted({str(e.params.get("tracking.experiment")) for e in found.values() if e.params})
    try:
        return sweep_runs(ran, sweep.name, sweep.file.stage) if ran else {}
    except Exception as exc:  # noqa: BLE001 - the table without the times rather than no table
        reason = describe_failure(exc) or f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        print(f"warning: no training times from MLflow ({masked_uri(reason)})", file=sys.stderr)
        return {}
