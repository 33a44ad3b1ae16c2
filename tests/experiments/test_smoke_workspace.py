"""`gptlab smoke` deletes only what it made: never a user's folder, the project, or work added later;
its runs log to their own experiment, tagged with the project's commit and an id per smoke run.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gptlab.cli.main import main
from gptlab.errors import GptlabError
from gptlab.experiments.smoke import (
    WORKSPACE_MARKER,
    mark_workspace,
    next_steps,
    prepare_workspace,
    run_logged,
    run_profile,
    workspace_lock,
)

from helpers import PROJECT_ROOT


def smoke(project: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.chdir(project)
    return main(["smoke", "--no-check", *args])


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A project clone with a commit and an uncommitted file: what `--workdir .` once emptied."""
    project = tmp_path / "clone"
    project.mkdir()
    (project / "dvc.yaml").write_text("stages: {}\n", encoding="utf-8")
    (project / "profiles").mkdir()
    for name in ("params.yaml", "profiles/smoke.yaml"):
        shutil.copy2(PROJECT_ROOT / name, project / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run([*git, "add", "-A"], cwd=project, check=True)
    subprocess.run([*git, "commit", "-qm", "first"], cwd=project, check=True)
    (project / "notes.txt").write_text("uncommitted\n", encoding="utf-8")
    return project


@pytest.mark.parametrize("workdir", [".", "..", "sub/.."], ids=["the project", "above it", "dotted"])
def test_smoke_refuses_the_project_and_any_folder_holding_it(
    clone: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], workdir: str
) -> None:
    before = tree(clone.parent)
    assert smoke(clone, monkeypatch, "--workdir", workdir) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds the project itself" in err
    assert tree(clone.parent) == before  # .git, sources and uncommitted files all there


def test_smoke_refuses_a_users_folder_and_deletes_nothing(
    clone: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    users = tmp_path / "mine"
    (users / "keep").mkdir(parents=True)
    (users / "keep" / "thesis.txt").write_text("four years of work\n", encoding="utf-8")
    assert smoke(clone, monkeypatch, "--workdir", str(users), "--fresh") == 2
    err = capsys.readouterr().err
    assert f"--workdir {users}: not empty and not made by gptlab smoke; nothing was deleted" in err
    assert tree(users) == {"keep/thesis.txt": b"four years of work\n"}


def test_the_default_workspace_is_refused_by_its_name_not_as_a_workdir_never_given(
    clone: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    users = clone / ".gptlab" / "smoke"
    users.mkdir(parents=True)
    (users / "mine.txt").write_text("not gptlab's\n", encoding="utf-8")
    assert smoke(clone, monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"the default workspace {users}: not empty and not made by gptlab smoke" in err
    assert "--workdir " + str(users) not in err and "name a new folder with --workdir" in err
    assert tree(users) == {"mine.txt": b"not gptlab's\n"}
    # --profile takes a path as well as a name, as `gptlab run` does; its workspace is named after it.
    shutil.copy2(clone / "profiles" / "smoke.yaml", clone / "tiny.yaml")
    (clone / ".gptlab" / "tiny").mkdir()
    (clone / ".gptlab" / "tiny" / "mine.txt").write_text("x", encoding="utf-8")
    assert smoke(clone, monkeypatch, "--profile", "tiny.yaml") == 2
    assert f"the default workspace {clone / '.gptlab' / 'tiny'}: not empty" in capsys.readouterr().err


def test_a_second_smoke_refuses_while_the_first_runs(
    clone: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "ws"
    prepare_workspace(clone, workdir, {})
    before = tree(workdir)
    with workspace_lock(workdir):  # the first run holds it
        assert smoke(clone, monkeypatch, "--workdir", str(workdir)) == 2
    assert "another gptlab smoke is running there (pid " in capsys.readouterr().err
    assert tree(workdir) == before


def test_a_finished_workspace_is_replaced_only_while_it_holds_just_what_its_run_made(
    tmp_path: Path,
) -> None:
    workdir = tmp_path / "ws"
    prepare_workspace(PROJECT_ROOT, workdir, {})
    mark_workspace(workdir, finished=True)
    (workdir / "scratch").write_text("mine\n", encoding="utf-8")  # made after the run: the user's

    with pytest.raises(GptlabError, match=r"holds work made after the last smoke run \(scratch\)"):
        prepare_workspace(PROJECT_ROOT, workdir, {})
    assert (workdir / "scratch").read_text(encoding="utf-8") == "mine\n"

    (workdir / "scratch").unlink()
    prepare_workspace(PROJECT_ROOT, workdir, {})  # untouched since its run: gptlab's to replace
    assert (workdir / WORKSPACE_MARKER).is_file() and (workdir / "dvc.yaml").is_file()


def test_a_dvc_experiment_made_in_the_workspace_is_kept_unless_fresh(tmp_path: Path) -> None:
    workdir = tmp_path / "ws"
    prepare_workspace(PROJECT_ROOT, workdir, {})
    mark_workspace(workdir, finished=True)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=workdir, capture_output=True, text=True, check=True
    ).stdout.strip()
    # What `dvc exp run` leaves in git: a ref under refs/exps (no file in the work tree changes).
    subprocess.run(["git", "update-ref", "refs/exps/ab/cdef/my-lr-try", head], cwd=workdir, check=True)

    with pytest.raises(GptlabError, match=r"refs/exps/ab/cdef/my-lr-try.*Pass --fresh to replace it"):
        prepare_workspace(PROJECT_ROOT, workdir, {})
    prepare_workspace(PROJECT_ROOT, workdir, {}, fresh=True)
    refs = subprocess.run(["git", "for-each-ref"], cwd=workdir, capture_output=True, text=True).stdout
    assert "refs/exps" not in refs


def _stopped_run(workdir: Path) -> None:
    """What a smoke run stopped at its third stage leaves: outputs, DVC's params and refs, no finished record."""
    (workdir / "reports" / "pretrain").mkdir(parents=True, exist_ok=True)
    (workdir / "reports" / "pretrain" / "metrics.json").write_text("{}\n", encoding="utf-8")
    (workdir / "models" / "pretrain").mkdir(parents=True)
    (workdir / "models" / "pretrain" / "model.safetensors").write_bytes(b"weights")
    (workdir / "dvc.lock").write_text("schema: '2.0'\n", encoding="utf-8")
    with (workdir / "params.yaml").open("a", encoding="utf-8") as params:
        params.write("# dvc exp run -S wrote here\n")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=workdir, capture_output=True, text=True).stdout
    subprocess.run(["git", "update-ref", "refs/exps/exec/EXEC_HEAD", head.strip()], cwd=workdir, check=True)


def test_a_stopped_runs_workspace_keeps_what_a_user_added_unless_fresh(tmp_path: Path) -> None:
    workdir = tmp_path / "ws"
    prepare_workspace(PROJECT_ROOT, workdir, {})  # its marker says: not finished
    _stopped_run(workdir)
    (workdir / "USER.txt").write_text("mine\n", encoding="utf-8")

    with pytest.raises(GptlabError, match=r"holds work made after the last smoke run \(USER.txt\)"):
        prepare_workspace(PROJECT_ROOT, workdir, {})
    assert (workdir / "USER.txt").read_text(encoding="utf-8") == "mine\n"

    (workdir / "USER.txt").unlink()
    prepare_workspace(PROJECT_ROOT, workdir, {})  # only the stopped run's own outputs: replaced
    assert not (workdir / "models").exists() and not (workdir / "dvc.lock").exists()

    _stopped_run(workdir)
    subprocess.run(["git", "branch", "my-try"], cwd=workdir, check=True)  # a user's branch
    with pytest.raises(GptlabError, match=r"refs/heads/my-try"):
        prepare_workspace(PROJECT_ROOT, workdir, {})
    prepare_workspace(PROJECT_ROOT, workdir, {}, fresh=True)
    assert (
        "my-try" not in subprocess.run(["git", "branch"], cwd=workdir, capture_output=True, text=True).stdout
    )


@pytest.mark.parametrize(
    "marker",
    [
        "{not json",
        "[]",
        '{"finished": "yes"}',
        "",
        '{"finished": true}',
        '{"finished": false, "refs": [1, {}]}',
    ],
    ids=["json", "list", "type", "empty", "no files", "bad refs"],
)
def test_a_damaged_workspace_record_is_one_line_and_deletes_nothing(
    clone: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    marker: str,
) -> None:
    workdir = tmp_path / "ws"
    prepare_workspace(clone, workdir, {})
    (workdir / WORKSPACE_MARKER).write_text(marker, encoding="utf-8")
    (workdir / "USER.txt").write_text("mine\n", encoding="utf-8")
    before = tree(workdir)

    assert smoke(clone, monkeypatch, "--workdir", str(workdir)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is damaged" in err and str(WORKSPACE_MARKER) in err and "--fresh" in err
    assert tree(workdir) == before


def test_smoke_runs_log_to_their_own_experiment_tagged_with_the_projects_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = yaml.safe_load((PROJECT_ROOT / "profiles" / "smoke.yaml").read_text(encoding="utf-8"))
    assert profile["tracking"]["experiment"] == "gptlab-smoke"

    calls: list[tuple[list[str], dict[str, str]]] = []
    real_run = subprocess.run

    def fake_dvc(command, workdir, env, log, verbose):  # only `dvc exp run` is faked: git answers for real
        calls.append((command, env))
        return 0

    monkeypatch.setattr("gptlab.experiments.smoke.run_logged", fake_dvc)
    monkeypatch.setattr(
        "gptlab.experiments.smoke.prepare_workspace",
        lambda project, workdir, source, fresh: real_run(["git", "init", "-q", str(workdir)]),
    )
    monkeypatch.delenv("GPTLAB_PIPELINE_RUN", raising=False)
    for workdir in ("ws", "ws2"):
        run_profile(PROJECT_ROOT, PROJECT_ROOT / "profiles" / "smoke.yaml", tmp_path / workdir)
    head = real_run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    (first, env), (second, env2) = calls
    assert env["GPTLAB_SOURCE_COMMIT"] == head.stdout.strip()
    assert env["GPTLAB_SOURCE_DIRTY"] in ("true", "false")
    # Every stage of one smoke run shares its pipeline id; two smoke runs differ in it and in their name.
    name = first[first.index("--name") + 1]
    assert name.startswith("smoke-") and env["GPTLAB_PIPELINE_RUN"].startswith(f"{name}-")
    assert env["GPTLAB_PIPELINE_RUN"] != env2["GPTLAB_PIPELINE_RUN"]


# What `dvc exp run` prints for a three-stage DAG, with a stage's chatter (a JSON dump) in between.
DVC_OUTPUT = """\
import json
print("Running stage 'download':")
print("> python stages/download.py")
print("Stage 'tokenize' didn't change, skipping")
print(json.dumps({f"metric_{i}": i for i in range(60)}, indent=2))
print("Running stage 'train':", flush=True)
raise SystemExit(int(__import__("sys").argv[1]))
"""


@pytest.mark.parametrize("fails", [False, True])
def test_the_terminal_gets_a_line_per_stage_and_the_log_gets_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fails: bool
) -> None:
    (tmp_path / "dvc.yaml").write_text("stages: {download: {}, tokenize: {}, train: {}}\n", encoding="utf-8")
    log = tmp_path / "smoke.log"
    command = [sys.executable, "-c", DVC_OUTPUT, str(int(fails))]
    assert run_logged(command, tmp_path, {}, log, verbose=False) == int(fails)
    shown = capsys.readouterr().out.splitlines()
    progress = [line.split()[:2] for line in shown if line.startswith("[")]
    assert progress == [["[1/3]", "download"], ["[2/3]", "tokenize"], ["[3/3]", "train"]]
    assert '"metric_59": 59' in log.read_text(encoding="utf-8")  # all of it, in the log
    if fails:  # the log's last lines follow, where the stage's error is
        assert len(shown) == 3 + 15 and shown[-1] == "Running stage 'train':"
    else:
        assert len(shown) == 3


def test_a_smoke_run_ends_with_the_next_steps() -> None:
    lines = next_steps(Path(".gptlab/smoke"), "gptlab-smoke")
    commands = [line.split("#")[0].strip() for line in lines[1:]]
    assert commands == [
        "gptlab ui --experiment gptlab-smoke",
        "cd .gptlab/smoke && gptlab compare",
        "gptlab metrics check",
        "dvc repro",
    ]


# A stage that runs until it is stopped, and says so as a stage does.
SLOW_STAGE = """\
import signal, sys, time
def stop(signum, frame):
    print("stage: stopped by SIGTERM", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("Running stage 'train':", flush=True)
print("epoch 1 of 3", flush=True)
time.sleep(120)
"""
# As `dvc exp run` does: it runs the stage in a process of its own, and exits at once on SIGTERM.
DVC_LIKE = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]])"
# `gptlab smoke`'s loop over `dvc exp run`, in a process of its own to stop.
RUN_LOGGED = """\
import sys
from pathlib import Path
from gptlab.experiments.smoke import run_logged
workdir = Path(sys.argv[1])
run_logged([sys.executable, "-c", sys.argv[2], sys.argv[3]], workdir, {}, workdir / "smoke.log", verbose=False)
"""


def test_a_smoke_stopped_by_sigterm_stops_its_stage_says_so_in_one_line_and_keeps_its_log(
    tmp_path: Path,
) -> None:
    """Row 64: it exited 143 with no line, its log 0 bytes (never flushed), and DVC and its stage ran on."""
    (tmp_path / "dvc.yaml").write_text("stages: {train: {}}\n", encoding="utf-8")
    command = [sys.executable, "-c", RUN_LOGGED, str(tmp_path), DVC_LIKE, SLOW_STAGE]
    smoke_process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert smoke_process.stdout is not None
    assert smoke_process.stdout.readline().startswith("[1/1] train")  # the stage runs
    smoke_process.send_signal(signal.SIGTERM)
    out, err = smoke_process.communicate(timeout=60)
    assert smoke_process.returncode == 143
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGTERM") and "smoke.log" in lines[0], err
    logged = (tmp_path / "smoke.log").read_text(encoding="utf-8")
    assert (
        "epoch 1 of 3" in logged and "stage: stopped by SIGTERM" in logged
    )  # the stage stopped as it should
