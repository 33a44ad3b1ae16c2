"""The reproduction report: the book's figures file, the comparison with a reports folder, the CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gptlab.book.reproduction import (
    LIVE,
    NOT_RUN,
    OFF,
    OK,
    RunInfo,
    compare,
    load_book,
    render_markdown,
    write_report,
)
from gptlab.cli.main import main
from gptlab.errors import GptlabError
from gptlab.experiments.smoke import commit_workspace
from gptlab.tracking.store import tracking_uri

from helpers import PROJECT_ROOT

BOOK = PROJECT_ROOT / "reproduction" / "book.yaml"


def write_yaml(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def figure(id: str, **fields: object) -> dict[str, object]:
    row: dict[str, object] = {
        "id": id,
        "chapter": 5,
        "description": f"figure {id}",
        "where": "ch. 5, section 5.1.3 printout",
        "book": "10.987",
        "tolerance": {"abs": 0.001, "reason": "printed to 3 decimals"},
        "ours": {"file": "pretrain/metrics.json", "key": "initial_train_loss"},
    }
    row.update(fields)
    return row


def small_book(path: Path, *figures: dict[str, object]) -> Path:
    return write_yaml(path, {"chapters": {5: "Pretraining on unlabeled data"}, "figures": list(figures)})


@pytest.fixture
def reports(tmp_path: Path) -> Path:
    """A fake reports folder: pretrain metrics and losses, and a project that used gpt2.source pretrain."""
    folder = tmp_path / "project" / "reports"
    (folder / "pretrain").mkdir(parents=True)
    (folder / "pretrain" / "metrics.json").write_text(
        json.dumps({"initial_train_loss": 10.9874, "initial_val_loss": 11.5, "nested": {"a": 2, "b": 3}}),
        encoding="utf-8",
    )
    (folder / "pretrain" / "losses.csv").write_text(
        "step,tokens_seen,train_loss,val_loss\n0,512,9.7812,9.933\n85,46080,0.3912,6.452\n", encoding="utf-8"
    )
    write_yaml(tmp_path / "project" / "params.yaml", {"gpt2": {"source": "pretrain"}})
    return folder


def test_book_file_loads_and_every_row_is_well_formed() -> None:
    book = load_book(BOOK)
    ids = [f.id for f in book.figures]
    assert len(ids) == len(set(ids))
    assert {f.chapter for f in book.figures} == {2, 3, 4, 5, 6, 7, "E"}
    for f in book.figures:
        assert f.where.startswith(f"app. {f.chapter}" if f.chapter == "E" else f"ch. {f.chapter}"), f.id
        assert f.tolerance.reason, f.id
        assert f.ours is not None or f.needs, f.id
    by_id = {f.id: f for f in book.figures}
    # A few figures the issue names, as the book prints them.
    assert by_id["ch2-verdict-characters"].book == 20_479
    assert by_id["ch4-params-untied"].book == 163_009_536
    assert by_id["ch5-initial-val-loss"].book == 10.98111
    assert by_id["ch6-final-test-accuracy"].book == 95.67
    assert [by_id[f"ch7-split-{s}"].book for s in ("train", "val", "test")] == [935, 55, 110]
    assert by_id["ch6-initial-val-accuracy"].book_text == "45.00"


def test_matching_value_is_ok_outside_tolerance_is_off_missing_file_is_not_run(
    tmp_path: Path, reports: Path
) -> None:
    book = load_book(
        small_book(
            tmp_path / "book.yaml",
            figure("match"),  # 10.9874 against 10.987 ± 0.001
            figure(
                "csv-match",
                book="0.391",
                ours={"file": "pretrain/losses.csv", "row": {"step": 85}, "column": "train_loss"},
            ),
            figure("off", book="10.5", ours={"file": "pretrain/metrics.json", "key": "initial_val_loss"}),
            figure(
                "summed",
                book="5",
                tolerance={"abs": 0, "reason": "counts"},
                ours={"file": "pretrain/metrics.json", "key": ["nested.a", "nested.b"]},
            ),
            figure("no-file", ours={"file": "spam/metrics.json", "key": "test.accuracy", "scale": 100}),
            figure("no-key", ours={"file": "pretrain/metrics.json", "key": "final_train_loss"}),
            figure("no-row", ours={"file": "pretrain/losses.csv", "row": {"step": 90}, "column": "val_loss"}),
            figure("openai", needs="OpenAI's weights"),
        )
    )
    outcomes = {o.figure.id: o for o in compare(book, reports)}
    assert outcomes["match"].status == OK and outcomes["match"].ours == pytest.approx(10.9874)
    assert outcomes["csv-match"].status == OK
    assert outcomes["off"].status == OFF
    assert outcomes["off"].reason == "off by 1.00, more than the tolerance"  # 11.5 against 10.5
    assert outcomes["summed"].status == OK and outcomes["summed"].ours == 5
    assert outcomes["no-file"].status == NOT_RUN and "stage not run" in outcomes["no-file"].reason
    assert outcomes["no-key"].status == NOT_RUN and "final_train_loss" in outcomes["no-key"].reason
    assert outcomes["no-row"].status == NOT_RUN and "step=90" in outcomes["no-row"].reason
    openai = outcomes["openai"]
    assert openai.status == NOT_RUN
    assert "needs OpenAI's weights" in openai.reason and "pretrain" in openai.reason


def test_figures_needing_openai_weights_are_compared_when_the_run_used_them(
    tmp_path: Path, reports: Path
) -> None:
    write_yaml(reports.parent / "params.yaml", {"gpt2": {"source": "huggingface"}})
    book = load_book(small_book(tmp_path / "book.yaml", figure("openai", needs="OpenAI's weights")))
    [outcome] = compare(book, reports)
    assert outcome.status == OK


def test_gpt2_source_is_read_from_dvc_lock_first(reports: Path) -> None:
    lock = {
        "schema": "2.0",
        "stages": {"load-gpt2": {"params": {"params.yaml": {"gpt2": {"source": "huggingface"}}}}},
    }
    write_yaml(reports.parent / "dvc.lock", lock)
    run = RunInfo.of_reports(reports)
    assert run.gpt2_source == "huggingface" and run.params_origin == "dvc.lock"


@pytest.mark.slow
def test_chapter_4_parameter_counts_from_our_model_equal_the_books() -> None:
    book = load_book(BOOK)
    counted = [
        f
        for f in book.figures
        if f.ours is not None and f.ours.live in ("parameter_count", "parameter_megabytes")
    ]
    assert len(counted) >= 4
    for f in counted:
        ours = LIVE[f.ours.live](None, **f.ours.args) * f.ours.scale
        assert f.tolerance.allows(f.book, ours), (f.id, ours, f.book)


def test_appendix_e_trainable_counts_from_our_lora_equal_the_books() -> None:
    book = {f.id: f for f in load_book(BOOK).figures}
    for name, printed in (("appE-trainable-before", 124_441_346), ("appE-trainable-lora", 2_666_528)):
        f = book[name]
        assert f.book == printed and f.chapter == "E"
        assert LIVE[f.ours.live](None, **f.ours.args) == printed, name


def test_every_sweep_variant_the_book_file_reads_is_in_the_spam_sweep() -> None:
    from gptlab.experiments.sweep import load_sweep

    sweep = load_sweep(PROJECT_ROOT / "sweeps" / "spam.yaml", PROJECT_ROOT / "params.yaml")
    read = {
        f.ours.row["variant"]
        for f in load_book(BOOK).figures
        if f.ours is not None and f.ours.file == "sweeps/spam.csv"
    }
    assert read and read <= set(sweep.variants)
    for f in load_book(BOOK).figures:  # the book's table and appendix E ran on OpenAI's weights
        if f.ours is not None and f.ours.file == "sweeps/spam.csv":
            assert f.needs and f.needs.startswith("OpenAI's"), f.id


def test_a_sweep_row_is_checked_against_its_own_gpt2_source(tmp_path: Path, reports: Path) -> None:
    """The workspace ran on pretrain; the sweep's rows say which weights each variant started from."""
    (reports / "sweeps").mkdir()
    (reports / "sweeps" / "spam.csv").write_text(
        "variant,experiment,status,gpt2.source,test_accuracy\n"
        "lora,spam-lora,success,huggingface,0.9667\n"
        "smoke,spam-smoke,success,pretrain,0.5\n",
        encoding="utf-8",
    )

    def row(variant: str) -> dict[str, object]:
        return {
            "file": "sweeps/spam.csv",
            "row": {"variant": variant},
            "column": "test_accuracy",
            "scale": 100,
        }

    book_path = write_yaml(
        tmp_path / "book.yaml",
        {
            "chapters": {
                5: "Pretraining on unlabeled data",
                "E": "Parameter-efficient fine-tuning with LoRA",
            },
            "figures": [
                figure("lora", chapter="E", book="96.67", needs="OpenAI's weights", ours=row("lora")),
                figure("smoke", chapter="E", book="96.67", needs="OpenAI's weights", ours=row("smoke")),
                figure("gone", book="96.67", needs="OpenAI's weights", ours=row("missing")),
            ],
        },
    )
    outcomes = {o.figure.id: o for o in compare(load_book(book_path), reports)}
    assert outcomes["lora"].status == OK and outcomes["lora"].ours == pytest.approx(96.67)
    assert outcomes["smoke"].status == NOT_RUN
    assert "sweeps/spam.csv's row gpt2.source is pretrain" in outcomes["smoke"].reason
    assert (
        outcomes["gone"].status == NOT_RUN and "this run's gpt2.source is pretrain" in outcomes["gone"].reason
    )
    text = render_markdown(book_path, reports)
    assert text.index("## Chapter 5") < text.index("## Appendix E: Parameter-efficient fine-tuning with LoRA")

    (reports / "sweeps" / "spam.csv").unlink()
    write_yaml(reports.parent / "params.yaml", {"gpt2": {"source": "huggingface"}})
    outcomes = {o.figure.id: o for o in compare(load_book(book_path), reports)}
    assert "sweep not run" in outcomes["lora"].reason and "gptlab sweep spam" in outcomes["lora"].reason


@pytest.mark.slow
def test_chapter_2_and_4_figures_computed_from_the_data_equal_the_books(shared_data: Path) -> None:
    run = RunInfo(Path("reports"), shared_data, {"data.raw_dir": str(shared_data)}, None, None, None)
    book = {f.id: f for f in load_book(BOOK).figures}
    for name in ("ch2-verdict-tokens", "ch4-greedy-hello"):
        f = book[name]
        assert LIVE[f.ours.live](run, **f.ours.args) == f.book, name


def test_cli_writes_the_report_and_exits_0(
    tmp_path: Path, reports: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    book = small_book(tmp_path / "book.yaml", figure("match"), figure("openai", needs="OpenAI's weights"))
    out = tmp_path / "out" / "REPRODUCTION.md"
    assert main(["report", "--reports", str(reports), "--book", str(book), "--out", str(out), "--log"]) == 0
    text = out.read_text(encoding="utf-8")
    assert "## Chapter 5: Pretraining on unlabeled data" in text
    assert "| ✓ |" in text
    assert "not run: needs OpenAI's weights; this run's gpt2.source is pretrain" in text
    assert "1 ✓, 0 ✗, 1 not run" in capsys.readouterr().out
    # Asked to (--log), it is also logged to MLflow, as a `report` run holding the same text.
    client = MlflowClient(tracking_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gptlab").experiment_id])
    assert run.info.run_name == "report" and run.data.tags["gptlab.figures_ok"] == "1"
    logged = Path(client.download_artifacts(run.info.run_id, "REPRODUCTION.md", str(tmp_path / "dl")))
    assert logged.read_text(encoding="utf-8") == text


def test_report_defaults_to_the_reports_folder(tmp_path: Path, reports: Path) -> None:
    book = small_book(tmp_path / "book.yaml", figure("match"))
    out, outcomes = write_report(None, book, reports)
    assert out == reports / "REPRODUCTION.md"
    assert [o.status for o in outcomes] == [OK]
    # The text to log to MLflow is the file's text.
    assert render_markdown(book, reports) == out.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (figure("typo", tolerence={"abs": 1}), "figure 'typo': tolerence: unknown key"),
        ({k: v for k, v in figure("bare").items() if k != "where"}, "figure 'bare': where: missing key"),
        (figure("no-reason", tolerance={"abs": 0.1}), "figure 'no-reason': tolerance.reason: missing key"),
        (
            figure("two-bounds", tolerance={"abs": 0.1, "rel": 0.01, "reason": "printed to 1 decimal"}),
            "figure 'two-bounds': tolerance: expected exactly one of `abs` and `rel`",
        ),
        (
            figure("json-column", ours={"file": "pretrain/metrics.json", "key": "a", "column": "b"}),
            "figure 'json-column': ours.column: is for .csv files",
        ),
        (figure("bad-book", book={"about": 10}), "figure 'bad-book': book:"),
        (figure("bad-list", book="[1, 2"), "is not a printed list"),
        (figure("cut-first", book="[..., 1]"), "figure 'cut-first': book: Ellipsis in a list"),
        (figure("bad-live", ours={"live": "nope"}), "figure 'bad-live': ours.live: unknown figure 'nope'"),
        (
            figure("bad-args", ours={"live": "verdict_tokens", "args": {"x": 1}}),
            "figure 'bad-args': ours.args:",
        ),
        (figure("bad-chapter", chapter=3), "figure 'bad-chapter': chapter: 3"),
    ],
)
def test_malformed_book_file_is_one_line_error_naming_the_row(
    tmp_path: Path, row: dict[str, object], message: str
) -> None:
    path = small_book(tmp_path / "book.yaml", figure("fine"), row)
    with pytest.raises(GptlabError, match=message.replace("(", r"\(")) as info:
        load_book(path)
    assert "\n" not in str(info.value)


def test_malformed_book_file_makes_the_cli_exit_2(
    tmp_path: Path, reports: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = small_book(tmp_path / "book.yaml", figure("typo", tolerence={"abs": 1}))
    assert main(["report", "--reports", str(reports), "--book", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gptlab report: ") and "figure 'typo'" in err and "\n" not in err


def test_report_on_a_smoke_workspace_logs_to_its_experiment_and_names_the_projects_commit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = tmp_path / "ws"
    reports = workspace / "reports"
    (reports / "pretrain").mkdir(parents=True)
    (reports / "pretrain" / "metrics.json").write_text(json.dumps({"final_val_loss": 6.5}))
    params = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text(encoding="utf-8"))
    params["tracking"]["experiment"] = "gptlab-smoke"  # as `dvc exp run -S` leaves the profile's params
    write_yaml(workspace / "params.yaml", params)
    subprocess.run(["git", "init", "-q", str(workspace)], check=True)
    project_commit = "0123456789abcdef0123456789abcdef01234567"
    commit_workspace(
        workspace, "smoke run", {"GPTLAB_SOURCE_COMMIT": project_commit, "GPTLAB_SOURCE_DIRTY": "false"}
    )
    book = small_book(tmp_path / "book.yaml", figure("match"))

    assert main(["report", "--reports", str(reports), "--book", str(book), "--write", "--log"]) == 0
    header = (reports / "REPRODUCTION.md").read_text(encoding="utf-8")
    assert "- commit: 0123456\n" in header  # the project's commit, not the throwaway repository's
    client = MlflowClient(tracking_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gptlab-smoke").experiment_id])
    assert run.info.run_name == "report"
    assert client.get_experiment_by_name("gptlab") is None


def test_a_profiles_run_off_the_book_says_why_in_its_row(
    tmp_path: Path, reports: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles = reports.parent / "profiles"
    profiles.mkdir()
    write_yaml(profiles / "smoke.yaml", {"gpt2": {"source": "pretrain"}})
    book = small_book(
        tmp_path / "book.yaml",
        figure(
            "off", book="10.5", unit="nats", ours={"file": "pretrain/metrics.json", "key": "initial_val_loss"}
        ),
    )
    assert main(["report", "--reports", str(reports), "--book", str(book), "--out", "-"]) == 0
    out, err = capsys.readouterr()
    (row,) = [line for line in out.splitlines() if line.startswith("| figure off")]
    assert (
        "| ✗: off by 1.00 nats, more than the tolerance; the run used the smoke profile "
        "(profiles/smoke.yaml), not the book's settings |" in row
    )
    # The report went to stdout, the summary to stderr, and no file was written.
    assert "0 ✓, 1 ✗, 0 not run" in err
    assert not (reports / "REPRODUCTION.md").exists()


def test_figures_of_a_stage_on_data_of_your_own_are_other_data_not_compared(
    tmp_path: Path, reports: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (reports / "tokenize").mkdir()
    counts = {
        "verdict": {"train": {"chars": 18431}, "val": {"chars": 2048}},
        "instruct": {"train": {"records": 14}},
    }
    (reports / "tokenize" / "counts.json").write_text(json.dumps(counts), encoding="utf-8")
    (reports / "preference").mkdir()
    (reports / "preference" / "counts.json").write_text(json.dumps({"train_records": 14}), encoding="utf-8")
    rows = [
        figure(
            "chars",
            book="20,479",
            ours={"file": "tokenize/counts.json", "key": ["verdict.train.chars", "verdict.val.chars"]},
        ),
        figure(
            "instructions", book="935", ours={"file": "tokenize/counts.json", "key": "instruct.train.records"}
        ),
        figure("pairs", book="935", ours={"file": "preference/counts.json", "key": "train_records"}),
        figure("loss", book="10.987"),
    ]
    book = small_book(tmp_path / "book.yaml", *rows)
    project = reports.parent
    own = {
        "tokenize": {"instruct": {"path": "examples/own-data/instructions.jsonl"}},
        "gpt2": {"source": "pretrain"},
    }
    write_yaml(project / "params.yaml", own)

    def statuses() -> dict[str, str]:
        assert main(["report", "--reports", str(reports), "--book", str(book), "--out", "-"]) == 0
        out = capsys.readouterr().out
        return {
            line.split("`")[1]: line.split(" | ")[5]
            for line in out.splitlines()
            if line.startswith("| figure ") and "`" in line
        }

    got = statuses()
    why = (
        "other data: instructions of your own (tokenize.instruct.path: examples/own-data/instructions.jsonl), "
        "not the book's: not compared"
    )
    # the instructions' counts and the DPO stage that starts from their model; the Verdict and pretrain compared
    assert got == {"chars": "✓", "instructions": why, "pairs": why, "loss": "✓"}
    # the book's file, even under another data.raw_dir, is the book's
    own["tokenize"]["instruct"]["path"] = "inputs/instruction-data.json"
    own["data"] = {"raw_dir": "inputs"}
    write_yaml(project / "params.yaml", own)
    assert statuses() == {
        "chars": "✓",
        "instructions": "✗: off by 921.0, more than the tolerance",
        "pairs": "✗: off by 921.0, more than the tolerance",
        "loss": "✓",
    }


@pytest.mark.slow
def test_report_without_arguments_in_a_clone_leaves_git_clean_and_mlflow_empty(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(PROJECT_ROOT), str(clone)], check=True)
    monkeypatch.chdir(clone)
    monkeypatch.setenv("GPTLAB_MIRROR", str(shared_data))  # the live figures read the pinned inputs
    assert main(["report"]) == 0
    assert capsys.readouterr().out.startswith(".gptlab/REPRODUCTION.md: ")
    assert (
        (clone / ".gptlab" / "REPRODUCTION.md")
        .read_text(encoding="utf-8")
        .startswith("# Reproduction report")
    )
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored=no"], cwd=clone, capture_output=True, text=True
    )
    assert status.stdout == ""
    # No MLflow experiment was made for it (only MLflow's own Default, if the store exists).
    assert {e.name for e in MlflowClient(tracking_uri()).search_experiments()} <= {"Default"}
