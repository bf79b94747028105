"""The prepared GPU check (benchmarks/gpu_check.sh): what it ships, and its refusals off a GPU.

- The wheels it ships are userdp's dependency closure minus what a GPU image brings: DeepSpeed,
  pydantic, dp-accounting, grpcio, protobuf and Opacus are in it; torch, its CUDA libraries and
  Triton, numpy and transformers (which a second copy would shadow) are not.
- ``run`` without its wheels or without a usage refuses with one line and exit status 2.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_shipped_wheels_are_the_closure_minus_the_gpu_image():
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_wheels.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    shipped = {line.split("==")[0] for line in done.stdout.split()}
    needed = {"userdp", "deepspeed", "pydantic", "pydantic-core", "dp-accounting", "grpcio"}
    needed |= {"protobuf", "opacus", "hjson"}
    assert needed <= shipped, f"missing from the wheels: {sorted(needed - shipped)}"
    image = {"torch", "triton", "numpy", "scipy", "transformers", "pyarrow", "peft", "pytest"}
    image |= {name for name in shipped if name.startswith("nvidia-")}
    assert not shipped & image, f"would shadow the image's own: {sorted(shipped & image)}"
    assert "uv" not in shipped, "the uv binary is skipped (no check imports it)"
    assert all("==" in line for line in done.stdout.split()), "every wheel is pinned"


def _gpu_check(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
    )


def test_gpu_check_refuses_with_one_line_and_exit_2(tmp_path):
    done = _gpu_check(cwd=tmp_path)
    assert done.returncode == 2 and "gpu_check.sh prepare" in done.stderr, done.stderr
    done = _gpu_check("run", str(tmp_path / "none"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "no wheels in" in line and "gpu_check.sh prepare" in line, line
    assert not list(tmp_path.glob("**/gpu-*.md")), "a refused run wrote results"
