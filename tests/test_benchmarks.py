"""The quick benchmarks still run against the package's current API: a benchmark that calls a
renamed option or a removed argument fails here, not in the next full record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["data", "scale", "strategies", "noise"]  # a few seconds each in quick mode


@pytest.mark.slow  # the benchmark scripts themselves (run_all runs them too)
def test_the_quick_benchmarks_run_and_record_their_rows(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run_all.py"),
            "--only",
            *QUICK,
            "--machine",
            "smoke",
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    record = json.loads((tmp_path / "smoke.json").read_text())
    failed = {
        name: entry.get("stderr_tail", "")[-2000:]
        for name, entry in record["benchmarks"].items()
        if entry["status"] != "ok"
    }
    assert not failed, failed
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(record["benchmarks"]) == sorted(QUICK)
    for name in QUICK:
        assert record["benchmarks"][name]["markdown"].count("|") > 10, name
