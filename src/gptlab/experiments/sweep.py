"""Sweeps: one stage's variants as queued DVC experiments, and the table that compares them.

A sweep file (sweeps/<name>.yaml) names the stage to run, overrides that every
variant shares (`base`, laid out like params.yaml) and the variants, each a set
of overrides of its own, plus optional one-line notes:

    stage: spam-finetune
    base: {}
    variants:
      last_block: {}
      lora: {spam: {trainable: lora}}
    notes:
      lora: appendix E

Every variant pins every param the sweep varies: a key that some variant sets is
set in each of them. Where the variant sets none, it gets the value it would have
anyway (params.yaml <- profile <- base), unless that is the profile's and one of
the values the sweep compares: then params.yaml's (or `base`'s). So `last_block`
trains the last block on any profile, although the smoke profile sets
`spam.trainable: all` (the all_layers variant's setting), while the smoke
profile's learning rate for its tiny model stays (no variant's). `gptlab sweep`
names the profile keys it overrode. Two variants whose effective params
(params.yaml <- profile <- base <- variant) are the same are an error naming
both, before anything is queued.

`gptlab sweep <name>` checks every variant against the params schema (under a
profile's overrides when given, e.g. the smoke profile), queues each one with
`dvc exp run --queue --name <sweep>-<variant> -S ... <stage>`, runs the queue
with `dvc queue start --jobs N`, waits for it, and writes
reports/sweeps/<sweep>.csv and .md (<sweep> is <file>-<profile> on a profile):
one row per variant with what it ran with (STAGE_SETTINGS: what trains, the base
model and where its weights come from, pooling, input length), the other params
that differ between variants, the trainable parameters, the stage's scores and
the training time. DVC does the scheduling, the temporary workspaces and the
bookkeeping: `dvc exp show` lists every variant. Each variant starts from the
last commit (plus changes to tracked files): the stages before the swept one
whose dvc.lock entry is up to date there are checked out from DVC's cache, the
others run in every variant, so `gptlab sweep` says so before it queues.

Each variant also sets `tracking.sweep` and `tracking.sweep_variant`, which the
fine-tune stages list as params: every variant's fine-tune really runs (none is
taken from the run-cache), and its MLflow run is tagged gptlab.sweep /
gptlab.sweep_variant and named <stage>/<variant>, so the UI's filter
`tags.gptlab.sweep = '<sweep>'` puts a sweep's runs side by side. The training
time comes from those runs (a time is no DVC metric: it differs run to run).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError, InputError
from gptlab.experiments.profiles import merge_overrides, named_yaml, set_arguments
from gptlab.files import atomic_path, exclusive_lock
from gptlab.paths import REPORTS
from gptlab.pipeline.params import Params
from gptlab.schema import ConfigError, build, flatten, read_yaml

SWEEPS_DIR = Path("sweeps")
# reports/sweeps/<sweep>.csv and .md
SWEEP_REPORTS = REPORTS / "sweeps"
_NAME = re.compile(r"[a-z0-9][a-z0-9_]*")
_SWEEP_KEYS = {"stage", "base", "variants", "notes", "description"}
# Keys a sweep sets itself: never overridden by a sweep file, never a column of "what differs".
_OWN_KEYS = ("tracking.sweep", "tracking.sweep_variant")
# Experiment states in `dvc exp show --json` (the executor's), and those that are final.
DONE = ("success", "failed")


@dataclass(frozen=True)
class Column:
    """One value of a variant's table row, read from a report file of its experiment's commit."""

    name: str  # CSV column
    title: str  # Markdown header
    file: str  # the stage's report, project-relative
    key: str  # dotted key in that JSON file
    percent: bool = False  # a fraction shown as a percentage in the Markdown table


# What a sweep of each stage tabulates; the stages a sweep can run.
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


@dataclass(frozen=True)
class Setting:
    """A column of the Markdown table: some of a variant's effective params, in words."""

    title: str
    keys: tuple[str, ...]  # the params it reads; the CSV holds them as they are
    describe: Callable[[Mapping[str, Any]], str]


def _trains(section: str) -> Callable[[Mapping[str, Any]], str]:
    def describe(params: Mapping[str, Any]) -> str:
        trainable = params.get(f"{section}.trainable")
        if trainable == "last_blocks":
            blocks = params.get(f"{section}.trainable_blocks")
            return f"last {blocks} block{'' if blocks == 1 else 's'} + final norm + head"
        if trainable == "lora":
            rank, alpha = params.get(f"{section}.lora.rank"), params.get(f"{section}.lora.alpha")
            return f"LoRA rank {rank}, alpha {alpha}"
        return {"head": "the new head only", "all": "every weight"}.get(str(trainable), str(trainable))

    return describe


def _base_model(section: str) -> Callable[[Mapping[str, Any]], str]:
    def describe(params: Mapping[str, Any]) -> str:
        name = params.get(f"{section}.base_model")
        if params.get("gpt2.source") == PRETRAIN_SOURCE:
            model = f"models/pretrain (as {name})"  # load-gpt2 converts our own model under every name
        else:
            model = f"OpenAI's {name}"
        if params.get(f"{section}.base_weights") == "random":
            return f"{model}: its architecture, random weights"
        return model

    return describe


def _spam_max_length(params: Mapping[str, Any]) -> str:
    length = params.get("spam.max_length")
    if length is None:
        return "longest training message"
    return "the model's context" if length == "context" else f"{length} tokens"


PRETRAIN_SOURCE = "pretrain"  # gpt2.source: every base model is this pipeline's models/pretrain
# What each stage's variants are, read from their effective params: trained weights, base model
# and where its weights come from, pooling, input length.
STAGE_SETTINGS: dict[str, tuple[Setting, ...]] = {
    "spam-finetune": (
        Setting(
            "trains",
            ("spam.trainable", "spam.trainable_blocks", "spam.lora.rank", "spam.lora.alpha"),
            _trains("spam"),
        ),
        Setting("base model", ("spam.base_model", "spam.base_weights", "gpt2.source"), _base_model("spam")),
        Setting("pooling", ("spam.pooling",), lambda params: str(params.get("spam.pooling"))),
        Setting("max length", ("spam.max_length",), _spam_max_length),
    ),
    "instruct-finetune": (
        Setting(
            "trains", ("instruct.trainable", "instruct.lora.rank", "instruct.lora.alpha"), _trains("instruct")
        ),
        Setting("base model", ("instruct.base_model", "gpt2.source"), _base_model("instruct")),
        Setting(
            "max length",
            ("instruct.allowed_max_length",),
            lambda params: f"{params.get('instruct.allowed_max_length')} tokens",
        ),
    ),
}


@dataclass(frozen=True)
class Sweep:
    """A sweep file, checked: every variant's overrides (profile + base + swept keys + its own), flattened."""

    name: str
    stage: str
    source: Path
    variants: dict[str, dict[str, Any]]
    # Each variant's own overrides (without the profile's and the base's): what it changes.
    changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    description: str = ""
    profile: str | None = None
    # Each variant's effective params (params.yaml <- profile <- base <- variant), flattened.
    effective: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The profile's keys whose value the sweep compares, with what the variants setting none take instead.
    profile_overridden: dict[str, Any] = field(default_factory=dict)

    @property
    def overridden(self) -> list[str]:
        """Every param some variant sets, in the order the file first sets them."""
        keys: list[str] = []
        for overrides in self.variants.values():
            keys += [k for k in overrides if k not in keys and k not in _OWN_KEYS]
        return keys

    def experiment(self, variant: str) -> str:
        """The DVC experiment name of a variant."""
        return f"{self.name}-{variant}"

    def set_arguments(self, variant: str) -> list[str]:
        """`-S key=value` arguments of a variant, its sweep tags included."""
        overrides = {**self.variants[variant], "tracking.sweep": self.name, "tracking.sweep_variant": variant}
        return set_arguments(overrides)


_UNSET = object()


def _canonical(value: Any) -> str:
    return "<unset>" if value is _UNSET else json.dumps(value, sort_keys=True, default=str)


def sweep_path(name_or_path: str | Path) -> Path:
    """A sweep file: the path itself, or sweeps/<name>.yaml for a bare name such as `spam`."""
    return named_yaml(name_or_path, SWEEPS_DIR, "sweep file", "sweeps")


def load_sweep(
    path: Path,
    params_file: Path,
    *,
    profile: Mapping[str, Any] | None = None,
    profile_name: str | None = None,
    name: str | None = None,
) -> Sweep:
    """Read a sweep file, pin its swept keys in every variant, and check each against the schema."""
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise InputError(f"{path}: expected a mapping with `stage` and `variants`")
    unknown = sorted(set(raw) - _SWEEP_KEYS)
    if unknown:
        raise InputError(f"{path}: unknown key {unknown[0]!r}; expected some of {sorted(_SWEEP_KEYS)}")
    stage = raw.get("stage")
    if stage not in STAGE_COLUMNS:
        raise InputError(f"{path}: stage: expected one of {sorted(STAGE_COLUMNS)}, got {stage!r}")
    sweep_name = name or path.stem
    if not _NAME.fullmatch(sweep_name.replace("-", "_")):
        raise InputError(
            f"sweep name {sweep_name!r}: use lowercase letters, digits, '_' and '-' (it prefixes "
            "the DVC experiment names)"
        )
    base = _mapping(raw.get("base"), f"{path}: base")
    notes = _mapping(raw.get("notes"), f"{path}: notes")
    own = _variant_overrides(raw.get("variants"), path)
    for variant, note in notes.items():
        if variant not in own:
            raise InputError(f"{path}: notes: {variant!r} is not one of the variants")
        if not isinstance(note, str):
            raise InputError(f"{path}: notes.{variant}: expected a string")
    params = read_yaml(params_file)
    baseline, overridden = _baseline(own, base, dict(profile or {}), params, path)
    layered_base = merge_overrides(dict(profile or {}), base)
    variants: dict[str, dict[str, Any]] = {}
    effective: dict[str, dict[str, Any]] = {}
    for variant, changes in own.items():
        where = f"{path}: variants.{variant}"
        pinned = {key: value for key, value in baseline.items() if key not in flatten(changes)}
        layered = merge_overrides(merge_overrides(layered_base, nested(pinned)), changes)
        flat = flatten(layered)
        taken = [key for key in _OWN_KEYS if key in flat]
        if taken:
            raise InputError(f"{where}: {taken[0]} is set by the sweep itself (the variant's name)")
        variants[variant] = flat
        effective[variant] = _typed(merge_overrides(params, layered), where)
    _refuse_identical(effective, path, profile_name)
    description = raw.get("description") or ""
    if not isinstance(description, str):
        raise InputError(f"{path}: description: expected a string")
    return Sweep(
        name=sweep_name,
        stage=stage,
        source=path,
        variants=variants,
        changes={variant: flatten(changes) for variant, changes in own.items()},
        notes=dict(notes),
        description=description.strip(),
        profile=profile_name,
        effective=effective,
        profile_overridden=overridden,
    )


def _baseline(
    own: Mapping[str, dict[str, Any]],
    base: dict[str, Any],
    profile: dict[str, Any],
    params: dict[str, Any],
    path: Path,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The value of every swept key in a variant that sets none, and the profile's keys it overrides.

    That is the value the variant would have anyway (params.yaml <- profile <- base), unless the
    profile's value is one the sweep compares (the smoke profile's `spam.trainable: all` is the
    all_layers variant's): then params.yaml's (or the base's), so no variant turns into another.
    """
    alternatives: dict[str, set[str]] = {}  # each swept key's values, as the schema reads them
    for variant, changes in own.items():
        typed = _typed(merge_overrides(params, changes), f"{path}: variants.{variant}")
        for key in flatten(changes):
            if key not in _OWN_KEYS:  # refused with its variant named, in load_sweep
                alternatives.setdefault(key, set()).add(_canonical(typed.get(key, _UNSET)))
    on_profile = _typed(merge_overrides(merge_overrides(params, profile), base), f"{path}: base")
    without = _typed(merge_overrides(params, base), f"{path}: base")
    from_profile = set(flatten(profile)) - set(flatten(base))
    overridden = {
        key: without[key]
        for key in alternatives
        if key in from_profile and _canonical(on_profile[key]) in alternatives[key]
    }
    values = {key: overridden.get(key, on_profile.get(key, _UNSET)) for key in alternatives}
    return {key: value for key, value in values.items() if value is not _UNSET}, overridden


def _typed(params: dict[str, Any], where: str) -> dict[str, Any]:
    """Params checked against the schema, flattened with the values it reads (a ConfigError names `where`)."""
    try:
        return flatten(build(Params, params, ""))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _variant_overrides(variants: Any, path: Path) -> dict[str, dict[str, Any]]:
    """The file's variants: each name checked, each value a mapping of overrides."""
    if not isinstance(variants, dict) or not variants:
        raise InputError(f"{path}: variants: expected a mapping of variant name to overrides")
    own: dict[str, dict[str, Any]] = {}
    for variant, changes in variants.items():
        where = f"{path}: variants.{variant}"
        if not isinstance(variant, str) or not _NAME.fullmatch(variant):
            raise InputError(f"{where}: a variant name is lowercase letters, digits and '_'")
        own[variant] = _mapping(changes, where)
    return own


def _refuse_identical(effective: Mapping[str, Mapping[str, Any]], path: Path, profile: str | None) -> None:
    """Two variants that would run with the same params would fill two rows with one result."""
    seen: dict[str, str] = {}
    for variant, values in effective.items():
        key = _canonical({k: v for k, v in values.items() if k not in _OWN_KEYS})
        if key in seen:
            where = f" on the {profile} profile" if profile else ""
            raise InputError(
                f"{path}: variants {seen[key]} and {variant} run with the same params{where}: "
                "give one of them a setting of its own, or drop it"
            )
        seen[key] = variant


def nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{a.b: 1} -> {a: {b: 1}}: flattened overrides laid out like params.yaml again."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a mapping laid out like params.yaml, got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------- the queue

Runner = Callable[..., subprocess.CompletedProcess[str]]


@dataclass
class Experiment:
    """One experiment as `dvc exp show --json` describes it."""

    name: str
    state: str  # queued, running, success, failed (the executor's), or "" when DVC gives none
    rev: str | None
    params: dict[str, Any]
    log: str | None = None


# Seconds one dvc command of a sweep may take (`dvc exp show` waiting on a lock would wait forever).
DVC_CALL_TIMEOUT_S = 300.0
# The default bound on waiting for a sweep's queue (`gptlab sweep --timeout`), and how long the
# states may stay as they are before the wait says so.
QUEUE_TIMEOUT_S = 24 * 3600.0
STALL_S = 600.0


class Dvc:
    """The dvc commands a sweep runs, in the project, with the environment its experiments inherit."""

    def __init__(
        self, project: Path, env: Mapping[str, str], dvc: str = "dvc", timeout: float = DVC_CALL_TIMEOUT_S
    ) -> None:
        self.project = project
        self.env = dict(env)
        self.dvc = dvc
        self.timeout = timeout

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # Output goes through files, not pipes: `dvc queue start` leaves workers running that inherit
        # its stdout and stderr, and reading a pipe would wait for them, i.e. for the whole queue.
        with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
            try:
                returncode = subprocess.run(
                    [self.dvc, *args],
                    cwd=self.project,
                    env=self.env,
                    stdout=stdout,
                    stderr=stderr,
                    timeout=self.timeout,
                ).returncode
            except subprocess.TimeoutExpired:  # the child is killed
                raise GptlabError(
                    f"`dvc {' '.join(args[:3])} ...` did not finish within {self.timeout:g} s and was "
                    "stopped: is another dvc command holding the project? (`dvc queue status`)"
                ) from None
            stdout.seek(0)
            stderr.seek(0)
            proc = subprocess.CompletedProcess(args, returncode, stdout.read(), stderr.read())
        if check and proc.returncode:
            output = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            raise GptlabError(
                f"`dvc {' '.join(args[:3])} ...` failed (exit {proc.returncode}): " + " / ".join(output[-3:])
            )
        return proc

    def experiments(self) -> list[Experiment]:
        """The experiments of HEAD, queued, running and done (`dvc exp show --json`)."""
        shown = json.loads(self("exp", "show", "--json").stdout or "[]")
        found: list[Experiment] = []
        for row in shown:
            for exp in row.get("experiments") or []:
                revs = exp.get("revs") or [{}]
                data = revs[0].get("data") or {}
                executor = exp.get("executor") or {}
                params = ((data.get("params") or {}).get("params.yaml") or {}).get("data") or {}
                found.append(
                    Experiment(
                        name=exp.get("name") or revs[0].get("name") or "",
                        state=executor.get("state") or "",
                        rev=revs[0].get("rev"),
                        params=flatten(params),
                        log=(executor.get("local") or {}).get("log"),
                    )
                )
        return found

    def workers(self) -> tuple[int, int] | None:
        """(active, idle) queue workers, from `dvc queue status`; None when it does not say."""
        out = self("queue", "status", check=False).stdout
        found = re.search(r"Worker status:\s*(\d+) active,\s*(\d+) idle", out)
        return (int(found.group(1)), int(found.group(2))) if found else None


def variant_notes(sweep: Sweep) -> list[str]:
    """What the variants run with that their names do not say: profile keys overridden, models that coincide."""
    notes = []
    for key, value in sweep.profile_overridden.items():
        notes.append(
            f"the {sweep.profile} profile's {key} is a setting this sweep compares: the variants that "
            f"set no {key} take params.yaml's {json.dumps(value)} instead"
        )
    for group in same_model_groups(sweep.stage, sweep.effective):
        notes.append(
            f"variants {' and '.join(group)} train the same model: with gpt2.source: pretrain every "
            "base model is models/pretrain, converted under each name"
        )
    return notes


def shared_stage_warnings(sweep: Sweep, dvc: Dvc, project: Path) -> list[str]:
    """Why the stages before the sweep's would run again in every variant, if they would.

    A queued experiment starts from the last commit plus the changes to tracked files. The
    stages whose dvc.lock entry is up to date there are checked out from DVC's cache; the
    others run in each variant (DVC's run-cache restores only stages whose outputs are all
    cached, here `download`). So: the workspace's stages up to date, and dvc.lock and reports/
    committed (or at least tracked).
    """
    warnings = []
    shown = dvc("status", "--with-deps", "--json", sweep.stage, check=False).stdout
    try:
        stale = sorted(name for name in json.loads(shown or "{}") if name.rpartition(":")[2] != sweep.stage)
    except json.JSONDecodeError:
        stale = []
    if stale:
        warnings.append(
            f"{', '.join(stale)} {'is' if len(stale) == 1 else 'are'} not up to date in this workspace: every "
            f"variant runs {'it' if len(stale) == 1 else 'them'} again (with OpenAI's weights, load-gpt2 "
            f"fetches them each time); run `dvc repro {' '.join(stale)}` and commit dvc.lock and reports/ first"
        )
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "--", "dvc.lock", str(REPORTS)],
        cwd=project,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    untracked = [path for path in untracked if not path.startswith(f"{SWEEP_REPORTS.as_posix()}/")]
    if untracked:
        warnings.append(
            f"{len(untracked)} stage outputs are untracked by git ({', '.join(untracked[:3])}"
            f"{', ...' if len(untracked) > 3 else ''}): queued experiments start from the last commit and "
            "leave untracked files behind, so the stages that wrote them run again; commit them first"
        )
    if sweep.profile:
        warnings.append(
            f"on the {sweep.profile} profile, the stages before {sweep.stage} run in every variant: "
            "their params differ from your dvc.lock's, and DVC takes from its run-cache only stages "
            "whose outputs are all cached (download)"
        )
    return warnings


def queue(sweep: Sweep, dvc: Dvc, *, replace: bool = False, out: Any = sys.stdout) -> None:
    """Queue every variant as `dvc exp run --queue`; names already taken need `replace`."""
    names = {sweep.experiment(v) for v in sweep.variants}
    for _attempt in range(5):
        taken = [e for e in dvc.experiments() if e.name in names]
        if not taken:
            break
        running = sorted(e.name for e in taken if e.state == "running")
        if running:
            raise GptlabError(
                f"experiments {', '.join(running)} are running: wait for them (`dvc queue status`) "
                "or stop them (`dvc queue kill NAME`) first"
            )
        if not replace:
            raise GptlabError(
                f"experiments named {', '.join(sorted(e.name for e in taken))} exist already: pass "
                "--replace to remove them and run the sweep again, or --name to run it under another name"
            )
        # A name can be queued twice (DVC checks names against finished experiments only).
        dvc("exp", "remove", *sorted({e.name for e in taken}))
        print(f"removed the earlier {', '.join(sorted({e.name for e in taken}))}", file=out, flush=True)
    else:
        raise GptlabError(f"could not remove the earlier experiments named {', '.join(sorted(names))}")
    for variant in sweep.variants:
        args = sweep.set_arguments(variant)
        dvc("exp", "run", "--queue", "--name", sweep.experiment(variant), *args, sweep.stage)
        own = sweep.changes.get(variant, {})
        shown = " ".join(f"{k}={json.dumps(v)}" for k, v in own.items()) or "the base settings"
        print(f"queued {sweep.experiment(variant)}: {shown}", file=out, flush=True)


SHOW_ATTEMPTS = 5  # consecutive failed `dvc exp show` polls before the sweep gives up
SWEEP_LOCK = Path(".gptlab") / "sweep.lock"


@contextmanager
def sweep_lock(project: Path, name: str) -> Iterator[None]:
    """Hold the project's sweep lock for the block: a second `gptlab sweep` is refused at once.

    Two sweeps at once share DVC's one queue and its locks, and the second could wait on them
    forever. The lock is the kernel's (flock): it dies with its process, however it dies.
    """
    path = project / SWEEP_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)

    def refusal(holder: str) -> str:
        return (
            f"another gptlab sweep is running in this project ({holder or 'another process'}): sweeps share "
            "DVC's queue, so run one at a time; wait for it (`dvc queue status`) or stop it, then rerun"
        )

    with exclusive_lock(path, f"sweep {name}, pid {os.getpid()}", refusal):
        yield


def run_queue(
    sweep: Sweep,
    dvc: Dvc,
    *,
    jobs: int,
    poll_seconds: float = 5.0,
    timeout: float = QUEUE_TIMEOUT_S,
    stall_seconds: float = STALL_S,
    out: Any = sys.stdout,
) -> dict[str, Experiment]:
    """`dvc queue start --jobs N`, then wait until every variant succeeded or failed.

    Prints each change of state, and says so when none came for `stall_seconds`. Fails when
    the queue has no worker left while variants are still queued, or after `timeout` seconds
    (the experiments go on: `dvc queue status`).
    """
    names = {sweep.experiment(v): v for v in sweep.variants}
    dvc("queue", "start", "--jobs", str(jobs))
    started = last_change = time.monotonic()
    seen: dict[str, str] = {}
    idle_polls = 0
    failed_polls = 0
    while True:
        try:
            current = {e.name: e for e in dvc.experiments() if e.name in names}
        except GptlabError:
            # `dvc exp show` can fail while a worker creates or removes its temporary workspace
            # (a folder vanishing under it); a later poll finds the queue settled again.
            failed_polls += 1
            if failed_polls >= SHOW_ATTEMPTS:
                raise
            time.sleep(poll_seconds)
            continue
        failed_polls = 0
        for name in names:
            state = current[name].state if name in current else "queued"
            if seen.get(name) != state:
                seen[name], last_change = state, time.monotonic()
                done = sum(s in DONE for s in seen.values())
                print(f"  {name}: {state or 'unknown'} ({done}/{len(names)} done)", file=out, flush=True)
        if all(seen[name] in DONE for name in names):
            return current
        if time.monotonic() - started > timeout:
            raise GptlabError(
                f"the sweep did not finish within {timeout:g} s (--timeout); its experiments go on in DVC's "
                "queue (`dvc queue status`); rerun `gptlab sweep` with --collect to write the table once done"
            )
        workers = dvc.workers()
        if time.monotonic() - last_change >= stall_seconds:
            last_change = time.monotonic()  # said once per stall_seconds without a change
            states = ", ".join(f"{name} {seen[name] or 'unknown'}" for name in names)
            print(
                f"  no change for {stall_seconds:g} s: {states}; DVC's queue has {_workers_text(workers)} "
                "(`dvc queue status`, `dvc queue logs NAME`)",
                file=out,
                flush=True,
            )
        if "running" not in seen.values() and workers == (0, 0):
            idle_polls += 1
            if idle_polls >= 3:  # give freshly started workers a moment to show up
                raise GptlabError(
                    "DVC's queue has no worker while variants are still queued: start one with "
                    f"`dvc queue start --jobs {jobs}`, then rerun `gptlab sweep` with --collect"
                )
        else:
            idle_polls = 0
        time.sleep(poll_seconds)


def _workers_text(workers: tuple[int, int] | None) -> str:
    return (
        "workers it does not count" if workers is None else f"{workers[0]} active, {workers[1]} idle workers"
    )


# --------------------------------------------------------------------------- the table


@dataclass
class Row:
    variant: str
    experiment: str
    status: str
    params: dict[str, Any]
    values: dict[str, Any]
    wall_seconds: float | None = None
    mlflow_run_id: str | None = None
    log: str | None = None


def collect(
    sweep: Sweep,
    experiments: Mapping[str, Experiment],
    project: Path,
    runs: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Row]:
    """One row per variant: its params, the stage's values from its commit, and its MLflow run's time."""
    rows = []
    for variant in sweep.variants:
        name = sweep.experiment(variant)
        exp = experiments.get(name)
        if exp is None:
            rows.append(Row(variant, name, "missing", dict(sweep.effective.get(variant, {})), {}))
            continue
        values: dict[str, Any] = {}
        if exp.state == "success" and exp.rev:
            reports: dict[str, Any] = {}
            for column in STAGE_COLUMNS[sweep.stage]:
                if column.file not in reports:
                    reports[column.file] = _report_at(project, exp.rev, column.file)
                values[column.name] = _dotted(reports[column.file], column.key)
        run = (runs or {}).get(variant) or {}
        rows.append(
            Row(
                variant,
                name,
                exp.state or "unknown",
                exp.params or dict(sweep.effective.get(variant, {})),  # what it ran with, else what it will
                values,
                wall_seconds=run.get("wall_seconds"),
                mlflow_run_id=run.get("run_id"),
                log=exp.log,
            )
        )
    return rows


def _report_at(project: Path, rev: str, file: str) -> Any:
    """A JSON report as the experiment's commit holds it (None when it holds none)."""
    shown = subprocess.run(
        ["git", "show", f"{rev}:{file}"], cwd=project, capture_output=True, text=True, check=False
    )
    if shown.returncode:
        return None
    try:
        return json.loads(shown.stdout)
    except json.JSONDecodeError:
        return None


def _dotted(data: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def table_columns(sweep: Sweep, rows: Sequence[Row]) -> list[str]:
    """The CSV's params columns: those the stage's settings read, then the others that differ.

    The values are those the experiments ran with (a variant that sets a param to its
    default does not make it differ).
    """
    described = _described_keys(sweep.stage)
    return described + [key for key in _varied(sweep, rows) if key not in described]


def _described_keys(stage: str) -> list[str]:
    return list(dict.fromkeys(key for setting in STAGE_SETTINGS[stage] for key in setting.keys))


def _varied(sweep: Sweep, rows: Sequence[Row]) -> list[str]:
    """The params some variant sets whose values differ between the rows."""
    known = [row.params for row in rows if row.params] or list(sweep.variants.values())
    return [k for k in sweep.overridden if len({_canonical(p.get(k, _UNSET)) for p in known}) > 1]


def same_model_groups(stage: str, params: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """Variants that train the same model: with gpt2.source pretrain they differ in the base's name only.

    load-gpt2 converts this pipeline's models/pretrain under every base model's name, so
    `gpt2-medium` then names the same weights as `gpt2-small`.
    """
    section = stage.removesuffix("-finetune")
    groups: dict[str, list[str]] = {}
    for variant, values in params.items():
        if values.get("gpt2.source") != PRETRAIN_SOURCE:
            continue
        rest = {k: v for k, v in values.items() if k != f"{section}.base_model" and k not in _OWN_KEYS}
        groups.setdefault(_canonical(rest), []).append(variant)
    return [group for group in groups.values() if len(group) > 1]


def to_csv(sweep: Sweep, rows: Sequence[Row]) -> str:
    params = table_columns(sweep, rows)
    columns = STAGE_COLUMNS[sweep.stage]
    header = [
        "variant",
        "experiment",
        "status",
        *params,
        *(c.name for c in columns),
        "wall_seconds",
        "mlflow_run_id",
    ]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow(
            [
                row.variant,
                row.experiment,
                row.status,
                *(_csv_value(row.params.get(key)) for key in params),
                *(_csv_value(row.values.get(c.name)) for c in columns),
                _csv_value(row.wall_seconds),
                row.mlflow_run_id or "",
            ]
        )
    return buffer.getvalue()


def _csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return str(value)


def to_markdown(sweep: Sweep, rows: Sequence[Row], *, commit: str | None, csv_name: str) -> str:
    settings = STAGE_SETTINGS[sweep.stage]
    described = _described_keys(sweep.stage)
    others = [key for key in _varied(sweep, rows) if key not in described]
    columns = STAGE_COLUMNS[sweep.stage]
    lines = _markdown_intro(sweep, rows, commit=commit, csv_name=csv_name)
    header = [
        "variant",
        *(setting.title for setting in settings),
        *(f"`{key}`" for key in others),
        *(c.title for c in columns),
        "training time",
        "status",
    ]
    if sweep.notes:
        header.append("note")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [
            f"`{row.variant}`",
            *(setting.describe(row.params) if row.params else "—" for setting in settings),
            *(_md_value(row.params.get(key)) for key in others),
            *(_md_number(row.values.get(c.name), c.percent) for c in columns),
            "—" if row.wall_seconds is None else f"{row.wall_seconds:.1f} s",
            row.status if row.status != "failed" else f"failed (`dvc queue logs {row.experiment}`)",
        ]
        if sweep.notes:
            cells.append(sweep.notes.get(row.variant, ""))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _markdown_intro(sweep: Sweep, rows: Sequence[Row], *, commit: str | None, csv_name: str) -> list[str]:
    """The table's title and how to read it: where it came from, what its columns hold, what coincides."""
    done = sum(r.status == "success" for r in rows)
    lines = [f"# Sweep `{sweep.name}`: {sweep.stage}, {len(rows)} variants", ""]
    if sweep.description:
        lines += [sweep.description, ""]
    lines += [
        f"Written by `gptlab sweep` from `{sweep.source.as_posix()}`"
        + (f" on the `{sweep.profile}` profile" if sweep.profile else "")
        + f"; baseline commit {commit or 'unknown'}; {done} of {len(rows)} variants succeeded. "
        f"The same rows, with full precision and every param as it is, are in `{csv_name}`.",
        "",
        f"Each row is one DVC experiment, `{sweep.name}-<variant>` in `dvc exp show`. Its "
        f"{sweep.stage} run in MLflow is tagged `gptlab.sweep = {sweep.name}` and named "
        f"`{sweep.stage}/<variant>`: filter the runs with `tags.gptlab.sweep = '{sweep.name}'` and "
        "press Compare to see their params and curves side by side. The first columns are what each "
        "variant ran with (its params.yaml, profile and overrides together), then the other params "
        "that differ between variants; trainable params counts what the optimizer updated (LoRA: the "
        "adapters only); training time is the training loop's wall time, from the MLflow run (it "
        "varies run to run).",
        "",
    ]
    for key, value in sweep.profile_overridden.items():
        lines += [
            f"The `{sweep.profile}` profile's `{key}` is a setting this sweep compares: the variants "
            f"that set no `{key}` take params.yaml's `{json.dumps(value)}` instead, so each row is the "
            "variant its name says.",
            "",
        ]
    for group in same_model_groups(sweep.stage, {row.variant: row.params for row in rows}):
        names = " and ".join(f"`{variant}`" for variant in group)
        lines += [
            f"{names} train the same model: with `gpt2.source: pretrain` every base model is this "
            "pipeline's own models/pretrain, converted by load-gpt2 under each name.",
            "",
        ]
    return lines


def _md_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _md_number(value: Any, percent: bool) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if percent:
        return f"{value * 100:.2f} %"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4f}"


def write_table(
    sweep: Sweep, rows: Sequence[Row], out_dir: Path, *, commit: str | None = None
) -> tuple[Path, Path]:
    """reports/sweeps/<sweep>.csv and .md, each replaced in one step; returns their paths."""
    csv_path, md_path = out_dir / f"{sweep.name}.csv", out_dir / f"{sweep.name}.md"
    with atomic_path(csv_path) as tmp:
        tmp.write_text(to_csv(sweep, rows), encoding="utf-8")
    with atomic_path(md_path) as tmp:
        tmp.write_text(to_markdown(sweep, rows, commit=commit, csv_name=csv_path.name), encoding="utf-8")
    return csv_path, md_path


def head_commit(project: Path) -> str | None:
    """The project's HEAD, the baseline the experiments ran from (short)."""
    shown = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=project, capture_output=True, text=True, check=False
    )
    if shown.returncode:
        return None
    return shown.stdout.strip() or None
