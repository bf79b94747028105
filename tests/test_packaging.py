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
    "userdp/testing": "userdp/testing",
}


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
        for source in (REPO_ROOT / folder).glob("*.py"):
            assert f"{target}/{source.name}" in names, f"{folder}/{source.name} missing from wheel"
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
    modules = ["userdp"] + [target.replace("/", ".") for target in FOLDERS.values()][1:]
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
