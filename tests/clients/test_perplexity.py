"""Perplexity-based selection (``data.selection = "highest_ppl" | "lowest_ppl"``, Chua et al.,
"Mind the Privacy Unit! User-Level Differential Privacy for Language Model Fine-Tuning", §4.1,
§5.1) on a real tiny GPT-2 saved with ``save_pretrained`` and shards tokenized by a local
ByT5 tokenizer: the scores against an independent cross-entropy, the per-shard cache and its
invalidation, the worker's selection, and an end-to-end run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import transformers
from userdp.clients import perplexity
from userdp.clients.perplexity import example_perplexities, model_sha256, score_examples
from userdp.clients.shard_store import ShardStore

from userdp.config import ConfigError, parse_config
from userdp.shards.input import InputSource
from userdp.shards.writer import ShardOptions, write_shards

SEQ_LEN = 24
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"


def _texts(seed: int, rows: int = 48) -> tuple[list[str], list[str]]:
    """User ids and texts: repetitive and random-looking texts of 1 to 60 characters, so
    perplexities differ and some examples are longer than SEQ_LEN."""
    rng = np.random.default_rng(seed)
    users, texts = [], []
    for i in range(rows):
        users.append(f"user{i % 8}")
        n = int(rng.integers(1, 60))
        if i % 3 == 0:
            texts.append(("ab" * n)[:n])
        else:
            texts.append("".join(ALPHABET[j] for j in rng.integers(0, len(ALPHABET), n)))
    return users, texts


def _write_shards(folder: Path, tokenizer: Path, seed: int) -> Path:
    users, texts = _texts(seed)
    source = InputSource.from_table(pa.table({"user": users, "text": texts}), "user", "text", "t")
    write_shards(
        source, folder, ShardOptions(progress=False, num_shards=2, tokenizer=str(tokenizer))
    )
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ppl")
    tokenizer = transformers.ByT5Tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "model")
    shards = _write_shards(root / "shards", root / "tokenizer", seed=0)
    return {
        "root": root,
        "tokenizer": root / "tokenizer",
        "model": root / "model",
        "shards": shards,
    }


def _model(folder: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    return model.eval()


def _reference_perplexity(model: torch.nn.Module, example: np.ndarray, seq_len: int) -> float:
    """exp(mean next-token cross-entropy) of one unpadded example, computed directly."""
    tokens = torch.as_tensor(np.asarray(example)[:seq_len], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=tokens[None, :-1]).logits[0]
    return float(torch.exp(torch.nn.functional.cross_entropy(logits.float(), tokens[1:])))


def _all_examples(store: ShardStore) -> list[np.ndarray]:
    return [e for user in store.users() for e in store.user_examples(user)]


def test_scores_equal_exp_of_the_mean_cross_entropy_of_the_truncated_example(files) -> None:
    model = _model(files["model"])
    with ShardStore(files["shards"]) as store:
        examples = _all_examples(store)
    assert any(len(e) > SEQ_LEN for e in examples)
    examples.insert(3, np.array([7], dtype=np.int32))  # one token: nothing to predict
    # a small budget: many micro-batches, rows padded to different lengths
    scores = score_examples(model, examples, SEQ_LEN, token_budget=64, pad_id=0)
    for example, score in zip(examples, scores, strict=True):
        if len(example) < 2:
            assert np.isnan(score)
        else:
            assert score == pytest.approx(_reference_perplexity(model, example, SEQ_LEN), rel=1e-5)
    assert np.nanmax(scores) - np.nanmin(scores) > 10.0  # the examples are told apart
    untruncated = score_examples(model, examples, 64)
    longer = [i for i, e in enumerate(examples) if len(e) > SEQ_LEN]
    assert not np.allclose(untruncated[longer], scores[longer])  # only trained-on tokens count


def test_every_user_gets_its_examples_scores_in_input_order(files, tmp_path) -> None:
    model = _model(files["model"])
    with ShardStore(files["shards"]) as store:
        scores = example_perplexities(model, store, SEQ_LEN, cache_dir=tmp_path)
        for user in store.users():
            expected = score_examples(model, store.user_examples(user), SEQ_LEN)
            np.testing.assert_allclose(scores.of_user(user), expected, rtol=1e-6)


def _count_scoring(monkeypatch) -> list[str]:
    """The shards scored from here on (the real scoring runs; this only records its calls)."""
    scored: list[str] = []
    score_shard = perplexity._score_shard

    def recording(module, store, shard, *args):
        scored.append(shard)
        return score_shard(module, store, shard, *args)

    monkeypatch.setattr(perplexity, "_score_shard", recording)
    return scored


def test_cache_is_reused_and_a_new_model_shard_or_seq_len_is_scored_again(
    files, tmp_path, monkeypatch
) -> None:
    shards = _write_shards(tmp_path / "shards", files["tokenizer"], seed=1)
    cache = tmp_path / "cache"
    model = _model(files["model"])
    scored = _count_scoring(monkeypatch)
    store = ShardStore(shards)
    first = example_perplexities(model, store, SEQ_LEN, cache_dir=cache)
    assert sorted(scored) == sorted(store.shard_names)
    assert len(list(cache.glob("perplexity-*.safetensors"))) == 2

    scored.clear()
    again = example_perplexities(_model(files["model"]), store, SEQ_LEN, cache_dir=cache)
    assert scored == []  # the same weights from the same folder: read from the cache
    for name in store.shard_names:
        np.testing.assert_array_equal(again.by_shard[name], first.by_shard[name])

    with torch.no_grad():  # another model: one weight moved
        model.transformer.h[0].mlp.c_fc.weight[0, 0] += 0.5
    changed = example_perplexities(model, store, SEQ_LEN, cache_dir=cache)
    assert sorted(scored) == sorted(store.shard_names)
    assert any(
        not np.allclose(changed.by_shard[n], first.by_shard[n], equal_nan=True)
        for n in store.shard_names
    )

    scored.clear()
    example_perplexities(model, store, SEQ_LEN - 4, cache_dir=cache)
    assert sorted(scored) == sorted(store.shard_names)
    store.close()

    shutil.rmtree(shards)  # the same shard names with other contents (other sha256)
    _write_shards(shards, files["tokenizer"], seed=2)
    scored.clear()
    with ShardStore(shards) as rewritten:
        fresh = example_perplexities(model, rewritten, SEQ_LEN, cache_dir=cache)
        assert sorted(scored) == sorted(rewritten.shard_names)
        user = rewritten.users()[0]
        expected = score_examples(model, rewritten.user_examples(user), SEQ_LEN)
        np.testing.assert_allclose(fresh.of_user(user), expected, rtol=1e-6)


def test_a_corrupt_cache_file_is_scored_again_and_replaced(files, tmp_path, monkeypatch) -> None:
    model = _model(files["model"])
    with ShardStore(files["shards"]) as store:
        first = example_perplexities(model, store, SEQ_LEN, cache_dir=tmp_path)
        victim = sorted(tmp_path.glob("perplexity-*.safetensors"))[0]
        victim.write_bytes(b"not a safetensors file")
        scored = _count_scoring(monkeypatch)
        again = example_perplexities(model, store, SEQ_LEN, cache_dir=tmp_path)
        assert len(scored) == 1
        for name in store.shard_names:
            np.testing.assert_array_equal(again.by_shard[name], first.by_shard[name])
        scored.clear()
        example_perplexities(model, store, SEQ_LEN, cache_dir=tmp_path)
        assert scored == []


def test_default_cache_is_in_the_shard_folder_and_an_unwritable_one_only_warns(
    files, tmp_path, caplog
) -> None:
    shards = _write_shards(tmp_path / "shards", files["tokenizer"], seed=3)
    model = _model(files["model"])
    with ShardStore(shards) as store:
        example_perplexities(model, store, SEQ_LEN)
        assert len(list((shards / "cache").glob("perplexity-*.safetensors"))) == 2
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        scores = example_perplexities(model, store, SEQ_LEN, cache_dir=blocker / "cache")
        assert "workers.cache_dir" in caplog.text
        user = store.users()[0]
        assert len(scores.of_user(user)) == len(store.user_examples(user))


def test_model_hash_follows_the_weights_not_the_folder(files, tmp_path) -> None:
    model = _model(files["model"])
    model.save_pretrained(tmp_path / "copy")
    assert model_sha256(_model(tmp_path / "copy")) == model_sha256(model)
    with torch.no_grad():
        model.lm_head.weight[3, 1] += 1e-3
    assert model_sha256(_model(files["model"])) != model_sha256(model)


def _broadcast_rank(rank: int, world_size: int, port: int, shards: str, out: str) -> None:
    """One rank of a gloo group: its own (rank-dependent) scores, then rank 0's."""
    import os

    from userdp.clients.perplexity import ExamplePerplexities

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        with ShardStore(shards) as store:
            by_shard = {
                entry.name: np.arange(entry.num_examples, dtype=np.float64) + 100.0 * rank
                for entry in store.manifest.shards
            }
            scores = ExamplePerplexities(store, by_shard)
            scores.broadcast_from_rank_zero(torch.device("cpu"))
            user = store.users()[0]
            np.save(Path(out) / f"rank{rank}.npy", scores.of_user(user))
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_takes_rank_zeros_scores(files, tmp_path) -> None:
    from userdp.clients.distributed import free_port

    torch.multiprocessing.spawn(
        _broadcast_rank, args=(2, free_port(), str(files["shards"]), str(tmp_path)), nprocs=2
    )
    rank0, rank1 = (np.load(tmp_path / f"rank{r}.npy") for r in (0, 1))
    np.testing.assert_array_equal(rank1, rank0)
    assert rank0.max() < 100.0  # rank 0's values, not rank 1's


# ---- the worker -------------------------------------------------------------------------------


def _config(files: dict[str, Path], tmp_path: Path, selection: str = "highest_ppl", **strategy):
    return parse_config(
        {
            "data": {
                "shards": str(files["shards"]),
                "seq_len": SEQ_LEN,
                "selection": selection,
                "eval_fraction": 0.25,
            },
            "model": {"path": str(files["model"])},
            "strategy": {
                "steps": 2,
                "sampling_prob": 0.5,
                "group_size": 2,
                "engine": "loop",
                "sampler_seed": 0,
                "server_optimizer": "sgd",
                "server_lr": 0.5,
                **strategy,
            },
            "privacy": {"epsilon": 30.0},
            "workers": {"count": 1, "cache_dir": str(tmp_path / "cache")},
            "output": {"dir": str(tmp_path / "run"), "seed": 0, "sample_count": 0},
        }
    )


def _task(units: list[str], selection: str, step: int = 0, unit: str = "user"):
    from userdp.proto import userdp_v1_pb2 as pb
    from userdp.proto.codec import task_from_proto

    return task_from_proto(
        pb.Task(
            task_id=f"{step}.0",
            step=step,
            unit_ids=units,
            clip_norm=1.0,
            engine=pb.EngineOptions(unit=unit),
            selection=pb.Selection(strategy=selection, group_size=2, seq_len=SEQ_LEN),
            selection_seed=5,
        )
    )


def test_worker_selects_by_the_initial_models_perplexity_after_updates(files, tmp_path) -> None:
    from userdp.clients.worker_service import build_compute

    from userdp.run.in_process import LocalTensor

    initial = _model(files["model"])
    with ShardStore(files["shards"]) as store:
        compute = build_compute(_config(files, tmp_path), store)
        moved = {  # an update reaches the worker: the selection must not follow it
            name: LocalTensor(param.detach() + 0.3)
            for name, param in compute.engine.module.named_parameters()
        }
        compute.apply_model(moved, full=False)
        users = store.users()
        for selection, sign in (("highest_ppl", -1.0), ("lowest_ppl", 1.0)):
            for unit in compute._units(_task(users, selection)):
                examples = store.user_examples(unit.unit_id)
                reference = np.array(
                    [
                        _reference_perplexity(initial, e, SEQ_LEN) if len(e) >= 2 else np.nan
                        for e in examples
                    ]
                )
                order = np.argsort(sign * reference, kind="stable")[:2]
                assert [e.tolist() for e in unit.examples] == [
                    examples[i][:SEQ_LEN].tolist() for i in order
                ], (unit.unit_id, selection)


def test_a_worker_started_without_perplexities_fails_such_a_task_in_one_line(
    files, tmp_path
) -> None:
    from userdp.clients.worker_service import build_compute

    with ShardStore(files["shards"]) as store:
        compute = build_compute(_config(files, tmp_path, selection="random"), store)
        with pytest.raises(ValueError, match=r"data\.selection = 'lowest_ppl'") as exc:
            compute._units(_task(store.users()[:1], "lowest_ppl"))
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "cache").exists()  # random selection scores nothing


def test_example_units_take_each_users_top_records_by_the_initial_models_perplexity(
    files, tmp_path
) -> None:
    # ELS / group privacy: D_sub holds ranks 0..G-1 and the worker resolves each on the user's
    # own records, by the initial model's perplexity; a rank at or past G is refused (it would
    # put more than G of the user's records in D_sub).
    from userdp.clients.worker_service import build_compute

    initial = _model(files["model"])
    with ShardStore(files["shards"]) as store:
        compute = build_compute(_config(files, tmp_path, name="els"), store)
        users = store.users()
        for selection, sign in (("highest_ppl", -1.0), ("lowest_ppl", 1.0)):
            ids = [f"{user}/{rank}" for user in users for rank in range(2)]
            units = compute._units(_task(ids, selection, unit="example"))
            for user in users:
                examples = store.user_examples(user)
                reference = np.array(
                    [
                        _reference_perplexity(initial, e, SEQ_LEN) if len(e) >= 2 else np.nan
                        for e in examples
                    ]
                )
                top = np.argsort(sign * reference, kind="stable")[:2]
                mine = [u.examples[0].tolist() for u in units if u.unit_id.startswith(f"{user}/")]
                assert mine == [examples[i][:SEQ_LEN].tolist() for i in top], (user, selection)
        with pytest.raises(IndexError, match="first 2 records"):
            compute._units(_task([f"{users[0]}/2"], "highest_ppl", unit="example"))


@pytest.mark.parametrize("strategy", ["els", "group-privacy"])
def test_random_chunk_with_example_units_is_a_config_error(files, tmp_path, strategy):
    with pytest.raises(ConfigError, match=r"data\.selection = 'random_chunk'.*strategy\.name"):
        _config(files, tmp_path, selection="random_chunk", name=strategy)


def test_config_check_exits_2_naming_the_key(files, tmp_path, capsys) -> None:
    from userdp.cli import main

    path = tmp_path / "run.toml"
    path.write_text('[data]\nselection = "random_chunk"\n[strategy]\nname = "els"\n')
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "data.selection = 'random_chunk'" in err and err.count("\n") == 0


def test_in_process_run_with_highest_ppl_selection_notes_the_public_model(files, tmp_path):
    from userdp.run.launch import run

    config = _config(files, tmp_path)
    result = run(config, tmp_path / "run", mode="in-process", quiet=True)
    assert result.stopped == "finished" and result.steps_done == 2
    assert len(list((tmp_path / "cache").glob("perplexity-*.safetensors"))) == 2
    report = json.loads((result.run_dir / "privacy_report.json").read_text())
    notes = [c for c in report["caveats"] if "initial model" in c]
    assert len(notes) == 1 and "highest_ppl" in notes[0] and "Mind the Privacy Unit!" in notes[0]
    assert "Mind the Privacy Unit!" in (result.run_dir / "privacy_report.md").read_text()
