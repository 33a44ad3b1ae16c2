"""dvc commands run as subprocesses, each bounded; read-only ones asked again when they stall.

`dvc exp show` reads each experiment's files out of git through pygit2, whose blob reader can wait
for good: it clears its "chunk ready" event after finding the queue empty, so a writer thread that
finishes in between is never heard (pygit2 1.21, `_BlobIO.readinto`). On a busy 2-core machine, one
`dvc exp show` poll of a running sweep stalled so in each of two test runs. A stalled dvc uses no
CPU where a slow one does, so a query that used none for `stall_after` seconds is stopped and asked
again: a read changes nothing. `dvc queue status` reads no file out of git.

`Dvc` runs them in one project and environment; `experiments` and `revision_row` read what
`dvc exp show --json` answers (the sweep reads it so, and `gptlab compare` too).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError
from gptlab.schema import flatten

DVC_CALL_TIMEOUT_S = 300.0  # one dvc command: one waiting on a lock would wait forever
STALL_AFTER_S = 30.0  # a read-only dvc command that used no CPU this long has stalled
QUERY_ATTEMPTS = 3  # stalled reads asked again, in all
QUEUE_STATES = ("queued", "running", "success", "failed")  # a task's, in `dvc queue status`
_PROGRESS_CPU_S = 0.05  # CPU seconds that count as work done, above a clock tick or two


@dataclass(frozen=True)
class Finished:
    """A dvc command's exit code and output."""

    code: int
    stdout: str
    stderr: str


class Stalled(GptlabError):
    """A read-only dvc command used no CPU for the stall bound and was stopped."""


def describe(args: Sequence[str]) -> str:
    """`dvc exp show --json ...`: how messages name a command."""
    return f"`dvc {' '.join(args[:3])} ...`"


def run_dvc(
    dvc: str,
    args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = DVC_CALL_TIMEOUT_S,
    stall_after: float | None = None,
) -> Finished:
    """Run `dvc ARGS` in its own session, stopped after `timeout` s, or `stall_after` s without CPU.

    Output goes to files: `dvc queue start`'s workers inherit them, and a pipe would wait for those.
    Its own session: Ctrl-C in the terminal reaches gptlab alone, which decides when dvc stops.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        command = [dvc, *args]
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            code = _wait(proc, args, timeout, stall_after)
        finally:
            if proc.poll() is None:  # stopped, or this process interrupted: no dvc left behind
                proc.kill()
                proc.wait()
        out.seek(0)
        err.seek(0)
        return Finished(code, out.read(), err.read())


def _wait(
    proc: subprocess.Popen[bytes], args: Sequence[str], timeout: float, stall_after: float | None
) -> int:
    started = progressed = time.monotonic()
    cpu = 0.0
    while True:
        try:
            return proc.wait(timeout=min(1.0, timeout))
        except subprocess.TimeoutExpired:
            now = time.monotonic()
        if now - started > timeout:
            raise GptlabError(
                f"{describe(args)} did not finish within {timeout:g} s and was stopped: is another dvc command holding the project? (`dvc queue status`)"
            )
        if stall_after is None:
            continue
        used = _cpu_seconds(proc.pid)
        if used is None or used - cpu >= _PROGRESS_CPU_S:  # None: it has just ended
            cpu, progressed = used or cpu, now
        elif now - progressed > stall_after:
            raise Stalled(f"{describe(args)} used no CPU for {stall_after:g} s and was stopped")


def _cpu_seconds(pid: int) -> float | None:
    import psutil  # here: the CLI's parser imports this module, and `gptlab --version` needs no psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system + times.children_user + times.children_system


def ask_dvc(
    dvc: str,
    args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = DVC_CALL_TIMEOUT_S,
    stall_after: float = STALL_AFTER_S,
    attempts: int = QUERY_ATTEMPTS,
) -> Finished:
    """A read-only dvc command (`exp show`, `queue status`), asked again when it stalls."""
    ask = functools.partial(run_dvc, dvc, args, cwd=cwd, env=env, timeout=timeout, stall_after=stall_after)
    for _ in range(attempts - 1):
        with contextlib.suppress(Stalled):
            return ask()
    try:
        return ask()
    except Stalled as stalled:
        raise GptlabError(f"{stalled}, {attempts} times in a row") from None


@dataclass(frozen=True)
class QueueStatus:
    """DVC's queue as `dvc queue status` has it: each task's state by experiment name, and its workers."""

    states: dict[str, str]  # queued, running, success or failed
    workers: tuple[int, int] | None  # (active, idle); None when it does not say


# DVC's default params file: its keys are shown bare, other files' as `file:key` (as DVC does).
DEFAULT_PARAMS_FILE = "params.yaml"
# The pseudo-revision of uncommitted changes in `dvc exp show --json`.
WORKSPACE = "workspace"


@dataclass(frozen=True)
class ExperimentRow:
    """One revision of `dvc exp show --json`: the commit, one of its experiments, or the workspace."""

    name: str
    state: str  # the executor's: queued, running, success, failed ("" when DVC gives none)
    rev: str | None = None  # the full commit, or "workspace"
    params: dict[str, Any] = field(default_factory=dict)  # {key or file:key: value}
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # {metrics file: {dotted key: value}}
    created: str = ""  # "YYYY-MM-DD HH:MM", "" for the workspace

    @property
    def shown_state(self) -> str:
        """The state as the table shows it: none once done."""
        return "" if self.state == "success" else self.state


def experiments(entry: dict[str, Any]) -> list[ExperimentRow]:
    """The experiments of one revision of `dvc exp show --json`, in DVC's order (newest first)."""
    found = []
    for experiment in entry.get("experiments") or []:
        revision = (experiment.get("revs") or [{}])[0]
        state = (experiment.get("executor") or {}).get("state") or ""
        found.append(revision_row(revision, experiment.get("name") or revision.get("name"), state))
    return found


def revision_row(revision: dict[str, Any], name: str | None, state: str) -> ExperimentRow:
    """One revision's params (`file:key` for other params files, as DVC names them) and metrics, flattened."""
    data = revision.get("data") or {}
    rev = revision.get("rev")
    params: dict[str, Any] = {}
    for file, content in (data.get("params") or {}).items():
        prefix = "" if file == DEFAULT_PARAMS_FILE else f"{file}:"
        params.update({prefix + key: value for key, value in flatten(content.get("data") or {}).items()})
    metrics = {
        file: flatten(content.get("data") or {}) for file, content in (data.get("metrics") or {}).items()
    }
    created = (data.get("timestamp") or "").replace("T", " ")[:16]
    return ExperimentRow(name or short_rev(rev), state, rev, params, metrics, created)


def short_rev(rev: str | None) -> str:
    return rev if rev == WORKSPACE else (rev or "")[:7]


@dataclass(frozen=True)
class Dvc:
    """dvc commands in one project and environment, each bounded; a failure is one line naming it."""

    project: Path
    env: Mapping[str, str]
    dvc: str = "dvc"
    timeout: float = DVC_CALL_TIMEOUT_S
    stall_after: float = STALL_AFTER_S  # the read-only ones'

    def __call__(self, *args: str) -> str:
        """A command that changes the project: run once."""
        return _checked(args, run_dvc(self.dvc, args, cwd=self.project, env=self.env, timeout=self.timeout))

    def ask(self, *args: str) -> str:
        """A read-only command: asked again when it stalls."""
        asked = ask_dvc(
            self.dvc, args, cwd=self.project, env=self.env, timeout=self.timeout, stall_after=self.stall_after
        )
        return _checked(args, asked)

    def experiments(self) -> dict[str, ExperimentRow]:
        """The experiments of HEAD, queued, running and done, by name (`dvc exp show --json`)."""
        return {
            row.name: row
            for entry in json.loads(self.ask("exp", "show", "--json") or "[]")
            for row in experiments(entry)
        }

    def queue_status(self) -> QueueStatus:
        """The queue's tasks and workers, read from no experiment's files.

        Its table lists running tasks first, then queued, failed, succeeded: a name's first row is
        its latest task.
        """
        said = self.ask("queue", "status")
        states: dict[str, str] = {}
        for line in said.splitlines()[1:]:  # below the heading: Task, Name, Created, Status
            if len(cells := line.split()) >= 4 and (state := cells[-1].lower()) in QUEUE_STATES:
                states.setdefault(cells[1], state)
        workers = re.search(r"Worker status:\s*(\d+) active,\s*(\d+) idle", said)
        return QueueStatus(states, (int(workers.group(1)), int(workers.group(2))) if workers else None)


@contextlib.contextmanager
def signals_held() -> Iterator[list[int]]:
    """SIGINT and SIGTERM within the block are recorded, not acted on, so a dvc command in flight ends
    on its own (`dvc exp run --queue` killed halfway can leave params.yaml with a variant's values)."""
    received: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in held}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _checked(args: Sequence[str], done: Finished) -> str:
    if done.code:
        said = " / ".join((done.stderr.strip() or done.stdout.strip()).splitlines()[-3:])
        raise GptlabError(f"{describe(args)} failed (exit {done.code}): {said}")
    return done.stdout
