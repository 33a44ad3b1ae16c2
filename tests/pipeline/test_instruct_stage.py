"""The instruct-finetune stage end to end on a tiny model, its judge wiring, and `gptlab chat`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from gptlab.cli.main import main as gptlab_main
from gptlab.data import instruct
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import WEIGHTS_FILE, CheckpointError, load_model, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.generate import generate
from gptlab.model.tokenizer import END_OF_TEXT_ID, load_tokenizer
from gptlab.pipeline.params import load_params
from gptlab.pipeline.stage import stage_main
from gptlab.tasks.judge import JudgeError
from gptlab.tasks.responses import extract_response
from stages.instruct_finetune import run

from helpers import PROJECT_ROOT, committed_params_raw, flip_tensor_bits

STAGE_SCRIPT = PROJECT_ROOT / "stages" / "instruct_finetune.py"
RECORDS = 4  # per split
MAX_NEW_TOKENS = 4


class ScriptedJudge:
    """An Ollama-shaped judge: the n-th scoring request gets 60 + n, every fourth an unusable reply."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = request["messages"][0]["content"]
                owner.prompts.append(prompt)
                n = sum(p.startswith("Given the input") for p in owner.prompts) - 1
                content = "100" if n < 0 else ScriptedJudge.reply(n)
                body = json.dumps({"message": {"role": "assistant", "content": content}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/chat"

    @staticmethod
    def reply(n: int) -> str:
        return "I cannot tell." if n % 4 == 3 else str(60 + n)


@pytest.fixture
def judge() -> Iterator[ScriptedJudge]:
    fake = ScriptedJudge()
    thread = threading.Thread(target=fake.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def write_params(project: Path, shared_data: Path, **judge: Any) -> None:
    """The committed params.yaml shrunk to a tiny, fast run; raw data read straight from the test inputs."""
    params = committed_params_raw()
    params["data"]["raw_dir"] = str(shared_data)
    params["tokenize"]["instruct"]["max_records"] = RECORDS
    instruct = params["instruct"]
    instruct["allowed_max_length"] = 128
    instruct["max_new_tokens"] = MAX_NEW_TOKENS
    instruct["train"].update(batch_size=2, eval_freq=2, eval_iter=1, device="cpu")
    params["checkpoints"]["every_steps"] = 4
    instruct["judge"].update(judge)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture
def project(tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp project (cwd) with tiny instruction splits and a tiny base model at models/gpt2/gpt2-medium."""
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, shared_data)
    params = load_params()
    split = params.tokenize.instruct
    records = instruct.read_splits(split, shared_data / params.data.sources.instruction_data.path)
    instruct.write_splits(records, params.data.processed_dir, load_tokenizer(shared_data))
    cfg = ModelConfig(context_length=128, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.1, qkv_bias=True)
    save_model(build_gpt(cfg), tmp_path / "models" / "gpt2" / "gpt2-medium", {"source": "test"})
    return tmp_path


def run_stage(project: Path) -> subprocess.CompletedProcess[str]:
    # -P: the script's folder stays off sys.path, where stages/tokenize.py would shadow the stdlib's tokenize.
    return subprocess.run(
        [sys.executable, "-P", str(STAGE_SCRIPT)],
        cwd=project,
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=300,
    )


def stage_runs(experiment: str) -> list:
    uri = os.environ["MLFLOW_TRACKING_URI"]
    if not Path(uri.removeprefix("sqlite:///")).exists():
        return []  # nothing ever opened the store
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    runs = client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])
    return [r for r in runs if r.info.run_name == "instruct-finetune"]


@pytest.mark.slow
def test_stage_end_to_end_with_judge_then_resumed_without(
    project: Path, shared_data: Path, judge: ScriptedJudge, capsys: pytest.CaptureFixture[str]
) -> None:
    write_params(project, shared_data, enabled=True, url=judge.url)
    first = run_stage(project)
    assert first.returncode == 0, first.stderr[-3000:]

    reports = project / "reports" / "instruct"
    metrics = json.loads((reports / "metrics.json").read_text())
    counted = json.loads((reports / "counts.json").read_text())
    responses = json.loads((reports / "responses.json").read_text())
    test_split = json.loads((project / "data" / "processed" / "instruct" / "test.json").read_text())

    # Answers: one per test record, prompt and header stripped.
    assert [{k: r[k] for k in ("instruction", "input", "output")} for r in responses] == test_split
    assert len(responses) == RECORDS == counted["test_records"]
    for record in responses:
        assert "Below is an instruction" not in record["model_response"]
        assert record["model_response"] == record["model_response"].strip()
        assert 0.0 <= record["rougeL_f1"] <= 1.0
    assert metrics["rougeL_f1"] == pytest.approx(sum(r["rougeL_f1"] for r in responses) / RECORDS)

    # Training: 4 records in batches of 2 for 2 epochs, evaluated every 2 steps.
    assert counted["steps"] == 4
    losses = pd.read_csv(reports / "losses.csv")
    assert list(losses.columns) == ["step", "tokens_seen", "train_loss", "val_loss"]
    assert losses["step"].tolist() == [0, 2]
    assert 0 < losses["tokens_seen"].iloc[0] < losses["tokens_seen"].iloc[-1] < counted["tokens_seen"]
    assert metrics["final_train_loss"] == pytest.approx(losses["train_loss"].iloc[-1])
    assert metrics["final_val_loss"] == pytest.approx(losses["val_loss"].iloc[-1])
    for key in ("val_loss", "test_loss"):
        assert 0.0 < metrics[key] < 20.0

    # Judge: one reachability probe before training, then one request per answer.
    assert len(judge.prompts) == 1 + RECORDS
    assert judge.prompts[1].endswith("Respond with the integer number only.")
    expected = [None if n % 4 == 3 else 60 + n for n in range(RECORDS)]
    assert [r["judge_score"] for r in responses] == expected
    usable = [s for s in expected if s is not None]
    assert counted["judge"]["scored"] == len(usable)
    assert counted["judge"]["unusable"] == RECORDS - len(usable)
    assert metrics["judge"] == {"mean": pytest.approx(sum(usable) / len(usable))}  # the only judge metric
    assert sum(counted["judge"]["histogram"].values()) == len(usable)

    # Checkpoint: a language model that remembers where it came from.
    model, metadata = load_model(project / "models" / "instruct")
    assert model.cfg.num_classes is None and model.cfg.drop_rate == 0.0
    assert metadata["base_model"] == "gpt2-medium"
    assert metadata["steps"] == 4
    assert metadata["generation"] == {"max_new_tokens": MAX_NEW_TOKENS}  # `gptlab chat`'s default

    # MLflow: a finished run with the metrics, the answer table, the reports and the checkpoint.
    (mlflow_run,) = stage_runs("gptlab")
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.metrics["instruct/rougeL_f1"] == pytest.approx(metrics["rougeL_f1"])
    assert mlflow_run.data.metrics["instruct/judge_mean"] == pytest.approx(metrics["judge"]["mean"])
    assert mlflow_run.data.params["instruct.base_model"] == "gpt2-medium"
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    artifacts = {
        a.path
        for folder in ("", "model", "instruct", "instruct/reports")
        for a in client.list_artifacts(mlflow_run.info.run_id, folder)
    }
    assert {
        "instruct/reports/metrics.json",
        "instruct/answers.json",
        "instruct/answer_examples.txt",
        "instruct/loss.png",
    } <= artifacts
    # The checkpoint is the run's logged model, registered as gptlab-instruct (no second copy).
    assert not any(path.startswith("model") for path in artifacts)
    (version,) = client.search_model_versions("name = 'gptlab-instruct'")
    assert version.run_id == mlflow_run.info.run_id
    table = json.loads(
        Path(client.download_artifacts(mlflow_run.info.run_id, "instruct/answers.json")).read_text()
    )
    assert table["columns"] == ["instruction", "input", "reference", "answer", "rougeL_f1", "judge_score"]
    assert len(table["data"]) == RECORDS

    # A finished run leaves nothing to resume; turning the judge off retrains to the same numbers.
    assert not any((project / ".gptlab" / "runs" / "instruct-finetune").glob("*/step-*"))
    write_params(project, shared_data, enabled=False, url=judge.url)
    capsys.readouterr()
    run(load_params())
    assert "resuming from" not in capsys.readouterr().err
    rerun = json.loads((reports / "metrics.json").read_text())
    assert "judge" not in rerun
    for key in ("final_train_loss", "final_val_loss", "val_loss", "test_loss", "rougeL_f1"):
        assert rerun[key] == metrics[key]
    assert len(judge.prompts) == 1 + RECORDS

    # `gptlab chat` answers a test instruction exactly as the stage did, with the model's own
    # answer length (what the stage answered with), whatever params.yaml now says.
    record = responses[0]
    args = ["chat", record["instruction"], "--input", record["input"]]
    edited = yaml.safe_load(Path("params.yaml").read_text())
    edited["instruct"]["max_new_tokens"] = 1
    Path("params.yaml").write_text(yaml.safe_dump(edited))
    capsys.readouterr()
    assert gptlab_main(args) == 0
    assert capsys.readouterr().out == record["model_response"] + "\n"


@pytest.mark.slow
def test_answers_stop_where_the_base_models_context_is_full_and_the_stage_says_so(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A base with context 64 and instruct.max_new_tokens 256: no answer slides the window past its prompt."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["tracking"].update(system_metrics=False, log_models=False)
    params["instruct"].update(allowed_max_length=64, max_new_tokens=256)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    cfg = ModelConfig(context_length=64, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.1, qkv_bias=True)
    save_model(build_gpt(cfg), project / "models" / "gpt2" / "gpt2-medium", {"source": "test"})

    run(load_params())

    import torch

    # Each answer is the trained model's first (64 - prompt length) tokens, where 256 would go on.
    tokenizer = load_tokenizer(Path(load_params().data.raw_dir))
    model, _ = load_model(project / "models" / "instruct")
    responses = json.loads((project / "reports" / "instruct" / "responses.json").read_text())
    longer = 0
    for record in responses:
        prompt = tokenizer.encode(instruct.format_input(record))
        room = max(64 - len(prompt), 0)
        uncapped = generate(model, torch.tensor([prompt]), 256, eos_id=END_OF_TEXT_ID)[0].tolist()
        text = tokenizer.decode(uncapped[: len(prompt) + room])
        assert record["model_response"] == extract_response(text, instruct.format_input(record))
        longer += len(uncapped) > len(prompt) + room
    assert longer > 0  # an untrained model rambles on: the cap is what ended its answers
    err = capsys.readouterr().err
    assert f"warning: instruct.max_new_tokens 256 capped for {RECORDS} of {RECORDS} test answers" in err
    assert "the context of the base model gpt2-medium (64 tokens)" in err


def test_unreachable_judge_fails_before_training(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/api/chat"
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, shared_data, enabled=True, url=url)
    with pytest.raises(JudgeError, match="unreachable"):
        run(load_params())
    with pytest.raises(SystemExit) as exit_info:
        stage_main(run, "instruct-finetune", ["--params", "params.yaml"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert url in err and "instruct.judge.enabled: false" in err
    assert not (tmp_path / "models").exists()
    assert stage_runs("gptlab") == []


def test_missing_base_model_is_named(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, shared_data)
    with pytest.raises(FileNotFoundError, match="models/gpt2/gpt2-medium"):
        run(load_params())
    assert stage_runs("gptlab") == []


def test_a_base_model_with_flipped_bits_is_refused_before_training(project: Path) -> None:
    """Finite values, so no NaN check would tell: the base model's manifest does."""
    weights = project / "models" / "gpt2" / "gpt2-medium" / WEIGHTS_FILE
    flip_tensor_bits(weights, "out_head.weight")
    with pytest.raises(
        CheckpointError, match=r"models/gpt2/gpt2-medium/model\.safetensors: its SHA-256 is not"
    ):
        run(load_params())
    assert not (project / "models" / "instruct").exists()


def test_chat_without_a_model_says_how_to_get_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gptlab_main(["chat", "Name a color.", "--model", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no instruction-tuned model" in err and "dvc repro instruct-finetune" in err


def test_chat_after_a_smoke_run_names_the_command_that_uses_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = ModelConfig(context_length=16, emb_dim=16, n_heads=2, n_layers=1)
    save_model(build_gpt(cfg), ".gptlab/smoke/models/instruct")
    assert gptlab_main(["chat", "Name a color."]) == 2
    err = capsys.readouterr().err
    assert "gptlab chat --model .gptlab/smoke/models/instruct --raw-dir .gptlab/smoke/data/raw" in err


def test_chat_refuses_an_empty_instruction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_model(
        build_gpt(ModelConfig(context_length=64, emb_dim=32, n_heads=2, n_layers=2)), tmp_path
    )
    assert gptlab_main(["chat", "  ", "--model", str(model_dir)]) == 2
    assert "instruction is empty" in capsys.readouterr().err


@pytest.mark.slow
def test_lora_stage_trains_adapters_and_saves_a_plain_model_chat_and_export_read(
    project: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """instruct.trainable lora: only the adapters train; the saved model is merged, a plain GPT-2."""
    import torch
    from transformers import GPT2LMHeadModel

    from gptlab.model.hf_gpt2 import export_checkpoint
    from gptlab.model.lora import add_lora

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["tracking"].update(system_metrics=False, log_models=False)
    params["instruct"].update(trainable="lora", lora={"rank": 4, "alpha": 8})
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    base, _ = load_model(project / "models" / "gpt2" / "gpt2-medium")
    with torch.device("meta"):
        expected = sum(p.numel() for p in add_lora(build_gpt(base.cfg), 4, 8).parameters() if p.requires_grad)

    run(load_params())

    out = capsys.readouterr().out
    assert "gpt2-medium (" in out and f"): {expected:,} of " in out
    counted = json.loads((project / "reports" / "instruct" / "counts.json").read_text())
    assert counted["trainable_params"] == expected
    model, metadata = load_model(project / "models" / "instruct")
    assert metadata["lora"] == {"rank": 4, "alpha": 8.0, "merged": True} and metadata["trainable"] == "lora"
    assert not torch.equal(model.out_head.weight, base.out_head.weight)  # the head's adapter trained
    assert torch.equal(model.tok_emb.weight, base.tok_emb.weight)  # no linear layer: frozen
    # `gptlab export` writes the merged weights; transformers gives the saved model's logits.
    export_checkpoint(project / "models" / "instruct", project / "hf")
    hf = GPT2LMHeadModel.from_pretrained(project / "hf").eval()
    ids = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)
    (mlflow_run,) = stage_runs("gptlab")
    assert mlflow_run.data.tags["gptlab.trainable_params"] == str(expected)
    assert mlflow_run.data.params["instruct.trainable"] == "lora"


@pytest.mark.slow
def test_answers_with_bf16_weights_come_from_a_bf16_copy_and_the_saved_model_stays_fp32(
    project: Path,
) -> None:
    """instruct.generate.precision bf16: the answers are a bf16 copy's; the checkpoint keeps fp32 weights."""
    import torch

    from gptlab.tasks.responses import generate_responses

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["tracking"].update(system_metrics=False, log_models=False)
    params["instruct"]["generate"].update(precision="bf16", batch_size=2)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    run(load_params())

    model, _ = load_model(project / "models" / "instruct")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    answered = json.loads((project / "reports" / "instruct" / "responses.json").read_text())
    records = [{k: r[k] for k in ("instruction", "input", "output")} for r in answered]
    tokenizer = load_tokenizer(Path(load_params().data.raw_dir))
    bf16 = model.to(torch.bfloat16)
    expected = generate_responses(bf16, tokenizer, records, max_new_tokens=MAX_NEW_TOKENS, batch_size=2)
    assert [r["model_response"] for r in answered] == [r["model_response"] for r in expected]
