"""``userdp plan --config F --compute-budget B``: ULS's group size and cohort for a compute
budget by Estimate-and-Double, and the ELS group-size heuristic (see :mod:`userdp.plan.budget`)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager

RULE_HELP = (
    "std-ratio (default): double G iff L(2G)/L(G) < σ(2M)/(2σ(M)), the actual change of the "
    "noise std σ(M)·L(G)/M; paper: double G iff τ_G < τ_M, the rule as printed in Algorithm 3"
)


def _plan(args: argparse.Namespace) -> int:
    from userdp.cli.simulate import demo_config
    from userdp.config import load_config
    from userdp.plan.budget import plan_budget

    if args.demo == bool(args.config):
        raise ValueError("give exactly one of --config FILE or --demo")
    config = demo_config() if args.demo else load_config(args.config)
    logging.basicConfig(level=logging.WARNING)
    with terminal_status() as status:
        plan = plan_budget(
            config,
            args.compute_budget,
            rule=args.rule,
            users=args.users,
            user_source=args.users_from,
            allow_training_users=args.allow_training_users,
            seed=args.seed,
            device=args.device,
            on_progress=status,
        )
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(render(plan))
    return 0


@contextmanager
def terminal_status() -> Iterator[Callable[[str], None]]:
    """A one-line status on stderr with the elapsed time, shown only when stderr is a terminal
    (a pipe or a file gets only the plan); cleared when the block ends."""
    from tqdm import tqdm

    line = tqdm(total=0, bar_format="plan: {desc} [{elapsed}]", disable=None, file=sys.stderr)

    def show(message: str) -> None:
        line.set_description_str(message, refresh=True)

    try:
        yield show
    finally:
        line.close()


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def render(plan) -> str:
    """The plan as text: the choice, the trace, the config lines, ELS, notes and the caveat."""
    data = plan.to_dict()
    g, m = data["group_size"], data["cohort_size"]
    delta_source = f" ({data['delta_source']})"
    lines = [
        'Estimate-and-Double (Algorithm 3 of "Fine-Tuning Large Language Models with User-Level '
        'Differential Privacy")',
        f"  budget G·M <= {data['budget']}, rule {data['rule']}; N = {data['num_users']} training "
        f"users, ε = {data['epsilon']:g}, δ = {data['delta']:.3g}{delta_source}, "
        f"T = {data['steps']} steps "
        "(ULS, Poisson)",
        f"  L(G): median over {data['sampled_users']} {data['user_source']} users (seed "
        f"{data['user_seed']}) of the norm of the gradient of the mean loss over <= G examples "
        f"at the initial model (init seed {data['model_init_seed']})",
        "",
        f"  {'G':>5} {'M':>6} {'L(G)':>9} {'L(2G)':>9} {'τ_G':>7} {'σ(M)':>9} {'σ(2M)':>9} "
        f"{'τ_M':>7}  doubled",
    ]
    for step in data["trace"]:
        lines.append(
            f"  {step['group_size']:>5} {step['cohort_size']:>6} {_number(step['norm']):>9} "
            f"{_number(step['norm_doubled']):>9} {_number(step['tau_g']):>7} "
            f"{_number(step['noise_multiplier']):>9} "
            f"{_number(step['noise_multiplier_doubled']):>9} {_number(step['tau_m']):>7}  "
            f"{step['doubled']}"
        )
    if not data["trace"]:
        lines.append("  (no doubling fits the budget)")
    lines += [
        "",
        f"chosen: G = {g}, M = {m}, compute G·M = {data['compute']}; σ(M) = "
        f"{data['noise_multiplier']:.4g}, L(G) = {data['norms'][str(g)]:.4g}, noise std on the "
        f"mean update σ·L(G)/M = {data['noise_std_of_mean']:.4g}",
        "put in the config:",
        "  [strategy]",
        *(f"  {line}" for line in plan.config_lines()),
    ]
    els = data["els"]
    lines += [
        "",
        f"ELS heuristic: G_ELS = {els['group_size']} (median {els['median_examples']:g} examples "
        f"per user, rounded to a power of two); sampling_prob = {els['sampling_prob']:.4g} gives "
        f"the plan's {els['expected_examples_per_step']:.4g} expected examples per step from "
        f"|D_sub| = {els['subset_examples']}",
    ]
    for note in data["notes"]:
        lines += ["", *textwrap.wrap(f"note: {note}", 100)]
    lines += ["", *textwrap.wrap(f"privacy: {data['privacy_caveat']}", 100)]
    return "\n".join(lines)


def _budget(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number of examples, got {text!r}")
    return int(value)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="choose ULS's group_size and sampling_prob for a compute budget (Estimate-and-Double)",
        description=(
            "Estimate-and-Double (Algorithm 3 of 'Fine-Tuning Large Language Models with "
            "User-Level Differential Privacy'): from (G, M) = (1, 32), while G·M fits the budget, "
            "double the group size G or the cohort M, whichever lowers the noise std "
            "σ(M)·L(G)/M more. L(G) is the median norm of users' mean gradients over <= G "
            "examples at the config's initial model (data.selection, data.seq_len); σ(M) is "
            "calibrated to privacy.epsilon, δ and strategy.steps with q = M/N (N training "
            "users). Prints the choice, the trace, the strategy.group_size / "
            "strategy.sampling_prob lines for the config, and the ELS group size G_ELS (median "
            "examples per user rounded to a power of two). PRIVACY: L(G) reads users' examples "
            "without noise; the choice is a data-dependent hyperparameter that ε does not "
            "account for. The users come from the held-out split (data.eval_fraction) unless "
            "--users-from training --allow-training-users. Needs strategy.name = 'uls' with "
            "poisson sampling."
        ),
    )
    parser.add_argument("--config", help="the run's TOML config")
    parser.add_argument("--demo", action="store_true", help="plan the embedded default config")
    parser.add_argument(
        "--compute-budget",
        type=_budget,
        required=True,
        metavar="B",
        help="examples per step, G·M <= B (at least 32, the initial G·M)",
    )
    parser.add_argument(
        "--users", type=int, default=128, help="users whose gradients give L(G) (default 128)"
    )
    parser.add_argument(
        "--users-from",
        choices=("held-out", "training"),
        default="held-out",
        help="held-out (default): the users data.eval_fraction holds out, never trained on; "
        "training: the training users, only with --allow-training-users",
    )
    parser.add_argument(
        "--allow-training-users",
        action="store_true",
        help="accept reading training users' examples without noise (outside ε)",
    )
    parser.add_argument(
        "--rule", choices=("std-ratio", "paper"), default="std-ratio", help=RULE_HELP
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the user sample and example selection (0)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="where gradients run (default workers.device)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.set_defaults(handler=_plan)
