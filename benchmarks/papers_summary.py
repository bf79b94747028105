"""One page for the papers' findings reproduced with userdp: every claim's verdicts, its plot and
a link to its full table, assembled from the JSON that ``benchmarks/papers.py``,
``benchmarks/papers_lm.py`` and ``benchmarks/papers_selection.py`` write (nothing is rerun).

    .venv/bin/python benchmarks/papers_summary.py --prefix benchmarks/results/cpu-2c-papers \\
        --out benchmarks/results/papers-cpu-2c.md
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

CLAIMS = (
    "mean_estimation",
    "privacy_unit",
    "data_selection",
    "language_model",
    "matrix_amplification",
)
"""In reading order: the ULS/ELS claims, the privacy-unit ones, the matrix-mechanism one."""


def page(prefix: Path, out: Path) -> str:
    records = {}
    for name in CLAIMS:
        path = Path(f"{prefix}-{name}.json")
        if path.is_file():
            records[name] = json.loads(path.read_text())
    if not records:
        raise SystemExit(f"no {prefix}-<claim>.json found; run the papers benchmarks first")
    tally = Counter(v["verdict"].split(":")[0].split(" (")[0] for r in records.values()
                    for v in r["verdicts"])  # fmt: skip
    lines = [
        "# The source papers' findings, reproduced with userdp (2-core CPU)",
        "",
        "Each finding is judged from runs of userdp's own strategies, samplers, engines and "
        "accountants (in-process simulation through the run API), with repeats and standard "
        "errors; a verdict is *reproduced* when the comparison holds beyond two standard errors "
        "where the claim needs it, *not reproduced* when it fails by as much, *inconclusive* "
        "otherwise. Each section links the full table (setup, every row) and shows its plot.",
        "",
        "Verdicts: " + ", ".join(f"{n} {k}" for k, n in sorted(tally.items())) + ".",
        "",
    ]
    for name, record in records.items():
        detail = Path(f"{prefix}-{name}.md")
        image = Path(f"{prefix}-{name}.png")
        lines += [
            f"## {record['claim']}",
            "",
            f"Full table: [{detail.name}]({_relative(detail, out)}); "
            f"{record['seconds']:.0f} s of CPU runs.",
            "",
            "| finding | evidence | verdict |",
            "|---|---|---|",
            *(f"| {v['finding']} | {v['evidence']} | {v['verdict']} |" for v in record["verdicts"]),
            "",
        ]
        if image.is_file():
            lines += [f"![{name}]({_relative(image, out)})", ""]
    return "\n".join(lines)


def _relative(path: Path, out: Path) -> str:
    """``path`` as a link from the page's folder (the page lives next to the results)."""
    return os.path.relpath(path.resolve(), out.resolve().parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=Path, required=True, help="PREFIX of PREFIX-<claim>.json")
    parser.add_argument("--out", type=Path, required=True, help="the markdown page to write")
    args = parser.parse_args()
    text = page(args.prefix, args.out)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
