"""What one step of a private training mechanism is, as a value the accountants can read.

A *mechanism* here is a frozen description of ONE step (one noisy release) of a training
algorithm, in the spirit of dp_accounting's ``dp_event.py``: it carries the parameters that
determine the privacy loss of that step and nothing else — no behaviour beyond validation and
JSON (de)serialization. Accountants (``userdp.accounting.api``) turn ``(mechanism, steps, delta)``
into an ε.

Stability rule: the meaning of a ``kind`` and of each of its parameters never changes once
released. A ledger written today must re-account identically later. A new mechanism, or a new
meaning, gets a new class and a new ``kind``.

All mechanisms are stated in normalized units: the clip norm is 1 and ``noise_multiplier`` σ is
the noise standard deviation divided by the clip norm. Adjacency is add-or-remove one *user*
(``NeighboringRelation.ADD_OR_REMOVE_ONE`` in dp_accounting) unless a class says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from userdp.accounting.correlation_spec import CorrelationSpec
from userdp.accounting.errors import InvalidMechanismError
from userdp.accounting.validation import positive_float, positive_int, probability

__all__ = [  # CorrelationSpec and InvalidMechanismError: the types of these values' fields and errors
    "BIN_SEMANTICS",
    "COMPOSABLE_KINDS",
    "DEFAULT_VALUE_DISCRETIZATION_INTERVAL",
    "ESTIMATORS",
    "BallsInBinsMechanism",
    "BandedPoissonMechanism",
    "CorrelationSpec",
    "ElsMechanism",
    "GroupPrivacyMechanism",
    "InvalidMechanismError",
    "Mechanism",
    "NoDpEventError",
    "PLD_KINDS",
    "RandomizedClippingMechanism",
    "UlsMechanism",
    "UserWiseFilterMechanism",
    "dp_event",
    "mechanism_from_dict",
]

BIN_SEMANTICS: tuple[str, ...] = ("fixed", "per-epoch")
DEFAULT_VALUE_DISCRETIZATION_INTERVAL = 1e-4
"""The PLD accountants' default value discretization interval (dp_accounting's parameter)."""
ESTIMATORS: tuple[str, ...] = ("hutchinson", "hutch++")


class NoDpEventError(ValueError):
    """The mechanism has no dp_accounting event (it is accounted another way)."""


# --------------------------------------------------------------------------------------------
# validation helpers (one line per message: parameter, bad value, allowed range)


def _check(mechanism: Any, name: str, check: Callable[..., Any], **options: Any) -> None:
    """Replace field ``name`` of a frozen mechanism by ``check`` (:mod:`validation`) of it."""
    value = check(name, getattr(mechanism, name), InvalidMechanismError, **options)
    object.__setattr__(mechanism, name, value)


def _correlation(value: Any) -> CorrelationSpec | None:
    """A mechanism's ``correlation``: None (identity), a CorrelationSpec, or its dict form."""
    if isinstance(value, Mapping):
        return CorrelationSpec.from_dict(value)
    if value is not None and not isinstance(value, CorrelationSpec):
        raise InvalidMechanismError(
            f"correlation={value!r} is not allowed; expected None (identity) or a CorrelationSpec"
        )
    return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise InvalidMechanismError(f"{name}={value!r} is not allowed; expected one of {allowed}")
    return value


# --------------------------------------------------------------------------------------------
# mechanisms


@dataclass(frozen=True)
class UlsMechanism:
    """User-level sampling (DP-SGD-ULS / DP-FedSGD), one step.

    Each user is included independently with probability q (Poisson); each included user's
    clipped update (norm ≤ 1) is summed and N(0, σ²I) is added:
        returns Σ_{u ∈ cohort} clip(g_u) + z,  z ~ N(0, σ²I),  cohort ~ Poisson(q).
    Dominating pair: N(0, σ²) vs N(Bern(q), σ²) (Theorem 2 of "Fine-Tuning Large Language Models with User-Level Differential Privacy").
    """

    kind: ClassVar[str] = "uls"
    noise_multiplier: float
    sampling_prob: float

    def __post_init__(self) -> None:
        _check(self, "noise_multiplier", positive_float)
        _check(self, "sampling_prob", probability, upper_open=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sampling_prob": self.sampling_prob,
        }


@dataclass(frozen=True)
class _PoissonExamplesStep:
    """The step :class:`ElsMechanism` and :class:`GroupPrivacyMechanism` both describe: examples
    Poisson-sampled with probability p, at most G of them per user, clipped per example and
    summed, then N(0, σ²I) added. The two classes are two accountants of this step, told apart
    by ``kind`` (and by class: an ELS mechanism never equals a group-privacy one)."""

    kind: ClassVar[str]
    noise_multiplier: float
    sampling_prob: float
    group_size: int

    def __post_init__(self) -> None:
        _check(self, "noise_multiplier", positive_float)
        _check(self, "sampling_prob", probability, upper_open=False)
        _check(self, "group_size", positive_int)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sampling_prob": self.sampling_prob,
            "group_size": self.group_size,
        }


@dataclass(frozen=True)
class ElsMechanism(_PoissonExamplesStep):
    """Example-level sampling (DP-SGD-ELS) seen at the USER level, one step.

    Each user owns at most G examples of the pooled dataset; each example is included with
    probability p (Poisson), clipped per example and summed, then N(0, σ²I) is added. One user's
    contribution has norm ≤ Binom(G, p), so the step is dominated by the mixture of Gaussians
        N(0, σ²)  vs  Σ_{k=0}^{G} Binom(G, p)(k) · N(k, σ²)
    (Theorem 1 of "Fine-Tuning Large Language Models with User-Level Differential Privacy"; dp_accounting ``MixtureOfGaussiansDpEvent``).
    """

    kind: ClassVar[str] = "els"


@dataclass(frozen=True)
class GroupPrivacyMechanism(_PoissonExamplesStep):
    """COMPARISON ONLY: example-level DP-SGD turned into user-level DP by black-box group privacy.

    The step is the same as :class:`ElsMechanism` (Poisson examples with probability p, per-example
    clipping, N(0, σ²I)), but the user-level guarantee is derived loosely: the T-step example-level
    (ε₀, δ₀) is converted to (G·ε₀, δ₀·(e^{G ε₀} − 1)/(e^{ε₀} − 1)) for groups of G examples
    (Vadhan 2017), minimized over ε₀. It is never tighter than the ELS mixture accountant; it exists
    to reproduce the paper's comparison (Fig. 1 of "Fine-Tuning Large Language Models with User-Level Differential Privacy"). Do not report it as the
    guarantee of a run.
    """

    kind: ClassVar[str] = "group-privacy"


@dataclass(frozen=True)
class BallsInBinsMechanism:
    """Balls-in-bins sampling: each unit lands in exactly one of ``bins`` steps per epoch.

    Every unit is assigned to one uniformly random bin (step) among ``bins``; step t releases
    Σ_{units in bin t} clip(g) + σ·(C⁻¹z)_t, z ~ N(0, I), for a non-negative lower-triangular
    correlation matrix C (``correlation``; None = identity = plain DP-SGD noise).
    ``bin_semantics``: ``"fixed"`` draws the bin once for the whole run (b-min-sep structure for
    matrix mechanisms, Choquette-Choo et al., "Near Exact Privacy Amplification for Matrix
    Mechanisms"); ``"per-epoch"`` redraws it every epoch (random allocation, composes per epoch;
    far better for plain DP-SGD). ``steps`` counts releases: ε after
    ``steps`` is the ε of ⌈steps / bins⌉ full epochs, at most ``epochs``. Accounted by Monte Carlo
    (``userdp.accounting.balls_in_bins``), which cannot be composed with PLD mechanisms.
    """

    kind: ClassVar[str] = "balls-in-bins"
    noise_multiplier: float
    bins: int
    epochs: int
    bin_semantics: str = "per-epoch"
    correlation: CorrelationSpec | None = None

    def __post_init__(self) -> None:
        _check(self, "noise_multiplier", positive_float)
        _check(self, "bins", positive_int)
        _check(self, "epochs", positive_int)
        _choice("bin_semantics", self.bin_semantics, BIN_SEMANTICS)
        object.__setattr__(self, "correlation", _correlation(self.correlation))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "bins": self.bins,
            "epochs": self.epochs,
            "bin_semantics": self.bin_semantics,
            "correlation": None if self.correlation is None else self.correlation.to_dict(),
        }


@dataclass(frozen=True)
class RandomizedClippingMechanism:
    """DP-SGD with randomized clipping, one step at the user level (DP-SGD-RC: Ullah et al.,
    "Efficient DP-SGD for LLMs with Randomized Clipping").

    Users are Poisson-sampled with probability q; each user's gradient norm is *estimated* with
    ``probes`` random probes (Hutchinson or Hutch++) and clipped by the estimate, so the realized
    sensitivity can exceed 1 with small probability; the envelope accountant in
    ``userdp.accounting.randomized_clipping`` bounds the resulting privacy loss.
    """

    kind: ClassVar[str] = "randomized-clipping"
    noise_multiplier: float
    sampling_prob: float
    probes: int
    estimator: str = "hutchinson"

    def __post_init__(self) -> None:
        _check(self, "noise_multiplier", positive_float)
        _check(self, "sampling_prob", probability, upper_open=False)
        _check(self, "probes", positive_int)
        _choice("estimator", self.estimator, ESTIMATORS)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sampling_prob": self.sampling_prob,
            "probes": self.probes,
            "estimator": self.estimator,
        }


@dataclass(frozen=True)
class UserWiseFilterMechanism:
    """User-wise DP-SGD with filter (Asi & Liu, "User-level Differentially Private Stochastic
    Convex Optimization: Efficient Algorithms with Optimal Rates", AISTATS 2024, as Algorithm 3 of
    "Mind the Privacy Unit! User-Level Differential Privacy for Language Model Fine-Tuning"), one
    step of a run of at most ``horizon`` steps.

    Every user in every step (q = 1). AboveThreshold at ``above_threshold_epsilon`` on the
    users' gradient concentration halts the run at its first "below"; otherwise the filtered
    mean ĝ is released as ĝ + N(0, (σ·Δ)²I), Δ = √(8 log(e^ε T/δ))·τ/N, which bounds ĝ's
    sensitivity except with probability ``filter_delta`` over the whole run. Normalized units:
    ``noise_multiplier`` σ = noise std / Δ. Accountant: ε(δ) after t ≤ horizon steps is
    ``above_threshold_epsilon`` + ε of t Gaussian(σ) steps at δ − ``filter_delta``
    (:mod:`userdp.accounting.user_filter`); a whole-run accountant (it composes with nothing).
    """

    kind: ClassVar[str] = "user-wise-filter"
    noise_multiplier: float
    above_threshold_epsilon: float
    filter_delta: float
    horizon: int

    def __post_init__(self) -> None:
        _check(self, "noise_multiplier", positive_float)
        _check(self, "above_threshold_epsilon", positive_float)
        filter_delta = probability(
            "filter_delta", self.filter_delta, InvalidMechanismError, upper_open=False
        )
        if filter_delta >= 1.0:
            raise InvalidMechanismError(
                f"filter_delta={filter_delta!r} is out of range; expected a float in (0, 1)"
            )
        object.__setattr__(self, "filter_delta", filter_delta)
        _check(self, "horizon", positive_int)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "above_threshold_epsilon": self.above_threshold_epsilon,
            "filter_delta": self.filter_delta,
            "horizon": self.horizon,
        }


@dataclass(frozen=True)
class BandedPoissonMechanism:
    """Banded matrix factorization with cyclic Poisson sampling, one step (Choquette-Choo et al.,
    "(Amplified) Banded Matrix Factorization: A unified approach to private training").

    Every unit is assigned once to one of ``bands`` groups (b̂); step t considers only group
    t mod b̂ and includes each of its units independently with probability ``sampling_prob``
    (p, the rate WITHIN the group). The run releases CX + σZ for a lower-triangular Toeplitz C
    with at most b̂ non-zero diagonals (``correlation``; None = identity). A unit's
    participations are b̂ steps apart, so its columns of C have disjoint supports and the run is
    ⌈steps/b̂⌉ Poisson-subsampled Gaussian mechanisms with noise multiplier σ/‖c‖, ‖c‖ the largest
    column norm of C (:mod:`userdp.accounting.banded_poisson`); a whole-run accountant.
    """

    kind: ClassVar[str] = "banded-poisson"
    noise_multiplier: float
    sampling_prob: float
    bands: int
    correlation: CorrelationSpec | None = None

    def __post_init__(self) -> None:
        _check(self, "noise_multiplier", positive_float)
        _check(self, "sampling_prob", probability, upper_open=False)
        _check(self, "bands", positive_int)
        object.__setattr__(self, "correlation", _correlation(self.correlation))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sampling_prob": self.sampling_prob,
            "bands": self.bands,
            "correlation": None if self.correlation is None else self.correlation.to_dict(),
        }


Mechanism = (
    UlsMechanism
    | ElsMechanism
    | GroupPrivacyMechanism
    | BallsInBinsMechanism
    | BandedPoissonMechanism
    | RandomizedClippingMechanism
    | UserWiseFilterMechanism
)

MECHANISM_CLASSES: dict[str, type] = {
    cls.kind: cls
    for cls in (
        UlsMechanism,
        ElsMechanism,
        GroupPrivacyMechanism,
        BallsInBinsMechanism,
        BandedPoissonMechanism,
        RandomizedClippingMechanism,
        UserWiseFilterMechanism,
    )
}

PLD_KINDS = (UlsMechanism.kind, ElsMechanism.kind)
"""Kinds accounted step by step as PLDs."""
COMPOSABLE_KINDS = (*PLD_KINDS, RandomizedClippingMechanism.kind)
"""Kinds whose per-step PLDs compose with each other across phases."""


def mechanism_from_dict(d: Mapping[str, Any]) -> Mechanism:
    """Inverse of ``mechanism.to_dict()``; unknown kinds or keys raise InvalidMechanismError."""
    if not isinstance(d, Mapping) or "kind" not in d:
        raise InvalidMechanismError(
            f"mechanism={d!r} is not allowed; expected a dict with a 'kind'"
        )
    kind = d["kind"]
    cls = MECHANISM_CLASSES.get(kind)
    if cls is None:
        raise InvalidMechanismError(
            f"kind={kind!r} is not allowed; expected one of {tuple(MECHANISM_CLASSES)}"
        )
    params = {k: v for k, v in d.items() if k != "kind"}
    allowed = {f.name for f in cls.__dataclass_fields__.values()}  # type: ignore[attr-defined]
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise InvalidMechanismError(
            f"{kind} mechanism key {unknown[0]!r} is not allowed; expected keys {sorted(allowed)}"
        )
    try:
        return cls(**params)
    except TypeError as exc:  # missing required parameter
        raise InvalidMechanismError(f"{kind} mechanism: {exc}") from None


def dp_event(mechanism: Mechanism) -> Any:
    """The dp_accounting DpEvent of one step, where one exists.

    ULS → ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``; ELS → ``MixtureOfGaussiansDpEvent(σ,
    0..G, Binom(G, p).pmf)``. Group privacy, balls-in-bins, randomized clipping and the user-wise
    filter have no user-level DpEvent and raise :class:`NoDpEventError`.
    """
    import dp_accounting
    from dp_accounting import dp_event as dpe

    if isinstance(mechanism, UlsMechanism):
        return dp_accounting.PoissonSampledDpEvent(
            mechanism.sampling_prob, dp_accounting.GaussianDpEvent(mechanism.noise_multiplier)
        )
    if isinstance(mechanism, ElsMechanism):
        sensitivities, probs = binomial_sensitivities(mechanism.group_size, mechanism.sampling_prob)
        return dpe.MixtureOfGaussiansDpEvent(mechanism.noise_multiplier, sensitivities, probs)
    raise NoDpEventError(
        f"mechanism kind {mechanism.kind!r} has no user-level dp_accounting event; "
        "use userdp.accounting.epsilon() instead"
    )


def binomial_sensitivities(
    group_size: int, sampling_prob: float
) -> tuple[list[float], list[float]]:
    """Sensitivities 0..G and their Binomial(G, p) probabilities (the ELS mixture weights)."""
    from scipy import stats

    sensitivities = [float(k) for k in range(group_size + 1)]
    probs = [float(x) for x in stats.binom.pmf(range(group_size + 1), group_size, sampling_prob)]
    return sensitivities, probs
