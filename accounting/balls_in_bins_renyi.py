"""A sampling-free ε bound for balls-in-bins with any C: Rényi divergences of the dominating pair.

The pair (Choquette-Choo et al., "Near Exact Privacy Amplification for Matrix Mechanisms", arXiv
2410.06266, Lemma 3.2) is P = (1/b)·Σᵢ N(mᵢ, σ²I) against Q = N(0, σ²I), reduced to the Gram
matrix G = MᵀM of its modes. Write ℓᵢ(y) = exp(⟨mᵢ, y⟩/σ² − Gᵢᵢ/(2σ²)), so P/Q = L = (1/b)·Σᵢ ℓᵢ,
and for a tuple of k bins drawn uniformly with replacement let n be its count vector (Σ n = k).

- **Remove** (P against Q), exact at every integer order α ≥ 2:
  E_Q[L^α] = E_n exp((nᵀGn − diag(G)·n)/(2σ²)), since E_Q[Π ℓ] multiplies Gaussian moment
  generating functions (the identity behind Rényi accounting of mixtures, as in Mironov, Talwar &
  Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism", arXiv 1908.10530, §3).
- **Add** (Q against P), upper bounds at every integer order α ≥ 2, the smaller of two:
  the geometric mean, 1/L ≤ exp(−⟨m̄, y⟩/σ² + ḡ/(2σ²)) (m̄ the mean mode, ḡ the mean of
  diag(G); arithmetic ≥ geometric mean), a closed form (:func:`geometric_add_divergences`); and
  the harmonic mean, 1/L ≤ (1/b)·Σᵢ 1/ℓᵢ, whose (α−1)-th power expands like the remove moment:
  E_n exp((nᵀGn + diag(G)·n)/(2σ²)) over tuples of α − 1 bins.

Both sums run over count vectors. For a Gram matrix whose non-zero entries lie within two
diagonals of the main one (a C with at most three bands) the sum is a dynamic program over the
bins with the last two counts as state (:func:`log_moments`): O(b·K⁴) for orders up to K. Every
other ("far") entry g is bounded, never on the optimistic side, for a spread r ≥ 0
(:func:`banded_bound`): g ≤ r + (g − r)⁺, where r times every far pair's nᵢnⱼ sums exactly to
r·(u² − Σnᵢ² − the near pairs) and the excess goes onto the diagonal by 2h·nᵢnⱼ ≤ h(nᵢ² + nⱼ²)
(counts are non-negative). The far entries include those that couple the last bins to the
first when the bins repeat over epochs. Two spreads are tried, 0 (everything onto the diagonal:
right for a few bands) and the largest far entry (nothing onto it: right for a wide Gram matrix
such as a BLT's), and each direction takes its smaller bound.

Each direction's Rényi bound becomes (ε, δ) by the conversion of Canonne, Kamath & Steinke, "The
Discrete Gaussian for Differential Privacy" (arXiv 2004.00010), Proposition 12, minimised over
the orders 2..:data:`MAX_ORDER`; ε is the larger of the two directions, rounded up by
:data:`ROUNDING_SLACK` (relative) to cover float64 round-off in the program.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy.special import gammaln, logsumexp

__all__ = [
    "MAX_ORDER",
    "ROUNDING_SLACK",
    "RenyiEpsilon",
    "banded_bound",
    "epsilon_from_renyi",
    "geometric_add_divergences",
    "log_moments",
    "renyi_epsilon",
    "spreads",
]

MAX_ORDER = 32
"""Largest Rényi order tried: the program costs O(b·K⁴) (about 2 CPU s at b = 128, K = 32)."""

ROUNDING_SLACK = 1e-9
"""Relative amount ε is rounded up by: the program's float64 log-sum-exps lose ~1e-15 each."""


@dataclasses.dataclass(frozen=True)
class BandedBound:
    """The quadratic form bounding nᵀGn on count vectors n with Σ n = u: Σ quad·n² +
    2Σ near1·nᵢnᵢ₊₁ + 2Σ near2·nᵢnᵢ₊₂ + spread·u², with ``diag`` = diag(G) for the linear term."""

    diag: np.ndarray
    quad: np.ndarray
    near1: np.ndarray
    near2: np.ndarray
    spread: float = 0.0


def banded_bound(gram: np.ndarray, spread: float = 0.0) -> BandedBound:
    """Keep G's first two off-diagonals (i, i+1), (i, i+2) exactly and bound every other
    ("far") entry g, for a ``spread`` r ≥ 0: g ≤ r + (g − r)⁺. The r part of all far pairs is
    r·(u² − Σnᵢ² − Σ over near pairs), exactly; the excess goes onto the diagonal by
    2h·nᵢnⱼ ≤ h·(nᵢ² + nⱼ²). r = 0 moves every positive far entry onto the diagonal and drops
    the negative ones; r = the largest far entry moves none (for a wide Gram matrix: BLT)."""
    gram = np.asarray(gram, dtype=np.float64)
    if spread < 0:
        raise ValueError(f"spread must be non-negative, got {spread}")
    b = gram.shape[0]
    diag = np.diag(gram).copy()
    far = np.triu(gram, k=3) + np.tril(gram, k=-3)
    excess = np.where(far > spread, far - spread, 0.0)
    has_far = b > 3
    r = spread if has_far else 0.0
    quad = diag - r + excess.sum(axis=1)
    near1 = np.array([gram[i, i + 1] for i in range(b - 1)]) - r
    near2 = np.array([gram[i, i + 2] for i in range(b - 2)]) - r
    return BandedBound(diag, quad, near1, near2, r)


def spreads(gram: np.ndarray) -> tuple[float, ...]:
    """The spreads :func:`renyi_epsilon` tries: 0 and the largest far entry (when positive)."""
    gram = np.asarray(gram, dtype=np.float64)
    far = np.triu(gram, k=3)
    largest = float(far.max()) if far.size and gram.shape[0] > 3 else 0.0
    return (0.0, largest) if largest > 0 else (0.0,)


def log_moments(bound: BandedBound, sigma: float, max_count: int, sign: int) -> np.ndarray:
    """log E_n exp((nᵀĜn + sign·diag·n)/(2σ²)) for k = 0..max_count bins drawn uniformly with
    replacement (n their count vector, Ĝ the ``bound``'s form): sign −1 is the remove moment,
    +1 the add bound. A program over the bins whose state is (balls so far, last two counts)."""
    s2 = sigma * sigma
    b = len(bound.diag)
    counts = np.arange(max_count + 1, dtype=np.float64)
    size = max_count + 1
    # f[u, k1, k2]: log weight of u balls in bins 0..i with count k1 in bin i and k2 in bin i-1
    f = np.full((size, size, size), -np.inf)
    f[counts.astype(int), counts.astype(int), 0] = _own(bound, 0, counts, s2, sign)
    with np.errstate(invalid="ignore"):
        for i in range(1, b):
            c1 = bound.near1[i - 1] / s2
            c2 = bound.near2[i - 2] / s2 if i >= 2 else 0.0
            own = _own(bound, i, counts, s2, sign)
            new = np.full_like(f, -np.inf)
            for kp in range(size):
                # new[u, kp, k1] = logsumexp_k2 (f[u - kp, k1, k2] + c2·k2·kp) + c1·k1·kp + own(kp)
                before = logsumexp(f[: size - kp] + (c2 * kp) * counts, axis=2)
                new[kp:, kp, :] = before + (c1 * kp) * counts + own[kp]
            f = new
    total = logsumexp(f.reshape(size, -1), axis=1) + bound.spread * counts**2 / (2 * s2)
    return total + gammaln(counts + 1) - counts * math.log(b)


def _own(bound: BandedBound, i: int, counts: np.ndarray, s2: float, sign: int) -> np.ndarray:
    """Bin i's own factor of the multinomial sum: exp((quad·k² + sign·diag·k)/(2σ²)) / k!."""
    return (bound.quad[i] * counts**2 + sign * bound.diag[i] * counts) / (2 * s2) - gammaln(
        counts + 1
    )


def geometric_add_divergences(gram: np.ndarray, sigma: float, orders: np.ndarray) -> np.ndarray:
    """The add direction's closed-form bound: Q/P = 1/L ≤ 1/(geometric mean of the ℓᵢ) =
    exp(−⟨m̄, y⟩/σ² + ḡ/(2σ²)), m̄ the mean mode and ḡ the mean of diag(G), so
    D_α(Q‖P) ≤ (α − 1)·‖m̄‖²/(2σ²) + ḡ/(2σ²), with ‖m̄‖² = 1ᵀG1/b². Tighter than the harmonic
    bound when the modes' likelihood ratios spread widely (large ‖mᵢ‖/σ)."""
    b = gram.shape[0]
    mean_mode_sq = float(gram.sum()) / b**2
    mean_norm_sq = float(np.trace(gram)) / b
    return ((orders - 1) * mean_mode_sq + mean_norm_sq) / (2 * sigma**2)


def epsilon_from_renyi(orders: np.ndarray, divergences: np.ndarray, delta: float) -> float:
    """The smallest ε over ``orders`` with H_{e^ε} ≤ δ implied by D_α ≤ ``divergences``
    (Canonne, Kamath & Steinke, Proposition 12): ε = D_α + log(1 − 1/α) − (log δ + log α)/(α − 1)."""
    orders = np.asarray(orders, dtype=np.float64)
    eps = divergences + np.log1p(-1 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
    return max(float(np.min(eps)), 0.0)


@dataclasses.dataclass(frozen=True)
class RenyiEpsilon:
    """``epsilon`` = max(remove, add); each direction's ε(δ) with the order that gave it."""

    epsilon: float
    remove: float
    add: float


def renyi_epsilon(
    gram: np.ndarray, compositions: int, sigma: float, delta: float, max_order: int = MAX_ORDER
) -> RenyiEpsilon:
    """The sampling-free ε(δ) bound of ``compositions`` copies of the pair with Gram matrix
    ``gram`` at noise multiplier ``sigma`` (Rényi divergences add under composition)."""
    gram = np.asarray(gram, dtype=np.float64)
    orders = np.arange(2, max_order + 1, dtype=np.float64)
    bounds = [banded_bound(gram, spread) for spread in spreads(gram)]
    eps_remove = min(
        epsilon_from_renyi(
            orders,
            compositions * log_moments(bound, sigma, max_order, -1)[2:] / (orders - 1),
            delta,
        )
        for bound in bounds
    )
    add = geometric_add_divergences(gram, sigma, orders)
    eps_add = epsilon_from_renyi(orders, compositions * add, delta)
    if eps_add > eps_remove:  # only then can the program's add bound lower the answer
        for bound in bounds:
            harmonic = log_moments(bound, sigma, max_order - 1, +1)[1:] / (orders - 1)
            add = np.minimum(add, harmonic)
        eps_add = epsilon_from_renyi(orders, compositions * add, delta)
    worst = max(eps_remove, eps_add)
    return RenyiEpsilon(worst * (1 + ROUNDING_SLACK), eps_remove, eps_add)
