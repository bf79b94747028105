"""deploy/warm_deepspeed_ops.py: the image's DeepSpeed JIT warm-up names real op builders, and a
warmed cache is what DeepSpeed's own loader uses afterwards (slow: compiles the op once)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "warm_deepspeed_ops.py"


def _load():
    spec = importlib.util.spec_from_file_location("warm_deepspeed_ops", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_start_up_ops_come_first_without_duplicates() -> None:
    warm = _load()
    assert warm.ops_to_build("cpu", []) == ["ShareMemCommBuilder"]
    assert warm.ops_to_build("cpu", ["FusedAdamBuilder", "ShareMemCommBuilder"]) == [
        "ShareMemCommBuilder",
        "FusedAdamBuilder",
    ]
    assert warm.ops_to_build("cuda", []) == []


def test_start_up_ops_are_the_builders_deepspeed_loads() -> None:
    """The cpu entry is the builder deepspeed.comm builds at init (deepspeed/comm/torch.py)."""
    import inspect

    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # the module, not torch

    warm = _load()
    source = inspect.getsource(ds_comm_torch.build_shm_op)
    for name in warm.STARTUP_OPS["cpu"]:
        assert f'"{name}"' in source
    assert ShareMemCommBuilder.__name__ in warm.STARTUP_OPS["cpu"]


def test_refuses_to_run_without_a_cache_directory() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "TORCH_EXTENSIONS_DIR" in result.stderr


@pytest.mark.slow
def test_warmed_cache_is_reused_by_deepspeed(tmp_path: Path) -> None:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), DS_ACCELERATOR="cpu")
    first = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
    )
    assert first.returncode == 0, first.stderr
    built = list((tmp_path / "ext").rglob("deepspeed_shm_comm*.so"))
    assert built, "no shared library in the cache"
    mtime = built[0].stat().st_mtime
    started = time.perf_counter()
    code = "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None"
    second = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stderr
    assert built[0].stat().st_mtime == mtime, "DeepSpeed rebuilt the op instead of reusing it"
    assert time.perf_counter() - started < 60


def test_gpu_image_warm_up_runs_without_a_gpu(tmp_path: Path) -> None:
    """The GPU image's default build step (DS_ACCELERATOR=cuda, no GPU during docker build)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), DS_ACCELERATOR="cuda")
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "no JIT ops to build for accelerator 'cuda'" in result.stdout


@pytest.mark.slow
def test_an_unknown_op_fails_the_build(tmp_path: Path) -> None:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), DS_ACCELERATOR="cuda")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "NoSuchBuilder"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "NoSuchBuilder is not available" in result.stderr
