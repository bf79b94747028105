"""The README's 30-second example, verbatim, in a new shell: no ``scripts/env.sh``, no userdp
variables, a fresh HOME. It must run to the end, and DeepSpeed's op must come from the
environment's prebuilt cache (nothing built into ``~/.cache/torch_extensions``)."""

from __future__ import annotations

import re
import subprocess
import sys
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


def readme_python_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("**From Python**", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def new_shell(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of a new shell (no userdp variables) with a fresh HOME."""
    home = tmp_path / "home"
    home.mkdir()
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}, home


@pytest.mark.skipif(
    not (Path(sys.prefix) / "torch_extensions").is_dir(),
    reason="this Python environment has no prebuilt DeepSpeed op (not set up by scripts/venv.sh)",
)
def test_the_python_api_uses_the_environments_prebuilt_op(tmp_path) -> None:
    """`userdp.simulate` from the environment's Python, in a new shell, finds DeepSpeed's op
    where the CLI does: nothing is compiled, nothing is built into ~/.cache/torch_extensions."""
    env, home = new_shell(tmp_path)
    code = (
        "import userdp\n"
        "config = {'data': {'demo_users': 40, 'seq_len': 32}, 'strategy': {'steps': 1, "
        "'sampling_prob': 0.5, 'group_size': 2, 'engine': 'loop'}, 'privacy': {'noise_multiplier': "
        "1.0}, 'output': {'plots': False, 'sample_count': 0}}\n"
        "result = userdp.simulate(config, 'runs/x', workers='in-process')\n"
        "print(result.steps_done)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-1] == "1"
    assert "compiling it now" not in result.stderr, result.stderr[-2000:]
    assert not (home / ".cache" / "torch_extensions").exists(), "DeepSpeed's op was rebuilt"


@pytest.mark.slow
def test_the_readme_python_example_runs_in_a_new_shell(tmp_path) -> None:
    """The README's shard command and run.toml, then its Python example verbatim, with the
    environment's Python in a new shell: the run ends and nothing is compiled."""
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    write_my_data(tmp_path / "my_data.parquet")
    env, home = new_shell(tmp_path)
    setup = "\n".join(
        line for line in readme_example().split(".venv/bin/userdp simulate")[0].splitlines()
    )
    subprocess.run(["bash", "-euo", "pipefail", "-c", setup], cwd=tmp_path, env=env, check=True)
    result = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-c", readme_python_example()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiling it now" not in result.stderr
    assert not (home / ".cache" / "torch_extensions").exists(), "DeepSpeed's op was rebuilt"
    assert (tmp_path / "runs" / "mine" / "privacy_report.md").is_file()
