"""The CLI checks its arguments before it loads torch or MLflow (seconds): one line naming the argument."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gptlab.cli.main import main

from helpers import PROJECT_ROOT, one_line_error

HEAVY = ("torch", "mlflow")
SEPARATOR = "=== next ==="

# Each command in one Python: after each, none of HEAVY may have been imported (by it or one before).
RUN_IN_TURN = f"""
import json, sys
from gptlab.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    print({SEPARATOR!r}, file=sys.stderr, flush=True)
    results.append([code, sorted(m for m in {HEAVY!r} if m in sys.modules)])
print(json.dumps(results))
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project's layout without its outputs: params.yaml, dvc.yaml and the profiles."""
    root = tmp_path / "project"
    root.mkdir()
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(PROJECT_ROOT / name, root / name)
    shutil.copytree(PROJECT_ROOT / "profiles", root / "profiles")
    return root


def run_in_turn(commands: list[list[str]], cwd: Path) -> list[tuple[int, list[str], str]]:
    """Each command's exit code, the heavy modules loaded by then, and its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", RUN_IN_TURN, json.dumps(commands)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    errors = done.stderr.split(f"{SEPARATOR}\n")
    results = json.loads(done.stdout.splitlines()[-1])
    return [(code, heavy, err.strip()) for (code, heavy), err in zip(results, errors, strict=False)]


def test_bad_arguments_are_refused_before_torch_or_mlflow_load(project: Path) -> None:
    profiles = ", ".join(sorted(p.stem for p in (project / "profiles").glob("*.yaml")))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = {
            "chat --max-new-tokens -3": (
                ["chat", "--max-new-tokens", "-3", "Name a color."],
                "gptlab chat: --max-new-tokens: expected 1 to 10000, got -3",
            ),
            "chat --temperature": (
                ["chat", "--temperature", "1000", "Name a color."],
                "gptlab chat: --temperature: expected 0 (greedy) or a number from 0.01 to 100, got 1000",
            ),
            # No --model and no models/spam here: the missing file is what is wrong first.
            "classify --file missing": (
                ["classify", "--file", "/nonexistent.txt"],
                "gptlab classify: --file /nonexistent.txt: no such file",
            ),
            "classify --raw-dir missing": (
                ["classify", "--raw-dir", "nowhere", "hi"],
                "gptlab classify: --raw-dir nowhere: no such folder",
            ),
            "ui --port busy": (
                ["ui", "--port", str(port)],
                f"gptlab ui: port {port} on 127.0.0.1 is already in use",
            ),
            "ui --port range": (
                ["ui", "--port", "70000"],
                "gptlab ui: --port: expected 1 to 65535, got 70000",
            ),
            "smoke --profile": (
                ["smoke", "--profile", "nosuch"],
                f"gptlab smoke: profile profiles/nosuch.yaml not found (profiles here: {profiles})",
            ),
            "run --profile": (
                ["run", "--profile", "nosuch"],
                f"gptlab run: profile profiles/nosuch.yaml not found (profiles here: {profiles})",
            ),
            "run --name": (
                ["run", "--profile", "smoke", "--name", "smoke\u202egpj"],
                "gptlab run: --name: control character U+202E (RIGHT-TO-LEFT OVERRIDE)",
            ),
            "report --reports": (
                ["report", "--reports", "/nonexistent"],
                "gptlab report: --reports /nonexistent: no such folder",
            ),
            "metrics check --reports": (
                ["metrics", "check", "--reports", "/nonexistent"],
                "gptlab metrics: --reports /nonexistent: no such folder",
            ),
        }
        results = run_in_turn([argv for argv, _ in cases.values()], project)
    assert len(results) == len(cases)
    for (case, (_, expected)), (code, heavy, err) in zip(cases.items(), results, strict=True):
        assert code == 2 and err.startswith(expected) and "\n" not in err, (case, err)
        assert heavy == [], f"{case}: {heavy} loaded before the refusal"
    assert not (project / ".gptlab").exists()  # nothing started, nothing written


def test_classify_reads_a_bounded_amount_from_an_endless_file(project: Path) -> None:
    """/dev/zero never ends: without a cap it is read until memory runs out."""
    [(code, heavy, err)] = run_in_turn([["classify", "--file", "/dev/zero"]], project)
    assert code == 2 and heavy == []
    assert err == (
        "gptlab classify: --file /dev/zero: more than 64 MiB of messages, the most one call reads; "
        "split the file, or is it endless?"
    )


def test_classify_prints_a_long_message_cut_on_one_line(
    tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from gptlab.model.build import build_gpt
    from gptlab.model.checkpoint import save_model
    from gptlab.model.config import ModelConfig
    from gptlab.tasks.classifier import make_classifier

    torch.manual_seed(0)
    cfg = ModelConfig(context_length=32, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)
    model = make_classifier(build_gpt(cfg), 2, trainable="head", trainable_blocks=1, seed=123).eval()
    metadata = {"labels": {"0": "ham", "1": "spam"}, "max_length": 8, "pooling": "last"}
    folder = save_model(model, tmp_path / "spam", metadata)
    long = "win a prize\t" * 100_000  # 1.2 MB, tabs in it
    assert main(["classify", "--model", str(folder), "--raw-dir", str(shared_data), long]) == 0
    label, probability, shown = capsys.readouterr().out.rstrip("\n").split("\t")
    assert label in ("ham", "spam") and 0.5 <= float(probability) <= 1
    assert shown == f"{' '.join(long.split())[:200]}… ({len(long):,} characters)"
    assert main(["classify", "--model", str(folder), "--raw-dir", str(shared_data), "--json", long]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == long  # whole, for a program to read


def test_promote_lists_the_registered_models_when_the_name_is_unknown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    client = MlflowClient()
    for name in ("gptlab-smoke-spam", "gptlab-smoke-instruct"):
        client.create_registered_model(name)
    assert main(["promote", "gptlab-spam", "99"]) == 2
    line = one_line_error(capsys, "promote")
    assert "no registered model 'gptlab-spam'" in line
    assert "the registered models are gptlab-smoke-instruct, gptlab-smoke-spam" in line
    assert main(["promote", "gptlab-smoke-spam", "99"]) == 2
    assert "no version 99 of registered model 'gptlab-smoke-spam'" in one_line_error(capsys, "promote")
