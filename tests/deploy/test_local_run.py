"""The chart's pods, run as local processes with exactly the rendered command lines: the shard Job,
the coordinator (with its exec startup probe) and two workers, over real mTLS on loopback. Then a
coordinator restart: it resumes from its checkpoint and ledger, and the workers, restarted as the
StatefulSet restarts them after the finished run drained them, are resynced.

What differs from a cluster, and only that: each mount path is replaced by a temporary directory
(the ConfigMap file, the Secret files as the pod would see them, the data and state volumes), the
coordinator's Service name by 127.0.0.1, the bind address 0.0.0.0 by 127.0.0.1 (loopback only),
and each worker's health port by a free port (pods have their own network namespaces; processes
here share one).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from userdp.proto.channels import WORKER_HEALTH_SERVICE

from userdp.kubernetes.chart import DEPLOY_PATHS
from userdp.kubernetes.probe import probe

ENTRY_POINTS = ("userdp.cli.coordinator", "userdp.cli.worker", "userdp.clients.worker_service")
MOUNTS = ("/etc/userdp/config", "/etc/userdp/tls", "/etc/userdp/token", "/data", "/var/lib/userdp")


def _missing_modules() -> list[str]:
    """userdp modules that the coordinator and worker entry points import but that do not exist
    (yet): the end-to-end run skips, naming them, until every one of them is there."""
    missing, seen, todo = [], set(), list(ENTRY_POINTS)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            missing.append(name)
            continue
        if name not in ENTRY_POINTS:
            continue
        tree = ast.parse(Path(spec.origin).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("userdp."):
                todo.append(node.module)
    return sorted(missing)


def _ledger_steps(ledger: Path) -> list[dict]:
    """The ledger's step records (its first line is the header)."""
    lines = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
    return [r for r in lines if r.get("type") == "step"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _userdp() -> str:
    exe = Path(sys.executable).parent / "userdp"
    return str(exe) if exe.exists() else shutil.which("userdp")


class Pod:
    """One pod's view of the filesystem: mount path -> local directory."""

    def __init__(self, root: Path, name: str, shared: dict[str, Path]) -> None:
        self.name = name
        self.mounts = dict(shared)
        self.mounts["/etc/userdp/tls"] = root / f"tls-{name}"
        self.mounts["/etc/userdp/tls"].mkdir()
        for directory in self.mounts.values():
            directory.mkdir(exist_ok=True)

    def local(self, value: str) -> str:
        for mount in sorted(self.mounts, key=len, reverse=True):
            if value == mount or value.startswith(mount + "/"):
                return str(self.mounts[mount]) + value[len(mount) :]
        return value


def _expand(values: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Za-z_]+)\)", lambda m: env[m[1]], v) for v in values]


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        pytest.fail(f"{proc.args[:2]} did not finish in {timeout:.0f}s; output:\n{out[-4000:]}")


def test_the_shard_job_container_shards_then_only_verifies(tmp_path: Path, render_chart) -> None:
    objects = render_chart({"shardJob": {"demo": True, "demoUsers": 12, "numShards": 2}})
    data = Pod(tmp_path, "job", {"/data": tmp_path / "data"})
    job = objects.find("Job", "-shard")
    shard = objects.container(job, "shard")
    assert shard["command"][0] == "/bin/sh"
    argv = [data.local(v) for v in shard["command"] + shard["args"]]
    env = dict(os.environ, PATH=f"{Path(_userdp()).parent}{os.pathsep}{os.environ['PATH']}")
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    manifest = Path(data.local(DEPLOY_PATHS["shards"])) / "manifest.json"
    assert json.loads(manifest.read_text())["num_shards"] == 2
    before = manifest.stat().st_mtime_ns
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "ok (2 shards, 12 users" in second.stdout
    assert manifest.stat().st_mtime_ns == before


@pytest.mark.slow
def test_the_rendered_pods_run_a_training_job_and_survive_a_coordinator_restart(
    tmp_path: Path, render_chart
) -> None:
    missing = _missing_modules()
    if missing:
        pytest.skip(f"coordinator/worker runtime not there yet: {', '.join(missing)}")
    from userdp.server.certs import make_dev_ca

    port = _free_port()
    values = {
        "config": {
            "strategy": {"steps": 2, "sampling_prob": 0.3, "group_size": 2, "engine": "loop"},
            "privacy": {"noise_multiplier": 1.0},
            "model": {"preset": "gpt2-tiny"},
            "data": {"seq_len": 32},
            "coordinator": {"step_deadline_s": 120.0, "checkpoint_every": 1},
            "output": {"plots": False, "seed": 0},
        },
        "coordinator": {"port": port},
        "workers": {"replicas": 2, "gpus": 0},
        "shardJob": {"demo": True, "demoUsers": 30, "numShards": 2},
    }
    objects = render_chart(values)
    shared = {
        "/etc/userdp/config": tmp_path / "config",
        "/etc/userdp/token": tmp_path / "token",
        "/data": tmp_path / "data",
        "/var/lib/userdp": tmp_path / "state",
    }
    for directory in shared.values():
        directory.mkdir()
    assert set(shared) | {"/etc/userdp/tls"} == set(MOUNTS)

    # The ConfigMap, as mounted (bind address and paths made local).
    configmap = objects.find("ConfigMap", "-config")
    (key, text) = next(iter(configmap["data"].items()))
    text = text.replace('host = "0.0.0.0"', 'host = "127.0.0.1"')
    for mount, directory in shared.items():
        text = text.replace(f'"{mount}/', f'"{directory}/')
    job_pod = Pod(tmp_path, "job", shared)
    env = dict(os.environ, PATH=f"{Path(_userdp()).parent}{os.pathsep}{os.environ['PATH']}")

    # 1. The shard Job's container, twice: it shards, then only verifies.
    job = objects.find("Job", "-shard")
    shard = objects.container(job, "shard")
    argv = [job_pod.local(v) for v in shard["command"] + shard["args"]]
    for _ in range(2):
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    assert "ok (" in result.stdout  # the second run was `userdp shard verify`
    assert (Path(job_pod.local(DEPLOY_PATHS["shards"])) / "manifest.json").is_file()

    # 2. Certificates as each pod's volume holds them.
    sts = objects.find("StatefulSet", "-worker")
    worker_names = [f"{sts['metadata']['name']}-{i}" for i in range(2)]
    make_dev_ca(tmp_path / "certs", ["coordinator", *worker_names], days=1)

    def pod(name: str, cert: str) -> Pod:
        p = Pod(tmp_path, name, shared)
        tls = p.mounts["/etc/userdp/tls"]
        for f in ("ca.pem", f"{cert}.pem", f"{cert}.key"):
            shutil.copy(tmp_path / "certs" / f, tls / f)
        return p

    coordinator_pod = pod("coordinator", "coordinator")
    config_file = Path(coordinator_pod.local(DEPLOY_PATHS["config_file"]))
    # coordinator.tls_dir is read by the coordinator only (workers take --tls-dir).
    text = text.replace(
        f'"{DEPLOY_PATHS["tls_dir"]}"', f'"{coordinator_pod.mounts["/etc/userdp/tls"]}"'
    )
    config_file.write_text(text)
    assert config_file.name == key

    # 3. The coordinator's container and its exec startup probe.
    deployment = objects.find("Deployment", "-coordinator")
    container = objects.container(deployment, "coordinator")
    coordinator_argv = [_userdp(), *[coordinator_pod.local(a) for a in container["args"]]]
    probe_argv = [coordinator_pod.local(a) for a in container["startupProbe"]["exec"]["command"]]

    def start_coordinator() -> subprocess.Popen:
        proc = subprocess.Popen(
            coordinator_argv,
            env=dict(env, POD_NAME="coordinator-0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"coordinator exited {proc.returncode}:\n{proc.stdout.read()[-4000:]}")
            probed = subprocess.run(probe_argv, env=env, capture_output=True, timeout=60)
            if probed.returncode == 0:
                return proc
            time.sleep(1)
        proc.kill()
        pytest.fail("the coordinator's startup probe never succeeded")

    coordinator = start_coordinator()

    # 4. The workers' containers.
    worker_container = objects.container(sts, "worker")
    health_ports = [_free_port() for _ in worker_names]
    worker_pods = [pod(name, name) for name in worker_names]

    def start_workers() -> list[subprocess.Popen]:
        procs = []
        for name, worker_pod, health_port in zip(
            worker_names, worker_pods, health_ports, strict=True
        ):
            argv = _expand(worker_container["args"], {"POD_NAME": name})
            argv = [worker_pod.local(a) for a in argv]
            argv[argv.index("--coordinator") + 1] = f"127.0.0.1:{port}"
            argv[argv.index("--health-port") + 1] = str(health_port)
            procs.append(
                subprocess.Popen(
                    [_userdp(), *argv],
                    env=dict(env, POD_NAME=name),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        return procs

    def drained(procs: list[subprocess.Popen]) -> None:
        """A finished run drains its workers: they exit 0 (the StatefulSet restarts them)."""
        for proc in procs:
            assert _wait(proc, 120) == 0, proc.stdout.read()[-4000:]

    workers = start_workers()
    try:
        # The readiness probe's service turns SERVING once a worker holds the coordinator's model.
        ready = set()
        deadline = time.monotonic() + 600
        while coordinator.poll() is None and time.monotonic() < deadline:
            for health_port in health_ports:
                if probe(f"127.0.0.1:{health_port}", WORKER_HEALTH_SERVICE, timeout_s=2)[0]:
                    ready.add(health_port)
            time.sleep(0.5)
        assert _wait(coordinator, 60) == 0, coordinator.stdout.read()[-4000:]
        assert ready == set(health_ports), "a worker never became ready"
        drained(workers)
        ledger = Path(coordinator_pod.local(DEPLOY_PATHS["output_dir"])) / "ledger.jsonl"
        assert len(_ledger_steps(ledger)) == 2
        checkpoints = ledger.parent / "checkpoints"
        assert any(checkpoints.iterdir())
        report = json.loads((ledger.parent / "privacy_report.json").read_text())
        assert report["steps"] == 2 and report["epsilon"] > 0
        assert (ledger.parent / "model" / "config.json").is_file()
        assert "noise_multiplier = 1.0" in (ledger.parent / "config.toml").read_text()

        # 5. Restart with one more step: resume from checkpoint + ledger; restarted workers
        # (as the StatefulSet restarts them) are resynced to the checkpointed model.
        assert "steps = 2" in text
        config_file.write_text(text.replace("steps = 2", "steps = 3"))
        coordinator = start_coordinator()
        workers = start_workers()
        assert _wait(coordinator, 600) == 0, coordinator.stdout.read()[-4000:]
        assert len(_ledger_steps(ledger)) == 3, "a resumed run must add exactly the missing step"
        drained(workers)
    finally:
        for proc in (coordinator, *workers):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in workers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
