"""Sweeps: one stage's variants as queued DVC experiments, and the table that compares them.

DVC does the work: `dvc exp run --queue --name <sweep>-<variant> -S ...` queues each variant, `dvc
queue start --jobs N` runs them, `dvc queue status` says how each goes and `dvc exp show --json`
what each did. What DVC cannot know stays here: the sweep file's schema, that its variants really
differ, and the table in the book's words. A variant that sets no value for a key the sweep varies
gets the one it would have anyway (params.yaml <- profile <- base), unless that is the profile's and
one the sweep compares: then params.yaml's (or base's), so `last_block` trains the last block on the
smoke profile too.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

from gptlab.errors import GptlabError, InputError
from gptlab.experiments.dvc_commands import (
    DVC_CALL_TIMEOUT_S,
    STALL_AFTER_S,
    Finished,
    ask_dvc,
    describe,
    run_dvc,
)
from gptlab.experiments.profiles import load_overrides, merge_overrides, named_yaml, set_arguments
from gptlab.files import atomic_path, exclusive_lock
from gptlab.paths import REPORTS
from gptlab.pipeline.params import Params
from gptlab.schema import ConfigError, FieldError, build, flatten, read_yaml, require
from gptlab.tasks.config import Trainable

T = TypeVar("T")
SWEEPS_DIR, SWEEP_REPORTS, SWEEP_LOCK = Path("sweeps"), REPORTS / "sweeps", Path(".gptlab") / "sweep.lock"
QUEUE_TIMEOUT_S = 24 * 3600.0  # the default `gptlab sweep --timeout`
POLL_ATTEMPTS = 5  # consecutive failed `dvc queue status` polls before the wait gives up
DONE = ("success", "failed")  # the states a variant's experiment ends in
QUEUE_STATES = ("queued", "running", *DONE)
_NAME = re.compile(r"[a-z0-9][a-z0-9_]*")
_OWN_KEYS = ("tracking.sweep", "tracking.sweep_variant")  # the sweep's and the variant's names


@dataclass(frozen=True)
class SweepFile:
    """sweeps/<name>.yaml: a stage, overrides its variants share, the variants, one-line notes."""

    stage: Literal["spam-finetune", "instruct-finetune"]
    variants: dict[str, dict[str, Any]]  # each overrides laid out like params.yaml
    base: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    description: str = ""

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
    return named_yaml(name_or_path, SWEEPS_DIR, "sweep file", "sweeps")


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
        return flatten(_built(Params, merge_overrides(params, overrides), f"{path}: {where}"))

    compared: dict[str, set[str]] = {}  # each swept key's values, as the schema reads them
    for variant, changes in spec.variants.items():
        values = typed(changes, f"variants.{variant}")
        for key in flatten(changes):
            compared.setdefault(key, set()).add(_canonical(values.get(key)))
    from_profile = load_overrides(profile, params_file) if profile else {}
    common = merge_overrides(_nested(from_profile), spec.base)
    usual, without = typed(common, "base"), typed(spec.base, "base")
    replaced = set(from_profile) - set(flatten(spec.base))  # the profile's own: a swept value may replace it
    restored = {k: without[k] for k in compared if k in replaced and _canonical(usual.get(k)) in compared[k]}
    variants, effective, seen = {}, {}, {}
    for variant, changes in spec.variants.items():
        pins = {k: restored.get(k, usual[k]) for k in compared if k in usual and k not in flatten(changes)}
        layered = merge_overrides(merge_overrides(common, _nested(pins)), changes)
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


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{a.b: 1} -> {a: {b: 1}}: flat overrides laid out like params.yaml again."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        functools.reduce(lambda node, part: node.setdefault(part, {}), parents, tree)[last] = value
    return tree


# --------------------------------------------------------------------------- DVC's queue


@dataclass(frozen=True)
class Experiment:
    """An experiment as `dvc exp show --json` has it."""

    name: str
    state: str  # its executor's: queued, running, success, failed ("" when DVC gives none)
    rev: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # flat: what it ran with
    metrics: dict[str, Any] = field(default_factory=dict)  # its DVC metrics files' data, by file


@dataclass(frozen=True)
class QueueStatus:
    """DVC's queue as `dvc queue status` has it: each task's state by experiment name, and its workers."""

    states: dict[str, str]  # queued, running, success or failed
    workers: tuple[int, int] | None  # (active, idle); None when it does not say


@dataclass(frozen=True)
class Dvc:
    """The dvc commands of a sweep, in the project and the experiments' environment, each bounded."""

    project: Path
    env: Mapping[str, str]
    dvc: str = "dvc"
    timeout: float = DVC_CALL_TIMEOUT_S
    stall_after: float = STALL_AFTER_S  # the read-only ones (see dvc_commands)

    def __call__(self, *args: str, check: bool = True) -> str:
        done = run_dvc(self.dvc, args, cwd=self.project, env=self.env, timeout=self.timeout)
        return self._checked(args, done) if check else done.stdout

    def _ask(self, *args: str) -> str:
        asked = ask_dvc(
            self.dvc, args, cwd=self.project, env=self.env, timeout=self.timeout, stall_after=self.stall_after
        )
        return self._checked(args, asked)

    @staticmethod
    def _checked(args: Sequence[str], done: Finished) -> str:
        if done.code:
            said = " / ".join((done.stderr.strip() or done.stdout.strip()).splitlines()[-3:])
            raise GptlabError(f"{describe(args)} failed (exit {done.code}): {said}")
        return done.stdout

    def experiments(self) -> dict[str, Experiment]:
        """The experiments of HEAD, queued, running and done, by name."""
        found = {}
        for row in json.loads(self._ask("exp", "show", "--json") or "[]"):
            for exp in row.get("experiments") or []:
                rev, state = (exp.get("revs") or [{}])[0], (exp.get("executor") or {}).get("state") or ""
                data, name = rev.get("data") or {}, exp.get("name") or rev.get("name") or ""
                params = ((data.get("params") or {}).get("params.yaml") or {}).get("data") or {}
                metrics = {file: (m or {}).get("data") for file, m in (data.get("metrics") or {}).items()}
                found[name] = Experiment(name, state, rev.get("rev"), flatten(params), metrics)
        return found

    def queue_status(self) -> QueueStatus:
        """The queue's tasks and workers: what the wait polls, as it reads no experiment's files.

        Its table lists running tasks first, then queued, failed, succeeded: a name's first row is
        its latest task.
        """
        said = self._ask("queue", "status")
        states: dict[str, str] = {}
        for line in said.splitlines()[1:]:  # below the heading: Task, Name, Created, Status
            if len(cells := line.split()) >= 4 and (state := cells[-1].lower()) in QUEUE_STATES:
                states.setdefault(cells[1], state)
        workers = re.search(r"Worker status:\s*(\d+) active,\s*(\d+) idle", said)
        return QueueStatus(states, (int(workers.group(1)), int(workers.group(2))) if workers else None)


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


@contextlib.contextmanager
def _signals_held() -> Iterator[list[int]]:
    """SIGINT and SIGTERM within the block are recorded, not acted on, so a dvc command in flight ends
    on its own (`dvc exp run --queue` killed halfway can leave params.yaml with a variant's values)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield received
        return
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in stops}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def queue(sweep: Sweep, dvc: Dvc, *, replace: bool = False) -> None:
    """Queue each variant with `dvc exp run --queue`; names taken already need `replace`.

    Stopped (SIGINT, SIGTERM) or failing halfway, it removes what it queued from DVC's queue, or
    says the command that does: a sweep's leftovers in the queue block its rerun.
    """
    names = {sweep.experiment(v) for v in sweep.variants}
    queued: list[str] = []
    try:
        with _signals_held() as received:
            for _attempt in range(5):  # DVC queues a name twice (it checks finished experiments only)
                if not (taken := sorted(names & (found := dvc.experiments()).keys())):
                    break
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
            else:
                raise GptlabError(
                    f"could not remove the earlier experiments named {', '.join(sorted(names))}"
                )
            for variant, overrides in sweep.variants.items():
                if received:
                    break
                own = set_arguments(
                    {**overrides, "tracking.sweep": sweep.name, "tracking.sweep_variant": variant}
                )
                dvc("exp", "run", "--queue", "--name", sweep.experiment(variant), *own, sweep.file.stage)
                queued.append(sweep.experiment(variant))
                shown = " ".join(
                    f"{k}={json.dumps(v)}" for k, v in flatten(sweep.file.variants[variant]).items()
                )
                print(f"queued {sweep.experiment(variant)}: {shown or 'the base settings'}", flush=True)
        if received:
            raise Stopped(received[0])
    except (GptlabError, Stopped) as exc:
        if not queued:
            raise
        note = _withdraw(dvc, queued)
        if isinstance(exc, Stopped):
            raise Stopped(exc.signum, note) from None
        raise GptlabError(f"{exc}; {note}") from None


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
) -> dict[str, Experiment]:
    """`dvc queue start --jobs N`, then wait until every variant succeeded or failed, saying each change.

    It polls `dvc queue status` and reads the experiments (`dvc exp show`) once, at the end. Fails
    after `timeout` seconds (the experiments go on) or when the queue has no worker left for them.
    """
    names = [sweep.experiment(v) for v in sweep.variants]
    dvc("queue", "start", "--jobs", str(jobs))
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


# --------------------------------------------------------------------------- the table


class Column(NamedTuple):
    """A value of a variant's row, from a report of its experiment: a DVC metrics file or its commit's."""

    name: str  # in the CSV
    title: str  # in the Markdown table
    file: str
    key: str  # dotted, in that JSON file
    percent: bool = False  # a fraction, shown as a percentage


STAGE_COLUMNS: dict[str, tuple[Column, ...]] = {
    "spam-finetune": (
        Column("trainable_params", "trainable params", "reports/spam/counts.json", "trainable_params"),
        Column("train_accuracy", "train acc", "reports/spam/metrics.json", "train.accuracy", True),
        Column("val_accuracy", "val acc", "reports/spam/metrics.json", "val.accuracy", True),
        Column("test_accuracy", "test acc", "reports/spam/metrics.json", "test.accuracy", True),
    ),
    "instruct-finetune": (
        Column("trainable_params", "trainable params", "reports/instruct/counts.json", "trainable_params"),
        Column("val_loss", "val loss", "reports/instruct/metrics.json", "val_loss"),
        Column("test_loss", "test loss", "reports/instruct/metrics.json", "test_loss"),
        Column("rougeL_f1", "ROUGE-L F1", "reports/instruct/metrics.json", "rougeL_f1"),
    ),
}
# The params the settings read, which the CSV holds as they are: the table's first columns.
SETTING_KEYS = {
    "spam-finetune": (
        *("spam.trainable", "spam.trainable_blocks", "spam.lora.rank", "spam.lora.alpha"),  # trains
        *("spam.base_model", "spam.base_weights", "gpt2.source", "spam.pooling", "spam.max_length"),
    ),
    "instruct-finetune": (
        *("instruct.trainable", "instruct.lora.rank", "instruct.lora.alpha"),  # trains
        *("instruct.base_model", "gpt2.source", "instruct.allowed_max_length"),
    ),
}
TRAINS: dict[Trainable, str] = {
    "head": "the new head only",
    "last_blocks": "last {blocks} block{s} + final norm + head",
    "all": "every weight",
    "lora": "LoRA rank {rank}, alpha {alpha}",
}
PRETRAIN_SOURCE = "pretrain"  # gpt2.source: every base model is this pipeline's models/pretrain


def settings(stage: str, p: Mapping[str, Any]) -> dict[str, str]:
    """What a variant ran with, in the chapter's words, by column title: the table's first columns."""
    task = stage.removesuffix("-finetune")
    trainable, blocks = p.get(f"{task}.trainable"), p.get(f"{task}.trainable_blocks")
    lora = {"rank": p.get(f"{task}.lora.rank"), "alpha": p.get(f"{task}.lora.alpha")}
    trains = TRAINS.get(trainable, str(trainable)).format(blocks=blocks, s="" if blocks == 1 else "s", **lora)
    name = p.get(f"{task}.base_model")
    # load-gpt2 converts this pipeline's own pretrained model under every base model's name
    model = f"models/pretrain (as {name})" if p.get("gpt2.source") == PRETRAIN_SOURCE else f"OpenAI's {name}"
    model += ": its architecture, random weights" if p.get(f"{task}.base_weights") == "random" else ""
    described = {"trains": trains, "base model": model}
    if task == "instruct":
        return described | {"max length": f"{p.get('instruct.allowed_max_length')} tokens"}
    words = {None: "longest training message", "context": "the model's context"}  # spam.max_length's
    length = words.get(p.get("spam.max_length"), f"{p.get('spam.max_length')} tokens")
    return described | {"pooling": str(p.get("spam.pooling")), "max length": length}


def collect(
    sweep: Sweep, found: Mapping[str, Experiment], project: Path, runs: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The table's rows: each variant's experiment and state, its params, its stage's values, its time.

    The params (the dotted keys) are what it ran with (not run: what it will): those the settings
    read, then the others some variant sets whose values differ between the rows.
    """
    named = {variant: sweep.experiment(variant) for variant in sweep.variants}
    exps = {variant: found.get(name) or Experiment(name, "missing") for variant, name in named.items()}
    params = {variant: exp.params or sweep.effective[variant] for variant, exp in exps.items()}
    keys = list(SETTING_KEYS[sweep.file.stage])
    for key in dict.fromkeys(k for overrides in sweep.variants.values() for k in overrides):
        if key not in keys and len({_canonical(p.get(key, "<unset>")) for p in params.values()}) > 1:
            keys.append(key)
    rows = []
    for variant, exp in exps.items():
        row = {"variant": variant, "experiment": exp.name, "status": exp.state or "unknown"}
        row |= {key: params[variant].get(key) for key in keys}
        for column in STAGE_COLUMNS[sweep.file.stage]:
            value = None
            if exp.state == "success":
                value = exp.metrics.get(column.file) or _report_at(project, exp.rev, column.file)
            for part in column.key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            row[column.name] = value
        run = runs.get(variant) or {}
        rows.append(row | {"wall_seconds": run.get("wall_seconds"), "mlflow_run_id": run.get("run_id")})
    return rows


def _report_at(project: Path, rev: str | None, file: str) -> Any:
    """A JSON report as the experiment's commit holds it (a stage's plain output, no DVC metric)."""
    shown = subprocess.run(["git", "show", f"{rev}:{file}"], cwd=project, capture_output=True, text=True)
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
    base_model, groups = f"{sweep.file.stage.removesuffix('-finetune')}.base_model", {}
    for variant, values in params.items():
        if values.get("gpt2.source") == PRETRAIN_SOURCE:
            rest = _canonical({key: value for key, value in values.items() if key != base_model})
            groups.setdefault(rest, []).append(variant)
    for group in (group for group in groups.values() if len(group) > 1):
        said.append(
            f"{' and '.join(f'`{v}`' for v in group)} train the same model: with `gpt2.source: pretrain` every base model is this pipeline's own models/pretrain, converted by load-gpt2 under each name."
        )
    return said


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows([list(rows[0]), *(map(_csv_value, row.values()) for row in rows)])
    return buffer.getvalue()


def _csv_value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return "" if value is None else json.dumps(value) if isinstance(value, bool) else str(value)


def to_markdown(sweep: Sweep, rows: Sequence[Mapping[str, Any]], *, commit: str | None, csv_name: str) -> str:
    stage, notes, columns = sweep.file.stage, sweep.file.notes, STAGE_COLUMNS[sweep.file.stage]
    others = [key for key in rows[0] if "." in key and key not in SETTING_KEYS[stage]]  # params: dotted keys
    header = ["variant", *settings(stage, rows[0]), *(f"`{key}`" for key in others)]
    table = [[*header, *(c.title for c in columns), "training time", "status", *(["note"] if notes else [])]]
    for row in rows:
        logs = f" (`dvc queue logs {row['experiment']}`)" if row["status"] == "failed" else ""
        took = "—" if row["wall_seconds"] is None else f"{row['wall_seconds']:.1f} s"
        cells = [f"`{row['variant']}`", *settings(stage, row).values(), *map(_md_param, map(row.get, others))]
        cells += [*(_md_number(row[c.name], c.percent) for c in columns), took, row["status"] + logs]
        table.append(cells + ([notes.get(row["variant"], "")] if notes else []))
    lines = ["| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in table]
    lines.insert(1, "|" + "---|" * len(table[0]))
    on = f" on the `{sweep.profile}` profile" if sweep.profile else ""
    done = sum(row["status"] == "success" for row in rows)
    params = {row["variant"]: {key: value for key, value in row.items() if "." in key} for row in rows}
    paragraphs = [
        f"# Sweep `{sweep.name}`: {stage}, {len(rows)} variants",
        sweep.file.description.strip(),
        f"Written by `gptlab sweep` from `{sweep.source.as_posix()}`{on}; baseline commit {commit or 'unknown'}; {done} of {len(rows)} variants succeeded. The same rows, with full precision and every param as it is, are in `{csv_name}`.",
        f"Each row is one DVC experiment, `{sweep.name}-<variant>` in `dvc exp show`. Its {stage} run in MLflow is tagged `gptlab.sweep = {sweep.name}` and named `{stage}/<variant>`: filter the runs with `tags.gptlab.sweep = '{sweep.name}'` and press Compare to see their params and curves side by side. The first columns are what each variant ran with (its params.yaml, profile and overrides together), then the other params that differ between variants; trainable params counts what the optimizer updated (LoRA: the adapters only); training time is the training loop's wall time, from the MLflow run (it varies run to run).",
        *coincidences(sweep, params),
        "\n".join(lines),
    ]
    return "\n\n".join(filter(None, paragraphs)) + "\n"


def _md_param(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


def _md_number(value: Any, percent: bool) -> str:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "—" if value is None else str(value)
    return f"{value * 100:.2f} %" if percent else f"{value:,}" if isinstance(value, int) else f"{value:.4f}"


def write_table(
    sweep: Sweep, rows: Sequence[Mapping[str, Any]], out_dir: Path, *, commit: str | None
) -> tuple[Path, Path]:
    """<out_dir>/<sweep>.csv and .md, each replaced in one step."""
    csv_path, md_path = out_dir / f"{sweep.name}.csv", out_dir / f"{sweep.name}.md"
    markdown = to_markdown(sweep, rows, commit=commit, csv_name=csv_path.name)
    for path, text in ((csv_path, to_csv(rows)), (md_path, markdown)):
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return csv_path, md_path
