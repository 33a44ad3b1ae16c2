"""Run the whole DAG on a small profile: the quick start, and what CI guards.

A profile is a YAML file of overrides laid out like params.yaml. It runs in a
separate workspace (default `.gptlab/<profile>/`: a fresh git repository with
a copy of the project's tracked files) through `dvc exp run -S ...`, so DVC
records exactly which params were used, while the project's own params.yaml,
outputs and dvc.lock stay untouched.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gptlab.environment import SOURCE_COMMIT_ENV, SOURCE_DIRTY_ENV, VERBOSE_ENV
from gptlab.errors import GptlabError
from gptlab.experiments.profiles import experiment_env, load_overrides, set_arguments
from gptlab.files import atomic_path, exclusive_lock
from gptlab.paths import PROJECT_POINTER, REPORTS
from gptlab.schema import read_yaml

DEFAULT_PROFILE = Path("profiles/smoke.yaml")
# Where `gptlab smoke` runs by default (project-relative): its models are under models/ there.
SMOKE_WORKDIR = Path(".gptlab") / DEFAULT_PROFILE.stem
# Inside the workspace's .git folder (git never tracks it): what the last run left, file by file.
# Only a folder carrying it is ever replaced, and only while it holds just what the run made.
WORKSPACE_MARKER = Path(".git") / "gptlab-workspace.json"
# Left out of the comparison: DVC's cache and scratch files change under read-only commands.
_UNTRACKED_PARTS = {(".git",), (".dvc", "tmp"), (".dvc", "cache")}


def smoke_model_hint(command: str, model: Path, raw_dir: Path) -> str:
    """The exact command that uses the smoke run's model instead, when a smoke run left one ('' if not).

    `model` and `raw_dir` are the project-relative paths the command reads by default.
    """
    smoke_model = SMOKE_WORKDIR / model
    if not (smoke_model / "config.json").is_file():
        return ""
    return (
        f"; to use the model of the last `gptlab smoke` run instead: "
        f"gptlab {command} --model {smoke_model.as_posix()} --raw-dir {(SMOKE_WORKDIR / raw_dir).as_posix()} ..."
    )


def check_workdir(project: Path, workdir: Path, *, given: bool = True) -> None:
    """Refuse a workspace folder that gptlab did not make: the project, a folder above it, a user's folder.

    The refusal names `--workdir` when the user `given` it, else the default workspace.
    """
    project, workdir = project.resolve(), workdir.resolve()
    where = f"--workdir {workdir}" if given else f"the default workspace {workdir}"
    fix = "name a new folder for the workspace" + ("" if given else " with --workdir")
    if workdir == project or workdir in project.parents:
        raise GptlabError(f"{where}: it holds the project itself; {fix}")
    if workdir.exists() and not workdir.is_dir():
        raise GptlabError(f"{where}: not a folder; {fix}")
    if workdir.is_dir() and any(workdir.iterdir()) and not (workdir / WORKSPACE_MARKER).is_file():
        raise GptlabError(
            f"{where}: not empty and not made by gptlab smoke; nothing was deleted. "
            + ("Name a new or empty folder" if given else "Move it away, or name a new folder with --workdir")
        )


def workspace_lock(workdir: Path) -> contextlib.AbstractContextManager[None]:
    """One smoke run at a time per workspace; the lock file sits beside it, as the folder is replaced."""
    workdir.parent.mkdir(parents=True, exist_ok=True)
    return exclusive_lock(
        workdir.parent / f".{workdir.name}.lock",
        f"pid {os.getpid()}",
        lambda holder: f"{workdir}: another gptlab smoke is running there ({holder}); wait for it to finish",
    )


def git_output(folder: Path, *args: str) -> str:
    """What `git ARGS` prints in `folder`; CalledProcessError if it fails."""
    return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, check=True).stdout


def workspace_state(workdir: Path) -> dict[str, object]:
    """The workspace's files (size, mtime) and git refs: what tells the run's own from later work."""
    files = {}
    for path in sorted(workdir.rglob("*")):
        relative = path.relative_to(workdir)
        if any(relative.parts[: len(p)] == p for p in _UNTRACKED_PARTS) or path.is_dir():
            continue
        stat = path.lstat()
        files[relative.as_posix()] = [stat.st_size, stat.st_mtime_ns]
    refs = git_output(workdir, "for-each-ref", "--format=%(refname) %(objectname)").splitlines()
    return {"files": files, "refs": refs}


def mark_workspace(workdir: Path, finished: bool) -> None:
    """Write the marker: the whole state once the run has finished; while it runs, its git refs.

    A stopped run's files are told from a user's by git (`stopped_run_extras`), its refs by
    this record: a ref made later is someone's, unless it is a DVC experiment's.
    """
    state = workspace_state(workdir)
    marker = {"finished": True, **state} if finished else {"finished": False, "refs": state["refs"]}
    with atomic_path(workdir / WORKSPACE_MARKER) as tmp:
        tmp.write_text(json.dumps(marker), encoding="utf-8")


def read_marker(workdir: Path) -> dict[str, Any]:
    """The marker's record; a damaged one is one line, and nothing is deleted."""
    marker_file = workdir / WORKSPACE_MARKER
    try:
        marker = json.loads(marker_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        marker = exc
    if not _well_formed(marker):
        raise GptlabError(
            f"{workdir}: its smoke run record {marker_file} is damaged, so what a user added there "
            "cannot be told from the run's own; nothing was deleted. Pass --fresh to replace the "
            "workspace, or --workdir to run elsewhere"
        )
    return marker


def _well_formed(marker: object) -> bool:
    """A record as `mark_workspace` writes it: a finished run's holds its files and refs, a running one's its refs."""
    if not isinstance(marker, dict) or not isinstance(marker.get("finished"), bool):
        return False
    refs = marker.get("refs", [] if not marker["finished"] else None)  # an older running record holds none
    refs_ok = isinstance(refs, list) and all(isinstance(ref, str) for ref in refs)
    return refs_ok and (not marker["finished"] or isinstance(marker.get("files"), dict))


def later_work(workdir: Path) -> list[str]:
    """What the workspace holds that its last smoke run did not leave: changed files, new experiments."""
    marker = read_marker(workdir)
    if not marker["finished"]:
        return stopped_run_extras(workdir, marker)
    now = workspace_state(workdir)
    files = [name for name, meta in now["files"].items() if marker["files"].get(name) != meta]
    refs = [ref.split()[0] for ref in set(now["refs"]) - set(marker["refs"])]
    return sorted(refs) + files


def stopped_run_extras(workdir: Path, marker: Mapping[str, Any]) -> list[str]:
    """What a user added to the workspace of a run that was stopped (Ctrl-C, SIGTERM, a crash).

    Its own outputs are the stages' reports, dvc.lock, the params DVC set and what git ignores
    (data/, models/): anything else new or edited since its first commit, and any git ref that
    is not a DVC experiment's, was made by someone else.
    """
    status = git_output(workdir, "status", "--porcelain", "-z", "--no-renames", "--untracked-files=all")
    changed = (entry[3:] for entry in status.split("\0") if entry)  # "XY path"
    files = sorted(name for name in changed if not _stopped_run_output(Path(name)))
    now = set(workspace_state(workdir)["refs"])
    refs = [ref.split()[0] for ref in now - set(marker.get("refs", now))]  # an older marker holds none
    return sorted(ref for ref in refs if not ref.startswith("refs/exps/")) + files


def _stopped_run_output(name: Path) -> bool:
    return _project_run_output(name) or name == Path("params.yaml") or name.name == ".gitignore"


def prepare_workspace(project: Path, workdir: Path, source: Mapping[str, str], fresh: bool = False) -> None:
    """A fresh git repository holding the project's tracked and new (not ignored) files.

    The project's own run (dvc.lock and the stages' reports) stays behind: the workspace's
    first commit is the pipeline and its inputs, and its second (`commit_run`) this profile's run.
    A previous workspace is replaced only if gptlab made it and, unless `fresh`, nothing was
    added to it since (a DVC experiment, a tracking store, an edited file).
    """
    check_workdir(project, workdir)
    ours = workdir.is_dir() and (workdir / WORKSPACE_MARKER).is_file()
    if ours and not fresh and (added := later_work(workdir)):
        shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
        raise GptlabError(
            f"{workdir}: holds work made after the last smoke run ({shown}); nothing was deleted. "
            "Pass --fresh to replace it, or --workdir to run elsewhere"
        )
    files = git_output(project, "ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    for name in filter(None, files):
        source_file = project / name
        if source_file.is_file() and not _project_run_output(Path(name)):
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source_file, workdir / name)
    subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)
    # Its runs log to the project's store, whoever runs what in it (gptlab.paths.project_root).
    (workdir / PROJECT_POINTER).write_text(f"{project.resolve()}\n", encoding="utf-8")
    mark_workspace(workdir, finished=False)  # claims the folder before anything can stop the run
    commit_workspace(workdir, "smoke workspace", source)
    mark_workspace(workdir, finished=False)  # and records its first commit


def _project_run_output(name: Path) -> bool:
    """dvc.lock and reports/<stage>/...: what the project's own `dvc repro` wrote."""
    return name == Path("dvc.lock") or (name.parts[0] == REPORTS.name and len(name.parts) > 2)


def commit_workspace(workdir: Path, title: str, source: Mapping[str, str]) -> None:
    """Commit everything in the workspace, naming the project's commit in git trailers.

    `gptlab report` reads them (gptlab.book.reproduction): the throwaway repository's own
    commit says nothing about which code ran.
    """
    trailers = [f"Source-Commit: {source[SOURCE_COMMIT_ENV]}"] if SOURCE_COMMIT_ENV in source else []
    if SOURCE_DIRTY_ENV in source:
        trailers.append(f"Source-Dirty: {source[SOURCE_DIRTY_ENV]}")
    message = title + ("\n\n" + "\n".join(trailers) if trailers else "")
    git = ["git", "-c", "user.name=gptlab", "-c", "user.email=gptlab@localhost"]
    subprocess.run([*git, "add", "-A"], cwd=workdir, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", message], cwd=workdir, check=True)


def source_commit_env(project: Path) -> dict[str, str]:
    """GPTLAB_SOURCE_COMMIT / GPTLAB_SOURCE_DIRTY naming the project's commit, for tracking/lineage.py to tag runs with."""
    try:
        commit = git_output(project, "rev-parse", "HEAD").strip()
        status = git_output(project, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {SOURCE_COMMIT_ENV: commit, SOURCE_DIRTY_ENV: str(bool(status.strip())).lower()}


def run_profile(
    project: Path, profile: Path, workdir: Path, fresh: bool = False, *, workdir_given: bool = True
) -> Path:
    """Run every stage with the profile's overrides; returns the workspace's reports folder."""
    # before the lock file is made beside it (prepare_workspace checks again)
    check_workdir(project, workdir, given=workdir_given)
    overrides = load_overrides(profile, project / "params.yaml")
    with workspace_lock(workdir):
        return _run_in_workspace(project, profile, workdir, overrides, fresh)


def _run_in_workspace(
    project: Path, profile: Path, workdir: Path, overrides: dict[str, Any], fresh: bool
) -> Path:
    source = source_commit_env(project)
    prepare_workspace(project, workdir, source, fresh)
    # Runs land in the project's own MLflow store (not the throwaway workspace) unless told otherwise,
    # tagged with the project's own commit, not the workspace's.
    # Named by the profile and the time: two smoke runs are told apart in the UI and in `dvc exp show`.
    name = f"{profile.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    env = experiment_env(project, name)
    env.update(source)
    command = [*dvc_command(), "exp", "run", "--name", name, *set_arguments(overrides)]
    log = smoke_log(workdir)
    returncode = run_logged(command, workdir, env, log, verbose=bool(os.environ.get(VERBOSE_ENV)))
    if returncode:
        raise GptlabError(
            f"the {profile.stem} profile failed in {workdir} (dvc exp run exited {returncode}); "
            f"the stages' output is in {log}"
        )
    # The run as the workspace's HEAD: `dvc metrics diff`, `dvc plots diff` and `gptlab compare`
    # there then measure further experiments against it.
    commit_workspace(workdir, f"{profile.stem} run", source)
    mark_workspace(workdir, finished=True)
    return workdir / REPORTS


def dvc_command() -> list[str]:
    """dvc without its warnings for outputs not built yet (gptlab.pipeline.dvc_quiet); the plain dvc with `-v`."""
    return ["dvc"] if os.environ.get(VERBOSE_ENV) else [sys.executable, "-m", "gptlab.pipeline.dvc_quiet"]


# DVC's line as it starts a stage ("Running stage 'pretrain':"), and as it takes one from its cache.
_STAGE_LINE = re.compile(r"^(?:Running stage|Stage) '([^']+)'(?::| didn't change)")
# Lines of the log shown when the run fails: the stage's error is at its end.
FAILURE_TAIL = 15


def smoke_log(workdir: Path) -> Path:
    """Everything the stages printed: beside the workspace (.gptlab/smoke.log), never inside it."""
    return workdir.parent / f"{workdir.name}.log"


def stage_started(line: str) -> str | None:
    """The stage a line of `dvc exp run` output starts, if it starts one."""
    found = _STAGE_LINE.match(line.strip())
    return found.group(1) if found else None


def run_logged(command: list[str], workdir: Path, env: Mapping[str, str], log: Path, verbose: bool) -> int:
    """Run `command`, its output into `log`; the terminal gets a line per stage (every line if `verbose`).

    On a failure the log's last lines follow, so the stage's error shows without opening it.
    """
    stages = list((read_yaml(workdir / "dvc.yaml") or {}).get("stages", {}))
    started = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=FAILURE_TAIL)
    with log.open("w", encoding="utf-8") as out:
        child = subprocess.Popen(
            command,
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its group, stages included, is stopped as one (_signals_passed_on)
        )
        assert child.stdout is not None, "piped"
        with _signals_passed_on(child) as stopped_by:
            for line in child.stdout:
                out.write(line)
                out.flush()  # the log holds every line as it comes, whatever stops this process
                tail.append(line.rstrip("\n"))
                if verbose:
                    print(line, end="", flush=True)
                elif (stage := stage_started(line)) is not None:
                    number = f"{stages.index(stage) + 1}/{len(stages)}" if stage in stages else "-"
                    print(progress_line(number, stage, time.monotonic() - started), flush=True)
            returncode = child.wait()
    if stopped_by:
        name = "SIGTERM" if stopped_by[0] == signal.SIGTERM else "SIGINT (Ctrl-C)"
        print(f"\nstopped by {name}: the stages' output is in {log}; rerun `gptlab smoke`", file=sys.stderr)
        raise SystemExit(128 + stopped_by[0])  # the shell's code: 143 for SIGTERM, 130 for Ctrl-C
    if returncode and not verbose:
        print("\n".join(tail))
    return returncode


# Seconds `dvc exp run` has to stop its stage (each ends its MLflow run) before it is killed.
STOP_TIMEOUT_S = 30


@contextlib.contextmanager
def _signals_passed_on(child: subprocess.Popen[str]) -> Iterator[list[int]]:
    """Within the block, SIGTERM and Ctrl-C are passed on to `dvc exp run`'s process group, stages included.

    DVC exits on SIGTERM and leaves its stage running; the stage stops on it as it should (its
    MLflow run ends KILLED). The block reads on, so what they print as they stop is logged
    too. The list yields the signals seen; the group is killed if it has not exited
    STOP_TIMEOUT_S after the first, and a second signal acts as it did before. Outside the
    main thread (which alone takes signals), nothing is passed on.
    """
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    killer = threading.Timer(STOP_TIMEOUT_S, _signal_group, (child, signal.SIGKILL))
    killer.daemon = True

    def pass_on(signum: int, frame: object) -> None:
        signal.signal(signum, previous[signum])
        if not seen:
            killer.start()
        seen.append(signum)
        _signal_group(child, signum)

    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.getsignal(signum) or signal.SIG_DFL for signum in handled}
    for signum in handled:
        signal.signal(signum, pass_on)
    try:
        yield seen
    finally:
        killer.cancel()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _signal_group(child: subprocess.Popen[str], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # all of it has exited already
        os.killpg(child.pid, signum)


def progress_line(number: str, stage: str, elapsed_s: float) -> str:
    """`[3/8] pretrain  (at 1 min 05 s)`: what runs now, and how long into the run it started."""
    return f"[{number}] {stage:<19} (at {human_duration(elapsed_s)})"  # the longest: preference-finetune


def human_duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes else f"{rest} s"


def next_steps(workdir: Path, experiment: str | None) -> list[str]:
    """What to do after a smoke run: the lines `gptlab smoke` ends with."""
    ui = "gptlab ui" + (f" --experiment {experiment}" if experiment else "")
    return command_lines(
        [
            (ui, "its MLflow runs: curves, samples, models"),
            (f"cd {workdir} && gptlab compare", "its DVC experiments side by side"),
            ("gptlab metrics check", "its metrics against baselines/smoke.yaml, as CI does"),
            ("dvc repro", "the whole pipeline with params.yaml: the book's run (hours)"),
        ]
    )


def command_lines(steps: list[tuple[str, str]]) -> list[str]:
    """`Next:` and one aligned line per (command, what it does)."""
    width = max(len(command) for command, _ in steps) + 2
    return ["Next:", *(f"  {command:<{width}}# {what}" for command, what in steps)]
