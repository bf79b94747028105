"""One rank of the multi-rank engine test (run as a subprocess by test_engine_distributed.py).

    python engine_rank_main.py OUT_DIR ZERO_STAGE ENGINE [FAIL_RANK]

RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the environment. Builds the worker engine
with ``build_engine`` (DeepSpeed, gloo on CPU), counts every call of the ZeRO optimizer's
gradient-reduction hook, computes the clipped sum of a fixed unit list and writes rank 0's result
(safetensors + JSON). A positive control then runs a plain ``.backward()`` to show the spy works.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

# run as a script by torch's launcher, outside pytest (whose `pythonpath` puts the checkout on the
# path for test modules): the checkout root is added here so `tests.clients` imports work
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(out_dir: str, stage_or_json: str, engine_name: str, fail_rank: int = -1) -> None:
    """``stage_or_json``: a ZeRO stage (``model.zero_stage``) or a DeepSpeed JSON file
    (``model.deepspeed_config``)."""
    import torch
    from safetensors.torch import save_file
    from userdp.clients import engine as engine_module
    from userdp.clients.engine import build_engine

    from tests.clients.engine_fixtures import SEQ_LEN, byte_manifest, random_units
    from userdp.config import parse_config

    config = parse_config(
        {
            "data": {"seq_len": SEQ_LEN},
            "model": (
                {"deepspeed_config": stage_or_json}
                if stage_or_json.endswith(".json")
                else {"zero_stage": int(stage_or_json)}
            ),
            "strategy": {"engine": engine_name},
            "workers": {"token_budget": 64},
        }
    )
    engine = build_engine(config, byte_manifest())
    zero_stage = engine.deepspeed_engine.zero_optimization_stage()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    reductions = []
    optimizer = engine.deepspeed_engine.optimizer
    if zero_stage > 0:
        original = optimizer.process_gradients

        def spy(param, i):
            reductions.append(i)
            return original(param, i)

        optimizer.process_gradients = spy
    units = random_units(7, seed=31, max_examples=4)
    if rank == fail_rank:  # the failure test: this rank's local compute raises

        def broken(*args, **kwargs):
            raise RuntimeError(f"injected failure on rank {rank}")

        engine_module.loop_clipped_sum = engine_module.vectorized_clipped_sum = broken
    result = engine.clipped_sum(units, 3.5)
    during = len(reductions)
    grads_untouched = all(p.grad is None for p in engine.module.parameters())
    if zero_stage > 0:  # positive control: an ordinary backward does reach ZeRO's hooks
        ids = torch.as_tensor(units[0].examples[0], dtype=torch.long)[None]
        engine.deepspeed_engine.backward(engine.module(input_ids=ids, labels=ids).loss)
    out = Path(out_dir)
    stats = {**asdict(result.stats), "skipped_examples": result.skipped_examples}
    stats.update(
        rank=rank,
        world=world,
        reductions_during_clipped_sum=during,
        reductions_after_plain_backward=len(reductions),
        grads_untouched=grads_untouched,
        zero_stage=zero_stage,
        micro_batch=engine.deepspeed_engine.train_micro_batch_size_per_gpu(),
        has_lr_scheduler=engine.deepspeed_engine.lr_scheduler is not None,
    )
    (out / f"stats-{rank}.json").write_text(json.dumps(stats))
    save_file({k: v.contiguous() for k, v in result.sums.items()}, str(out / f"sums-{rank}.st"))
    if world > 1:  # leave together: a rank exiting mid-teardown can make gloo abort another
        from userdp.clients.ranks import leave_process_group

        leave_process_group()


if __name__ == "__main__":
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]))
