"""The fortunes corpus: real quotations partitioned by their author, built offline.

Source: the ``fortune`` data files of BSD (Ken Arnold's fortune(6), extended by the Linux
fortune-mod), as Debian ships them in the package ``fortunes`` (``apt-get install fortunes``;
the files land in ``/usr/share/games/fortunes``; license: BSD, see that package's
``/usr/share/doc/fortunes/copyright``). Each file holds quotations separated by a line ``%``; a
quotation whose last line starts with ``--`` is attributed to the author named there.

Two splits, disjoint:

* ``private`` — every attributed quotation, the user being its author (the text before the
  first ``,`` ``(`` ``[`` ``"`` or ``:`` of the attribution, whitespace collapsed). Debian's
  1.99.1 data gives 3,782 authors and 7,213 quotations: a heavy tail (median 1 quotation per
  author, 881 authors with 2 or more, 112 for Ambrose Bierce), the uneven contributions
  user-level DP is about.
* ``public`` — every unattributed quotation (8,004), one user each: data for non-private
  pre-training of the model that is then fine-tuned privately on ``private``.

``userdp shard --fortunes OUT [--fortunes-split public] [--fortunes-dir DIR]`` writes either
split as shards.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa

__all__ = ["FORTUNES_DIR", "SPLITS", "FortunesError", "fortunes_corpus"]

FORTUNES_DIR = Path("/usr/share/games/fortunes")
SPLITS = ("private", "public")
_SEPARATOR = re.compile(r"^%\s*$", re.MULTILINE)
_ATTRIBUTION = re.compile(r"^\s*--\s*(\S.*?)\s*$")
_AUTHOR_END = re.compile(r"[,(\[\":]")


class FortunesError(ValueError):
    """The fortune files are missing or unreadable; the message says what to install or pass."""


def _author(attribution: str) -> str:
    return " ".join(_AUTHOR_END.split(attribution, maxsplit=1)[0].split())


def _files(directory: Path) -> list[Path]:
    """The data files: every regular file without a suffix (``.dat`` are strfile indexes,
    ``.u8`` links to the same text)."""
    if not directory.is_dir():
        raise FortunesError(
            f"{directory} is not a directory of fortune files; install them (Debian/Ubuntu: "
            "apt-get install fortunes) or pass --fortunes-dir"
        )
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink())
    files = [p for p in files if not p.suffix]
    if not files:
        raise FortunesError(f"{directory} holds no fortune files (names without a suffix)")
    return files


def fortunes_corpus(directory: str | Path = FORTUNES_DIR, split: str = "private") -> pa.Table:
    """The ``split`` of the corpus as a table with columns ``user_id`` and ``text``, in file
    order (files by name, quotations as they appear)."""
    if split not in SPLITS:
        raise FortunesError(f"split={split!r} is not allowed; expected one of {SPLITS}")
    users: list[str] = []
    texts: list[str] = []
    for path in _files(Path(directory)):
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FortunesError(f"{path}: not a readable UTF-8 fortune file ({exc})") from None
        for index, quotation in enumerate(_SEPARATOR.split(content)):
            lines = [line.rstrip() for line in quotation.strip("\n").splitlines()]
            lines = [line for line in lines if line.strip()]
            if not lines:
                continue
            match = _ATTRIBUTION.match(lines[-1]) if len(lines) > 1 else None
            author = _author(match.group(1)) if match else ""
            if split == "private" and author:
                users.append(author)
                texts.append("\n".join(lines[:-1]))
            elif split == "public" and not author:
                users.append(f"{path.name}-{index}")
                texts.append("\n".join(lines))
    return pa.table({"user_id": users, "text": texts})
