"""Which distributions a GPU machine's image lacks for userdp, from this environment's metadata.

A GPU image brings its own CUDA build of torch and the usual stack around it; what it lacks is
the rest of userdp's dependency closure (DeepSpeed, pydantic, dp-accounting, grpcio, protobuf,
Opacus for the anchors, ...). This prints ``name==version`` for every distribution in the closure
of ``--need`` (default: userdp, deepspeed, opacus) that is NOT in the closure of ``--image``
(default: the packages such images ship: torch, transformers, peft, numpy, scipy, pyarrow,
pytest) nor named by ``--skip`` (default: ``uv``, a 17 MB command-line binary that Flower lists
and nothing the checks import), one per line, as installed in THIS environment (so the pins
match the tested set). ``benchmarks/gpu_check.sh prepare`` downloads or builds their wheels.

    .venv/bin/python benchmarks/gpu_wheels.py [--need userdp deepspeed opacus] [--image ...]
        [--skip uv]
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import sys

from packaging.requirements import Requirement

IMAGE = ["torch", "transformers", "peft", "numpy", "scipy", "pyarrow", "pytest"]
NEED = ["userdp", "deepspeed", "opacus"]
SKIP = ["uv"]


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """Normalized name → installed version for ``roots`` and everything they require (markers
    evaluated for this interpreter, extras not followed); roots not installed are left out."""
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if _key(name) in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[_key(name)] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--need", nargs="+", default=NEED)
    parser.add_argument("--image", nargs="+", default=IMAGE)
    parser.add_argument("--skip", nargs="*", default=SKIP)
    args = parser.parse_args(argv)
    missing = [n for n in args.need if _key(n) not in closure([n])]
    if missing:
        print(f"gpu_wheels: not installed here: {', '.join(missing)}", file=sys.stderr)
        return 2
    image = closure(args.image)
    skip = {_key(n) for n in args.skip}
    for name, version in sorted(closure(args.need).items()):
        if name not in image and name not in skip:
            print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
