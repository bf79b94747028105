"""The sampling-free Rényi bound for balls-in-bins is an upper bound, in both directions.

:mod:`userdp.accounting.balls_in_bins_renyi` states ε for correlated noise from Rényi moments of
the dominating pair P = (1/b)·Σᵢ N(mᵢ, σ²I), Q = N(0, σ²I), summed over count vectors by a
dynamic program. Two checks against references computed here, independently of that program:

* the program's log moments, for each form it tries (each spread, straight and cyclic), are at
  least the exact sums over every tuple of bins (enumerated), for Gram matrices whose entries far
  from the diagonal, which the program bounds or keeps as wrap-around, are of both signs or all
  positive;
* for two- and three-mode pairs in the plane, the Rényi divergences by quadrature on a fine grid:
  the remove bound equals the true D_α(P‖Q), and each add bound (the program's harmonic one and
  the geometric-mean closed form) is at least the true D_α(Q‖P).

Quadrature tolerance: the integrands are Gaussian mixtures, for which the trapezoid sum on a
uniform grid converges faster than any power of the step (step 0.02σ here, the grid reaching ≥ 9σ
beyond every mode's tilted centre), so 10⁻⁶ relative covers the float sums.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy.special import logsumexp
from userdp.accounting import balls_in_bins_renyi as renyi

ORDERS = (2, 3, 5)
TOLERANCE = 1e-6


def enumerated_log_moment(gram: np.ndarray, sigma: float, k: int, sign: int) -> float:
    b = gram.shape[0]
    total = [
        (n @ gram @ n + sign * np.diag(gram) @ n) / (2 * sigma**2)
        for n in (np.bincount(t, minlength=b) for t in itertools.product(range(b), repeat=k))
    ]
    return float(logsumexp(total)) - k * math.log(b)


def _quadrature(modes: np.ndarray, sigma: float, alpha: int, direction: str) -> float:
    """D_α of the pair by a trapezoid sum on a grid in the plane (modes: 2×b)."""
    reach = 9 * sigma + alpha * float(np.abs(modes).max())
    grid = np.arange(-reach, reach, 0.02 * sigma)
    x, y = np.meshgrid(grid, grid)
    log_q = -(x**2 + y**2) / (2 * sigma**2)
    log_p = logsumexp(
        [-((x - m[0]) ** 2 + (y - m[1]) ** 2) / (2 * sigma**2) for m in modes.T], axis=0
    ) - math.log(modes.shape[1])
    top, bottom = (log_p, log_q) if direction == "remove" else (log_q, log_p)
    norm = math.log(2 * math.pi * sigma**2) - 2 * math.log(grid[1] - grid[0])
    return float(logsumexp(alpha * top + (1 - alpha) * bottom) - norm) / (alpha - 1)


def check_renyi_bound_covers_the_pair() -> None:
    rng = np.random.default_rng(7)
    mixed = rng.normal(size=(9, 6))
    positive = rng.random(size=(9, 6))
    ring = 3.0 * np.eye(7) + sum(  # a banded C's Gram matrix when bins repeat: cyclic
        weight * (np.roll(np.eye(7), shift, axis=1) + np.roll(np.eye(7), -shift, axis=1))
        for shift, weight in ((1, 1.5), (2, 0.8))
    )
    # far entries of both signs; all positive; only the wrap-around ones
    for gram in (mixed.T @ mixed, positive.T @ positive, ring):
        assert len(renyi.spreads(gram)) == 2
        forms = itertools.product(renyi.spreads(gram), (False, True), (-1, +1))
        for spread, cyclic, sign in forms:
            bound = renyi.banded_bound(gram, spread, cyclic)
            computed = renyi.log_moments(bound, 1.6, 4, sign)
            for k in range(5):
                exact = enumerated_log_moment(gram, 1.6, k, sign)
                assert computed[k] >= exact - TOLERANCE * abs(exact), (
                    f"the Rényi program's moment is below the exact sum over tuples: {k} bins, "
                    f"sign {sign}, spread {spread:.3g}, cyclic {cyclic}: {computed[k]:.9g} < "
                    f"{exact:.9g}"
                )
    for modes, sigma in (
        (np.array([[1.0, 0.0], [0.0, 1.0]]), 1.0),
        (np.array([[2.0, 0.0], [0.0, 2.0]]), 1.0),
        (np.array([[1.0, 0.6, 0.0], [0.0, 0.8, 1.0]]), 0.8),
    ):
        gram = modes.T @ modes
        bound = renyi.banded_bound(gram)
        remove = renyi.log_moments(bound, sigma, max(ORDERS), -1)
        add = renyi.log_moments(bound, sigma, max(ORDERS) - 1, +1)
        geometric = renyi.geometric_add_divergences(gram, sigma, np.array(ORDERS, dtype=float))
        for alpha, closed_form in zip(ORDERS, geometric, strict=True):
            true_remove = _quadrature(modes, sigma, alpha, "remove")
            true_add = _quadrature(modes, sigma, alpha, "add")
            stated_remove = remove[alpha] / (alpha - 1)
            stated_add = min(add[alpha - 1] / (alpha - 1), closed_form)
            assert abs(stated_remove - true_remove) <= TOLERANCE * true_remove, (
                f"the Rényi bound is not the pair's true remove divergence at α = {alpha}: "
                f"{stated_remove:.9g} against {true_remove:.9g}"
            )
            assert stated_add >= true_add * (1 - TOLERANCE), (
                f"the Rényi bound is below the pair's true add divergence at α = {alpha}: "
                f"{stated_add:.9g} < {true_add:.9g}"
            )
