"""The flags of ``userdp account`` and their translation into mechanism values: which flags each
mechanism takes and needs, the correlation spec, and the errors that name a flag."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Iterator

from userdp.accounting.mechanisms import (
    BallsInBinsMechanism,
    BandedPoissonMechanism,
    CorrelationSpec,
    ElsMechanism,
    GroupPrivacyMechanism,
    InvalidMechanismError,
    Mechanism,
    RandomizedClippingMechanism,
    UlsMechanism,
)

MECHANISMS = (
    "uls",
    "els",
    "group-privacy",
    "balls-in-bins",
    "banded-poisson",
    "randomized-clipping",
)


DEFAULT_DELTA = 1e-6


# Parameter names in error messages → the flag the user typed.
_FLAGS = {
    "noise_multiplier": "--noise-multiplier",
    "sampling_prob": "--sampling-prob",
    "group_size": "--group-size",
    "bins": "--bins",
    "bands": "--bands",
    "epochs": "--epochs",
    "bin_semantics": "--bin-semantics",
    "probes": "--probes",
    "estimator": "--estimator",
    "target_epsilon": "--epsilon",
    "epsilon": "--epsilon",
    "delta": "--delta",
    "steps": "--steps",
    "value_discretization_interval": "--discretization",
}


# Which flags each mechanism needs (beyond --noise-multiplier).
_REQUIRED = {
    "uls": ("sampling_prob",),
    "els": ("sampling_prob", "group_size"),
    "group-privacy": ("sampling_prob", "group_size"),
    "balls-in-bins": ("bins", "epochs"),
    "banded-poisson": ("sampling_prob", "bands"),
    "randomized-clipping": ("sampling_prob", "probes"),
}


class AccountCliError(ValueError):
    """Bad ``userdp account`` input; the message names the flag."""


def build_mechanism(args: argparse.Namespace, noise_multiplier: float) -> Mechanism:
    """The mechanism the flags describe; missing or out-of-range flags raise AccountCliError."""
    kind = args.mechanism
    for name in _REQUIRED[kind]:
        if getattr(args, name) is None:
            raise AccountCliError(f"{_FLAGS[name]} is required for --mechanism {kind}")
    with flag_names():
        if kind == "uls":
            return UlsMechanism(noise_multiplier, args.sampling_prob)
        if kind == "els":
            return ElsMechanism(noise_multiplier, args.sampling_prob, args.group_size)
        if kind == "group-privacy":
            return GroupPrivacyMechanism(noise_multiplier, args.sampling_prob, args.group_size)
        if kind == "balls-in-bins":
            check_balls_in_bins_rate(args)
            return BallsInBinsMechanism(
                noise_multiplier,
                args.bins,
                args.epochs,
                bin_semantics=args.bin_semantics,
                correlation=parse_correlation(args.correlation),
            )
        if kind == "banded-poisson":
            return BandedPoissonMechanism(
                noise_multiplier,
                args.sampling_prob,
                args.bands,
                correlation=parse_correlation(args.correlation),
            )
        return RandomizedClippingMechanism(
            noise_multiplier, args.sampling_prob, args.probes, estimator=args.estimator
        )


def parse_correlation(text: str | None) -> CorrelationSpec | None:
    """``--correlation``: a named family ``NAME:KEY=V1,V2;KEY2=...`` (``blt:buf_decay=0.9,0.5;
    output_scale=0.3,0.2``, ``banded:coefs=1,0.5``, ``toeplitz:coefs=...``, ``identity``), the
    JSON form of a ledger's ``correlation`` field, or ``@FILE`` holding that JSON."""
    if text is None:
        return None
    from userdp.accounting.correlation import CorrelationError, from_spec

    source = text
    try:
        if text.startswith("@"):
            source = f"the file {text[1:]}"
            with open(text[1:], encoding="utf-8") as handle:
                spec = CorrelationSpec.from_dict(json.load(handle))
        elif text.lstrip().startswith("{"):
            spec = CorrelationSpec.from_dict(json.loads(text))
        else:
            name, _, rest = text.partition(":")
            params = {}
            for item in filter(None, rest.split(";")):
                key, sep, values = item.partition("=")
                if not sep:
                    raise ValueError(f"{item!r} is not KEY=V1,V2,...")
                params[key.strip()] = [float(v) for v in values.split(",")]
            spec = CorrelationSpec.of(name.strip(), **params)
        from_spec(spec)  # a known family with its parameters
    except (OSError, ValueError, KeyError, TypeError, CorrelationError) as exc:
        raise AccountCliError(
            f"--correlation {text!r}: {exc} (in {source}); expected NAME:KEY=V1,V2;... "
            "(blt:buf_decay=...;output_scale=..., banded:coefs=..., toeplitz:coefs=...), the "
            'JSON {"name": ..., "params": {...}} or @FILE with that JSON'
        ) from None
    return spec


def check_balls_in_bins_rate(args: argparse.Namespace) -> None:
    """Balls-in-bins has no free sampling rate: each user is in one of ``--bins`` steps per epoch.
    A ``--sampling-prob`` other than 1/bins would be silently ignored, so it is refused."""
    q = args.sampling_prob
    if q is None or args.bins is None or args.bins < 1:
        return
    if not math.isclose(q, 1.0 / args.bins, rel_tol=1e-6):
        raise AccountCliError(
            f"--sampling-prob={q!r} does not match --mechanism balls-in-bins with --bins "
            f"{args.bins} (each user is in exactly one of {args.bins} steps per epoch, rate "
            f"1/bins = {1.0 / args.bins:.6g}); drop --sampling-prob or set it to 1/bins"
        )


@contextlib.contextmanager
def flag_names() -> Iterator[None]:
    """Re-raise InvalidMechanismError with the parameter name replaced by the user's flag."""
    try:
        yield
    except AccountCliError:
        raise
    except InvalidMechanismError as exc:
        message = str(exc)
        for name, flag in _FLAGS.items():
            if message.startswith(f"{name}="):
                message = flag + message[len(name) :]
                break
        raise AccountCliError(message) from None
