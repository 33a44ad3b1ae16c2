"""The shared training loop on a tiny GPT: learning, determinism, exact resume, failure handling."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, TensorDataset

from gptlab.data.verdict import GPTDatasetV1
from gptlab.files import WriteError
from gptlab.model import checkpoint
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import WEIGHTS_FILE
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.model.tokenizer import load_tokenizer
from gptlab.schema import ConfigError
from gptlab.training.config import CheckpointConfig, TrainConfig
from gptlab.training.data_order import epoch_order
from gptlab.training.loop import count_tokens, fit, learning_rate
from gptlab.training.losses import IGNORE_INDEX, LossFn, average_loss, next_token_loss
from gptlab.training.runtime import ordered_loader, resolve_device

from helpers import checkpoint_config, inputs_dir, train_config

TESTS_DIR = Path(__file__).resolve().parent
CONTEXT = 16
TINY = ModelConfig(context_length=CONTEXT, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.1)
# 2 epochs x 6 batches of 4 windows; eval every 2 steps; checkpoints every 4 steps and at epoch ends.
TRAIN = train_config(
    batch_size=4, epochs=2, lr=5e-3, eval_freq=2, eval_iter=2, seed=7, rng="per_epoch", fused_adamw=True
)
CHECKPOINTS = checkpoint_config(every_steps=4, keep=2)


def verdict_data() -> tuple[GPTDatasetV1, GPTDatasetV1]:
    """26 training and 4 validation windows of The Verdict's first tokens."""
    inputs = inputs_dir()  # fetched on first use; the tests that need no inputs never call this
    ids = load_tokenizer(inputs).encode((inputs / "the-verdict.txt").read_text(encoding="utf-8"))
    return GPTDatasetV1(ids[: 26 * CONTEXT + 1], CONTEXT, CONTEXT), GPTDatasetV1(
        ids[1000 : 1000 + 4 * CONTEXT + 1], CONTEXT, CONTEXT
    )


def tiny_model() -> GPTModel:
    torch.manual_seed(123)
    return build_gpt(TINY)


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_fit(
    checkpoint_dir: Path,
    cfg: TrainConfig = TRAIN,
    loss_fn: LossFn = next_token_loss,
    checkpoints: CheckpointConfig = CHECKPOINTS,
    **kwargs: Any,
):
    train_data, val_data = verdict_data()
    model = tiny_model()
    result = fit(
        model,
        train_data,
        val_data,
        cfg=cfg,
        checkpoints=checkpoints,
        loss_fn=loss_fn,
        run_dir=checkpoint_dir,
        **kwargs,
    )
    return model, result


def subprocess_fit(checkpoint_dir: str, out: str, step_delay: float, threads: int) -> None:
    """Entry point of the training subprocess in the kill test (run through `python -c`)."""
    torch.set_num_threads(threads)  # as the reference run: the thread count can change float sums

    def slow_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if model.training:
            time.sleep(step_delay)  # paces the run so the kill lands mid-training
        return next_token_loss(model, batch)

    train_data, val_data = verdict_data()
    model = tiny_model()
    result = fit(
        model,
        train_data,
        val_data,
        cfg=TRAIN,
        checkpoints=CHECKPOINTS,
        loss_fn=slow_loss,
        run_dir=Path(checkpoint_dir),
    )
    payload = {
        "history": result.history,
        "resumed_steps": result.resumed_steps,
        "weights_sum": float(sum(v.double().sum() for v in model.state_dict().values())),
    }
    Path(out).write_text(json.dumps(payload))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: several times faster for tiny models on a shared, busy CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """One uninterrupted run that the other tests compare against."""
    model, result = run_fit(tmp_path_factory.mktemp("reference"))
    return weights_of(model), result


def test_loss_decreases_and_history_has_the_books_shape(reference) -> None:
    _, result = reference
    steps = 2 * (26 // 4)
    assert result.steps == steps and result.global_step == steps - 1
    assert [row["step"] for row in result.history] == list(range(0, steps, 2))  # the book: step % eval_freq
    assert result.seen == steps * 4 * CONTEXT
    assert [row["tokens_seen"] for row in result.history] == [
        (s + 1) * 4 * CONTEXT for s in range(0, steps, 2)
    ]
    assert [(row["epoch"], row["step"]) for row in result.epochs] == [(1, 5), (2, 11)]
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"] - 0.5
    assert result.history[-1]["val_loss"] < result.history[0]["val_loss"]
    assert all(row["lr"] == TRAIN.lr for row in result.history)


def test_same_seed_same_run_even_when_the_epoch_callback_draws_random_numbers(
    reference, tmp_path: Path
) -> None:
    weights, result = reference
    calls: list[int] = []

    def noisy_callback(epoch: int, model: torch.nn.Module) -> dict[str, float]:
        calls.append(epoch)
        return {"noise": torch.rand(1).item()}  # must not shift the dropout masks of training

    model, again = run_fit(tmp_path, on_epoch_end=noisy_callback)
    assert calls == [1, 2]
    assert again.history == result.history
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert [set(row) for row in again.epochs] == [{"epoch", "step", "noise"}] * 2


def test_checkpoints_keep_the_newest_and_load_with_weights_only(reference, tmp_path: Path) -> None:
    weights, _ = reference
    run_fit(tmp_path)
    # Saves at steps 4, 6 (epoch end), 8, 12 (epoch end and last); keep 2.
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-0000008", "step-0000012"]
    loaded, state = checkpoint.load_training_checkpoint(tmp_path / "step-0000012")
    assert all(torch.equal(weights[k], v) for k, v in loaded.items())
    assert state["progress"]["steps"] == 12 and state["progress"]["epoch"] == 2
    assert state["train_config"] == dataclasses.asdict(TRAIN)
    assert set(state["rng"]) == {"torch", "cuda", "numpy", "python"}


def test_the_finished_runs_save_leaves_out_the_moments_and_still_resumes(reference, tmp_path: Path) -> None:
    weights, result = reference
    run_fit(tmp_path)
    _, earlier = checkpoint.load_training_checkpoint(tmp_path / "step-0000008")
    _, last = checkpoint.load_training_checkpoint(tmp_path / "step-0000012")
    assert len(earlier["optimizer"]["state"]) == len(weights)  # a step is left: AdamW's moments kept
    assert last["optimizer"]["state"] == {}
    assert last["optimizer"]["param_groups"] == earlier["optimizer"]["param_groups"]
    # The rerun of a run that crashed after its last step trains nothing and ends the same.
    model, resumed = run_fit(tmp_path)
    assert resumed.resumed_steps == 12 and resumed.history == result.history
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_resume_after_kill_gives_the_uninterrupted_result(reference, tmp_path: Path) -> None:
    weights, result = reference
    checkpoint_dir, out = tmp_path / "run", tmp_path / "result.json"
    code = (
        f"import sys; sys.path[:0] = [{str(TESTS_DIR)!r}, {str(TESTS_DIR.parent)!r}]; import test_train; "
        f"test_train.subprocess_fit({str(checkpoint_dir)!r}, {str(out)!r}, 0.15, {torch.get_num_threads()})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=os.environ)
    deadline = time.monotonic() + 180
    while not checkpoint.list_checkpoints(checkpoint_dir):
        assert proc.poll() is None, "the training subprocess ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint appeared within 180 s"
        time.sleep(0.02)
    time.sleep(0.2)  # somewhere inside the next steps, or inside the next save
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "training finished before it was killed; the test proved nothing"
    survivors = checkpoint.list_checkpoints(checkpoint_dir)
    assert survivors and int(survivors[-1].name.removeprefix("step-")) < result.steps

    rerun = subprocess.run([sys.executable, "-c", code.replace("0.15,", "0.0,")], env=os.environ, timeout=300)
    assert rerun.returncode == 0
    resumed = json.loads(out.read_text())
    assert resumed["resumed_steps"] > 0
    assert resumed["history"] == result.history  # floats survive JSON exactly (repr round trip)
    assert resumed["weights_sum"] == float(sum(v.double().sum() for v in weights.values()))


def test_another_checkpoint_cadence_after_a_crash_still_resumes_to_the_same_numbers(
    reference, tmp_path: Path
) -> None:
    weights, result = reference
    trained = []

    def crashes_at_step_7(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if model.training:
            trained.append(len(trained))
            if len(trained) == 8:
                raise RuntimeError("crash")
        return next_token_loss(model, batch)

    with pytest.raises(RuntimeError, match="crash"):
        run_fit(tmp_path, loss_fn=crashes_at_step_7)  # saved after 4 and 6 steps
    # Saving is operational: another cadence and retention resume the same run.
    model, resumed = run_fit(
        tmp_path, checkpoints=checkpoint_config(every_steps=None, every_minutes=60, keep=1)
    )
    assert resumed.resumed_steps == 6
    assert resumed.history == result.history
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_corrupted_checkpoint_is_refused_and_the_previous_one_used(
    reference, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, result = reference
    cut = dataclasses.replace(TRAIN, max_steps=8)
    run_fit(tmp_path, cut)  # leaves checkpoints at steps 6 and 8
    weights = tmp_path / "step-0000008" / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # same size, other weights: only the content can tell
    weights.write_bytes(bytes(data))

    _, resumed = run_fit(tmp_path, cut)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {tmp_path / 'step-0000008'}" in err
    assert "does not match the SHA-256 recorded when it was saved" in err
    assert resumed.resumed_steps == 6
    assert resumed.history == result.history[:4]  # steps 7 and 8 redone exactly
    checkpoint.load_training_checkpoint(tmp_path / "step-0000008")  # the refused one was replaced


def test_weights_that_match_their_digest_but_not_the_recorded_loss_are_refused(
    reference, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, result = reference
    cut = dataclasses.replace(TRAIN, max_steps=8)
    run_fit(tmp_path, cut)
    path = tmp_path / "step-0000008"
    weights = load_file(str(path / WEIGHTS_FILE))
    weights["final_norm.scale"] = weights["final_norm.scale"] * 2  # other weights, under a forged digest
    save_file(weights, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    manifest = json.loads((path / checkpoint.MANIFEST_FILE).read_text())
    manifest["sizes"][WEIGHTS_FILE] = (path / WEIGHTS_FILE).stat().st_size
    manifest["sha256"][WEIGHTS_FILE] = checkpoint.content_digest(weights)
    (path / checkpoint.MANIFEST_FILE).write_text(json.dumps(manifest))

    _, resumed = run_fit(tmp_path, cut)
    assert "do not give the loss recorded at save time" in capsys.readouterr().err
    assert resumed.resumed_steps == 6
    assert resumed.history == result.history[:4]


def test_damaged_files_are_refused_naming_them(tmp_path: Path) -> None:
    run_fit(tmp_path, dataclasses.replace(TRAIN, max_steps=4))
    path = tmp_path / "step-0000004"
    state = path / checkpoint.STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match=r"state\.pt: expected \d+ bytes, found 100 bytes"):
        checkpoint.load_training_checkpoint(path)
    (path / checkpoint.MANIFEST_FILE).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json: missing or unreadable manifest"):
        checkpoint.load_training_checkpoint(path)


def test_partial_saves_are_cleaned_and_unreadable_checkpoints_skipped(
    reference, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, result = reference
    cut = dataclasses.replace(TRAIN, max_steps=8)
    run_fit(tmp_path, cut)
    (tmp_path / "step-0000008" / checkpoint.MANIFEST_FILE).unlink()
    (tmp_path / ".step-0000010.abc.tmp").mkdir()  # what a kill during a save leaves
    _, resumed = run_fit(tmp_path, cut)
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "manifest" in err
    assert resumed.resumed_steps == 6
    assert resumed.history == result.history[:4]
    assert not (tmp_path / ".step-0000010.abc.tmp").exists()


def test_changed_settings_never_resume_a_stale_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    every_2 = checkpoint_config(every_steps=2)
    run_fit(tmp_path, dataclasses.replace(TRAIN, max_steps=2), checkpoints=every_2)
    _, result = run_fit(tmp_path, dataclasses.replace(TRAIN, max_steps=2, lr=2e-3), checkpoints=every_2)
    assert result.resumed_steps == 0
    assert "different train settings" in capsys.readouterr().err


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    steps_run = []

    def explodes_at_step_6(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = next_token_loss(model, batch)
        if model.training:
            steps_run.append(len(steps_run))
            if len(steps_run) == 7:  # the 7th update is step 6 in the book's numbering
                return loss * math.nan
        return loss

    train_data, val_data = verdict_data()
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 6:.*step-0000006"):
        fit(
            tiny_model(),
            train_data,
            val_data,
            cfg=TRAIN,
            checkpoints=CHECKPOINTS,
            loss_fn=explodes_at_step_6,
            run_dir=tmp_path,
        )
    kept = checkpoint.list_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step-0000004", "step-0000006"]
    _, state = checkpoint.load_training_checkpoint(kept[-1])
    assert math.isfinite(state["probe_loss"])


def test_max_steps_bf16_and_warmup_cosine(tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        TRAIN, max_steps=3, precision="bf16", warmup_steps=1, lr_schedule="cosine", min_lr=1e-4, eval_freq=1
    )
    calls: list[int] = []
    _, result = run_fit(tmp_path, cfg, on_epoch_end=lambda epoch, model: calls.append(epoch) or {})
    assert result.steps == 3
    assert calls == [1]  # the cut-short epoch still ends with the callback
    assert [row["lr"] for row in result.history] == [learning_rate(s, cfg, 3) for s in range(3)]
    assert all(math.isfinite(row["train_loss"]) for row in result.history)
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]


def test_learning_rate_schedule() -> None:
    cfg = dataclasses.replace(TRAIN, warmup_steps=4, lr_schedule="cosine", min_lr=1e-5)
    lrs = [learning_rate(s, cfg, 20) for s in range(20)]
    assert lrs[:4] == pytest.approx([TRAIN.lr * f for f in (0.25, 0.5, 0.75, 1.0)])
    assert lrs[4] == pytest.approx(TRAIN.lr) and lrs[-1] == pytest.approx(1e-5)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    constant = dataclasses.replace(TRAIN, warmup_steps=2)
    assert [learning_rate(s, constant, 20) for s in range(4)] == pytest.approx(
        [TRAIN.lr * f for f in (0.5, 1, 1, 1)]
    )


def test_epoch_order_is_a_pure_function_of_seed_and_epoch() -> None:
    assert epoch_order(50, 7, 0) == epoch_order(50, 7, 0)
    assert sorted(epoch_order(50, 7, 1)) == list(range(50))
    assert epoch_order(50, 7, 0) != epoch_order(50, 7, 1)
    state = torch.get_rng_state()
    list(ordered_loader(TensorDataset(torch.arange(10)), 3))
    assert torch.equal(state, torch.get_rng_state()), "evaluation loaders must not draw from the global RNG"


def test_resolve_device() -> None:
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_too_little_data_is_a_clear_error(tmp_path: Path) -> None:
    train_data, val_data = verdict_data()
    with pytest.raises(ValueError, match="fewer than one batch of train.batch_size=64"):
        fit(
            tiny_model(),
            train_data,
            val_data,
            cfg=dataclasses.replace(TRAIN, batch_size=64),
            checkpoints=CHECKPOINTS,
            loss_fn=next_token_loss,
            run_dir=tmp_path,
        )


def test_next_token_loss_skips_ignored_targets() -> None:
    model = tiny_model().eval()
    inputs = torch.randint(0, 50257, (2, 8))
    targets = torch.randint(0, 50257, (2, 8))
    targets[0, 5:] = IGNORE_INDEX
    logits = model(inputs)
    keep = targets != IGNORE_INDEX
    expected = F.cross_entropy(logits[keep], targets[keep])
    assert torch.allclose(next_token_loss(model, (inputs, targets)), expected)


def test_average_loss_matches_the_books_calc_loss_loader() -> None:
    model = tiny_model().eval()
    train_data, _ = verdict_data()
    loader = DataLoader(train_data, batch_size=4)
    with torch.no_grad():
        per_batch = [next_token_loss(model, batch).item() for batch in loader]
    assert average_loss(model, loader, next_token_loss) == pytest.approx(np.mean(per_batch))
    assert average_loss(model, loader, next_token_loss, num_batches=2) == pytest.approx(
        np.mean(per_batch[:2])
    )
    assert math.isnan(average_loss(model, [], next_token_loss))
    assert count_tokens((torch.zeros(3, 5), torch.zeros(3, 5))) == 15


def test_checkpoints_by_time_and_always_after_the_last_step(reference, tmp_path: Path) -> None:
    weights, result = reference
    by_time = checkpoint_config(every_steps=None, every_minutes=1e6, keep=5)
    _, timed = run_fit(tmp_path / "rare", checkpoints=by_time)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "rare")] == ["step-0000012"]
    assert timed.history == result.history  # when it saves never changes the numbers
    loaded, _ = checkpoint.load_training_checkpoint(tmp_path / "rare" / "step-0000012")
    assert all(torch.equal(weights[k], v) for k, v in loaded.items())

    often = dataclasses.replace(by_time, every_minutes=1e-9)
    run_fit(tmp_path / "often", checkpoints=often)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "often")] == [
        f"step-{s:07d}" for s in range(8, 13)
    ]


def test_a_failed_background_save_surfaces(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("a file where the checkpoint folder should be")
    with pytest.raises(WriteError, match=r"cannot write .*run/step-\d{7}: File exists"):  # one line, the file
        run_fit(tmp_path / "run", dataclasses.replace(TRAIN, max_steps=4))


def test_the_last_save_left_to_the_caller_is_complete_once_its_stack_closes(
    reference, tmp_path: Path
) -> None:
    weights, result = reference
    with ExitStack() as finish_saving:
        _, deferred = run_fit(tmp_path / "run", finish_saving=finish_saving)
    assert deferred.history == result.history
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "run")] == ["step-0000008", "step-0000012"]
    loaded, state = checkpoint.load_training_checkpoint(tmp_path / "run" / "step-0000012")
    assert all(torch.equal(weights[k], v) for k, v in loaded.items())
    assert state["progress"]["steps"] == 12


def test_a_failed_last_save_left_to_the_caller_surfaces_when_its_stack_closes(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("a file where the checkpoint folder should be")
    only_last = checkpoint_config(every_steps=None, every_minutes=1e6, keep=2)
    stack = ExitStack()
    run_fit(
        tmp_path / "run", dataclasses.replace(TRAIN, max_steps=4), checkpoints=only_last, finish_saving=stack
    )
    with pytest.raises(WriteError, match=r"cannot write .*run/step-0000004: File exists"):
        stack.close()


def test_a_run_without_any_checkpoint_schedule_is_refused() -> None:
    with pytest.raises(ConfigError, match="every_steps and every_minutes are both null"):
        checkpoint_config(every_steps=None, every_minutes=None)


def test_evaluations_in_one_pass_give_the_per_batch_means_of_full_batches(tmp_path: Path) -> None:
    """eval_in_one_pass scores eval_iter full batches at once: the same losses, the same training."""
    model_a, batched = run_fit(tmp_path / "batched")
    model_b, one_pass = run_fit(tmp_path / "one_pass", dataclasses.replace(TRAIN, eval_in_one_pass=True))
    assert len(one_pass.history) == len(batched.history) > 2
    for row_a, row_b in zip(batched.history, one_pass.history, strict=True):
        assert row_a["step"] == row_b["step"]
        for key in ("train_loss", "val_loss"):
            assert row_b[key] == pytest.approx(row_a[key], rel=1e-5), (row_a["step"], key)
    for (name, a), b in zip(weights_of(model_a).items(), weights_of(model_b).values(), strict=True):
        assert torch.equal(a, b), name  # evaluation draws nothing: training is the same
