"""A tiny model, tokenizer and user-partitioned dataset for the Hugging Face Trainer tests (built
offline from configs; nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainingArguments

WORDS = ["tea", "rain", "song", "stone", "river", "light", "garden", "letter"]
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def user_texts(users: int = 40, per_user: int = 3) -> tuple[list[str], list[str]]:
    """(user ids, texts): each user writes ``per_user`` short texts about its own words."""
    ids, texts = [], []
    for u in range(users):
        for k in range(per_user):
            a, b = WORDS[(u + k) % len(WORDS)], WORDS[(3 * u + 2 * k) % len(WORDS)]
            ids.append(f"u{u}")
            texts.append(f"user {u} likes {a} and {b}, then {a} again")
    return ids, texts


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (every string encodes) with a pad token, an eos token and a chat template."""
    _, texts = user_texts()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(tokenizer: Any, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=32,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def user_dataset(users: int = 40, per_user: int = 3) -> Dataset:
    ids, texts = user_texts(users, per_user)
    return Dataset.from_dict({"user_id": ids, "text": texts})


def trainer_args(out: Path, steps: int, **overrides: Any) -> TrainingArguments:
    """Arguments userdp accepts: no Trainer clipping, plain SGD at a constant rate (the same
    update as userdp's own ``server_optimizer = "sgd"``), no checkpoints, no trackers."""
    values = {
        "output_dir": str(out),
        "max_steps": steps,
        "max_grad_norm": 0.0,
        "use_cpu": True,
        "report_to": [],
        "optim": "sgd",
        "learning_rate": 0.5,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        **overrides,
    }
    return TrainingArguments(**values)
