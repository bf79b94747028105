"""Plugin strategies named by config (``[strategy] name = "module:Class"``): found next to the
config, built with the standard arguments and ``[strategy.params]``, refused in one line (exit 2)
when the module, the class or the parameters are wrong."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

import userdp
from userdp import cli
from userdp.config import ConfigError, load_config
from userdp.run.registry import PluginError, build_strategy

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "examples" / "plugin" / "warmup_uls.py"


def write_config(folder: Path, name: str, params: str = "learning_rate = 0.5\n", extra=""):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.toml"
    path.write_text(
        f'[strategy]\nname = "{name}"\nsteps = 2\nsampling_prob = 0.25\n{extra}'
        f"[strategy.params]\n{params}\n[data]\ndemo_users = 40\nseq_len = 32\n"
        "[privacy]\nepsilon = 20.0\n"
    )
    return path


def run_cli(args, capsys) -> tuple[int, str]:
    code = cli.main(args)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def plugin_dir(tmp_path):
    shutil.copy(PLUGIN, tmp_path / "warmup_uls.py")
    return tmp_path


def test_a_plugin_next_to_the_config_is_found_and_built(plugin_dir, capsys):
    path = write_config(
        plugin_dir, "warmup_uls:WarmupUls", "learning_rate = 0.5\nwarmup_steps = 3\n"
    )
    assert run_cli(["config", "check", str(path)], capsys)[0] == 0
    config = load_config(path)
    assert config.strategy.plugin_path == str(plugin_dir.resolve())
    strategy = build_strategy(config, 100, 1.7)
    assert type(strategy).__name__ == "WarmupUls"
    assert strategy.noise_multiplier == 1.7 and strategy.warmup_steps == 3
    assert strategy.clip_norm == config.strategy.clip_norm
    assert strategy.sampler.sampling_prob == 0.25 and not strategy.sampler.seed_was_given


@pytest.mark.parametrize(
    "name, params, files, message",
    [
        ("no_such_module:X", "", {}, "no module 'no_such_module'"),
        ("shapes:Circle", "", {"shapes.py": "class Circle:\n    pass\n"}, "is not a subclass"),
        ("shapes:Square", "", {"shapes.py": "class Circle:\n    pass\n"}, "has no 'Square'"),
        (
            "broken:X",
            "",
            {"broken.py": "import not_installed_anywhere\n"},
            "importing 'broken' failed",
        ),
        (
            "warmup_uls:WarmupUls",
            "learning_rate = 0.5\ntypo = 1\n",
            {},
            "unexpected keyword argument 'typo'",
        ),
        ("warmup_uls:WarmupUls", "", {}, "missing a required argument: 'learning_rate'"),
        (
            "warmup_uls:WarmupUls",
            "learning_rate = 0.5\nclip_norm = 2.0\n",
            {},
            "strategy.params.clip_norm",
        ),
    ],
)
def test_bad_plugins_are_one_line_and_exit_2(plugin_dir, capsys, name, params, files, message):
    for file, text in files.items():
        (plugin_dir / file).write_text(text)
    path = write_config(plugin_dir, name, params)
    code, err = run_cli(["config", "check", str(path)], capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    code, err = run_cli(["simulate", "--config", str(path), "--in-process", "--quiet"], capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_a_plugin_constructor_that_refuses_its_arguments_is_a_plugin_error(plugin_dir):
    config = load_config(write_config(plugin_dir, "warmup_uls:WarmupUls"))
    with pytest.raises(PluginError, match=r"WarmupUls\(.*\) failed: noise_multiplier=-1.0"):
        build_strategy(config, 10, -1.0)


def test_params_and_plugin_path_belong_to_plugins_only(tmp_path):
    with pytest.raises(ConfigError, match="strategy.params is for plugin strategies"):
        load_config(write_config(tmp_path, "uls"))


def test_the_python_api_runs_a_plugin_from_a_dict(plugin_dir, tmp_path):
    config = {
        "strategy": {
            "name": "warmup_uls:WarmupUls",
            "plugin_path": str(plugin_dir),
            "steps": 2,
            "sampling_prob": 0.25,
            "engine": "loop",
            "params": {"learning_rate": 0.5},
        },
        "data": {"demo_users": 40, "seq_len": 32},
        "privacy": {"epsilon": 20.0},
    }
    result = userdp.simulate(config, tmp_path / "run", workers="in-process")
    assert result.steps_done == 2 and math.isfinite(result.epsilon)
    assert result.run_dir == tmp_path / "run" and result.final_eval_loss is not None
    with pytest.raises(ConfigError, match="workers='threads' is not allowed"):
        userdp.simulate(config, tmp_path / "other", workers="threads")


def test_the_flower_adapter_builds_a_plugin_from_config(plugin_dir):
    from userdp.run.flower import UserDpFlowerStrategy

    path = write_config(plugin_dir, "warmup_uls:WarmupUls")
    adapter = UserDpFlowerStrategy.from_config(path, ledger=None, num_users=40)
    assert type(adapter.strategy).__name__ == "WarmupUls"
    assert adapter.options.seq_len == 32 and adapter.expected_users == 40
    assert adapter.strategy.noise_multiplier > 0  # calibrated for 40 users at ε = 20


def test_import_userdp_is_cheap_and_exposes_the_api():
    import subprocess
    import sys

    code = "import sys, userdp; print('torch' in sys.modules, sorted(userdp.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("False")
    assert "simulate" in out.stdout and "Config" in out.stdout


def test_config_check_of_a_plugin_imports_no_torch_nor_scipy(plugin_dir):
    import subprocess
    import sys

    path = write_config(plugin_dir, "warmup_uls:WarmupUls")
    code = (
        "import sys\nfrom userdp.cli import main\n"
        f"assert main(['config', 'check', {str(path)!r}]) == 0\n"
        "print('torch' in sys.modules, 'scipy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_a_plugin_gets_the_sampler_the_builtins_build_for_the_config(tmp_path):
    (tmp_path / "own.py").write_text(
        "from userdp.accounting.mechanisms import UlsMechanism\n"
        "from userdp.strategies import Strategy\n\n\n"
        "class Own(Strategy):\n"
        "    def __init__(self, *, noise_multiplier, clip_norm, sampler):\n"
        "        super().__init__(noise_multiplier=noise_multiplier, clip_norm=clip_norm,\n"
        "                         sampler=sampler)\n\n"
        "    def mechanism(self):\n"
        "        return UlsMechanism(self.noise_multiplier, self.sampler.base.sampling_prob)\n"
    )
    path = write_config(tmp_path, "own:Own", "", extra='sampling = "padding"\n')
    plugin = build_strategy(load_config(path), 400, 1.0)
    builtin = build_strategy(load_config(write_config(tmp_path / "b", "uls", "")), 400, 1.0)
    assert plugin.sampler.sampling == "padding" and plugin.sampler.size == 135  # 100 + 4·√75
    builtin_padding = load_config(write_config(tmp_path / "c", "uls", "", 'sampling = "padding"\n'))
    assert build_strategy(builtin_padding, 400, 1.0).sampler.size == plugin.sampler.size
    assert builtin.sampler.sampling == "poisson"
