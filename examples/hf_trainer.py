"""User-level DP fine-tuning with Hugging Face's Trainer: a tiny GPT-2 with LoRA on 200 users.

.venv/bin/python examples/hf_trainer.py [OUTPUT_DIR]
"""

import sys

from datasets import Dataset
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainingArguments

from userdp.hf import UserDPArguments, UserDPTrainer

words = ["tea", "rain", "song", "stone", "river", "light", "garden", "letter"]
users = [f"user-{u}" for u in range(200) for k in range(4)]
texts = [
    f"{w} and {words[(k + 3) % 8]} again"
    for u in range(200)
    for k, w in enumerate(words[u % 5 : u % 5 + 4])
]

bpe = Tokenizer(models.BPE())  # a public tokenizer in real use: AutoTokenizer.from_pretrained(...)
bpe.pre_tokenizer, bpe.decoder = (
    pre_tokenizers.ByteLevel(add_prefix_space=False),
    decoders.ByteLevel(),
)
bpe.train_from_iterator(
    words,
    trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ),
)
tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>")

model = GPT2LMHeadModel(
    GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=64, n_layer=2, n_head=2)
)
model = get_peft_model(model, LoraConfig(r=8, target_modules=["c_attn"], lora_dropout=0.0))

args = TrainingArguments(
    output_dir=sys.argv[1] if len(sys.argv) > 1 else "runs/hf-trainer",
    max_steps=40,
    learning_rate=3e-3,
    max_grad_norm=0.0,
    logging_steps=10,
    report_to=[],
    use_cpu=True,
)
privacy = UserDPArguments(
    user_column="user_id", sampling_prob=0.2, group_size=4, clip_norm=1.0, epsilon=8.0, seq_len=16
)
trainer = UserDPTrainer(
    model=model,
    args=args,
    train_dataset=Dataset.from_dict({"user_id": users, "text": texts}),
    processing_class=tokenizer,
    privacy=privacy,
)
trainer.train()
print(f"ε = {trainer.privacy_report['epsilon']:.3f} at δ = {trainer.privacy_report['delta']:.2g}")
print(
    f"report: {args.output_dir}/privacy_report.md; check it: userdp ledger verify {args.output_dir}"
)
