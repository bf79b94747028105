"""Building the tokenizer for ``userdp shard --tokenizer byte|bpe:N|PATH`` (writer side only).

Workers never train or copy tokenizers; they call
:func:`userdp.clients.tokenization.load_tokenizer` on the shard directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from userdp.clients.shard_format import TOKENIZER_DIR, InputDataError, TokenizerInfo
from userdp.clients.tokenization import (
    ByteTokenizer,
    Tokenizer,
    TokenizersTokenizer,
    TransformersTokenizer,
    directory_sha256,
)

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
MIN_BPE_VOCAB = 256 + len(SPECIAL_TOKENS) + 1
MAX_BPE_VOCAB = 1_000_000


def parse_tokenizer_spec(spec: str) -> tuple[str, int | Path | None]:
    """``byte`` -> ("byte", None); ``bpe:N`` -> ("bpe", N); a directory -> ("path", Path)."""
    if spec == "byte":
        return "byte", None
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            vocab = -1
        if not MIN_BPE_VOCAB <= vocab <= MAX_BPE_VOCAB:
            raise ValueError(
                f"--tokenizer {spec!r}: bpe vocabulary size must be an integer in "
                f"[{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}], e.g. bpe:8192"
            )
        return "bpe", vocab
    path = Path(spec)
    if path.is_dir() and (
        (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    ):
        return "path", path
    raise ValueError(
        f"--tokenizer {spec!r}: allowed are 'byte', 'bpe:N' (train a BPE of N tokens on the input) "
        "or a local directory holding tokenizer.json or a transformers tokenizer"
    )


def build_tokenizer(
    spec: str, texts: Callable[[], Iterator[list[str]]], out_dir: Path
) -> Tokenizer:
    """Create the tokenizer ``spec`` names, saving its files under ``out_dir/tokenizer/``.

    ``texts`` returns a fresh iterator over batches of the input's texts (one extra streaming pass,
    used only to train ``bpe:N``).
    """
    kind, arg = parse_tokenizer_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    target = Path(out_dir) / TOKENIZER_DIR
    target.mkdir(parents=True)
    if kind == "bpe":
        assert isinstance(arg, int)
        _train_bpe(arg, texts, target / "tokenizer.json")
        info = _info("bpe", f"bpe:{arg}", target)
        return TokenizersTokenizer(target / "tokenizer.json", info)
    assert isinstance(arg, Path)
    if (arg / "tokenizer_config.json").is_file():
        for item in arg.iterdir():
            if item.is_file():
                shutil.copy2(item, target / item.name)
        info = _info("transformers", arg.resolve().name, target)
        return TransformersTokenizer(target, info)
    shutil.copy2(arg / "tokenizer.json", target / "tokenizer.json")
    info = _info("tokenizers", arg.resolve().name, target)
    return TokenizersTokenizer(target / "tokenizer.json", info)


def _info(kind: str, tokenizer_id: str, directory: Path) -> TokenizerInfo:
    if kind == "transformers":
        loaded = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        vocab, eos, pad = len(loaded), loaded.eos_token_id, loaded.pad_token_id
    else:
        loaded = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        vocab = loaded.get_vocab_size()
        eos, pad = loaded.token_to_id("<eos>"), loaded.token_to_id("<pad>")
    return TokenizerInfo(
        kind=kind,
        id=tokenizer_id,
        sha256=directory_sha256(directory),
        vocab_size=int(vocab),
        eos_id=eos,
        pad_id=pad,
        path=TOKENIZER_DIR,
    )


def _train_bpe(vocab_size: int, texts: Callable[[], Iterator[list[str]]], path: Path) -> None:
    """Byte-level BPE (every string encodes, no unknown tokens) trained on the input's texts."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    if tokenizer.get_vocab_size() < MIN_BPE_VOCAB - 1:
        raise InputDataError(f"BPE training produced only {tokenizer.get_vocab_size()} tokens")
    tokenizer.save(str(path))
