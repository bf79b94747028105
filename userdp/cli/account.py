"""``userdp account epsilon | calibrate | max-steps | optimize-blt``: the accountants from the command line.

Examples::

    userdp account epsilon --mechanism els --noise-multiplier 1 --steps 2000 \\
        --sampling-prob 0.01 --group-size 16 --delta 1e-6 --json
    userdp account calibrate --mechanism uls --epsilon 4 --delta 1e-9 --steps 10000 \\
        --sampling-prob 0.0015
    userdp account max-steps --mechanism uls --noise-multiplier 1 --sampling-prob 0.01 \\
        --epsilon 8 --delta 1e-6

    userdp account epsilon --mechanism balls-in-bins --noise-multiplier 2 --steps 6 --bins 2 \
        --epochs 3 --bin-semantics fixed --correlation banded:coefs=1,0.5
    userdp account optimize-blt --bins 100 --epochs 10 --buffers 2 --epsilon 1 --delta 1e-5

Bad input raises ValueError with the offending flag named; ``userdp`` prints it and exits 2. The
accountants (dp_accounting, scipy) are imported by the handlers, not at parser build time; the
flags' translation into mechanisms is in :mod:`userdp.cli.account_flags`.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from userdp.accounting.mechanisms import (
    BIN_SEMANTICS,
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    ESTIMATORS,
)
from userdp.cli.account_flags import (
    DEFAULT_DELTA,
    MECHANISMS,
    AccountCliError,
    build_mechanism,
    flag_names,
)


def _monte_carlo(args: argparse.Namespace) -> dict[str, Any]:
    if args.mechanism != "balls-in-bins":
        return {}
    out: dict[str, Any] = {}
    if args.samples is not None:
        out["num_samples"] = args.samples
    if args.seed is not None:
        out["seed"] = args.seed
    return out


COMPARISON_ONLY = (
    "group-privacy is a black-box conversion kept for comparison only; "
    "report the els accountant for DP-SGD-ELS runs"
)
BALLS_IN_BINS_CERTIFIED = (
    "balls-in-bins epsilon is the smallest certified upper bound among the random-allocation "
    "PLD (C = I), the Gaussian bound without amplification and Monte Carlo Estimate-Verify-"
    "Release (see 'method'); calibrate and max-steps use the same bound"
)
MONTE_CARLO_ESTIMATE = (
    "Monte Carlo POINT ESTIMATE of balls-in-bins epsilon (--estimate): below the true epsilon "
    "about half of the time, NOT a guarantee; drop --estimate for the certified bound"
)


def _emit(args: argparse.Namespace, result: dict[str, Any], text: str) -> int:
    note = None
    if args.mechanism == "group-privacy":
        note = COMPARISON_ONLY
    elif args.mechanism == "balls-in-bins":
        note = MONTE_CARLO_ESTIMATE if result.get("estimate") else BALLS_IN_BINS_CERTIFIED
    if note is not None:
        result = {**result, "note": note}
        text = f"{text}\nnote: {note}"
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(text)
    return 0


def _steps(args: argparse.Namespace, command: str) -> int:
    """``--steps``; for balls-in-bins it defaults to the whole run, ``--bins`` x ``--epochs``."""
    if args.steps is not None:
        return args.steps
    if args.mechanism == "balls-in-bins" and args.bins and args.epochs:
        return args.bins * args.epochs
    also = " (or --bins and --epochs: the whole run)" if args.mechanism == "balls-in-bins" else ""
    raise AccountCliError(f"--steps is required for `account {command}`{also}")


def _epsilon(args: argparse.Namespace) -> int:
    if args.noise_multiplier is None:
        raise AccountCliError("--noise-multiplier is required for `account epsilon`")
    args.steps = _steps(args, "epsilon")
    from userdp.accounting import api

    _check_monte_carlo_flags(args)
    mechanism = build_mechanism(args, args.noise_multiplier)
    method = None
    with flag_names():
        if args.estimate:
            from userdp.accounting import balls_in_bins

            eps = balls_in_bins.epsilon(
                mechanism.noise_multiplier,
                mechanism.bins,
                api.balls_in_bins_epochs(mechanism, args.steps),
                args.delta,
                bin_semantics=mechanism.bin_semantics,
                correlation=mechanism.correlation,
                **_monte_carlo(args),
            )
        elif args.mechanism == "balls-in-bins":
            from userdp.accounting.balls_in_bins_certified import certified_epsilon

            certified = certified_epsilon(
                mechanism, api.balls_in_bins_epochs(mechanism, args.steps), args.delta
            )
            eps, method = certified.epsilon, certified.method
        else:
            eps = api.epsilon(
                mechanism,
                args.steps,
                args.delta,
                value_discretization_interval=args.discretization,
            )
    result = {
        "epsilon": eps if math.isfinite(eps) else None,
        "delta": args.delta,
        "steps": args.steps,
        "mechanism": mechanism.to_dict(),
        **({"estimate": True} if args.estimate else {}),
        **({"method": method} if method else {}),
    }
    text = f"epsilon = {eps:.6g} at delta = {args.delta:g} after {args.steps} steps of {mechanism}"
    return _emit(args, result, text)


def _calibrate(args: argparse.Namespace) -> int:
    if args.epsilon is None:
        raise AccountCliError("--epsilon is required for `account calibrate`")
    args.steps = _steps(args, "calibrate")
    from userdp.accounting import calibration

    template = build_mechanism(args, 1.0)
    with flag_names():
        sigma = calibration.calibrate_noise_multiplier(
            template,
            args.epsilon,
            args.delta,
            args.steps,
            rtol=args.rtol,
            value_discretization_interval=args.discretization,
            use_cache=not args.no_cache,
            **_monte_carlo(args),
        )
    mechanism = build_mechanism(args, sigma)
    result = {
        "noise_multiplier": sigma,
        "epsilon": args.epsilon,
        "delta": args.delta,
        "steps": args.steps,
        "mechanism": mechanism.to_dict(),
    }
    text = f"noise_multiplier = {sigma:.6g} for epsilon <= {args.epsilon:g}, delta = {args.delta:g}"
    return _emit(args, result, text)


def _max_steps(args: argparse.Namespace) -> int:
    if args.noise_multiplier is None:
        raise AccountCliError("--noise-multiplier is required for `account max-steps`")
    if args.epsilon is None:
        raise AccountCliError("--epsilon is required for `account max-steps`")
    from userdp.accounting import calibration

    _check_monte_carlo_flags(args)
    mechanism = build_mechanism(args, args.noise_multiplier)
    with flag_names():
        steps = calibration.max_steps(
            mechanism,
            args.epsilon,
            args.delta,
            limit=args.limit,
            value_discretization_interval=args.discretization,
            use_cache=not args.no_cache,
        )
    result = {
        "max_steps": steps,
        "epsilon": args.epsilon,
        "delta": args.delta,
        "mechanism": mechanism.to_dict(),
    }
    text = f"max_steps = {steps} for epsilon <= {args.epsilon:g}, delta = {args.delta:g}"
    return _emit(args, result, text)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mechanism", required=True, choices=MECHANISMS)
    parser.add_argument("--sampling-prob", type=float, help="q (users) or p (examples), in (0, 1]")
    parser.add_argument("--group-size", type=int, help="G: examples per user (els, group-privacy)")
    parser.add_argument("--bins", type=int, help="balls-in-bins: steps per epoch")
    parser.add_argument("--epochs", type=int, help="balls-in-bins: epochs")
    parser.add_argument("--bin-semantics", choices=BIN_SEMANTICS, default="per-epoch")
    parser.add_argument(
        "--bands",
        type=int,
        help="banded-poisson: b̂, the groups of cyclic Poisson sampling (C has < b̂ diagonals)",
    )
    parser.add_argument(
        "--correlation",
        metavar="SPEC",
        help="balls-in-bins (needs --bin-semantics fixed) and banded-poisson (at most --bands "
        "diagonals): the noise correlation C, "
        "NAME:KEY=V1,V2;... e.g. blt:buf_decay=0.9,0.5;output_scale=0.3,0.2 or banded:coefs=1,0.5, "
        "its JSON, or @FILE with the JSON (default: identity, plain DP-SGD)",
    )
    parser.add_argument("--probes", type=int, help="randomized clipping: probes per norm estimate")
    parser.add_argument("--estimator", choices=ESTIMATORS, default="hutchinson")
    parser.add_argument(
        "--samples", type=int, help="balls-in-bins: Monte Carlo samples (--estimate; calibrate)"
    )
    parser.add_argument(
        "--seed", type=int, help="balls-in-bins: Monte Carlo seed (--estimate; calibrate)"
    )
    parser.add_argument("--delta", type=float, default=DEFAULT_DELTA, help="δ in (0, 1)")
    parser.add_argument(
        "--discretization",
        type=float,
        default=DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
        help="PLD value_discretization_interval (default 1e-4)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _check_monte_carlo_flags(args: argparse.Namespace) -> None:
    """--samples and --seed configure the Monte Carlo point estimate (--estimate) and, for
    calibrate, the start of a correlated search; a certified query takes neither."""
    estimate = getattr(args, "estimate", False)
    if estimate and args.mechanism != "balls-in-bins":
        raise AccountCliError(
            f"--estimate applies to --mechanism balls-in-bins only; the {args.mechanism} "
            "accountant is not a Monte Carlo estimate"
        )
    given = [flag for flag, v in (("--samples", args.samples), ("--seed", args.seed)) if v]
    if given and not estimate:
        raise AccountCliError(
            f"{given[0]} applies to the Monte Carlo point estimate (--estimate) only; the "
            "certified balls-in-bins epsilon is a function of the mechanism, steps and delta"
        )


def _estimate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--estimate",
        action="store_true",
        help="balls-in-bins: print the Monte Carlo POINT ESTIMATE of epsilon (not a guarantee; "
        "--samples, --seed) instead of the certified bound",
    )


def _optimize_blt(args: argparse.Namespace) -> int:
    """``account optimize-blt``: BLT parameters minimizing σ(C)²·error (``--objective``: the RMSE
    or the max error of prefix sums) under fixed balls-in-bins
    (:mod:`userdp.strategies.blt_amplified`)."""
    for flag, value in (
        ("--bins", args.bins),
        ("--epochs", args.epochs),
        ("--buffers", args.buffers),
        ("--samples", args.samples),
    ):
        if value is not None and value < 1:
            raise AccountCliError(f"{flag}={value} is out of range; expected an integer >= 1")
    if args.bins is None or args.epochs is None or args.epsilon is None:
        raise AccountCliError("--bins, --epochs and --epsilon are required for optimize-blt")
    if not (args.epsilon > 0 and 0 < args.delta < 1):
        raise AccountCliError(
            f"--epsilon={args.epsilon} / --delta={args.delta} out of range; expected ε > 0, "
            "0 < δ < 1"
        )
    from userdp.strategies.blt_amplified import optimize_blt_amplified

    found = optimize_blt_amplified(
        args.bins,
        args.epochs,
        args.buffers,
        args.epsilon,
        args.delta,
        num_samples=args.samples or 2**12,
        seed=args.seed or 0,
        objective=args.objective,
    )
    theta = ",".join(f"{v:.10g}" for v in found.blt.buf_decay)
    omega = ",".join(f"{v:.10g}" for v in found.blt.output_scale)
    spec = f"blt:buf_decay={theta};output_scale={omega}"
    result = {
        "buf_decay": list(found.blt.buf_decay),
        "output_scale": list(found.blt.output_scale),
        "correlation": spec,
        "noise_multiplier_estimate": found.noise_multiplier,
        "objective": found.objective,
        "loss": found.loss,
        "loss_definition": OPTIMIZE_BLT_LOSSES[found.objective],
        "unamplified": {
            "buf_decay": list(found.unamplified_blt.buf_decay),
            "output_scale": list(found.unamplified_blt.output_scale),
            "noise_multiplier_estimate": found.unamplified_noise_multiplier,
            "loss": found.unamplified_loss,
        },
        "evaluations": found.evaluations,
        "note": OPTIMIZE_BLT_NOTE,
    }
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(
            f"--correlation {spec}\n"
            f"objective {found.objective}: loss {OPTIMIZE_BLT_LOSSES[found.objective]} = "
            f"{found.loss:.6g} at σ ≈ {found.noise_multiplier:.6g} (BLT optimized without "
            f"amplification: {found.unamplified_loss:.6g} at σ ≈ "
            f"{found.unamplified_noise_multiplier:.6g})\nnote: {OPTIMIZE_BLT_NOTE}"
        )
    return 0


OPTIMIZE_BLT_LOSSES = {
    "rmse": "σ²·‖A C⁻¹‖²_F/n (RMSE² of the n prefix sums)",
    "max-error": "σ²·max_t ‖row_t(A C⁻¹)‖² (the largest prefix sum's squared error)",
}


OPTIMIZE_BLT_NOTE = (
    "σ here is a Monte Carlo estimate for comparing BLTs; calibrate the run's σ with `userdp "
    "account calibrate --mechanism balls-in-bins --bin-semantics fixed --correlation ...`"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("account", help="privacy accounting: ε, σ calibration, steps")
    sub = parser.add_subparsers(dest="account_command", metavar="ACTION", required=True)

    eps = sub.add_parser("epsilon", help="ε(δ) after --steps steps at --noise-multiplier")
    _common(eps)
    eps.add_argument("--noise-multiplier", type=float)
    eps.add_argument("--steps", type=int, help="releases; balls-in-bins default: --bins x --epochs")
    _estimate(eps)
    eps.set_defaults(handler=_epsilon)

    cal = sub.add_parser("calibrate", help="smallest σ with ε ≤ --epsilon after --steps steps")
    _common(cal)
    cal.add_argument("--epsilon", type=float)
    cal.add_argument("--steps", type=int, help="releases; balls-in-bins default: --bins x --epochs")
    cal.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance on σ")
    cal.add_argument("--no-cache", action="store_true", help="do not read or write the cache")
    cal.set_defaults(handler=_calibrate)

    mx = sub.add_parser("max-steps", help="largest step count with ε ≤ --epsilon")
    _common(mx)
    mx.add_argument("--noise-multiplier", type=float)
    mx.add_argument("--epsilon", type=float)
    mx.add_argument("--limit", type=int, default=10**7, help="search no further than this")
    mx.add_argument("--no-cache", action="store_true", help="do not read or write the cache")
    mx.set_defaults(handler=_max_steps)

    opt = sub.add_parser(
        "optimize-blt",
        help="BLT parameters optimized for fixed balls-in-bins amplification (σ²·error)",
    )
    opt.add_argument("--bins", type=int, help="steps per epoch (each user in one bin)")
    opt.add_argument("--epochs", type=int, help="epochs (participations per user)")
    opt.add_argument("--buffers", type=int, default=2, help="BLT buffers (default 2)")
    opt.add_argument("--epsilon", type=float)
    opt.add_argument("--delta", type=float, default=DEFAULT_DELTA, help="δ in (0, 1)")
    opt.add_argument("--samples", type=int, help="Monte Carlo draws inside the search (4096)")
    opt.add_argument("--seed", type=int, help="seed of the draws (0)")
    opt.add_argument(
        "--objective",
        choices=tuple(OPTIMIZE_BLT_LOSSES),
        default="rmse",
        help="what to minimize, A the prefix-sum matrix: rmse (default) = "
        f"{OPTIMIZE_BLT_LOSSES['rmse']}; max-error = {OPTIMIZE_BLT_LOSSES['max-error']}",
    )
    opt.add_argument("--json", action="store_true", help="print one JSON object")
    opt.set_defaults(handler=_optimize_blt)
