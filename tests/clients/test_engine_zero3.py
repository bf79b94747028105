"""ZeRO-3 workers: two gloo ranks with partitioned parameters give the single-process ``loop``
engine's clipped sum, for GPT-2-, Llama- and Qwen2-style models, full fine-tuning and LoRA, per
user and per example; DeepSpeed reduces nothing during a clipped sum (it only gathers
parameters) and what the ranks reduce-scatter is clipped, pass by pass; a model version is applied to each rank's partition only; settings a ZeRO-3 worker
cannot honour are refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from userdp.clients.engine import ClippingEngine

from tests.clients.engine_fixtures import assert_sums_close
from tests.clients.engine_rank_main import rank_config, rank_units, reference_model
from tests.clients.hf_families import family_model
from tests.clients.test_engine_distributed import run_ranks

RELEASE_AFTER_USE = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
"""DeepSpeed keeps parameters under 10⁵ elements (all of a tiny model's) gathered once fetched;
a threshold of 0 releases every parameter after each use, as a large model's are."""


def qwen2_folder(tmp_path: Path) -> str:
    folder = tmp_path / "qwen2"
    family_model("qwen2").save_pretrained(folder)
    return str(folder)


def check_zero3_against_loop(tmp_path: Path, engine: str, options: dict) -> list[dict]:
    stats = run_ranks(tmp_path, 2, 3, engine, options)
    config = rank_config("3", "loop", options)
    seed = int(options.get("apply_seed", 0))
    units = rank_units(options)
    reference = ClippingEngine(
        reference_model(config, seed), engine="loop", token_budget=64
    ).clipped_sum(units, float(options.get("clip", 3.5)))
    assert reference.stats.count == len(units) and reference.stats.clipped > 0
    # the sums reach rank 0, which sends them; the other rank returns statistics only
    assert_sums_close(load_file(str(tmp_path / "sums-0.st")), reference.sums, rtol=1e-5)
    assert not load_file(str(tmp_path / "sums-1.st"))
    # the clipped sums were reduce-scattered pass by pass: every rank made the same number of
    # reduce-scatters, one per trainable parameter per round
    calls = [len(rank_stats["reduce_scatter_squared_norms"]) for rank_stats in stats]
    assert calls[0] == calls[1] > 0 and calls[0] % stats[0]["trainable_parameters"] == 0, calls
    for rank_stats in stats:
        assert rank_stats["world"] == 2 and rank_stats["zero_stage"] == 3
        assert max(round_norms(rank_stats)) <= float(options.get("clip", 3.5)) * len(units) * (
            1 + 1e-5
        )
        for key in ("count", "nonfinite", "clipped", "tokens"):
            assert rank_stats[key] == getattr(reference.stats, key), key
        for key in ("norm_min", "norm_max", "norm_sum", "norm_sum_sq", "loss_sum"):
            assert rank_stats[key] == pytest.approx(getattr(reference.stats, key), rel=1e-5), key
        # no unclipped gradient crossed ranks: the stage-3 worker has no gradient hooks (no
        # optimizer), and during the clipped sum DeepSpeed issued no reduction of any kind
        # (the spy does see its traffic: it counted the parameter gathers of the run; with
        # parameters released after use, also during the clipped sum)
        collectives = rank_stats["deepspeed_collectives_during_clipped_sum"]
        assert not [name for name in collectives if "reduce" in name], collectives
        assert rank_stats["deepspeed_collectives_in_all"].get("all_gather_into_tensor", 0) > 0
        if options.get("deepspeed") == RELEASE_AFTER_USE:
            assert collectives.get("all_gather_into_tensor", 0) > 0, collectives
        assert rank_stats["grads_untouched"]
        # each rank holds half of every parameter (padded to an even length), and did from the
        # moment the model was built (LoRA's adapters are partitioned later, by DeepSpeed)
        assert rank_stats["partition_elements"] * 2 >= rank_stats["model_elements"]
        assert rank_stats["partition_elements"] * 2 <= rank_stats["model_elements"] + 2 * 64
        built = rank_stats["built_partitions"] * 2
        assert rank_stats["built_partitioned_elements"] <= built
        assert built <= rank_stats["built_partitioned_elements"] + 2 * 64
        # LoRA's adapters are created after the partitioned build; with offload_param one GPT-2
        # tensor (8,192 of 126,400 elements) comes out of zero.Init whole and is partitioned by
        # deepspeed.initialize
        whole = rank_stats["built_whole_elements"]
        offloaded = "offload_param" in json.dumps(options.get("deepspeed", {}))
        if "lora_rank" in options["model"] or offloaded:
            assert whole < 0.1 * rank_stats["model_elements"]
        else:
            assert whole == 0
    return stats


def round_norms(rank_stats: dict) -> list[float]:
    """The norm of what a rank handed to the reduce-scatters of each round (one pass's adds)."""
    squared = rank_stats["reduce_scatter_squared_norms"]
    size = rank_stats["trainable_parameters"]
    return [math.sqrt(sum(squared[i : i + size])) for i in range(0, len(squared), size)]


@pytest.mark.parametrize("engine", ["vectorized", "loop"])
def test_only_clipped_sums_cross_ranks(tmp_path, engine):
    """With a clip norm far below every unit's gradient norm, one unclipped unit in a round would
    push that round's reduce-scatter inputs past C·(units); each round stays within it."""
    clip = 0.01
    options = {"model": {"preset": "gpt2-tiny"}, "units": "user", "clip": clip}
    options["deepspeed"] = RELEASE_AFTER_USE
    units = rank_units(options)
    reference = ClippingEngine(
        reference_model(rank_config("3", "loop", options), 0), engine="loop", token_budget=64
    ).clipped_sum(units, clip)
    # the check is sharp: one unclipped unit exceeds the bound even against all the others
    assert reference.stats.norm_min > 2 * len(units) * clip
    stats = check_zero3_against_loop(tmp_path, engine, options)
    assert all(len(round_norms(rank_stats)) > 1 for rank_stats in stats)


@pytest.mark.parametrize(
    ("engine", "model", "units", "deepspeed"),
    [
        ("vectorized", {"preset": "gpt2-tiny"}, "user", None),
        ("vectorized", {"preset": "llama-tiny", "lora_rank": 4}, "example", RELEASE_AFTER_USE),
        ("loop", {"preset": "llama-tiny"}, "user", RELEASE_AFTER_USE),
        ("vectorized", {"preset": "gpt2-tiny"}, "uneven", RELEASE_AFTER_USE),
        pytest.param(
            "vectorized",
            {"preset": "gpt2-tiny", "lora_rank": 4},
            "user",
            RELEASE_AFTER_USE,
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "vectorized", {"preset": "llama-tiny"}, "example", None, marks=pytest.mark.slow
        ),
        pytest.param("loop", {"preset": "gpt2-tiny"}, "example", None, marks=pytest.mark.slow),
        pytest.param(  # parameter partitions in host memory (on CPU ranks: where they were)
            "vectorized",
            {"preset": "gpt2-tiny"},
            "user",
            {
                "zero_optimization": {
                    **RELEASE_AFTER_USE["zero_optimization"],
                    "offload_param": {"device": "cpu"},
                }
            },
            marks=pytest.mark.slow,
        ),
    ],
)
def test_two_zero3_ranks_equal_the_single_process_loop(tmp_path, engine, model, units, deepspeed):
    # LoRA's B starts at zero, so its gradients are small: a smaller clip norm clips some units
    options = {"model": model, "units": units, "clip": 0.5 if model.get("lora_rank") else 3.5}
    if deepspeed is not None:
        options["deepspeed"] = deepspeed
    check_zero3_against_loop(tmp_path, engine, options)


@pytest.mark.parametrize(
    ("units", "lora"),
    [
        ("user", False),
        pytest.param("example", False, marks=pytest.mark.slow),
        pytest.param("user", True, marks=pytest.mark.slow),
    ],
)
def test_qwen2_folder_on_zero3_after_a_model_version(tmp_path, units, lora):
    """A user's own Qwen2-style folder (tied embeddings, RMSNorm, biased attention; full
    fine-tuning, and LoRA on the partitioned base model), parameters
    released after each use; after a first task the ranks apply a new model version to their
    partitions, and the next task is computed on exactly that model."""
    options = {
        "model": {"path": qwen2_folder(tmp_path), **({"lora_rank": 4} if lora else {})},
        "units": units,
        "deepspeed": RELEASE_AFTER_USE,
        "apply_seed": 7,
        "clip": 0.2 if lora else 1.0,  # LoRA norms here: 0.13-0.41
    }
    stats = check_zero3_against_loop(tmp_path, "vectorized", options)
    # the parameters DeepSpeed had released (most of the model) reached rank 1 as its half only
    mine = stats[1]
    sliced, received = mine["version_bytes_sent_as_slices"], mine["version_slice_bytes"]
    assert sliced > mine["version_bytes"] / 2
    assert sliced / 2 <= received <= sliced / 2 + 4 * mine["version_sliced_tensors"]
    assert mine["version_bytes_received"] == mine["version_bytes"] - sliced + received


def test_randomized_engine_on_zero3_gives_its_stage_0_result(tmp_path):
    """The randomized engine (Hutchinson estimates from seeded probes) on two stage-3 ranks gives
    what the same two ranks give at stage 0 with the same probes: the estimates, clip factors and
    clipped sums do not depend on where the weights live."""
    options = {"model": {"preset": "gpt2-tiny"}, "units": "user", "probe_seed": 3, "clip": 1.0}
    (tmp_path / "zero").mkdir()
    (tmp_path / "three").mkdir()
    zero = run_ranks(tmp_path / "zero", 2, 0, "randomized", options)
    three = run_ranks(
        tmp_path / "three", 2, 3, "randomized", {**options, "deepspeed": RELEASE_AFTER_USE}
    )
    expected = load_file(str(tmp_path / "zero" / "sums-0.st"))
    assert_sums_close(load_file(str(tmp_path / "three" / "sums-0.st")), expected, rtol=1e-5)
    assert zero[0]["clipped"] == three[0]["clipped"] > 0
    for key in ("count", "tokens", "nonfinite"):
        assert zero[0][key] == three[0][key], key
    for key in ("norm_min", "norm_max", "norm_sum", "loss_sum"):
        assert three[0][key] == pytest.approx(zero[0][key], rel=1e-5), key


def test_one_rank_with_parameters_offloaded_builds_partitioned_and_equals_the_loop(tmp_path):
    """One device with ``offload_param``: the model is built partitioned (into host memory on a
    GPU), a model version reaches the partitions, and the clipped sum is the loop engine's."""
    offload = {
        "zero_optimization": {
            **RELEASE_AFTER_USE["zero_optimization"],
            "offload_param": {"device": "cpu"},
        }
    }
    options = {"model": {"preset": "llama-tiny"}, "units": "user", "deepspeed": offload}
    (stats,) = run_ranks(tmp_path, 1, 3, "vectorized", options)
    config = rank_config("3", "loop", options)
    reference = ClippingEngine(
        reference_model(config, 0), engine="loop", token_budget=64
    ).clipped_sum(rank_units(options), 3.5)
    assert_sums_close(load_file(str(tmp_path / "sums-0.st")), reference.sums, rtol=1e-5)
    assert stats["zero_stage"] == 3 and stats["world"] == 1
    assert stats["built_partitioned_elements"] == stats["model_elements"]
    assert stats["built_whole_elements"] == 0
    assert stats["count"] == reference.stats.count and stats["clipped"] == reference.stats.clipped


def test_offloaded_partitions_keep_the_clipped_sums_in_host_memory():
    """TEST DOUBLE of a ZeRO-3 parameter (a placeholder on another device than its partition, as
    on a GPU with ``offload_param``): the accumulator goes where the partitions are, and an add
    from the placeholders' device lands there."""
    from userdp.clients.clipping import Accumulator
    from userdp.clients.zero3 import offload_device

    placeholder = torch.nn.Parameter(torch.empty(0, device="meta"))
    placeholder.ds_tensor, placeholder.ds_numel = torch.zeros(2), 4
    placeholder.ds_shape = torch.Size([2, 2])
    params = {"w": placeholder}
    assert offload_device(params) == torch.device("cpu")
    acc = Accumulator(params, 1.0, device=offload_device(params))
    assert acc.flat.device.type == "cpu" and acc.flat.numel() == 4
    acc.add("w", torch.ones(2, 2, dtype=torch.bfloat16), 0.5)
    assert acc.host_sums()["w"].tolist() == [[0.5, 0.5], [0.5, 0.5]]
    placeholder.ds_tensor = torch.zeros(2, device="meta")  # partitions on the compute device
    assert offload_device(params) is None


def test_model_version_after_persistent_gather(tmp_path):
    """DeepSpeed's default keeps small parameters gathered after their first use: a model version
    must reach that gathered copy as well as the partition, or the next task runs on the old
    weights."""
    options = {"model": {"preset": "gpt2-tiny"}, "units": "user", "apply_seed": 5}
    stats = check_zero3_against_loop(tmp_path, "vectorized", options)
    # all of a tiny model's parameters are persistent: gathered, so they were sent whole
    assert stats[1]["version_bytes_received"] == stats[1]["version_bytes"]


def test_load_partitioned_writes_only_this_ranks_slice_and_zero_padding():
    from types import SimpleNamespace

    from userdp.clients import zero3

    value = torch.arange(7, dtype=torch.float32).reshape(7, 1)
    partition = torch.full((4,), -1.0)
    partition.ds_numel = 4
    param = torch.nn.Parameter(torch.empty(0))
    param.ds_tensor, param.ds_shape, param.ds_numel = partition, torch.Size([7, 1]), 7
    param.ds_status = SimpleNamespace()  # not AVAILABLE: no gathered copy to write
    for rank, expected in [(0, [0.0, 1.0, 2.0, 3.0]), (1, [4.0, 5.0, 6.0, 0.0])]:
        original = zero3._partition_rank
        zero3._partition_rank = lambda p, r=rank: r
        try:
            zero3.load_partitioned(param, value)
        finally:
            zero3._partition_rank = original
        assert partition.tolist() == expected
    with pytest.raises(ValueError, match="shape"):
        zero3.load_partitioned(param, torch.zeros(3))


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        ({"stage": 4}, "must be 0, 1, 2 or 3"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "offload_param.device = 'nvme'"),
        ({"stage": 3, "zero_hpz_partition_size": 8}, "zero_hpz_partition_size"),
    ],
)
def test_zero3_settings_a_worker_cannot_honour_are_refused(zero, expected):
    from userdp.clients.deepspeed_config import deepspeed_json_problem

    assert expected in deepspeed_json_problem({"zero_optimization": zero})
    ok = {"stage": 3, "offload_param": {"device": "cpu"}}
    assert deepspeed_json_problem({"zero_optimization": ok}) is None
