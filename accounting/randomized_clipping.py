"""Accountant for DP-SGD with randomized clipping (DP-SGD-RC: Ullah et al., "Efficient DP-SGD for
LLMs with Randomized Clipping", its f-DP accountant based on chi-squared mixture envelopes).

Each sampled unit's squared gradient norm is estimated with k Gaussian probes (Hutchinson,
P ~ N(0, 1/k)^{p×k}, fresh every step) and clipped by the estimate, so its contribution has norm
C·Z with Z = ‖g‖/√n̂ (random, unbounded). The step is treated as a Gaussian mechanism with a
random mean shift Z/σ that is revealed to the adversary (the paper's single-step trade-off
function, which conditions on Z):

    P = (Z, (1 − q)·N(0, 1) + q·N(Z/σ, 1))   vs   Q = (Z, N(0, 1))     (and the reverse pair).

THE BOUND IMPLEMENTED: a conservative envelope of Z,

    Z_cons = max(1, √(k / χ²_k)),

i.e. the rank-1 (worst-spectrum) law of Z on Z ≥ 1 with all remaining mass at Z = 1 (no credit
for over-estimated norms). It is stochastically larger than Z(λ) for every gradient spectrum λ
if the rank-1 spectrum maximizes P(Σ λᵢχ²ᵢ(k)/k < x) for every x ≤ 1 — the right segment of the
paper's three-segment envelope (checked numerically and by a Dirichlet-spectrum test; proved in
the paper's appendix, which we have not seen). Larger shifts are less private (Blackwell order of
Gaussian shifts), so the mechanism is a post-processing of the Z_cons mechanism.

HUTCH++ (``estimator="hutch++"``; Meyer, Musco, Musco, Woodruff, "Hutch++: Optimal Stochastic
Trace Estimation"): independent S, P ~ N(0, 1/k)^{d0×k}, Q = an orthonormal basis of M Mᵀ S (a
matrix, not the hypothesis Q above), and n̂ = ‖MᵀQ‖² + ‖Mᵀ(I − QQᵀ)P‖². As in the paper's
analysis the adversary is handed the head sketch Q. Conditional on Q (a function of S and the
data only, so independent of P), the tail is a Hutchinson estimate of the residual R = Mᵀ(I − QQᵀ) with k Gaussian N(0, 1/k) probes:

    n̂ = h + r·Y,   h = ‖MᵀQ‖²,  r = ‖R‖²_F,  Y = Σ_j λ'_j χ²_j(k)/k,   E Y = 1,

over the normalized squared singular values λ' of R. The true squared norm is h + r, so

    Z² = (h + r)/(h + r·Y) ≤ max(1, 1/Y):

for Y ≥ 1 the ratio is at most 1, and for Y < 1, Y·(h + r) ≤ h + r·Y ⇔ Y·h ≤ h. Summed over
weights (and exact bias terms) the same holds with Y the r-weighted mix of the weights' Y's,
again a law Σ λ'_j χ²_j(k)/k with Σ λ' = 1. Hence Z_{Hutch++} ≤ max(1, 1/√Y) pointwise for every
Q, which is stochastically dominated by Z_cons with the same k (the rank-1 spectrum maximizes
P(Y < x) for x ≤ 1, as for Hutchinson). The Hutchinson accountant with k = the number of TAIL
probes is therefore a valid, conservative accountant for Hutch++, and ε is the same for both
estimators at the same (σ, q, steps, k) — as in the paper, which uses one noise multiplier for
Hutch and Hutch++ at k = 32. The credit the exact head could earn (Z near 1 whenever h ≫ r) is
not taken; Hutch++ pays off in utility (fewer units clipped by a wrong norm), not in ε.

Computation (pessimistic throughout): Z_cons is discretized by rounding UP onto a geometric grid
1 = z₀ < … < z_J; the mass above z_J (``0.01·δ/steps`` per step) goes to infinite privacy loss.
For each atom z the dp_accounting PLD of the Poisson-subsampled Gaussian with noise σ/z is built
(pessimistic rounding); since Z is revealed and has the same law under P and Q, the step's PLD
is the Z-weighted mixture of those PLDs (both directions). It is composed over the steps with
dp_accounting's FFT self-composition. The estimator is validated and recorded with the
mechanism; both estimators share this PLD.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import integrate, stats
from userdp.accounting import dp_accounting_adapter as adapter
from userdp.accounting import fast_pld
from userdp.accounting.validation import positive_float, positive_int, probability

__all__ = [
    "ESTIMATORS",
    "RandomizedClippingError",
    "calibrate_noise_multiplier",
    "envelope_atoms",
    "envelope_cdf",
    "epsilon",
    "privacy_loss_distribution",
    "single_step_delta",
]

ESTIMATORS = ("hutchinson", "hutch++")
DEFAULT_VALUE_DISCRETIZATION_INTERVAL = 1e-3
DEFAULT_ATOMS = 48


class RandomizedClippingError(ValueError):
    """Bad input to the randomized-clipping accountant; the message names the parameter."""


def _check_estimator(estimator: str) -> None:
    """Both estimators are accounted by the Z_cons envelope (module docstring)."""
    if estimator not in ESTIMATORS:
        raise RandomizedClippingError(
            f"estimator={estimator!r} is not allowed; expected one of {ESTIMATORS}"
        )


def envelope_cdf(z: np.ndarray | float, probes: int) -> np.ndarray:
    """F_env(z) = P(Z_cons ≤ z): 0 below 1, P(χ²_k ≥ k/z²) from 1 on (module docstring)."""
    k = float(positive_int("probes", probes, RandomizedClippingError))
    z = np.asarray(z, dtype=float)
    safe = np.maximum(z, 1.0)
    return np.where(z >= 1.0, stats.chi2.sf(k / safe**2, k), 0.0)


def envelope_atoms(
    probes: int, tail_mass: float, atoms: int = DEFAULT_ATOMS
) -> tuple[np.ndarray, np.ndarray, float]:
    """Z_cons rounded up onto a grid: (z values, their masses, mass above the last z).

    P(Z_cons ≤ z) = P(χ²_k ≥ k/z²) for z ≥ 1; the atom z₀ = 1 carries P(χ²_k ≥ k).
    """
    probes = positive_int("probes", probes, RandomizedClippingError)
    k = float(probes)
    z_max = math.sqrt(k / max(float(stats.chi2.ppf(tail_mass, k)), 1e-300))
    z_max = max(z_max, 1.0 + 1e-9)
    # No finer than 0.1 % steps in z (rounding Z up by 0.1 % changes ε by about as much).
    atoms = int(min(atoms, max(2, math.ceil(math.log(z_max) / math.log1p(1e-3)) + 1)))
    grid = np.geomspace(1.0, z_max, atoms)
    cdf = envelope_cdf(grid, probes)  # at z = 1 this is the atom at 1
    masses = np.diff(cdf, prepend=0.0)
    tail = float(max(1.0 - cdf[-1], 0.0))
    return grid, masses, tail


def privacy_loss_distribution(
    noise_multiplier: float,
    sampling_prob: float,
    probes: int,
    *,
    tail_mass: float = 1e-12,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    atoms: int = DEFAULT_ATOMS,
) -> pld_lib.PrivacyLossDistribution:
    """Pessimistic PLD of ONE step (both adjacency directions) under the Z_cons envelope."""
    sigma = positive_float("noise_multiplier", noise_multiplier, RandomizedClippingError)
    q = probability("sampling_prob", sampling_prob, RandomizedClippingError, upper_open=False)
    grid, masses, tail = envelope_atoms(probes, tail_mass, atoms)
    mix_remove: Any = None
    mix_add: Any = None
    total = 0.0
    for z, w in zip(grid, masses, strict=True):
        if w <= 0.0:
            continue
        # the Poisson-subsampled Gaussian at noise σ/z as the two-component mixture
        # (sensitivity 0 w.p. 1 − q, 1 w.p. q): fast_pld builds the same pessimistic
        # connect-the-dots PLD as dp_accounting, vectorized (dp_accounting's Python inversion
        # loop took ~0.14 s per atom)
        if q == 1.0:  # no subsampling: the library's closed-form Gaussian loss is fast
            pld = pld_lib.from_gaussian_mechanism(
                standard_deviation=sigma / z,
                value_discretization_interval=value_discretization_interval,
            )
        else:
            pld = fast_pld.mixture_gaussian_pld(
                sigma / z,
                [0.0, 1.0],
                [1.0 - q, q],
                value_discretization_interval=value_discretization_interval,
            )
        remove, add = adapter.directions(pld)
        if mix_remove is None:
            mix_remove, mix_add = remove, add
        else:
            keep = total / (total + w)
            mix_remove = mix_remove.compute_mixture(remove, keep)
            mix_add = mix_add.compute_mixture(add, keep)
        total += w
    if tail > 0.0:  # Z above the grid: charge it as infinite privacy loss
        infinite = pld_pmf.DensePLDPmf(
            value_discretization_interval, 0, np.zeros(1), 1.0, pessimistic_estimate=True
        )
        keep = total / (total + tail)
        mix_remove = mix_remove.compute_mixture(infinite, keep)
        mix_add = mix_add.compute_mixture(infinite, keep)
    return pld_lib.PrivacyLossDistribution(mix_remove, mix_add)


def epsilon(
    noise_multiplier: float,
    sampling_prob: float,
    steps: int,
    probes: int,
    delta: float,
    *,
    estimator: str = "hutchinson",
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    atoms: int = DEFAULT_ATOMS,
) -> float:
    """ε(δ) after ``steps`` Poisson-subsampled RC steps (add/remove one unit), an upper bound."""
    _check_estimator(estimator)
    steps = positive_int("steps", steps, RandomizedClippingError)
    delta = probability("delta", delta, RandomizedClippingError, upper_open=True)
    pld = privacy_loss_distribution(
        noise_multiplier,
        sampling_prob,
        probes,
        tail_mass=0.01 * delta / steps,
        value_discretization_interval=value_discretization_interval,
        atoms=atoms,
    )
    return float(pld.self_compose(steps).get_epsilon_for_delta(delta))


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sampling_prob: float,
    steps: int,
    probes: int,
    *,
    estimator: str = "hutchinson",
    rtol: float = 1e-3,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    """The smallest σ (to relative ``rtol``, rounded up) with ε(σ) ≤ ``target_epsilon``."""
    _check_estimator(estimator)
    target = positive_float("target_epsilon", target_epsilon, RandomizedClippingError)

    def eps_at(sigma: float) -> float:
        return epsilon(
            sigma,
            sampling_prob,
            steps,
            probes,
            delta,
            value_discretization_interval=value_discretization_interval,
        )

    lo, hi = 0.25, 1.0
    while eps_at(hi) > target:
        lo, hi = hi, hi * 2.0
        if hi > 1e4:
            raise RandomizedClippingError(f"target_epsilon={target} needs noise_multiplier > 1e4")
    while lo > 1e-3 and eps_at(lo) <= target:
        lo, hi = lo / 2.0, lo
    while hi / lo > 1.0 + rtol:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps_at(mid) <= target else (mid, hi)
    return hi


def single_step_delta(noise_multiplier: float, probes: int, epsilon: float) -> float:
    """Exact δ(ε) of ONE un-subsampled step under Z_cons: E_Z[δ_Gauss(ε; μ = Z/σ)] by quadrature
    (closed form per Z, conditioned on Z; no discretization, for checks and intuition)."""
    sigma = positive_float("noise_multiplier", noise_multiplier, RandomizedClippingError)
    k = float(positive_int("probes", probes, RandomizedClippingError))

    def gauss(mu: float) -> float:
        return float(
            stats.norm.cdf(-epsilon / mu + mu / 2)
            - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2)
        )

    # y = χ²_k / k; Z = 1/√y when y < 1, else Z = 1.
    at_one = float(stats.chi2.sf(k, k)) * gauss(1.0 / sigma)

    def integrand(y: float) -> float:
        return gauss(1.0 / (sigma * math.sqrt(y))) * k * float(stats.chi2.pdf(k * y, k))

    tail, _ = integrate.quad(integrand, 0.0, 1.0, limit=200, epsabs=1e-14, epsrel=1e-10)
    return at_one + tail
