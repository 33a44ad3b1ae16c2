"""Bad inputs, one table per command (issue 14): each is refused with a message naming what is wrong,
the CLI's exit code tells "could not run" (2) from "a check failed" (1), and nothing is written or
overwritten on the way.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from gptlab.cli.main import main
from gptlab.data import spam, verdict
from gptlab.data.instruct import PREAMBLE, format_input
from gptlab.errors import GptlabError
from gptlab.experiments.metrics_check import load_baseline
from gptlab.experiments.sweep import sweep_path
from gptlab.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_model, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.fast_kernels import build_gpt
from gptlab.model.gpt import GPTModel
from gptlab.model.hf_gpt2 import load_hf_folder
from gptlab.schema import ConfigError, build
from gptlab.tasks.config import JudgeConfig

from helpers import PROJECT_ROOT

TINY = ModelConfig(vocab_size=300, context_length=32, emb_dim=32, n_heads=2, n_layers=2, qkv_bias=True)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) with its bytes: equal snapshots, nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The CLI's stderr, checked to be one `gptlab COMMAND: ...` line and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gptlab {command}: "), err
    return lines[0]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return save_model(build_gpt(TINY).eval(), tmp_path / "models" / "pretrain", {"stage": "pretrain"})


# --------------------------------------------------------------------------- #
# 1. gptlab export: never into a checkpoint, the source or a non-empty folder
# --------------------------------------------------------------------------- #


def _other_checkpoint(tmp_path: Path, source: Path) -> Path:
    return save_model(build_gpt(TINY), tmp_path / "models" / "other")


def _non_empty(tmp_path: Path, source: Path) -> Path:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "config.json").write_text('{"mine": true}\n')
    (folder / "todo.txt").write_text("keep me\n")
    return folder


@pytest.mark.parametrize(
    ("target", "force", "message"),
    [
        (lambda tmp, src: src, False, "is the checkpoint being exported"),
        (lambda tmp, src: src, True, "is the checkpoint being exported"),
        (
            lambda tmp, src: tmp / "models" / "pretrain" / ".." / "pretrain",
            True,
            "is the checkpoint being exported",
        ),
        (lambda tmp, src: tmp / "models", True, "holds the checkpoint being exported"),
        (_other_checkpoint, False, "is a gptlab checkpoint"),
        (_other_checkpoint, True, "is a gptlab checkpoint"),
        (_non_empty, False, "is not empty"),
        (lambda tmp, src: (tmp / "file.txt").write_text("x") and tmp / "file.txt", True, "is not a folder"),
    ],
    ids=[
        "source",
        "source-force",
        "source-other-spelling",
        "ancestor-force",
        "checkpoint",
        "checkpoint-force",
        "non-empty",
        "a-file",
    ],
)
def test_export_refuses_and_writes_nothing(
    tmp_path: Path,
    checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    target: Callable[[Path, Path], Path],
    force: bool,
    message: str,
) -> None:
    out = target(tmp_path, checkpoint)
    before = snapshot(tmp_path)

    argv = ["export", str(checkpoint), str(out)] + (["--force"] if force else [])
    assert main(argv) == 2

    line = one_line_error(capsys, "export")
    assert message in line and str(out) in line
    assert snapshot(tmp_path) == before  # byte-identical, and no temp folder left behind
    load_model(checkpoint)  # still a valid gptlab checkpoint


def test_export_into_non_empty_folder_with_force_replaces_it(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _non_empty(tmp_path, checkpoint)
    assert main(["export", str(checkpoint), str(out)]) == 2
    assert "--force" in one_line_error(capsys, "export")

    assert main(["export", str(checkpoint), str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert load_hf_folder(out).cfg.emb_dim == TINY.emb_dim
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "notes"]  # no temp or backup folder


def test_export_into_empty_or_new_folder_is_fine(tmp_path: Path, checkpoint: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["export", str(checkpoint), str(tmp_path / "empty")]) == 0
    assert main(["export", str(checkpoint), str(tmp_path / "new" / "deeper")]) == 0
    assert snapshot(tmp_path / "empty") == snapshot(tmp_path / "new" / "deeper")


def test_export_failure_midway_leaves_the_old_folder(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _non_empty(tmp_path, checkpoint)
    before = snapshot(tmp_path)

    def broken_save(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("disk full, say")

    monkeypatch.setattr("gptlab.model.hf_gpt2.save_file", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        main(["export", str(checkpoint), str(out), "--force"])
    assert snapshot(tmp_path) == before


def test_export_into_unwritable_folder_names_it(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "hf"
    real_mkdir = os.mkdir

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:  # what a read-only folder answers
        if Path(path).parent == locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    assert main(["export", str(checkpoint), str(out)]) == 2
    line = one_line_error(capsys, "export")
    assert str(out) in line and "Permission denied" in line
    assert list(locked.iterdir()) == []


def test_export_into_an_unwritable_place_names_it(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A parent that is a file cannot hold a folder, whoever runs the test (root ignores chmod 0o555).
    locked = tmp_path / "locked"
    locked.write_text("a file, not a folder")
    assert main(["export", str(checkpoint), str(locked / "hf")]) == 2
    assert str(locked) in one_line_error(capsys, "export")
    assert locked.read_text() == "a file, not a folder"  # nothing written


# --------------------------------------------------------------------------- #
# 5. gptlab metrics: 1 = regressed or missing, 2 = could not check; a baseline can be created
# --------------------------------------------------------------------------- #

GOOD_BASELINE = {
    "metrics": {
        "pretrain/metrics.json": {"val_loss": {"baseline": 6.0, "direction": "lower", "tolerance": 0.05}}
    }
}


def write_reports(root: Path, val_loss: float = 5.9) -> Path:
    reports = root / "reports"
    (reports / "pretrain").mkdir(parents=True, exist_ok=True)
    (reports / "spam").mkdir(parents=True, exist_ok=True)
    (reports / "eval").mkdir(parents=True, exist_ok=True)
    pretrain = {"val_loss": val_loss, "final_val_perplexity": 400.0, "steps": 10, "epochs": 1}
    (reports / "pretrain" / "metrics.json").write_text(json.dumps(pretrain))
    spam_metrics = {"test": {"accuracy": 0.9, "f1": 0.8, "confusion_matrix": [[1, 2], [3, 4]]}}
    (reports / "spam" / "metrics.json").write_text(json.dumps(spam_metrics))
    (reports / "eval" / "metrics.json").write_text(
        json.dumps({"val_loss": 6.5, "val_perplexity": float("inf")})
    )
    return reports


@pytest.mark.parametrize(
    ("baseline_text", "message"),
    [
        ("metrics:\n  pretrain/metrics.json: {val_loss: [1, 2\n", "line 3"),
        ("metrics:\n  - just a list\n", "expected a mapping"),
        ("metrics:\n  pretrain/metrics.json: [val_loss]\n", "metrics.pretrain/metrics.json"),
        ("metrics:\n  pretrain/metrics.json:\n    val_loss: 6.0\n", "metrics.pretrain/metrics.json.val_loss"),
        ("\xff\xfe garbage", "not UTF-8"),
    ],
    ids=["yaml-syntax", "wrong-shape", "file-not-a-mapping", "guard-not-a-mapping", "binary"],
)
@pytest.mark.parametrize("action", ["check", "update-baseline"])
def test_malformed_baseline_cannot_be_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], baseline_text: str, message: str, action: str
) -> None:
    baseline = tmp_path / "baseline.yaml"
    baseline.write_bytes(baseline_text.encode("latin-1"))
    reports = write_reports(tmp_path)
    before = snapshot(tmp_path)

    assert main(["metrics", action, "--baseline", str(baseline), "--reports", str(reports)]) == 2

    line = one_line_error(capsys, "metrics")
    assert str(baseline) in line and message in line
    assert snapshot(tmp_path) == before


def test_missing_baseline_or_reports_cannot_be_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "baseline.yaml"
    reports = write_reports(tmp_path)
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 2
    line = one_line_error(capsys, "metrics")
    assert str(baseline) in line and f"gptlab metrics update-baseline --baseline {baseline}" in line

    baseline.write_text(yaml.safe_dump(GOOD_BASELINE))
    for action in ("check", "update-baseline"):
        nowhere = tmp_path / "nowhere"
        assert main(["metrics", action, "--baseline", str(baseline), "--reports", str(nowhere)]) == 2
        assert f"reports folder {nowhere} not found" in one_line_error(capsys, "metrics")
    assert baseline.read_text() == yaml.safe_dump(GOOD_BASELINE)


def test_unreadable_metrics_file_cannot_be_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text(yaml.safe_dump(GOOD_BASELINE))
    reports = write_reports(tmp_path)
    (reports / "pretrain" / "metrics.json").write_text('{"val_loss": 5.')
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 2
    line = one_line_error(capsys, "metrics")
    assert str(reports / "pretrain" / "metrics.json") in line and "not valid JSON" in line


def test_regression_and_missing_metric_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text(yaml.safe_dump(GOOD_BASELINE))
    reports = write_reports(tmp_path, val_loss=7.0)
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 1
    assert "regressed" in capsys.readouterr().out
    (reports / "pretrain" / "metrics.json").unlink()
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 1
    assert "missing" in capsys.readouterr().out


def test_update_baseline_creates_a_new_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reports = write_reports(tmp_path)
    new = tmp_path / "baselines" / "new.yaml"

    assert main(["metrics", "update-baseline", "--baseline", str(new), "--reports", str(reports)]) == 0
    assert f"created {new}" in capsys.readouterr().out

    guards = load_baseline(new)
    assert set(guards) == {"pretrain/metrics.json", "spam/metrics.json", "eval/metrics.json"}
    assert set(guards["pretrain/metrics.json"]) == {"val_loss", "final_val_perplexity"}  # counts left out
    loss = guards["pretrain/metrics.json"]["val_loss"]
    assert (loss.baseline, loss.direction) == (5.9, "lower") and 0 < loss.tolerance < 0.5
    accuracy = guards["spam/metrics.json"]["test.accuracy"]
    assert (accuracy.baseline, accuracy.direction, accuracy.tolerance) == (0.9, "higher", 0.03)
    assert set(guards["eval/metrics.json"]) == {"val_loss"}  # an infinite perplexity cannot be a baseline
    assert new.read_text().startswith("#")  # says how it was made and how to update it
    assert main(["metrics", "check", "--baseline", str(new), "--reports", str(reports)]) == 0


def test_update_baseline_without_any_metric_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    new = tmp_path / "new.yaml"
    assert main(["metrics", "update-baseline", "--baseline", str(new), "--reports", str(reports)]) == 2
    line = one_line_error(capsys, "metrics")
    assert str(reports) in line and "update-baseline" not in line
    assert not new.exists()


def test_smoke_command_uses_the_check_of_metrics_check() -> None:
    import gptlab.cli.smoke as smoke_command
    import gptlab.experiments.metrics_check as metrics_check

    assert smoke_command.check is metrics_check.check


# --------------------------------------------------------------------------- #
# 5. Damaged .npy files and non-UTF-8 text name the file (and the line)
# --------------------------------------------------------------------------- #


def _pickled(path: Path) -> None:
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)


def _truncated(path: Path) -> None:
    np.save(path, np.arange(200, dtype=np.int32).reshape(2, 100))
    path.write_bytes(path.read_bytes()[:-50])


def _not_npy(path: Path) -> None:
    path.write_bytes(b"just some text, not an array\n")


def _floats(path: Path) -> None:
    np.save(path, np.ones((2, 4), dtype=np.float32))


def _out_of_vocabulary(path: Path) -> None:
    np.save(path, np.array([[15496, 995, 50257, 0], [1, 2, 3, 50256]], dtype=np.int32))


def _negative(path: Path) -> None:
    np.save(path, np.array([[15496, 995, -1, 0], [1, 2, 3, 50256]], dtype=np.int32))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_pickled, "pickled"),
        (_truncated, "truncated"),
        (_not_npy, "not a NumPy"),
        (_floats, "integer"),
        (
            _out_of_vocabulary,
            r"token id 50257 at index \(0, 2\) is outside GPT-2's vocabulary \(0 to 50256\)",
        ),
        (_negative, r"token id -1 at index \(0, 2\) is outside GPT-2's vocabulary"),
    ],
    ids=["pickled", "truncated", "not-npy", "floats", "out-of-vocabulary", "negative"],
)
@pytest.mark.parametrize("dataset", ["verdict", "spam"])
def test_damaged_npy_names_the_file(
    tmp_path: Path, damage: Callable[[Path], None], message: str, dataset: str
) -> None:
    processed = tmp_path / "processed"
    if dataset == "verdict":
        path = verdict.split_path(processed, "train")
        path.parent.mkdir(parents=True)
        damage(path)
        load = lambda: verdict.load_split(processed, "train")  # noqa: E731
    else:
        csv_path, path = spam.split_paths(processed, "train")
        path.parent.mkdir(parents=True)
        csv_path.write_text("text,label\nhello,0\nwin now,1\n")
        damage(path)
        load = lambda: spam.SpamDataset(processed, "train")  # noqa: E731
    before = snapshot(tmp_path)
    with pytest.raises(GptlabError, match=message) as info:
        load()
    assert str(path) in str(info.value)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("via_stdin", [False, True], ids=["file", "stdin"])
def test_classify_non_utf8_file_names_file_and_line(
    tmp_path: Path,
    checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    via_stdin: bool,
) -> None:
    messages = tmp_path / "messages.txt"
    messages.write_bytes("hello there\n\nfree prize\nvoil\xe0 une offre\n".encode("latin-1"))
    if via_stdin:

        class Stdin:
            buffer = io.BytesIO(messages.read_bytes())

        monkeypatch.setattr("sys.stdin", Stdin)
    source = "-" if via_stdin else str(messages)
    assert main(["classify", "--file", source, "--model", str(checkpoint)]) == 2
    line = one_line_error(capsys, "classify")
    assert ("<stdin>" if via_stdin else str(messages)) in line
    assert "line 4" in line and "UTF-8" in line


def test_classify_reads_utf8_lines_from_a_file_or_stdin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gptlab.cli.classify import _read_texts

    messages = tmp_path / "messages.txt"
    messages.write_text("voilà\r\n\nfree prize 😀\n", encoding="utf-8")
    assert _read_texts(["first"], str(messages)) == ["first", "voilà", "free prize 😀"]
    monkeypatch.setattr("sys.stdin", io.StringIO("from a text stream\n"))  # no .buffer: already text
    assert _read_texts([], "-") == ["from a text stream"]


# --------------------------------------------------------------------------- #
# 6. The judge: no redirects with the key, no key over plain HTTP to other hosts
# --------------------------------------------------------------------------- #


class Recorder:
    """A local HTTP server that records each request's method, path and headers, and answers `reply`."""

    def __init__(self, reply: Callable[[BaseHTTPRequestHandler], None]) -> None:
        self.requests: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def handle_any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                owner.requests.append(
                    {"method": self.command, "path": self.path, "headers": dict(self.headers)}
                )
                reply(self)

            do_GET = do_POST = handle_any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _chat_reply(handler: BaseHTTPRequestHandler) -> None:
    payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": "100"}}]}).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


@pytest.fixture
def servers() -> Iterator[tuple[Recorder, Recorder]]:
    """(judge, elsewhere): the judge answers every request with a 302 to `elsewhere`."""
    elsewhere = Recorder(_chat_reply)

    def redirect(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", f"{elsewhere.base}/v1/chat/completions")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    judge = Recorder(redirect)
    yield judge, elsewhere
    judge.close()
    elsewhere.close()


def judge_config(url: str, **extra: Any) -> JudgeConfig:
    section = {"enabled": True, "api": "openai", "url": url, "model": "llama3", "timeout_s": 5, **extra}
    return build(JudgeConfig, section, "instruct.judge")


@pytest.mark.parametrize("with_key", [True, False], ids=["key", "no-key"])
def test_judge_refuses_redirects(
    servers: tuple[Recorder, Recorder], monkeypatch: pytest.MonkeyPatch, with_key: bool
) -> None:
    from gptlab.tasks.judge import API_KEY_ENV, JudgeError, check_judge, judge_one

    judge, elsewhere = servers
    if with_key:
        monkeypatch.setenv(API_KEY_ENV, "sk-secret-123")
    else:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    cfg = judge_config(f"{judge.base}/v1/chat/completions")

    with pytest.raises(JudgeError, match="redirect") as info:
        check_judge(cfg)
    assert cfg.url in str(info.value) and elsewhere.base in str(info.value)
    assert "sk-secret-123" not in str(info.value)
    verdict = judge_one(cfg, {"instruction": "Say hi.", "input": "", "output": "hi"}, "hi")
    assert verdict.score is None and "redirect" in verdict.reply

    assert len(judge.requests) == 2
    assert judge.requests[0]["headers"].get("Authorization") == ("Bearer sk-secret-123" if with_key else None)
    assert elsewhere.requests == []  # the key (and the prompt) never reached the redirect target


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://judge.example.com/v1/chat/completions", False),
        ("http://10.1.2.3:8000/v1/chat/completions", False),
        ("http://127.0.0.2:8000/v1/chat/completions", True),  # loopback
        ("http://localhost:8000/v1/chat/completions", True),
        ("http://[::1]:8000/v1/chat/completions", True),
        ("https://judge.example.com/v1/chat/completions", True),
    ],
)
def test_judge_key_never_goes_over_plain_http_to_other_hosts(
    monkeypatch: pytest.MonkeyPatch, url: str, allowed: bool
) -> None:
    from gptlab.tasks import judge
    from gptlab.tasks.judge import API_KEY_ENV, JudgeError, check_judge

    sent: list[str] = []

    def fake_open(request: Any, timeout: float) -> Any:  # nothing leaves the machine
        sent.append(request.full_url)
        raise OSError("not connecting in a test")

    monkeypatch.setattr(judge._OPENER, "open", fake_open)
    monkeypatch.setenv(API_KEY_ENV, "sk-secret-123")
    if allowed:
        with pytest.raises(JudgeError, match="unreachable"):
            check_judge(judge_config(url))
        assert sent == [url]
        return
    with pytest.raises(JudgeError, match="allow_insecure_http") as info:
        check_judge(judge_config(url))
    assert url in str(info.value) and "sk-secret-123" not in str(info.value)
    assert sent == []

    # Without a key there is nothing to leak; with the explicit opt-in the key is sent.
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(JudgeError, match="unreachable"):
        check_judge(judge_config(url))
    monkeypatch.setenv(API_KEY_ENV, "sk-secret-123")
    with pytest.raises(JudgeError, match="unreachable"):
        check_judge(judge_config(url, allow_insecure_http=True))
    assert sent == [url, url]


def test_judge_allow_insecure_http_is_a_checked_bool() -> None:
    assert judge_config("http://localhost:1/x").allow_insecure_http is False
    with pytest.raises(ConfigError, match=r"instruct\.judge\.allow_insecure_http"):
        judge_config("http://localhost:1/x", allow_insecure_http="yes")
    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    assert params["instruct"]["judge"]["allow_insecure_http"] is False


# --------------------------------------------------------------------------- #
# 7. gptlab chat: crop the input, never the template; cap the answer at the context
# --------------------------------------------------------------------------- #

CHAT_CONTEXT = 96


@pytest.fixture
def chat_model(tmp_path: Path) -> Path:
    """A tiny language model over GPT-2's vocabulary that never says end-of-text (answers run to the cap)."""
    torch.manual_seed(0)
    model = build_gpt(
        ModelConfig(context_length=CHAT_CONTEXT, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)
    )
    with torch.no_grad():  # the final norm outputs a fixed vector that the head maps to ","
        model.final_norm.scale.zero_()
        model.final_norm.shift.zero_()
        model.final_norm.shift[0] = 1.0
        model.out_head.weight.zero_()
        model.out_head.weight[11, 0] = 1.0  # "," is id 11
    return save_model(model.eval(), tmp_path / "instruct")


@pytest.fixture
def generate_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, int]]:
    import gptlab.tasks.responses

    calls: list[tuple[torch.Tensor, int]] = []
    real = gptlab.tasks.responses.generate

    def spy(model: GPTModel, idx: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
        calls.append((idx.clone(), max_new_tokens))
        return real(model, idx, max_new_tokens, **kwargs)

    monkeypatch.setattr(gptlab.tasks.responses, "generate", spy)
    return calls


def chat(model: Path, shared_data: Path, *args: str) -> int:
    return main(["chat", *args, "--model", str(model), "--raw-dir", str(shared_data)])


def test_chat_long_input_is_cropped_not_the_instruction(
    chat_model: Path,
    shared_data: Path,
    tokenizer: Any,
    capsys: pytest.CaptureFixture[str],
    generate_calls: list[tuple[torch.Tensor, int]],
) -> None:
    instruction = "Summarize the text."
    long_input = " ".join(f"word{i}" for i in range(400))
    before = snapshot(chat_model)

    assert chat(chat_model, shared_data, instruction, "--input", long_input, "--max-new-tokens", "20") == 0

    out, err = capsys.readouterr()
    assert out.strip().startswith(",")  # the model's answer
    assert "warning" in err and "input" in err and "cropped" in err and "Traceback" not in err
    ((idx, max_new),) = generate_calls
    prompt = tokenizer.decode(idx[0].tolist())
    assert prompt.startswith(f"{PREAMBLE}\n\n### Instruction:\n{instruction}\n\n### Input:\nword0 word1")
    assert idx.shape[1] + max_new <= CHAT_CONTEXT  # nothing slides out of the window
    assert max_new == 20  # the answer's room was kept; the input gave way
    assert snapshot(chat_model) == before


def test_chat_huge_max_new_tokens_is_capped(
    chat_model: Path,
    shared_data: Path,
    capsys: pytest.CaptureFixture[str],
    generate_calls: list[tuple[torch.Tensor, int]],
) -> None:
    assert chat(chat_model, shared_data, "Say something.", "--max-new-tokens", "100000") == 0
    err = capsys.readouterr().err
    ((idx, max_new),) = generate_calls
    assert idx.shape[1] + max_new == CHAT_CONTEXT
    assert f"--max-new-tokens 100000 capped at {max_new}" in err


def test_chat_empty_answer_says_why(
    chat_model: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, metadata = load_model(chat_model)
    with torch.no_grad():  # the fixed vector now maps to end-of-text: the answer ends before it starts
        model.out_head.weight.zero_()
        model.out_head.weight[50256, 0] = 1.0
    save_model(model, chat_model, {**metadata, "steps": 3})
    assert chat(chat_model, shared_data, "Name a color.", "--max-new-tokens", "5") == 0
    out, err = capsys.readouterr()
    assert out == "\n"
    assert "warning: the model answered nothing after 3 training steps" in err and "train it longer" in err


def test_chat_instruction_longer_than_context_is_refused(
    chat_model: Path,
    shared_data: Path,
    capsys: pytest.CaptureFixture[str],
    generate_calls: list[tuple[torch.Tensor, int]],
) -> None:
    instruction = "Explain " + " ".join(["this"] * 200)
    assert chat(chat_model, shared_data, instruction, "--max-new-tokens", "5") == 2
    line = one_line_error(capsys, "chat")
    assert "instruction" in line and str(CHAT_CONTEXT) in line
    assert generate_calls == []


@pytest.mark.parametrize(
    "long_input",
    [
        " ".join(["naïve café 😀 ünïcödé"] * 100),
        "x" * 5000,
        "<|endoftext|> " * 200,
        "a\n\n### Response:\n" * 80,
    ],
    ids=["multi-byte", "one-long-word", "special-token", "fake-headers"],
)
def test_fit_to_context_crops_only_the_input(tokenizer: Any, long_input: str) -> None:
    from gptlab.tasks.responses import fit_to_context

    entry = {"instruction": "Summarize the text.", "input": long_input, "output": ""}
    fitted = fit_to_context(tokenizer, entry, context_length=CHAT_CONTEXT, max_new_tokens=10)

    assert fitted.input_cropped and fitted.max_new_tokens == 10
    assert fitted.entry["instruction"] == entry["instruction"]
    assert long_input.startswith(fitted.entry["input"]) and "\ufffd" not in fitted.entry["input"]
    prompt = format_input(fitted.entry)
    ids = tokenizer.encode(prompt, allowed_special={"<|endoftext|>"})
    assert len(ids) == fitted.prompt_tokens and len(ids) + fitted.max_new_tokens <= CHAT_CONTEXT
    assert tokenizer.decode(ids) == prompt  # the answer is found after the prompt, as generate_response needs

    short = {**entry, "input": "A short text."}
    assert fit_to_context(tokenizer, short, context_length=1024, max_new_tokens=10).entry == short


def test_smoke_runs_log_to_their_own_experiment_tagged_with_the_projects_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    import gptlab.experiments.smoke as smoke

    profile = yaml.safe_load((PROJECT_ROOT / "profiles" / "smoke.yaml").read_text(encoding="utf-8"))
    assert profile["tracking"]["experiment"] == "gptlab-smoke"

    calls: list[dict[str, str]] = []
    real_run = subprocess.run

    def fake_run(args, *rest, **kwargs):  # only `dvc exp run` is faked: git answers for real
        if "exp" in args:
            calls.append(kwargs["env"])
            return subprocess.CompletedProcess(args, 0)
        return real_run(args, *rest, **kwargs)

    monkeypatch.setattr(smoke.subprocess, "run", fake_run)
    monkeypatch.setattr(
        smoke,
        "prepare_workspace",
        lambda project, workdir, source, fresh: real_run(["git", "init", "-q", str(workdir)]),
    )
    smoke.run_profile(PROJECT_ROOT, PROJECT_ROOT / "profiles" / "smoke.yaml", tmp_path / "ws")
    head = real_run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    (env,) = calls
    assert env["GPTLAB_SOURCE_COMMIT"] == head.stdout.strip()
    assert env["GPTLAB_SOURCE_DIRTY"] in ("true", "false")


# --------------------------------------------------------------------------- #
# 9. Checkpoints checked before use (issue 23): finite weights, a config within the caps;
#    a folder where a file was meant is named as one
# --------------------------------------------------------------------------- #


def _damage_tensor(folder: Path, name: str, value: float) -> None:
    """Overwrite the first values of one tensor of a saved checkpoint, as a bad disk or a diverged run would."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / WEIGHTS_FILE))
    weights[name][:4] = value
    save_file(weights, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})


@pytest.fixture
def classifier(tmp_path: Path) -> Path:
    from gptlab.tasks.classifier import make_classifier

    torch.manual_seed(0)
    model = make_classifier(build_gpt(TINY), 2, trainable="head", trainable_blocks=1, seed=123).eval()
    metadata = {"labels": {"0": "ham", "1": "spam"}, "max_length": 8, "pooling": "last"}
    return save_model(model, tmp_path / "models" / "spam", metadata)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_classify_and_chat_refuse_weights_holding_nan_or_inf(
    classifier: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str], value: float
) -> None:
    _damage_tensor(classifier, "final_norm.scale", value)
    assert main(["classify", "--model", str(classifier), "You won a free prize"]) == 2
    line = one_line_error(capsys, "classify")
    assert str(classifier / WEIGHTS_FILE) in line and "final_norm.scale" in line
    assert "NaN or infinite" in line
    assert capsys.readouterr().out == ""  # no label printed
    _damage_tensor(checkpoint, "tok_emb.weight", value)
    assert main(["chat", "--model", str(checkpoint), "--max-new-tokens", "2", "Say hi"]) == 2
    line = one_line_error(capsys, "chat")
    assert str(checkpoint / WEIGHTS_FILE) in line and "tok_emb.weight" in line


def test_a_checkpoint_config_beyond_the_caps_is_refused_before_the_model_is_built(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads((checkpoint / CONFIG_FILE).read_text())
    # Cheapest first: without the caps, the 1000 small blocks are built, and refused only then.
    for key, value in (("n_layers", 1000), ("n_layers", 10**9), ("emb_dim", 10**7)):
        (checkpoint / CONFIG_FILE).write_text(
            json.dumps({**config, "model": {**config["model"], key: value}})
        )
        assert main(["classify", "--model", str(checkpoint), "hello"]) == 2
        line = one_line_error(capsys, "classify")
        assert str(checkpoint / CONFIG_FILE) in line and f"model.{key}: expected 1 to " in line
    many = {**config["model"], "emb_dim": 8192, "n_heads": 8, "n_layers": 256, "vocab_size": 50257}
    (checkpoint / CONFIG_FILE).write_text(json.dumps({**config, "model": many}))
    assert main(["classify", "--model", str(checkpoint), "hello"]) == 2
    assert "parameters, over the cap of 4,000,000,000" in one_line_error(capsys, "classify")


def test_a_folder_given_for_a_file_is_named_as_a_folder(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "messages"
    folder.mkdir()
    assert main(["classify", "--file", str(folder), "--model", str(checkpoint)]) == 2
    assert (
        one_line_error(capsys, "classify") == f"gptlab classify: --file {folder}: is a directory, not a file"
    )
    weights = checkpoint / WEIGHTS_FILE
    assert main(["chat", "--model", str(weights), "Say hi"]) == 2
    assert one_line_error(capsys, "chat").startswith(
        f"gptlab chat: --model {weights}: is a file, not a checkpoint"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    assert main(["run", "--profile", str(folder)]) == 2
    assert one_line_error(capsys, "run") == f"gptlab run: profile {folder}: is a directory, not a file"
    with pytest.raises(
        IsADirectoryError, match=re.escape(f"sweep file {folder}: is a directory, not a file")
    ):
        sweep_path(folder)
    assert main(["metrics", "check", "--baseline", str(folder)]) == 2
    assert (
        one_line_error(capsys, "metrics")
        == f"gptlab metrics: baseline {folder}: is a directory, not a baseline file"
    )
