"""Checkpoints: nested state round-trips without pickle; writes are atomic."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from userdp.server.checkpoint import CheckpointError, load_latest, save_checkpoint


def test_nested_state_round_trip(tmp_path):
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
    optimizer.step()
    state = {
        "params": {"w": torch.arange(4.0)},
        "optimizer": optimizer.state_dict(),  # int keys, tuples (betas), tensors
        "strategy": {"buffer": np.arange(3.0), "steps": [1, 2], "name": "blt", "x": None},
    }
    save_checkpoint(tmp_path, step=5, model_version=6, ledger_entries=5, state=state)
    ckpt = load_latest(tmp_path)
    assert (ckpt.step, ckpt.model_version, ckpt.ledger_entries) == (5, 6, 5)
    assert torch.equal(ckpt.state["params"]["w"], torch.arange(4.0))
    restored = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    restored.load_state_dict(ckpt.state["optimizer"])
    assert restored.state_dict()["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(
        restored.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    np.testing.assert_array_equal(ckpt.state["strategy"]["buffer"], np.arange(3.0))
    assert ckpt.state["strategy"]["steps"] == [1, 2] and ckpt.state["strategy"]["x"] is None
    assert not any(p.suffix == ".pkl" for p in tmp_path.rglob("*"))


def test_latest_points_to_newest_and_old_ones_are_pruned(tmp_path):
    for step in range(4):
        save_checkpoint(
            tmp_path,
            step=step,
            model_version=step,
            ledger_entries=step,
            state={"p": {"w": torch.full((2,), float(step))}},
            keep=2,
        )
    assert load_latest(tmp_path).step == 3
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000000002", "ckpt-000000003"]


def test_half_written_checkpoint_is_invisible(tmp_path):
    save_checkpoint(tmp_path, step=1, model_version=1, ledger_entries=1, state={"a": 1})
    (tmp_path / ".tmp-ckpt-000000002-dead").mkdir()  # a crash mid-write leaves only this
    assert load_latest(tmp_path).step == 1
    assert load_latest(tmp_path / "nothing") is None


def test_unknown_format_version_refused(tmp_path):
    path = save_checkpoint(tmp_path, step=1, model_version=1, ledger_entries=1, state={})
    meta = json.loads((path / "state.json").read_text())
    meta["format_version"] = 99
    (path / "state.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format"):
        load_latest(tmp_path)
