"""Monte Carlo accountant for balls-in-bins sampling with (correlated) Gaussian noise
(Choquette-Choo et al., "Near Exact Privacy Amplification for Matrix Mechanisms").

Mechanism: every unit (user) lands in one uniformly random bin among ``bins``; step t of each
epoch uses bin t, and the run releases Cx + σz (equivalently x + σC⁻¹z), z ~ N(0, I), for a
non-negative lower-triangular C (``None`` = identity = DP-SGD), n = bins·epochs steps.

Two bin semantics, NOT interchangeable (the sampler and the accountant must agree):

* ``"fixed"`` — bins drawn once for the whole run (Def. 3.1 of that paper; the b-min-sep
  structure matrix mechanisms need). Its Lemma 3.2: dominated by the b-mode mixture
      P = (1/b) Σᵢ N(mᵢ, σ²Iₙ)  vs  Q = N(0, σ²Iₙ),   mᵢ = Σⱼ |C|[:, b·j + i].
* ``"per-epoch"`` — bins redrawn every epoch (random allocation, Chua et al. arXiv 2412.16802).
  Only C = identity is supported: the epochs are then independent one-epoch mechanisms with
  orthonormal modes, so the run is dominated by the E-fold product of the one-epoch pair and the
  privacy loss is the SUM of E independent one-epoch losses (exact composition, sampled).
  With correlated noise the epochs are coupled and there are b^E patterns; no dominating pair
  is known here, so that combination raises :class:`UnsupportedBinSemanticsError`.

Sampling draws the paper's σ-independent samples X = m_k + σZ (its §4.1, Algorithm 2) through
the Gram matrix G = MᵀM: with k ~ Unif[b], W = MᵀZ ~ N(0, G),
    Y  = logsumexpᵢ((G[k,i] − G[i,i]/2)/σ² + Wᵢ/σ) − log b          (X ~ P, loss log P/Q)
    Y' = −(logsumexpᵢ(−G[i,i]/(2σ²) + Wᵢ/σ) − log b)                 (X ~ Q, loss log Q/P)
so after an O(n·b²) setup each sample costs O(b²) (O(b) for diagonal G), independent of n and
of the model size. Both directions are always estimated and the max is used.

Randomness: a seed gives two independent streams (children 0 and 1 of ``SeedSequence(seed)``):
the estimate stream (ε/δ̂ estimates and calibration) and the verify stream. Calibration bisects σ
on fixed estimate-stream samples (common random numbers); verification draws only the verify
stream, which calibration never touches. Each sample's W is shared by both directions.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize, stats
from userdp.accounting import monte_carlo as mc
from userdp.accounting.correlation import Correlation, CorrelationError, from_spec
from userdp.accounting.mechanisms import CorrelationSpec

__all__ = [
    "BIN_SEMANTICS",
    "BallsInBinsError",
    "DeltaEstimate",
    "DominatingPair",
    "UnsupportedBinSemanticsError",
    "VerificationFailedError",
    "VerificationResult",
    "calibrate_noise_multiplier",
    "correlation_matrix",
    "delta_estimate",
    "dominating_pair",
    "epsilon",
    "gaussian_delta",
    "verify",
]

BIN_SEMANTICS = ("fixed", "per-epoch")
DEFAULT_NUM_SAMPLES = 2**20
_CHUNK_ELEMENTS = 2**23  # float32 entries per chunk of W (32 MiB)
_THREADS = max(1, min(4, os.cpu_count() or 1))  # chunks computed in parallel (GIL released)
_ESTIMATE, _VERIFY = 0, 1


class BallsInBinsError(ValueError):
    """Bad input to the balls-in-bins accountant; the message names the parameter."""


class UnsupportedBinSemanticsError(BallsInBinsError):
    """``per-epoch`` bins with a non-identity correlation matrix have no accountant here."""


class VerificationFailedError(BallsInBinsError):
    """The fresh-sample EVR check did not certify (ε, δ) at the calibrated σ."""


# --------------------------------------------------------------------------------------------
# the correlation matrix C


def correlation_matrix(correlation: Any, n: int) -> np.ndarray | None:
    """C as a dense n×n array, or None for the identity.

    Accepts None; an (n, n) array; a callable ``f(n) -> array``; a
    :class:`~userdp.accounting.correlation.Correlation` (e.g. ``strategies.blt.Blt``); or a
    ``CorrelationSpec`` or its dict form, turned into numbers by
    :func:`userdp.accounting.correlation.from_spec`.
    """
    if correlation is None:
        return None
    if isinstance(correlation, CorrelationSpec | Mapping):
        try:
            correlation = from_spec(correlation)
        except CorrelationError as exc:
            raise BallsInBinsError(str(exc)) from None
    if isinstance(correlation, Correlation):
        return None if correlation.is_identity else correlation.matrix(n)
    matrix = correlation(n) if callable(correlation) else correlation
    return np.asarray(matrix, dtype=np.float64)


def _check_correlation(matrix: np.ndarray, n: int) -> None:
    if matrix.shape != (n, n):
        raise BallsInBinsError(
            f"correlation has shape {matrix.shape}; expected ({n}, {n}) = (bins·epochs, bins·epochs)"
        )
    if not np.all(np.isfinite(matrix)):
        raise BallsInBinsError("correlation has non-finite entries; expected finite numbers")
    if np.any(np.triu(matrix, 1) != 0.0):
        raise BallsInBinsError(
            "correlation is not lower-triangular; Lemma 3.2 needs C[i, j] = 0, j > i"
        )
    if np.any(matrix < 0.0):
        raise BallsInBinsError("correlation has negative entries; Lemma 3.2 needs C >= 0 entrywise")


# --------------------------------------------------------------------------------------------
# the dominating pair


@dataclass(frozen=True)
class DominatingPair:
    """The b-mode mixture pair, reduced to its Gram matrix.

    ``gram`` = MᵀM (b×b) of one block; ``compositions`` = how many independent copies of the
    block's pair are composed (1 for fixed bins, ``epochs`` for per-epoch bins with C = I).
    """

    gram: np.ndarray
    compositions: int
    bin_semantics: str

    @property
    def bins(self) -> int:
        return self.gram.shape[0]

    @property
    def sensitivity(self) -> float:
        """√compositions · max‖mᵢ‖: the sensitivity of the same mechanism WITHOUT amplification."""
        return math.sqrt(self.compositions * float(np.max(np.diag(self.gram))))


def dominating_pair(
    bins: int, epochs: int, *, bin_semantics: str = "fixed", correlation: Any = None
) -> DominatingPair:
    """Build the Lemma 3.2 pair for ``bins`` × ``epochs`` steps (validates every input)."""
    bins = _positive_int("bins", bins)
    epochs = _positive_int("epochs", epochs)
    if bin_semantics not in BIN_SEMANTICS:
        raise BallsInBinsError(
            f"bin_semantics={bin_semantics!r} is not allowed; expected one of {BIN_SEMANTICS}"
        )
    n = bins * epochs
    matrix = correlation_matrix(correlation, n)
    if matrix is not None and np.array_equal(matrix, np.eye(n)):
        matrix = None
    if bin_semantics == "per-epoch":
        if matrix is not None:
            raise UnsupportedBinSemanticsError(
                "bin_semantics='per-epoch' supports only correlation=None (identity, DP-SGD); "
                "use bin_semantics='fixed' for correlated noise (the dominating pair of "
                "Lemma 3.2 of Near Exact Privacy Amplification for Matrix Mechanisms)"
            )
        return DominatingPair(np.eye(bins), epochs, bin_semantics)
    if matrix is None:
        return DominatingPair(float(epochs) * np.eye(bins), 1, bin_semantics)
    _check_correlation(matrix, n)
    modes = matrix.reshape(n, epochs, bins).sum(axis=1)  # column t = b·j + i → [:, j, i]
    return DominatingPair(modes.T @ modes, 1, bin_semantics)


class _Sampler:
    """Privacy-loss samples of a pair at any σ from FIXED randomness (common random numbers).

    The standard normals are regenerated chunk by chunk from per-chunk seeds, so the same
    object gives the same draws on every call without holding m·b floats in memory.
    """

    def __init__(self, pair: DominatingPair, num_samples: int, seed: Any, purpose: int) -> None:
        self.pair = pair
        self.num_samples = num_samples
        self.bins = pair.bins
        gram = pair.gram
        self.diag = np.diag(gram).astype(np.float64)
        if np.count_nonzero(gram - np.diag(self.diag)) == 0:
            self.factor: np.ndarray | None = None  # W = √diag · g
            self.scale = np.sqrt(self.diag).astype(np.float32)
        else:
            w, v = np.linalg.eigh(gram)
            self.factor = (v * np.sqrt(np.clip(w, 0.0, None))).T.astype(np.float32)  # W = g @ Lᵀ
        root = _root_seed(seed)
        self.seed = _child(root, purpose)
        width = self.bins * pair.compositions
        self.chunk = max(1, min(num_samples, _CHUNK_ELEMENTS // width))

    def _normals(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``index`` of the fixed draws: mode indices k and standard normals g."""
        n_chunks = math.ceil(self.num_samples / self.chunk)
        if not 0 <= index < n_chunks:
            raise IndexError(index)
        size = min(self.chunk, self.num_samples - index * self.chunk)
        rng = np.random.default_rng(_child(self.seed, index))
        k = rng.integers(0, self.bins, size=(self.pair.compositions, size))
        g = rng.standard_normal((self.pair.compositions, size, self.bins), dtype=np.float32)
        return k, g

    def _chunk_losses(self, index: int, sigma: float) -> tuple[np.ndarray, np.ndarray]:
        """The positive losses of both directions for chunk ``index`` at σ."""
        k, g = self._normals(index)
        log_b = math.log(self.bins)
        if self.factor is None:
            # Diagonal G: X ~ P differs from the Q-row only at coordinate k, by G[k, k]/σ², so
            # its log-sum-exp follows from the Q-row's without a second pass over the b modes:
            #   lse(pos) = logaddexp(log Σ_{i≠k} e^{base_i}, base_k + G[k, k]/σ²),
            #   log Σ_{i≠k} e^{base_i} = lse(base) + log1p(−e^{base_k − lse(base)}).
            base_k, lse_base = self._diagonal_lse(index, k, g, sigma)
            with np.errstate(divide="ignore"):
                rest = lse_base + np.log1p(-np.exp(np.minimum(base_k - lse_base, 0.0)))
            lse_pos = np.logaddexp(rest, base_k + self.diag[k] / sigma**2)
            y_qp = -(lse_base - log_b).sum(axis=0)
            y_pq = (lse_pos - log_b).sum(axis=0)
        else:
            base = g @ self.factor
            base *= np.float32(1.0 / sigma)
            base -= (0.5 * self.diag / sigma**2).astype(np.float32)
            pos = base + (self.pair.gram / sigma**2).astype(np.float32)[k]
            y_qp = -_logsumexp_rows(base, log_b)
            y_pq = _logsumexp_rows(pos, log_b)
        return y_pq[y_pq > 0.0], y_qp[y_qp > 0.0]

    def _diagonal_lse(
        self, index: int, k: np.ndarray, g: np.ndarray, sigma: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(base_k, log Σ_i e^{base_i}) in float64 for base = √diag·g/σ − diag/(2σ²); ``g`` is
        overwritten.

        Equal diagonal entries (fixed bins without correlation, per-epoch bins) make the shift a
        constant c: lse(base) = log Σ_i e^{s·g_i} − c, two passes over the draws (scale+exp in
        place, sum) instead of the max-shifted five. e^{s·g} cannot overflow float32 unless
        s·max g > 88; a non-finite or zero row sum sends the chunk down the max-shifted path,
        regenerated from its seed."""
        diag = self.diag
        if diag.size and np.all(diag == diag[0]):
            scale = float(np.sqrt(diag[0]) / sigma)
            shift = 0.5 * float(diag[0]) / sigma**2
            g_k = np.take_along_axis(g, k[..., None], -1)[..., 0].astype(np.float64)
            np.multiply(g, np.float32(scale), out=g)
            with np.errstate(over="ignore"):  # detected below: the chunk is redone
                np.exp(g, out=g)
            total = g.sum(axis=-1, dtype=np.float64)
            if np.all(np.isfinite(total)) and np.all(total > 0.0):
                return scale * g_k - shift, np.log(total) - shift
            k, g = self._normals(index)  # overflow: the max-shifted path on the same draws
        base = g
        base *= (self.scale / np.float32(sigma)).astype(np.float32)
        base -= (0.5 * diag / sigma**2).astype(np.float32)
        base_k = np.take_along_axis(base, k[..., None], -1)[..., 0].astype(np.float64)
        return base_k, _logsumexp_last(base)

    def losses(self, sigma: float) -> tuple[np.ndarray, np.ndarray]:
        """The positive privacy-loss samples (Y > 0) of both directions at σ: (H(P,Q) losses
        log P/Q under P, H(Q,P) losses log Q/P under Q). The two directions share W (each
        estimate is unbiased on its own; EVR tests each direction separately).

        Chunks run on up to ``_THREADS`` threads (numpy's generators and ufuncs release the
        GIL); each chunk has its own seed and results are joined in chunk order, so the output
        does not depend on the thread count."""
        n_chunks = math.ceil(self.num_samples / self.chunk)
        threads = max(1, min(_THREADS, n_chunks))
        if threads == 1:
            parts = [self._chunk_losses(i, sigma) for i in range(n_chunks)]
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="userdp-bib") as pool:
                parts = list(pool.map(lambda i: self._chunk_losses(i, sigma), range(n_chunks)))
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _logsumexp_last(logits: np.ndarray) -> np.ndarray:
    """logsumexp over the last axis, in float64 (exp in float32); overwrites ``logits``."""
    peak = logits.max(axis=-1, keepdims=True)
    logits -= peak
    np.exp(logits, out=logits)
    return np.log(logits.sum(axis=-1, dtype=np.float64)) + peak[..., 0]


def _logsumexp_rows(logits: np.ndarray, log_b: float) -> np.ndarray:
    """Σ over compositions of (logsumexp over the last axis − log b); overwrites ``logits``."""
    return (_logsumexp_last(logits) - log_b).sum(axis=0)


def _root_seed(seed: Any) -> np.random.SeedSequence:
    """A SeedSequence for ``seed`` (None = fresh OS entropy, drawn once per call)."""
    return seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)


def _child(root: np.random.SeedSequence, index: int) -> np.random.SeedSequence:
    """The ``index``-th independent child of ``root``, deterministically (unlike ``spawn``,
    which advances a counter and would break common random numbers on a second call)."""
    return np.random.SeedSequence(root.entropy, spawn_key=(*root.spawn_key, index))


# --------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class DeltaEstimate:
    """δ̂ = max(H(P,Q), H(Q,P)) at ``epsilon`` and σ, with standard errors and a one-sided
    KL-Chernoff upper confidence bound (each direction at failure (1 − confidence)/2)."""

    epsilon: float
    noise_multiplier: float
    delta: float
    delta_pq: float
    delta_qp: float
    stderr_pq: float
    stderr_qp: float
    upper_bound: float
    confidence: float
    num_samples: int

    @property
    def stderr(self) -> float:
        return self.stderr_pq if self.delta_pq >= self.delta_qp else self.stderr_qp


@dataclass(frozen=True)
class VerificationResult:
    """The EVR check on FRESH samples: ``passed`` iff both directions pass
    :func:`userdp.accounting.monte_carlo.evr_passes` at the fixed target ``delta``."""

    passed: bool
    epsilon: float
    delta: float
    noise_multiplier: float
    delta_pq: float
    delta_qp: float
    num_samples: int


# --------------------------------------------------------------------------------------------
# public API


def delta_estimate(
    noise_multiplier: float,
    bins: int,
    epochs: int,
    epsilon: float,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: Any = None,
    confidence: float = 0.95,
) -> DeltaEstimate:
    """Estimate δ(ε) for σ = ``noise_multiplier`` (both directions) from ``num_samples`` each."""
    sigma = _positive_float("noise_multiplier", noise_multiplier)
    epsilon = _non_negative_float("epsilon", epsilon)
    if not 0.0 < confidence < 1.0:
        raise BallsInBinsError(f"confidence={confidence!r} is out of range; expected (0, 1)")
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    m = _positive_int("num_samples", num_samples)
    sampler = _Sampler(pair, m, seed, _ESTIMATE)
    return _estimate(sampler, sigma, epsilon, confidence)


def _estimate(sampler: _Sampler, sigma: float, epsilon: float, confidence: float) -> DeltaEstimate:
    m = sampler.num_samples
    y_pq, y_qp = sampler.losses(sigma)
    d_pq, se_pq = mc.delta_from_losses(y_pq, epsilon, m)
    d_qp, se_qp = mc.delta_from_losses(y_qp, epsilon, m)
    failure = (1.0 - confidence) / 2.0
    ucb = max(mc.kl_upper_confidence_bound(d, m, failure) for d in (d_pq, d_qp))
    return DeltaEstimate(
        epsilon, sigma, max(d_pq, d_qp), d_pq, d_qp, se_pq, se_qp, ucb, confidence, m
    )


def epsilon(
    noise_multiplier: float,
    bins: int,
    epochs: int,
    delta: float,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: Any = None,
) -> float:
    """Monte Carlo point estimate of ε(δ): the smallest ε with max(δ̂_PQ, δ̂_QP)(ε) ≤ δ.

    An ESTIMATE (its error is that of δ̂, see :func:`delta_estimate`); to certify a guarantee
    use :func:`verify` with fresh samples.
    """
    sigma = _positive_float("noise_multiplier", noise_multiplier)
    delta = _probability("delta", delta)
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    m = _positive_int("num_samples", num_samples)
    sampler = _Sampler(pair, m, seed, _ESTIMATE)
    losses = list(sampler.losses(sigma))
    return mc.epsilon_from_losses(losses, delta, m)


def verify(
    noise_multiplier: float,
    bins: int,
    epochs: int,
    epsilon: float,
    delta: float,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int | None = None,
    seed: Any = None,
    safety: float = 0.8,
) -> VerificationResult:
    """Estimate-Verify-Release check of (ε, δ) at σ on FRESH samples (the verify streams of
    ``seed``, independent of every calibration/estimate draw with the same seed).

    Passes iff for both directions δ̂ < δ and exp(−m·KL(δ̂ ‖ δ)) ≤ δ; then releasing only on a pass
    is (ε, δ)-DP (Theorem 2.1 of "Near Exact Privacy Amplification for Matrix Mechanisms",
    Theorem 9 of Wang et al. 2023, with τδ = δ). ``num_samples`` defaults to
    :func:`~userdp.accounting.monte_carlo.evr_min_samples` (δ, ``safety``): enough for δ̂ =
    safety·δ to pass.
    """
    sigma = _positive_float("noise_multiplier", noise_multiplier)
    epsilon = _non_negative_float("epsilon", epsilon)
    delta = _probability("delta", delta)
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    m = mc.evr_min_samples(delta, safety) if num_samples is None else num_samples
    m = _positive_int("num_samples", m)
    sampler = _Sampler(pair, m, seed, _VERIFY)
    y_pq, y_qp = sampler.losses(sigma)
    d_pq = mc.delta_from_losses(y_pq, epsilon, m)[0]
    d_qp = mc.delta_from_losses(y_qp, epsilon, m)[0]
    passed = mc.evr_passes(d_pq, m, delta) and mc.evr_passes(d_qp, m, delta)
    return VerificationResult(passed, epsilon, delta, sigma, d_pq, d_qp, m)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    bins: int,
    epochs: int,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: Any = None,
    safety: float = 0.8,
    verify_samples: int | None = None,
    check: bool = True,
    rtol: float = 1e-3,
) -> float:
    """σ for (target_epsilon, delta): bisection (in log σ) on δ̂(σ) = ``safety``·δ with common
    random numbers, then the EVR check of :func:`verify` at δ on fresh samples.

    ``verify_samples`` defaults to ``evr_min_samples(delta, safety)`` (5.4·10⁷ at δ = 1e-5).
    Raises :class:`VerificationFailedError` if the fresh check fails. ``check=False`` skips the
    verification: the result is then only an estimate, not a guarantee.
    """
    target = _non_negative_float("target_epsilon", target_epsilon)
    delta = _probability("delta", delta)
    if not 0.0 < safety <= 1.0:
        raise BallsInBinsError(f"safety={safety!r} is out of range; expected a float in (0, 1]")
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    m = _positive_int("num_samples", num_samples)
    root = _root_seed(seed)
    sampler = _Sampler(pair, m, root, _ESTIMATE)
    goal = safety * delta

    def excess(log_sigma: float) -> float:
        est = _estimate(sampler, math.exp(log_sigma), target, 0.5)
        return est.delta - goal

    # Upper bracket: the unamplified Gaussian σ. H(P,Q) ≤ H(worst single mode, Q), since the
    # hockey-stick divergence is convex in P (and, for the reverse direction, in Q).
    hi = math.log(gaussian_sigma(target, goal, pair.sensitivity))
    for _ in range(8):
        if excess(hi) <= 0.0:
            break
        hi += math.log(2.0)
    else:
        raise BallsInBinsError("calibration found no σ with δ̂ ≤ safety·δ; use more num_samples")
    lo = hi - math.log(4.0)
    for _ in range(60):
        if excess(lo) > 0.0:
            break
        lo -= math.log(4.0)
    sigma = math.exp(optimize.brentq(excess, lo, hi, xtol=math.log1p(rtol) / 2))
    sigma *= 1.0 + rtol / 2  # the private side of the root's bracket
    if excess(math.log(sigma)) > 0.0:
        sigma = math.exp(hi)
    if check:
        result = verify(
            sigma,
            bins,
            epochs,
            target,
            delta,
            bin_semantics=bin_semantics,
            correlation=correlation,
            num_samples=verify_samples,
            seed=root,
            safety=safety,
        )
        if not result.passed:
            raise VerificationFailedError(
                f"EVR check failed at noise_multiplier={sigma:.6g}: fresh δ̂ = "
                f"{max(result.delta_pq, result.delta_qp):.3g} with {result.num_samples} samples "
                f"does not certify delta={delta}; raise verify_samples or lower safety"
            )
    return sigma


# --------------------------------------------------------------------------------------------
# analytic Gaussian (b = 1 reference and the calibration bracket)


def gaussian_delta(epsilon: float, sensitivity: float, sigma: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), μ = Δ/σ."""
    mu = sensitivity / sigma
    return float(
        stats.norm.cdf(-epsilon / mu + mu / 2)
        - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2)
    )


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The σ with gaussian_delta(ε, Δ, σ) = δ."""

    def f(log_sigma: float) -> float:
        return gaussian_delta(epsilon, sensitivity, math.exp(log_sigma)) - delta

    lo, hi = math.log(sensitivity) - 10.0, math.log(sensitivity) + 10.0
    return math.exp(optimize.brentq(f, lo, hi, xtol=1e-12))


# --------------------------------------------------------------------------------------------
# input checks (one-line messages: parameter, bad value, what is allowed)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise BallsInBinsError(f"{name}={value!r} is out of range; expected an integer >= 1")
    return int(value)


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BallsInBinsError(f"{name}={value!r} is not a number; expected a float > 0")
    if not (math.isfinite(value) and value > 0):
        raise BallsInBinsError(f"{name}={value!r} is out of range; expected a finite float > 0")
    return float(value)


def _non_negative_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BallsInBinsError(f"{name}={value!r} is not a number; expected a float >= 0")
    if not (math.isfinite(value) and value >= 0):
        raise BallsInBinsError(f"{name}={value!r} is out of range; expected a finite float >= 0")
    return float(value)


def _probability(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < 1.0:
        raise BallsInBinsError(f"{name}={value!r} is out of range; expected a float in (0, 1)")
    return float(value)
