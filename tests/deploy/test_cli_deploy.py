"""``userdp deploy render | secrets | probe`` against the real chart, real dev-CA certificates and
the real coordinator and worker health endpoints (gRPC on loopback, with and without mTLS)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
import yaml

from userdp.cli import main
from userdp.config import ConfigError, parse_config
from userdp.kubernetes.chart import (
    CHART_MANAGED_KEYS,
    DEFAULT_GROUP_PORT,
    DEFAULT_PORT,
    DEPLOY_PATHS,
    chart_fullname,
    worker_ids,
)
from userdp.kubernetes.probe import probe
from userdp.kubernetes.secrets import secret_manifests
from userdp.kubernetes.values import ShardSource, effective_config, render_values

# The chart has no default data source; tests about other things use the demo corpus.
DEMO = {"shardJob": {"demo": True}}

RUN_TOML = """
[strategy]
name = "uls"
steps = 50
clip_norm = 0.5
sampling_prob = 0.02

[privacy]
epsilon = 4.0
delta = 1e-6

[model]
preset = "gpt2-small"

[coordinator]
port = 7000
tls_dir = "certs"
auth_token_file = "token.txt"
checkpoint_every = 5

[workers]
count = 4
device = "cuda"
replicas = 2

[output]
dir = "runs/x"
seed = 3
"""


@pytest.fixture
def run_toml(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    return path


def test_render_moves_deployment_keys_to_chart_values(run_toml: Path) -> None:
    values, notes = render_values(run_toml, image="registry.local:5000/ml/userdp:0.1.0-cu128")
    assert values["image"] == {"repository": "registry.local:5000/ml/userdp", "tag": "0.1.0-cu128"}
    assert values["coordinator"] == {"port": 7000}
    assert values["workers"] == {"replicas": 4, "gpus": 1}
    assert values["tls"] == {"enabled": True}  # tls_dir and a token file: mTLS wins
    assert values["authToken"] == {"enabled": False}
    config = values["config"]
    assert config["strategy"] == {
        "name": "uls",
        "steps": 50,
        "clip_norm": 0.5,
        "sampling_prob": 0.02,
    }
    assert config["coordinator"] == {"checkpoint_every": 5}
    assert config["workers"] == {"replicas": 2}
    assert config["output"] == {"seed": 3}
    for section, keys in config.items():
        for key in keys:
            assert (section, key) not in CHART_MANAGED_KEYS
    moved = {note.split(" = ")[0] for note in notes if " is set by the chart" in note}
    assert moved == {
        "coordinator.port",
        "coordinator.tls_dir",
        "coordinator.auth_token_file",
        "workers.count",
        "workers.device",
        "output.dir",
    }


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("userdp", {"repository": "userdp", "tag": ""}),
        ("localhost:5000/userdp", {"repository": "localhost:5000/userdp", "tag": ""}),
        ("ghcr.io/org/userdp:v1", {"repository": "ghcr.io/org/userdp", "tag": "v1"}),
    ],
)
def test_render_splits_image_names(run_toml: Path, image: str, expected: dict) -> None:
    values, _ = render_values(run_toml, image=image)
    assert values["image"] == expected


def test_render_cli_writes_values_and_rejects_bad_configs(tmp_path: Path, run_toml: Path) -> None:
    out = tmp_path / "values.yaml"
    assert main(["deploy", "render", "--config", str(run_toml), "--values", str(out)]) == 0
    values = yaml.safe_load(out.read_text())
    assert values["workers"]["replicas"] == 4
    bad = tmp_path / "bad.toml"
    bad.write_text("[privacy]\ndelta = 1.5\n")
    with pytest.raises(ConfigError, match="privacy.delta"):
        render_values(bad)
    assert main(["deploy", "render", "--config", str(bad), "--values", str(out)]) == 2
    assert main(["deploy", "render", "--config", str(run_toml), "--values", "-", "--gpus", "-1"])


def test_render_gpus_reach_the_workers_launcher(tmp_path: Path, render_chart, run_toml) -> None:
    """`--gpus 4`: the values ask for four GPUs per worker and the chart runs four ranks."""
    out = tmp_path / "values.yaml"
    argv = ["deploy", "render", "--config", str(run_toml), "--values", str(out), "--gpus", "4"]
    assert main(argv) == 0
    values = yaml.safe_load(out.read_text())
    assert values["workers"]["gpus"] == 4
    objects = render_chart(values)
    worker = objects.container(objects.find("StatefulSet", "-worker"), "worker")
    assert worker["command"][0] == "torchrun" and "--nproc-per-node=4" in worker["command"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_a_cpu_configs_ranks_reach_the_workers_launcher(tmp_path: Path, render_chart) -> None:
    """A CPU config with workers.ranks = 2: no GPU is asked for, and each worker pod runs the
    two ranks under torchrun (values workers.cpuRanks), as `simulate` runs them."""
    config = tmp_path / "cpu.toml"
    workers = 'count = 4\ndevice = "cuda"\nreplicas = 2\n'
    assert workers in RUN_TOML
    config.write_text(RUN_TOML.replace(workers, "count = 2\nranks = 2\n"))
    values, notes = render_values(config)
    assert values["workers"] == {"replicas": 2, "gpus": 0, "cpuRanks": 2}
    assert any("workers.ranks = 2 is set by the chart" in n and "cpuRanks" in n for n in notes)
    objects = render_chart(values)
    worker = objects.container(objects.find("StatefulSet", "-worker"), "worker")
    assert worker["command"][0] == "torchrun" and "--nproc-per-node=2" in worker["command"]
    assert "nvidia.com/gpu" not in str(worker.get("resources", {}))
    values["workers"]["cpuRanks"] = 1
    objects = render_chart(values)
    worker = objects.container(objects.find("StatefulSet", "-worker"), "worker")
    assert "command" not in worker or worker["command"][0] != "torchrun"


def test_render_picks_token_auth_when_the_config_has_only_a_token(tmp_path: Path) -> None:
    path = tmp_path / "token.toml"
    path.write_text('[coordinator]\nauth_token_file = "t.txt"\n')
    values, _ = render_values(path)
    assert values["tls"] == {"enabled": False} and values["authToken"] == {"enabled": True}
    values, _ = render_values(path, auth="mtls")
    assert values["tls"] == {"enabled": True} and values["authToken"] == {"enabled": False}
    assert effective_config(values)["coordinator"]["tls_dir"] == DEPLOY_PATHS["tls_dir"]


def test_rendered_values_round_trip_through_the_chart(render_chart, validate_k8s, run_toml) -> None:
    values, _ = render_values(run_toml)
    objects = render_chart(values)
    for obj in objects:
        validate_k8s(obj)
    (text,) = objects.find("ConfigMap", "-config")["data"].values()
    rendered = tomllib.loads(text)
    # The Python mirror of the chart's overrides and the chart agree exactly.
    assert rendered == effective_config(values)
    # Every key of the user's file survives, except the ones the chart owns.
    original = tomllib.loads(RUN_TOML)
    for section, keys in original.items():
        for key, value in keys.items():
            if (section, key) not in CHART_MANAGED_KEYS:
                assert rendered[section][key] == value, f"{section}.{key}"
    assert rendered["coordinator"]["port"] == 7000
    assert rendered["coordinator"]["tls_dir"] == DEPLOY_PATHS["tls_dir"]
    assert "auth_token_file" not in rendered["coordinator"]
    assert rendered["workers"]["count"] == 4
    token_values, _ = render_values(run_toml, auth="token")
    (text,) = render_chart(token_values).find("ConfigMap", "-config")["data"].values()
    assert tomllib.loads(text) == effective_config(token_values)


def _collective_toml(tmp_path: Path, coordinator: str = "") -> Path:
    """RUN_TOML on the collective data plane, with extra ``[coordinator]`` lines."""
    path = tmp_path / "collective.toml"
    lines = f'[coordinator]\ndata_plane = "collective"\n{coordinator}'
    path.write_text(RUN_TOML.replace("[coordinator]\n", lines))
    return path


def test_render_collective_publishes_a_fixed_rendezvous_port(
    tmp_path: Path, render_chart, validate_k8s
) -> None:
    values, _ = render_values(_collective_toml(tmp_path))  # group_port 0: the chart's default
    assert values["coordinator"] == {"port": 7000, "groupPort": DEFAULT_GROUP_PORT}
    assert values["config"]["coordinator"] == {"data_plane": "collective", "checkpoint_every": 5}
    objects = render_chart(values)
    for obj in objects:
        validate_k8s(obj)
    (text,) = objects.find("ConfigMap", "-config")["data"].values()
    rendered = tomllib.loads(text)
    assert rendered == effective_config(values)
    assert rendered["coordinator"]["group_port"] == DEFAULT_GROUP_PORT
    assert parse_config(rendered).coordinator.group_port == DEFAULT_GROUP_PORT
    service = objects.find("Service", "-coordinator")["spec"]["ports"]
    ports = {p["name"]: p["port"] for p in service}
    assert ports == {"grpc": 7000, "rendezvous": DEFAULT_GROUP_PORT}
    worker = objects.container(objects.find("StatefulSet", "-worker"), "worker")
    assert {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"} in worker["env"]
    # A fixed group_port is carried over, and said to be the chart's.
    values, notes = render_values(_collective_toml(tmp_path, "group_port = 7100\n"))
    assert values["coordinator"] == {"port": 7000, "groupPort": 7100}
    assert "group_port" not in values["config"]["coordinator"]
    assert any(n.startswith("coordinator.group_port = 7100 is set by the chart") for n in notes)
    assert effective_config(values)["coordinator"]["group_port"] == 7100


@pytest.mark.parametrize(
    ("coordinator", "message"),
    [
        # group_port 0 becomes the default, which the gRPC port already is
        (f"port = {DEFAULT_GROUP_PORT}\n", "coordinator.group_port = 0, which the chart makes"),
        # port 0 becomes the default, which group_port already is
        (f"port = 0\ngroup_port = {DEFAULT_PORT}\n", f"coordinator.group_port = {DEFAULT_PORT} is"),
    ],
)
def test_render_refuses_a_rendezvous_port_that_is_the_grpc_port(
    tmp_path: Path, capsys, coordinator: str, message: str
) -> None:
    config = _collective_toml(tmp_path, coordinator)
    config.write_text(config.read_text().replace("port = 7000\n", ""))
    code, out, err = _render_cli(capsys, config)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("userdp deploy: error: ") and message in line
    assert line.endswith("set another coordinator.group_port")


def test_render_grpc_values_have_no_rendezvous_port(tmp_path: Path, run_toml: Path) -> None:
    values, _ = render_values(run_toml)
    assert values["coordinator"] == {"port": 7000}
    grpc = tmp_path / "grpc.toml"
    grpc.write_text(RUN_TOML.replace("[coordinator]\n", "[coordinator]\ngroup_port = 7100\n"))
    values, notes = render_values(grpc)
    assert values["coordinator"] == {"port": 7000}
    assert "group_port" not in effective_config(values)["coordinator"]
    assert any(n.startswith("coordinator.group_port = 7100 is set by the chart") for n in notes)


def _render_cli(capsys, config: Path, *flags: str) -> tuple[int, str, str]:
    """``userdp deploy render --config CONFIG --values - FLAGS`` -> (exit code, stdout, stderr)."""
    code = main(["deploy", "render", "--config", str(config), "--values", "-", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_render_without_data_shards_trains_on_the_demo_corpus_and_says_so_loudly(
    tmp_path: Path, capsys
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(RUN_TOML + "\n[data]\ndemo_users = 60\n")
    code, out, err = _render_cli(capsys, config)
    assert code == 0
    values = yaml.safe_load(out)
    assert values["shardJob"] == {"demo": True, "demoUsers": 60}
    assert "# shardJob.demo: true -- the run trains on the synthetic demo corpus" in out
    (warning,) = [line for line in err.splitlines() if line.startswith("WARNING")]
    assert "synthetic demo corpus (60 users), NOT on user data" in warning
    assert "--shards-claim" in warning and "--shard-input-claim" in warning
    # --demo asks for it explicitly, even with data.shards set; the warning stays.
    config.write_text(RUN_TOML + '\n[data]\nshards = "shards/chats"\n')
    code, out, err = _render_cli(capsys, config, "--demo")
    assert code == 0 and yaml.safe_load(out)["shardJob"]["demo"] is True
    assert any(line.startswith("WARNING: shardJob.demo=true") for line in err.splitlines())


def test_render_with_data_shards_refuses_without_the_shards_place_in_the_cluster(
    tmp_path: Path, capsys
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(RUN_TOML + '\n[data]\nshards = "shards/chats"\n')
    out_file = tmp_path / "values.yaml"
    argv = ["deploy", "render", "--config", str(config), "--values", str(out_file)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out_file.exists() and out == ""
    (line,) = err.strip().splitlines()
    shards = tmp_path / "shards" / "chats"  # a relative path is inside the config's folder
    assert line.startswith(f"userdp deploy: error: data.shards = '{shards}' is a folder on")
    assert "--shards-claim CLAIM" in line
    assert "--shard-input-claim CLAIM --shard-input-path PATH --user-column COLUMN" in line
    assert "WARNING" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shard-input-claim", "raw"], "needs --shard-input-path, --user-column, --text-column"),
        (
            ["--shard-input-claim", "raw", "--shard-input-path", "a.jsonl", "--user-column", "u"],
            "needs --text-column",
        ),
        (["--user-column", "u", "--shards-claim", "s"], "--user-column describe the dataset"),
        (
            ["--demo", "--shard-input-claim", "raw", "--shard-input-path", "a.jsonl"]
            + ["--user-column", "u", "--text-column", "t"],
            "--demo and --shard-input-claim",
        ),
    ],
)
def test_render_refuses_incomplete_or_contradictory_data_flags(
    tmp_path: Path, capsys, flags: list[str], message: str
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(RUN_TOML + '\n[data]\nshards = "shards/chats"\n')
    code, out, err = _render_cli(capsys, config, *flags)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert message in line


_DATASET_FLAGS = ["--shard-input-claim", "raw", "--shard-input-path", "chats/train.parquet"]
_DATASET_FLAGS += ["--user-column", "author", "--text-column", "body", "--tokenizer", "bpe:4096"]
SOURCE_FLAGS = {
    "existing-shards": ["--shards-claim", "chat-shards"],
    "dataset": _DATASET_FLAGS,
    "dataset-into-claim": [*_DATASET_FLAGS, "--shards-claim", "chat-shards"],
    "demo": ["--demo"],
}


def _render_source(tmp_path: Path, capsys, source: str) -> tuple[dict, str]:
    """(values, stderr) of ``deploy render`` for a config with data.shards and ``source``'s flags."""
    config = tmp_path / "run.toml"
    config.write_text(RUN_TOML + '\n[data]\nshards = "shards/chats"\nseq_len = 64\n')
    code, out, err = _render_cli(capsys, config, *SOURCE_FLAGS[source])
    assert code == 0, err
    return yaml.safe_load(out), err


@pytest.mark.parametrize("source", ["existing-shards", "dataset", "dataset-into-claim"])
def test_render_flags_place_the_shards_and_the_chart_follows(
    tmp_path: Path, capsys, render_chart, validate_k8s, source
) -> None:
    values, err = _render_source(tmp_path, capsys, source)
    assert "WARNING" not in err
    assert "note: data.shards = 'shards/chats' is set by the chart: /data/shards" in err
    assert values["shardJob"]["demo"] is False
    assert values["config"]["data"] == {"seq_len": 64}
    if source != "dataset":
        assert values["data"] == {"persistence": {"existingClaim": "chat-shards"}}
    else:
        assert "data" not in values
    if source != "existing-shards":
        assert values["shardJob"]["input"] == {
            "existingClaim": "raw",
            "path": "chats/train.parquet",
        }
        assert values["shardJob"]["tokenizer"] == "bpe:4096"
    objects = render_chart(values)
    for obj in objects:
        validate_k8s(obj)
    args = objects.container(objects.find("Job", "-shard"), "shard")["args"]
    if source == "existing-shards":
        assert args == ["shard", "verify", DEPLOY_PATHS["shards"]]
    else:
        assert args[:2] == ["shard", "/input/chats/train.parquet"]
        assert args[args.index("--tokenizer") + 1] == "bpe:4096"


@pytest.mark.parametrize("source", sorted(SOURCE_FLAGS))
def test_rendered_values_of_every_data_source_apply_with_kubectl_dry_run(
    tmp_path: Path, capsys, render_chart, kubectl_dry_run, source
) -> None:
    values, _ = _render_source(tmp_path, capsys, source)
    for out in kubectl_dry_run(render_chart(values)):
        assert "job.batch/demo-userdp-shard created (dry run)" in out


def test_shard_source_flags_are_not_needed_without_data_shards(run_toml: Path) -> None:
    values, _ = render_values(run_toml, shards=ShardSource(claim="chat-shards"))
    assert values["shardJob"] == {"demo": False}
    assert values["data"] == {"persistence": {"existingClaim": "chat-shards"}}


def test_chart_fullname_matches_the_chart(render_chart) -> None:
    for release in ("demo", "my-userdp", "userdp"):
        objects = render_chart(DEMO, release=release)
        sts = objects.find("StatefulSet", "-worker")
        assert sts["metadata"]["name"] == f"{chart_fullname(release)}-worker"
        assert worker_ids(release, 2) == [f"{sts['metadata']['name']}-{i}" for i in range(2)]


def test_secrets_hold_exactly_what_the_pods_mount(
    tmp_path: Path, render_chart, validate_k8s
) -> None:
    from userdp.server.certs import make_dev_ca

    certs = tmp_path / "certs"
    make_dev_ca(certs, ["coordinator", *worker_ids("demo", 3)], days=2)
    token = tmp_path / "token"
    token.write_text("0123456789abcdef-token\n")
    out = tmp_path / "secrets.yaml"
    argv = ["deploy", "secrets", "--tls-dir", str(certs), "--token-file", str(token)]
    argv += ["--release", "demo", "--workers", "3", "--namespace", "ml", "--out", str(out)]
    assert main(argv) == 0
    assert os.stat(out).st_mode & 0o777 == 0o600
    secrets = {s["metadata"]["name"]: s for s in yaml.safe_load_all(out.read_text())}
    for secret in secrets.values():
        validate_k8s(secret)
        assert secret["metadata"]["namespace"] == "ml"
    token_mode = render_chart({**DEMO, "tls": {"enabled": False}, "authToken": {"enabled": True}})
    deployment = token_mode.find("Deployment", "-coordinator")
    volumes = {v["name"]: v for v in token_mode.pod_spec(deployment)["volumes"]}
    token_secret = secrets[volumes["token"]["secret"]["secretName"]]
    assert {i["key"] for i in volumes["token"]["secret"]["items"]} == set(token_secret["data"])
    objects = render_chart(DEMO)
    deployment = objects.find("Deployment", "-coordinator")
    volumes = {v["name"]: v for v in objects.pod_spec(deployment)["volumes"]}
    coordinator_secret = secrets[volumes["tls"]["secret"]["secretName"]]
    assert {i["key"] for i in volumes["tls"]["secret"]["items"]} == set(coordinator_secret["data"])
    sts = objects.find("StatefulSet", "-worker")
    volumes = {v["name"]: v for v in objects.pod_spec(sts)["volumes"]}
    workers_secret = secrets[volumes["all-certs"]["secret"]["secretName"]]
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(3)]
    expected = {"ca.pem"} | {f"{p}.pem" for p in pods} | {f"{p}.key" for p in pods}
    assert set(workers_secret["data"]) == expected
    assert "coordinator.key" not in workers_secret["data"]


def test_secrets_refuse_a_missing_worker_certificate(tmp_path: Path) -> None:
    from userdp.server.certs import make_dev_ca

    make_dev_ca(tmp_path, ["coordinator", *worker_ids("demo", 2)], days=2)
    with pytest.raises(ValueError, match="demo-userdp-worker-2.pem"):
        secret_manifests(tmp_path, "demo", 3)
    with pytest.raises(ValueError, match="nothing to write"):
        secret_manifests(None, "demo", 3)


def test_probe_reads_the_worker_health_endpoint() -> None:
    from userdp.clients.grpc_client import WorkerHealth
    from userdp.proto.channels import WORKER_HEALTH_SERVICE

    health = WorkerHealth(port=0, host="127.0.0.1")
    try:
        address = f"127.0.0.1:{health.port}"
        assert probe(address, "") == (True, "SERVING")
        assert probe(address, WORKER_HEALTH_SERVICE) == (False, "NOT_SERVING")
        assert main(["deploy", "probe", "--address", address, "--service", ""]) == 0
        argv = ["deploy", "probe", "--address", address, "--service", WORKER_HEALTH_SERVICE]
        assert main(argv) == 1
        health.set_ready(True)
        assert main(argv) == 0
    finally:
        health.stop()
    ok, why = probe(address, "", timeout_s=0.5)
    assert not ok and why.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))


def test_probe_passes_the_coordinators_mtls_with_its_own_certificate(tmp_path: Path) -> None:
    from userdp.proto.channels import SERVICE_NAME, read_tls_files
    from userdp.server.auth import Authorizer
    from userdp.server.certs import make_dev_ca
    from userdp.server.grpc_server import serve
    from userdp.server.service import ModelPublisher, WorkerRegistry

    make_dev_ca(tmp_path / "tls", ["coordinator", "worker-0"], days=2)
    other = tmp_path / "other"
    make_dev_ca(other, ["coordinator"], days=2)  # a different CA
    server = serve(
        WorkerRegistry(),
        ModelPublisher(1 << 20),
        Authorizer.with_mtls(),
        {},
        host="127.0.0.1",
        port=0,
        tls=read_tls_files(tmp_path / "tls", "coordinator"),
    )
    try:
        tls = str(tmp_path / "tls")
        address = f"127.0.0.1:{server.port}"
        # Exactly the chart's exec probe, with the pod's paths replaced by the test's.
        argv = ["deploy", "probe", "--address", address, "--service", SERVICE_NAME]
        assert main([*argv, "--tls-dir", tls, "--cert-name", "coordinator"]) == 0
        assert probe(address, SERVICE_NAME, tls_dir=tls, cert_name="coordinator")[0]
        # Plain text (what a kubelet gRPC probe does) and a foreign CA are refused.
        assert not probe(address, SERVICE_NAME, timeout_s=2)[0]
        assert not probe(address, SERVICE_NAME, tls_dir=str(other), timeout_s=2)[0]
    finally:
        server.stop()


def test_probe_without_an_address_has_nothing_to_check(monkeypatch, capsys) -> None:
    monkeypatch.delenv("USERDP_HEALTH_ADDRESS", raising=False)
    assert main(["deploy", "probe"]) == 0
    assert "nothing to check" in capsys.readouterr().out
    monkeypatch.setenv("USERDP_HEALTH_ADDRESS", "127.0.0.1:1")
    assert main(["deploy", "probe", "--timeout", "0.5"]) == 1


PLUGIN = Path(__file__).resolve().parents[2] / "examples" / "plugin"


def test_render_ships_a_plugin_file_with_the_config(render_chart, validate_k8s, tmp_path) -> None:
    from userdp.config import parse_config

    (tmp_path / "warmup_uls.py").write_text((PLUGIN / "warmup_uls.py").read_text())
    run = tmp_path / "run.toml"
    run.write_text((PLUGIN / "run.toml").read_text() + '\n[output]\nreport_to = ["tensorboard"]\n')
    values, notes = render_values(run)
    assert values["plugin"]["files"] == {"warmup_uls.py": (PLUGIN / "warmup_uls.py").read_text()}
    assert any("shipped in the chart's ConfigMap" in n for n in notes)
    objects = render_chart(values)
    for obj in objects:
        validate_k8s(obj)
    data = objects.find("ConfigMap", "-config")["data"]
    assert data["warmup_uls.py"] == (PLUGIN / "warmup_uls.py").read_text()
    rendered = tomllib.loads(data["userdp.toml"])
    assert rendered == effective_config(values)
    assert rendered["strategy"]["plugin_path"] == DEPLOY_PATHS["config_dir"]
    assert rendered["strategy"]["params"] == {"learning_rate": 0.5, "warmup_steps": 2}
    assert rendered["output"]["report_to"] == ["tensorboard"]
    assert parse_config(rendered).strategy.name == "warmup_uls:WarmupUls"
    coordinator = objects.find("Deployment", "-coordinator")
    mounts = {
        m["name"]: m["mountPath"]
        for m in coordinator["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    assert mounts["config"] == DEPLOY_PATHS["config_dir"]  # the plugin file sits next to the config


def test_render_refuses_a_plugin_it_cannot_reach(tmp_path, capsys) -> None:
    run = tmp_path / "run.toml"
    run.write_text('[strategy]\nname = "nowhere_to_be_found:X"\n')
    assert main(["deploy", "render", "--config", str(run), "--values", "-"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot reach the plugin" in err and len(err.splitlines()) == 1
    run.write_text('[strategy]\nname = "json:JSONDecoder"\n')  # installed: the image must hold it
    values, notes = render_values(run)
    assert "plugin" not in values and any("must have it installed" in n for n in notes)


def test_render_ends_with_the_next_commands(tmp_path: Path, run_toml: Path, capsys) -> None:
    """`deploy render` says what comes next: without --image, that the default image is in no
    registry; with mTLS, the certificates and Secrets to create BEFORE helm install (named for
    the values' worker count); with a token, its Secret; then helm install with the file."""
    out = tmp_path / "values.yaml"
    assert main(["deploy", "render", "--config", str(run_toml), "--values", str(out)]) == 0
    err = capsys.readouterr().err
    steps = err[err.index("next:") :]
    assert "which is in no registry: build it (bash scripts/image.sh)" in steps
    workers = yaml.safe_load(out.read_text().split("\n", 2)[2])["workers"]["replicas"]
    ids = ",".join(worker_ids("RELEASE", workers))
    assert f"userdp certs dev-ca --out certs --names coordinator,{ids}" in steps
    assert f"--release RELEASE --workers {workers} --out secrets.yaml" in steps
    assert steps.rstrip().endswith(f"helm install RELEASE deploy/helm/userdp -f {out}")
    args = ["deploy", "render", "--config", str(run_toml), "--values", "-"]
    assert main([*args, "--image", "reg.example/userdp:1.0", "--auth", "token"]) == 0
    steps = capsys.readouterr().err.split("next:")[1]
    assert "push the image reg.example/userdp:1.0" in steps and "certs dev-ca" not in steps
    assert "userdp deploy secrets --token-file TOKEN --release RELEASE" in steps
    assert "rendezvous" not in steps
    # The collective data plane: the rendezvous port, and that the workers reach each other.
    collective = _collective_toml(tmp_path, "group_port = 7100\n")
    assert main(["deploy", "render", "--config", str(collective), "--values", "-"]) == 0
    steps = " ".join(capsys.readouterr().err.split("next:")[1].split())
    assert "the coordinator Service publishes the rendezvous port 7100" in steps
    assert "the worker pods must reach each other and the coordinator pod on any TCP port" in steps
    assert steps.endswith("helm install RELEASE deploy/helm/userdp -f THIS_FILE")
