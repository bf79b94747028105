"""docs/design.md's layout table names every module of the package once, in its folder's row,
and names no module that does not exist: the map is checked against the tree."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("accounting", "clients", "proto", "server", "strategies", "userdp")
MODULE = re.compile(r"`([A-Za-z0-9_]+\.py)`")


def layout_rows(text: str) -> dict[str, list[str]]:
    """{folder: the module basenames its row names} for the rows of the "## Layout" table whose
    first cell is one package folder."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        folder = re.fullmatch(r"`([a-z_/]+)/`", cells[0]) if line.startswith("| `") else None
        if folder and folder.group(1).split("/")[0] in PACKAGE_FOLDERS:
            assert folder.group(1) not in rows, f"two rows for {folder.group(1)}/"
            rows[folder.group(1)] = MODULE.findall(cells[-1])
    return rows


def package_modules() -> dict[str, set[str]]:
    """{folder: its modules' basenames}; a folder's ``__init__.py`` is its row itself."""
    modules: dict[str, set[str]] = {}
    for top in PACKAGE_FOLDERS:
        for path in (ROOT / top).rglob("*.py"):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                folder = path.parent.relative_to(ROOT).as_posix()
                modules.setdefault(folder, set()).add(path.name)
    return modules


def test_the_layout_table_names_every_module_once():
    rows = layout_rows((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    modules = package_modules()
    missing = {f"{f}/{m}" for f, names in modules.items() for m in names - set(rows.get(f, ()))}
    stale = {f"{f}/{m}" for f, names in rows.items() for m in set(names) - modules.get(f, set())}
    twice = {f"{f}/{m}" for f, names in rows.items() for m, n in Counter(names).items() if n > 1}
    assert not missing, f"modules missing from docs/design.md's layout table: {sorted(missing)}"
    assert not stale, f"docs/design.md's layout table names no such module: {sorted(stale)}"
    assert not twice, f"named twice in docs/design.md's layout table: {sorted(twice)}"


def test_the_check_reads_the_table():
    """The parser finds the rows (a table it could not read would pass vacuously)."""
    rows = layout_rows((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    assert {"accounting", "clients", "server", "userdp/hf", "userdp/run"} <= set(rows)
    assert "engine_request.py" in rows["clients"] and "tether.py" in rows["userdp/run"]
