"""``userdp account …``: JSON output equals the Python API; bad input is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from userdp.accounting import ElsMechanism, UlsMechanism, epsilon

from userdp.cli import main


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE_DIR", str(tmp_path / "cache"))


def _run_json(capsys, *argv: str) -> dict:
    assert main(["account", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def test_epsilon_uls_json(capsys) -> None:
    result = _run_json(
        capsys, "epsilon", "--mechanism", "uls", "--noise-multiplier", "1", "--steps", "2000",
        "--sampling-prob", "0.01", "--delta", "1e-6",
    )  # fmt: skip
    assert result["epsilon"] == epsilon(UlsMechanism(1.0, 0.01), 2000, 1e-6)
    assert result["epsilon"] == pytest.approx(2.95526, abs=1e-5)
    assert result["delta"] == 1e-6
    assert result["mechanism"] == {"kind": "uls", "noise_multiplier": 1.0, "sampling_prob": 0.01}


def test_epsilon_els_json(capsys) -> None:
    result = _run_json(
        capsys, "epsilon", "--mechanism", "els", "--noise-multiplier", "1", "--steps", "2000",
        "--sampling-prob", "0.01", "--group-size", "4", "--discretization", "1e-3",
    )  # fmt: skip
    assert result["epsilon"] == pytest.approx(14.535, rel=2e-4)  # dp_accounting, Fig. 1 setting
    assert result["mechanism"]["group_size"] == 4


def test_epsilon_text_output(capsys) -> None:
    argv = ["account", "epsilon", "--mechanism", "uls", "--noise-multiplier", "2",
            "--steps", "10", "--sampling-prob", "0.1"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("epsilon = ")


def test_calibrate_json_is_private(capsys) -> None:
    result = _run_json(
        capsys, "calibrate", "--mechanism", "uls", "--epsilon", "1", "--delta", "1e-6",
        "--steps", "256", "--sampling-prob", "0.015625",
    )  # fmt: skip
    sigma = result["noise_multiplier"]
    assert sigma == pytest.approx(1.37700, abs=2e-4)  # dp_accounting, mean-estimation setting
    assert epsilon(UlsMechanism(sigma, 0.015625), 256, 1e-6) <= 1.0


def test_calibrate_els_json(capsys) -> None:
    result = _run_json(
        capsys, "calibrate", "--mechanism", "els", "--epsilon", "1", "--delta", "1e-6",
        "--steps", "256", "--sampling-prob", "0.015625", "--group-size", "16",
        "--discretization", "1e-3", "--rtol", "1e-3",
    )  # fmt: skip
    sigma = result["noise_multiplier"]
    assert sigma == pytest.approx(17.0461, rel=2e-3)
    eps = epsilon(ElsMechanism(sigma, 0.015625, 16), 256, 1e-6, value_discretization_interval=1e-3)
    assert eps <= 1.0


def test_max_steps_json(capsys) -> None:
    result = _run_json(
        capsys, "max-steps", "--mechanism", "uls", "--noise-multiplier", "1",
        "--sampling-prob", "0.02", "--epsilon", "1", "--discretization", "1e-3",
    )  # fmt: skip
    steps = result["max_steps"]
    mech = UlsMechanism(1.0, 0.02)
    assert epsilon(mech, steps, 1e-6, value_discretization_interval=1e-3) <= 1.0
    assert epsilon(mech, steps + 1, 1e-6, value_discretization_interval=1e-3) > 1.0


BASE = ["account", "epsilon", "--mechanism", "uls", "--noise-multiplier", "1", "--steps", "10",
        "--sampling-prob", "0.1"]  # fmt: skip


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (_replace(BASE, "--sampling-prob", "1.5"), "--sampling-prob=1.5"),
        (_replace(BASE, "--sampling-prob", "0"), "--sampling-prob=0.0"),
        (_replace(BASE, "--noise-multiplier", "0"), "--noise-multiplier=0.0"),
        (_replace(BASE, "--noise-multiplier", "-2"), "--noise-multiplier=-2.0"),
        (_replace(BASE, "--delta", "1"), "--delta=1.0"),
        (_replace(BASE, "--delta", "0"), "--delta=0.0"),
        (_replace(BASE, "--steps", "-3"), "--steps=-3"),
        (_replace(_replace(BASE, "--mechanism", "els"), "--group-size", "0"), "--group-size=0"),
        (_replace(BASE, "--mechanism", "els"), "--group-size is required"),
        (_replace(BASE, "--mechanism", "balls-in-bins"), "--bins is required"),
        (["account", "calibrate", "--mechanism", "uls", "--epsilon", "-1", "--steps", "10",
          "--sampling-prob", "0.1"], "--epsilon=-1"),
        (["account", "calibrate", "--mechanism", "uls", "--steps", "10",
          "--sampling-prob", "0.1"], "--epsilon is required"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("userdp account: error: ")
    assert needle in lines[0]


def test_unknown_mechanism_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(_replace(BASE, "--mechanism", "dp-sgd"))
    assert info.value.code == 2


def test_group_privacy_is_available_for_comparison(capsys) -> None:
    common = ["--noise-multiplier", "2", "--steps", "100", "--sampling-prob", "0.01",
              "--discretization", "1e-3"]  # fmt: skip
    black_box = _run_json(
        capsys, "epsilon", "--mechanism", "group-privacy", "--group-size", "4", *common
    )
    tight = _run_json(capsys, "epsilon", "--mechanism", "els", "--group-size", "4", *common)
    assert black_box["mechanism"]["kind"] == "group-privacy"
    assert "comparison only" in black_box["note"]
    assert black_box["epsilon"] > tight["epsilon"]


BIB = ["--mechanism", "balls-in-bins", "--noise-multiplier", "3", "--steps", "64",
       "--bins", "32", "--epochs", "2"]  # fmt: skip
ESTIMATE = ["--estimate", "--samples", "4096", "--seed", "0"]


def test_balls_in_bins_epsilon_json_is_the_certified_bound(capsys) -> None:
    from userdp.accounting import BallsInBinsMechanism
    from userdp.accounting.balls_in_bins import epsilon as point_estimate

    result = _run_json(capsys, "epsilon", *BIB)
    mechanism = BallsInBinsMechanism(3.0, 32, 2, bin_semantics="per-epoch")
    assert result["epsilon"] == epsilon(mechanism, 64, 1e-6)
    assert result["method"] == "random-allocation PLD" and "estimate" not in result
    assert result["mechanism"]["kind"] == "balls-in-bins"
    assert "smallest certified upper bound" in result["note"]
    # --sampling-prob equal to 1/bins is accepted (the same flags as the other mechanisms), and
    # changes nothing
    again = _run_json(capsys, "epsilon", *BIB, "--sampling-prob", "0.03125")
    assert again["epsilon"] == result["epsilon"]
    # the point estimate only when asked for, and labelled
    estimate = _run_json(capsys, "epsilon", *BIB, *ESTIMATE)
    assert estimate["estimate"] is True and "NOT a guarantee" in estimate["note"]
    assert estimate["epsilon"] == point_estimate(
        3.0, 32, 2, 1e-6, bin_semantics="per-epoch", num_samples=4096, seed=0
    )
    for argv in (["--samples", "4096"], ["--seed", "1"]):
        assert main(["account", "epsilon", *BIB, *argv]) == 2
    assert "(--estimate) only" in capsys.readouterr().err


def test_balls_in_bins_steps_default_to_the_whole_run(capsys) -> None:
    """--bins and --epochs fix a balls-in-bins run's length: --steps may be left out (and is
    bins x epochs); another mechanism still needs it, in one line that names it."""
    flags = [f for f in BIB if f not in ("--steps", "64")]
    assert len(flags) == len(BIB) - 2
    whole = _run_json(capsys, "epsilon", *flags)
    assert whole["steps"] == 64 and whole == _run_json(capsys, "epsilon", *BIB)
    uls = ["--mechanism", "uls", "--noise-multiplier", "1", "--sampling-prob", "0.1"]
    assert main(["account", "epsilon", *uls, "--delta", "1e-6"]) == 2
    err = capsys.readouterr().err
    assert "--steps is required for `account epsilon`" in err and "--bins" not in err


def test_balls_in_bins_sampling_prob_other_than_one_over_bins_is_refused(capsys) -> None:
    assert main(["account", "epsilon", *BIB, "--sampling-prob", "0.01"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sampling-prob=0.01" in err[0] and "1/bins" in err[0]


def test_randomized_clipping_with_hutch_plus_plus(capsys) -> None:
    """Hutch++ is accounted by the Hutchinson envelope with its tail probes: same ε, recorded."""
    argv = ["epsilon", "--mechanism", "randomized-clipping", "--noise-multiplier", "1.5",
            "--sampling-prob", "0.02", "--steps", "40", "--probes", "16", "--delta", "1e-5"]  # fmt: skip
    plus = _run_json(capsys, *argv, "--estimator", "hutch++")
    plain = _run_json(capsys, *argv, "--estimator", "hutchinson")
    assert plus["mechanism"]["estimator"] == "hutch++"
    assert plus["epsilon"] == plain["epsilon"]


def test_balls_in_bins_estimate_loads_neither_dp_accounting_nor_scipy() -> None:
    # A Monte Carlo point estimate pays only for numpy and its own samples: dp_accounting (the
    # PLD accountants) and scipy cost more CPU time to import than the 2^20-sample query itself.
    code = (
        "import sys\n"
        "from userdp.cli import main\n"
        f"assert main(['account', 'epsilon', *{BIB!r}, *{ESTIMATE!r}]) == 0\n"
        "loaded = [m for m in ('dp_accounting', 'scipy') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "epsilon =" in result.stdout
