"""The run's model artifact: ``RUN/model/`` is a folder that ``AutoTokenizer`` and
``AutoModelForCausalLM`` load as it is (and ``generate`` works on), ``RUN/adapter/`` the LoRA
adapter alone for ``peft.PeftModel``.

* ``model/``: the trained model (LoRA merged into its base weights), ``config.json``, safetensors,
  ``generation_config.json``, and the tokenizer the shards were made with, saved by
  ``save_pretrained``: a transformers tokenizer as it was given; a ``tokenizer.json`` (given, or
  the byte-level BPE that ``userdp shard --tokenizer bpe:N`` trains) wrapped in
  ``PreTrainedTokenizerFast``; userdp's byte tokenizer (UTF-8 byte b -> id b + 3, pad 0, eos 1,
  unk 2) rebuilt as a ``PreTrainedTokenizerFast`` with the same ids.
* ``adapter/`` (LoRA runs only): ``adapter_config.json`` + ``adapter_model.safetensors``; its base
  is ``model.path`` (for a preset, the preset's initial weights, which the run does not export).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from userdp.accounting.durable import fsync_path
from userdp.clients.shard_format import TOKENIZER_DIR, TokenizerInfo
from userdp.clients.tokenization import BYTE_OFFSET

BYTE_SPECIALS = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2 (pad_id 0 and eos_id 1 of the manifest)


def _byte_level_chars() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2's), which ``tokenizers``'
    ByteLevel pre-tokenizer and decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_fast() -> Any:
    """userdp's byte tokenizer as a ``PreTrainedTokenizerFast``: every UTF-8 byte is one token
    (a BPE without merges over the byte-level alphabet), ids as in the shards."""
    vocab = {token: i for i, token in enumerate(BYTE_SPECIALS)}
    vocab.update({char: b + BYTE_OFFSET for b, char in _byte_level_chars().items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(BYTE_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        split_special_tokens=True,  # the text "<eos>" is five bytes, as in the shards
    )


def hf_tokenizer(info: TokenizerInfo, shard_dir: Path) -> Any:
    """The shards' tokenizer as a transformers tokenizer (see the module docstring)."""
    if info.kind == "byte":
        return byte_tokenizer_fast()
    directory = Path(shard_dir) / (info.path or TOKENIZER_DIR)
    if info.kind == "transformers":
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    specials = {}
    for role, token_id in (("eos_token", info.eos_id), ("pad_token", info.pad_id)):
        if token_id is not None:
            specials[role] = fast.convert_ids_to_tokens(token_id)
    if "<unk>" in fast.get_vocab():  # the BPE userdp trains has one
        specials["unk_token"] = "<unk>"
    fast.add_special_tokens(specials)
    return fast


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def export_model(model: Any, run_dir: Path, info: TokenizerInfo, shard_dir: Path) -> Path:
    """Write ``RUN/model/`` (and ``RUN/adapter/`` for LoRA); returns ``RUN/model``."""
    target = Path(run_dir) / "model"
    target.mkdir(parents=True, exist_ok=True)
    plain = model
    if is_peft(model):
        model.save_pretrained(Path(run_dir) / "adapter", safe_serialization=True)
        plain = copy.deepcopy(model).merge_and_unload()
    plain.save_pretrained(target, safe_serialization=True)
    hf_tokenizer(info, shard_dir).save_pretrained(target)
    for folder in [f for f in (target, Path(run_dir) / "adapter") if f.is_dir()]:
        for written in folder.rglob("*"):  # the library writes by name: make its files durable
            fsync_path(written)
        fsync_path(folder)
    fsync_path(Path(run_dir))
    return target
