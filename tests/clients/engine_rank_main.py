"""One rank of the multi-rank engine test (run as a subprocess by test_engine_distributed.py).

    python engine_rank_main.py OUT_DIR ZERO_STAGE ENGINE [FAIL_RANK [OPTIONS_JSON]]

RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the environment. Builds the worker engine
with ``build_engine`` (DeepSpeed, gloo on CPU), counts every call of the ZeRO optimizer's
gradient-reduction hook, computes the clipped sum of a fixed unit list and writes rank 0's result
(safetensors + JSON). A positive control then runs a plain ``.backward()`` to show the spy works.
OPTIONS_JSON (:func:`rank_config`): ``model`` (a ``[model]`` table: preset, path, lora_rank),
``units`` ("user": up to 4 examples each; "example": one each; "uneven": three units of one
micro-batch each), ``clip`` (the clip norm,
default 3.5), ``deepspeed`` (a DeepSpeed JSON
object written next to the results and used instead of the stage), ``apply_seed`` (after a
first task, the model built with this seed goes to the ranks as a worker sends a model version,
``clients/ranks.py``: slices of released ZeRO-3 parameters, whole tensors otherwise; then the
task is computed again on it) and ``probe_seed`` (the randomized engine's probes). At stage 3
the engine is built partitioned with weights of its own, so the reference model (seed 0) is
first sent the same way, as the coordinator's initial model version.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

# run as a script by torch's launcher, outside pytest (whose `pythonpath` puts the checkout on the
# path for test modules): the checkout root is added here so `tests.clients` imports work
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rank_config(stage_or_json: str, engine_name: str, options: dict):
    """The worker config of this test: ZeRO stage or DeepSpeed JSON, engine, the model table."""
    from tests.clients.engine_fixtures import SEQ_LEN
    from userdp.config import parse_config

    model = dict(options.get("model", {}))
    if stage_or_json.endswith(".json"):
        model["deepspeed_config"] = stage_or_json
    else:
        model["zero_stage"] = int(stage_or_json)
    return parse_config(
        {
            "data": {"seq_len": SEQ_LEN},
            "model": model,
            "strategy": {"engine": engine_name},
            "workers": {"token_budget": 64},
        }
    )


def spy_deepspeed_collectives() -> dict[str, int]:
    """Count every collective DeepSpeed issues through its communication backend, by name (the
    engine's own reduction of clipped sums calls torch.distributed directly and is not counted)."""
    from collections import Counter

    import deepspeed.comm.comm as ds_comm

    counts: Counter = Counter()
    for name in dir(ds_comm.cdb):
        if name.startswith(("all_", "reduce", "broadcast", "gather", "scatter", "send", "recv")):
            original = getattr(ds_comm.cdb, name)
            if not callable(original):
                continue

            def spy(*args, _original=original, _name=name, **kwargs):
                counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(ds_comm.cdb, name, spy)
    return counts


def spy_reduce_scatters() -> list[float]:
    """Record the squared norm of every tensor this rank hands to a reduce-scatter (ZeRO-3's
    clipped sums, clients/sharded_sums.py), in call order."""
    import torch

    inputs: list[float] = []
    original = torch.distributed.reduce_scatter_tensor

    def spy(output, tensor, *args, **kwargs):
        inputs.append(float(tensor.double().pow(2).sum()))
        return original(output, tensor, *args, **kwargs)

    torch.distributed.reduce_scatter_tensor = spy
    return inputs


def apply_version_as_a_worker(engine, version: dict) -> dict:
    """Rank 0 sends ``version`` (as the wire delivers it) to the other ranks through the ranks'
    channel and applies it; the others receive and apply what reaches them. Returns the bytes
    this rank received and the version's whole size."""
    import torch
    from userdp.clients.engine import Unit
    from userdp.clients.ranks import (
        RankChannel,
        _apply_version,
        receive_model_version,
        send_model_version,
    )
    from userdp.clients.worker_service import EngineCompute
    from userdp.proto.tensors import decode_chunks, tensors_chunks

    compute = EngineCompute(None, engine, Unit)
    channel = RankChannel(engine.device)
    wire = decode_chunks(tensors_chunks(version))
    total = sum(len(bytes(t.data)) for t in wire.values())
    if torch.distributed.get_rank() == 0:
        assert send_model_version(channel, engine.module, wire, True) is None
        compute.apply_model(wire, True)
        return {"version_bytes_received": total, "version_bytes": total}
    header, payloads = channel.receive()
    whole, slices = receive_model_version(channel, header, payloads)
    _apply_version(compute, whole, slices, True)
    got = sum(len(bytes(t.data)) for t in [*whole.values(), *slices.values()])
    standing_for = sum(len(bytes(wire[name].data)) for name in slices)
    return {
        "version_bytes_received": got,
        "version_bytes": total,
        "version_bytes_sent_as_slices": standing_for,
        "version_slice_bytes": sum(len(bytes(t.data)) for t in slices.values()),
        "version_sliced_tensors": len(slices),
    }


def reference_model(config, seed: int):
    """The worker's model as ``build_engine`` builds it, without DeepSpeed."""
    from userdp.clients.model import build_model, model_shape

    from tests.clients.engine_fixtures import byte_manifest

    return build_model(config.model, model_shape(byte_manifest(), config.data.seq_len), seed)


def rank_units(options: dict):
    import numpy as np
    from userdp.clients.engine import Unit

    from tests.clients.engine_fixtures import SEQ_LEN, random_units

    if options.get("units") == "uneven":  # one unit per micro-batch: 2 of them on one rank, 1 on
        # the other, which must run a dummy micro-batch pass to stay in step (clients/zero3.py)
        return [
            Unit(f"u{i}", [np.arange(3 + i, 3 + i + SEQ_LEN) for _ in range(2)]) for i in range(3)
        ]
    if options.get("units", "user") == "example":
        return random_units(9, seed=31, max_examples=1)
    return random_units(7, seed=31, max_examples=4)


def main(
    out_dir: str, stage_or_json: str, engine_name: str, fail_rank: int = -1, options: str = "{}"
) -> None:
    """``stage_or_json``: a ZeRO stage (``model.zero_stage``) or a DeepSpeed JSON file
    (``model.deepspeed_config``)."""
    import torch
    from safetensors.torch import save_file
    from userdp.clients import engine as engine_module
    from userdp.clients.engine import build_engine

    from tests.clients.engine_fixtures import byte_manifest

    opts = json.loads(options)
    if "deepspeed" in opts:
        stage_or_json = str(Path(out_dir) / f"ds-{os.environ['RANK']}.json")
        Path(stage_or_json).write_text(json.dumps(opts["deepspeed"]))
    config = rank_config(stage_or_json, engine_name, opts)
    built = {}
    build_model = engine_module.build_model

    def build_and_measure(*args, **kwargs):  # what a rank holds once the model is built
        module = build_model(*args, **kwargs)
        sliced = [p for p in module.parameters() if hasattr(p, "ds_tensor")]
        built["built_partitions"] = sum(p.ds_tensor.numel() for p in sliced)
        built["built_partitioned_elements"] = sum(p.ds_numel for p in sliced)
        built["built_whole_elements"] = sum(
            p.numel() for p in module.parameters() if not hasattr(p, "ds_tensor")
        )
        return module

    engine_module.build_model = build_and_measure
    engine = build_engine(config, byte_manifest())
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()  # the partitioned build did not leak past the engine
    zero_stage = engine.deepspeed_engine.zero_optimization_stage()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    reductions = []
    optimizer = engine.deepspeed_engine.optimizer
    ds_collectives = spy_deepspeed_collectives()
    if zero_stage == 3:  # parameter partitioning only: no optimizer, so no gradient hooks
        assert type(optimizer).__name__ == "DeepSpeedZeRoOffload", type(optimizer)
        assert not hasattr(optimizer, "reduce_ready_partitions_and_remove_grads")
    elif zero_stage > 0:
        original = optimizer.process_gradients

        def spy(param, i):
            reductions.append(i)
            return original(param, i)

        optimizer.process_gradients = spy
    units = rank_units(opts)
    clip = float(opts.get("clip", 3.5))
    if rank == fail_rank:  # the failure test: this rank's local compute raises

        def broken(*args, **kwargs):
            raise RuntimeError(f"injected failure on rank {rank}")

        engine_module.CLIPPED_SUMS.update(dict.fromkeys(engine_module.CLIPPED_SUMS, broken))
    received = {}
    if "apply_seed" in opts:  # a model version after a first task (which leaves DeepSpeed's
        # persistent parameters gathered), applied the way a worker's ranks apply one
        engine.clipped_sum(units, clip)
        version = reference_model(config, int(opts["apply_seed"])).named_parameters()
        received = apply_version_as_a_worker(engine, {n: p.detach() for n, p in version})
    elif zero_stage == 3:  # built partitioned, with weights of its own: the coordinator's
        # initial model version (the reference's) replaces them, as in a run
        version = reference_model(config, 0).named_parameters()
        received = apply_version_as_a_worker(engine, {n: p.detach() for n, p in version})
    before = dict(ds_collectives)
    scattered = spy_reduce_scatters()
    seeded = {"probe_seed": int(opts["probe_seed"])} if "probe_seed" in opts else {}
    result = engine.clipped_sum(units, clip, **seeded)
    during = len(reductions)
    collectives_during = {
        name: count - before.get(name, 0)
        for name, count in ds_collectives.items()
        if count > before.get(name, 0)
    }
    grads_untouched = all(p.grad is None for p in engine.module.parameters())
    if 0 < zero_stage < 3:  # positive control: an ordinary backward does reach ZeRO's hooks
        ids = torch.as_tensor(units[0].examples[0], dtype=torch.long)[None]
        engine.deepspeed_engine.backward(engine.module(input_ids=ids, labels=ids).loss)
    out = Path(out_dir)
    stats = {**asdict(result.stats), "skipped_examples": result.skipped_examples}
    stats.update(
        rank=rank,
        world=world,
        reductions_during_clipped_sum=during,
        deepspeed_collectives_during_clipped_sum=collectives_during,
        deepspeed_collectives_in_all=dict(ds_collectives),
        reductions_after_plain_backward=len(reductions),
        grads_untouched=grads_untouched,
        zero_stage=zero_stage,
        micro_batch=engine.deepspeed_engine.train_micro_batch_size_per_gpu(),
        has_lr_scheduler=engine.deepspeed_engine.lr_scheduler is not None,
        partition_elements=sum(
            p.ds_tensor.numel() for p in engine.module.parameters() if hasattr(p, "ds_tensor")
        ),
        model_elements=sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
        trainable_parameters=len(engine.params),
        **built,
        **received,
        reduce_scatter_squared_norms=scattered,
    )
    (out / f"stats-{rank}.json").write_text(json.dumps(stats))
    save_file({k: v.contiguous() for k, v in result.sums.items()}, str(out / f"sums-{rank}.st"))
    if world > 1:  # leave together: a rank exiting mid-teardown can make gloo abort another
        from userdp.clients.ranks import leave_process_group

        leave_process_group()


if __name__ == "__main__":
    faulthandler.enable()  # a native abort prints every thread's Python stack
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]), *sys.argv[5:6])
    # the results are written and the ranks left together: exit without interpreter finalization,
    # whose teardown of native threads' leftovers can abort a process that did all its work
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
