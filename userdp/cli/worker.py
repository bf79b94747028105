"""``userdp worker --coordinator HOST:PORT --shards DIR ...``: serve gradient tasks for the shards
in DIR (all of them, or ``--shard-names``), reconnecting with backoff until drained or stopped.

At start it verifies its shards against ``manifest.json`` (sha256 of every shard and index file,
row/user/token counts; :meth:`userdp.clients.shard_store.ShardStore.verify`): a truncated or
modified file is a one-line error (exit 2). ``--no-verify`` skips that (one warning line says so);
a bad file then surfaces only when a task reads it.

While it starts (verifying, loading the model, building DeepSpeed's op) it logs and reports its
phase to the coordinator (:mod:`userdp.clients.startup`), which waits while that progress
continues. SIGTERM or SIGINT (also when started as a background job with SIGINT ignored) drains
gracefully once connected (no new tasks, finish queued ones, exit 0); before that it stops at
once (exit 130).

Under a launcher (``torchrun --nproc-per-node N ... userdp worker ...``: ``RANK`` and
``WORLD_SIZE`` set) the worker is N processes, one per device: rank 0 does all of the above and
is the only one that talks to the coordinator or serves ``--health-port``; the other ranks build
the same engine and follow rank 0's model versions and tasks (:mod:`userdp.clients.ranks`).
They ignore SIGTERM and SIGINT and end when rank 0 stops them.

Exit status: 0 when drained (by a signal, or by the coordinator at the end of its run: the worker
does not reconnect then); 2 for bad input (arguments, config, shards); 3 when the coordinator
refuses the worker (bad token/certificate, unknown worker id, shards that do not match its
manifest), with the coordinator's message; 4 when the coordinator has been unreachable for
``--reconnect-timeout`` seconds (default: the config's ``workers.reconnect_timeout_s``, 600;
0 = keep retrying).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from pathlib import Path

from userdp.cli.simulate import stop_signals

REFUSED_EXIT = 3
UNREACHABLE_EXIT = 4

log = logging.getLogger("userdp.worker")


def _parse_target(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator must be HOST:PORT, got {value!r}")
    return value


def _run(args: argparse.Namespace) -> int:
    from userdp.clients.ranks import launched_rank

    rank, _ = launched_rank()
    if rank > 0:
        with stop_signals(_left_to_rank_zero):
            return _follow(args, rank)
    with stop_signals():  # KeyboardInterrupt until the client can drain
        return _serve(args)


def _left_to_rank_zero(signum, frame) -> None:
    log.info("rank > 0 ignores signal %d: rank 0 drains the worker and then stops it", signum)


def _follow(args: argparse.Namespace, rank: int) -> int:
    """A rank > 0: the engine of the config on the same shards, following rank 0."""
    from userdp.clients.ranks import bind_local_device, follow
    from userdp.clients.shard_store import ShardStore
    from userdp.clients.worker_service import build_compute
    from userdp.config import Config, load_config

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s"
    )
    config = load_config(args.config) if args.config else Config()
    bind_local_device(config.workers.device)
    names = [n for n in (args.shard_names or "").split(",") if n] or None
    store = ShardStore(Path(args.shards), shards=names)
    try:
        follow(build_compute(config, store))
    finally:
        store.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from userdp.clients.grpc_client import (
        CoordinatorUnreachableError,
        WorkerClient,
        WorkerHealth,
        WorkerRefusedError,
    )
    from userdp.clients.ranks import BroadcastCompute, bind_local_device, launched_rank
    from userdp.clients.shard_format import file_sha256
    from userdp.clients.shard_store import ShardStore
    from userdp.clients.startup import StartupReporter
    from userdp.config import Config, load_config
    from userdp.proto import userdp_v1_pb2 as pb
    from userdp.proto.allocator import keep_freed_memory
    from userdp.proto.channels import read_tls_files, read_token

    keep_freed_memory()  # chunk messages reuse freed pages (see the module)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    target = _parse_target(args.coordinator)
    if args.token_file and args.tls_dir:
        raise ValueError("give either --token-file or --tls-dir, not both")
    if args.reconnect_timeout is not None and args.reconnect_timeout < 0:
        raise ValueError(
            f"--reconnect-timeout must be >= 0 seconds (0 = forever), got {args.reconnect_timeout:g}"
        )
    config = load_config(args.config) if args.config else Config()
    reconnect_timeout_s = (
        config.workers.reconnect_timeout_s
        if args.reconnect_timeout is None
        else args.reconnect_timeout
    )
    _, world_size = launched_rank()
    if world_size > 1:
        bind_local_device(config.workers.device)
    worker_id = args.worker_id or socket.gethostname()
    shard_dir = Path(args.shards)
    names = [n for n in (args.shard_names or "").split(",") if n] or None
    token = read_token(args.token_file) if args.token_file else None
    tls = read_tls_files(args.tls_dir, worker_id) if args.tls_dir else None
    store = ShardStore(shard_dir, shards=names)
    try:
        startup = StartupReporter(target, worker_id, store.shard_names, token=token, tls=tls)
    except BaseException:
        store.close()
        raise
    try:
        if args.verify:
            startup.phase("verifying shards")
            store.verify()
        else:
            log.warning(
                "worker %s: --no-verify: shards in %s are not checked against manifest.json; "
                "a truncated or modified file is found only when a task reads it",
                worker_id,
                shard_dir,
            )
        by_name = {entry.name: entry for entry in store.manifest.shards}
        holdings = [(name, by_name[name].sha256) for name in store.shard_names]

        from userdp.clients.worker_service import build_compute

        try:
            compute = build_compute(config, store, on_phase=startup.phase)
        except ModuleNotFoundError as exc:
            raise ValueError(
                f"userdp worker needs {exc.name} (the worker's model/engine), which this build lacks"
            ) from None
        startup.phase("connecting")
    except BaseException:
        startup.close()
        store.close()
        raise
    ranks = BroadcastCompute(compute) if world_size > 1 else None
    health = None
    try:
        health = WorkerHealth(args.health_port) if args.health_port is not None else None
        max_bytes = (args.max_message_mb or config.coordinator.max_message_mb) << 20
        client = WorkerClient(
            target,
            worker_id,
            holdings,
            ranks or compute,
            token=token,
            tls=tls,
            capabilities=pb.Capabilities(
                device=config.workers.device,
                num_devices=world_size,
                engines=[config.strategy.engine],
                max_message_bytes=max_bytes,
            ),
            manifest_sha256=file_sha256(shard_dir / "manifest.json"),
            max_message_bytes=max_bytes,
            reconnect_timeout_s=reconnect_timeout_s,
            health=health,
            on_welcome=startup.stop,
        )

        def on_stop(signum, frame):
            log.info("worker %s: %s: draining", worker_id, signal.Signals(signum).name)
            threading.Thread(target=client.drain, daemon=True).start()

        with stop_signals(on_stop):
            client.run()
    except WorkerRefusedError as exc:
        log.error("%s", exc)
        return REFUSED_EXIT
    except CoordinatorUnreachableError as exc:
        log.error("worker %s: %s", worker_id, exc)
        return UNREACHABLE_EXIT
    finally:
        if ranks is not None:
            ranks.stop()
        startup.close()
        if health is not None:
            health.stop()
        store.close()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "worker", help="serve gradient tasks for a coordinator from local shards"
    )
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--shards", required=True, help="shard directory (with manifest.json)")
    parser.add_argument(
        "--shard-names", help="comma-separated shards of DIR this worker holds (default: all)"
    )
    parser.add_argument("--worker-id", help="worker id (default: the host name); mTLS: cert CN")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument("--token-file", help="file with the shared token")
    auth.add_argument("--tls-dir", help="directory with ca.pem, <worker-id>.pem/.key")
    parser.add_argument("--config", help="the run's TOML config (model, engine, device)")
    parser.add_argument(
        "--health-port",
        type=int,
        help="serve grpc.health.v1 on this port (liveness '', readiness 'userdp.v1.Worker')",
    )
    parser.add_argument("--max-message-mb", type=int, help="gRPC message limit (default: config)")
    parser.add_argument(
        "--reconnect-timeout",
        type=float,
        metavar="SECONDS",
        help="exit (status 4) once the coordinator has been unreachable this long "
        "(default: workers.reconnect_timeout_s of --config, 600; 0 = keep retrying)",
    )
    verify = parser.add_mutually_exclusive_group()
    verify.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking the shards' sha256 and counts against manifest.json at start",
    )
    verify.add_argument(
        "--verify",
        dest="verify",
        action="store_true",
        help="check the shards against manifest.json at start (the default)",
    )
    parser.set_defaults(handler=_run, verify=True)
