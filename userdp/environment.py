"""The caches a userdp environment brings (what ``scripts/env.sh`` exports), found from
``sys.prefix``: the CLI and the Python API (:func:`userdp.simulate`) start the same way."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["ENVIRONMENT_CACHES", "use_environment_caches"]

ENVIRONMENT_CACHES = (
    ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
    ("USERDP_CACHE_DIR", "userdp_cache"),
)
"""Variables the CLI points into its own environment (``sys.prefix``), as ``scripts/env.sh``
exports them: DeepSpeed's JIT op cache, which ``scripts/venv.sh`` (and the Docker image) fill once,
and userdp's accounting cache."""


def use_environment_caches(prefix: str | os.PathLike[str] | None = None) -> None:
    """Where ``prefix`` holds a prebuilt DeepSpeed op cache (``torch_extensions/``, made by setup),
    use it and the environment's accounting cache unless the caller set them: without this a
    worker would rebuild DeepSpeed's op into the shared ``~/.cache/torch_extensions`` (minutes,
    and clobbering another environment's build). Hub access stays off (userdp never downloads).
    Child processes (workers) inherit the result."""
    root = Path(sys.prefix if prefix is None else prefix)
    if (root / "torch_extensions").is_dir():
        for variable, folder in ENVIRONMENT_CACHES:
            if not os.environ.get(variable):
                os.environ[variable] = str(root / folder)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
