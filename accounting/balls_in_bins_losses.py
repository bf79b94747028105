"""The balls-in-bins dominating pair and its privacy-loss samples, the Monte Carlo core of
:mod:`userdp.accounting.balls_in_bins` (Choquette-Choo et al., "Near Exact Privacy Amplification
for Matrix Mechanisms").

Mechanism: every unit (user) lands in one uniformly random bin among ``bins``; step t of each
epoch uses bin t, and the run releases Cx + σz (equivalently x + σC⁻¹z), z ~ N(0, I), for a
non-negative lower-triangular C (``None`` = identity = DP-SGD), n = bins·epochs steps.

Two bin semantics, NOT interchangeable (the sampler and the accountant must agree):

* ``"fixed"`` — bins drawn once for the whole run (Def. 3.1 of that paper; the b-min-sep
  structure matrix mechanisms need). Its Lemma 3.2: dominated by the b-mode mixture
      P = (1/b) Σᵢ N(mᵢ, σ²Iₙ)  vs  Q = N(0, σ²Iₙ),   mᵢ = Σⱼ |C|[:, b·j + i].
* ``"per-epoch"`` — bins redrawn every epoch (random allocation, Chua et al., "Balls-and-Bins Sampling for DP-SGD").
  Only C = identity is supported: the epochs are then independent one-epoch mechanisms with
  orthonormal modes, so the run is dominated by the E-fold product of the one-epoch pair and the
  privacy loss is the SUM of E independent one-epoch losses (exact composition, sampled).
  With correlated noise the epochs are coupled and there are b^E patterns; no dominating pair
  is known here, so that combination raises :class:`UnsupportedBinSemanticsError`.
  The composition is estimated from one-epoch samples split into E independent groups
  (:mod:`userdp.accounting.composed_losses`): ``num_samples`` counts one-epoch draws, and the
  Chernoff bounds use ⌊num_samples/E⌋.

Sampling draws the paper's σ-independent samples X = m_k + σZ (its §4.1, Algorithm 2) through
the Gram matrix G = MᵀM: with k ~ Unif[b], W = MᵀZ ~ N(0, G),
    Y  = logsumexpᵢ((G[k,i] − G[i,i]/2)/σ² + Wᵢ/σ) − log b          (X ~ P, loss log P/Q)
    Y' = −(logsumexpᵢ(−G[i,i]/(2σ²) + Wᵢ/σ) − log b)                 (X ~ Q, loss log Q/P)
so after an O(n·b²) setup each sample costs O(b²) (O(b) for diagonal G), independent of n and
of the model size. Both directions are always sampled; each sample's W is shared by both.
A seed gives independent streams, children ``ESTIMATE`` (0) and ``VERIFY`` (1) of
``SeedSequence(seed)``, drawn again identically on every call (common random numbers).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits
from userdp.accounting import monte_carlo as mc
from userdp.accounting.composed_losses import ComposedLosses, GroupedHistogram
from userdp.accounting.correlation import (
    Correlation,
    CorrelationError,
    from_spec,
    min_sep_column,
)
from userdp.accounting.correlation_spec import CorrelationSpec
from userdp.accounting.validation import positive_int

__all__ = [
    "BIN_SEMANTICS",
    "ESTIMATE",
    "VERIFY",
    "BallsInBinsError",
    "DominatingPair",
    "LossSampler",
    "UnsupportedBinSemanticsError",
    "correlation_matrix",
    "dominating_pair",
    "matrix_modes",
    "toeplitz_modes",
]

BIN_SEMANTICS = ("fixed", "per-epoch")
_CHUNK_ELEMENTS = 2**23  # float32 entries per chunk of W (32 MiB)
_BLOCK_ELEMENTS = 2**17  # float32 entries per cache-sized block of a streamed chunk (512 KiB)
_THREADS = max(1, min(4, os.cpu_count() or 1))  # chunks computed in parallel (GIL released)
ESTIMATE, VERIFY = 0, 1


class BallsInBinsError(ValueError):
    """Bad input to the balls-in-bins accountant; the message names the parameter."""


class UnsupportedBinSemanticsError(BallsInBinsError):
    """``per-epoch`` bins with a non-identity correlation matrix have no accountant here."""


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

    @classmethod
    def of_modes(cls, modes: np.ndarray) -> DominatingPair:
        """The fixed-bins pair of modes M (n×b): Gram matrix MᵀM, one composition."""
        return cls(modes.T @ modes, 1, "fixed")

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
    bins = positive_int("bins", bins, BallsInBinsError)
    epochs = positive_int("epochs", epochs, BallsInBinsError)
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
    return DominatingPair.of_modes(matrix_modes(matrix, bins, epochs))


def matrix_modes(matrix: np.ndarray, bins: int, epochs: int) -> np.ndarray:
    """M (n×b): mode mᵢ = Σⱼ C[:, b·j + i] of a dense n×n C, n = bins·epochs (Lemma 3.2)."""
    n = bins * epochs
    return matrix.reshape(n, epochs, bins).sum(axis=1)  # column t = b·j + i → [:, j, i]


def toeplitz_modes(coefs: np.ndarray, bins: int, epochs: int) -> np.ndarray:
    """:func:`matrix_modes` of the Toeplitz C with first column ``coefs`` (n = bins·epochs
    entries) without forming C: mode 0 is :func:`~userdp.accounting.correlation.min_sep_column`
    and mode i is mode 0 shifted down by i rows, O(n·b) instead of O(n²) (the BLT optimizer of
    :mod:`userdp.strategies.blt_amplified` evaluates it hundreds of times)."""
    column = min_sep_column(np.asarray(coefs, dtype=np.float64), bins, epochs)
    n = len(column)
    modes = np.zeros((n, bins))
    for i in range(bins):
        modes[i:, i] = column[: n - i]
    return modes


class LossSampler:
    """Privacy-loss samples of a pair at any σ from FIXED randomness (common random numbers).

    The standard normals are regenerated chunk by chunk from per-chunk seeds, so the same
    object gives the same draws on every call without holding m·b floats in memory. Each of the
    ``num_samples`` draws is one copy of the pair (one epoch for per-epoch bins).
    """

    def __init__(self, pair: DominatingPair, num_samples: int, seed: Any, purpose: int) -> None:
        self.pair = pair
        self.num_samples = num_samples
        self.bins = pair.bins
        gram = pair.gram
        self.diag = np.diag(gram).astype(np.float64)
        # W = g @ factor: None = diagonal G (W = √diag · g); else the Cholesky factor Lᵀ of a
        # positive definite G, applied in place as a triangular product (half a dense matmul's
        # work), or an eigen-factor when G is singular.
        self.factor: np.ndarray | None = None
        self.lower: np.ndarray | None = None
        if np.count_nonzero(gram - np.diag(self.diag)) == 0:
            self.scale = np.sqrt(self.diag).astype(np.float32)
        else:
            try:
                self.lower = np.linalg.cholesky(gram)
                self.factor = self.lower.T.astype(np.float32)
            except np.linalg.LinAlgError:
                w, v = np.linalg.eigh(gram)
                self.factor = (v * np.sqrt(np.clip(w, 0.0, None))).T.astype(np.float32)
        root = _root_seed(seed)
        self.seed = _child(root, purpose)
        self.chunk = max(1, min(num_samples, _CHUNK_ELEMENTS // self.bins))

    def _modes(self, index: int) -> tuple[np.random.Generator, np.ndarray]:
        """Chunk ``index``'s generator, positioned after its mode indices k, and k."""
        n_chunks = math.ceil(self.num_samples / self.chunk)
        if not 0 <= index < n_chunks:
            raise IndexError(index)
        size = min(self.chunk, self.num_samples - index * self.chunk)
        # SFC64: a small-state generator that passes the same statistical batteries as numpy's
        # default PCG64 and feeds the float32 ziggurat about 1.3x faster (the draws dominate a
        # chunk's cost); the normals' law, tails included, is the ziggurat's either way.
        rng = np.random.Generator(np.random.SFC64(_child(self.seed, index)))
        return rng, rng.integers(0, self.bins, size=(1, size))

    def _normals(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``index`` of the fixed draws: mode indices k and standard normals g."""
        rng, k = self._modes(index)
        return k, rng.standard_normal((1, k.shape[1], self.bins), dtype=np.float32)

    def _chunk_losses(self, index: int, sigma: float) -> tuple[np.ndarray, np.ndarray]:
        """The losses of one copy of the pair, both directions, for chunk ``index`` at σ."""
        log_b = math.log(self.bins)
        if self.factor is None:
            # Diagonal G: X ~ P differs from the Q-row only at coordinate k, by G[k, k]/σ², so
            # its log-sum-exp follows from the Q-row's without a second pass over the b modes:
            #   lse(pos) = logaddexp(log Σ_{i≠k} e^{base_i}, base_k + G[k, k]/σ²),
            #   log Σ_{i≠k} e^{base_i} = lse(base) + log1p(−e^{base_k − lse(base)}).
            streamed = self._equal_diagonal_lse(index, sigma)
            if streamed is None:
                k, g = self._normals(index)
                streamed = (k, *self._diagonal_lse(k, g, sigma))
            k, base_k, lse_base = streamed
            with np.errstate(divide="ignore"):
                rest = lse_base + np.log1p(-np.exp(np.minimum(base_k - lse_base, 0.0)))
            lse_pos = np.logaddexp(rest, base_k + self.diag[k] / sigma**2)
            y_qp = -(lse_base[0] - log_b)
            y_pq = lse_pos[0] - log_b
        else:
            k, g = self._normals(index)
            lse_base, lse_pos = self._dense_lse(index, k, g, sigma)
            y_qp = -(lse_base - log_b)
            y_pq = lse_pos - log_b
        return y_pq, y_qp

    def _dense_lse(
        self, index: int, k: np.ndarray, g: np.ndarray, sigma: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(log Σ_i e^{base_i}, log Σ_i e^{pos_i}) in float64 for base = W/σ − diag/(2σ²) and
        pos = base + G[k]/σ² (a general Gram matrix); ``g`` is overwritten.

        Both sums share e^{W/σ}: Σ_i e^{base_i} = e^{W/σ}·a with aᵢ = e^{−Gᵢᵢ/(2σ²)}, and
        Σ_i e^{pos_i} = (e^{W/σ}·Bᵀ)[k] with B[k, i] = e^{G[k,i]/σ² − Gᵢᵢ/(2σ²)}: one exp pass and
        two products instead of two max-shifted log-sum-exps. The modes are taken sorted: k is
        independent of the i.i.d. rows of g, so pairing the sorted k with the rows in order has
        the same joint law, and the rows of one mode are contiguous (the second product is one
        matrix-vector product per mode, without a gather). When a weight or e^{W/σ} leaves
        float32's safe range, or a row sum is not a positive finite number, the chunk takes the
        max-shifted path on the same draws."""
        k = np.sort(k, axis=-1)
        gram = self.pair.gram
        shift = 0.5 * self.diag / sigma**2
        pos_logits = gram / sigma**2 - shift
        if max(float(pos_logits.max()), float((-shift).max())) < 60.0:
            w = self._correlated(g[0], sigma)
            weights = np.exp(pos_logits).astype(np.float32)
            p_sum = np.empty(w.shape[0], np.float32)
            starts = np.searchsorted(k[0], np.arange(self.bins + 1))
            with np.errstate(over="ignore", under="ignore"):
                np.exp(w, out=w)
                q_sum = w @ np.exp(-shift).astype(np.float32)
                for mode in np.flatnonzero(np.diff(starts)):
                    rows = slice(starts[mode], starts[mode + 1])
                    np.matmul(w[rows], weights[mode], out=p_sum[rows])
            ok = np.isfinite(q_sum) & np.isfinite(p_sum) & (q_sum > 1e-30) & (p_sum > 1e-30)
            if np.all(ok):
                return np.log(q_sum.astype(np.float64)), np.log(p_sum.astype(np.float64))
            g = self._normals(index)[1]  # the same draws again; k is unchanged
        base = self._correlated(g[0], sigma)[None]
        base -= shift.astype(np.float32)
        pos = base + (gram / sigma**2).astype(np.float32)[k]
        return _logsumexp_last(base)[0], _logsumexp_last(pos)[0]

    def _correlated(self, g: np.ndarray, sigma: float) -> np.ndarray:
        """W/σ = g @ factor / σ for one chunk's normals ``g`` (rows × b, C order): with the
        Cholesky factor, BLAS's triangular product in place on ``g`` (which is overwritten);
        else a dense product."""
        if self.lower is None:
            return np.matmul(g, (self.factor / np.float32(sigma)).astype(np.float32))
        # Imported here: scipy.linalg costs about 0.5 CPU-s of imports, and only correlated noise
        # (fixed bins) needs it.
        from scipy.linalg.blas import strmm

        lower = np.asfortranarray(self.lower / sigma, dtype=np.float32)
        # g's transpose is a Fortran-ordered b × rows matrix: Wᵀ = L·gᵀ, written over g.
        return strmm(1.0, lower, g.T, side=0, lower=1, overwrite_b=1).T

    def _equal_diagonal_lse(
        self, index: int, sigma: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(k, base_k, log Σ_i e^{base_i}) in float64 for base = √d·g/σ − d/(2σ²) when every
        diagonal entry equals d (fixed bins without correlation, per-epoch bins), else None, as
        when a row overflows (s·max g > 88; the caller then takes the max-shifted path). The
        shift is a constant c: lse(base) = log Σ_i e^{s·g_i} − c, one pass (draw, scale, exp,
        sum) over cache-sized blocks of rows drawn into one buffer: :meth:`_normals`'s draws (a
        generator's stream does not depend on how it is cut) without a chunk-sized array."""
        diag = self.diag
        if not (diag.size and np.all(diag == diag[0])):
            return None
        scale = float(np.sqrt(diag[0]) / sigma)
        shift = 0.5 * float(diag[0]) / sigma**2
        rng, k = self._modes(index)
        size = k.shape[1]
        g_k, total = np.empty(size), np.empty(size)
        block = np.empty((min(size, _BLOCK_ELEMENTS // self.bins), self.bins), np.float32)
        for start in range(0, size, block.shape[0]):
            rows = block[: min(block.shape[0], size - start)]
            span = slice(start, start + rows.shape[0])
            rng.standard_normal(dtype=np.float32, out=rows)
            g_k[span] = rows[np.arange(rows.shape[0]), k[0, span]]
            np.multiply(rows, np.float32(scale), out=rows)
            with np.errstate(over="ignore"):  # detected below: the chunk is redone
                np.exp(rows, out=rows)
            rows.sum(axis=-1, dtype=np.float64, out=total[span])
        if not (np.all(np.isfinite(total)) and np.all(total > 0.0)):
            return None
        return k, (scale * g_k - shift)[None], (np.log(total) - shift)[None]

    def _diagonal_lse(self, k: np.ndarray, g: np.ndarray, sigma: float) -> tuple:
        """(base_k, log Σ_i e^{base_i}) in float64 for base = √diag·g/σ − diag/(2σ²), max-shifted
        (any diagonal G; any draws); ``g`` is overwritten."""
        base = g
        base *= (self.scale / np.float32(sigma)).astype(np.float32)
        base -= (0.5 * self.diag / sigma**2).astype(np.float32)
        base_k = np.take_along_axis(base, k[..., None], -1)[..., 0].astype(np.float64)
        return base_k, _logsumexp_last(base)

    def _chunks(self, sigma: float, positive: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Chunk losses in chunk order, computed on up to ``_THREADS`` threads (numpy's
        generators and ufuncs release the GIL); each chunk has its own seed, so the output does
        not depend on the thread count. ``positive`` keeps only the losses > 0."""

        def run(i: int) -> tuple[np.ndarray, np.ndarray]:
            y_pq, y_qp = self._chunk_losses(i, sigma)
            return (y_pq[y_pq > 0.0], y_qp[y_qp > 0.0]) if positive else (y_pq, y_qp)

        n_chunks = math.ceil(self.num_samples / self.chunk)
        threads = max(1, min(_THREADS, n_chunks))
        if threads == 1:
            yield from (run(i) for i in range(n_chunks))
            return
        # One BLAS thread per chunk: the chunks already fill the cores, and BLAS's own threads on
        # top of them would contend for the same cores.
        with (
            threadpool_limits(limits=1, user_api="blas"),
            ThreadPoolExecutor(threads, thread_name_prefix="userdp-bib") as pool,
        ):
            yield from pool.map(run, range(n_chunks))

    def losses(self, sigma: float) -> tuple[np.ndarray, np.ndarray]:
        """The privacy-loss samples of one copy of the pair at σ, both directions: (H(P,Q) losses
        log P/Q under P, H(Q,P) losses log Q/P under Q); only the positive ones (Y > 0) when the
        pair is not composed. The two directions share W (each estimate is unbiased on its own;
        EVR tests each direction separately)."""
        parts = list(self._chunks(sigma, positive=self.pair.compositions == 1))
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def estimates_at(
        self, sigma: float, epsilon: float
    ) -> tuple[mc.StreamedDelta | ComposedLosses, ...]:
        """The δ̂ estimators of the pair at σ for the one ``epsilon`` that calibration and
        verification ask about: for a pair that is not composed, running sums of the terms per
        chunk, so memory stays O(chunk) whatever ``num_samples`` is (kept losses would take
        16 bytes a sample: tens of GB at the sample counts of δ = 1e-6); a composed pair's
        histograms are bounded already. Same draws, same δ̂ as :meth:`estimates` up to the
        summation order."""
        if self.pair.compositions != 1:
            return self.estimates(sigma)
        sums = np.zeros((2, 2))
        for part in self._chunks(sigma, positive=True):
            for row, y in zip(sums, part, strict=True):
                terms = mc.delta_terms(y, epsilon)
                row += (terms.sum(), np.square(terms).sum())
        return tuple(
            mc.StreamedDelta(epsilon, total, total_sq, self.num_samples) for total, total_sq in sums
        )

    def estimates(self, sigma: float) -> tuple[mc.SampledLosses | ComposedLosses, ...]:
        """The δ̂ estimators of the pair at σ, (H(P,Q), H(Q,P)): the sample mean when the pair
        is not composed, else the grouped composition of the one-copy losses."""
        if self.pair.compositions == 1:
            y_pq, y_qp = self.losses(sigma)
            return mc.SampledLosses(y_pq, self.num_samples), mc.SampledLosses(
                y_qp, self.num_samples
            )
        histograms = [GroupedHistogram(self.pair.compositions, self.num_samples) for _ in "pq"]
        for part in self._chunks(sigma, positive=False):
            for histogram, y in zip(histograms, part, strict=True):
                histogram.add(y)
        return histograms[0].finish(), histograms[1].finish()


def _logsumexp_last(logits: np.ndarray) -> np.ndarray:
    """logsumexp over the last axis, in float64 (exp in float32); overwrites ``logits``."""
    peak = logits.max(axis=-1, keepdims=True)
    logits -= peak
    np.exp(logits, out=logits)
    return np.log(logits.sum(axis=-1, dtype=np.float64)) + peak[..., 0]


def _root_seed(seed: Any) -> np.random.SeedSequence:
    """A SeedSequence for ``seed`` (None = fresh OS entropy, drawn once per call)."""
    return seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)


def _child(root: np.random.SeedSequence, index: int) -> np.random.SeedSequence:
    """The ``index``-th independent child of ``root``, deterministically (unlike ``spawn``,
    which advances a counter and would break common random numbers on a second call)."""
    return np.random.SeedSequence(root.entropy, spawn_key=(*root.spawn_key, index))
