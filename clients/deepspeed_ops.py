"""DeepSpeed's JIT-compiled start-up ops: built once into ``$TORCH_EXTENSIONS_DIR``, never waited
on forever.

On a CPU, ``deepspeed.initialize`` builds the shared-memory communication op the first time it runs
(``deepspeed.comm.torch.build_shm_op``). torch serializes such builds with a lock file in the op's
build directory (``torch.utils.file_baton.FileBaton``); a build killed half-way leaves that file
behind and every later process waits on it forever. So:

* setup builds the ops once (``scripts/venv.sh`` and the Docker image run
  ``python -m userdp.clients.deepspeed_ops``), and workers only load the cached library;
* :func:`build_startup_ops` runs before ``deepspeed.initialize`` in every worker: it removes a lock
  that no live process holds (:func:`heal_stale_lock`, one log line), keeps checking while it waits
  on another process's build (the builder may be killed mid-way), and retries the build after a
  heal, so it never waits forever.

A lock is stale when no process holds it open or works in its build directory (Linux: read from
``/proc``, for the lock owner's processes; torch's builder keeps the lock open for the whole build
and runs ninja in that directory). Where that cannot be checked, a lock older than
:data:`STALE_LOCK_AGE_S` is stale. Limits: builders in another PID namespace (two containers
sharing one cache volume) are invisible to ``/proc`` here, so such a cache must not be shared
(images build their own); a builder that is alive but hung keeps its lock, and then the worker's
start-up bound (``coordinator.worker_startup_s``) ends the wait.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

STARTUP_OPS: dict[str, tuple[str, ...]] = {
    "cpu": ("ShareMemCommBuilder",),
    "cuda": (),
}
"""Op builders DeepSpeed itself loads while initializing, per accelerator."""

STALE_LOCK_AGE_S = 3600.0
"""Where live builders cannot be seen (no ``/proc``, or a lock of another user), a lock this old
is stale: far longer than the op's build takes even on a loaded machine."""

WATCH_INTERVAL_S = 5.0
"""How often a process waiting on another's build checks whether that build is still alive."""

MAX_BUILD_ATTEMPTS = 3


class OpBuildError(RuntimeError):
    """A DeepSpeed op could not be built or loaded (the message names it and the cache)."""


def ops_to_build(accelerator: str, requested: Sequence[str] = ()) -> list[str]:
    """Start-up ops of ``accelerator`` followed by ``requested``, without duplicates."""
    names: list[str] = []
    for name in (*STARTUP_OPS.get(accelerator, ()), *requested):
        if name not in names:
            names.append(name)
    return names


def build_directory(op_name: str) -> Path:
    """Where torch builds ``op_name`` (``$TORCH_EXTENSIONS_DIR/NAME``, else torch's default root
    with its python/accelerator subfolder), computed the way torch's JIT loader does."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op_name, False))


def _proc_uid(pid_dir: Path) -> int | None:
    try:
        for line in (pid_dir / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def lock_in_use(lock: Path) -> bool | None:
    """Whether a live process holds ``lock`` open or runs in its directory; None when that
    cannot be known (no ``/proc``, or the lock belongs to another user whose processes are
    hidden from this one)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    try:
        owner = lock.stat().st_uid
    except FileNotFoundError:
        return False
    if owner != os.geteuid() and os.geteuid() != 0:
        return None
    target = os.path.realpath(lock)
    directory = os.path.realpath(lock.parent)
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit() or _proc_uid(pid_dir) != owner:
            continue
        try:
            if os.readlink(pid_dir / "cwd") == directory:
                return True
            for fd in (pid_dir / "fd").iterdir():
                if os.readlink(fd) == target:
                    return True
        except OSError:
            continue  # the process ended while we looked
    return False


def heal_stale_lock(lock: Path, recheck_s: float = 1.0) -> bool:
    """Remove ``lock`` when no live build holds it (seen twice, ``recheck_s`` apart, so a build
    that is just releasing it is left alone); returns whether it was removed."""
    for attempt in range(2):
        try:
            stat = lock.stat()
        except FileNotFoundError:
            return False
        in_use = lock_in_use(lock)
        if in_use is None:
            in_use = time.time() - stat.st_mtime < STALE_LOCK_AGE_S
        if in_use:
            return False
        if attempt == 0:
            time.sleep(recheck_s)
    try:
        now = lock.stat()
        if (now.st_ino, now.st_ctime_ns) != (stat.st_ino, stat.st_ctime_ns):
            return False  # a new build took the lock meanwhile
        lock.unlink()
    except FileNotFoundError:
        return False
    age = time.time() - stat.st_mtime
    log.warning(
        "removed a stale DeepSpeed build lock %s (%.0f s old, no live build holds it); rebuilding",
        lock,
        age,
    )
    return True


def _forget_build(name: str) -> None:
    """Make torch's next JIT load of ``name`` in this process run the build again: torch skips
    the build of a module it already loaded once, which is wrong when that load only waited on
    another process's build that never finished."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

    JIT_EXTENSION_VERSIONER.entries.pop(name, None)


def _build_one(builder, on_wait: Callable[[], None] | None) -> None:
    """``builder.load()`` with a watcher that heals the op's lock if the build it waits on dies;
    retried after a heal (torch's waiter then finds no library and raises)."""
    lock = build_directory(builder.NAME) / "lock"
    stop = threading.Event()
    healed = threading.Event()

    def watch() -> None:
        while not stop.wait(WATCH_INTERVAL_S):
            if on_wait is not None:
                on_wait()
            if heal_stale_lock(lock):
                healed.set()

    if not (lock.parent / f"{builder.NAME}.so").is_file():
        log.warning(
            "DeepSpeed op %s is not built in %s: compiling it now (about a minute; setup builds "
            "it once: `TORCH_EXTENSIONS_DIR=DIR python -m userdp.clients.deepspeed_ops`, which "
            "scripts/venv.sh runs into .venv/torch_extensions)",
            builder.NAME,
            lock.parent.parent,
        )
    for attempt in range(1, MAX_BUILD_ATTEMPTS + 1):
        heal_stale_lock(lock)
        watcher = threading.Thread(target=watch, daemon=True, name="userdp-op-watch")
        stop.clear()
        watcher.start()
        try:
            builder.load(verbose=False)
            return
        except (ImportError, OSError, RuntimeError) as exc:
            if attempt == MAX_BUILD_ATTEMPTS:
                raise OpBuildError(
                    f"DeepSpeed op {builder.NAME} could not be built into {lock.parent}: {exc}"
                ) from exc
            if healed.is_set():
                log.warning(
                    "DeepSpeed op %s: the build waited on died; building it here", builder.NAME
                )
            else:
                log.warning("DeepSpeed op %s: %s; building again", builder.NAME, exc)
            healed.clear()
            _forget_build(builder.NAME)
        finally:
            stop.set()
            watcher.join()


def build_startup_ops(
    requested: Sequence[str] = (), on_wait: Callable[[], None] | None = None
) -> list[str]:
    """Build (or load from the cache) the ops DeepSpeed loads at start-up for the current
    accelerator, plus ``requested`` builder names; returns the names built. ``on_wait`` is
    called every few seconds while a build runs (start-up progress)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    kind = accelerator.device_name()
    built = []
    for name in ops_to_build(kind, requested):
        builder = accelerator.create_op_builder(name)
        # The CPU accelerator answers unknown names with a placeholder whose load() raises.
        placeholder = builder is not None and builder.NAME == "deepspeed_not_implemented"
        if builder is None or placeholder or not builder.is_compatible(verbose=False):
            raise OpBuildError(f"DeepSpeed op {name} is not available on accelerator {kind!r}")
        _build_one(builder, on_wait)
        built.append(name)
    return built


def main(argv: Sequence[str]) -> int:
    """``python -m userdp.clients.deepspeed_ops [BuilderClassName ...]``: fill the JIT cache.

    With no names it builds the ops DeepSpeed loads at start-up for the accelerator that
    ``DS_ACCELERATOR`` selects (there is no GPU during ``docker build``); extra names (e.g.
    ``FusedAdamBuilder``) are built too. Exit 2 without ``TORCH_EXTENSIONS_DIR``, 1 when an op
    cannot be built."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        print("deepspeed_ops: set TORCH_EXTENSIONS_DIR (the cache to fill)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="deepspeed_ops: %(message)s")
    cache = os.environ["TORCH_EXTENSIONS_DIR"]
    started = time.monotonic()
    shown: list[float] = []

    def progress() -> None:  # the first tick, then every 30 s
        elapsed = time.monotonic() - started
        if not shown or elapsed - shown[-1] >= 30:
            shown.append(elapsed)
            print(f"deepspeed_ops: still building ({elapsed:.0f} s)", file=sys.stderr, flush=True)

    try:
        built = build_startup_ops(list(argv), on_wait=progress)
    except OpBuildError as exc:
        print(f"deepspeed_ops: {exc}", file=sys.stderr)
        return 1
    if built:
        print(f"deepspeed_ops: {', '.join(built)} ready in {cache}")
    else:
        print("deepspeed_ops: no JIT ops to build for this accelerator")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
