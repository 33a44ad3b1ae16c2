"""The preference-finetune stage (DPO, the chapter 7 bonus) on a tiny model: the notebook's numbers, resume, chat.

The exactness test writes out the bonus notebook's procedure (dpo-from-scratch.ipynb:
PreferenceDataset, custom_collate_fn, compute_logprobs, compute_dpo_loss,
compute_dpo_loss_loader, evaluate_dpo_loss_loader, train_model_dpo_simple and the cells
that seed and build the loaders) and runs it beside the stage on the same tiny model
and data, at the notebook's settings with only the size shrunk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

from gptlab.cli.main import main as gptlab_main
from gptlab.data import preference
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import WEIGHTS_FILE, list_checkpoints, load_model, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.tokenizer import load_tokenizer
from gptlab.pipeline.params import load_params
from stages.preference_finetune import LOSS_COLUMNS, run

from helpers import PROJECT_ROOT, committed_params_raw

STAGE_SCRIPT = PROJECT_ROOT / "stages" / "preference_finetune.py"
RECORDS = 6  # per split: 3 training batches of 2
TINY_INSTRUCT = ModelConfig(
    context_length=128, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0, qkv_bias=True
)


def write_params(project: Path, shared_data: Path, *, log_models: bool = False, **train: object) -> None:
    """The committed params.yaml shrunk: tiny splits, a smaller batch, evaluations every 2 steps."""
    params = committed_params_raw()
    params["tracking"]["log_models"] = log_models  # registering a model takes seconds: one test does
    params["data"]["raw_dir"] = str(shared_data)
    params["tokenize"]["preference"]["max_records"] = RECORDS
    params["checkpoints"]["every_steps"] = 2
    cfg = params["preference"]
    cfg.update(allowed_max_length=128, max_new_tokens=3)
    # lr: a tiny random model moves far at the notebook's 5e-6 only in the last digits.
    cfg["train"].update(
        dict(batch_size=2, epochs=2, lr=0.005, eval_freq=2, eval_iter=1, device="cpu") | train
    )
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the stage subprocesses get (OMP_NUM_THREADS=1): the same float sums."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def project(tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp project (cwd) with tiny preference splits and a tiny instruct model at models/instruct."""
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, shared_data)
    params = load_params()
    split = params.tokenize.preference
    source = shared_data / params.data.sources.instruction_preference.path
    pairs = preference.read_splits(split, source, load_tokenizer(shared_data), book=True)
    preference.write_splits(pairs, params.data.processed_dir)
    torch.manual_seed(0)
    save_model(build_gpt(TINY_INSTRUCT), tmp_path / "models" / "instruct", {"stage": "instruct-finetune"})
    return tmp_path


# ---- The notebook's procedure, as its cells write it ------------------------------------------------


def format_input(entry):
    instruction_text = (
        f"Below is an instruction that describes a task. "
        f"Write a response that appropriately completes the request."
        f"\n\n### Instruction:\n{entry['instruction']}"
    )
    input_text = f"\n\n### Input:\n{entry['input']}" if entry["input"] else ""
    return instruction_text + input_text


class NotebookPreferenceDataset(Dataset):
    def __init__(self, data, tokenizer):
        self.data = data
        self.encoded_texts = []
        for entry in data:
            prompt = format_input(entry)
            prompt_tokens = tokenizer.encode(prompt)
            chosen_full_tokens = tokenizer.encode(f"{prompt}\n\n### Response:\n{entry['chosen']}")
            rejected_full_tokens = tokenizer.encode(f"{prompt}\n\n### Response:\n{entry['rejected']}")
            self.encoded_texts.append(
                {"prompt": prompt_tokens, "chosen": chosen_full_tokens, "rejected": rejected_full_tokens}
            )

    def __getitem__(self, index):
        return self.encoded_texts[index]

    def __len__(self):
        return len(self.data)


def custom_collate_fn(batch, pad_token_id=50256, allowed_max_length=None, mask_prompt_tokens=True):
    batch_data = {"prompt": [], "chosen": [], "rejected": [], "rejected_mask": [], "chosen_mask": []}
    max_length_common = 0
    if batch:
        for key in ["chosen", "rejected"]:
            current_max = max(len(item[key]) + 1 for item in batch)
            max_length_common = max(max_length_common, current_max)
    for item in batch:
        prompt = torch.tensor(item["prompt"])
        batch_data["prompt"].append(prompt)
        for key in ["chosen", "rejected"]:
            sequence = item[key]
            padded = sequence + [pad_token_id] * (max_length_common - len(sequence))
            mask = torch.ones(len(padded)).bool()
            mask[len(sequence) :] = False
            if mask_prompt_tokens:
                mask[: prompt.shape[0] + 2] = False
            batch_data[key].append(torch.tensor(padded))
            batch_data[f"{key}_mask"].append(mask)
    for key in ["chosen", "rejected", "chosen_mask", "rejected_mask"]:
        tensor_stack = torch.stack(batch_data[key])
        if allowed_max_length is not None:
            tensor_stack = tensor_stack[:, :allowed_max_length]
        batch_data[key] = tensor_stack
    return batch_data


def compute_dpo_loss(model_chosen, model_rejected, reference_chosen, reference_rejected, beta=0.1):
    model_logratios = model_chosen - model_rejected
    reference_logratios = reference_chosen - reference_rejected
    logits = model_logratios - reference_logratios
    losses = -F.logsigmoid(beta * logits)
    chosen_rewards = (model_chosen - reference_chosen).detach()
    rejected_rewards = (model_rejected - reference_rejected).detach()
    return losses.mean(), chosen_rewards.mean(), rejected_rewards.mean()


def compute_logprobs(logits, labels, selection_mask=None):
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    log_probs = F.log_softmax(logits, dim=-1)
    selected_log_probs = torch.gather(input=log_probs, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    mask = selection_mask[:, 1:].clone()
    selected_log_probs = selected_log_probs * mask
    return selected_log_probs.sum(-1) / mask.sum(-1)


def compute_dpo_loss_batch(batch, policy_model, reference_model, beta):
    logprobs = [
        compute_logprobs(model(batch[key]), batch[key], batch[f"{key}_mask"])
        for model in (policy_model, reference_model)
        for key in ("chosen", "rejected")
    ]
    return compute_dpo_loss(*logprobs, beta=beta)


def compute_dpo_loss_loader(data_loader, policy_model, reference_model, beta, num_batches=None):
    total_loss, total_chosen_rewards, total_rejected_rewards = 0.0, 0.0, 0.0
    num_batches = len(data_loader) if num_batches is None else min(num_batches, len(data_loader))
    for i, batch in enumerate(data_loader):
        if i < num_batches:
            loss, chosen_rewards, rejected_rewards = compute_dpo_loss_batch(
                batch, policy_model, reference_model, beta
            )
            total_loss += loss.item()
            total_chosen_rewards += chosen_rewards.item()
            total_rejected_rewards += rejected_rewards.item()
        else:
            break
    return total_loss / num_batches, total_chosen_rewards / num_batches, total_rejected_rewards / num_batches


def evaluate_dpo_loss_loader(policy_model, reference_model, train_loader, val_loader, beta, eval_iter):
    policy_model.eval()
    with torch.no_grad():
        train = compute_dpo_loss_loader(train_loader, policy_model, reference_model, beta, eval_iter)
        val = compute_dpo_loss_loader(val_loader, policy_model, reference_model, beta, eval_iter)
    policy_model.train()
    return {
        "train_loss": train[0],
        "train_chosen_reward": train[1],
        "train_rejected_reward": train[2],
        "val_loss": val[0],
        "val_chosen_reward": val[1],
        "val_rejected_reward": val[2],
    }


def train_model_dpo_simple(
    policy_model, reference_model, train_loader, val_loader, optimizer, num_epochs, beta, eval_freq, eval_iter
):
    rows = []
    tokens_seen, global_step = 0, -1
    for _ in range(num_epochs):
        policy_model.train()
        for batch in train_loader:
            optimizer.zero_grad()
            loss, _, _ = compute_dpo_loss_batch(batch, policy_model, reference_model, beta)
            loss.backward()
            optimizer.step()
            tokens_seen += batch["chosen"].numel()
            global_step += 1
            if global_step % eval_freq == 0:
                res = evaluate_dpo_loss_loader(
                    policy_model, reference_model, train_loader, val_loader, beta, eval_iter
                )
                rows.append({"step": global_step, "tokens_seen": tokens_seen, **res})
        # (the notebook's epoch-end sample is greedy: it draws no random numbers)
    return rows


def notebook_run(project: Path, tokenizer) -> list[dict[str, float]]:
    """The notebook's cells from the data loaders to the training, on the stage's data and model."""
    params = load_params()
    cfg, train = params.preference, params.preference.train
    train_data = preference.load_split(params.data.processed_dir, "train")
    val_data = preference.load_split(params.data.processed_dir, "val")

    def collate(batch):
        return custom_collate_fn(batch, allowed_max_length=cfg.allowed_max_length, mask_prompt_tokens=True)

    torch.manual_seed(123)
    train_loader = DataLoader(
        NotebookPreferenceDataset(train_data, tokenizer),
        batch_size=train.batch_size,
        collate_fn=collate,
        shuffle=True,
        drop_last=True,
        num_workers=0,
    )
    val_loader = DataLoader(
        NotebookPreferenceDataset(val_data, tokenizer),
        batch_size=train.batch_size,
        collate_fn=collate,
        shuffle=False,
        drop_last=False,
        num_workers=0,
    )
    policy_model, _ = load_model(project / "models" / "instruct")
    reference_model, _ = load_model(project / "models" / "instruct")
    reference_model.eval()
    torch.manual_seed(123)
    optimizer = torch.optim.AdamW(policy_model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
    return train_model_dpo_simple(
        policy_model,
        reference_model,
        train_loader,
        val_loader,
        optimizer,
        num_epochs=train.epochs,
        beta=cfg.beta,
        eval_freq=train.eval_freq,
        eval_iter=train.eval_iter,
    )


# ---- The tests --------------------------------------------------------------------------------------


def test_stage_equals_the_notebooks_procedure_and_its_model_chats(
    project: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(load_params())
    reports = project / "reports" / "preference"
    ours = pd.read_csv(reports / "losses.csv")
    assert list(ours.columns) == LOSS_COLUMNS
    book = pd.DataFrame(notebook_run(project, load_tokenizer(shared_data)), columns=LOSS_COLUMNS)

    # 6 records in batches of 2 for 2 epochs: steps 0..5, evaluated at 0, 2, 4.
    assert ours["step"].tolist() == book["step"].tolist() == [0, 2, 4]
    assert ours["tokens_seen"].tolist() == book["tokens_seen"].tolist()
    for column in LOSS_COLUMNS[2:]:
        assert ours[column].tolist() == pytest.approx(book[column].tolist(), abs=1e-5), column
    # The comparison has teeth: the policy moved away from its reference, the chosen answers ahead.
    margins = ours["train_chosen_reward"] - ours["train_rejected_reward"]
    assert abs(margins.iloc[-1]) > 0.01 and ours["train_loss"].iloc[-1] < ours["train_loss"].iloc[0]

    metrics = json.loads((reports / "metrics.json").read_text())
    before, after = metrics["test"]["before"], metrics["test"]["after"]
    assert before["loss"] == pytest.approx(0.6931471805599453)  # the reference is the policy before
    assert before["reward_margin"] == 0.0 and before["reward_accuracy"] == 0.0
    assert after["reward_margin"] != 0.0 and 0.0 <= after["reward_accuracy"] <= 1.0
    assert metrics["final_train_reward_margin"] == pytest.approx(margins.iloc[-1])
    counts = json.loads((reports / "counts.json").read_text())
    assert counts["steps"] == 6 and counts["tokens_seen"] > book["tokens_seen"].iloc[-1]
    assert counts["train_records"] == counts["val_records"] == counts["test_records"] == RECORDS
    responses = json.loads((reports / "responses.json").read_text())
    test_split = json.loads((project / "data" / "processed" / "preference" / "test.json").read_text())
    assert [r["instruction"] for r in responses] == [r["instruction"] for r in test_split]
    assert all({"response_before", "response_after"} <= set(r) for r in responses)
    assert (reports / "reward_margins.png").stat().st_size > 0 and (reports / "loss.png").stat().st_size > 0

    # The model answers through `gptlab chat`.
    capsys.readouterr()
    assert (
        gptlab_main(["chat", "--model", "models/preference", "--max-new-tokens", "2", "Name a color."]) == 0
    )
    assert capsys.readouterr().out.strip() != ""


def kill_after_first_checkpoint(project: Path, env: dict[str, str]) -> None:
    runs = project / ".gptlab" / "runs" / "preference-finetune"
    proc = subprocess.Popen(
        [sys.executable, "-P", str(STAGE_SCRIPT)],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not any(list_checkpoints(run) for run in runs.glob("*")):
        assert proc.poll() is None, "the stage ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_resume_after_kill_gives_the_uninterrupted_result(
    project: Path,
    shared_data: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    untouched = tmp_path_factory.mktemp("uninterrupted")
    for name in ("data", "models"):
        subprocess.run(["cp", "-r", str(project / name), str(untouched)], check=True)
    # 9 steps, saved every 2: the kill lands mid-run. The uninterrupted run also registers its model.
    write_params(untouched, shared_data, log_models=True, epochs=3)
    write_params(project, shared_data, epochs=3)

    with monkeypatch.context() as here:  # in this process, on one thread as the subprocesses
        here.chdir(untouched)
        run(load_params())
    kill_after_first_checkpoint(project, env)
    assert not (project / "reports" / "preference" / "losses.csv").exists(), "it finished before the kill"
    resumed = subprocess.run(
        [sys.executable, "-P", str(STAGE_SCRIPT)], cwd=project, env=env, capture_output=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    reports = "reports/preference/losses.csv"
    assert (project / reports).read_bytes() == (untouched / reports).read_bytes()
    weights = f"models/preference/{WEIGHTS_FILE}"
    ours, theirs = load_file(project / weights), load_file(untouched / weights)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    (version,) = client.search_model_versions("name='gptlab-preference'")  # <experiment>-preference
    assert version.run_id
