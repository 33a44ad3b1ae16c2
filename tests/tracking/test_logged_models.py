"""Trained models as MLflow models: logged once, registered, promoted, loaded without the project, used by the CLI.

Each test logs tiny checkpoints through `registry.log_model`, as the pyfunc models of
gptlab.serving.specs, into its own SQLite store (the conftest fixture), then
reads them back as a user would: with
`mlflow.pyfunc.load_model` in a fresh Python whose sys.path lacks the project,
and with `gptlab promote`, `gptlab classify` and `gptlab chat`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from mlflow.tracking import MlflowClient

from gptlab.cli.main import main as gptlab_main
from gptlab.errors import GptlabError
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import (
    MANIFEST_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    save_model,
    write_model_manifest,
)
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.serving.pyfunc_models import BadModelInput
from gptlab.serving.specs import model_spec
from gptlab.tasks.classifier import classify_texts, make_classifier
from gptlab.tracking.buffered_run import NULL_RUN, StageRun
from gptlab.tracking.registry import log_model
from gptlab.tracking.runs import stage_run

from helpers import PROJECT_ROOT, committed_params, flip_tensor_bits, invoke, served_model, small_disk

MESSAGES = [
    "Free entry in 2 a wkly comp to win FA Cup final tkts 21st May 2005. Text FA to 87121",
    "Hey, just wanted to check if we're still on for dinner?",
]

# Runs in a fresh interpreter: the project's src (the editable install's path entry) is taken off
# sys.path first, so the model can only run through the gptlab code it carries.
LOAD_AND_PREDICT = """
import importlib.util, json, sys
from pathlib import Path
sys.path[:] = [p for p in sys.path if not (Path(p or ".") / "gptlab" / "__init__.py").is_file()]
assert importlib.util.find_spec("gptlab") is None, "the project is still importable"
import mlflow.pyfunc, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
import gptlab
params = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
out = model.predict(pd.DataFrame(json.loads(sys.argv[2])), params=params)
print(json.dumps({"gptlab": gptlab.__file__, "predictions": out.to_dict(orient="list")}))
"""


def load_in_clean_process(uri: str, frame: dict, tmp_path: Path, params: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = [sys.executable, "-c", LOAD_AND_PREDICT, uri, json.dumps(frame)]
    if params is not None:
        args.append(json.dumps(params))
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    gptlab_file = Path(result["gptlab"]).resolve()
    assert PROJECT_ROOT not in gptlab_file.parents and "code" in gptlab_file.parts, gptlab_file
    return result["predictions"]


def log(
    tracker: StageRun,
    kind: str,
    checkpoint: Path,
    shared_data: Path,
    defaults: dict[str, Any] | None = None,
    headline: dict[str, float] | None = None,
) -> str | None:
    """log_model of a checkpoint into experiment gptlab, served as a stage serves it, with GPT-2's BPE
    files from the test inputs (where the committed params say)."""
    sources = committed_params().data.sources
    bpe = (shared_data / sources.gpt2_vocab_bpe.path, shared_data / sources.gpt2_encoder_json.path)
    spec = model_spec(kind, checkpoint, bpe, defaults)
    return log_model(tracker, kind, spec, experiment="gptlab", headline=headline or {})


def log_spam(tracker: StageRun, checkpoint: Path, shared_data: Path) -> str | None:
    """log_model of a spam checkpoint into experiment gptlab, with no defaults or headline figures."""
    return log(tracker, "spam", checkpoint, shared_data)


def tiny_classifier(directory: Path, emb_dim: int = 16) -> GPTModel:
    """A spam classifier over GPT-2's vocabulary: its weights take about `emb_dim` / 5 MB."""
    torch.manual_seed(0)
    cfg = ModelConfig(context_length=32, emb_dim=emb_dim, n_heads=2, n_layers=1, drop_rate=0.0)
    model = make_classifier(build_gpt(cfg), 2, trainable="head", trainable_blocks=1, seed=123).eval()
    save_model(model, directory, {"labels": {"0": "ham", "1": "spam"}, "max_length": 12, "pooling": "last"})
    return model


def tiny_language_model(directory: Path) -> GPTModel:
    torch.manual_seed(0)
    cfg = ModelConfig(context_length=128, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)
    model = build_gpt(cfg).eval()
    save_model(model, directory, {"source": "test"})
    return model


def all_run_artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    found = []
    for entry in client.list_artifacts(run_id, path):
        found += all_run_artifacts(client, run_id, entry.path) if entry.is_dir else [entry.path]
    return found


@pytest.mark.slow
def test_spam_model_logged_once_registered_promoted_and_served_to_the_cli(
    tmp_path: Path,
    shared_data: Path,
    tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    model = tiny_classifier(tmp_path / "clf")
    runs = []
    for _ in range(2):  # two training runs: two versions
        with stage_run("spam-finetune", "gptlab", {}) as tracker:
            tracker.set_tags({"gptlab.base_model": "gpt2-small"})
            uri = log(
                tracker,
                "spam",
                tmp_path / "clf",
                shared_data,
                headline={"final/test.accuracy": 0.9375 - len(runs) / 8},
            )
            runs.append((tracker.run_id, uri))
    capsys.readouterr()

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    versions = client.search_model_versions("name = 'gptlab-spam'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    assert {v.run_id for v in versions} == {run_id for run_id, _ in runs}
    # Each version says on the registry page what it is: stage, base model, figures, source run.
    for version in versions:
        run_id, _ = runs[int(version.version) - 1]
        assert version.description.startswith("**spam-finetune** stage, spam model. Base model: gpt2-small.")
        assert f"`final/test.accuracy`: {0.9375 - (int(version.version) - 1) / 8:.4g}" in version.description
        # A link to its run that opens in the UI's model-training mode.
        assert f"/runs/{run_id}?workflowType=machine_learning) (`{run_id}`)." in version.description
    experiment = client.get_experiment_by_name("gptlab")
    logged = client.search_logged_models([experiment.experiment_id])
    assert {f"models:/{m.model_id}" for m in logged} == {uri for _, uri in runs}
    for run_id, uri in runs:
        run = client.get_run(run_id)
        assert run.data.tags["gptlab.model_uri"] == uri
        assert [o.model_id for o in run.outputs.model_outputs] == [uri.removeprefix("models:/")]
        # The weights' one copy is inside the model, none among the run's own artifacts.
        assert not [a for a in all_run_artifacts(client, run_id) if a.endswith(".safetensors")]
    for logged_model in logged:
        files = Path(urlparse(logged_model.artifact_location).path)
        assert [p.relative_to(files).as_posix() for p in files.rglob("*.safetensors")] == [
            "artifacts/clf/model.safetensors"
        ]
        assert (files / "MLmodel").is_file() and (
            files / "code" / "gptlab" / "tasks" / "classifier.py"
        ).is_file()

    # A fresh Python without the project loads it and labels exactly as the checkpoint does.
    expected = classify_texts(model, tokenizer, MESSAGES, max_length=12, pooling="last")
    predictions = load_in_clean_process("models:/gptlab-spam/1", {"text": MESSAGES}, tmp_path)
    assert predictions["label"] == [("ham", "spam")[int(p.argmax())] for p in expected]
    assert predictions["spam_probability"] == pytest.approx(expected[:, 1].tolist(), abs=1e-6)

    # promote, then classify through the alias: the same output as the folder itself.
    assert gptlab_main(["promote", "gptlab-spam", "2"]) == 0
    assert "models:/gptlab-spam@champion" in capsys.readouterr().out
    assert str(client.get_model_version_by_alias("gptlab-spam", "champion").version) == "2"
    folder = [
        "classify",
        "--json",
        "--model",
        str(tmp_path / "clf"),
        "--raw-dir",
        str(shared_data),
        *MESSAGES,
    ]
    assert gptlab_main(folder) == 0
    from_folder = capsys.readouterr().out
    assert gptlab_main(["classify", "--json", "--model", "models:/gptlab-spam@champion", *MESSAGES]) == 0
    fetched = capsys.readouterr()
    assert fetched.out == from_folder
    assert "Downloading artifacts" not in fetched.err  # MLflow's progress bars stay off

    assert gptlab_main(["promote", "gptlab-spam", "7"]) == 2
    err = capsys.readouterr().err
    assert "no version 7 of registered model 'gptlab-spam'" in err and "its versions are 1, 2" in err
    assert gptlab_main(["classify", "--model", "models:/gptlab-spam@nobody", "hi"]) == 2
    assert "gptlab promote" in capsys.readouterr().err


@pytest.mark.slow
def test_instruct_and_language_models_load_without_the_project_and_chat_uses_them(
    tmp_path: Path,
    shared_data: Path,
    tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gptlab.model.config import SampleConfig
    from gptlab.model.generate import generate_text
    from gptlab.tasks.responses import generate_response

    monkeypatch.chdir(tmp_path)
    model = tiny_language_model(tmp_path / "lm")
    params = committed_params()
    with stage_run("instruct-finetune", "gptlab", {}) as tracker:
        log(
            tracker,
            "instruct",
            tmp_path / "lm",
            shared_data,
            {"max_new_tokens": params.instruct.max_new_tokens},
        )
    with stage_run("pretrain", "gptlab", {}) as tracker:
        sample = dataclasses.asdict(params.pretrain.sample)
        del sample["prompt"]
        log(tracker, "pretrain", tmp_path / "lm", shared_data, sample)
    capsys.readouterr()
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert [int(v.version) for v in client.search_model_versions("name = 'gptlab-instruct'")] == [1]
    assert [int(v.version) for v in client.search_model_versions("name = 'gptlab-pretrain'")] == [1]

    records = {"instruction": ["Name a color.", "Rewrite the sentence."], "input": ["", "It is fast."]}
    answers = load_in_clean_process("models:/gptlab-instruct/1", records, tmp_path, {"max_new_tokens": 5})
    expected = [
        generate_response(model, tokenizer, {"instruction": i, "input": x}, max_new_tokens=5)
        for i, x in zip(records["instruction"], records["input"], strict=True)
    ]
    assert answers["response"] == expected

    sample = SampleConfig(prompt="Every effort moves you", max_new_tokens=6, temperature=1.0, top_k=5, seed=7)
    texts = load_in_clean_process(
        "models:/gptlab-pretrain/1",
        {"prompt": [sample.prompt]},
        tmp_path,
        {"max_new_tokens": 6, "temperature": 1.0, "top_k": 5, "seed": 7},
    )
    assert texts["text"] == [generate_text(model, tokenizer, sample)]

    args = ["chat", "Name a color.", "--max-new-tokens", "5"]
    assert gptlab_main([*args, "--model", "models:/gptlab-instruct/1"]) == 0
    assert capsys.readouterr().out == expected[0] + "\n"
    # Without --max-new-tokens and without a params.yaml: the model's own default answer length.
    assert not (tmp_path / "params.yaml").exists()
    chat = ["chat", "Name a color.", "--model", "models:/gptlab-instruct/1"]
    assert gptlab_main(chat) == 0
    by_default = capsys.readouterr()
    assert gptlab_main([*chat, "--max-new-tokens", str(params.instruct.max_new_tokens)]) == 0
    assert by_default.out == capsys.readouterr().out
    assert "the model's max_new_tokens" in by_default.err  # capped to the tiny context, and said so


def test_the_disabled_run_logs_and_registers_nothing(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchrun rank other than 0 has NULL_RUN: its log_model returns None (rank 0 logs the model)."""
    monkeypatch.chdir(tmp_path)
    tiny_classifier(tmp_path / "clf")
    assert log_spam(NULL_RUN, tmp_path / "clf", shared_data) is None
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert client.search_registered_models() == []


@pytest.mark.slow
def test_the_mlflow_model_refuses_weights_holding_nan(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the logged model checks its weights as `gptlab classify` does: no NaN is ever served."""
    import mlflow.pyfunc
    from safetensors.torch import load_file, save_file

    monkeypatch.chdir(tmp_path)
    tiny_classifier(tmp_path / "clf")
    weights_file = tmp_path / "clf" / "model.safetensors"
    weights = load_file(str(weights_file))
    weights["final_norm.scale"][:4] = float("nan")
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    write_model_manifest(tmp_path / "clf")  # saved so, as by a run that diverged: only the values tell
    with stage_run("spam-finetune", "gptlab", {}) as tracker:
        uri = log_spam(tracker, tmp_path / "clf", shared_data)
    with pytest.raises(Exception, match=r"model\.safetensors: tensor final_norm\.scale holds NaN") as info:
        mlflow.pyfunc.load_model(uri)
    assert "\n" not in str(info.value)


def test_a_bad_input_keeps_its_one_line_through_the_scoring_servers_rewrite() -> None:
    """MLflow's scoring server prefixes the message with the whole input; the reply keeps the line alone."""
    error = BadModelInput("batch_size: expected 1 to 65536, got 0")
    error.message = f"Failed to predict data '  text\n0  hi'. \nError: {error.message}"  # as the server does
    assert json.loads(error.serialize_as_json())["message"] == "batch_size: expected 1 to 65536, got 0"
    assert error.get_http_status_code() == 400 and isinstance(error, ValueError)


def one_line_refusal(status: int, reply: dict, line: str) -> None:
    """A 400 whose message is exactly `line`: no stack trace, no server path, none of the request echoed."""
    assert status == 400, reply
    assert reply["error_code"] == "INVALID_PARAMETER_VALUE" and "stack_trace" not in reply
    assert reply["message"] == line


@pytest.mark.slow
def test_a_damaged_checkpoint_is_not_logged_and_a_damaged_logged_model_does_not_load(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights cut short: refused by log_model before logging. Finite bit flips, which only the
    weights' digest tells: refused by the model MLflow loads and serves (the save computed that
    digest, which publishing takes from the manifest, and every load checks)."""
    import mlflow.pyfunc

    monkeypatch.chdir(tmp_path)
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    tiny_classifier(tmp_path / "clf")
    weights = tmp_path / "clf" / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-4096])
    with stage_run("spam-finetune", "gptlab", {}) as tracker:
        with pytest.raises(
            CheckpointError, match=r"clf/model\.safetensors: expected \d+ bytes, found \d+ bytes"
        ):
            log_spam(tracker, tmp_path / "clf", shared_data)
        experiment_id = client.get_run(tracker.run_id).info.experiment_id
    assert client.search_logged_models([experiment_id]) == []

    tiny_classifier(tmp_path / "clf")  # intact again
    with stage_run("spam-finetune", "gptlab", {}) as tracker:
        uri = log_spam(tracker, tmp_path / "clf", shared_data)
    logged = client.get_logged_model(uri.removeprefix("models:/"))
    checkpoint = Path(urlparse(logged.artifact_location).path) / "artifacts" / "clf"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["config.json", MANIFEST_FILE, WEIGHTS_FILE]
    flip_tensor_bits(checkpoint / WEIGHTS_FILE, "final_norm.scale")
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: its SHA-256 is not the one recorded"
    ) as info:
        mlflow.pyfunc.load_model(uri)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_full_artifact_store_is_one_line_naming_it_and_leaves_no_partial_model(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's disk (a real 4 MiB tmpfs) takes the model's other files, not its ~6.5 MB of weights."""
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    tiny_classifier(tmp_path / "clf", emb_dim=32)
    store = Path(os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///")).parent
    with small_disk(store / "mlruns", "4m") as disk:  # where the store keeps its artifacts
        with pytest.raises(GptlabError) as failed, stage_run("spam-finetune", "gptlab", {}) as tracker:
            log_spam(tracker, tmp_path / "clf", shared_data)
        message = str(failed.value)
        (logged,) = client.search_logged_models([client.get_run(tracker.run_id).info.experiment_id])
        assert message.startswith(
            f"cannot log the spam model into the artifact store {logged.artifact_location}: {disk.reason} "
            f"(its partial copy is deleted, model {logged.model_id} stays FAILED)"
        )
        assert disk.folder.as_uri() in logged.artifact_location and "\n" not in message
        assert [p for p in disk.folder.rglob("*") if p.is_file()] == []  # no truncated weights, nothing
        assert str(logged.status) == "FAILED"
        assert client.get_run(tracker.run_id).info.status == "FAILED"
        assert client.search_registered_models() == []


@pytest.mark.slow
@pytest.mark.slow
def test_the_mlflow_model_refuses_a_config_that_disagrees_with_its_weights_in_one_line(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """emb_dim doubled in config.json, the manifest written again: the sizes named, not torch's traceback."""
    import mlflow.pyfunc

    monkeypatch.chdir(tmp_path)
    tiny_classifier(tmp_path / "clf")
    config_file = tmp_path / "clf" / "config.json"
    config = json.loads(config_file.read_text())
    config["model"]["emb_dim"] *= 2
    config_file.write_text(json.dumps(config))
    write_model_manifest(tmp_path / "clf")
    with stage_run("spam-finetune", "gptlab", {}) as tracker:
        uri = log_spam(tracker, tmp_path / "clf", shared_data)
    with pytest.raises(
        GptlabError,
        match=r"config\.json does not match model\.safetensors: tok_emb\.weight is \[50257, 16\] in the weights but \[50257, 32\] by the config",
    ) as info:
        mlflow.pyfunc.load_model(uri)
    assert "\n" not in str(info.value)


def test_the_served_models_refuse_a_bad_request_in_one_line_as_the_cli_does(
    tmp_path: Path, shared_data: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mlflow models serve` on a spam and an instruct model: each bad request a 400 naming its field."""
    import mlflow.pyfunc
    import pandas as pd

    from gptlab.tasks.responses import generate_response

    monkeypatch.chdir(tmp_path)
    tiny_classifier(tmp_path / "clf")
    language_model = tiny_language_model(tmp_path / "lm")
    uris = {}
    for kind, folder in (("spam", "clf"), ("instruct", "lm")):
        with stage_run(f"{kind}-finetune", "gptlab", {}) as tracker:
            uris[kind] = log(tracker, kind, tmp_path / folder, shared_data)
    # In Python, the same check is a ValueError naming the field.
    with pytest.raises(ValueError, match=r"^text \(row 2\) is empty: give some text to classify$"):
        mlflow.pyfunc.load_model(uris["spam"]).predict(pd.DataFrame({"text": ["hi", "  "]}))
    # The instruct model samples as `gptlab chat --temperature` does, seeded: not silently greedy.
    sampling = {"temperature": 1.5, "top_k": 50, "seed": 7}
    asked = pd.DataFrame({"instruction": ["Name a color."]})
    answered = mlflow.pyfunc.load_model(uris["instruct"]).predict(asked, {"max_new_tokens": 6, **sampling})
    entry = {"instruction": "Name a color.", "input": ""}
    assert answered["response"].tolist() == [
        generate_response(language_model, tokenizer, entry, max_new_tokens=6, **sampling)
    ]
    assert answered["response"][0] != generate_response(language_model, tokenizer, entry, max_new_tokens=6)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the models run the code they carry
    (tmp_path / "spam").mkdir()
    (tmp_path / "instruct").mkdir()
    with (
        served_model(uris["spam"], tmp_path / "spam", env) as spam,
        served_model(uris["instruct"], tmp_path / "instruct", env) as instruct,
    ):
        texts = {"dataframe_split": {"columns": ["text"], "data": [["Free prize, call now"], ["ok see you"]]}}
        status, good = invoke(spam, texts)
        assert (
            status == 200 and [row["label"] in ("ham", "spam") for row in good["predictions"]] == [True] * 2
        )
        for size in (0, -5):
            one_line_refusal(
                *invoke(spam, {**texts, "params": {"batch_size": size}}),
                f"batch_size: expected 1 to 65536, got {size}",
            )
        split = {"columns": ["text"], "data": [["hi"], [123]]}
        one_line_refusal(
            *invoke(spam, {"dataframe_split": split}), "text (row 2): expected a string, got int 123"
        )
        split = {"columns": ["text"], "data": [[{"a": 1}]]}
        one_line_refusal(
            *invoke(spam, {"dataframe_split": split}), "text (row 1): expected a string, got dict {'a': 1}"
        )
        split = {"columns": ["text"], "data": [["hi"], ["  "]]}
        one_line_refusal(
            *invoke(spam, {"dataframe_split": split}), "text (row 2) is empty: give some text to classify"
        )

        asked = {"columns": ["instruction", "input"], "data": [["Name a color.", ""]]}
        status, good = invoke(instruct, {"dataframe_split": asked, "params": {"max_new_tokens": 3}})
        assert status == 200 and isinstance(good["predictions"][0]["response"], str)
        empty = {"columns": ["instruction", "input"], "data": [["", "It is fast."]]}
        one_line_refusal(
            *invoke(instruct, {"dataframe_split": empty, "params": {"max_new_tokens": 3}}),
            "instruction (row 1) is empty: say what the model should do",
        )
        one_line_refusal(
            *invoke(instruct, {"dataframe_split": asked, "params": {"max_new_tokens": 0}}),
            "max_new_tokens: expected 1 to 10000, got 0",
        )
        one_line_refusal(
            *invoke(instruct, {"dataframe_split": asked, "params": {"temperature": 1000.0}}),
            "temperature: expected 0 (greedy) or a number from 0.01 to 100, got 1000",
        )


@pytest.mark.slow
def test_gptlab_precision_bf16_serves_bf16_weights_and_an_unknown_value_is_refused(
    tmp_path: Path, shared_data: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.pyfunc

    from gptlab.tasks.responses import generate_response

    monkeypatch.chdir(tmp_path)
    model = tiny_language_model(tmp_path / "lm")
    with stage_run("instruct-finetune", "gptlab", {}) as tracker:
        uri = log(tracker, "instruct", tmp_path / "lm", shared_data)
    records = {"instruction": ["Name a color.", "Rewrite the sentence."], "input": ["", "It is fast."]}

    monkeypatch.setenv("GPTLAB_PRECISION", "bf16")
    answers = load_in_clean_process(uri, records, tmp_path, {"max_new_tokens": 5})
    bf16 = model.to(torch.bfloat16)
    expected = [
        generate_response(bf16, tokenizer, {"instruction": i, "input": x}, max_new_tokens=5)
        for i, x in zip(records["instruction"], records["input"], strict=True)
    ]
    assert answers["response"] == expected

    monkeypatch.setenv("GPTLAB_PRECISION", "fp16")
    with pytest.raises(Exception, match=r"\$GPTLAB_PRECISION: expected one of fp32, bf16, auto, got 'fp16'"):
        mlflow.pyfunc.load_model(uri)


@pytest.mark.slow
def test_a_served_generation_answers_within_the_servers_timeout_or_is_refused_while_asked(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 65 item 20: 10,000 new tokens for each of 40 prompts outlasted the scoring server's timeout, which
    answered 504 while the generation went on. Now the work stops before the timeout, and the caller gets why."""
    monkeypatch.chdir(tmp_path)
    tiny_language_model(tmp_path / "lm")
    with stage_run("pretrain", "gptlab", {}) as tracker:
        uri = log(tracker, "pretrain", tmp_path / "lm", shared_data)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"] = "10"
    (tmp_path / "serve").mkdir()
    prompts = {"columns": ["prompt"], "data": [["Every effort moves you"]] * 40}
    with served_model(uri, tmp_path / "serve", env) as url:
        one_line_refusal(
            *invoke(url, {"dataframe_split": prompts, "params": {"max_new_tokens": 10_000}}),
            "the request takes longer than the scoring server allows (MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT: "
            "10 s), so it was stopped after 9 s: ask for fewer max_new_tokens or rows, or serve with a longer "
            "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT",
        )
        status, reply = invoke(url, {"dataframe_split": prompts, "params": {"max_new_tokens": 3}})
        assert status == 200 and len(reply["predictions"]) == 40
