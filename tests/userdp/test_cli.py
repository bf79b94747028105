"""The console script: version, help, and the exit-code convention."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    from userdp import cli
    from userdp.cli import config as cli_config

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


def test_a_traceback_that_cannot_be_saved_names_the_real_cause(monkeypatch, capsys, tmp_path):
    """Where the traceback's folder cannot take it, the note says why (here: its parent is a
    file), not that the folder is unwritable, and leaves no partial file."""
    from userdp import cli
    from userdp.cli import config as cli_config

    def broken(args):
        raise RuntimeError("boom")

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(cli_config, "_check", broken)
    monkeypatch.setattr(cli.tempfile, "gettempdir", lambda: str(blocker / "logs"))
    assert cli.main(["config", "check", "run.toml"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"(traceback: not saved: Not a directory in {blocker / 'logs'})\n"), err
    assert "not writable" not in err


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


def _ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell's `cmd &` does


@pytest.mark.parametrize("module", ["cli.simulate", "cli.coordinator", "cli.worker"])
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_sigint_and_sigterm_stop_a_command_started_with_sigint_ignored(module, signame) -> None:
    """`simulate`/`train`, `coordinator` and `worker` run inside `stop_signals()`, which makes
    SIGINT do what SIGTERM does even when the process inherited SIGINT ignored."""
    import signal

    code = (
        "import signal, sys, time\n"
        f"from userdp.{module} import stop_signals\n"
        "print('ignored' if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 'default')\n"
        "try:\n"
        "    with stop_signals():\n"
        "        print('ready', flush=True)\n"
        "        while True:\n"
        "            time.sleep(0.05)\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    try:
        assert proc.stdout.readline().strip() == "ignored"
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(getattr(signal, signame))
        assert proc.wait(timeout=120) == 130, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_commands_run_inside_stop_signals(monkeypatch, tmp_path) -> None:
    """While `simulate`, `coordinator` and `worker` run, SIGINT and SIGTERM raise
    KeyboardInterrupt (the worker swaps in its drain once connected); the handlers that were
    there before come back afterwards."""
    import argparse
    import signal
    import types

    from userdp.cli import coordinator as cli_coordinator
    from userdp.cli import simulate as cli_simulate
    from userdp.cli import worker as cli_worker

    seen = []

    def record(*args, **kwargs):
        seen.append((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)))
        return types.SimpleNamespace(
            run_dir=tmp_path,
            stopped="finished",
            steps_done=0,
            epsilon=0.0,
            delta=0.0,
            noise_multiplier=1.0,
            baseline_eval_loss=None,
            final_eval_loss=None,
        )

    monkeypatch.setitem(sys.modules, "userdp.run.launch", types.SimpleNamespace(run=record))
    monkeypatch.setattr(cli_coordinator, "_serve", lambda args: record() and 0)
    monkeypatch.setattr(cli_worker, "_serve", lambda args: record() and 0)
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    simulate = argparse.Namespace(
        command="simulate",
        config=None,
        demo=True,
        output=str(tmp_path),
        quiet=True,
        in_process=True,
    )
    assert cli_simulate._run(simulate) == 0
    assert cli_coordinator._run(argparse.Namespace()) == 0
    assert cli_worker._run(argparse.Namespace()) == 0
    interrupt = cli_simulate._interrupt
    assert seen == [(interrupt, interrupt)] * 3
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_the_cli_uses_its_environments_prebuilt_op_without_env_sh(tmp_path) -> None:
    """`userdp` run in a fresh shell (no scripts/env.sh) finds the DeepSpeed op cache setup built
    in its own environment, instead of rebuilding the op into ~/.cache/torch_extensions; values
    the caller set are kept."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "USERDP_CACHE_DIR")
    }
    code = (
        "import os\n"
        "from userdp.cli import main\n"
        "main(['config', 'show'])\n"
        "print(os.environ.get('TORCH_EXTENSIONS_DIR'), os.environ.get('USERDP_CACHE_DIR'))\n"
    )
    prebuilt = Path(sys.prefix) / "torch_extensions"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    ops, cache = result.stdout.strip().splitlines()[-1].split(" ")
    if prebuilt.is_dir():  # an environment set up by scripts/venv.sh (or the image)
        assert (ops, cache) == (str(prebuilt), str(Path(sys.prefix) / "userdp_cache"))
    else:
        assert (ops, cache) == ("None", "None")
    given = {**env, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")}
    result = subprocess.run(
        [sys.executable, "-c", code], env=given, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip().splitlines()[-1].split(" ")[0] == str(tmp_path / "ops")


def test_environment_caches_follow_the_prefix(tmp_path, monkeypatch) -> None:
    from userdp.environment import use_environment_caches

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("USERDP_CACHE_DIR", raising=False)
    use_environment_caches(tmp_path)  # no torch_extensions/: not a userdp-managed environment
    assert "TORCH_EXTENSIONS_DIR" not in os.environ
    (tmp_path / "torch_extensions").mkdir()
    use_environment_caches(tmp_path)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "torch_extensions")
    assert os.environ["USERDP_CACHE_DIR"] == str(tmp_path / "userdp_cache")


@pytest.mark.parametrize("inside", [False, True])
def test_simulate_into_an_existing_file_is_refused_at_once(tmp_path, capsys, inside) -> None:
    """`simulate --output FILE` (or a folder under a file) is one line, exit 2, before any work;
    `config check` says the same of output.dir."""
    from userdp.cli import main

    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    output = existing / "run" if inside else existing
    assert main(["simulate", "--demo", "--in-process", "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Errno" not in err and "traceback" not in err, err
    what = f"is inside {existing}, which is a file" if inside else "is a file"
    assert f"--output = '{output}' {what}, not a folder" in err
    assert existing.read_text() == "keep me"
    config = tmp_path / "run.toml"
    config.write_text(f"[output]\ndir = '{output}'\n")
    assert main(["config", "check", str(config)]) == 2
    assert f"output.dir = '{output}' {what}, not a folder" in capsys.readouterr().err
