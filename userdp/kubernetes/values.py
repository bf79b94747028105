"""The Helm chart's contract seen from a userdp config (deploy/helm/userdp): where the chart mounts
things in the pods, the config keys it owns, and the chart values a validated config becomes."""

from __future__ import annotations

import importlib.util
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from userdp.config import Config, load_config
from userdp.kubernetes.chart import (
    CHART_MANAGED_KEYS,
    DEFAULT_GROUP_PORT,
    DEFAULT_PORT,
    DEPLOY_PATHS,
    worker_ids,
)
from userdp.strategies.catalogue import BUILTIN_STRATEGIES


@dataclass(frozen=True)
class ShardSource:
    """Where the shards are in the cluster: the ``render`` flags behind the chart's data values.

    ``claim`` alone: a PersistentVolumeClaim that already holds ``userdp shard`` output in its
    ``shards/`` folder (values ``data.persistence.existingClaim``). ``input_claim`` with
    ``input_path``, ``user_column`` and ``text_column``: the shard Job runs ``userdp shard`` on that
    dataset (values ``shardJob.input`` ...), into ``claim`` when given. ``demo``: the synthetic demo
    corpus (values ``shardJob.demo``). Nothing given: the config decides (no ``data.shards``: demo).
    """

    claim: str | None = None
    input_claim: str | None = None
    input_path: str | None = None
    user_column: str | None = None
    text_column: str | None = None
    tokenizer: str | None = None
    format: str | None = None
    demo: bool = False

    @property
    def given(self) -> bool:
        """True when the flags say where the shards are (the config's data.shards is not asked)."""
        return bool(self.claim or self.input_claim or self.demo)


SHARD_SOURCE_FLAGS = (
    "--shards-claim CLAIM (a PersistentVolumeClaim holding that `userdp shard` output in shards/) "
    "or --shard-input-claim CLAIM --shard-input-path PATH --user-column COLUMN --text-column "
    "COLUMN (a claim holding the dataset, which the shard Job shards in the cluster)"
)


def shard_values(source: ShardSource, config_shards: str | None, demo_users: int) -> dict[str, Any]:
    """The chart's data values (``data.persistence``, ``shardJob``) for ``source``.

    Raises ValueError, naming the flags to give, for a config whose ``data.shards`` names a local
    folder while ``source`` says nothing (the cluster cannot see that folder), and for incomplete
    or contradictory flags. Falls back to the demo corpus only when the config has no
    ``data.shards`` either, as a local run would; :func:`demo_warning` then has a line to print.
    """
    input_flags = {
        "--shard-input-path": source.input_path,
        "--user-column": source.user_column,
        "--text-column": source.text_column,
        "--tokenizer": source.tokenizer,
        "--format": source.format,
    }
    if source.input_claim is None:
        stray = [flag for flag, value in input_flags.items() if value is not None]
        if stray:
            raise ValueError(
                f"{', '.join(stray)} describe the dataset of --shard-input-claim CLAIM"
            )
    else:
        required = ("--shard-input-path", "--user-column", "--text-column")
        missing = [flag for flag in required if not input_flags[flag]]
        if missing:
            raise ValueError(
                f"--shard-input-claim {source.input_claim} needs {', '.join(missing)} "
                "(the dataset's file in the claim and its user and text columns)"
            )
        if source.demo:
            raise ValueError(
                "--demo and --shard-input-claim: train on the demo corpus or on your dataset"
            )
    if not source.given and config_shards is not None:
        raise ValueError(
            f"data.shards = {config_shards!r} is a folder on this machine, which the cluster "
            f"cannot see: give {SHARD_SOURCE_FLAGS}; --demo trains on the synthetic demo corpus"
        )
    values: dict[str, Any] = {}
    if source.claim:
        values["data"] = {"persistence": {"existingClaim": source.claim}}
    if source.demo or not source.given:
        values["shardJob"] = {"demo": True, "demoUsers": demo_users}
    elif source.input_claim:
        job: dict[str, Any] = {
            "demo": False,
            "input": {"existingClaim": source.input_claim, "path": source.input_path},
            "userColumn": source.user_column,
            "textColumn": source.text_column,
        }
        if source.tokenizer:
            job["tokenizer"] = source.tokenizer
        if source.format:
            job["format"] = source.format
        values["shardJob"] = job
    else:
        values["shardJob"] = {"demo": False}
    return values


def demo_warning(values: dict[str, Any]) -> str | None:
    """The line ``render`` prints on stderr when ``values`` train on the demo corpus, else None."""
    job = values.get("shardJob", {})
    if not job.get("demo"):
        return None
    return (
        f"WARNING: shardJob.demo=true: the run trains on the synthetic demo corpus "
        f"({job.get('demoUsers', 400)} users), NOT on user data; to train on your dataset give "
        "--shards-claim or --shard-input-claim (userdp deploy render --help)"
    )


def render_values(
    config_path: str | Path,
    *,
    image: str | None = None,
    gpus: int | None = None,
    auth: str | None = None,
    shards: ShardSource = ShardSource(),
) -> tuple[dict[str, Any], list[str]]:
    """Chart values for the TOML config at ``config_path`` and notes on the keys the chart owns.

    The config is validated first (ConfigError names a bad key). ``config`` in the result holds
    only the keys the file sets, minus the chart-managed ones. ``auth`` is ``"mtls"`` or
    ``"token"``; by default the config's choice (a token file without tls_dir means token), else
    mTLS. ``shards`` says where the shards are in the cluster (:func:`shard_values`).
    """
    config = load_config(config_path, local_files=False)  # its paths are the pods'
    raw = tomllib.loads(Path(config_path).read_text(encoding="utf-8"))
    notes: list[str] = []
    kept: dict[str, dict[str, Any]] = {}
    for section, keys in raw.items():
        for key, value in keys.items():
            managed = CHART_MANAGED_KEYS.get((section, key))
            if managed is None:
                kept.setdefault(section, {})[key] = value
            else:
                notes.append(f"{section}.{key} = {value!r} is set by the chart: {managed}")
    if gpus is None:  # a CPU worker pod runs workers.ranks ranks (values workers.cpuRanks)
        gpus = config.workers.ranks if config.workers.device == "cuda" else 0
    if gpus < 0:
        raise ValueError(f"--gpus must be >= 0, got {gpus}")
    if auth is None:
        token_only = config.coordinator.auth_token_file and not config.coordinator.tls_dir
        auth = "token" if token_only else "mtls"
    if auth not in ("mtls", "token"):
        raise ValueError(f"--auth must be mtls or token, got {auth!r}")
    values: dict[str, Any] = {}
    if image is not None:
        repository, _, tag = image.rpartition(":") if _has_tag(image) else (image, "", "")
        values["image"] = {"repository": repository, "tag": tag}
    values["config"] = kept
    values["coordinator"] = _coordinator_values(config)
    values["workers"] = {"replicas": config.workers.count, "gpus": gpus}
    if gpus == 0 and config.workers.ranks > 1:  # a CPU pod runs the config's ranks
        values["workers"]["cpuRanks"] = config.workers.ranks
    values["tls"] = {"enabled": auth == "mtls"}
    values["authToken"] = {"enabled": auth == "token"}
    plugin_files, plugin_notes = _plugin_files(config, kept)
    if plugin_files:
        values["plugin"] = {"files": plugin_files}
    notes += plugin_notes
    values.update(shard_values(shards, config.data.shards, config.data.demo_users))
    return values, notes


def _coordinator_values(config: Config) -> dict[str, int]:
    """The chart's ``coordinator`` ports: the gRPC port and, with the collective data plane, the
    rendezvous store's (0 in the config is a fixed default, since the Service publishes it).
    ValueError, naming the key to change, when the two ports are one."""
    port = config.coordinator.port or DEFAULT_PORT
    if config.coordinator.data_plane != "collective":
        return {"port": port}
    group_port = config.coordinator.group_port or DEFAULT_GROUP_PORT
    if group_port == port:
        given = config.coordinator.group_port
        where = f"{given}" if given else f"0, which the chart makes {DEFAULT_GROUP_PORT},"
        raise ValueError(
            f"coordinator.group_port = {where} is the coordinator's gRPC port ({port}) too: the "
            "rendezvous store needs a port of its own; set another coordinator.group_port"
        )
    return {"port": port, "groupPort": group_port}


PLUGIN_MAX_BYTES = 512 << 10  # a ConfigMap holds at most 1 MiB in all


def _plugin_files(config: Config, kept: dict[str, dict[str, Any]]) -> tuple[dict[str, str], list]:
    """The plugin module the chart ships in its ConfigMap (a single file next to the config, or
    in ``strategy.plugin_path``), or nothing for a built-in or a plugin installed as a package
    (which the image must then hold). ValueError when the chart cannot reach the plugin."""
    name = config.strategy.name
    if name in BUILTIN_STRATEGIES:
        return {}, []
    kept.get("strategy", {}).pop("plugin_path", None)  # the chart sets it to the mount
    module = name.partition(":")[0]
    folder = Path(config.strategy.plugin_path or ".")
    top = module.split(".")[0]
    if (folder / f"{top}.py").is_file() or (folder / top).is_dir():
        if "." in module or (folder / top).is_dir():
            raise ValueError(
                f"strategy.name = {name!r}: {module!r} is a package in {folder}; the chart ships "
                "one module file next to the config, so make the plugin a single .py file or "
                "install its package in the image (docs/kubernetes.md)"
            )
        source = (folder / f"{module}.py").read_text(encoding="utf-8")
        if len(source.encode()) > PLUGIN_MAX_BYTES:
            raise ValueError(
                f"strategy.name = {name!r}: {folder / module}.py is over "
                f"{PLUGIN_MAX_BYTES >> 10} KiB, too large for the chart's ConfigMap; install it "
                "in the image instead (docs/kubernetes.md)"
            )
        return {f"{module}.py": source}, [
            f"strategy plugin {folder / module}.py is shipped in the chart's ConfigMap and "
            f"imported from {DEPLOY_PATHS['config_dir']} in the pods"
        ]
    if importlib.util.find_spec(top) is None:
        raise ValueError(
            f"strategy.name = {name!r}: no {module}.py in {folder} and no installed module "
            f"{top!r}; the chart cannot reach the plugin (put the file next to the config)"
        )
    return {}, [
        f"strategy plugin {module!r} is imported from the installed package: the image must "
        "have it installed (docs/kubernetes.md)"
    ]


def _has_tag(image: str) -> bool:
    """True when ``image`` ends in ``:tag`` (a ``:`` after the last ``/``, not a registry port)."""
    return ":" in image.rsplit("/", 1)[-1]


def collective(values: dict[str, Any]) -> bool:
    """True when the values' config moves tensors over the collective data plane (the chart then
    publishes the rendezvous port and sets the workers' gloo interface)."""
    coordinator = values.get("config", {}).get("coordinator", {})
    return coordinator.get("data_plane", "grpc") == "collective"


def effective_config(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The config the chart renders for ``values`` (the same overrides as _helpers.tpl)."""
    config = {section: dict(keys) for section, keys in values.get("config", {}).items()}
    tls = values.get("tls", {}).get("enabled", True)
    token = values.get("authToken", {}).get("enabled", False)
    workers = values.get("workers", {})
    config.setdefault("data", {})["shards"] = DEPLOY_PATHS["shards"]
    coordinator = config.setdefault("coordinator", {})
    coordinator["host"] = "0.0.0.0"
    coordinator["port"] = values.get("coordinator", {}).get("port", DEFAULT_PORT)
    coordinator.pop("group_port", None)
    if collective(values):
        ports = values.get("coordinator", {})
        coordinator["group_port"] = ports.get("groupPort", DEFAULT_GROUP_PORT)
    coordinator.pop("tls_dir", None)
    coordinator.pop("auth_token_file", None)
    if tls:
        coordinator["tls_dir"] = DEPLOY_PATHS["tls_dir"]
    elif token:
        coordinator["auth_token_file"] = DEPLOY_PATHS["token_file"]
    section = config.setdefault("workers", {})
    section["count"] = workers.get("replicas", 2)
    section["device"] = "cuda" if workers.get("gpus", 1) > 0 else "cpu"
    config.setdefault("output", {})["dir"] = DEPLOY_PATHS["output_dir"]
    strategy = config.setdefault("strategy", {})
    strategy.pop("plugin_path", None)
    if values.get("plugin", {}).get("files"):
        strategy["plugin_path"] = DEPLOY_PATHS["config_dir"]
    return config


def next_commands(values: dict[str, Any], values_file: str) -> list[str]:
    """What to do after ``deploy render``, in order: the image, the Secrets the values need,
    then ``helm install`` (RELEASE is the Helm release name the user picks)."""
    workers = int(values.get("workers", {}).get("replicas", 1))
    image = values.get("image")
    lines = ["next:"]
    if image is None:
        lines.append(
            "  - the values name the chart's default image 'userdp', which is in no registry: "
            "build it (bash scripts/image.sh), push it where the cluster pulls from, and render "
            "again with --image REPOSITORY:TAG"
        )
    else:
        reference = image["repository"] + (f":{image['tag']}" if image.get("tag") else "")
        lines.append(f"  - push the image {reference} where the cluster pulls from")
    ids = ",".join(worker_ids("RELEASE", workers))
    if values.get("tls", {}).get("enabled", True):
        lines += [
            "  - mTLS is on: the Secrets must exist before the pods start:",
            f"      userdp certs dev-ca --out certs --names coordinator,{ids}",
            f"      userdp deploy secrets --tls-dir certs --release RELEASE --workers {workers} "
            "--out secrets.yaml && kubectl apply -f secrets.yaml",
        ]
    elif values.get("authToken", {}).get("enabled"):
        lines.append(
            f"  - token auth is on: userdp deploy secrets --token-file TOKEN --release RELEASE "
            f"--workers {workers} --out secrets.yaml && kubectl apply -f secrets.yaml"
        )
    if collective(values):
        group_port = values.get("coordinator", {}).get("groupPort", DEFAULT_GROUP_PORT)
        lines.append(
            f"  - collective data plane: the coordinator Service publishes the rendezvous port "
            f"{group_port} (coordinator.groupPort) next to the gRPC port, and the worker pods "
            "must reach each other and the coordinator pod on any TCP port (gloo, unencrypted: "
            "keep it on a private network; the interfaces are values "
            "workers.glooSocketIfname and coordinator.glooSocketIfname, default eth0)"
        )
    target = "THIS_FILE" if values_file == "-" else values_file
    lines.append(f"  - helm install RELEASE deploy/helm/userdp -f {target}")
    return lines
