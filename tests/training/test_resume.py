"""A run's resume folder and checkpoints across process counts: another count never deletes them.

A pretrain of 2 torchrun processes, killed after a checkpoint, then relaunched by mistake as one
process, once deleted the 2-process checkpoints and trained from scratch. Now each count has its
own folder, and a checkpoint of another count found in a run's folder is refused in one line, kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptlab.errors import InputError
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import Progress, list_checkpoints
from gptlab.model.config import ModelConfig
from gptlab.training.distributed import World
from gptlab.training.resume import Checkpointer, resume_folder

TINY = ModelConfig(context_length=8, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)


def checkpointer(folder: Path, processes: int) -> Checkpointer:
    """Rank 0's checkpointer of a tiny model, as a run of `processes` processes has it."""
    torch.manual_seed(0)
    model = build_gpt(TINY)
    batch = torch.arange(8).reshape(1, 8)
    return Checkpointer(
        folder,
        model,
        torch.optim.AdamW(model.parameters()),
        {"lr": 0.1},
        lambda m: m(batch).float().square().mean().item(),
        keep=2,
        world=World(rank=0, local_rank=0, size=processes),
        device=torch.device("cpu"),
    )


def as_rank_0_of(processes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment torchrun gives rank 0 of `processes` (1: none), as `resume_folder` reads it."""
    for name, value in (("WORLD_SIZE", str(processes)), ("RANK", "0")):
        if processes > 1:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)


def test_another_process_count_trains_in_its_own_folder_and_leaves_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    as_rank_0_of(2, monkeypatch)
    with pytest.raises(RuntimeError), resume_folder("pretrain", {"lr": 0.1}) as two:
        as_rank_0_of(1, monkeypatch)  # the folder is chosen; this test's saves need no process group
        saver = checkpointer(two, processes=2)
        saver.save(Progress(steps=20))
        saver.wait()
        raise RuntimeError("killed after its step-20 checkpoint")
    assert two.name.endswith("-2procs")

    with resume_folder("pretrain", {"lr": 0.1}) as one:  # the mistaken relaunch as one process
        assert one != two and one.name == two.name.removesuffix("-2procs")
        assert checkpointer(one, processes=1).resume() is None  # its own folder: it trains afresh
    note = capsys.readouterr().err
    assert f"{two} holds this run interrupted with another number of processes" in note
    assert [p.name for p in list_checkpoints(two)] == ["step-0000020"]  # still there to resume

    as_rank_0_of(2, monkeypatch)
    with resume_folder("pretrain", {"lr": 0.1}) as again:  # relaunched with 2: it resumes
        as_rank_0_of(1, monkeypatch)
        assert again == two
        assert checkpointer(again, processes=2).resume().steps == 20


def test_a_checkpoint_of_another_process_count_in_the_folder_is_refused_and_kept(tmp_path: Path) -> None:
    saver = checkpointer(tmp_path, processes=2)  # saved before the counts had folders of their own
    saver.save(Progress(steps=20))
    saver.wait()
    with pytest.raises(InputError, match=r"made by 2 processes, this run has 1: relaunch with 2") as refused:
        checkpointer(tmp_path, processes=1).resume()
    assert "\n" not in str(refused.value)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000020"]
    assert checkpointer(tmp_path, processes=2).resume().steps == 20
