"""Multi-rank inside one worker: DeepSpeed (gloo on CPU) around the model, ranks split the units
(never a unit), per-unit gradients bypass ZeRO's reduction hooks, the clipped sums and statistics
are all-reduced; the result equals the single-process ``loop`` engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from userdp.clients.distributed import free_port, split_units
from userdp.clients.engine import ClippingEngine

from tests.clients.engine_fixtures import assert_sums_close, random_units, tiny_model

RANK_MAIN = Path(__file__).with_name("engine_rank_main.py")


def start_ranks(
    tmp_path: Path,
    world: int,
    zero_stage: int | Path,
    engine: str,
    fail_rank: int = -1,
    options: dict | None = None,
) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(RANK_MAIN),
                    str(tmp_path),
                    str(zero_stage),
                    engine,
                    str(fail_rank),
                    json.dumps(options or {}),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def run_ranks(
    tmp_path: Path, world: int, zero_stage: int | Path, engine: str, options: dict | None = None
) -> list[dict]:
    for proc in start_ranks(tmp_path, world, zero_stage, engine, options=options):
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-4000:]
    return [json.loads((tmp_path / f"stats-{r}.json").read_text()) for r in range(world)]


def test_one_rank_failing_fails_every_rank_instead_of_hanging(tmp_path):
    """Rank 1's compute raises: rank 1 re-raises its error, rank 0 raises an EngineError saying
    another rank failed, and neither blocks in the result all-reduce (the timeout would fire)."""
    outputs = []
    for proc in start_ranks(tmp_path, 2, 0, "vectorized", fail_rank=1):
        output, _ = proc.communicate(timeout=300)
        outputs.append((proc.returncode, output))
    (rc0, out0), (rc1, out1) = outputs
    assert rc0 != 0 and "another rank of this worker failed" in out0, out0[-2000:]
    assert rc1 != 0 and "injected failure on rank 1" in out1, out1[-2000:]
    assert not list(tmp_path.glob("stats-*.json"))


def single_process_loop():
    units = random_units(7, seed=31, max_examples=4)
    return ClippingEngine(tiny_model(seed=0), engine="loop").clipped_sum(units, 3.5)


def check_against_loop(tmp_path: Path, stats: list[dict], world: int) -> None:
    reference = single_process_loop()
    assert 0 < reference.stats.clipped < 7
    for rank, rank_stats in enumerate(stats):
        assert rank_stats["world"] == world
        assert_sums_close(load_file(str(tmp_path / f"sums-{rank}.st")), reference.sums, rtol=2e-5)
        for key in ("count", "nonfinite", "clipped", "tokens"):
            assert rank_stats[key] == getattr(reference.stats, key), key
        for key in ("norm_min", "norm_max", "norm_sum", "norm_sum_sq", "loss_sum"):
            assert rank_stats[key] == pytest.approx(getattr(reference.stats, key), rel=1e-5), key
        assert rank_stats["grads_untouched"]


def test_split_units_is_balanced_deterministic_and_never_splits_a_unit():
    costs = [50, 10, 10, 30, 5, 45]
    shares = split_units(costs, 2)
    assert sorted(i for share in shares for i in share) == list(range(6))
    loads = [sum(costs[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(costs)
    assert shares == split_units(costs, 2)
    assert split_units(costs, 1) == [list(range(6))]


def test_two_ranks_zero2_vectorized_equal_single_process_loop(tmp_path):
    stats = run_ranks(tmp_path, 2, zero_stage=2, engine="vectorized")
    check_against_loop(tmp_path, stats, 2)
    for rank_stats in stats:
        assert rank_stats["reductions_during_clipped_sum"] == 0
        assert rank_stats["reductions_after_plain_backward"] > 0  # the spy does see reductions


def test_two_ranks_from_a_deepspeed_json_equal_single_process_loop(tmp_path):
    """A DeepSpeed user's own JSON (ZeRO-2 with an optimizer, scheduler and batch sizes of its
    own): the stage is taken, the keys userdp controls are overridden, and the clipped sum is
    still the single-process loop engine's, with no reduction of unclipped gradients."""
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(
        json.dumps(
            {
                "train_batch_size": 64,
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 4,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
                "zero_optimization": {"stage": 2, "overlap_comm": False},
                "gradient_clipping": 1.0,
            }
        )
    )
    stats = run_ranks(tmp_path, 2, ds_json, engine="vectorized")
    check_against_loop(tmp_path, stats, 2)
    for rank_stats in stats:
        assert rank_stats["zero_stage"] == 2
        assert rank_stats["micro_batch"] == 1
        assert not rank_stats["has_lr_scheduler"]
        assert rank_stats["reductions_during_clipped_sum"] == 0
        assert rank_stats["reductions_after_plain_backward"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(("zero_stage", "engine"), [(0, "loop"), (1, "vectorized"), (2, "loop")])
def test_two_ranks_other_stages_and_engines(tmp_path, zero_stage, engine):
    stats = run_ranks(tmp_path, 2, zero_stage=zero_stage, engine=engine)
    check_against_loop(tmp_path, stats, 2)
    if zero_stage:
        assert all(s["reductions_during_clipped_sum"] == 0 for s in stats)


def test_deepspeed_json_overrides_are_named() -> None:
    from userdp.clients.distributed import deepspeed_config

    user = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW"},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e7},
        "wall_clock_breakdown": True,
    }
    config, notes = deepspeed_config(0, False, user)
    assert config["train_micro_batch_size_per_gpu"] == 1 and "optimizer" not in config
    assert config["bf16"] == {"enabled": False}
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 5e7}
    assert config["wall_clock_breakdown"] is True  # everything else passes through
    assert notes == [
        "train_micro_batch_size_per_gpu=8 -> 1",
        "optimizer removed",
        "bf16.enabled=True -> False (model.dtype decides)",
    ]
    assert deepspeed_config(2, True)[0]["zero_optimization"] == {"stage": 2}
    assert user["optimizer"] == {"type": "AdamW"}  # the caller's dict is left as it was
