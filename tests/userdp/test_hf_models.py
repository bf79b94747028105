"""A user's own Hugging Face model folder end to end: a tiny Llama-, Qwen2- and Mistral-style
model saved with ``save_pretrained`` next to its tokenizer, sharded with that tokenizer, trained
with LoRA (the architecture's default targets) and the user's DeepSpeed JSON (ZeRO-2) by
``userdp simulate`` over gRPC workers; the run
folder's ``model/`` then loads with AutoTokenizer + AutoModelForCausalLM and generates, and its
``adapter/`` loads with peft onto the original folder with the same outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.clients.hf_families import family_config

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly kings"


def _corpus(path: Path, users: int = 24) -> None:
    words = WORDS.split()
    with open(path, "w") as f:
        for u in range(users):
            for e in range(3):
                text = " ".join(words[(u + e + i) % len(words)] for i in range(12 + e))
                f.write(json.dumps({"user": f"user{u}", "text": text}) + "\n")


def _model_folder(family: str, folder: Path, corpus: Path) -> None:
    """A BPE tokenizer trained on the corpus and a fresh model of ``family`` with its vocabulary,
    both saved in ``folder`` as a user would have them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    raw.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(folder)
    config = family_config(family)
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 1
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _userdp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "userdp"), *args],
        capture_output=True,
        text=True,
        timeout=1800,
    )


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        pytest.param("qwen2", marks=pytest.mark.slow),  # same path, another family: -m slow
        pytest.param("mistral", marks=pytest.mark.slow),
    ],
)
def test_shard_simulate_with_lora_and_load_the_run_folder(tmp_path: Path, family: str) -> None:
    corpus = tmp_path / "data.jsonl"
    _corpus(corpus)
    folder = tmp_path / f"my-{family}"
    _model_folder(family, folder, corpus)
    shard = _userdp(
        "shard",
        str(corpus),
        "--user-column",
        "user",
        "--text-column",
        "text",
        "--out",
        str(tmp_path / "shards"),
        "--tokenizer",
        str(folder),
        "--num-shards",
        "2",
    )
    assert shard.returncode == 0, shard.stderr[-2000:]
    (tmp_path / "ds.json").write_text(  # a DeepSpeed user's own config, ZeRO-2
        json.dumps(
            {
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "train_micro_batch_size_per_gpu": 4,
            }
        )
    )
    (tmp_path / "run.toml").write_text(
        f"""
[data]
shards = "{tmp_path / "shards"}"
seq_len = 24
eval_fraction = 0.2
[model]
path = "{folder}"
lora_rank = 4
deepspeed_config = "{tmp_path / "ds.json"}"
[strategy]
steps = 2
sampling_prob = 0.5
group_size = 2
engine = "vectorized"
server_optimizer = "sgd"
server_lr = 0.5
[privacy]
epsilon = 30.0
[workers]
count = 2
[coordinator]
step_deadline_s = 600.0
[output]
sample_count = 2
sample_max_new_tokens = 5
"""
    )
    run_dir = tmp_path / "run"
    result = _userdp("simulate", "--config", str(tmp_path / "run.toml"), "--output", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for log in (run_dir / "logs").glob("worker-*.log"):  # the JSON reached every worker
        assert "model.deepspeed_config: userdp overrides" in log.read_text()
    assert summary["stopped"] == "finished" and summary["steps"] == 2
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert report["steps"] == 2 and report["epsilon"] <= 30.0

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model").eval()
    assert model.config.model_type == family
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged
    prompt = tokenizer("the quick brown", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4
    assert isinstance(tokenizer.decode(out[0]), str)

    adapter_config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_modules"]) == ["q_proj", "v_proj"]  # PEFT's defaults
    base = AutoModelForCausalLM.from_pretrained(folder)
    with_adapter = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    original = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        merged_logits = model(**prompt).logits
        adapter_logits = with_adapter(**prompt).logits
        original_logits = original(**prompt).logits
    torch.testing.assert_close(adapter_logits, merged_logits, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(original_logits, merged_logits)  # training changed the model

    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["source"].startswith("held-out user") for s in samples)
    assert all(len(s["continuation_ids"]) <= 5 for s in samples)
    markdown = (run_dir / "privacy_report.md").read_text()
    assert "## Appendix: generation samples" in markdown and "not covered by ε" in markdown
    for sample in samples:  # held-out users' text stays in samples.jsonl, out of the report
        assert sample["prompt"] not in markdown
