"""The privacy report: what ε(δ) a run spent, and every assumption that number rests on.

The report states the assumptions: sampling scheme (:class:`~userdp.accounting.facts.Sampling`,
the same names as the config and the samplers), adjacency (add/remove vs zero-out) and whether
the implemented sampling matches the accountant. Which sampling implies which adjacency and
caveats lives in one table, :data:`SAMPLING_SCHEMES`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from userdp.accounting.api import ACCOUNTANT_VERSION, balls_in_bins_epochs, compose_epsilon
from userdp.accounting.balls_in_bins_certified import certified_epsilon
from userdp.accounting.durable import atomic_write_text
from userdp.accounting.facts import (
    DETERMINISTIC_NOISE_CAVEAT,
    FAST_NOISE_CAVEAT,
    Sampling,
    Unit,
)
from userdp.accounting.ledger_format import group_phases, ledger_state, read_ledger
from userdp.accounting.mechanisms import BallsInBinsMechanism

ADD_REMOVE = "add/remove one {unit}"
ZERO_OUT = "zero-out one {unit}"
REPLACE_ONE = "replace one {unit} (N public)"

SHUFFLE_CAVEAT = (
    "Sampling was a fixed-size shuffle, but ε was computed as if sampling were Poisson. "
    "Shuffling can be less private than Poisson sampling (Chua et al. 2024), so the printed ε "
    "does NOT hold; use it only to compare runs, never to report a guarantee."
)
ZERO_OUT_CAVEAT = (
    "Cohorts were padded/truncated to a fixed size. The guarantee holds under zero-out adjacency "
    "(a {unit}'s contribution replaced by zero), not add/remove: under add/remove, adding a {unit} "
    "to a full cohort can push out another one, doubling the per-step sensitivity."
)
BIB_FIXED_CAVEAT = (
    "Balls-in-bins with bins fixed for the whole run: the Monte Carlo accountant must use the "
    "fixed-bin (whole-run) semantics; bins redrawn per epoch are a different mechanism."
)
BIB_PER_EPOCH_CAVEAT = (
    "Balls-in-bins with bins redrawn every epoch: accounted by composing epochs; bins fixed for "
    "the whole run are a different mechanism."
)
CYCLIC_POISSON_CAVEAT = (
    "Cyclic Poisson sampling: users were assigned once to groups and each step Poisson-sampled "
    "one group; accounted as banded matrix factorization, which holds only because the noise "
    "correlation C has fewer diagonals than there are groups."
)
GROUP_PRIVACY_CAVEAT = (
    "Group-privacy conversion is a loose black-box bound reported for comparison only; the "
    "mixture-of-Gaussians (ELS) accountant is the tight one."
)
MONTE_CARLO_CAVEAT = (
    "ε comes from the balls-in-bins accountant: the smallest certified upper bound among its "
    "methods (random-allocation PLD for C = I, sampling-free Rényi DP for correlated C, the "
    "Gaussian bound without amplification, Monte Carlo Estimate-Verify-Release), never a Monte "
    "Carlo point estimate."
)
NON_PRIVATE_HYPERPARAMETERS_CAVEAT = (
    "The clip norm and other hyperparameters were chosen without spending privacy budget; tuning "
    "them on the private data is not covered by ε."
)

PUBLIC_MODEL_SELECTION_CAVEAT = (
    "Each sampled user's examples were selected by their perplexity under the initial model "
    '(data.selection = {selection}; Chua et al., "Mind the Privacy Unit! User-Level Differential '
    "Privacy for Language Model Fine-Tuning\", §4.1, §5.1). The selection reads only that user's "
    "own examples and the initial model, and the user's update is clipped after it, so ε holds "
    "at user level provided the initial model is public: one trained on the training users' "
    "data is not covered. The workers' perplexity caches are as private as the shards."
)


def public_model_selection_caveat(selection: str) -> str:
    """The report's note for a selection that ranks each user's examples with the initial
    model (``data.selection = "highest_ppl" | "lowest_ppl"``)."""
    return PUBLIC_MODEL_SELECTION_CAVEAT.format(selection=selection)


@dataclass(frozen=True)
class SamplingScheme:
    """One row of the table: what a sampling scheme implies for the guarantee."""

    adjacency: str  # template with {unit}
    accounting_matches_sampling: bool
    caveats: tuple[str, ...]


SAMPLING_SCHEMES: dict[Sampling, SamplingScheme] = {
    Sampling.POISSON: SamplingScheme(ADD_REMOVE, True, ()),
    Sampling.BALLS_IN_BINS_FIXED: SamplingScheme(ADD_REMOVE, True, (BIB_FIXED_CAVEAT,)),
    Sampling.BALLS_IN_BINS_EPOCH: SamplingScheme(ADD_REMOVE, True, (BIB_PER_EPOCH_CAVEAT,)),
    Sampling.CYCLIC_POISSON: SamplingScheme(ADD_REMOVE, True, (CYCLIC_POISSON_CAVEAT,)),
    Sampling.PADDING: SamplingScheme(ZERO_OUT, True, (ZERO_OUT_CAVEAT,)),
    Sampling.SHUFFLE: SamplingScheme(ADD_REMOVE, False, (SHUFFLE_CAVEAT,)),
}

USER_FILTER_ADJACENCY_CAVEAT = (
    "User-wise DP-SGD with filter: the filtered mean's noise is calibrated to its sensitivity "
    "between datasets of the same N users (Asi & Liu), so ε holds when one user's data is "
    "replaced, with N public; adding or removing a user also moves N·ĝ by up to the clip norm, "
    "which this noise does not cover."
)

# Mechanism kinds whose ε carries a caveat of its own, whatever the sampling.
MECHANISM_CAVEATS: dict[str, tuple[str, ...]] = {
    "group-privacy": (GROUP_PRIVACY_CAVEAT,),
    "balls-in-bins": (MONTE_CARLO_CAVEAT,),
    "user-wise-filter": (USER_FILTER_ADJACENCY_CAVEAT,),
}

# Mechanism kinds whose analysis holds under another adjacency than the sampling's.
MECHANISM_ADJACENCY: dict[str, str] = {"user-wise-filter": REPLACE_ONE}

UNITS = tuple(u.value for u in Unit)


@dataclass(frozen=True)
class PrivacyReport:
    """The privacy guarantee of one run and the assumptions it rests on."""

    epsilon: float
    delta: float
    mechanism: dict[str, Any]  # the last phase's Mechanism.to_dict()
    phases: list[dict[str, Any]]  # [{"mechanism": ..., "steps": n}, ...]
    unit: str
    sampling: str
    adjacency: str
    noise_multiplier: float
    steps: int
    expected_cohort_size: float | None
    clip_norm: float | None
    accounting_matches_sampling: bool
    caveats: list[str]
    run_id: str
    budget_epsilon: float | None
    accountant: str = f"userdp.accounting v{ACCOUNTANT_VERSION}"
    epsilon_curve: list[tuple[int, float]] = field(default_factory=list)
    training_users: int | None = None
    """N, the users the run could sample (held-out users excluded); δ is read against 1/N."""
    secure_noise: bool | None = None
    """True: noise from a cryptographic keystream, releases on a grid; False: fast floating-point
    generators; None: the strategy did not say."""
    ledger: dict[str, Any] = field(default_factory=dict)
    """The ledger state this report was computed from (``steps``, ``last_hash``): a reader
    compares it with the ledger (:func:`check_report_current`) and refuses a stale report."""
    certification: dict[str, Any] | None = None
    """Balls-in-bins runs: which certified method gave ε and each method's value
    (:class:`userdp.accounting.balls_in_bins_certified.CertifiedEpsilon`)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["epsilon_curve"] = [list(p) for p in self.epsilon_curve]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_markdown(self) -> str:
        holds = "holds" if self.accounting_matches_sampling else "DOES NOT HOLD (see caveats)"
        lines = [
            "# Privacy report",
            "",
            f"**ε = {self.epsilon:.4g} at δ = {self.delta:.3g}** ({self.unit}-level, "
            f"{self.adjacency}) — guarantee {holds}.",
            "",
        ]
        if self.training_users:
            n = self.training_users
            lines += [
                f"δ next to the population: δ = {self.delta:.3g} = 1/{1 / self.delta:,.0f}, with "
                f"N = {n:,} training users (1/N = {1 / n:.3g}; 1/(10·N) = {1 / (10 * n):.3g}). "
                "δ bounds the probability that the ε guarantee fails for a user; it is "
                "meaningful only when well below 1/N.",
                "",
            ]
        if self.caveats:
            lines += ["## Caveats", ""] + [f"- ⚠ {c}" for c in self.caveats] + [""]
        lines += ["## Parameters", "", "| field | value |", "|---|---|"]
        rows = [
            ("mechanism", self.mechanism.get("kind")),
            ("unit", self.unit),
            ("sampling", self.sampling),
            ("adjacency", self.adjacency),
            ("accounting matches sampling", self.accounting_matches_sampling),
            ("noise multiplier", self.noise_multiplier),
            ("steps", self.steps),
            ("expected cohort size", self.expected_cohort_size),
            ("clip norm", self.clip_norm),
            ("noise generator", NOISE_GENERATORS[self.secure_noise]),
            ("budget ε", self.budget_epsilon),
            ("accountant", self.accountant),
            ("run id", self.run_id),
        ]
        lines += [f"| {k} | {v} |" for k, v in rows]
        if self.ledger:
            lines += [
                "",
                f"Computed from the ledger's {self.ledger['steps']} step record(s), last record "
                f"hash `{self.ledger['last_hash'][:16]}…`; `userdp ledger verify RUN_DIR` checks "
                "that the ledger has not moved on since.",
            ]
        lines += ["", "## Phases", "", "| steps | mechanism |", "|---|---|"]
        lines += [
            f"| {p['steps']} | `{json.dumps(p['mechanism'], sort_keys=True)}` |"
            for p in self.phases
        ]
        if self.certification:
            c = self.certification
            lines += [
                "",
                "## Balls-in-bins accountant (certified upper bounds on ε)",
                "",
                "| method | ε | |",
                "|---|---|---|",
            ]
            for name, value in c["candidates"].items():
                stated = "stated" if name == c["method"] else ""
                shown = f"{value:.4g}" if value is not None else "n/a"
                lines.append(f"| {name} | {shown} | {stated or c['skipped'].get(name, '')} |")
        if self.epsilon_curve:
            lines += ["", "## ε by step", "", "| step | ε |", "|---|---|"]
            lines += [f"| {s} | {e:.4g} |" for s, e in self.epsilon_curve]
        return "\n".join(lines) + "\n"


def assumptions(unit: str, sampling: str, mechanism_kinds: list[str]) -> tuple[str, bool, list]:
    """(adjacency, accounting_matches_sampling, caveats) from the table, for a run."""
    if unit not in UNITS:
        raise ValueError(f"unit={unit!r} is not allowed; expected one of {UNITS}")
    scheme = SAMPLING_SCHEMES[_sampling(sampling)]
    caveats = [c.format(unit=unit) for c in scheme.caveats]
    for kind in dict.fromkeys(mechanism_kinds):
        caveats += list(MECHANISM_CAVEATS.get(kind, ()))
    caveats.append(NON_PRIVATE_HYPERPARAMETERS_CAVEAT)
    adjacency = scheme.adjacency
    for kind in mechanism_kinds:
        adjacency = MECHANISM_ADJACENCY.get(kind, adjacency)
    return adjacency.format(unit=unit), scheme.accounting_matches_sampling, caveats


def _sampling(sampling: str) -> Sampling:
    try:
        return Sampling(sampling)
    except ValueError:
        allowed = tuple(s.value for s in SAMPLING_SCHEMES)
        raise ValueError(
            f"sampling={sampling!r} is not allowed; expected one of {allowed}"
        ) from None


def delta_caveat(delta: float, training_users: int | None) -> str | None:
    """A warning when δ > 1/(10·N): with few users, δ is not small next to one user's share."""
    if not training_users or delta <= 1.0 / (10 * training_users):
        return None
    return (
        f"δ = {delta:.3g} (≈ 1/{1 / delta:,.0f}) is larger than 1/(10·N) = "
        f"{1 / (10 * training_users):.3g} for N = {training_users:,} training users: a "
        "mechanism could reveal one user's data outright with probability about δ and still "
        "meet this (ε, δ); use more users or a smaller privacy.delta"
    )


NOISE_GENERATORS = {
    True: "secure: AES-256-CTR keystream, releases rounded onto a grid (privacy.secure_noise)",
    False: "fast floating-point (numpy PCG64 / torch), not protected (see caveats)",
    None: "not stated by the strategy",
}


CURVE_DISCRETIZATION = 1e-3
"""The PLD grid of the report's ε-by-step curve: ten times coarser than the stated ε's, so each
point costs a tenth; every point is still an upper bound (pessimistic discretization)."""


def build_report(
    ledger_path: str | os.PathLike[str],
    delta: float,
    *,
    unit: str,
    sampling: str,
    clip_norm: float | None = None,
    expected_cohort_size: float | None = None,
    curve_points: int = 0,
    extra_caveats: tuple[str, ...] = (),
    training_users: int | None = None,
    secure_noise: bool | None = None,
    **accountant_options: Any,
) -> PrivacyReport:
    """Build the report from the ledger file alone (ε recomputed, not trusted from metrics).

    ``curve_points`` > 0 adds ε at that many evenly spaced steps (each costs one accounting).
    ``training_users`` (N) puts δ next to 1/N, with a caveat when δ > 1/(10·N).
    ``secure_noise`` is the strategy's noise generator mode (:class:`PrivacyFacts`); when every
    step record says which noise it drew (the ledger's ``noise`` field), the records decide, and
    steps that did not draw secure noise get a caveat.
    """
    header, records = read_ledger(ledger_path)
    if not records:
        raise ValueError(f"ledger {ledger_path} has no released steps; nothing to report")
    phases = group_phases(records)
    _check_sampling_matches_mechanisms(sampling, [m.to_dict() for m, _ in phases])
    adjacency, matches, caveats = assumptions(unit, sampling, [m.kind for m, _ in phases])
    certification = None
    if len(phases) == 1 and isinstance(phases[0][0], BallsInBinsMechanism):
        # a whole-run accountant: the smallest certified bound, the one every place states
        mechanism, count = phases[0]
        certification = certified_epsilon(mechanism, balls_in_bins_epochs(mechanism, count), delta)
        caveats = [certification.describe(delta) if c == MONTE_CARLO_CAVEAT else c for c in caveats]
    # the one entry point every place that states ε goes through (for balls-in-bins the same
    # certified bound as ``certification``, read from the same cache)
    eps = compose_epsilon(phases, delta, **accountant_options)

    def prefix_epsilon(k: int) -> float:
        if k == len(records):
            return eps
        prefix = group_phases(records[:k])
        options = dict(accountant_options)
        if certification is None:
            # upper bounds at a coarser grid (pessimistic discretization bounds ε at any grid)
            options["value_discretization_interval"] = max(
                options.get("value_discretization_interval", 0.0), CURVE_DISCRETIZATION
            )
        return compose_epsilon(prefix, delta, **options)

    curve: list[tuple[int, float]] = []
    if curve_points > 0:
        n = len(records)
        for k in sorted({max(1, round(n * i / curve_points)) for i in range(1, curve_points + 1)}):
            curve.append((records[k - 1]["step"], prefix_epsilon(k)))
    secure_noise, noise_caveats = _noise_of_records(records, secure_noise)
    last = phases[-1][0]
    return PrivacyReport(
        epsilon=float(eps),
        delta=delta,
        mechanism=last.to_dict(),
        phases=[{"mechanism": m.to_dict(), "steps": c} for m, c in phases],
        unit=unit,
        sampling=Sampling(sampling).value,
        adjacency=adjacency,
        noise_multiplier=float(last.noise_multiplier),
        steps=len(records),
        expected_cohort_size=expected_cohort_size,
        clip_norm=clip_norm,
        accounting_matches_sampling=matches,
        caveats=[c for c in (delta_caveat(delta, training_users),) if c]
        + noise_caveats
        + caveats
        + [c for c in extra_caveats if not (noise_caveats and c in _STRATEGY_NOISE_CAVEATS)],
        run_id=header["run_id"],
        budget_epsilon=header["budget_epsilon"],
        training_users=training_users,
        secure_noise=secure_noise,
        epsilon_curve=curve,
        ledger=ledger_state(records, header),
        certification=None if certification is None else certification.to_dict(),
    )


_STRATEGY_NOISE_CAVEATS = (FAST_NOISE_CAVEAT, DETERMINISTIC_NOISE_CAVEAT)
"""Replaced by the per-step count when the ledger says which noise each step drew."""
_NOISE_WORDS = {
    "fast": "fast floating-point noise (privacy.secure_noise = false), not protected against a "
    "predictable generator or the low-order bits of released floats",
    "test": "noise from a fixed test seed: NOT PRIVATE, whatever ε says",
    "none": "NO noise (a test-only mode): NOT PRIVATE",
}


def _noise_of_records(
    records: list[dict[str, Any]], stated: bool | None
) -> tuple[bool | None, list[str]]:
    """(secure_noise, caveats) from the step records' ``noise`` fields when every record has one;
    otherwise the strategy's ``stated`` mode and no caveat of its own."""
    modes = [record.get("noise") for record in records]
    if not modes or None in modes:
        return stated, []
    caveats = []
    for mode, words in _NOISE_WORDS.items():
        count = modes.count(mode)
        if count:
            caveats.append(f"{count} of {len(modes)} released steps drew {words}")
    return not caveats, caveats


def _check_sampling_matches_mechanisms(sampling: str, mechanisms: list[dict[str, Any]]) -> None:
    """Balls-in-bins sampling and its accountant must agree on the bin semantics: bins fixed for
    the run and bins redrawn every epoch are different mechanisms; cyclic Poisson sampling and
    the banded-Poisson accountant go only with each other."""
    scheme = _sampling(sampling)
    semantics = scheme.bin_semantics
    for d in mechanisms:
        if (d["kind"] == "banded-poisson") != (scheme is Sampling.CYCLIC_POISSON):
            raise ValueError(
                f"sampling={sampling!r} does not match the ledger's {d['kind']} accountant; "
                "cyclic-poisson sampling goes with the banded-poisson accountant and only with it"
            )
        if d["kind"] == "balls-in-bins" and semantics != d.get("bin_semantics"):
            expected = Sampling.of_bin_semantics(d.get("bin_semantics")).value
            raise ValueError(
                f"sampling={sampling!r} does not match the ledger's balls-in-bins accountant "
                f"(bin_semantics={d.get('bin_semantics')!r}); expected sampling={expected!r}"
            )


def write_report(report: PrivacyReport, run_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write privacy_report.json and privacy_report.md in ``run_dir``, each durably and atomically
    (:func:`userdp.accounting.durable.atomic_write`)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    json_path = run_dir / "privacy_report.json"
    md_path = run_dir / "privacy_report.md"
    atomic_write_text(json_path, report.to_json())
    atomic_write_text(md_path, report.to_markdown())
    return json_path, md_path
