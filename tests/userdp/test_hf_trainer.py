"""``UserDPTrainer`` / ``UserDPSFTTrainer``: userdp's user-level DP inside Hugging Face's Trainer.
The same run as ``simulate --in-process`` (same shards, cohorts, σ, ε; noiseless, the same model
update), the same artefacts checked by the same commands, every refusal, LoRA, TRL chat data, and
resume from a Trainer checkpoint without releasing a step twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, TrainingArguments

from tests.userdp.hf_fixtures import tiny_model, tiny_tokenizer, trainer_args, user_dataset
from userdp.cli import main
from userdp.config import parse_config
from userdp.hf import DatasetError, TrainerSettingError, UserDPArguments, UserDPTrainer
from userdp.run.launch import run

PRIVACY = {
    "sampling_prob": 0.25,
    "group_size": 2,
    "clip_norm": 1.0,
    "seq_len": 16,
    "engine": "loop",
    "strategy_options": {"sampler_seed": 7},
}


def ledger_steps(folder: Path) -> list[int]:
    lines = (folder / "ledger.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["type"] == "step"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_the_trainer_runs_what_simulate_in_process_runs(tmp_path, tokenizer) -> None:
    """Same shards, σ, sampler seed and initial model: noiseless, three Trainer steps (SGD at the
    same rate) give `simulate --in-process`'s model; the ledgers charge the same mechanism, the
    reports state the same ε, and `userdp ledger verify` accepts both folders."""
    model_dir = tmp_path / "model"
    tiny_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    trainer = UserDPTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=trainer_args(tmp_path / "hf", 3),
        train_dataset=user_dataset(),
        processing_class=tokenizer,
        privacy=UserDPArguments(noise_multiplier=1.0, **PRIVACY),
    )
    trainer.test_only_disable_noise = True
    trainer.train()
    (shards,) = (tmp_path / "hf" / "userdp_shards").iterdir()
    config = parse_config(
        {
            "data": {"shards": str(shards), "seq_len": 16, "eval_fraction": 0.0},
            "model": {"path": str(model_dir)},
            "strategy": {
                "steps": 3,
                "sampling_prob": 0.25,
                "group_size": 2,
                "engine": "loop",
                "sampler_seed": 7,
                "server_optimizer": "sgd",
                "server_lr": 0.5,
            },
            "privacy": {"noise_multiplier": 1.0},
            "workers": {"count": 1},
            "output": {"plots": False, "sample_count": 0},
        }
    )
    result = run(
        config, tmp_path / "sim", mode="in-process", quiet=True, test_only_disable_noise=True
    )
    trained = dict(trainer.model.named_parameters())
    assert set(result.params) == set(trained)
    moved = 0
    for name, value in result.params.items():
        torch.testing.assert_close(trained[name].detach(), value, rtol=1e-5, atol=1e-6)
        moved += int(
            not torch.equal(
                value, AutoModelForCausalLM.from_pretrained(model_dir).state_dict()[name]
            )
        )
    assert moved > 0  # the steps trained: the comparison is not of two initial models
    for folder in (tmp_path / "hf", tmp_path / "sim"):
        assert ledger_steps(folder) == [0, 1, 2]
        assert main(["ledger", "verify", str(folder)]) == 0
    reports = [
        json.loads((f / "privacy_report.json").read_text())
        for f in (tmp_path / "hf", tmp_path / "sim")
    ]
    for key in ("epsilon", "delta", "mechanism", "steps", "noise_multiplier", "unit", "sampling"):
        assert reports[0][key] == reports[1][key], key


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_grad_norm": 1.0}, "max_grad_norm = 1 would clip the noisy mean again"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps = 2 would mix"),
        ({"train_sampling_strategy": "group_by_length"}, "remove group_by_length"),
    ],
)
def test_trainer_settings_that_break_the_guarantee_are_refused(
    tmp_path, tokenizer, overrides, message
) -> None:
    with pytest.raises(TrainerSettingError) as info:
        UserDPTrainer(
            model=tiny_model(tokenizer),
            args=trainer_args(tmp_path, 2, **overrides),
            train_dataset=user_dataset(),
            processing_class=tokenizer,
            privacy=UserDPArguments(**PRIVACY),
        )
    assert message in str(info.value) and "\n" not in str(info.value)


class TwoProcesses(TrainingArguments):
    """Arguments as Accelerate/DDP sets them in each of two processes."""

    @property
    def world_size(self) -> int:
        return 2


def test_multi_process_packing_collators_and_datasets_without_users_are_refused(
    tmp_path, tokenizer
) -> None:
    def build(**kwargs):
        values = {
            "model": tiny_model(tokenizer),
            "args": trainer_args(tmp_path, 2),
            "train_dataset": user_dataset(),
            "processing_class": tokenizer,
            "privacy": UserDPArguments(**PRIVACY),
            **kwargs,
        }
        return UserDPTrainer(**values)

    args = trainer_args(tmp_path, 2).to_dict()
    with pytest.raises(TrainerSettingError, match="2 processes .* without userdp's reduce"):
        build(args=TwoProcesses(**{k: v for k, v in args.items() if not k.startswith("_")}))
    with pytest.raises(TrainerSettingError, match="DataCollatorWithFlattening packs"):
        build(data_collator=DataCollatorWithFlattening())
    with pytest.raises(DatasetError, match="no user column 'user_id'"):
        build(train_dataset=user_dataset().remove_columns("user_id"))
    with pytest.raises(DatasetError, match="set privacy.user_column"):
        build(train_dataset=user_dataset().rename_column("user_id", "author"))
    build(
        train_dataset=user_dataset().rename_column("user_id", "author"),
        privacy=UserDPArguments(user_column="author", **PRIVACY),
    )
    with pytest.raises(TrainerSettingError, match="privacy=UserDPArguments"):
        build(privacy=None)


def test_lora_trains_only_the_adapters_and_saves_them(tmp_path, tokenizer) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(tokenizer), LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0)
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = UserDPTrainer(
        model=model,
        args=trainer_args(tmp_path, 2),
        train_dataset=user_dataset(),
        processing_class=tokenizer,
        privacy=UserDPArguments(epsilon=8.0, **PRIVACY),
    )
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert changed and changed <= trainable and all("lora_" in n for n in changed)
    assert ledger_steps(tmp_path) == [0, 1]
    assert (tmp_path / "model" / "adapter_config.json").is_file()
    release = json.loads((tmp_path / "model" / "userdp_release.json").read_text())
    assert (
        release["epsilon"] == json.loads((tmp_path / "privacy_report.json").read_text())["epsilon"]
    )
    assert main(["ledger", "verify", str(tmp_path)]) == 0


def test_epsilon_reaches_the_trainers_logs(tmp_path, tokenizer) -> None:
    trainer = UserDPTrainer(
        model=tiny_model(tokenizer),
        args=trainer_args(tmp_path, 3),
        train_dataset=user_dataset(),
        processing_class=tokenizer,
        privacy=UserDPArguments(epsilon=4.0, **PRIVACY),
    )
    trainer.train()
    spent = [row["epsilon"] for row in trainer.state.log_history if "epsilon" in row]
    assert len(spent) == 3 and spent == sorted(spent) and spent[0] > 0
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert spent[-1] == pytest.approx(report["epsilon"]) and report["epsilon"] <= 4.0


def test_resume_from_a_trainer_checkpoint_never_releases_a_step_twice(tmp_path, tokenizer) -> None:
    """Four steps with checkpoints at 2 and 4, then resumed from checkpoint 2 to 6 steps: steps
    2 and 3 are charged already and are skipped (their updates are lost with the newer
    checkpoint, not released again); steps 4 and 5 are new."""

    def trainer(steps: int) -> UserDPTrainer:
        return UserDPTrainer(
            model=tiny_model(tokenizer),
            args=trainer_args(tmp_path, steps, save_strategy="steps", save_steps=2),
            train_dataset=user_dataset(),
            processing_class=tokenizer,
            privacy=UserDPArguments(noise_multiplier=1.0, steps=steps, **PRIVACY),
        )

    first = trainer(4)
    first.train()
    assert ledger_steps(tmp_path) == [0, 1, 2, 3]
    assert (tmp_path / "checkpoint-2" / "userdp").is_dir()
    second = trainer(6)
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert ledger_steps(tmp_path) == [0, 1, 2, 3, 4, 5]
    assert main(["ledger", "verify", str(tmp_path)]) == 0


def test_sft_trainer_on_chat_data(tmp_path, tokenizer) -> None:
    """TRL's SFTTrainer with chat messages: the chat template makes each example's text; packing
    is refused."""
    from datasets import Dataset
    from trl import SFTConfig

    from userdp.hf.trl import UserDPSFTTrainer

    rows = [
        {
            "user_id": f"u{u}",
            "messages": [
                {"role": "user", "content": f"what does user {u} like?"},
                {"role": "assistant", "content": f"tea and song number {k}"},
            ],
        }
        for u in range(40)
        for k in range(2)
    ]
    dataset = Dataset.from_list(rows)
    base = trainer_args(tmp_path, 2).to_dict()
    config = {k: v for k, v in base.items() if not k.startswith("_")}
    with pytest.raises(TrainerSettingError, match="packing puts several users"):
        UserDPSFTTrainer(
            model=tiny_model(tokenizer),
            args=SFTConfig(**config, packing=True, max_length=16),
            train_dataset=dataset,
            processing_class=tokenizer,
            privacy=UserDPArguments(**PRIVACY),
        )
    trainer = UserDPSFTTrainer(
        model=tiny_model(tokenizer),
        args=SFTConfig(**config, max_length=16),
        train_dataset=dataset,
        processing_class=tokenizer,
        privacy=UserDPArguments(epsilon=8.0, **PRIVACY),
    )
    trainer.train()
    assert ledger_steps(tmp_path) == [0, 1]
    (shards,) = (tmp_path / "userdp_shards").iterdir()
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["totals"]["users"] == 40 and manifest["totals"]["examples"] == 80
    assert main(["ledger", "verify", str(tmp_path)]) == 0


@pytest.mark.slow  # 15-60 s: a fresh interpreter imports the stack and trains 40 steps
def test_the_example_script_runs_and_its_folder_verifies(tmp_path) -> None:
    """examples/hf_trainer.py as a user runs it: it trains, prints ε, and its output folder is
    a run folder that `userdp report` and `userdp ledger verify` accept."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    # a user's shell: not the rendezvous variables an in-process run of this test session set
    rendezvous = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "hf_trainer.py"), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "privacy_report.json").read_text())
    assert f"ε = {report['epsilon']:.3f}" in done.stdout and report["epsilon"] <= 8.0
    assert ledger_steps(tmp_path / "run") == list(range(40))
    assert main(["report", str(tmp_path / "run")]) == 0
    assert main(["ledger", "verify", str(tmp_path / "run")]) == 0


@pytest.mark.parametrize(
    ("privacy", "kind"),
    [
        ({"unit": "example"}, "els"),
        pytest.param(
            {"strategy": "randomized-clipping", "engine": "randomized", "probes": 4},
            "randomized-clipping",
            marks=pytest.mark.slow,  # ~20 s: the randomized engine's probes on every weight
        ),
    ],
)
def test_example_level_and_randomized_clipping_strategies(
    tmp_path, tokenizer, privacy, kind
) -> None:
    options = {k: v for k, v in PRIVACY.items() if k != "engine"}
    trainer = UserDPTrainer(
        model=tiny_model(tokenizer),
        args=trainer_args(tmp_path, 2),
        train_dataset=user_dataset(),
        processing_class=tokenizer,
        privacy=UserDPArguments(epsilon=8.0, **options, **privacy),
    )
    trainer.train()
    lines = (tmp_path / "ledger.jsonl").read_text().splitlines()
    kinds = {r["mechanism"]["kind"] for r in map(json.loads, lines) if r["type"] == "step"}
    assert kinds == {kind} and ledger_steps(tmp_path) == [0, 1]
    assert main(["ledger", "verify", str(tmp_path)]) == 0


def test_a_userdp_shards_folder_instead_of_a_dataset(tmp_path, capsys) -> None:
    """privacy.shards: a folder `userdp shard` wrote (byte tokenizer), no train_dataset."""
    from tests.userdp.hf_fixtures import user_texts

    ids, texts = user_texts()
    source = tmp_path / "input.jsonl"
    source.write_text(
        "".join(json.dumps({"uid": u, "text": t}) + "\n" for u, t in zip(ids, texts, strict=True))
    )
    argv = ["shard", str(source), "--user-column", "uid", "--text-column", "text"]
    assert main([*argv, "--out", str(tmp_path / "shards")]) == 0
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())

    class ByteVocabulary:
        eos_token_id = pad_token_id = manifest["tokenizer"]["pad_id"]

        def __len__(self) -> int:
            return manifest["tokenizer"]["vocab_size"]

    trainer = UserDPTrainer(
        model=tiny_model(ByteVocabulary()),
        args=trainer_args(tmp_path / "run", 2),
        privacy=UserDPArguments(shards=str(tmp_path / "shards"), epsilon=8.0, **PRIVACY),
    )
    trainer.train()
    assert ledger_steps(tmp_path / "run") == [0, 1]
    assert not (tmp_path / "run" / "userdp_shards").exists()


def test_an_iterable_dataset_is_sharded_like_a_dataset(tmp_path, tokenizer) -> None:
    from userdp.hf.data import dataset_shards

    a = dataset_shards(user_dataset(), "user_id", "text", tokenizer, tmp_path / "a")
    b = dataset_shards(
        user_dataset().to_iterable_dataset(), "user_id", "text", tokenizer, tmp_path / "b"
    )
    assert a.name == b.name  # the same data and tokenizer: the same content hash
    for name in ("manifest.json",):
        left, right = (json.loads((f / name).read_text()) for f in (a, b))
        assert (
            left["totals"]
            == right["totals"]
            == {"users": 40, "examples": 120, "tokens": left["totals"]["tokens"]}
        )
    assert (
        dataset_shards(user_dataset(), "user_id", "text", tokenizer, tmp_path / "a") == a
    )  # reused
