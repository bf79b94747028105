"""The README's 30-second example, verbatim, in a new shell: no ``scripts/env.sh``, no userdp
variables, a fresh HOME. It must run to the end, and DeepSpeed's op must come from the
environment's prebuilt cache (nothing built into ``~/.cache/torch_extensions``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## 30-second example", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def write_my_data(path: Path) -> None:
    """A user-partitioned corpus with the example's columns: 400 authors, uneven counts."""
    words = ["river", "stone", "light", "garden", "letter", "winter", "market", "song"]
    rows = []
    for author in range(400):
        for k in range(1 + author % 5):
            text = " ".join(words[(author * 7 + k * 3 + j) % len(words)] for j in range(12))
            rows.append({"author": f"a{author}", "body": f"{text}.", "extra": k})
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.slow
def test_the_readme_example_runs_verbatim_in_a_new_shell(tmp_path) -> None:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    write_my_data(tmp_path / "my_data.parquet")
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", readme_example()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert (tmp_path / "runs" / "mine" / "privacy_report.md").is_file()
    assert '"epsilon"' in result.stdout.splitlines()[-1]  # account epsilon --json
    assert not (home / ".cache" / "torch_extensions").exists(), "DeepSpeed's op was rebuilt"
