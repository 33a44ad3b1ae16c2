"""`train.rng: book`: our loop draws randomness exactly as the book's chapter scripts do.

Each test writes the book's own loop from its text (chapter 5's
train_model_simple, chapter 6's train_classifier_simple and calc_accuracy_loader,
chapter 7's reuse of chapter 5 with a custom collate function), runs it beside
our `fit` from the same seed on a tiny model, and asserts that the two loss
(and accuracy) sequences are equal, float for float, over several epochs.
Chapters 6 and 7 start from a GPT-2 weights file laid out as OpenAI's: the book
reads it with its load_weights_into_gpt, we with the load-gpt2 stage's conversion,
its saved base model (the kernels the default params ask for) and the fine-tunes'
load_model.
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
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from gptlab.data.instruct import instruction_collate
from gptlab.data.verdict import GPTDatasetV1, encode, split_text
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import load_model
from gptlab.model.config import ModelConfig
from gptlab.model.generate import generate
from gptlab.model.gpt import GPTModel
from gptlab.model.hf_gpt2 import expected_hf_shapes
from gptlab.model.tokenizer import load_tokenizer
from gptlab.paths import GPT2_MODELS
from gptlab.pipeline.base_models import write_base_model
from gptlab.tasks.classifier import accuracy, classification_loss, count_examples, make_classifier
from gptlab.training.data_order import evaluation_loader
from gptlab.training.loop import fit
from gptlab.training.losses import next_token_loss

from helpers import checkpoint_config, committed_params, train_config

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


def book_assign_check(left, right):
    if left.shape != right.shape:
        raise ValueError(f"Shape mismatch. Left: {left.shape}, Right: {right.shape}")
    return torch.nn.Parameter(right.clone().detach())


def book_load_weights_into_gpt(gpt, params):
    """The book's loader of OpenAI's GPT-2 from Hugging Face's safetensors file (ch05 bonus, weight loading)."""
    gpt.pos_emb.weight = book_assign_check(gpt.pos_emb.weight, params["wpe.weight"])
    gpt.tok_emb.weight = book_assign_check(gpt.tok_emb.weight, params["wte.weight"])
    for b in range(len(gpt.trf_blocks)):
        block = gpt.trf_blocks[b]
        q_w, k_w, v_w = torch.chunk(params[f"h.{b}.attn.c_attn.weight"], 3, axis=-1)
        block.att.W_query.weight = book_assign_check(block.att.W_query.weight, q_w.T)
        block.att.W_key.weight = book_assign_check(block.att.W_key.weight, k_w.T)
        block.att.W_value.weight = book_assign_check(block.att.W_value.weight, v_w.T)
        q_b, k_b, v_b = torch.chunk(params[f"h.{b}.attn.c_attn.bias"], 3, axis=-1)
        block.att.W_query.bias = book_assign_check(block.att.W_query.bias, q_b)
        block.att.W_key.bias = book_assign_check(block.att.W_key.bias, k_b)
        block.att.W_value.bias = book_assign_check(block.att.W_value.bias, v_b)
        block.att.out_proj.weight = book_assign_check(
            block.att.out_proj.weight, params[f"h.{b}.attn.c_proj.weight"].T
        )
        block.att.out_proj.bias = book_assign_check(
            block.att.out_proj.bias, params[f"h.{b}.attn.c_proj.bias"]
        )
        block.ff.layers[0].weight = book_assign_check(
            block.ff.layers[0].weight, params[f"h.{b}.mlp.c_fc.weight"].T
        )
        block.ff.layers[0].bias = book_assign_check(block.ff.layers[0].bias, params[f"h.{b}.mlp.c_fc.bias"])
        block.ff.layers[2].weight = book_assign_check(
            block.ff.layers[2].weight, params[f"h.{b}.mlp.c_proj.weight"].T
        )
        block.ff.layers[2].bias = book_assign_check(block.ff.layers[2].bias, params[f"h.{b}.mlp.c_proj.bias"])
        block.norm1.scale = book_assign_check(block.norm1.scale, params[f"h.{b}.ln_1.weight"])
        block.norm1.shift = book_assign_check(block.norm1.shift, params[f"h.{b}.ln_1.bias"])
        block.norm2.scale = book_assign_check(block.norm2.scale, params[f"h.{b}.ln_2.weight"])
        block.norm2.shift = book_assign_check(block.norm2.shift, params[f"h.{b}.ln_2.bias"])
    gpt.final_norm.scale = book_assign_check(gpt.final_norm.scale, params["ln_f.weight"])
    gpt.final_norm.shift = book_assign_check(gpt.final_norm.shift, params["ln_f.bias"])
    gpt.out_head.weight = book_assign_check(gpt.out_head.weight, params["wte.weight"])


# ---------------------------------------------------------------------- #
# OpenAI's weights, as the book and the load-gpt2 stage each read them
# ---------------------------------------------------------------------- #

# A GPT-2 whose bare weights file load-gpt2 can read: 64-dimensional heads, c_attn biases.
GPT2_TINY = dataclasses.replace(TINY, emb_dim=128, n_heads=2, qkv_bias=True)


def openai_weights_file(path: Path) -> Path:
    """Random weights laid out as OpenAI's model.safetensors on the hub: unprefixed, Conv1D, tied head."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in expected_hf_shapes(GPT2_TINY).items():
        scale = name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
        tensors[name] = float(scale) + 0.05 * torch.randn(shape, generator=gen)
    save_file(tensors, str(path))
    return path


def book_pretrained(weights: Path, drop_rate: float) -> GPTModel:
    """The book's way: its GPTModel (masked softmax, its kernels) with load_weights_into_gpt."""
    model = build_gpt(dataclasses.replace(GPT2_TINY, drop_rate=drop_rate))
    book_load_weights_into_gpt(model, load_file(str(weights)))
    return model.eval()


def row_major(model: GPTModel) -> GPTModel:
    """The same weights, each laid out row-major (contiguous), as a safetensors file loads them."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.contiguous()
    return model


def stage_pretrained(weights: Path, drop_rate: float) -> GPTModel:
    """The pipeline's way: load-gpt2 converts and saves the base model, the fine-tune rebuilds it from there."""
    params = committed_params()  # the default params: OpenAI's weights, the book's kernels
    write_base_model("gpt2-small", params, weights, params.pretrain.model.resolve())
    model, _ = load_model(GPT2_MODELS / "gpt2-small", drop_rate=drop_rate)
    assert (model.cfg.attention, model.cfg.kernels) == ("masked_softmax", "book")
    return model


@pytest.fixture
def weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # load-gpt2 writes models/gpt2/<name>
    return openai_weights_file(tmp_path / "model.safetensors")


# ---------------------------------------------------------------------- #
# Chapter 5, 6 and 7 beside our loop
# ---------------------------------------------------------------------- #


def test_chapter_5_loop(tmp_path: Path) -> None:
    train, val = windows(22, seed=1), windows(5, seed=2)  # 5 batches of 4 per epoch (2 left over)

    torch.manual_seed(123)  # chapter 5: seed, model, optimizer, train
    model = build_gpt(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=BOOK.lr, weight_decay=BOOK.weight_decay)
    train_loader, val_loader = book_loaders(train, val, BOOK.batch_size)
    book = book_train_model_simple(model, train_loader, val_loader, optimizer, BOOK.epochs, 2, 2)

    torch.manual_seed(123)
    ours = fit(
        build_gpt(TINY),
        train,
        val,
        cfg=BOOK,
        checkpoints=CHECKPOINTS,
        loss_fn=next_token_loss,
        run_dir=tmp_path,
        on_epoch_end=greedy_sample,
    )

    assert len(book[0]) == len(ours.history) == 8  # steps 0, 2, ..., 14
    assert [r["train_loss"] for r in ours.history] == book[0]
    assert [r["val_loss"] for r in ours.history] == book[1]
    assert [r["tokens_seen"] for r in ours.history] == book[2]
    assert [r["sample"] for r in ours.epochs] == [str(s) for s in book[3]]


def test_chapter_6_loop_with_accuracies_from_openais_weights(tmp_path: Path, weights: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50257, (30, 12), generator=gen)
    labels = torch.randint(0, 2, (30,), generator=gen)
    train, val = TensorDataset(ids[:22], labels[:22]), TensorDataset(ids[22:], labels[22:])

    # The book: seed before the loaders, the model, seed before the new head, seed before training.
    torch.manual_seed(123)
    train_loader, val_loader = book_loaders(train, val, BOOK.batch_size)
    model = make_classifier(
        book_pretrained(weights, 0.0), 2, trainable="last_blocks", trainable_blocks=1, seed=123
    )
    torch.manual_seed(123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=BOOK.lr, weight_decay=BOOK.weight_decay)
    book = book_train_classifier_simple(model, train_loader, val_loader, optimizer, BOOK.epochs, 2, 2)

    # Ours, as the load-gpt2 and spam-finetune stages drive it (spam.drop_rate 0.0).
    ours_model = make_classifier(
        stage_pretrained(weights, 0.0), 2, trainable="last_blocks", trainable_blocks=1, seed=123
    )
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
        run_dir=tmp_path / "run",
        seen_name="examples_seen",
        count_seen=count_examples,
        on_epoch_end=epoch_accuracy,
    )
    assert [r["train_loss"] for r in ours.history] == book[0]
    assert [r["val_loss"] for r in ours.history] == book[1]
    assert [r["train_accuracy"] for r in ours.epochs] == book[2]
    assert [r["val_accuracy"] for r in ours.epochs] == book[3]
    assert ours.seen == book[4]


@pytest.mark.slow
def test_chapter_7_loop_with_the_instruction_collate_from_openais_weights(
    tmp_path: Path, weights: Path
) -> None:
    gen = torch.Generator().manual_seed(4)
    examples = [
        (torch.randint(0, 50256, (int(n),), generator=gen).tolist(), 3)
        for n in torch.randint(4, 14, (26,), generator=gen)
    ]
    train, val = examples[:21], examples[21:]
    collate = functools.partial(instruction_collate, allowed_max_length=TINY.context_length)
    cfg = dataclasses.replace(BOOK, epochs=2)

    def book_run(model: GPTModel) -> tuple[list[float], list[float], list[int], list[list[int]]]:
        torch.manual_seed(123)  # chapter 7: seed, loaders, the pretrained model, optimizer, seed, train
        train_loader, val_loader = book_loaders(train, val, cfg.batch_size, collate)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        torch.manual_seed(123)
        return book_train_model_simple(model, train_loader, val_loader, optimizer, cfg.epochs, 2, 2)

    # The book's load_weights_into_gpt keeps each block weight as a clone of a transposed view:
    # column-major, where the pipeline's safetensors base model is row-major. Same batches, same
    # shapes (padding, composition, batches per evaluation), but the matmuls read their weights in
    # the other layout, and some CPUs' GEMMs (AVX-512, seen on a Xeon) then round the last bit of
    # a validation batch's loss differently (a 1-ulp change in one batch moves the mean by 5e-7).
    # So: against the book's own layout, equal to float32 rounding; with the layout made the same,
    # equal float for float, on every CPU.
    book = book_run(book_pretrained(weights, 0.1))  # with dropout: both draw its masks alike
    book_row_major = book_run(row_major(book_pretrained(weights, 0.1)))

    ours_model = stage_pretrained(weights, 0.1)  # instruct-finetune: load_model(base, drop_rate=...)
    torch.manual_seed(123)
    ours = fit(
        ours_model,
        train,
        val,
        cfg=cfg,
        checkpoints=CHECKPOINTS,
        loss_fn=next_token_loss,
        run_dir=tmp_path / "run",
        collate_fn=collate,
    )
    assert [r["train_loss"] for r in ours.history] == book_row_major[0]
    assert [r["val_loss"] for r in ours.history] == book_row_major[1]
    assert [r["tokens_seen"] for r in ours.history] == book_row_major[2] == book[2]
    assert [r["train_loss"] for r in ours.history] == pytest.approx(book[0], rel=1e-6, abs=0)
    assert [r["val_loss"] for r in ours.history] == pytest.approx(book[1], rel=1e-6, abs=0)


def test_a_run_resumed_mid_epoch_replays_the_books_draws(tmp_path: Path) -> None:
    train, val = windows(22, seed=1), windows(5, seed=2)

    def run(loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], folder: str):
        every_3 = checkpoint_config(every_steps=3)
        return fit(
            build_gpt(TINY),
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
    torch.manual_seed(123)
    model = build_gpt(
        ModelConfig(context_length=256, drop_rate=0.1, qkv_bias=False, attention="masked_softmax")
    )
    # Saved once, after the last step (not at each epoch's end too): 2 GB a save at these dims.
    last_only = checkpoint_config(every_steps=None, every_minutes=60, keep=1)
    result = fit(model, train, val, cfg=cfg, checkpoints=last_only, loss_fn=next_token_loss, run_dir=tmp_path)
    train_losses = [r["train_loss"] for r in result.history]
    val_losses = [r["val_loss"] for r in result.history]
    assert round(train_losses[0], 1) == 7.6
    assert round(val_losses[0], 1) == 10.1
    assert train_losses[-1] < train_losses[0]
