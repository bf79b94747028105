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
(counts are non-negative). When the bins repeat over epochs a banded C's Gram matrix is cyclic:
three entries tie the last two bins to the first two. A second, cyclic program keeps them exactly
by carrying the first two bins' counts in its state (O(b·K⁶), orders up to
:data:`CYCLIC_MAX_ORDER`); the straight one bounds them like the far entries. Two spreads are
tried, 0 (everything onto the diagonal: right for a few bands) and the largest far entry
(nothing onto it: right for a wide Gram matrix such as a BLT's), and each direction takes, order
by order, its smallest bound among these forms.

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
    "CYCLIC_MAX_ORDER",
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
"""Largest Rényi order tried: the straight program costs O(b·K⁴) (about 1 CPU s at b = 128,
K = 32)."""

CYCLIC_MAX_ORDER = 8
"""Largest order of the cyclic program, O(b·K⁶) (under a CPU second at b = 128, K = 8): the
orders that matter where the wrap-around entries weigh most (moderate ε)."""

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
    wrap: tuple[float, float, float] | None = None
    """Cyclic form only: the entries (b−1, 0), (b−2, 0), (b−1, 1) kept exactly."""


def banded_bound(gram: np.ndarray, spread: float = 0.0, cyclic: bool = False) -> BandedBound:
    """Keep G's first two off-diagonals (i, i+1), (i, i+2) exactly and bound every other
    ("far") entry g, for a ``spread`` r ≥ 0: g ≤ r + (g − r)⁺. The r part of all far pairs is
    r·(u² − Σnᵢ² − Σ over near pairs), exactly; the excess goes onto the diagonal by
    2h·nᵢnⱼ ≤ h·(nᵢ² + nⱼ²). r = 0 moves every positive far entry onto the diagonal and drops
    the negative ones; r = the largest far entry moves none (for a wide Gram matrix: BLT).
    ``cyclic`` (b ≥ 5) also keeps the three entries that tie the last two bins to the first two
    exactly (the bins repeat over epochs, so the Gram matrix of a banded C is cyclic)."""
    gram = np.asarray(gram, dtype=np.float64)
    if spread < 0:
        raise ValueError(f"spread must be non-negative, got {spread}")
    b = gram.shape[0]
    cyclic = cyclic and b >= 5
    diag = np.diag(gram).copy()
    far = np.triu(gram, k=3) + np.tril(gram, k=-3)
    wrap = None
    if cyclic:
        wrap_at = ((b - 1, 0), (b - 2, 0), (b - 1, 1))
        wrap = tuple(float(gram[i, j]) for i, j in wrap_at)
        for i, j in wrap_at:
            far[i, j] = far[j, i] = 0.0
    excess = np.where(far > spread, far - spread, 0.0)
    has_far = b > (5 if cyclic else 3)
    r = spread if has_far else 0.0
    quad = diag - r + excess.sum(axis=1)
    near1 = np.array([gram[i, i + 1] for i in range(b - 1)]) - r
    near2 = np.array([gram[i, i + 2] for i in range(b - 2)]) - r
    if wrap is not None:
        wrap = (wrap[0] - r, wrap[1] - r, wrap[2] - r)
    return BandedBound(diag, quad, near1, near2, r, wrap)


def spreads(gram: np.ndarray) -> tuple[float, ...]:
    """The spreads :func:`renyi_epsilon` tries: 0 and the largest far entry (when positive)."""
    gram = np.asarray(gram, dtype=np.float64)
    far = np.triu(gram, k=3)
    largest = float(far.max()) if far.size and gram.shape[0] > 3 else 0.0
    return (0.0, largest) if largest > 0 else (0.0,)


def log_moments(bound: BandedBound, sigma: float, max_count: int, sign: int) -> np.ndarray:
    """log E_n exp((nᵀĜn + sign·diag·n)/(2σ²)) for k = 0..max_count bins drawn uniformly with
    replacement (n their count vector, Ĝ the ``bound``'s form): sign −1 is the remove moment,
    +1 the add bound. A program over the bins whose state is (balls so far, last two counts),
    and for a cyclic form also the first two bins' counts (O(b·K⁶): for small K only)."""
    if bound.wrap is not None:
        return _cyclic_log_moments(bound, sigma, max_count, sign)
    s2 = sigma * sigma
    counts = np.arange(max_count + 1, dtype=np.float64)
    size = max_count + 1
    # f[u, k1, k2]: log weight of u balls in bins 0..i with count k1 in bin i and k2 in bin i-1
    f = np.full((size, size, size), -np.inf)
    f[counts.astype(int), counts.astype(int), 0] = _own(bound, 0, counts, s2, sign)
    f = _sweep(bound, f, 1, counts, s2, sign)
    return _normalized(bound, logsumexp(f.reshape(size, -1), axis=1), counts, s2)


def _cyclic_log_moments(bound: BandedBound, sigma: float, max_count: int, sign: int) -> np.ndarray:
    """:func:`log_moments` of a cyclic form: the first two bins' counts (k0, k1) stay in the state
    so that the wrap-around entries are charged exactly at the end."""
    s2 = sigma * sigma
    counts = np.arange(max_count + 1, dtype=np.float64)
    size = max_count + 1
    # f[k0, k1, u, kl, k2]: bins 0..i hold u balls, bin 0 k0, bin 1 k1, bin i kl, bin i-1 k2
    f = np.full((size,) * 5, -np.inf)
    own0, own1 = _own(bound, 0, counts, s2, sign), _own(bound, 1, counts, s2, sign)
    for k0 in range(size):
        for k1 in range(size - k0):
            f[k0, k1, k0 + k1, k1, k0] = own0[k0] + own1[k1] + bound.near1[0] * k0 * k1 / s2
    f = _sweep(bound, f, 2, counts, s2, sign)
    last_first, second_last_first, last_second = (w / s2 for w in bound.wrap)
    k0 = counts[:, None, None, None, None]
    k1 = counts[None, :, None, None, None]
    kl = counts[None, None, None, :, None]
    k2 = counts[None, None, None, None, :]
    f = f + last_first * kl * k0 + second_last_first * k2 * k0 + last_second * kl * k1
    return _normalized(bound, logsumexp(np.moveaxis(f, 2, 0).reshape(size, -1), axis=1), counts, s2)


def _sweep(
    bound: BandedBound, f: np.ndarray, first: int, counts: np.ndarray, s2: float, sign: int
) -> np.ndarray:
    """Add bins ``first``.. to the program's table f[..., u, k_last, k_before_last] (leading axes
    carried along untouched): each bin's own factor and its couplings to the two bins before."""
    size = len(counts)
    with np.errstate(invalid="ignore"):
        for i in range(first, len(bound.diag)):
            c1 = bound.near1[i - 1] / s2
            c2 = bound.near2[i - 2] / s2 if i >= 2 else 0.0
            own = _own(bound, i, counts, s2, sign)
            new = np.full_like(f, -np.inf)
            for kp in range(size):
                # new[u, kp, k1] = logsumexp_k2 (f[u - kp, k1, k2] + c2·k2·kp) + c1·k1·kp + own(kp)
                before = logsumexp(f[..., : size - kp, :, :] + (c2 * kp) * counts, axis=-1)
                new[..., kp:, kp, :] = before + (c1 * kp) * counts + own[kp]
            f = new
    return f


def _normalized(bound: BandedBound, total: np.ndarray, counts: np.ndarray, s2: float) -> np.ndarray:
    """The program's sums over count vectors, by balls u, as log E over uniform u-tuples: the
    spread's r·u², the multinomial u!, and b^−u."""
    total = total + bound.spread * counts**2 / (2 * s2)
    return total + gammaln(counts + 1) - counts * math.log(len(bound.diag))


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


def _smallest_divergences(gram: np.ndarray, sigma: float, max_order: int, sign: int) -> np.ndarray:
    """At each order 2..``max_order`` the smallest Rényi bound of one direction (sign −1 remove,
    +1 the harmonic add bound) among the forms tried: each spread, straight (orders up to
    ``max_order``) and cyclic (orders up to :data:`CYCLIC_MAX_ORDER`)."""
    orders = np.arange(2, max_order + 1, dtype=np.float64)
    best = np.full(len(orders), np.inf)
    shift = 2 if sign < 0 else 1  # the add bound at order α is the moment of α − 1 bins
    for spread in spreads(gram):
        for cyclic, top in ((False, max_order), (True, min(max_order, CYCLIC_MAX_ORDER))):
            bound = banded_bound(gram, spread, cyclic)
            if cyclic and bound.wrap is None:
                continue
            moments = log_moments(bound, sigma, top - (2 - shift), sign)[shift:]
            divergences = moments / (orders[: len(moments)] - 1)
            best[: len(moments)] = np.minimum(best[: len(moments)], divergences)
    return best


def renyi_epsilon(
    gram: np.ndarray, compositions: int, sigma: float, delta: float, max_order: int = MAX_ORDER
) -> RenyiEpsilon:
    """The sampling-free ε(δ) bound of ``compositions`` copies of the pair with Gram matrix
    ``gram`` at noise multiplier ``sigma`` (Rényi divergences add under composition)."""
    gram = np.asarray(gram, dtype=np.float64)
    orders = np.arange(2, max_order + 1, dtype=np.float64)
    remove = _smallest_divergences(gram, sigma, max_order, -1)
    eps_remove = epsilon_from_renyi(orders, compositions * remove, delta)
    add = geometric_add_divergences(gram, sigma, orders)
    eps_add = epsilon_from_renyi(orders, compositions * add, delta)
    if eps_add > eps_remove:  # only then can the program's add bound lower the answer
        add = np.minimum(add, _smallest_divergences(gram, sigma, max_order, +1))
        eps_add = epsilon_from_renyi(orders, compositions * add, delta)
    worst = max(eps_remove, eps_add)
    return RenyiEpsilon(worst * (1 + ROUNDING_SLACK), eps_remove, eps_add)
