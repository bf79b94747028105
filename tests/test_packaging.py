"""The wheel maps every root folder into the ``userdp`` namespace (README's layout table)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

FOLDERS = {
    "userdp": "userdp",
    "proto": "userdp/proto",
    "server": "userdp/server",
    "clients": "userdp/clients",
    "strategies": "userdp/strategies",
    "accounting": "userdp/accounting",
}


def _sources(folder: str):
    """Every module under a root folder, its subpackages included."""
    root = REPO_ROOT / folder
    for source in sorted(root.rglob("*.py")):
        if "__pycache__" not in source.parts:
            yield source.relative_to(root)


def _packages() -> list[str]:
    """Every package the wheel must import: each folder holding an ``__init__.py``."""
    names = []
    for folder, target in FOLDERS.items():
        for source in _sources(folder):
            if source.name == "__init__.py":
                names.append(".".join(Path(target, source.parent).parts))
    return sorted(set(names))


def _build_wheel(out: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO_ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("userdp-*.whl")
    return wheel


def test_wheel_contains_every_module_and_imports_from_it(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, target in FOLDERS.items():
        for source in _sources(folder):
            assert f"{target}/{source.as_posix()}" in names, f"{folder}/{source} missing from wheel"
    for proto in (REPO_ROOT / "proto").glob("*.proto"):
        assert f"userdp/proto/{proto.name}" in names

    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    modules = _packages()
    assert {"userdp.run", "userdp.cli", "userdp.config", "userdp.testing"} <= set(modules)
    probe = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(site)!r}), (name, module.__file__)\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
