"""The Helm chart renders (Helm's engine) into objects that pass the Kubernetes schemas and
``kubectl apply --dry-run=client``, in every supported configuration, and has the deployment's
shape: one coordinator that never overlaps with another (Recreate) and keeps its ledger on a
volume, GPU workers in a StatefulSet, a PDB, the shard Job, mTLS material mounted only where it
belongs. The shards come from exactly one source the values name (an existing claim, the shard Job
on the user's dataset, or the demo corpus when asked for); with none the chart refuses."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from userdp.config import parse_config
from userdp.kubernetes.chart import DEPLOY_PATHS, chart_fullname

CHART_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "userdp"

# The three data sources. Tests about other things train on the demo corpus, named explicitly.
DEMO = {"shardJob": {"demo": True}}
EXISTING_SHARDS = {"data": {"persistence": {"existingClaim": "shards"}}}
DATASET = {
    "shardJob": {
        "input": {"existingClaim": "raw", "path": "chats/train.parquet"},
        "userColumn": "author",
        "textColumn": "body",
    }
}

# The collective data plane: the workers reduce in a gloo group that meets in the coordinator's
# rendezvous store.
COLLECTIVE = {**DEMO, "config": {"coordinator": {"data_plane": "collective"}}}

VARIANTS = {
    "demo": DEMO,
    "collective": COLLECTIVE,
    "existing-shards": EXISTING_SHARDS,
    "dataset": DATASET,
    "cpu-workers": {**DEMO, "workers": {"gpus": 0, "replicas": 3, "antiAffinity": "none"}},
    "hard-anti-affinity": {**DEMO, "workers": {"antiAffinity": "hard", "gpus": 8}},
    "four-gpu-workers": {**DEMO, "workers": {"gpus": 4}},  # torchrun, one rank per GPU
    "token-created": {
        **DEMO,
        "tls": {"enabled": False},
        "authToken": {"enabled": True, "value": "0123456789abcdef0123"},
    },
    "token-existing": {
        **DEMO,
        "tls": {"enabled": False},
        "authToken": {"enabled": True, "existingSecret": "my-token"},
    },
    "existing-claims": {
        "coordinator": {"persistence": {"existingClaim": "ledger"}},
        "data": {"persistence": {"existingClaim": "shards"}},
    },
    "no-persistence-no-job": {
        "coordinator": {"persistence": {"enabled": False}, "pdb": {"enabled": True}},
        "data": {"persistence": {"existingClaim": "shards"}},
        "shardJob": {"enabled": False},
        "workers": {"pdb": {"enabled": False}},
    },
    "real-dataset": {
        "shardJob": {
            "demo": False,
            "input": {"existingClaim": "raw", "path": "chats/train.parquet"},
            "userColumn": "author",
            "textColumn": "body",
            "tokenizer": "bpe:4096",
            "maxExamplesPerUser": 64,
            "keepText": True,
            "datasetName": "chats",
        }
    },
    "dataset-into-existing-claim": {**DATASET, **EXISTING_SHARDS},
    "scheduling": {
        **DEMO,
        "imagePullSecrets": [{"name": "registry"}],
        "image": {"repository": "registry.example.com/ml/userdp", "tag": "0.1.0-cu128"},
        "workers": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "pool", "operator": "In", "values": ["gpu"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        },
        "coordinator": {"service": {"annotations": {"example.com/team": "privacy"}}},
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_object_passes_the_kubernetes_schemas(
    render_chart, validate_k8s, variant
) -> None:
    objects = render_chart(VARIANTS[variant])
    assert objects, "nothing rendered"
    for obj in objects:
        validate_k8s(obj)


def test_demo_install_has_every_piece(render_chart) -> None:
    objects = render_chart(DEMO)
    assert objects.kinds() == sorted(
        [
            "ConfigMap",
            "Deployment",
            "Job",
            "PersistentVolumeClaim",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "Service",
            "Service",
            "StatefulSet",
        ]
    )


def test_one_coordinator_never_two_and_its_ledger_is_on_a_persistent_volume(render_chart) -> None:
    objects = render_chart(DEMO)
    deployment = objects.find("Deployment", "-coordinator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = objects.pod_spec(deployment)
    mounts = {m["name"]: m for m in objects.container(deployment, "coordinator")["volumeMounts"]}
    assert mounts["state"]["mountPath"] == DEPLOY_PATHS["state_dir"]
    assert not mounts["state"].get("readOnly", False)
    assert DEPLOY_PATHS["output_dir"].startswith(DEPLOY_PATHS["state_dir"] + "/")
    (state,) = [v for v in pod["volumes"] if v["name"] == "state"]
    claim = state["persistentVolumeClaim"]["claimName"]
    pvc = objects.find("PersistentVolumeClaim", claim)
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "ReadWriteOnce" in pvc["spec"]["accessModes"]
    # The config the coordinator reads puts checkpoints and the ledger under that mount.
    config = _config_of(objects)
    assert config["output"]["dir"] == DEPLOY_PATHS["output_dir"]


def test_existing_state_claim_is_used_and_not_created(render_chart) -> None:
    objects = render_chart(VARIANTS["existing-claims"])
    assert "PersistentVolumeClaim" not in objects.kinds()
    pod = objects.pod_spec(objects.find("Deployment", "-coordinator"))
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"data": "shards", "state": "ledger"}


def test_the_demo_corpus_is_never_the_default(render_chart) -> None:
    from helm_python import HelmError

    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert defaults["shardJob"]["demo"] is False
    with pytest.raises(HelmError) as refused:
        render_chart({})
    message = str(refused.value).splitlines()[-1]
    assert "no training data: set data.persistence.existingClaim" in message
    for value in ("shardJob.input.existingClaim", "shardJob.input.path", "shardJob.demo=true"):
        assert value in message
    for values in ({"shardJob": {"enabled": False}}, {"shardJob": {"demo": False}}):
        with pytest.raises(HelmError, match="no training data"):
            render_chart(values)


def _data_volumes(objects) -> dict[str, dict]:
    """Workload kind -> its ``data`` volume."""
    return {
        obj["kind"]: next(v for v in objects.pod_spec(obj)["volumes"] if v["name"] == "data")
        for obj in objects
        if obj["kind"] in {"Deployment", "StatefulSet", "Job"}
    }


@pytest.mark.parametrize("source", ["demo", "existing-shards", "dataset"])
def test_each_data_source_is_what_the_pods_mount_and_the_job_runs(
    render_chart, validate_k8s, source
) -> None:
    objects = render_chart(VARIANTS[source])
    for obj in objects:
        validate_k8s(obj)
    job = objects.find("Job", "-shard")
    shard = objects.container(job, "shard")
    argv = shard["args"]  # after `userdp` (the image's entry point or the Job's script)
    volumes = _data_volumes(objects)
    claims = {kind: v["persistentVolumeClaim"]["claimName"] for kind, v in volumes.items()}
    assert len(set(claims.values())) == 1, claims  # the Job and every reader see one volume
    assert _config_of(objects)["data"]["shards"] == DEPLOY_PATHS["shards"]
    if source == "demo":
        assert argv[argv.index("--demo") + 1] == DEPLOY_PATHS["shards"]
        notes = " ".join(objects.notes.split())
        assert "WARNING: shardJob.demo=true: this release trains on the synthetic demo" in notes
        assert "NOT on your data" in notes
    else:
        assert "--demo" not in argv and "WARNING" not in objects.notes
    if source == "existing-shards":
        # Nothing is written: the claim is mounted read-only everywhere and only verified.
        assert "command" not in shard
        assert shard["args"] == ["shard", "verify", DEPLOY_PATHS["shards"]]
        assert set(claims.values()) == {"shards"}
        pvcs = [o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"]
        assert not [name for name in pvcs if name.endswith("-data")]
        assert all(v["persistentVolumeClaim"]["readOnly"] for v in volumes.values())
        (mount,) = [m for m in shard["volumeMounts"] if m["name"] == "data"]
        assert mount["readOnly"] is True
        assert "the claim shards must hold it in shards/" in str(
            objects.pod_spec(objects.find("StatefulSet", "-worker"))["initContainers"][0]["command"]
        )
    if source == "dataset":
        assert argv[1] == "/input/chats/train.parquet"
        assert argv[argv.index("--user-column") + 1] == "author"
        assert argv[argv.index("--text-column") + 1] == "body"
        assert argv[argv.index("--out") + 1] == DEPLOY_PATHS["shards"]
        inputs = [v for v in objects.pod_spec(job)["volumes"] if v["name"] == "input"]
        assert inputs == [
            {"name": "input", "persistentVolumeClaim": {"claimName": "raw", "readOnly": True}}
        ]
        assert "from raw:chats/train.parquet" in objects.notes


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_applies_with_kubectl_dry_run(render_chart, kubectl_dry_run, variant) -> None:
    values = VARIANTS[variant]
    objects = render_chart(values)
    for out in kubectl_dry_run(objects):  # one per Kubernetes version served
        assert out.count("created (dry run)") == len(objects), out
        assert "deployment.apps/demo-userdp-coordinator created (dry run)" in out
        assert "statefulset.apps/demo-userdp-worker created (dry run)" in out
        job_enabled = values.get("shardJob", {}).get("enabled", True)
        assert ("job.batch/demo-userdp-shard created (dry run)" in out) == job_enabled


@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_workers_request_their_gpus_and_the_config_matches(render_chart, gpus) -> None:
    objects = render_chart({**DEMO, "workers": {"gpus": gpus, "replicas": 5}})
    sts = objects.find("StatefulSet", "-worker")
    assert sts["spec"]["replicas"] == 5
    resources = objects.container(sts, "worker")["resources"]
    if gpus:
        assert resources["requests"]["nvidia.com/gpu"] == gpus
        assert resources["limits"]["nvidia.com/gpu"] == gpus
    else:
        assert "nvidia.com/gpu" not in resources.get("requests", {})
        assert "nvidia.com/gpu" not in resources.get("limits", {})
    assert resources["requests"]["memory"] and resources["requests"]["cpu"]
    config = _config_of(objects)
    assert config["workers"]["count"] == 5
    assert config["workers"]["device"] == ("cuda" if gpus else "cpu")


def test_workers_have_stable_identity_and_shared_shards(render_chart) -> None:
    objects = render_chart(DEMO)
    sts = objects.find("StatefulSet", "-worker")
    headless = objects.find("Service", "-worker")
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["clusterIP"] == "None"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    mounts = {m["name"]: m for m in objects.container(sts, "worker")["volumeMounts"]}
    assert mounts["data"]["mountPath"] == DEPLOY_PATHS["data_dir"]
    assert mounts["data"]["readOnly"] is True
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert DEPLOY_PATHS["shards"].startswith(DEPLOY_PATHS["data_dir"] + "/")
    # The shard Job writes where the workers read.
    job = objects.find("Job", "-shard")
    job_mounts = {m["name"]: m for m in objects.container(job, "shard")["volumeMounts"]}
    assert job_mounts["data"]["mountPath"] == DEPLOY_PATHS["data_dir"]
    assert not job_mounts["data"].get("readOnly", False)
    claim = {
        o["kind"]: [v for v in objects.pod_spec(o)["volumes"] if v["name"] == "data"][0][
            "persistentVolumeClaim"
        ]["claimName"]
        for o in (sts, job, objects.find("Deployment", "-coordinator"))
    }
    assert len(set(claim.values())) == 1, claim


@pytest.mark.parametrize(
    ("mode", "field"),
    [
        ("soft", "preferredDuringSchedulingIgnoredDuringExecution"),
        ("hard", "requiredDuringSchedulingIgnoredDuringExecution"),
        ("none", None),
    ],
)
def test_worker_anti_affinity_option(render_chart, mode, field) -> None:
    objects = render_chart({**DEMO, "workers": {"antiAffinity": mode}})
    sts = objects.find("StatefulSet", "-worker")
    pod = objects.pod_spec(sts)
    if field is None:
        assert "affinity" not in pod
        return
    (term,) = pod["affinity"]["podAntiAffinity"][field]
    term = term.get("podAffinityTerm", term)
    assert term["topologyKey"] == "kubernetes.io/hostname"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()


def test_disruption_budgets_select_the_right_pods(render_chart) -> None:
    objects = render_chart({**DEMO, "coordinator": {"pdb": {"enabled": True}}})
    workers_pdb = objects.find("PodDisruptionBudget", "-worker")
    sts = objects.find("StatefulSet", "-worker")
    selector = workers_pdb["spec"]["selector"]["matchLabels"]
    assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert workers_pdb["spec"]["maxUnavailable"] == 1
    coordinator_pdb = objects.find("PodDisruptionBudget", "-coordinator")
    deployment = objects.find("Deployment", "-coordinator")
    selector = coordinator_pdb["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert not selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_coordinator_service_reaches_the_coordinator_port(render_chart) -> None:
    objects = render_chart({**DEMO, "coordinator": {"port": 7443}})
    service = objects.find("Service", "-coordinator")
    deployment = objects.find("Deployment", "-coordinator")
    assert service["spec"]["selector"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    (port,) = service["spec"]["ports"]
    assert port["port"] == 7443
    (container_port,) = objects.container(deployment, "coordinator")["ports"]
    assert port["targetPort"] == container_port["name"]
    assert container_port["containerPort"] == 7443
    assert _config_of(objects)["coordinator"]["port"] == 7443


def test_collective_data_plane_publishes_the_rendezvous_port_and_sets_the_gloo_interface(
    render_chart,
) -> None:
    objects = render_chart(COLLECTIVE)
    deployment = objects.find("Deployment", "-coordinator")
    ports = {p["name"]: p for p in objects.container(deployment, "coordinator")["ports"]}
    assert ports["rendezvous"] == {"name": "rendezvous", "containerPort": 29400, "protocol": "TCP"}
    service = {p["name"]: p for p in objects.find("Service", "-coordinator")["spec"]["ports"]}
    assert set(service) == {"grpc", "rendezvous"}
    assert service["rendezvous"]["port"] == 29400
    assert service["rendezvous"]["targetPort"] == "rendezvous"
    config = _config_of(objects)
    assert config["coordinator"]["data_plane"] == "collective"
    assert config["coordinator"]["group_port"] == 29400
    parse_config(config)
    worker = objects.container(objects.find("StatefulSet", "-worker"), "worker")
    assert {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"} in worker["env"]
    # Workers dial the store at the host of --coordinator: the coordinator Service.
    address = worker["args"][worker["args"].index("--coordinator") + 1]
    assert address.split(":")[0] == objects.find("Service", "-coordinator")["metadata"]["name"]
    # the coordinator is the root of the workers' reduce: a gloo rank too
    coordinator_env = objects.container(deployment, "coordinator")["env"]
    assert {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"} in coordinator_env
    notes = " ".join(objects.notes.split())
    assert "the workers rendezvous at demo-userdp-coordinator:29400" in notes
    assert "the worker pods must reach each other and the coordinator pod" in notes

    custom = {
        **COLLECTIVE,
        "coordinator": {"port": 7000, "groupPort": 7001, "glooSocketIfname": "net2"},
        "workers": {"glooSocketIfname": "net1"},
    }
    objects = render_chart(custom)
    service = {p["name"]: p for p in objects.find("Service", "-coordinator")["spec"]["ports"]}
    assert (service["grpc"]["port"], service["rendezvous"]["port"]) == (7000, 7001)
    assert _config_of(objects)["coordinator"]["group_port"] == 7001
    worker = objects.container(objects.find("StatefulSet", "-worker"), "worker")
    assert {"name": "GLOO_SOCKET_IFNAME", "value": "net1"} in worker["env"]
    coordinator = objects.container(objects.find("Deployment", "-coordinator"), "coordinator")
    assert {"name": "GLOO_SOCKET_IFNAME", "value": "net2"} in coordinator["env"]
    # "" leaves the variable unset (gloo takes the interface of the pod's host name).
    objects = render_chart(
        {
            **COLLECTIVE,
            "coordinator": {"glooSocketIfname": ""},
            "workers": {"glooSocketIfname": ""},
        }
    )
    assert "GLOO_SOCKET_IFNAME" not in objects.manifest


@pytest.mark.parametrize("plane", [None, "grpc"])
def test_grpc_data_plane_renders_nothing_of_the_collective_one(render_chart, plane) -> None:
    values = {**DEMO, "config": {"coordinator": {"data_plane": plane}} if plane else {}}
    objects = render_chart(values)
    assert "rendezvous" not in objects.manifest and "rendezvous" not in objects.notes
    assert "GLOO_SOCKET_IFNAME" not in objects.manifest
    assert "group_port" not in objects.manifest
    (port,) = objects.find("Service", "-coordinator")["spec"]["ports"]
    assert port["name"] == "grpc"
    # The collective plane's values change nothing, and a group_port in the config is dropped.
    other = render_chart(
        {**values, "coordinator": {"groupPort": 1234}, "workers": {"glooSocketIfname": "net1"}}
    )
    assert other.manifest == objects.manifest and other.notes == objects.notes
    dropped = render_chart({**DEMO, "config": {"coordinator": {"group_port": 1234}}})
    assert "group_port" not in _config_of(dropped)["coordinator"]


def test_configmap_holds_a_valid_userdp_config_with_user_keys_passed_through(render_chart) -> None:
    user = {
        "strategy": {"name": "els", "steps": 500, "clip_norm": 0.25, "group_size": 4},
        "privacy": {"epsilon": 4, "delta": 1e-7, "noise_multiplier": None},
        "model": {"preset": "gpt2-small", "path": 'C:\\models "quoted" ü'},
        "output": {"plots": False, "seed": 12345678, "dir": "somewhere/else"},
        "coordinator": {"tls_dir": "certs", "checkpoint_every": 5, "max_message_mb": 128},
        "workers": {"count": 99, "replicas": 2},
        "data": {"shards": "/elsewhere", "seq_len": 256},
    }
    config = _config_of(render_chart({**DEMO, "config": user, "workers": {"replicas": 3}}))
    parsed = parse_config(config)  # what `userdp coordinator --config` will accept
    assert parsed.strategy.name == "els"
    assert config["strategy"]["steps"] == 500 and isinstance(config["strategy"]["steps"], int)
    assert config["strategy"]["clip_norm"] == 0.25
    assert config["privacy"]["delta"] == pytest.approx(1e-7, rel=1e-12)
    assert "noise_multiplier" not in config["privacy"]
    assert config["model"]["path"] == 'C:\\models "quoted" ü'
    assert config["output"] == {"dir": DEPLOY_PATHS["output_dir"], "plots": False, "seed": 12345678}
    assert config["coordinator"]["checkpoint_every"] == 5
    assert config["coordinator"]["tls_dir"] == DEPLOY_PATHS["tls_dir"]
    assert config["coordinator"]["host"] == "0.0.0.0"
    assert config["workers"] == {"count": 3, "replicas": 2, "device": "cuda"}
    assert config["data"] == {"shards": DEPLOY_PATHS["shards"], "seq_len": 256}


def test_token_mode_mounts_the_token_and_no_certificates(render_chart) -> None:
    objects = render_chart(VARIANTS["token-created"])
    config = _config_of(objects)
    assert "tls_dir" not in config["coordinator"]
    assert config["coordinator"]["auth_token_file"] == DEPLOY_PATHS["token_file"]
    secret = objects.find("Secret", "-token")
    assert set(secret["data"]) == {"token"}
    for obj, name in (
        (objects.find("Deployment", "-coordinator"), "coordinator"),
        (objects.find("StatefulSet", "-worker"), "worker"),
    ):
        mounts = {m["mountPath"] for m in objects.container(obj, name)["volumeMounts"]}
        assert str(Path(DEPLOY_PATHS["token_file"]).parent) in mounts
        assert DEPLOY_PATHS["tls_dir"] not in mounts
        volumes = {v["name"]: v for v in objects.pod_spec(obj)["volumes"]}
        assert volumes["token"]["secret"]["secretName"] == secret["metadata"]["name"]
    worker_args = objects.container(objects.find("StatefulSet", "-worker"), "worker")["args"]
    assert "--tls-dir" not in worker_args
    assert worker_args[worker_args.index("--token-file") + 1] == DEPLOY_PATHS["token_file"]


def test_mtls_mode_has_no_token(render_chart) -> None:
    objects = render_chart(DEMO)
    config = _config_of(objects)
    assert config["coordinator"]["tls_dir"] == DEPLOY_PATHS["tls_dir"]
    assert "auth_token_file" not in config["coordinator"]
    assert "Secret" not in objects.kinds()
    worker_args = objects.container(objects.find("StatefulSet", "-worker"), "worker")["args"]
    assert "--token-file" not in worker_args
    assert worker_args[worker_args.index("--tls-dir") + 1] == DEPLOY_PATHS["tls_dir"]


def test_only_the_releases_workers_may_register(render_chart) -> None:
    objects = render_chart({**DEMO, "workers": {"replicas": 3}})
    args = objects.container(objects.find("Deployment", "-coordinator"), "coordinator")["args"]
    allowed = args[args.index("--allow-workers") + 1].split(",")
    name = objects.find("StatefulSet", "-worker")["metadata"]["name"]
    assert allowed == [f"{name}-{i}" for i in range(3)]


def test_each_pod_mounts_only_its_own_tls_material(render_chart) -> None:
    objects = render_chart(DEMO)
    fullname = chart_fullname("demo")
    deployment = objects.find("Deployment", "-coordinator")
    (tls,) = [v for v in objects.pod_spec(deployment)["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["secretName"] == f"{fullname}-tls-coordinator"
    assert {item["path"] for item in tls["secret"]["items"]} == {
        "ca.pem",
        "coordinator.pem",
        "coordinator.key",
    }
    sts = objects.find("StatefulSet", "-worker")
    pod = objects.pod_spec(sts)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["all-certs"]["secret"]["secretName"] == f"{fullname}-tls-workers"
    assert volumes["tls"]["emptyDir"]["medium"] == "Memory"
    worker_mounts = {m["name"] for m in objects.container(sts, "worker")["volumeMounts"]}
    assert "all-certs" not in worker_mounts and "tls" in worker_mounts
    (select,) = [c for c in pod["initContainers"] if c["name"] == "select-certificate"]
    script = select["command"][-1]
    assert '"$POD_NAME.pem" "$POD_NAME.key"' in script and DEPLOY_PATHS["tls_dir"] in script


def test_pods_run_as_the_image_user_without_privileges(render_chart) -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    objects = render_chart(DEMO)
    for obj in objects:
        if obj["kind"] not in {"Deployment", "StatefulSet", "Job"}:
            continue
        pod = objects.pod_spec(obj)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == values["securityContext"]["runAsUser"]
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_config_changes_restart_the_pods(render_chart) -> None:
    def checksums(values):
        objects = render_chart(values)
        return {
            kind: objects.find(kind, suffix)["spec"]["template"]["metadata"]["annotations"][
                "checksum/config"
            ]
            for kind, suffix in (("Deployment", "-coordinator"), ("StatefulSet", "-worker"))
        }

    before = checksums(DEMO)
    after = checksums({**DEMO, "config": {"strategy": {"steps": 7}}})
    assert before["Deployment"] != after["Deployment"]
    assert before["StatefulSet"] != after["StatefulSet"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # values.schema.json (Helm checks it before rendering)
        ({"worker": {"replicas": 3}}, "additional properties 'worker' not allowed"),
        ({"workers": {"antiAffinity": "sometimes"}}, "value must be one of 'none', 'soft', 'hard'"),
        ({"workers": {"gpus": -1}}, "/workers/gpus"),
        ({"config": {"strategy": 3}}, "/config/strategy"),
        ({"config": {"strategy": {"steps": [[1], 2]}}}, "/config/strategy/steps"),
        ({"config": {"strategy": {"params": {"x": {"y": 1}}}}}, "/config/strategy/params/x"),
        ({"plugin": {"files": {"../evil.sh": "x"}}}, "invalid propertyName '../evil.sh'"),
        (
            {"data": {"persistence": {"existingClaim": "My_Shards"}}},
            "at '/data/persistence/existingClaim': 'My_Shards' does not match pattern",
        ),
        ({**DATASET, "shardJob": {"input": {"path": "../../etc"}}}, "/shardJob/input/path"),
        # the templates' own checks
        (
            {"shardJob": {"input": {"existingClaim": "raw"}}},
            "shardJob.input: also set shardJob.input.path, shardJob.userColumn, "
            "shardJob.textColumn",
        ),
        (
            {"shardJob": {**DATASET["shardJob"], "demo": True}},
            "shardJob.demo=true and shardJob.input are both set",
        ),
        (
            {"shardJob": {"enabled": False, "demo": True}},
            "shardJob.enabled=false, but only the shard Job writes the shards",
        ),
        (
            {**DEMO, "tls": {"enabled": False}, "authToken": {"enabled": True, "value": "short"}},
            "at least 16 characters",
        ),
        (
            {
                **DEMO,
                "tls": {"enabled": False},
                "authToken": {"enabled": True, "value": "x" * 20, "existingSecret": "t"},
            },
            "not both",
        ),
        ({**DEMO, "authToken": {"enabled": True}}, "tls.enabled and authToken.enabled: choose one"),
        ({**DEMO, "tls": {"enabled": False}}, "workers must authenticate"),
        (
            {**COLLECTIVE, "coordinator": {"groupPort": 50051}},
            "coordinator.groupPort = 50051 is coordinator.port too",
        ),
        (
            {**DEMO, "config": {"coordinator": {"data_plane": "nccl"}}},
            "config.coordinator.data_plane must be grpc or collective, got nccl",
        ),
        ({**COLLECTIVE, "workers": {"glooSocketIfname": "eth0 x"}}, "/workers/glooSocketIfname"),
        ({**COLLECTIVE, "coordinator": {"groupPort": 0}}, "/coordinator/groupPort"),
    ],
)
def test_bad_values_fail_the_render_with_a_message(render_chart, values, message) -> None:
    from helm_python import HelmError

    with pytest.raises(HelmError, match=re.escape(message)):
        render_chart(values)


def test_helm_lint_reports_no_errors(render_chart) -> None:
    import helm_python

    report = helm_python.lint(str(CHART_DIR))
    assert report["errors"] == []
    errors = [m for m in report["messages"] if m["severity"] >= 3]
    assert errors == []


def test_every_top_level_value_is_documented() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    for index, line in enumerate(lines):
        if line and not line.startswith((" ", "#")) and ":" in line:
            key = line.split(":")[0]
            block = [ln for ln in lines[max(0, index - 3) : index] if ln.startswith("#")]
            children = [ln for ln in lines[index + 1 : index + 4] if ln.strip().startswith("#")]
            assert block or children, f"values.yaml: top-level key {key!r} has no comment"


def _config_of(objects) -> dict:
    configmap = objects.find("ConfigMap", "-config")
    (text,) = configmap["data"].values()
    assert Path(DEPLOY_PATHS["config_file"]).name in configmap["data"]
    return tomllib.loads(text)
