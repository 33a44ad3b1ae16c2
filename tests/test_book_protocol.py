"""`train.rng: book`: our loop draws randomness exactly as the book's chapter scripts do.

Each test writes the book's own loop from its text (chapter 5's
train_model_simple, chapter 6's train_classifier_simple and calc_accuracy_loader,
chapter 7's reuse of chapter 5 with a custom collate function), runs it beside
our `fit` from the same seed on a tiny model, and asserts that the two loss
(and accuracy) sequences agree over several epochs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from gptlab.architecture import ModelConfig
from gptlab.classifier import accuracy, classification_loss, count_examples, make_classifier
from gptlab.data_order import evaluation_loader
from gptlab.datasets.instruct import instruction_collate
from gptlab.datasets.verdict import GPTDatasetV1, encode, split_text
from gptlab.generate import generate
from gptlab.losses import next_token_loss
from gptlab.model import GPTModel
from gptlab.tokenizer import load_tokenizer
from gptlab.train import fit

from helpers import checkpoint_config, train_config

BOOK = train_config(batch_size=4, epochs=3, lr=5e-3, eval_freq=2, eval_iter=2, rng="book")
CHECKPOINTS = checkpoint_config(every_steps=1000, keep=1)
TINY = ModelConfig(
    vocab_size=50257,
    context_length=16,
    emb_dim=16,
    n_heads=2,
    n_layers=2,
    drop_rate=0.1,
    attention="masked_softmax",
)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def windows(n: int, seed: int) -> Dataset:
    ids = torch.randint(
        0, 50257, (n * TINY.context_length + 1,), generator=torch.Generator().manual_seed(seed)
    )
    return GPTDatasetV1(ids.tolist(), TINY.context_length, TINY.context_length)


# ---------------------------------------------------------------------- #
# The book's code, written from its text
# ---------------------------------------------------------------------- #


def book_calc_loss_loader(data_loader, model, calc_loss_batch, num_batches=None):
    total_loss = 0.0
    if len(data_loader) == 0:
        return float("nan")
    elif num_batches is None:
        num_batches = len(data_loader)
    else:
        num_batches = min(num_batches, len(data_loader))
    for i, (input_batch, target_batch) in enumerate(data_loader):
        if i < num_batches:
            loss = calc_loss_batch(input_batch, target_batch, model)
            total_loss += loss.item()
        else:
            break
    return total_loss / num_batches


def book_calc_loss_batch(input_batch, target_batch, model):
    logits = model(input_batch)
    return F.cross_entropy(logits.flatten(0, 1), target_batch.flatten())


def book_evaluate_model(model, train_loader, val_loader, eval_iter, calc_loss_batch):
    model.eval()
    with torch.no_grad():
        train_loss = book_calc_loss_loader(train_loader, model, calc_loss_batch, num_batches=eval_iter)
        val_loss = book_calc_loss_loader(val_loader, model, calc_loss_batch, num_batches=eval_iter)
    model.train()
    return train_loss, val_loss


def book_train_model_simple(model, train_loader, val_loader, optimizer, num_epochs, eval_freq, eval_iter):
    """Chapter 5's loop; chapter 7 calls it unchanged. The per-epoch sample is greedy."""
    train_losses, val_losses, track_tokens_seen, samples = [], [], [], []
    tokens_seen, global_step = 0, -1
    for _epoch in range(num_epochs):
        model.train()
        for input_batch, target_batch in train_loader:
            optimizer.zero_grad()
            loss = book_calc_loss_batch(input_batch, target_batch, model)
            loss.backward()
            optimizer.step()
            tokens_seen += input_batch.numel()
            global_step += 1
            if global_step % eval_freq == 0:
                train_loss, val_loss = book_evaluate_model(
                    model, train_loader, val_loader, eval_iter, book_calc_loss_batch
                )
                train_losses.append(train_loss)
                val_losses.append(val_loss)
                track_tokens_seen.append(tokens_seen)
        model.eval()  # generate_and_print_sample
        with torch.no_grad():
            samples.append(generate(model, torch.tensor([[1, 2, 3]]), 5, use_cache=False)[0].tolist())
        model.train()
    return train_losses, val_losses, track_tokens_seen, samples


def book_calc_accuracy_loader(data_loader, model, num_batches=None):
    model.eval()
    correct_predictions, num_examples = 0, 0
    num_batches = len(data_loader) if num_batches is None else min(num_batches, len(data_loader))
    for i, (input_batch, target_batch) in enumerate(data_loader):
        if i < num_batches:
            with torch.no_grad():
                logits = model(input_batch)[:, -1, :]
            predicted_labels = torch.argmax(logits, dim=-1)
            num_examples += predicted_labels.shape[0]
            correct_predictions += (predicted_labels == target_batch).sum().item()
        else:
            break
    return correct_predictions / num_examples


def book_class_loss_batch(input_batch, target_batch, model):
    logits = model(input_batch)[:, -1, :]
    return F.cross_entropy(logits, target_batch)


def book_train_classifier_simple(
    model, train_loader, val_loader, optimizer, num_epochs, eval_freq, eval_iter
):
    train_losses, val_losses, train_accs, val_accs = [], [], [], []
    examples_seen, global_step = 0, -1
    for _epoch in range(num_epochs):
        model.train()
        for input_batch, target_batch in train_loader:
            optimizer.zero_grad()
            loss = book_class_loss_batch(input_batch, target_batch, model)
            loss.backward()
            optimizer.step()
            examples_seen += input_batch.shape[0]
            global_step += 1
            if global_step % eval_freq == 0:
                train_loss, val_loss = book_evaluate_model(
                    model, train_loader, val_loader, eval_iter, book_class_loss_batch
                )
                train_losses.append(train_loss)
                val_losses.append(val_loss)
        train_accs.append(book_calc_accuracy_loader(train_loader, model, num_batches=eval_iter))
        val_accs.append(book_calc_accuracy_loader(val_loader, model, num_batches=eval_iter))
    return train_losses, val_losses, train_accs, val_accs, examples_seen


def book_loaders(
    train: Dataset, val: Dataset, batch_size: int, collate_fn: Callable | None = None
) -> tuple[DataLoader, DataLoader]:
    train_loader = DataLoader(
        train, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=collate_fn
    )
    val_loader = DataLoader(val, batch_size=batch_size, shuffle=False, drop_last=False, collate_fn=collate_fn)
    return train_loader, val_loader


def greedy_sample(epoch: int, model: torch.nn.Module) -> dict[str, Any]:
    return {"sample": str(generate(model, torch.tensor([[1, 2, 3]]), 5)[0].tolist())}


# ---------------------------------------------------------------------- #
# Chapter 5, 6 and 7 beside our loop
# ---------------------------------------------------------------------- #


def test_chapter_5_loop(tmp_path: Path) -> None:
    train, val = windows(22, seed=1), windows(5, seed=2)  # 5 batches of 4 per epoch (2 left over)

    torch.manual_seed(123)  # chapter 5: seed, model, optimizer, train
    model = GPTModel(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=BOOK.lr, weight_decay=BOOK.weight_decay)
    train_loader, val_loader = book_loaders(train, val, BOOK.batch_size)
    book = book_train_model_simple(model, train_loader, val_loader, optimizer, BOOK.epochs, 2, 2)

    torch.manual_seed(123)
    ours = fit(
        GPTModel(TINY),
        train,
        val,
        cfg=BOOK,
        checkpoints=CHECKPOINTS,
        loss_fn=next_token_loss,
        run_dir=tmp_path,
        on_epoch_end=greedy_sample,
    )

    assert len(book[0]) == len(ours.history) == 8  # steps 0, 2, ..., 14
    assert [r["train_loss"] for r in ours.history] == pytest.approx(book[0], abs=1e-6)
    assert [r["val_loss"] for r in ours.history] == pytest.approx(book[1], abs=1e-6)
    assert [r["tokens_seen"] for r in ours.history] == book[2]
    assert [r["sample"] for r in ours.epochs] == [str(s) for s in book[3]]


def test_chapter_6_loop_with_accuracies(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50257, (30, 12), generator=gen)
    labels = torch.randint(0, 2, (30,), generator=gen)
    train, val = TensorDataset(ids[:22], labels[:22]), TensorDataset(ids[22:], labels[22:])

    def base_model() -> GPTModel:
        torch.manual_seed(0)  # the "pretrained" weights
        return GPTModel(dataclasses.replace(TINY, drop_rate=0.0))

    # The book: seed before the loaders, the model, seed before the new head, seed before training.
    torch.manual_seed(123)
    train_loader, val_loader = book_loaders(train, val, BOOK.batch_size)
    model = make_classifier(base_model(), 2, trainable="last_blocks", trainable_blocks=1, seed=123)
    torch.manual_seed(123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=BOOK.lr, weight_decay=BOOK.weight_decay)
    book = book_train_classifier_simple(model, train_loader, val_loader, optimizer, BOOK.epochs, 2, 2)

    # Ours, as the spam-finetune stage drives it.
    ours_model = make_classifier(base_model(), 2, trainable="last_blocks", trainable_blocks=1, seed=123)
    scores = {
        "train": evaluation_loader(train, BOOK.batch_size, "book", shuffled=True),
        "val": evaluation_loader(val, BOOK.batch_size, "book", shuffled=False),
    }

    def epoch_accuracy(epoch: int, trained: torch.nn.Module) -> dict[str, float]:
        return {
            f"{s}_accuracy": accuracy(trained, scores[s], num_batches=BOOK.eval_iter)
            for s in ("train", "val")
        }

    torch.manual_seed(123)
    ours = fit(
        ours_model,
        train,
        val,
        cfg=BOOK,
        checkpoints=CHECKPOINTS,
        loss_fn=classification_loss("last"),
        run_dir=tmp_path,
        seen_name="examples_seen",
        count_seen=count_examples,
        on_epoch_end=epoch_accuracy,
    )
    assert [r["train_loss"] for r in ours.history] == pytest.approx(book[0], abs=1e-6)
    assert [r["val_loss"] for r in ours.history] == pytest.approx(book[1], abs=1e-6)
    assert [r["train_accuracy"] for r in ours.epochs] == pytest.approx(book[2], abs=1e-6)
    assert [r["val_accuracy"] for r in ours.epochs] == pytest.approx(book[3], abs=1e-6)
    assert ours.seen == book[4]


def test_chapter_7_loop_with_the_instruction_collate(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(4)
    examples = [
        (torch.randint(0, 50256, (int(n),), generator=gen).tolist(), 3)
        for n in torch.randint(4, 14, (26,), generator=gen)
    ]
    train, val = examples[:21], examples[21:]
    collate = functools.partial(instruction_collate, allowed_max_length=TINY.context_length)
    cfg = dataclasses.replace(BOOK, epochs=2)

    def pretrained() -> GPTModel:
        torch.manual_seed(0)
        return GPTModel(TINY)

    torch.manual_seed(123)  # chapter 7: seed, loaders, the pretrained model, optimizer, seed, train
    train_loader, val_loader = book_loaders(train, val, cfg.batch_size, collate)
    model = pretrained()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    torch.manual_seed(123)
    book = book_train_model_simple(model, train_loader, val_loader, optimizer, cfg.epochs, 2, 2)

    ours_model = pretrained()
    torch.manual_seed(123)
    ours = fit(
        ours_model,
        train,
        val,
        cfg=cfg,
        checkpoints=CHECKPOINTS,
        loss_fn=next_token_loss,
        run_dir=tmp_path,
        collate_fn=collate,
    )
    assert [r["train_loss"] for r in ours.history] == pytest.approx(book[0], abs=1e-6)
    assert [r["val_loss"] for r in ours.history] == pytest.approx(book[1], abs=1e-6)
    assert [r["tokens_seen"] for r in ours.history] == book[2]


def test_a_run_resumed_mid_epoch_replays_the_books_draws(tmp_path: Path) -> None:
    train, val = windows(22, seed=1), windows(5, seed=2)

    def run(loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], folder: str):
        every_3 = checkpoint_config(every_steps=3)
        return fit(
            GPTModel(TINY),
            train,
            val,
            cfg=BOOK,
            checkpoints=every_3,
            loss_fn=loss_fn,
            run_dir=tmp_path / folder,
        )

    torch.manual_seed(123)
    full = run(next_token_loss, "full")
    calls = 0

    def crashing_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        nonlocal calls
        if model.training:
            calls += 1
            if calls == 8:  # step 7: in the middle of epoch 2, after the checkpoint at step 6
                raise KeyboardInterrupt
        return next_token_loss(model, batch)

    torch.manual_seed(123)
    with pytest.raises(KeyboardInterrupt):
        run(crashing_loss, "cut")
    torch.manual_seed(999)  # whatever the RNG holds now, the resumed run restores its own
    resumed = run(next_token_loss, "cut")
    assert resumed.resumed_steps == 6
    assert resumed.history == full.history


@pytest.mark.slow
def test_the_book_packages_chapter_5_unit_test(shared_data: Path, tmp_path: Path) -> None:
    """The book's own test: GPT-2 small dims at context 256, one window each, 2 epochs, batch 1."""
    tokenizer = load_tokenizer(shared_data)
    text = (shared_data / "the-verdict.txt").read_text(encoding="utf-8")
    train_text, val_text = split_text(text, 0.9)
    train = Subset(GPTDatasetV1(encode(train_text, tokenizer), 256, 256), range(1))
    val = Subset(GPTDatasetV1(encode(val_text, tokenizer), 256, 256), range(1))
    cfg = dataclasses.replace(BOOK, batch_size=1, epochs=2, lr=5e-4, eval_freq=1, eval_iter=1)
    torch.set_num_threads(2)
    torch.manual_seed(123)
    model = GPTModel(
        ModelConfig(context_length=256, drop_rate=0.1, qkv_bias=False, attention="masked_softmax")
    )
    result = fit(
        model, train, val, cfg=cfg, checkpoints=CHECKPOINTS, loss_fn=next_token_loss, run_dir=tmp_path
    )
    train_losses = [r["train_loss"] for r in result.history]
    val_losses = [r["val_loss"] for r in result.history]
    assert round(train_losses[0], 1) == 7.6
    assert round(val_losses[0], 1) == 10.1
    assert train_losses[-1] < train_losses[0]
