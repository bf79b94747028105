"""The package's shape: layers that import downward only, no import cycle, modules of one idea.

The layer order is accounting < strategies < proto < clients, server < the app (``userdp/``:
config, run, cli, ...). A module may import its own layer or a lower one; imports under
``if TYPE_CHECKING:`` are types only and exempt. Imports inside functions are the CLI's
(``userdp/cli/``: ``userdp --help`` stays fast); elsewhere a module imports userdp at its top.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 450
MAX_FUNCTION_LINES = 80
"""The longest function of the worker (``clients/``) and the coordinator (``server/``)."""
LAYERS = {"accounting": 0, "strategies": 1, "proto": 2, "clients": 3, "server": 3}
"""userdp.<sub> -> layer; every other module of the package is the app (4)."""
GENERATED = {"userdp.proto.userdp_v1_pb2", "userdp.proto.userdp_v1_pb2_grpc"}


def package_modules() -> dict[str, Path]:
    """Module name -> file, from pyproject's package folders."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setup["package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in folders.items():
        root = REPO / folder
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            modules.setdefault(name, path)
    return modules


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 4) if len(parts) > 1 else 4


def imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported package module, inside a function) for each userdp import outside
    ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only: set[int] = set()
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            in_function.update(id(n) for n in ast.walk(node))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "userdp":
                found.append((target, id(node) in in_function))
    return found


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, bool]]]]:
    modules = package_modules()
    return modules, {name: imports(name, path, modules) for name, path in modules.items()}


def test_no_import_reaches_up_the_layers() -> None:
    _, edges = graph()
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in edges.items()
        for target, _ in targets
        if layer(target) > layer(source)
    )
    assert not upward, (
        f"imports that reach up accounting < strategies < proto < clients, server < app: {upward}"
    )


def test_no_import_cycle() -> None:
    _, edges = graph()
    successors = {name: sorted({t for t, _ in targets}) for name, targets in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in successors.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in successors:
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles: {cycles}"


def is_cli(module: str) -> bool:
    """``userdp.cli`` and its modules (not ``userdp.clients``, which shares the prefix)."""
    return module == "userdp.cli" or module.startswith("userdp.cli.")


def test_only_the_cli_imports_userdp_inside_functions() -> None:
    _, edges = graph()
    inside = sorted(
        f"{source} imports {target}"
        for source, targets in edges.items()
        if not is_cli(source)
        for target, in_function in targets
        if in_function
    )
    assert not inside, f"imports inside functions outside userdp/cli: {inside}"


def test_config_is_below_run() -> None:
    """The config layer reads and checks a config; building a run from it is the run layer's: no
    module of ``userdp.config`` imports ``userdp.run`` (the strategy catalogue it needs is
    :mod:`userdp.strategies.catalogue`)."""
    _, edges = graph()
    upward = sorted(
        f"{source} imports {target}"
        for source, targets in edges.items()
        if source.startswith("userdp.config")
        for target, _ in targets
        if target.startswith("userdp.run")
    )
    assert not upward, f"userdp.config imports the run layer: {upward}"


def test_no_package_module_is_over_the_line_limit() -> None:
    modules, _ = graph()
    long = sorted(
        f"{name} ({n} lines)"
        for name, path in modules.items()
        if name not in GENERATED
        and (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    )
    assert not long, f"modules over {MAX_LINES} lines (one module, one idea): {long}"


def test_no_function_of_the_worker_or_the_coordinator_is_over_the_line_limit() -> None:
    """A long function in ``clients/`` or ``server/`` hides steps that deserve names."""
    long, seen = [], 0
    for folder in ("clients", "server"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    seen += 1
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines})")
    assert seen > 100, f"read only {seen} functions in clients/ and server/"
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_graph_sees_known_edges() -> None:
    """The checks above read a real graph: known imports of each kind are found."""
    modules, edges = graph()
    assert "userdp.run.components" in modules and "userdp.accounting.ledger" in modules
    assert ("userdp.strategies.catalogue", False) in edges["userdp.config.load"]
    assert ("userdp.accounting.mechanisms", False) in edges["userdp.strategies.builtins"]
    assert any(in_function for _, in_function in edges["userdp.cli.simulate"])
    assert not is_cli("userdp.clients.engine") and is_cli("userdp.cli") and is_cli("userdp.cli.x")
    assert layer("userdp.accounting.ledger") < layer("userdp.strategies.base") < layer("userdp.cli")


def test_every_folder_of_modules_is_a_package_the_wheel_lists() -> None:
    """A folder of modules without ``__init__.py`` (a namespace package) or missing from
    pyproject's package list would import from a checkout and be absent from the wheel."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    missing = []
    for package, folder in setup["package-dir"].items():
        for init_dir in {p.parent for p in (REPO / folder).rglob("*.py")}:
            if "__pycache__" in init_dir.parts:
                continue
            name = ".".join((package, *init_dir.relative_to(REPO / folder).parts))
            if not (init_dir / "__init__.py").is_file() or name not in listed:
                missing.append(name)
    assert not missing, f"module folders that are not listed packages with __init__.py: {missing}"
