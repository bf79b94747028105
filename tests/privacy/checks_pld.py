"""The fast PLD builder's monotone repair of δ(ε) keeps every δ an upper bound.

:func:`userdp.accounting.fast_pld.mixture_gaussian_deltas` evaluates the hockey-stick curve
δ(ε) on a grid and then makes it non-increasing, as the true curve is, before the connect-the-dots
PMF is built from it (Doroshenko et al., "Connect the Dots: Tighter Discrete Approximations of
Privacy Loss Distributions", Thm. 3.2, needs each δ_i ≥ the true δ(ε_i)). Rounding can make the
computed values rise somewhere; the repair must RAISE the earlier values to the later ones (a
reversed running maximum), never lower the later values to the earlier ones (a forward running
minimum), which would put δ below what was computed, and so below the true curve.

Real mixtures give rises at the level of float rounding only, too small for a δ-versus-reference
check to tell the two repairs apart. The check therefore drives the builder's real code path with
an ADVERSARIAL curve: the CDF evaluations are replaced so that the values the builder computes
before its repair are a known zigzag (rises of 10⁻³), and every value it returns must be at least
the value it computed there, and the returned curve non-increasing.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
from dp_accounting.pld import privacy_loss_mechanism as plm
from userdp.accounting import fast_pld

POINTS = 512


def _zigzag(n: int) -> np.ndarray:
    """A decreasing curve from 0.5 with rises of 10⁻³ at every other point."""
    i = np.arange(n)
    return 0.5 * (1 - i / n) + 1e-3 * (i % 2)


def check_fast_pld_repair_raises_delta() -> None:
    loss = plm.MixtureGaussianPrivacyLoss(
        1.0,
        [0.0, 1.0],
        [0.9, 0.1],
        pessimistic_estimate=True,
        adjacency_type=plm.AdjacencyType.REMOVE,
    )
    epsilons = np.linspace(0.1, 3.0, POINTS)  # all above log(1 − q): every ε is inverted
    raw = _zigzag(POINTS)

    def cdfs(loss, x):  # δ = upper − e^ε·e^(log lower) = upper when log lower = −∞
        assert x.size == POINTS, "precondition: one chunk"
        return raw.copy(), np.full(x.size, -np.inf)

    with mock.patch.object(fast_pld, "_cdfs", cdfs):
        deltas = fast_pld.mixture_gaussian_deltas(loss, epsilons)
    below = np.flatnonzero(deltas < raw)
    assert below.size == 0, (
        f"the fast PLD builder returns δ = {deltas[below[0]]:.6g} at ε = "
        f"{epsilons[below[0]]:.4g} where it computed {raw[below[0]]:.6g} ({below.size} of "
        f"{POINTS} values lowered): the monotone repair of δ(ε) lowers δ instead of raising it"
    )
    assert np.all(np.diff(deltas) <= 0), "the repaired δ(ε) is not non-increasing"
