"""``userdp plan``: Estimate-and-Double on a config from the command line. The JSON is checked
against independent recomputations: each trace decision from the reported L(G) and σ(M), σ(M)
from the calibration, G_ELS and the ELS rate from the shard counts, L(G) from a plain HF loss."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from userdp import cli
from userdp.config import load_config

BUDGET = 256
CONFIG = """
[data]
demo_users = 120
eval_fraction = 0.4
seq_len = 32

[strategy]
name = "uls"
steps = 20

[privacy]
epsilon = 4.0

[output]
seed = 0
"""


def write_config(folder: Path, text: str = CONFIG) -> Path:
    path = folder / "run.toml"
    path.write_text(text)
    return path


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("plan"))


@pytest.fixture(scope="module", params=["std-ratio", "paper"])
def plan(request, config_path) -> dict:
    code, out, err = run_cli(
        ["plan", "--config", str(config_path), "--compute-budget", str(BUDGET), "--users", "16"]
        + ["--rule", request.param, "--json"]
    )
    assert code == 0, err
    return json.loads(out)


def shard_counts(config_path: Path) -> tuple[dict[str, int], list[str], list[str]]:
    from userdp.clients.shard_store import ShardStore

    from userdp.run.components import shard_directory, split_users

    config = load_config(config_path)
    with ShardStore(shard_directory(config)) as store:
        counts = {u: c.n_examples for u, c in store.user_counts().items()}
    train, held = split_users(list(counts), config.data.eval_fraction)
    return counts, train, held


def test_the_trace_follows_the_rule_and_the_choice_fits_the_budget(plan, config_path) -> None:
    _, train, _ = shard_counts(config_path)
    n = len(train)
    assert plan["num_users"] == n
    assert plan["delta"] == pytest.approx(1.0 / (10 * n)) and plan["delta_source"] == "1/(10·N)"
    g, m = plan["group_size"], plan["cohort_size"]
    assert plan["compute"] == g * m <= BUDGET and 2 * g * m > BUDGET  # no doubling left
    assert m <= n and plan["sampling_prob"] == m / n
    assert plan["config"] == {"strategy": {"group_size": g, "sampling_prob": m / n}}
    norms = {int(k): v for k, v in plan["norms"].items()}
    sigmas = {int(k): v for k, v in plan["noise_multipliers"].items()}
    state = (1, 32)
    for step in plan["trace"]:
        sg, sm = step["group_size"], step["cohort_size"]
        assert (sg, sm) == state
        assert step["norm"] == norms[sg] and step["norm_doubled"] == norms[2 * sg]
        assert step["tau_g"] == pytest.approx(norms[2 * sg] / norms[sg], rel=1e-12)
        if 2 * sm <= n:
            tau_m = sigmas[2 * sm] / sigmas[sm]
            assert step["tau_m"] == pytest.approx(tau_m, rel=1e-12)
        else:  # M cannot pass N: only G may grow
            assert step["tau_m"] is None and step["noise_multiplier_doubled"] is None
            tau_m = math.inf
        threshold = tau_m / 2 if plan["rule"] == "std-ratio" else tau_m
        expected = "G" if step["tau_g"] < threshold else "M"
        assert step["doubled"] == expected, step
        state = (2 * sg, sm) if expected == "G" else (sg, 2 * sm)
    assert state == (g, m)
    assert plan["noise_multiplier"] == sigmas[m]
    assert plan["noise_std_of_mean"] == pytest.approx(sigmas[m] * norms[g] / m)
    assert plan["user_source"] == "held-out" and plan["sampled_users"] == 16
    assert "does not account" in plan["privacy_caveat"]


def test_sigma_is_the_calibrated_noise_multiplier(plan) -> None:
    """σ(M) is calibrated on the plan's coarser PLD grid: exactly that calibration, on the
    private side of the run's own (finer) calibration and within 1 % of it."""
    from userdp.accounting.calibration import calibrate_noise_multiplier
    from userdp.accounting.mechanisms import UlsMechanism

    from userdp.plan.estimators import PLAN_DISCRETIZATION

    m, n = plan["cohort_size"], plan["num_users"]
    template = UlsMechanism(1.0, m / n)
    sigma = calibrate_noise_multiplier(
        template,
        4.0,
        plan["delta"],
        20,
        value_discretization_interval=PLAN_DISCRETIZATION,
        search_discretization_interval=None,
        use_cache=False,
    )
    assert plan["noise_multiplier"] == pytest.approx(sigma, rel=1e-12)
    run = calibrate_noise_multiplier(template, 4.0, plan["delta"], 20, use_cache=False)
    assert run * (1 - 1e-4) <= plan["noise_multiplier"] <= run * 1.01


def test_els_group_size_is_the_median_rounded_to_a_power_of_two(plan, config_path) -> None:
    counts, train, _ = shard_counts(config_path)
    median = float(np.median(list(counts.values())))
    g_els = 2 ** round(math.log2(median))
    els = plan["els"]
    assert els["median_examples"] == median and els["group_size"] == g_els
    per_user = np.array([counts[u] for u in train])
    subset = int(np.minimum(per_user, g_els).sum())
    g, m = plan["group_size"], plan["cohort_size"]
    expected = m / len(train) * float(np.minimum(per_user, g).sum())  # selection "random"
    assert els["subset_examples"] == subset
    assert els["expected_examples_per_step"] == pytest.approx(expected)
    assert els["sampling_prob"] == pytest.approx(min(1.0, expected / subset))


def test_text_output_names_the_config_lines_and_the_caveat(config_path) -> None:
    code, out, err = run_cli(
        ["plan", "--config", str(config_path), "--compute-budget", "64", "--users", "8"]
    )
    assert code == 0, err
    _, train, _ = shard_counts(config_path)
    assert "Estimate-and-Double" in out and "[strategy]" in out
    lines = out.splitlines()
    chosen = next(line for line in lines if line.startswith("chosen: "))
    g = int(chosen.split("G = ")[1].split(",")[0])
    m = int(chosen.split("M = ")[1].split(",")[0])
    assert g * m <= 64
    assert f"  group_size = {g}" in lines and f"  sampling_prob = {m / len(train)!r}" in lines
    assert "G_ELS = " in out and "does not account for" in out.replace("\n", " ")


def test_user_norm_is_the_gradient_norm_of_the_mean_example_loss(config_path) -> None:
    """Eq. 8 for one user, recomputed with the model's own loss (labels = inputs)."""
    from userdp.clients.engine import ClippingEngine
    from userdp.clients.model import build_model, model_shape
    from userdp.clients.shard_store import ShardStore

    from userdp.plan.estimators import UserGradientNorms
    from userdp.run.components import shard_directory

    config = load_config(config_path)
    _, _, held = shard_counts(config_path)
    with ShardStore(shard_directory(config)) as store:
        shape = model_shape(store.manifest, 32)
        module = build_model(config.model, shape, 0)
        engine = ClippingEngine(module, engine="loop", pad_id=0)
        norms = UserGradientNorms(
            engine, held, store.user_examples, selection="longest", seq_len=32, seed=0
        )
        user = next(u for u in held if len(store.user_examples(u)) >= 3)
        examples = store.user_examples(user)
        for group_size in (1, 2):
            longest = sorted(examples, key=len, reverse=True)[:group_size]
            losses = [
                module(input_ids=torch.as_tensor(e[:32], dtype=torch.long)[None]).logits
                for e in longest
            ]
            mean_loss = sum(
                torch.nn.functional.cross_entropy(
                    logits[0, :-1], torch.as_tensor(e[1:32], dtype=torch.long)
                )
                for logits, e in zip(losses, longest, strict=True)
            ) / len(longest)
            params = [p for p in module.parameters() if p.requires_grad]
            grads = torch.autograd.grad(mean_loss, params)
            expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
            assert norms.user_norm(user, group_size) == pytest.approx(expected, rel=1e-5)


def test_users_come_from_the_held_out_split_unless_training_users_are_allowed() -> None:
    from userdp.plan.budget import PlanError, sample_users

    train, held = [f"t{i}" for i in range(50)], [f"h{i}" for i in range(20)]
    kw = {"eval_fraction": 0.3, "allow_training_users": False}
    chosen = sample_users(train, held, "held-out", 8, 3, **kw)
    assert set(chosen) <= set(held) and len(set(chosen)) == 8
    assert chosen == sample_users(train, held, "held-out", 8, 3, **kw)  # the seed fixes it
    with pytest.raises(PlanError, match="--allow-training-users"):
        sample_users(train, held, "training", 8, 3, **kw)
    kw["allow_training_users"] = True
    assert set(sample_users(train, held, "training", 8, 3, **kw)) <= set(train)
    with pytest.raises(PlanError, match="only 20 held-out users"):
        sample_users(train, held, "held-out", 21, 3, **kw)


@pytest.mark.parametrize(
    ("edit", "argv", "message"),
    [
        (None, ["--compute-budget", "31"], "below the initial G·M"),
        (("[data]", '[data]\nshards = "/nonexistent/shards"'), [], "data.shards"),
        (('name = "uls"', 'name = "els"'), [], "strategy.name = 'uls'"),
        (None, ["--users-from", "training"], "--allow-training-users"),
        (None, ["--users", "500"], "held-out users"),
        (("demo_users = 120", "demo_users = 40"), [], "at least that many"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, edit, argv, message) -> None:
    text = CONFIG if edit is None else CONFIG.replace(*edit)
    path = write_config(tmp_path, text)
    budget = [] if "--compute-budget" in argv else ["--compute-budget", "64"]
    code, out, err = run_cli(["plan", "--config", str(path), "--users", "4", *budget, *argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("userdp plan: error: ") and message in err


def test_console_script_exits_2_below_the_initial_budget(config_path) -> None:
    userdp = str(Path(sys.executable).parent / "userdp")
    result = subprocess.run(
        [userdp, "plan", "--config", str(config_path), "--compute-budget", "16"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "below the initial G·M = 1·32 = 32" in result.stderr


def test_els_group_size_rounds_log2_of_the_median() -> None:
    from userdp.strategies.compute_budget import els_group_size

    assert [els_group_size(m) for m in (1, 1.4, 1.5, 2.5, 5, 6, 7, 11.5)] == [
        1,
        1,
        2,
        2,
        4,
        8,
        8,
        16,
    ]
    with pytest.raises(ValueError, match="median"):
        els_group_size(0)


def test_user_norm_with_perplexity_selection_uses_the_initial_models_lowest_ppl(
    config_path,
) -> None:
    """``data.selection = "lowest_ppl"``: the plan scores the user's examples at the initial
    model it measures norms with, and takes the G of lowest perplexity (computed here from the
    model's own cross-entropy)."""
    from userdp.clients.engine import ClippingEngine
    from userdp.clients.model import build_model, model_shape
    from userdp.clients.shard_store import ShardStore

    from userdp.plan.estimators import UserGradientNorms
    from userdp.run.components import shard_directory

    config = load_config(config_path)
    _, _, held = shard_counts(config_path)
    with ShardStore(shard_directory(config)) as store:
        module = build_model(config.model, model_shape(store.manifest, 32), 0)
        engine = ClippingEngine(module, engine="loop", pad_id=0)
        norms = UserGradientNorms(
            engine, held, store.user_examples, selection="lowest_ppl", seq_len=32, seed=0
        )
        user = next(u for u in held if len(store.user_examples(u)) >= 3)
        examples = [e for e in store.user_examples(user) if len(e) >= 2]

        def loss(e):
            logits = module(input_ids=torch.as_tensor(e[:32], dtype=torch.long)[None]).logits
            return torch.nn.functional.cross_entropy(
                logits[0, :-1], torch.as_tensor(e[1:32], dtype=torch.long)
            )

        with torch.no_grad():
            ppl = [math.exp(float(loss(e))) for e in examples]
        chosen = [examples[i] for i in np.argsort(ppl, kind="stable")[:2]]
        mean_loss = sum(loss(e) for e in chosen) / len(chosen)
        params = [p for p in module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(mean_loss, params)
        expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        assert norms.user_norm(user, 2) == pytest.approx(expected, rel=1e-5)


def test_progress_is_shown_on_a_terminal_and_nowhere_else(config_path) -> None:
    """On a terminal, stderr carries a status line naming what the plan computes (each user's
    L(G), each σ(M) calibration) with the time elapsed; through a pipe stderr stays empty and
    stdout holds only the plan."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    userdp = str(Path(sys.executable).parent / "userdp")
    argv = [userdp, "plan", "--config", str(config_path), "--compute-budget", "64"]
    argv += ["--users", "8", "--json"]
    master, slave = pty.openpty()
    size = struct.pack("HHHH", 24, 120, 0, 0)  # rows, columns: a terminal window's size
    fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave) as child:
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        out = child.stdout.read()
    os.close(master)
    assert child.returncode == 0, seen.decode(errors="replace")[-2000:]
    terminal = seen.decode("utf-8", errors="replace")
    assert "plan: L(G=1): user 1 of 8" in terminal and "plan: L(G=1): user 8 of 8" in terminal
    assert "plan: σ(M=32): calibrating to ε = 4" in terminal
    assert json.loads(out)["budget"] == 64
    piped = subprocess.run(argv, capture_output=True, text=True)
    assert piped.returncode == 0 and piped.stderr == ""
    assert json.loads(piped.stdout)["budget"] == 64
