"""``userdp deploy render | secrets | probe``: the Kubernetes side of userdp (deploy/helm/userdp).

- ``render --config run.toml --values OUT.yaml`` turns a validated userdp TOML config into values
  for the Helm chart. The chart owns the deployment keys (where shards, certificates, the token and
  the outputs are mounted; the ports; the worker count and device): those are moved to the chart's
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

The in-pod paths of the chart are in :data:`userdp.kubernetes.chart.DEPLOY_PATHS`; tests/deploy checks that the chart
mounts exactly these.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _render(args: argparse.Namespace) -> int:
    import yaml

    from userdp.config import parse_config
    from userdp.kubernetes.values import (
        ShardSource,
        demo_warning,
        effective_config,
        next_commands,
        render_values,
    )

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


# ---- secrets ---------------------------------------------------------------------------------


def _secrets(args: argparse.Namespace) -> int:
    import yaml

    from userdp.kubernetes.secrets import secret_manifests

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


def _probe(args: argparse.Namespace) -> int:
    from userdp.kubernetes.probe import probe

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
        "--gpus",
        type=int,
        help="GPUs (ranks) per worker pod (default: workers.ranks if workers.device = cuda, else 0)",
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
