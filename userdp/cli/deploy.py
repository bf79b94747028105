"""``userdp deploy render | secrets | probe``: the Kubernetes side of userdp (deploy/helm/userdp).

- ``render --config run.toml --values OUT.yaml`` turns a validated userdp TOML config into values
  for the Helm chart. The chart owns the deployment keys (where shards, certificates, the token and
  the outputs are mounted; the port; the worker count and device): those are moved to the chart's
  own values or dropped, with one line per key saying so. The config's ``data.shards`` is a folder
  on this machine, so render must be told where the shards are in the cluster (:class:`ShardSource`:
  a claim holding them, or a claim holding the dataset for the shard Job); without ``data.shards``
  the run uses the synthetic demo corpus, and render says so in a warning.
- ``secrets --tls-dir DIR --release NAME`` writes the Secret manifests the chart mounts (the
  coordinator's certificate, every worker's certificate, optionally the shared token) from a
  directory made by ``userdp certs dev-ca`` or your own PKI with the same file names.
- ``probe`` asks a grpc.health.v1 endpoint whether a service is SERVING (exit 0) or not (exit 1).
  The chart's coordinator probes use it, because with mTLS the kubelet's native gRPC probe cannot
  present a client certificate; the image's Docker HEALTHCHECK uses it with ``USERDP_HEALTH_*``.

The in-pod paths of the chart are in :data:`DEPLOY_PATHS`; tests/deploy checks that the chart
mounts exactly these. One idea — the chart's contract (paths, values, secrets, probes) seen from
the CLI — hence one module over 400 lines.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHART_NAME = "userdp"
DEFAULT_PORT = 50051
COORDINATOR_CERT_NAME = "coordinator"

# Where the chart mounts things inside the pods (deploy/helm/userdp/templates/_helpers.tpl).
DEPLOY_PATHS: dict[str, str] = {
    "config_dir": "/etc/userdp/config",
    "config_file": "/etc/userdp/config/userdp.toml",
    "tls_dir": "/etc/userdp/tls",
    "token_file": "/etc/userdp/token/token",
    "data_dir": "/data",
    "shards": "/data/shards",
    "state_dir": "/var/lib/userdp",
    "output_dir": "/var/lib/userdp/run",
}

# Config keys the chart sets itself, and what it sets them to.
CHART_MANAGED_KEYS: dict[tuple[str, str], str] = {
    ("data", "shards"): f"{DEPLOY_PATHS['shards']} (shards/ on the data volume)",
    ("coordinator", "host"): "0.0.0.0",
    ("coordinator", "port"): "values coordinator.port",
    ("coordinator", "tls_dir"): f"{DEPLOY_PATHS['tls_dir']} when values tls.enabled",
    ("coordinator", "auth_token_file"): (
        f"{DEPLOY_PATHS['token_file']} when values authToken.enabled (and tls.enabled is false)"
    ),
    ("workers", "count"): "values workers.replicas",
    ("workers", "device"): "cuda when values workers.gpus > 0, else cpu",
    ("output", "dir"): f"{DEPLOY_PATHS['output_dir']} (on the coordinator's state volume)",
}


def chart_fullname(release: str) -> str:
    """The chart's ``userdp.fullname`` for a release (no overrides): the prefix of every object."""
    name = release if CHART_NAME in release else f"{release}-{CHART_NAME}"
    return name[:40].removesuffix("-")


def worker_ids(release: str, count: int) -> list[str]:
    """Worker ids (= StatefulSet pod names = certificate common names) of a release."""
    return [f"{chart_fullname(release)}-worker-{index}" for index in range(count)]


# ---- render ----------------------------------------------------------------------------------


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
    import tomllib

    from userdp.config import load_config

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
    if gpus is None:
        gpus = 1 if config.workers.device == "cuda" else 0
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
    values["coordinator"] = {"port": config.coordinator.port or DEFAULT_PORT}
    values["workers"] = {"replicas": config.workers.count, "gpus": gpus}
    values["tls"] = {"enabled": auth == "mtls"}
    values["authToken"] = {"enabled": auth == "token"}
    plugin_files, plugin_notes = _plugin_files(config, kept)
    if plugin_files:
        values["plugin"] = {"files": plugin_files}
    notes += plugin_notes
    values.update(shard_values(shards, config.data.shards, config.data.demo_users))
    return values, notes


PLUGIN_MAX_BYTES = 512 << 10  # a ConfigMap holds at most 1 MiB in all


def _plugin_files(config: Any, kept: dict[str, dict[str, Any]]) -> tuple[dict[str, str], list]:
    """The plugin module the chart ships in its ConfigMap (a single file next to the config, or
    in ``strategy.plugin_path``), or nothing for a built-in or a plugin installed as a package
    (which the image must then hold). ValueError when the chart cannot reach the plugin."""
    import importlib.util

    from userdp.config import BUILTIN_STRATEGIES

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


def _render(args: argparse.Namespace) -> int:
    import yaml

    from userdp.config import parse_config

    shards = ShardSource(
        claim=args.shards_claim,
        input_claim=args.shard_input_claim,
        input_path=args.shard_input_path,
        user_column=args.user_column,
        text_column=args.text_column,
        tokenizer=args.tokenizer,
        format=args.format,
        demo=args.demo,
    )
    values, notes = render_values(
        args.config, image=args.image, gpus=args.gpus, auth=args.auth, shards=shards
    )
    parse_config(effective_config(values))  # what the pods will read must validate too
    header = (
        f"# Helm values for deploy/helm/userdp, from {args.config} (userdp deploy render).\n"
        "# helm install RELEASE deploy/helm/userdp -f THIS_FILE\n"
    )
    warning = demo_warning(values)
    if warning:
        header += (
            "# shardJob.demo: true -- the run trains on the synthetic demo corpus, not user data.\n"
        )
    text = header + yaml.safe_dump(values, sort_keys=False, default_flow_style=False)
    if args.values == "-":
        sys.stdout.write(text)
    else:
        Path(args.values).write_text(text, encoding="utf-8")
        print(f"wrote {args.values}")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if warning:
        print(warning, file=sys.stderr)
    print("\n".join(next_commands(values, args.values)), file=sys.stderr)
    return 0


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
    target = "THIS_FILE" if values_file == "-" else values_file
    lines.append(f"  - helm install RELEASE deploy/helm/userdp -f {target}")
    return lines


# ---- secrets ---------------------------------------------------------------------------------


def _secret(name: str, files: dict[str, bytes], namespace: str | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {"app.kubernetes.io/name": CHART_NAME, "app.kubernetes.io/part-of": CHART_NAME},
    }
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": {key: base64.b64encode(data).decode("ascii") for key, data in files.items()},
    }


def secret_manifests(
    tls_dir: str | Path | None,
    release: str,
    workers: int,
    *,
    token_file: str | Path | None = None,
    namespace: str | None = None,
) -> list[dict[str, Any]]:
    """The Secrets the chart mounts: ``<fullname>-tls-coordinator`` (ca.pem, coordinator.pem/key),
    ``<fullname>-tls-workers`` (ca.pem and each worker's <id>.pem/key) and ``<fullname>-token``.

    Raises ValueError naming the first missing file: a worker without its certificate could not
    connect, so it is better to fail here than in the pod.
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    fullname = chart_fullname(release)
    manifests = []
    if tls_dir is not None:
        tls_dir = Path(tls_dir)

        def read(name: str) -> bytes:
            path = tls_dir / name
            if not path.is_file():
                raise ValueError(
                    f"--tls-dir {tls_dir}: missing {name} (issue it with `userdp certs dev-ca "
                    f"--out {tls_dir} --names coordinator,{','.join(worker_ids(release, workers))}`)"
                )
            return path.read_bytes()

        ca = read("ca.pem")
        coordinator = {
            "ca.pem": ca,
            f"{COORDINATOR_CERT_NAME}.pem": read(f"{COORDINATOR_CERT_NAME}.pem"),
            f"{COORDINATOR_CERT_NAME}.key": read(f"{COORDINATOR_CERT_NAME}.key"),
        }
        worker_files = {"ca.pem": ca}
        for worker_id in worker_ids(release, workers):
            worker_files[f"{worker_id}.pem"] = read(f"{worker_id}.pem")
            worker_files[f"{worker_id}.key"] = read(f"{worker_id}.key")
        manifests.append(_secret(f"{fullname}-tls-coordinator", coordinator, namespace))
        manifests.append(_secret(f"{fullname}-tls-workers", worker_files, namespace))
    if token_file is not None:
        from userdp.proto.channels import read_token

        token = read_token(token_file)
        manifests.append(_secret(f"{fullname}-token", {"token": token.encode()}, namespace))
    if not manifests:
        raise ValueError("nothing to write: give --tls-dir, --token-file or both")
    return manifests


def _secrets(args: argparse.Namespace) -> int:
    import yaml

    manifests = secret_manifests(
        args.tls_dir,
        args.release,
        args.workers,
        token_file=args.token_file,
        namespace=args.namespace,
    )
    text = "# Secrets for the userdp chart (userdp deploy secrets). Holds private keys.\n"
    text += yaml.safe_dump_all(manifests, sort_keys=False, explicit_start=True)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        names = ", ".join(m["metadata"]["name"] for m in manifests)
        print(f"wrote {args.out} ({names}); apply with kubectl apply -f {args.out}")
    return 0


# ---- probe -----------------------------------------------------------------------------------


def probe(
    address: str,
    service: str = "",
    *,
    tls_dir: str | None = None,
    cert_name: str | None = None,
    server_name: str | None = None,
    timeout_s: float = 5.0,
) -> tuple[bool, str]:
    """(True, "SERVING") when ``service`` at ``address`` reports SERVING; else (False, why)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls_dir is None:
        channel = grpc.insecure_channel(address)
    else:
        from userdp.proto.channels import read_tls_files

        name = cert_name or COORDINATOR_CERT_NAME
        files = read_tls_files(tls_dir, name)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert
        )
        options = [("grpc.ssl_target_name_override", server_name or name)]
        channel = grpc.secure_channel(address, credentials, options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def _probe(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("USERDP_HEALTH_ADDRESS")
    if not address:
        print("probe: no --address and no USERDP_HEALTH_ADDRESS: nothing serves, nothing to check")
        return 0
    service = args.service if args.service is not None else os.environ.get("USERDP_HEALTH_SERVICE")
    tls_dir = args.tls_dir or os.environ.get("USERDP_HEALTH_TLS_DIR") or None
    cert_name = args.cert_name or os.environ.get("USERDP_HEALTH_CERT_NAME") or None
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    ok, status = probe(
        address,
        service or "",
        tls_dir=tls_dir,
        cert_name=cert_name,
        server_name=args.server_name,
        timeout_s=args.timeout,
    )
    print(f"probe {address} service {service or '(server)'!s}: {status}")
    return 0 if ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "deploy", help="Kubernetes: chart values from a config, Secrets from certs, health probe"
    )
    sub = parser.add_subparsers(dest="deploy_command", metavar="ACTION", required=True)

    render = sub.add_parser(
        "render",
        help="write Helm values (deploy/helm/userdp) for a userdp TOML config",
        description=(
            "Validate --config and write chart values; keys the chart sets are reported. "
            "The config's data.shards is a folder on this machine: say where the shards are in "
            "the cluster with --shards-claim (a claim already holding them) or "
            "--shard-input-claim (a claim holding the dataset the shard Job shards); without "
            "them render refuses (exit 2). A config without data.shards, or --demo, trains on "
            "the synthetic demo corpus, and render prints a WARNING line saying so."
        ),
    )
    render.add_argument("--config", required=True, help="userdp TOML config")
    render.add_argument("--values", required=True, help="output values file ('-' = stdout)")
    render.add_argument("--image", help="container image REPOSITORY[:TAG] built from deploy/")
    render.add_argument(
        "--gpus", type=int, help="GPUs per worker (default: 1 if workers.device = cuda, else 0)"
    )
    render.add_argument(
        "--auth",
        choices=("mtls", "token"),
        help="how workers authenticate (default: token if the config has only "
        "auth_token_file, else mtls)",
    )
    data = render.add_argument_group(
        "where the shards are in the cluster (required when the config sets data.shards)"
    )
    data.add_argument(
        "--shards-claim",
        metavar="CLAIM",
        help="PersistentVolumeClaim with the `userdp shard` output in its shards/ folder (values "
        "data.persistence.existingClaim; the shard Job verifies it); with --shard-input-claim "
        "or --demo, the claim the shard Job writes into",
    )
    data.add_argument(
        "--shard-input-claim",
        metavar="CLAIM",
        help="PersistentVolumeClaim holding your dataset: the shard Job runs `userdp shard` on "
        "it (values shardJob.input.existingClaim)",
    )
    data.add_argument(
        "--shard-input-path",
        metavar="PATH",
        help="the Parquet/JSONL/CSV/Arrow file or folder, relative to that claim's root",
    )
    data.add_argument(
        "--user-column", metavar="COLUMN", help="the dataset's user id column (the privacy unit)"
    )
    data.add_argument("--text-column", metavar="COLUMN", help="the dataset's text column")
    data.add_argument(
        "--tokenizer", metavar="SPEC", help="byte, bpe:N or /input/<tokenizer dir> (default byte)"
    )
    data.add_argument(
        "--format", choices=("auto", "parquet", "jsonl", "csv", "arrow"), help="default auto"
    )
    data.add_argument(
        "--demo",
        action="store_true",
        help="train on the synthetic demo corpus (shardJob.demo=true), not on user data",
    )
    render.set_defaults(handler=_render)

    secrets = sub.add_parser(
        "secrets",
        help="write the chart's Secret manifests from a certificate directory and token file",
    )
    secrets.add_argument("--tls-dir", help="ca.pem, coordinator.pem/.key, <worker id>.pem/.key")
    secrets.add_argument("--token-file", help="shared token file (one line, >= 16 characters)")
    secrets.add_argument("--release", required=True, help="the Helm release name")
    secrets.add_argument("--workers", type=int, required=True, help="number of worker pods")
    secrets.add_argument("--namespace", help="namespace to put in the manifests")
    secrets.add_argument("--out", required=True, help="output YAML file ('-' = stdout)")
    secrets.set_defaults(handler=_secrets)

    check = sub.add_parser(
        "probe",
        help="grpc.health.v1 check: exit 0 when SERVING, 1 otherwise",
        description=(
            "Defaults come from USERDP_HEALTH_ADDRESS, USERDP_HEALTH_SERVICE, "
            "USERDP_HEALTH_TLS_DIR and USERDP_HEALTH_CERT_NAME (the image's HEALTHCHECK)."
        ),
    )
    check.add_argument("--address", help="HOST:PORT of the health endpoint")
    check.add_argument("--service", help="service name ('' = the server as a whole)")
    check.add_argument("--tls-dir", help="mTLS: directory with ca.pem and <cert-name>.pem/.key")
    check.add_argument("--cert-name", help="mTLS: client certificate name (default coordinator)")
    check.add_argument("--server-name", help="mTLS: name expected in the server's certificate")
    check.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    check.set_defaults(handler=_probe)
