"""docs/strategies.md's plugin tutorial is the files in examples/plugin/, and its commands and
Python code run: a plugin in a file outside the package, named by module:Class in a TOML config,
through ``userdp simulate`` (gRPC worker processes), ``userdp.simulate`` and the conformance kit."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "strategies.md"
BLOCK = re.compile(r"<!-- tutorial: (?P<name>\S+) -->\n```\w+\n(?P<body>.*?)```", re.S)


def blocks() -> dict[str, str]:
    found = {m["name"]: m["body"] for m in BLOCK.finditer(DOC.read_text(encoding="utf-8"))}
    assert set(found) == {
        "examples/plugin/warmup_uls.py",
        "examples/plugin/run.toml",
        "shell",
        "python",
    }, sorted(found)
    return found


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder holding a copy of examples/plugin/, as a user's checkout would."""
    shutil.copytree(REPO / "examples" / "plugin", tmp_path / "examples" / "plugin")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_tutorial_shows_the_example_files_verbatim():
    for name, body in blocks().items():
        if name.startswith("examples/"):
            assert body == (REPO / name).read_text(encoding="utf-8"), f"{name} differs from docs"


@pytest.mark.slow  # the same plugin runs in process in the default suite (the tutorial's Python)
def test_the_tutorial_commands_run_the_plugin_over_grpc(workdir):
    for line in blocks()["shell"].strip().splitlines():
        argv = shlex.split(line)
        assert argv[0] == "userdp"
        done = subprocess.run(
            [sys.executable, "-m", "userdp.cli", *argv[1:]],
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
    run = workdir / "runs" / "plugin"
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in ledger if r.get("type") == "step"]
    assert steps == [0, 1, 2]
    assert all(r["mechanism"]["kind"] == "uls" for r in ledger if r.get("type") == "step")
    assert len(list((run / "logs").glob("worker-*.log"))) == 2  # two gRPC worker processes
    report = json.loads((run / "privacy_report.json").read_text())
    assert report["sampling"] == "poisson" and report["steps"] == 3
    resolved = (run / "config.toml").read_text()
    assert 'name = "warmup_uls:WarmupUls"' in resolved and "[strategy.params]" in resolved


def test_the_tutorial_python_runs_in_process_and_passes_the_kit(workdir):
    namespace: dict = {}
    exec(compile(blocks()["python"], "docs/strategies.md", "exec"), namespace)
    result, checks = namespace["result"], namespace["checks"]
    assert result.steps_done == 3 and result.stopped == "finished"
    assert math.isfinite(result.epsilon) and 0 < result.epsilon <= 20.0
    assert (workdir / "runs" / "plugin-py" / "ledger.jsonl").is_file()
    assert sorted(checks.passed) == sorted(
        ["noise", "normalization", "exactly_once", "fresh_noise", "sampling", "facts"]
    )
