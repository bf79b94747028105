"""``userdp certs dev-ca --out DIR --names coordinator,worker-0,...``: a development CA for mTLS."""

from __future__ import annotations

import argparse


def _dev_ca(args: argparse.Namespace) -> int:
    from userdp.server.certs import make_dev_ca

    names = [n.strip() for n in args.names.split(",") if n.strip()]
    if not names:
        raise ValueError("--names must list at least one name, e.g. coordinator,worker-0")
    written = make_dev_ca(args.out, names, days=args.days)
    print(f"wrote {len(written)} files to {args.out} (CA + {len(names)} key/certificate pairs)")
    print("keep ca.key offline; give each party ca.pem and its own <name>.pem/<name>.key")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("certs", help="make development certificates for mTLS")
    sub = parser.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    dev = sub.add_parser(
        "dev-ca",
        help="write a dev CA and one certificate per name (CN = name = worker id)",
    )
    dev.add_argument("--out", required=True, help="directory to write ca.pem, <name>.pem/.key")
    dev.add_argument(
        "--names",
        required=True,
        help="comma-separated names: 'coordinator' and every worker id, e.g. coordinator,worker-0",
    )
    dev.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    dev.set_defaults(handler=_dev_ca)
