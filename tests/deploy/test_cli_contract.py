"""The manifests and the CLI cannot drift apart: every ``userdp`` command line the chart renders
(container args, the shard Job's script, exec probes, the worker's launcher, with Kubernetes'
``$(VAR)`` expansion) parses with ``userdp.cli.build_parser()``; the launcher's own arguments
parse with torch's ``torchrun`` parser; the config path it passes is where the ConfigMap is
mounted; probe ports and services are the ones the coordinator and worker serve."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
from userdp.proto.channels import SERVICE_NAME, WORKER_HEALTH_SERVICE

from userdp.cli import build_parser
from userdp.kubernetes.chart import DEPLOY_PATHS

SHARD_JOB_SCRIPT = 'if [ -f "$1/manifest.json" ]; then exec userdp shard verify "$1"; fi'
# The chart has no default data source; tests about other things use the demo corpus.
DEMO = {"shardJob": {"demo": True}}

VARIANTS = [
    DEMO,
    {
        **DEMO,
        "tls": {"enabled": False},
        "authToken": {"enabled": True, "existingSecret": "t"},
        "workers": {"gpus": 0, "verifyShards": True},
    },
    {
        "shardJob": {
            "demo": False,
            "input": {"existingClaim": "raw", "path": "/chats.jsonl"},
            "userColumn": "author",
            "textColumn": "body",
            "maxExamplesPerUser": 32,
            "keepText": True,
            "datasetName": "chats",
            "format": "jsonl",
            "tokenizer": "bpe:2048",
        },
        "coordinator": {"port": 6000},
        "workers": {"healthPort": 9000},
    },
    # shards already on a claim: the Job runs `userdp shard verify` only
    {"data": {"persistence": {"existingClaim": "shards"}}},
    # four GPUs per worker: `torchrun ... --no-python userdp worker ...`, one rank per GPU
    {**DEMO, "workers": {"gpus": 4}},
]
LAUNCHER = "torchrun"


def _subcommands(parser) -> set[str]:
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return set(action.choices)


def full_parser():
    """``build_parser()``, plus ``userdp.cli.<command>`` modules that exist on disk but are not in
    COMMAND_MODULES yet (so the contract is checked as soon as a command's module lands;
    test_manifest_commands_are_registered says when one still needs registering)."""
    parser = build_parser()
    registered = _subcommands(parser)
    (action,) = [a for a in parser._actions if a.dest == "command"]
    for command in ("coordinator", "worker"):
        module = f"userdp.cli.{command}"
        if command not in registered and importlib.util.find_spec(module) is not None:
            importlib.import_module(module).register(action)
    return parser


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value)


def _pod_env(obj: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    pod_name = obj["metadata"]["name"] + ("-0" if obj["kind"] == "StatefulSet" else "-abcde")
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[item["name"]] = pod_name
        else:
            env[item["name"]] = "field"
    return env


def userdp_command_lines(objects) -> list[tuple[str, list[str], dict[str, Any], dict[str, Any]]]:
    """(where, argv after `userdp`, container, workload) for every userdp call in the pods."""
    found = []
    for obj in objects:
        if obj["kind"] not in {"Deployment", "StatefulSet", "Job"}:
            continue
        pod = objects.pod_spec(obj)
        for c in pod["containers"] + pod.get("initContainers", []):
            env = _pod_env(obj, c)
            command = [_expand(part, env) for part in c.get("command", [])]
            args = [_expand(part, env) for part in c.get("args", [])]
            where = f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}"
            if not command:
                found.append((where, args, c, obj))  # the image's ENTRYPOINT is userdp
            elif command[0] == "userdp":
                found.append((where, command[1:] + args, c, obj))
            elif command[0] == LAUNCHER:
                launcher = torchrun_args(command[1:] + args)
                found.append((f"{where} ({LAUNCHER})", launcher.training_script_args, c, obj))
            elif command[:2] == ["/bin/sh", "-c"] and 'exec userdp "$@"' in command[2]:
                assert command[2].startswith(SHARD_JOB_SCRIPT), command[2]
                positional = command[4:]  # $0 is command[3]
                found.append((f"{where} (verify)", ["shard", "verify", positional[0]], c, obj))
                found.append((where, positional[1:] + args, c, obj))
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind, {})
                if probe.get("exec", {}).get("command", [""])[0] == "userdp":
                    argv = [_expand(p, env) for p in probe["exec"]["command"][1:]]
                    found.append((f"{where} {kind}", argv, c, obj))
    return found


def torchrun_args(argv: list[str]):
    """``torchrun``'s arguments parsed by torch's own launcher parser; the program it runs must
    be the ``userdp`` entry point (``--no-python userdp``)."""
    from torch.distributed.run import get_args_parser

    try:
        parsed = get_args_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`{LAUNCHER} {' '.join(argv)}` does not parse")
    assert parsed.no_python and parsed.training_script == "userdp", argv
    return parsed


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_every_userdp_command_line_in_the_manifests_parses(render_chart, variant) -> None:
    objects = render_chart(VARIANTS[variant])
    parser = full_parser()
    available = _subcommands(parser)
    lines = userdp_command_lines(objects)
    commands = {argv[0] for _, argv, _, _ in lines}
    assert {"coordinator", "worker", "shard"} <= commands
    tls = VARIANTS[variant].get("tls", {}).get("enabled", True)
    assert ("deploy" in commands) == tls  # the coordinator's exec probe under mTLS
    missing = sorted(commands - available)
    for where, argv, _, _ in lines:
        if argv[0] in missing:
            continue
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `userdp {' '.join(argv)}` does not parse")
    if missing:
        pytest.skip(f"no module for userdp {', '.join(missing)} yet")


def test_manifest_commands_are_registered_in_the_cli(render_chart) -> None:
    commands = {argv[0] for _, argv, _, _ in userdp_command_lines(render_chart(DEMO))}
    missing = sorted(commands - _subcommands(build_parser()))
    if missing:
        pytest.skip(
            f"userdp {', '.join(missing)} not in COMMAND_MODULES of userdp/cli/__init__.py yet"
        )


@pytest.mark.parametrize("tls", [True, False])
def test_parsed_worker_and_coordinator_args_mean_what_the_pod_provides(render_chart, tls) -> None:
    values = {**DEMO, "workers": {"replicas": 3, "healthPort": 9100}, "coordinator": {"port": 6100}}
    if not tls:
        values |= {"tls": {"enabled": False}, "authToken": {"enabled": True}}
    objects = render_chart(values)
    parser = full_parser()
    if not {"coordinator", "worker"} <= _subcommands(parser):
        pytest.skip("userdp coordinator/worker modules not there yet")
    parsed = {}
    for _, argv, container, workload in userdp_command_lines(objects):
        if argv[0] in ("coordinator", "worker"):
            parsed[argv[0]] = (parser.parse_args(argv), container, workload)
    worker, container, sts = parsed["worker"]
    assert worker.config == DEPLOY_PATHS["config_file"]
    assert worker.shards == DEPLOY_PATHS["shards"]
    assert worker.worker_id == f"{sts['metadata']['name']}-0"  # $(POD_NAME) of pod 0
    assert worker.health_port == container["ports"][0]["containerPort"] == 9100
    service = objects.find("Service", "-coordinator")
    assert worker.coordinator == f"{service['metadata']['name']}:6100"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    if tls:
        assert worker.tls_dir == DEPLOY_PATHS["tls_dir"] and worker.token_file is None
    else:
        assert worker.token_file == DEPLOY_PATHS["token_file"] and worker.tls_dir is None
        assert str(Path(DEPLOY_PATHS["token_file"]).parent) in mounts
    assert DEPLOY_PATHS["data_dir"] in mounts
    coordinator, _, _ = parsed["coordinator"]
    assert coordinator.config == DEPLOY_PATHS["config_file"]
    assert coordinator.allow_workers.split(",") == [
        f"{sts['metadata']['name']}-{i}" for i in range(3)
    ]


def test_config_path_is_where_the_configmap_is_mounted(render_chart) -> None:
    objects = render_chart(DEMO)
    configmap = objects.find("ConfigMap", "-config")
    with_config = [line for line in userdp_command_lines(objects) if "--config" in line[1]]
    assert {argv[0] for _, argv, _, _ in with_config} == {"coordinator", "worker"}
    for where, argv, container, workload in with_config:
        path = Path(argv[argv.index("--config") + 1])
        assert str(path) == DEPLOY_PATHS["config_file"], where
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume_name = mounts[str(path.parent)]
        (volume,) = [v for v in objects.pod_spec(workload)["volumes"] if v["name"] == volume_name]
        assert volume["configMap"]["name"] == configmap["metadata"]["name"], where
        assert path.name in configmap["data"], where


def test_shard_paths_agree_between_job_workers_and_config(render_chart) -> None:
    objects = render_chart(DEMO)
    lines = userdp_command_lines(objects)
    (job,) = [argv for where, argv, _, _ in lines if argv[0] == "shard" and "verify" not in argv]
    assert job[job.index("--demo") + 1] == DEPLOY_PATHS["shards"]
    (verify,) = [argv for _, argv, _, _ in lines if argv[:2] == ["shard", "verify"]]
    assert verify[2] == DEPLOY_PATHS["shards"]
    for where, argv, _, _ in lines:
        if argv[0] == "worker" and "--shards" in argv:
            assert argv[argv.index("--shards") + 1] == DEPLOY_PATHS["shards"], where


def test_coordinator_port_probe_and_service_agree(render_chart) -> None:
    token = {"tls": {"enabled": False}, "authToken": {"enabled": True}}
    for values in (DEMO, {**DEMO, **token, "coordinator": {"port": 6000}}):
        objects = render_chart(values)
        deployment = objects.find("Deployment", "-coordinator")
        container = objects.container(deployment, "coordinator")
        (port,) = container["ports"]
        service = objects.find("Service", "-coordinator")
        assert service["spec"]["ports"][0]["port"] == port["containerPort"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            if "grpc" in probe:
                assert probe["grpc"] == {"port": port["containerPort"], "service": SERVICE_NAME}
            else:
                argv = probe["exec"]["command"]
                assert argv[argv.index("--address") + 1] == f"127.0.0.1:{port['containerPort']}"
                assert argv[argv.index("--service") + 1] == SERVICE_NAME
                assert argv[argv.index("--tls-dir") + 1] == DEPLOY_PATHS["tls_dir"]
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                assert DEPLOY_PATHS["tls_dir"] in mounts
        tls_on = values.get("tls", {}).get("enabled", True)
        # With mTLS the kubelet's gRPC probe cannot connect: the probe must be the exec one.
        assert ("exec" in container["livenessProbe"]) == tls_on


def test_worker_health_port_probes_and_coordinator_address_agree(render_chart) -> None:
    objects = render_chart({**DEMO, "workers": {"healthPort": 9000}, "coordinator": {"port": 6000}})
    sts = objects.find("StatefulSet", "-worker")
    container = objects.container(sts, "worker")
    (port,) = container["ports"]
    assert port["containerPort"] == 9000
    args = container["args"]
    assert args[args.index("--health-port") + 1] == "9000"
    assert container["livenessProbe"]["grpc"] == {"port": 9000, "service": ""}
    assert container["startupProbe"]["grpc"] == {"port": 9000, "service": ""}
    assert container["readinessProbe"]["grpc"] == {"port": 9000, "service": WORKER_HEALTH_SERVICE}
    service = objects.find("Service", "-coordinator")
    expected = f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert args[args.index("--coordinator") + 1] == expected


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
def test_a_worker_with_several_gpus_runs_one_rank_per_gpu_with_the_same_userdp_args(
    render_chart, gpus
) -> None:
    """workers.gpus > 1: the launcher starts one `userdp worker` process per GPU in the pod
    (standalone rendezvous on localhost), with exactly the args of a one-GPU worker, and waits
    the pod's grace period after SIGTERM before killing the ranks; gpus <= 1: the image's
    ENTRYPOINT runs `userdp worker` itself, as the one-GPU chart always did."""
    objects = render_chart({**DEMO, "workers": {"gpus": gpus}})
    sts = objects.find("StatefulSet", "-worker")
    container = objects.container(sts, "worker")
    one_gpu = objects.container(
        render_chart({**DEMO, "workers": {"gpus": 1}}).find("StatefulSet", "-worker"), "worker"
    )
    assert "command" not in one_gpu  # the image's ENTRYPOINT, userdp
    if gpus <= 1:
        assert "command" not in container and container["args"] == one_gpu["args"]
        return
    launcher = torchrun_args(container["command"][1:] + container["args"])
    assert container["command"][0] == LAUNCHER
    assert launcher.training_script_args == one_gpu["args"]
    assert launcher.standalone and launcher.nnodes == "1" and launcher.max_restarts == 0
    assert launcher.nproc_per_node == str(gpus)
    grace = objects.pod_spec(sts)["terminationGracePeriodSeconds"]
    assert int(launcher.shutdown_timeout) == grace
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    # one health port, rank 0's: the probes are those of a one-GPU worker
    for key in ("ports", "startupProbe", "livenessProbe", "readinessProbe"):
        assert container[key] == one_gpu[key], key
    parsed = full_parser().parse_args(launcher.training_script_args)
    assert parsed.command == "worker" and parsed.health_port == 8081
