"""Compile DeepSpeed's JIT ops into ``$TORCH_EXTENSIONS_DIR`` at image build time.

DeepSpeed builds some C++/CUDA ops the first time they are used (on a CPU it builds the
shared-memory communication op when ``deepspeed.comm`` initializes). In a pod that would cost
minutes at every start on a fresh node, so the image runs this script once, as the runtime user:
the ops land in the JIT cache, and torch's loader finds them there with the same source hash later.

    python warm_deepspeed_ops.py [BuilderClassName ...]

With no names it builds the ops DeepSpeed loads at start-up for the current accelerator
(``DS_ACCELERATOR`` selects it; there is no GPU during ``docker build``). Extra names (e.g.
``FusedAdamBuilder``) are built too. Exits non-zero when a requested op cannot be built.
"""

from __future__ import annotations

import os
import sys

# Op builders that DeepSpeed itself loads while initializing, per accelerator.
STARTUP_OPS: dict[str, tuple[str, ...]] = {
    "cpu": ("ShareMemCommBuilder",),
    "cuda": (),
}


def ops_to_build(accelerator: str, requested: list[str]) -> list[str]:
    """Start-up ops of ``accelerator`` followed by ``requested``, without duplicates."""
    names: list[str] = []
    for name in (*STARTUP_OPS.get(accelerator, ()), *requested):
        if name not in names:
            names.append(name)
    return names


def main(argv: list[str]) -> int:
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        print("warm_deepspeed_ops: set TORCH_EXTENSIONS_DIR (the cache to fill)", file=sys.stderr)
        return 2
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    kind = accelerator.device_name()
    names = ops_to_build(kind, argv)
    if not names:
        print(f"warm_deepspeed_ops: no JIT ops to build for accelerator {kind!r}")
        return 0
    failed = []
    for name in names:
        builder = accelerator.create_op_builder(name)
        # The CPU accelerator answers unknown names with a placeholder whose load() raises.
        placeholder = builder is not None and builder.NAME == "deepspeed_not_implemented"
        if builder is None or placeholder or not builder.is_compatible(verbose=False):
            print(f"warm_deepspeed_ops: {name} is not available on {kind!r}", file=sys.stderr)
            failed.append(name)
            continue
        builder.load(verbose=False)
        print(f"warm_deepspeed_ops: built {name} into {os.environ['TORCH_EXTENSIONS_DIR']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
