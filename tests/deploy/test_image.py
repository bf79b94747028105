"""The built image (``scripts/image.sh``) runs the chart's pods: the shard Job, the coordinator and
two workers, each with the rendered command line and the pod's mounts as real volumes, on the
host network, for a 2-step demo run whose ledger and report land on the state volume.

Set ``USERDP_IMAGE`` (e.g. ``localhost/userdp:cpu``) to run it; it is slow (marked) and skipped
otherwise. Each pod runs in a container of the image (``podman run``) or, where the engine's OCI
runtime cannot start containers (``USERDP_IMAGE_RUNNER=chroot``, root only), in a writable
copy of the image's filesystem (``podman create`` + ``podman mount``) entered with ``chroot`` as
the image's user, with the image's environment and working directory, and the mounts bound in a
private mount namespace.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from userdp.kubernetes.chart import DEPLOY_PATHS

IMAGE = os.environ.get("USERDP_IMAGE", "")
RUNNER = os.environ.get("USERDP_IMAGE_RUNNER", "podman")
ENGINE = os.environ.get("USERDP_IMAGE_ENGINE", "podman")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not IMAGE, reason="set USERDP_IMAGE to an image built by scripts/image.sh"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    """Starts one pod's container from the image: argv after the entrypoint (or a replacement
    entrypoint), mounts {container path: host path}, environment."""

    def __init__(self, image: str, mode: str) -> None:
        if mode not in ("podman", "chroot"):
            raise ValueError(f"USERDP_IMAGE_RUNNER must be podman or chroot, got {mode!r}")
        if shutil.which(ENGINE) is None:
            pytest.skip(f"{ENGINE} not installed")
        self.image, self.mode = image, mode
        config = json.loads(
            subprocess.run(
                [ENGINE, "image", "inspect", image, "--format", "{{json .Config}}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        self.entrypoint = config["Entrypoint"]
        self.env = dict(item.split("=", 1) for item in config["Env"])
        self.user = config["User"]
        self.workdir = config["WorkingDir"] or "/"
        self.containers: list[str] = []

    def start(
        self,
        argv: list[str],
        mounts: dict[str, Path],
        env: dict[str, str],
        entrypoint: list[str] | None = None,
    ) -> subprocess.Popen:
        command = (entrypoint or self.entrypoint) + argv
        name = f"userdp-test-{uuid.uuid4().hex[:8]}"
        if self.mode == "podman":
            cmd = [ENGINE, "run", "--rm", "--name", name, "--network", "host"]
            for target, source in mounts.items():
                cmd += ["--volume", f"{source}:{target}"]
            for key, value in env.items():
                cmd += ["--env", f"{key}={value}"]
            cmd += ["--entrypoint", json.dumps(command[:1]), self.image, *command[1:]]
            self.containers.append(name)
        else:
            subprocess.run(
                [ENGINE, "create", "--name", name, self.image], check=True, capture_output=True
            )
            self.containers.append(name)
            root = subprocess.run(
                [ENGINE, "mount", name], check=True, capture_output=True, text=True
            ).stdout.strip()
            binds = ["mount -t proc proc {root}/proc", "mount --rbind /dev {root}/dev"]
            for target, source in mounts.items():
                binds.append(f"mkdir -p {root}{target} && mount --bind {source} {root}{target}")
            script = " && ".join(b.format(root=shlex.quote(root)) for b in binds)
            environment = [f"{k}={v}" for k, v in {**self.env, **env}.items()]
            inner = [
                "env",
                "-i",
                *environment,
                "sh",
                "-c",
                f'cd {self.workdir} && exec "$@"',
                "-",
                *command,
            ]
            script += f" && exec chroot --userspec={self.user} {shlex.quote(root)} " + shlex.join(
                inner
            )
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def close(self) -> None:
        for name in self.containers:
            if self.mode == "chroot":
                subprocess.run([ENGINE, "umount", name], capture_output=True)
            subprocess.run([ENGINE, "rm", "--force", name], capture_output=True)


def _finish(proc: subprocess.Popen, timeout: float, what: str) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout:.0f} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def test_the_image_runs_the_charts_pods_for_a_demo_run(tmp_path: Path, render_chart) -> None:
    from userdp.server.certs import make_dev_ca

    runner = Runner(IMAGE, RUNNER)
    uid = int(runner.user.split(":")[0])
    port = _free_port()
    objects = render_chart(
        {
            "config": {
                "strategy": {"steps": 2, "sampling_prob": 0.3, "group_size": 2, "engine": "loop"},
                "privacy": {"noise_multiplier": 1.0},
                "model": {"preset": "gpt2-tiny"},
                "data": {"seq_len": 32},
                "coordinator": {"step_deadline_s": 300.0},
                "output": {"plots": False, "seed": 0},
            },
            "coordinator": {"port": port},
            "workers": {"replicas": 2, "gpus": 0},
            "shardJob": {"demo": True, "demoUsers": 30, "numShards": 2},
        }
    )
    volumes = {name: tmp_path / name for name in ("config", "data", "state")}
    for directory in volumes.values():
        directory.mkdir()
        os.chown(directory, uid, uid) if os.geteuid() == 0 else directory.chmod(0o777)
    configmap = objects.find("ConfigMap", "-config")
    (key, text) = next(iter(configmap["data"].items()))
    (volumes["config"] / key).write_text(text.replace('host = "0.0.0.0"', 'host = "127.0.0.1"'))
    shared = {
        "/etc/userdp/config": volumes["config"],
        "/data": volumes["data"],
        "/var/lib/userdp": volumes["state"],
    }
    sts = objects.find("StatefulSet", "-worker")
    workers = [f"{sts['metadata']['name']}-{i}" for i in range(2)]
    make_dev_ca(tmp_path / "certs", ["coordinator", *workers], days=1)

    def tls(name: str) -> Path:
        folder = tmp_path / f"tls-{name}"
        folder.mkdir()
        for f in ("ca.pem", f"{name}.pem", f"{name}.key"):
            shutil.copy(tmp_path / "certs" / f, folder / f)
            if os.geteuid() == 0:
                os.chown(folder / f, uid, uid)
        return folder

    try:
        # 1. The shard Job writes the demo shards onto the data volume.
        shard = objects.container(objects.find("Job", "-shard"), "shard")
        job = runner.start(
            shard["args"], {"/data": volumes["data"]}, {}, entrypoint=shard["command"]
        )
        _finish(job, 600, "the shard Job")
        assert (volumes["data"] / Path(DEPLOY_PATHS["shards"]).name / "manifest.json").is_file()

        # 2. The coordinator, until its own startup probe passes.
        deployment = objects.find("Deployment", "-coordinator")
        container = objects.container(deployment, "coordinator")
        coordinator = runner.start(
            container["args"],
            {**shared, "/etc/userdp/tls": tls("coordinator")},
            {"POD_NAME": "coordinator-0"},
        )
        address = f"127.0.0.1:{port}"
        coordinator_tls = str(tmp_path / "tls-coordinator")
        startup = [
            a.replace("/etc/userdp/tls", coordinator_tls)
            for a in container["startupProbe"]["exec"]["command"]
        ]
        host_env = dict(
            os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        )
        deadline = time.monotonic() + 600
        while subprocess.run(startup, env=host_env, capture_output=True, timeout=60).returncode:
            if coordinator.poll() is not None or time.monotonic() > deadline:
                _finish(coordinator, 5, "the coordinator (before serving)")
            time.sleep(1)

        # 3. Two workers; the run ends by draining them.
        spec = objects.container(sts, "worker")
        procs = []
        for name in workers:
            argv = [a.replace("$(POD_NAME)", name) for a in spec["args"]]
            argv[argv.index("--coordinator") + 1] = address
            argv[argv.index("--health-port") + 1] = str(_free_port())
            procs.append(
                runner.start(argv, {**shared, "/etc/userdp/tls": tls(name)}, {"POD_NAME": name})
            )
        # A worker exits 0 only on the coordinator's Drain, which reaches connected workers; one
        # that never connected would retry until --reconnect-timeout and exit 4.
        _finish(coordinator, 900, "the coordinator")
        for proc, name in zip(procs, workers, strict=True):
            _finish(proc, 120, f"worker {name}")

        run_dir = volumes["state"] / Path(DEPLOY_PATHS["output_dir"]).relative_to("/var/lib/userdp")
        steps = [
            r
            for r in map(json.loads, (run_dir / "ledger.jsonl").read_text().splitlines())
            if r.get("type") == "step"
        ]
        assert len(steps) == 2
        report = json.loads((run_dir / "privacy_report.json").read_text())
        assert report["steps"] == 2 and report["epsilon"] > 0
    finally:
        runner.close()
