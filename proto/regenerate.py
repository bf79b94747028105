"""Regenerate the committed protobuf/gRPC modules from ``userdp_v1.proto`` (the ONE way to do it).

Run ``.venv/bin/python proto/regenerate.py`` after editing the ``.proto``. It needs grpcio-tools
(a dev dependency). ``tests/proto/test_generated_fresh.py`` regenerates into a temporary
directory and fails when the committed files differ, so a stale checkout cannot pass CI.

The ``.proto`` is compiled as if it lived at ``userdp/proto/userdp_v1.proto`` so the generated
gRPC module imports ``from userdp.proto import userdp_v1_pb2`` (an installed-package import), not a
top-level ``userdp_v1_pb2``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("userdp_v1.proto",)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_names() -> list[str]:
    """File names (inside proto/) that :func:`generate` writes."""
    return [Path(p).stem + suffix for p in PROTO_FILES for suffix in GENERATED_SUFFIXES]


def generate(out_dir: Path) -> list[Path]:
    """Compile every ``.proto`` of :data:`PROTO_FILES` into ``out_dir``; return the written files."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src_root = Path(tmp) / "src"
        gen_root = Path(tmp) / "gen"
        package_dir = src_root / "userdp" / "proto"
        package_dir.mkdir(parents=True)
        gen_root.mkdir()
        for name in PROTO_FILES:
            shutil.copyfile(PROTO_DIR / name, package_dir / name)
        include = Path(protoc.__file__).resolve().parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{src_root}",
            f"-I{include}",
            f"--python_out={gen_root}",
            f"--pyi_out={gen_root}",
            f"--grpc_python_out={gen_root}",
            *[f"userdp/proto/{name}" for name in PROTO_FILES],
        ]
        status = protoc.main(args)
        if status != 0:
            raise RuntimeError(f"protoc failed with status {status}: {' '.join(args)}")
        written = []
        for name in generated_names():
            target = out_dir / name
            shutil.copyfile(gen_root / "userdp" / "proto" / name, target)
            written.append(target)
    return written


def main() -> int:
    for path in generate(PROTO_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
