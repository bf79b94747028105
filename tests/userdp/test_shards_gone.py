"""A shard folder deleted or moved during a run: the worker refuses to read from it and the
coordinator stops the run with one line naming it, before the step under way releases anything;
put back, the same command resumes."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
from userdp.clients.shard_format import ShardsGoneError
from userdp.clients.shard_store import ShardStore, check_present
from userdp.server.fleet import Fleet
from userdp.server.release_journal import read_release_records

from tests.server.harness import make_loopback
from userdp import cli
from userdp.config import parse_config
from userdp.run.components import demo_shards
from userdp.run.outputs import config_toml


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """A copy of the demo shards that a test may move away (the cached ones are shared)."""
    return Path(shutil.copytree(demo_shards(40), tmp_path / "shards"))


def test_a_store_refuses_to_read_once_its_folder_is_moved(shards: Path) -> None:
    store = ShardStore(shards)
    first, other = (store.shard_users(name)[0] for name in store.shard_names[:2])
    assert store.user_examples(first)  # its shard is now memory-mapped
    shards.rename(shards.with_name("elsewhere"))
    for user in (first, other):  # open or not, a read names the folder
        with pytest.raises(ShardsGoneError) as raised:
            store.user_examples(user)
        assert str(raised.value).startswith(
            f"the shards folder {shards} was deleted or moved during the run ("
        )
        assert str(raised.value).endswith("put it back, then run the same command to resume")
    store.close()


def test_the_coordinator_stops_before_a_step_once_the_shards_folder_is_gone(shards, tmp_path):
    """The coordinator's check (the shard folder's files) runs as each step starts: moved away
    after step 1, the run stops with :class:`ShardsGoneError` before step 2 is charged or
    released; put back, the run goes on (real gRPC, toy workers)."""
    manifest = ShardStore(shards).manifest
    check = functools.partial(check_present, shards, manifest.shards)
    loop = make_loopback(tmp_path, data_check=check)
    try:
        loop.add_worker("w0", ["shard-00000", "shard-00001", "shard-00002", "shard-00003"])
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(2)
        shards.rename(tmp_path / "away")
        with pytest.raises(ShardsGoneError, match=f"the shards folder {shards} was deleted"):
            loop.coordinator.run(4)
        assert [r["step"] for r in loop.coordinator.ledger.records] == [0, 1]
        assert [r["step"] for r in read_release_records(tmp_path / "ckpt")] == [0, 1]
        (tmp_path / "away").rename(shards)
        loop.coordinator.run(4)
        assert [r["step"] for r in loop.coordinator.ledger.records] == [0, 1, 2, 3]
    finally:
        loop.close()


def _ledger_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "ledger.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if '"step"' in line]


@pytest.mark.slow
def test_simulate_stops_in_one_line_when_its_shards_folder_vanishes_mid_step(
    shards: Path, tmp_path: Path, capfd, monkeypatch
) -> None:
    """The folder is moved away as step 2 starts gathering: the workers' tasks fail on their
    reads and the coordinator's check stops the run. Steps 0 and 1 are charged and released,
    nothing of step 2 is; with the folder back, the same command runs steps 2 and 3."""
    run_dir, away = tmp_path / "run", tmp_path / "away"
    config = parse_config(
        {
            "data": {"shards": str(shards), "seq_len": 32, "eval_fraction": 0.1},
            "model": {"preset": "gpt2-tiny"},
            "strategy": {"steps": 4, "sampling_prob": 0.25, "group_size": 2, "engine": "loop"},
            "privacy": {"epsilon": 20.0},
            "coordinator": {"step_deadline_s": 300.0},
            "output": {"dir": str(run_dir), "seed": 0, "plots": False},
        }
    )
    path = tmp_path / "run.toml"
    path.write_text(config_toml(config))
    gather = Fleet.gather

    def gather_moving_the_shards_at_step_2(fleet, collect, spec):
        if collect.step == 2 and shards.exists():
            shards.rename(away)
        return gather(fleet, collect, spec)

    monkeypatch.setattr(Fleet, "gather", gather_moving_the_shards_at_step_2)
    assert cli.main(["simulate", "--config", str(path)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"userdp simulate: error: the shards folder {shards} was deleted or moved during the run "
        "(manifest.json is gone): put it back, then run the same command to resume"
    )
    assert not any("Traceback" in line for line in err), err
    assert _ledger_steps(run_dir) == [0, 1]  # nothing of step 2 was charged
    journal = read_release_records(run_dir / "checkpoints")
    assert [r["step"] for r in journal] == [0, 1]  # ... or released
    away.rename(shards)
    monkeypatch.setattr(Fleet, "gather", gather)
    assert cli.main(["simulate", "--config", str(path)]) == 0
    assert _ledger_steps(run_dir) == [0, 1, 2, 3]
    assert [r["step"] for r in read_release_records(run_dir / "checkpoints")] == [0, 1, 2, 3]
