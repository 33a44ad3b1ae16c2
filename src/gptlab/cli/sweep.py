"""`gptlab sweep NAME`: a sweep file's variants as queued DVC experiments, then their table.

sweeps/NAME.yaml (or a path) names a stage and its variants. Each variant is
queued with `dvc exp run --queue -S ... <stage>`, the queue runs with `dvc
queue start --jobs N`, and once every variant has succeeded or failed the table
is written to reports/sweeps/<sweep>.md and .csv. `dvc exp show` lists the
variants as <sweep>-<variant>, and their MLflow runs are tagged
gptlab.sweep=<sweep>. --profile lays a profile's overrides (e.g. the smoke
profile) under every variant; the sweep is then named <file>-<profile>.
One sweep runs at a time in a project (they share DVC's queue): a second is
refused at once. The wait is bounded (--timeout, a day by default), each dvc
command too, and a wait without any change of state says so every 10 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab.experiments.sweep import QUEUE_TIMEOUT_S  # light: yaml and the params schema

if TYPE_CHECKING:
    from gptlab.experiments.sweep import Sweep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sweep", metavar="NAME", help="sweeps/NAME.yaml, or a path to a sweep file")
    parser.add_argument(
        "--profile",
        metavar="PROFILE",
        help="profiles/PROFILE.yaml (or a path): overrides under every variant, e.g. smoke",
    )
    parser.add_argument(
        "--jobs", "-j", type=int, default=1, help="experiments run at a time (dvc queue start --jobs)"
    )
    parser.add_argument(
        "--name",
        help="the sweep's name: prefix of its experiments, its MLflow tag and table file "
        "(default: the file's name, plus -PROFILE with --profile)",
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="remove earlier experiments of the same names first (default: refuse to run over them)",
    )
    parser.add_argument(
        "--collect",
        action="store_true",
        help="queue and run nothing: write the table from the sweep's experiments as they are",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=QUEUE_TIMEOUT_S,
        help="stop waiting for the queue after this many seconds (default: %(default)g, a day); "
        "the experiments go on, --collect writes the table later",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for <sweep>.md and .csv (default: reports/sweeps)"
    )


def run(args: argparse.Namespace) -> int:
    import sys

    from gptlab.errors import GptlabError, InputError
    from gptlab.experiments.profiles import dvc_executable, experiment_env
    from gptlab.experiments.smoke import source_commit_env
    from gptlab.experiments.sweep import (
        SWEEP_REPORTS,
        Dvc,
        collect,
        head_commit,
        queue,
        run_queue,
        shared_stage_warnings,
        sweep_lock,
        variant_notes,
        write_table,
    )
    from gptlab.tracking.runs import prepare_store

    project = Path.cwd()
    if not (project / "dvc.yaml").is_file():
        raise GptlabError("dvc.yaml not found: run `gptlab sweep` from the project root")
    if args.jobs < 1:
        raise InputError(f"--jobs: expected 1 or more, got {args.jobs}")
    if not args.timeout > 0:
        raise InputError(f"--timeout: expected a positive number of seconds, got {args.timeout:g}")
    commit = head_commit(project)
    if commit is None:
        raise GptlabError(
            "gptlab sweep runs DVC experiments, which start from a git commit: "
            "run it in a git repository with at least one commit"
        )
    path, sweep = _load_sweep(args, project)
    env = experiment_env(project)
    env.update(source_commit_env(project))
    dvc = Dvc(project, env, dvc_executable())

    print(f"sweep {sweep.name}: {len(sweep.variants)} variants of {sweep.stage} from {path}", flush=True)
    for note in variant_notes(sweep):
        print(f"note: {note}", file=sys.stderr, flush=True)
    if not args.collect:
        try:
            with sweep_lock(project, sweep.name):  # before anything else: a second sweep is refused at once
                for warning in shared_stage_warnings(sweep, dvc, project):
                    print(f"note: {warning}", file=sys.stderr, flush=True)
                # The MLflow store and experiments exist before stages start logging to them in parallel.
                with _env(env):
                    prepare_store(sorted({str(_experiment_of(sweep, v)) for v in sweep.variants}))
                queue(sweep, dvc, replace=args.replace)
                experiments = run_queue(sweep, dvc, jobs=args.jobs, timeout=args.timeout)
        except KeyboardInterrupt:
            print(
                f"\nstopped waiting; the variants go on in DVC's queue (`dvc queue status`, stop them with "
                f"`dvc queue kill NAME`); `gptlab sweep {args.sweep} --name {sweep.name} --collect` "
                "writes the table once they are done",
                file=sys.stderr,
            )
            return 130
    else:
        experiments = {e.name: e for e in dvc.experiments()}
    runs = _training_runs(sweep, experiments, env)
    rows = collect(sweep, experiments, project, runs)
    csv_path, md_path = write_table(sweep, rows, args.out or SWEEP_REPORTS, commit=commit)
    print(f"\nwrote {md_path} and {csv_path}")
    print(
        f"compare them with `dvc exp show` (experiments {sweep.name}-*) or in the MLflow UI: "
        f"filter `tags.gptlab.sweep = '{sweep.name}'`"
    )
    failed = [row for row in rows if row.status != "success"]
    if failed:
        for row in failed:
            hint = f"`dvc queue logs {row.experiment}`" if row.status == "failed" else "not run"
            print(f"variant {row.variant}: {row.status} ({hint})", file=sys.stderr)
        return 1
    return 0


def _load_sweep(args: argparse.Namespace, project: Path) -> tuple[Path, Sweep]:
    """The sweep file named on the command line, checked with its profile against the params schema."""
    from gptlab.experiments.profiles import load_overrides, profile_path
    from gptlab.experiments.sweep import load_sweep, nested, sweep_path

    path = sweep_path(args.sweep)
    profile, overrides = None, None
    if args.profile:
        profile = profile_path(args.profile)
        overrides = load_overrides(profile, project / "params.yaml")
    name = args.name or (f"{path.stem}-{profile.stem}" if profile else path.stem)
    sweep = load_sweep(
        path,
        project / "params.yaml",
        profile=nested(overrides or {}),
        profile_name=profile.stem if profile else None,
        name=name,
    )
    return path, sweep


def _training_runs(
    sweep: Sweep, experiments: dict[str, Any], env: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """The variants' MLflow runs (their training times); none, with a warning, if MLflow cannot say."""
    import sys

    from gptlab.errors import describe_failure
    from gptlab.tracking.runs import sweep_runs

    mlflow_experiments = sorted(
        {str(e.params.get("tracking.experiment")) for e in experiments.values() if e.params}
    )
    try:
        with _env(env):
            runs = sweep_runs(mlflow_experiments, sweep.name, sweep.stage) if mlflow_experiments else {}
    except Exception as exc:  # noqa: BLE001 - the table is written without the times rather than lost
        reason = (
            describe_failure(exc) or f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
        print(f"warning: no training times from MLflow ({reason})", file=sys.stderr)
        runs = {}
    return runs


def _experiment_of(sweep: object, variant: str) -> object:
    """The MLflow experiment a variant's runs log to (tracking.experiment, overridden or not)."""
    from gptlab.pipeline.params import load_params

    overrides = sweep.variants[variant]  # type: ignore[attr-defined]
    return overrides.get("tracking.experiment") or load_params().tracking.experiment


@contextlib.contextmanager
def _env(env: dict[str, str]) -> Iterator[None]:
    """This process sees the experiments' MLflow store (MLFLOW_TRACKING_URI) while in the block."""
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved
