"""Multi-rank workers on CPU (DeepSpeed, gloo), serving a real coordinator over gRPC.

The chart's worker with ``workers.gpus > 1``: its launcher command (``torchrun ... --no-python
userdp``) starts a 2-rank ``userdp worker``. Without noise (the test-only switch), the run ends
with the same model as the in-process reference run of the same config, so every released step
is the clipped sum of each sampled unit counted once; the coordinator's drain ends both ranks and
the launcher with status 0. At ZeRO stage 3 the two ranks hold half of each parameter and the
run ends with the same model as the in-process run of the same config at stage 0; so does
``simulate`` with two such workers (``workers.ranks = 2``), through a killed worker and a
resume."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from userdp.proto.channels import WORKER_HEALTH_SERVICE

from userdp.config import parse_config
from userdp.kubernetes.probe import probe
from userdp.run.components import prepare_run
from userdp.run.grpc_workers import kill_tree
from userdp.run.launch import run
from userdp.run.outputs import config_toml

RENDEZVOUS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path: Path, port: int, zero_stage: int = 0, steps: int = 2):
    return parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 32, "eval_fraction": 0.1},
            "model": {"preset": "gpt2-tiny", "zero_stage": zero_stage},
            "strategy": {
                "steps": steps,
                "sampling_prob": 0.3,
                "group_size": 2,
                "engine": "vectorized",
                "sampler_seed": 0,  # one cohort per step in both runs
                "server_optimizer": "sgd",
                "server_lr": 0.5,
            },
            "privacy": {"epsilon": 20.0},
            "workers": {"count": 1, "device": "cpu"},
            "coordinator": {"host": "127.0.0.1", "port": port, "step_deadline_s": 300.0},
            "output": {"dir": str(tmp_path / "run"), "seed": 0, "plots": False},
        }
    )


def _launcher(render_chart) -> list[str]:
    """The worker container's command for two GPUs, with this venv's torchrun."""
    objects = render_chart({"shardJob": {"demo": True}, "workers": {"gpus": 2}})
    sts = objects.find("StatefulSet", "-worker")
    command = objects.container(sts, "worker")["command"]
    assert command[0] == "torchrun" and command[-2:] == ["--no-python", "userdp"]
    return [str(Path(sys.executable).parent / "torchrun"), *command[1:]]


def _start_worker(
    tmp_path: Path, config, render_chart, health_port: int, log_path: Path
) -> subprocess.Popen:
    """The chart's two-rank worker ``w0`` for ``config``, its output in ``log_path``."""
    worker_config = tmp_path / "worker.toml"
    worker_config.write_text(config_toml(config))
    shards = prepare_run(config).shard_dir
    argv = _launcher(render_chart) + [
        "worker",
        "--coordinator",
        f"127.0.0.1:{config.coordinator.port}",
    ]
    argv += ["--shards", str(shards), "--config", str(worker_config), "--worker-id", "w0"]
    argv += ["--health-port", str(health_port), "--reconnect-timeout", "600"]
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env)


def _in_process_reference(tmp_path: Path, config):
    """The noiseless in-process run of ``config`` at ZeRO stage 0 (the same model and units)."""
    return run(
        config.model_copy(
            update={
                "coordinator": config.coordinator.model_copy(update={"port": 0}),
                "model": config.model.model_copy(update={"zero_stage": 0}),
            }
        ),
        tmp_path / "local",
        mode="in-process",
        quiet=True,
        test_only_disable_noise=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_the_charts_two_rank_worker_serves_a_coordinator_like_one_process(
    tmp_path: Path, render_chart, zero_stage: int
) -> None:
    port, health_port = _free_port(), _free_port()
    config = _config(tmp_path, port, zero_stage)
    log_path = tmp_path / "worker.log"
    worker = _start_worker(tmp_path, config, render_chart, health_port, log_path)
    ready: list[bool] = []
    stop_probing = threading.Event()

    def probe_rank_0() -> None:  # the pod's readiness probe, while the run goes on
        while not stop_probing.wait(0.5) and not ready:
            if probe(f"127.0.0.1:{health_port}", WORKER_HEALTH_SERVICE, timeout_s=2)[0]:
                ready.append(True)

    prober = threading.Thread(target=probe_rank_0, daemon=True)
    prober.start()
    try:
        ranked = run(
            config, tmp_path / "ranks", mode="external", quiet=True, test_only_disable_noise=True
        )
        returncode = worker.wait(timeout=180)  # drained at the end of the run
    finally:
        stop_probing.set()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    output = log_path.read_text(errors="replace")
    assert returncode == 0, output[-4000:]
    assert ready, "rank 0 never served the readiness probe"
    assert "[rank 1]: stopped by rank 0" in output, output[-4000:]
    if zero_stage == 3:  # each rank holds half of the parameters at rest
        assert "ZeRO-3: rank 1 holds" in output, output[-4000:]
    assert ranked.steps_done == 2

    reference = _in_process_reference(tmp_path, config)
    assert reference.steps_done == 2
    initial = prepare_run(config).trainable
    for name, value in ranked.params.items():
        torch.testing.assert_close(value, reference.params[name], rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(value, initial[name]), f"{name} did not move"


@pytest.mark.slow
def test_a_zero3_worker_killed_mid_run_is_replaced_and_the_run_ends_as_in_process(
    tmp_path: Path, render_chart, monkeypatch
) -> None:
    """SIGKILL to the launcher and both ranks of a stage-3 worker as the coordinator starts
    gathering step 2 (it has sent that step's tasks or is about to); a new worker with the same
    id joins, is resynced with the whole model (written into its partitions), the coordinator
    re-issues what was lost, and the noiseless run ends with the in-process run's model."""
    from userdp.server.fleet import Fleet

    port, health_port = _free_port(), _free_port()
    steps, kill_at = 4, 2
    config = _config(tmp_path, port, zero_stage=3, steps=steps)
    workers: list[subprocess.Popen] = []
    gather = Fleet.gather

    def gather_killing_the_worker_once(fleet, collect, spec):
        if collect.step == kill_at and len(workers) == 1:
            kill_tree(workers[0])
            second_log = tmp_path / "second.log"
            workers.append(_start_worker(tmp_path, config, render_chart, health_port, second_log))
        return gather(fleet, collect, spec)

    monkeypatch.setattr(Fleet, "gather", gather_killing_the_worker_once)
    workers.append(
        _start_worker(tmp_path, config, render_chart, health_port, tmp_path / "first.log")
    )
    try:
        ranked = run(
            config, tmp_path / "ranks", mode="external", quiet=True, test_only_disable_noise=True
        )
        assert len(workers) == 2, "the worker was never killed"
        returncode = workers[1].wait(timeout=180)  # drained at the end of the run
    finally:
        for proc in workers:
            kill_tree(proc)
    first = (tmp_path / "first.log").read_text(errors="replace")
    output = (tmp_path / "second.log").read_text(errors="replace")
    assert workers[0].returncode != 0 and "drained by coordinator" not in first, first[-4000:]
    assert returncode == 0, output[-4000:]
    assert "ZeRO-3: rank 1 holds" in output and "drained by coordinator" in output, output[-4000:]
    assert ranked.steps_done == steps
    reference = _in_process_reference(tmp_path, config)
    for name, value in ranked.params.items():
        torch.testing.assert_close(value, reference.params[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_simulate_with_two_zero3_workers_of_two_ranks_survives_a_kill_and_resumes(
    tmp_path: Path, monkeypatch
) -> None:
    """``simulate`` (gRPC) with two workers of two ranks each at ZeRO stage 3, every shard held
    by both. Worker 0 (launcher and both ranks) is SIGKILLed as the coordinator starts gathering
    step 1, whose tasks worker 1 then computes; the run is interrupted after step 2 and run
    again, which resumes from its checkpoint with fresh workers for step 3. Without noise the
    run ends with the in-process run's model, each step in the ledger once."""
    import json

    from userdp.server.fleet import Fleet

    from userdp.run import grpc_workers
    from userdp.run.loop import RunLoop

    base = _config(tmp_path, _free_port(), zero_stage=3, steps=4)
    workers = base.workers.model_copy(update={"count": 2, "ranks": 2, "replicas": 2})
    config = base.model_copy(update={"workers": workers})
    spawned: list[subprocess.Popen] = []
    spawn, gather, on_step = grpc_workers._spawn_workers, Fleet.gather, RunLoop.on_step

    def spawn_and_keep(loop, address):
        spawned[:] = spawn(loop, address)
        return spawned

    killed: list[int] = []

    def gather_killing_worker_0_once(fleet, collect, spec):
        if collect.step == 1 and not killed:
            kill_tree(spawned[0])
            killed.append(spawned[0].returncode)
        return gather(fleet, collect, spec)

    def interrupt_after_step_2(self, step, *args):
        on_step(self, step, *args)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(grpc_workers, "_spawn_workers", spawn_and_keep)
    monkeypatch.setattr(Fleet, "gather", gather_killing_worker_0_once)
    monkeypatch.setattr(RunLoop, "on_step", interrupt_after_step_2)
    out = tmp_path / "sim"
    first = run(config, out, mode="grpc", quiet=True, test_only_disable_noise=True)
    assert killed and first.steps_done == 3
    survivor = (out / "logs" / "worker-1.log").read_text(errors="replace")
    assert "ZeRO-3: rank 1 holds" in survivor, survivor[-4000:]
    monkeypatch.setattr(RunLoop, "on_step", on_step)
    second = run(config, out, mode="grpc", quiet=True, test_only_disable_noise=True)
    assert second.steps_done == 4
    assert all(proc.poll() is not None for proc in spawned)  # drained or stopped, ranks too
    ledger = (out / "ledger.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in ledger if '"step"' in line] == [0, 1, 2, 3]
    reference = _in_process_reference(tmp_path, config)
    assert reference.steps_done == 4
    for name, value in second.params.items():
        torch.testing.assert_close(value, reference.params[name], rtol=1e-5, atol=1e-6, msg=name)
