"""A profile sweep's shared stages, run once before its variants and saved in DVC's run-cache for them.

Each variant is a DVC experiment in a workspace of its own. The stages before the swept one that are
not up to date in `dvc.lock` would run again in every variant: DVC saves no run-cache entry for a
stage with an uncached output that is neither a metric nor a plot, as the reports are, so no variant
could reuse another's pretrain. `dvc commit` saves the entry all the same. Without a profile, the
shared stages' params are the workspace's, and `dvc repro` plus a commit there makes them up to date
for every variant (docs/sweeps.md); on a profile, none can be. So the sweep runs them once, in a
scratch git worktree of the project (HEAD plus the changes to tracked files, as a queued experiment
gets) with the first variant's params, commits them there into the project's cache, and each
variant whose stage has the same deps and params checks its outputs out of the cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import yaml

from gptlab.errors import GptlabError
from gptlab.experiments import profiles
from gptlab.experiments.dvc_commands import Dvc
from gptlab.schema import nested, read_yaml

SCRATCH = Path(".gptlab") / "sweep-shared"  # under it, the worktree; ignored by git and DVC
LOG = SCRATCH.with_suffix(".log")
LOCK = "dvc.lock"


def upstream_stages(dvc: Dvc, stage: str) -> list[str]:
    """The stages `stage` depends on, directly or not, as `dvc dag` lists them (in order)."""
    return [
        name for name in re.findall(r'^"([^"]+)";$', dvc.ask("dag", "--dot", stage), re.M) if name != stage
    ]


def run_shared_stages(
    project: Path, dvc: Dvc, stage: str, overrides: Mapping[str, Any], *, timeout: float
) -> dict[str, Any]:
    """Run the stages before `stage` once with `overrides` (flat) and save them in DVC's run-cache.

    Returns their `dvc.lock` entries (none when nothing ran), for `shared_lock`. Their output goes
    to .gptlab/sweep-shared.log; a failure is one line naming it, and the variants are not queued.
    """
    stages = upstream_stages(dvc, stage)
    if not stages:
        return {}
    cache = dvc.ask("cache", "dir").strip()
    with _worktree(project) as scratch:
        params = profiles.merge_overrides(read_yaml(scratch / "params.yaml"), nested(dict(overrides)))
        (scratch / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
        here = Dvc(scratch, dvc.env, dvc.dvc, timeout=dvc.timeout)
        here("config", "--local", "cache.dir", cache)  # the project's cache, as a queued experiment's
        # Up to date in dvc.lock for these params (committed), only their outputs missing here: each
        # variant checks them out of the cache anyway.
        if set(_leaves(json.loads(here.ask("status", "--json", *stages) or "{}"))) <= {"deleted"}:
            return {}
        print(
            f"running the shared stages once for every variant ({', '.join(stages)}; log: {LOG})", flush=True
        )
        with (project / LOG).open("w", encoding="utf-8") as log:
            _run_logged([dvc.dvc, "repro", *stages], scratch, dvc.env, log, timeout)
        here("commit", "--force", *stages)  # saves each stage's run-cache entry, uncached outputs too
        locked = read_yaml(scratch / LOCK)["stages"]
    return {name: locked[name] for name in stages}


@contextmanager
def shared_lock(project: Path, entries: Mapping[str, Any]) -> Iterator[None]:
    """While the variants are queued, the project's dvc.lock holds the shared stages' `entries`.

    A queued experiment starts from the workspace's dvc.lock. One whose entries name outputs that
    are not in the cache (a fresh clone's) breaks DVC's experiment after a stage is checked out of
    the run-cache (`failed to load directory`); these entries' outputs are all there. The file is
    put back as it was, whatever happens.
    """
    path = project / LOCK
    if not entries:
        yield
        return
    original = path.read_bytes() if path.is_file() else None
    locked = yaml.safe_load(original or b"") or {"schema": "2.0", "stages": {}}
    locked["stages"] = {**locked.get("stages", {}), **entries}
    path.write_text(yaml.safe_dump(locked, sort_keys=False), encoding="utf-8")
    try:
        yield
    finally:
        if original is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(original)


def _leaves(status: Any) -> Iterator[str]:
    """The states in `dvc status --json`: "deleted", "modified", "changed command", ..."""
    if isinstance(status, dict):
        for value in status.values():
            yield from _leaves(value)
    elif isinstance(status, list):
        for value in status:
            yield from _leaves(value)
    else:
        yield str(status)


@contextmanager
def _worktree(project: Path) -> Iterator[Path]:
    """A detached git worktree of HEAD plus the tracked files' changes, removed whatever happens."""
    stash = _git(project, "stash", "create").strip()  # the changes as a commit; nothing touched
    (parent := project / SCRATCH).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=parent))
    _git(project, "worktree", "add", "--detach", "--force", str(scratch), stash or "HEAD")
    try:
        yield scratch
    finally:
        with suppress(GptlabError):
            _git(project, "worktree", "remove", "--force", str(scratch))
        shutil.rmtree(scratch, ignore_errors=True)
        with suppress(GptlabError):
            _git(project, "worktree", "prune")


def _git(project: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=project, capture_output=True, text=True)
    if done.returncode:
        said = (done.stderr.strip().splitlines() or [""])[-1]
        raise GptlabError(f"git {' '.join(args[:2])} failed (exit {done.returncode}): {said}")
    return done.stdout


def _run_logged(command: list[str], cwd: Path, env: Mapping[str, str], log: Any, timeout: float) -> None:
    """`command` with its output in `log`; stopped (Ctrl-C, SIGTERM, the timeout), its whole group ends."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise GptlabError(
            f"the shared stages did not finish within {timeout:g} s (--timeout); see {LOG}"
        ) from None
    finally:
        if proc.poll() is None:  # stopped, or timed out: no stage left running in the removed worktree
            _end_group(proc)
    if code:
        raise GptlabError(f"the shared stages failed (`{' '.join(command[1:])}` exit {code}): see {LOG}")


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to `proc`'s session (its stage ends its MLflow run as KILLED), SIGKILL 30 s later."""
    for signum, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
            return
