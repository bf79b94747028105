"""``userdp simulate`` with workers on a CUDA device (skipped without one; ``pytest -m gpu`` on a
GPU machine): two real gRPC worker processes computing on the GPU give the same model updates as
two CPU worker processes (noise off through the test-only switch), and every tensor moves. Both
runs use worker processes: DeepSpeed picks one accelerator per process, so a CPU engine cannot
be built in a process that already built a CUDA one."""

from __future__ import annotations

import pytest

from tests.userdp.test_simulate import assert_same_updates, small_config
from userdp.run.launch import run

pytestmark = pytest.mark.gpu


def test_cuda_workers_equal_cpu_workers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # the worker processes' float32 is exact
    base = small_config(tmp_path, steps=2)
    gpu = base.model_copy(update={"workers": base.workers.model_copy(update={"device": "cuda"})})
    a = run(gpu, tmp_path / "gpu", mode="grpc", quiet=True, test_only_disable_noise=True)
    b = run(base, tmp_path / "cpu", mode="grpc", quiet=True, test_only_disable_noise=True)
    assert_same_updates(a, b, base, 2, rtol=1e-4, atol=1e-5)
