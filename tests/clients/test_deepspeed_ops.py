"""userdp.clients.deepspeed_ops: setup and images build DeepSpeed's start-up op once; a build lock
left by a killed build is healed instead of waited on forever; a live build's lock is left alone."""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from userdp.clients import deepspeed_ops

OP = "deepspeed_shm_comm"
MODULE = [sys.executable, "-m", "userdp.clients.deepspeed_ops"]
PATIENCE_S = 900  # outer bound for a subprocess that may compile the op on a loaded machine


def _holder(lock: Path) -> subprocess.Popen:
    """A process that takes ``lock`` the way torch's FileBaton does and keeps it open."""
    code = (
        "import os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)\n"
        "print('held', flush=True)\n"
        "time.sleep(3600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _killed_holder(lock: Path) -> None:
    """A build killed while it held the lock: the file stays behind with no process."""
    proc = _holder(lock)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lock.exists()


def _cache_with_op(tmp_path: Path) -> Path:
    """A JIT cache holding the op: a copy of this venv's (scripts/venv.sh builds it there), or
    empty, in which case the op is compiled into it (slower, same result)."""
    cache = tmp_path / "ext"
    built = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / OP
    if (built / f"{OP}.so").is_file():
        shutil.copytree(built, cache / OP, ignore=shutil.ignore_patterns("lock"))
    (cache / OP).mkdir(parents=True, exist_ok=True)
    return cache


def test_start_up_ops_come_first_without_duplicates() -> None:
    assert deepspeed_ops.ops_to_build("cpu") == ["ShareMemCommBuilder"]
    assert deepspeed_ops.ops_to_build("cpu", ["FusedAdamBuilder", "ShareMemCommBuilder"]) == [
        "ShareMemCommBuilder",
        "FusedAdamBuilder",
    ]
    assert deepspeed_ops.ops_to_build("cuda") == []


def test_start_up_ops_are_the_builders_deepspeed_loads() -> None:
    """The cpu entry is the builder deepspeed.comm builds at init (deepspeed/comm/torch.py)."""
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # the module, not torch
    source = inspect.getsource(ds_comm_torch.build_shm_op)
    for name in deepspeed_ops.STARTUP_OPS["cpu"]:
        assert f'"{name}"' in source
    assert ShareMemCommBuilder.__name__ in deepspeed_ops.STARTUP_OPS["cpu"]
    assert ShareMemCommBuilder.NAME == OP


def test_refuses_to_run_without_a_cache_directory() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    result = subprocess.run(MODULE, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert result.returncode == 2
    assert "TORCH_EXTENSIONS_DIR" in result.stderr


def test_gpu_image_build_step_runs_without_a_gpu(tmp_path: Path) -> None:
    """The GPU image's default build step (DS_ACCELERATOR=cuda, no GPU during docker build)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), DS_ACCELERATOR="cuda")
    result = subprocess.run(MODULE, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert result.returncode == 0, result.stderr
    assert "no JIT ops to build for this accelerator" in result.stdout


def test_an_unknown_op_fails_the_build(tmp_path: Path) -> None:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), DS_ACCELERATOR="cuda")
    result = subprocess.run(
        [*MODULE, "NoSuchBuilder"], env=env, capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert result.returncode == 1
    assert "NoSuchBuilder is not available" in result.stderr


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path: Path, caplog) -> None:
    lock = tmp_path / "lock"
    _killed_holder(lock)
    assert deepspeed_ops.lock_in_use(lock) is False
    with caplog.at_level("WARNING", logger=deepspeed_ops.__name__):
        assert deepspeed_ops.heal_stale_lock(lock, recheck_s=0.01)
    assert not lock.exists()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "removed a stale DeepSpeed build lock" in line and str(lock) in line


def test_a_lock_held_by_a_live_build_is_left_alone(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    holder = _holder(lock)
    try:
        assert deepspeed_ops.lock_in_use(lock) is True
        assert not deepspeed_ops.heal_stale_lock(lock, recheck_s=0.01)
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_process_working_in_the_build_directory_keeps_the_lock(tmp_path: Path) -> None:
    """torch runs ninja (and the compiler) in the build directory without the lock open."""
    lock = tmp_path / "lock"
    _killed_holder(lock)
    ninja = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], cwd=tmp_path)
    try:
        assert deepspeed_ops.lock_in_use(lock) is True
        assert not deepspeed_ops.heal_stale_lock(lock, recheck_s=0.01)
    finally:
        ninja.kill()
        ninja.wait()
    assert deepspeed_ops.heal_stale_lock(lock, recheck_s=0.01)


def test_without_process_information_only_an_old_lock_is_stale(tmp_path: Path, monkeypatch) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    monkeypatch.setattr(deepspeed_ops, "lock_in_use", lambda path: None)
    assert not deepspeed_ops.heal_stale_lock(lock, recheck_s=0.01)
    old = lock.stat().st_mtime - deepspeed_ops.STALE_LOCK_AGE_S - 60
    os.utime(lock, (old, old))
    assert deepspeed_ops.heal_stale_lock(lock, recheck_s=0.01)
    assert not lock.exists()


def test_a_stale_lock_in_the_cache_is_healed_and_deepspeed_loads_the_op(tmp_path: Path) -> None:
    """The hang a killed first build caused: the lock stays, no library is loaded. The build
    module removes it, (re)builds, and DeepSpeed's own loader then finds the op."""
    cache = _cache_with_op(tmp_path)
    _killed_holder(cache / OP / "lock")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache), DS_ACCELERATOR="cpu")
    result = subprocess.run(MODULE, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert result.returncode == 0, result.stderr
    assert "removed a stale DeepSpeed build lock" in result.stderr
    assert not (cache / OP / "lock").exists()
    code = "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None"
    loaded = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert loaded.returncode == 0, loaded.stderr


def test_a_build_that_dies_while_others_wait_is_healed_by_the_waiter(tmp_path: Path) -> None:
    """A second worker waits on the first one's build; the first is killed mid-build. The
    waiter notices (it checks the lock every few seconds), removes it and finishes."""
    cache = _cache_with_op(tmp_path)
    lock = cache / OP / "lock"
    builder = _holder(lock)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache), DS_ACCELERATOR="cpu")
    waiter = subprocess.Popen(MODULE, env=env, stderr=subprocess.PIPE, text=True)
    waiting = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in waiter.stderr:
            lines.append(line)
            if "still building" in line:
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # the waiter reports progress only while it waits on the (live) builder's lock
        assert waiting.wait(PATIENCE_S), "".join(lines)
        assert lock.exists()
        builder.send_signal(signal.SIGKILL)
        builder.wait()
        assert waiter.wait(PATIENCE_S) == 0, "".join(lines)
    finally:
        for proc in (builder, waiter):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reader.join(timeout=60)
    assert any("removed a stale DeepSpeed build lock" in line for line in lines), "".join(lines)
    assert not lock.exists()


@pytest.mark.slow
def test_a_built_cache_is_reused_by_deepspeed(tmp_path: Path) -> None:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), DS_ACCELERATOR="cpu")
    first = subprocess.run(MODULE, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert first.returncode == 0, first.stderr
    built = list((tmp_path / "ext").rglob(f"{OP}*.so"))
    assert built, "no shared library in the cache"
    mtime = built[0].stat().st_mtime
    code = "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None"
    second = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert second.returncode == 0, second.stderr
    assert built[0].stat().st_mtime == mtime, "DeepSpeed rebuilt the op instead of reusing it"
