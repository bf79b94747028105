"""Test driver: run the ``userdp`` CLI with its disk filled just before one kind of write.

``python fill_disk.py POINT CALL FILLER -- userdp-args...`` wraps the function POINT names and,
on its CALL-th call, fills the file system holding FILLER (a small tmpfs) before calling it, so
that write meets a real ENOSPC."""

from __future__ import annotations

import sys

POINTS = {
    "ledger": ("userdp.accounting.ledger", "Ledger", "_write_line"),
    "checkpoint": ("userdp.server.coordinator", None, "save_checkpoint"),
    "journal": ("userdp.server.coordinator", None, "append_release_journal"),
    "report": ("userdp.run.outputs", None, "render_report"),
}


def fill(path: str) -> None:
    with open(path, "ab", buffering=0) as handle:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    handle.write(b"\0" * size)
            except OSError:
                continue


def main() -> int:
    import importlib

    point, call, filler = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    args = sys.argv[sys.argv.index("--") + 1 :]
    module_name, owner_name, name = POINTS[point]
    module = importlib.import_module(module_name)
    owner = getattr(module, owner_name) if owner_name else module
    real = getattr(owner, name)
    calls = [0]

    def wrapper(*a, **k):
        calls[0] += 1
        if calls[0] == call:
            fill(filler)
        return real(*a, **k)

    setattr(owner, name, wrapper)
    from userdp.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
