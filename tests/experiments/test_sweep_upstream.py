"""A profile sweep's shared stages (issue 65, item 18): what the queued variants start from, put back after."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gptlab.experiments.sweep_upstream import shared_lock


def test_the_shared_stages_lock_entries_are_queued_and_the_projects_dvc_lock_put_back(tmp_path: Path) -> None:
    lock = tmp_path / "dvc.lock"
    original = b"schema: '2.0'\nstages:\n  tokenize:\n    cmd: old  # as the user left it\n  spam-finetune:\n    cmd: s\n"
    lock.write_bytes(original)
    entries = {"tokenize": {"cmd": "new"}}
    with pytest.raises(KeyboardInterrupt), shared_lock(tmp_path, entries):
        during = yaml.safe_load(lock.read_text())
        raise KeyboardInterrupt  # a stop while queuing
    assert during["stages"] == {"tokenize": {"cmd": "new"}, "spam-finetune": {"cmd": "s"}}
    assert lock.read_bytes() == original

    lock.unlink()  # none before: none after
    with shared_lock(tmp_path, entries):
        assert yaml.safe_load(lock.read_text()) == {"schema": "2.0", "stages": entries}
    assert not lock.exists()
    with shared_lock(tmp_path, {}):  # nothing ran first: nothing written
        assert not lock.exists()
