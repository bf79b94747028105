"""The console script: version, help, and the exit-code convention."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import userdp
from userdp.cli import build_parser


def _userdp() -> str:
    return str(Path(sys.executable).parent / "userdp")


def test_console_script_version() -> None:
    result = subprocess.run([_userdp(), "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == f"userdp {userdp.__version__}"


def test_help_lists_every_registered_command() -> None:
    parser = build_parser()
    result = subprocess.run([_userdp(), "--help"], capture_output=True, text=True, check=True)
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert subparsers.choices, "no subcommands registered"
    for name in subparsers.choices:
        assert name in result.stdout


def test_no_command_prints_help_and_exits_2() -> None:
    result = subprocess.run([_userdp()], capture_output=True, text=True)
    assert result.returncode == 2
    assert "usage: userdp" in result.stdout


def test_readme_cli_reference_names_every_command() -> None:
    """The README's CLI reference and the registered commands cannot drift apart."""
    import re
    from pathlib import Path

    from userdp.cli import build_parser

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- CLI-REFERENCE -->")[1].split("<!-- /CLI-REFERENCE -->")[0]
    documented = set(re.findall(r"`userdp ([a-z-]+)", block))
    parser = build_parser()
    registered = set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001
    assert registered <= documented, f"undocumented commands: {sorted(registered - documented)}"
    assert documented - {"--version", "--help"} <= registered, sorted(documented - registered)


def test_an_unexpected_error_is_one_line_exit_2_with_its_traceback_in_a_file(
    monkeypatch, capsys, tmp_path
) -> None:
    from userdp import cli, cli_config

    def broken(args):
        raise RuntimeError("workers did not become ready\nsecond line of detail")

    monkeypatch.setattr(cli_config, "_check", broken)
    monkeypatch.setattr(cli.tempfile, "gettempdir", lambda: str(tmp_path))
    assert cli.main(["config", "check", "run.toml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        "userdp config: error: workers did not become ready second line of detail (traceback: "
    )
    (log,) = tmp_path.glob("userdp-config-error-*.log")
    assert str(log) in err
    assert "Traceback" in log.read_text() and "RuntimeError" in log.read_text()


def test_building_the_parser_imports_nothing_heavy() -> None:
    """`userdp --help` and parsing cost a fraction of a second: no torch, accountant, config
    schema or gRPC until a handler runs (CPU time is measured in benchmarks/cli_start.py)."""
    heavy = ("torch", "dp_accounting", "scipy", "numpy", "pydantic", "grpc", "transformers")
    code = (
        "import sys\n"
        "from userdp.cli import build_parser\n"
        "build_parser().parse_args(['account', 'epsilon', '--mechanism', 'uls'])\n"
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
