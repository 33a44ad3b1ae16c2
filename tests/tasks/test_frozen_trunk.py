"""The spam stage's frozen trunk computed once: the same records, scores and weights as the whole model, on a tiny GPT.

Chapter 6's procedure is run as the stage runs it (gptlab.tasks.frozen_trunk's view and loss
around the shared loop), once on the cached trunk and once on the whole model, and compared
float for float. It rests on the CPU's matmuls giving a row the same result whatever the other
rows of its batch hold: the tests that need it check that first and skip, saying so, where it
does not hold (the stage then turns its cache off, as the last tests show).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.model.lora import add_lora
from gptlab.tasks.classifier import accuracy, classification_loss, count_examples, make_classifier, predict
from gptlab.tasks.frozen_trunk import first_trainable_block, frozen_trunk, off_reason, trunk_output
from gptlab.training.config import TrainConfig
from gptlab.training.data_order import evaluation_loader
from gptlab.training.loop import fit
from gptlab.training.runtime import ordered_loader

from helpers import checkpoint_config, train_config

TINY = ModelConfig(context_length=24, emb_dim=32, n_heads=2, n_layers=3, drop_rate=0.0, qkv_bias=True)
ROWS = {"train": 29, "val": 11, "test": 13}  # none a multiple of the batches below: short batches too
LENGTH = 20
BOOK = train_config(batch_size=4, epochs=3, lr=5e-3, eval_freq=2, eval_iter=2, rng="book")
CHECKPOINTS = checkpoint_config(every_steps=3, keep=2)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def spam_like_splits() -> dict[str, TensorDataset]:
    """Random messages padded with end-of-text, random labels; one training message again in val."""
    gen = torch.Generator().manual_seed(5)
    data = {}
    for split, rows in ROWS.items():
        ids = torch.randint(0, 50256, (rows, LENGTH), generator=gen)
        lengths = torch.randint(3, LENGTH + 1, (rows,), generator=gen)
        ids[torch.arange(LENGTH) >= lengths.unsqueeze(1)] = 50256
        data[split] = TensorDataset(ids, torch.randint(0, 2, (rows,), generator=gen))
    data["val"].tensors[0][0] = data["train"].tensors[0][3]
    return data


def classifier(trainable: str = "last_blocks", blocks: int = 1, drop_rate: float = 0.0) -> GPTModel:
    torch.manual_seed(0)
    model = build_gpt(dataclasses.replace(TINY, drop_rate=drop_rate)).eval()
    return make_classifier(model, 2, trainable=trainable, trainable_blocks=blocks, seed=123)  # type: ignore[arg-type]


def require_row_independent_kernels(batch_size: int) -> None:
    """Skip unless a message's trunk output here is the same in two batches of `batch_size` with other rows."""
    model = classifier()
    ids = spam_like_splits()["train"].tensors[0]
    with torch.no_grad():
        alone = trunk_output(model, first_trainable_block(model), ids[:batch_size])
        mixed = trunk_output(
            model, first_trainable_block(model), torch.cat([ids[-batch_size + 1 :], ids[:1]])
        )
    # The rule: on a CPU whose kernels are not row-independent there is nothing exact to
    # compare; CI's CPUs (AVX2, AVX-512) are, so CI runs these tests.
    if not torch.equal(alone[0], mixed[-1]):
        pytest.skip(
            f"this machine's matmuls give a row of a {batch_size}-row batch another result with other "
            "rows beside it: the cache cannot be exact here (it turns itself off, as tested below)"
        )


@dataclass
class Outcome:
    """What chapter 6's procedure produced: the records, the scores, the weights, and the cache's use."""

    initial: dict[str, float]
    history: list[dict[str, float]]
    epochs: list[dict[str, Any]]
    predictions: dict[str, tuple[np.ndarray, ...]]
    weights: dict[str, torch.Tensor]
    summary: str
    misses: int


def chapter_6(
    run_dir: Path,
    cfg: TrainConfig,
    *,
    cached: bool,
    trainable: str = "last_blocks",
    blocks: int = 1,
    pooling: str = "last",
    wrap_loss: Callable[[Any], Any] = lambda loss: loss,
) -> Outcome:
    """Chapter 6 as stages/spam_finetune.py runs it: initial accuracies, training, epoch accuracies, scores."""
    data = spam_like_splits()
    model = classifier(trainable, blocks)
    eval_batch = cfg.eval_batch_size or cfg.batch_size
    with frozen_trunk(
        model,
        {split: dataset.tensors[0] for split, dataset in data.items()},
        batch_sizes=(cfg.batch_size, eval_batch),
        shuffled="train",
        precision=cfg.precision,
        spill_dir=run_dir / "spill",
        off=None if cached else "the test's whole-model run",
    ) as trunk:
        loaders = {
            s: evaluation_loader(d, cfg.batch_size, cfg.rng, shuffled=s == "train") for s, d in data.items()
        }

        def scores(trained: nn.Module, num_batches: int = cfg.eval_iter) -> dict[str, float]:
            view = trunk.view(trained)  # type: ignore[arg-type]
            return {
                f"{s}_accuracy": accuracy(view, loaders[s], pooling, num_batches) for s in ("train", "val")
            }  # type: ignore[arg-type]

        torch.manual_seed(123)
        initial = scores(model, 3)
        torch.manual_seed(123)
        result = fit(
            model,
            data["train"],
            data["val"],
            cfg=cfg,
            checkpoints=CHECKPOINTS,
            loss_fn=wrap_loss(trunk.loss(classification_loss(pooling))),  # type: ignore[arg-type]
            run_dir=run_dir / "run",
            seen_name="examples_seen",
            count_seen=count_examples,
            on_epoch_end=lambda epoch, trained: scores(trained),
        )
        predictions = {
            s: predict(trunk.view(model), ordered_loader(d, eval_batch), pooling)  # type: ignore[arg-type]
            for s, d in data.items()
        }
        return Outcome(
            initial,
            result.history,
            result.epochs,
            predictions,
            model.state_dict(),
            trunk.summary,
            trunk.misses,
        )


def assert_same(cached: Outcome, whole: Outcome) -> None:
    assert cached.summary.startswith("on: ") and whole.summary.startswith("off: ")
    assert cached.initial == whole.initial
    assert cached.history == whole.history and len(cached.history) > 3
    assert cached.epochs == whole.epochs and len(cached.epochs) == BOOK.epochs
    for split, arrays in whole.predictions.items():
        for ours, theirs in zip(cached.predictions[split], arrays, strict=True):
            assert np.array_equal(ours, theirs), split  # the probabilities too, bit for bit
    for name, tensor in whole.weights.items():
        assert torch.equal(cached.weights[name], tensor), name


@pytest.mark.parametrize(
    ("trainable", "blocks", "pooling", "changes"),
    [
        ("last_blocks", 1, "last", {}),  # chapter 6
        ("head", 1, "mean", {"eval_batch_size": 5}),  # the final scores in batches of another size
        ("last_blocks", 2, "first", {"rng": "per_epoch", "eval_batch_size": 3}),
    ],
)
def test_the_cached_trunk_gives_the_whole_models_records_scores_and_weights(
    tmp_path: Path, trainable: str, blocks: int, pooling: str, changes: dict[str, Any]
) -> None:
    cfg = dataclasses.replace(BOOK, **changes)
    require_row_independent_kernels(cfg.batch_size)
    settings = {"trainable": trainable, "blocks": blocks, "pooling": pooling}
    cached = chapter_6(tmp_path / "cached", cfg, cached=True, **settings)
    whole = chapter_6(tmp_path / "whole", cfg, cached=False, **settings)
    assert_same(cached, whole)
    assert cached.misses == 0  # every batch the procedure read was one the cache holds
    first = {"head": "blocks 0-2", "last_blocks": f"blocks 0-{2 - blocks}" if blocks < 2 else "block 0"}
    assert f"the embeddings and {first[trainable]} computed once" in cached.summary


@pytest.mark.parametrize("cut_cached", [True, False])
def test_a_run_cut_on_one_path_resumes_on_the_other_with_the_same_numbers(
    tmp_path: Path, cut_cached: bool
) -> None:
    require_row_independent_kernels(BOOK.batch_size)
    full = chapter_6(tmp_path / "full", BOOK, cached=not cut_cached)
    calls = 0

    def crashing(
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    ) -> Callable[[nn.Module, Any], torch.Tensor]:
        def loss(model: nn.Module, batch: Any) -> torch.Tensor:
            nonlocal calls
            if model.training:
                calls += 1
                if calls == 12:  # step 11: in epoch 2, after the checkpoint of step 9
                    raise KeyboardInterrupt
            return loss_fn(model, batch)

        return loss

    with pytest.raises(KeyboardInterrupt):
        chapter_6(tmp_path / "cut", BOOK, cached=cut_cached, wrap_loss=crashing)
    torch.manual_seed(999)  # whatever the RNG holds now, the resumed run restores its own
    resumed = chapter_6(tmp_path / "cut", BOOK, cached=not cut_cached)
    assert resumed.history == full.history and resumed.epochs == full.epochs
    for name, tensor in full.weights.items():
        assert torch.equal(resumed.weights[name], tensor), name


def test_the_cache_is_off_where_it_cannot_be_exact_and_says_why() -> None:
    book = classifier()
    reasons = {
        "book": off_reason(book, enabled=True, trainable="last_blocks", compiled=False, processes=1),
        "flag": off_reason(book, enabled=False, trainable="last_blocks", compiled=False, processes=1),
        "all": off_reason(classifier("all"), enabled=True, trainable="all", compiled=False, processes=1),
        "lora": off_reason(
            add_lora(classifier("lora"), 2, 4), enabled=True, trainable="lora", compiled=False, processes=1
        ),
        "dropout": off_reason(
            classifier(drop_rate=0.1), enabled=True, trainable="last_blocks", compiled=False, processes=1
        ),
        "compile": off_reason(book, enabled=True, trainable="last_blocks", compiled=True, processes=1),
        "torchrun": off_reason(book, enabled=True, trainable="head", compiled=False, processes=2),
    }
    assert reasons == {
        "book": None,
        "flag": "spam.cache_frozen_trunk is false",
        "all": "trainable: all trains weights in every block",
        "lora": "trainable: lora trains weights in every block",
        "dropout": "dropout 0.1 in the frozen blocks draws new masks at every pass",
        "compile": "train.compile compiles the whole model into the step",
        "torchrun": "torchrun runs 2 processes",
    }
    # Trainable embeddings (no mode of the stage trains them alone) keep the cache off too.
    book.tok_emb.requires_grad_(True)
    assert (
        off_reason(book, enabled=True, trainable="head", compiled=False, processes=1)
        == "the embeddings train"
    )

    ids = spam_like_splits()["train"].tensors[0]
    loss = classification_loss("last")
    with frozen_trunk(
        book,
        {"train": ids},
        batch_sizes=(4, 4),
        shuffled="train",
        precision="fp32",
        spill_dir=Path(),
        off="why",
    ) as trunk:
        assert trunk.summary == "off: why" and not trunk.cached
        assert trunk.view(book) is book and trunk.loss(loss) is loss


class MixesRows(nn.Module):
    """A frozen block whose output depends on the batch's other rows, as a GEMM that blocks by content would."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        out = self.block(x, cache)
        return out + 1e-3 * out.mean(dim=0, keepdim=True)


def test_states_that_differ_from_the_whole_model_turn_the_cache_off(tmp_path: Path) -> None:
    model = classifier()
    model.trf_blocks[0] = MixesRows(model.trf_blocks[0])
    ids = spam_like_splits()["train"].tensors[0]
    with frozen_trunk(
        model,
        {"train": ids},
        batch_sizes=(4, 4),
        shuffled="train",
        precision="fp32",
        spill_dir=tmp_path,
        off=None,
    ) as trunk:
        assert not trunk.cached and trunk.view(model) is model
        assert trunk.summary == (
            "off: the cached states differ from the whole model's on a check batch "
            "(this machine's kernels depend on a batch's other rows)"
        )


def test_states_beyond_the_memory_limit_are_memory_mapped_and_leave_no_file(tmp_path: Path) -> None:
    require_row_independent_kernels(4)
    model = classifier("head")
    splits = {split: dataset.tensors[0] for split, dataset in spam_like_splits().items()}
    spill = tmp_path / "spill"
    options = {
        "batch_sizes": (4, 5),
        "shuffled": "train",
        "precision": "fp32",
        "spill_dir": spill,
        "off": None,
    }
    batch = splits["train"][[20, 3, 11, 28]]
    with frozen_trunk(model, splits, **options) as in_memory:  # type: ignore[arg-type]
        assert "MiB in memory)" in in_memory.summary
        kept = in_memory.states(batch)
    with frozen_trunk(model, splits, memory_limit=0, **options) as mapped:  # type: ignore[arg-type]
        assert f"MiB memory-mapped under {spill})" in mapped.summary
        assert list(spill.iterdir()) == []  # the file has no name to leave behind, even after kill -9
        assert kept is not None and torch.equal(mapped.states(batch), kept)
        # Batches of 4: 29 training messages (the last in a full batch too), 7 of val's 8 (one is
        # a training message), 12 of test; their short batches 1 + 3 + 1. Of 5: 25 + 9 + 10, short 1 + 3.
        assert mapped.summary.startswith(
            "on: the embeddings and blocks 0-2 computed once (101 message states"
        )
    assert not mapped.cached and list(spill.iterdir()) == []


def test_a_batch_the_cache_does_not_hold_runs_the_whole_model(tmp_path: Path) -> None:
    require_row_independent_kernels(4)
    model = classifier()
    ids = spam_like_splits()["train"].tensors[0]
    with frozen_trunk(
        model,
        {"train": ids},
        batch_sizes=(4, 4),
        shuffled="train",
        precision="fp32",
        spill_dir=tmp_path,
        off=None,
    ) as trunk:
        view = trunk.view(model)
        unknown = ids[:4].clone()
        unknown[0, 0] += 1
        elsewhere = {
            "another number of rows": ids[:3],
            "a message never cached": unknown,
            "another length": ids[:4, :10],
        }
        with torch.no_grad():
            for why, batch in elsewhere.items():
                assert torch.equal(view(batch), model(batch)), why
            assert trunk.misses == len(elsewhere) and trunk.hits == 0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(view(ids[:4]), model(ids[:4]))
            assert trunk.misses == 4 and trunk.hits == 0
            view(ids[4:8])
            assert trunk.hits == 1
