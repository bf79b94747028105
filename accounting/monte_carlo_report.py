"""The privacy report's ε for a balls-in-bins run: certified, reproducible from the ledger.

The balls-in-bins accountant (:mod:`userdp.accounting.balls_in_bins`; Choquette-Choo et al.,
"Near Exact Privacy Amplification for Matrix Mechanisms", arXiv 2410.06266) is a Monte Carlo
estimate. Its point estimate ε̂ (the ε at which the estimated δ equals δ) is below the true ε about
half of the time, so it is not what a report may state as the guarantee. The report states instead
the ε certified by Estimate-Verify-Release (Wang et al. 2023; Theorem 2.1 of the paper above):

1. estimate: ε̂_c, the smallest ε whose estimated δ on the estimate samples is at most the
   calibration target (below δ by a KL-Chernoff confidence margin);
2. verify: (ε̂_c, δ) is tested on fresh samples; a value whose true δ exceeds δ passes with
   probability at most δ.

The samples are seeded from the ledger
(:func:`~userdp.accounting.ledger_format.ledger_seed`: its run id and the phase), so every
report of the same ledger (at the end of the run, ``userdp report``) draws the same samples and
states the same ε, and a failed check is not retried with new samples until one passes. The point
estimate is kept, labelled as an estimate, for comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from userdp.accounting import api, balls_in_bins
from userdp.accounting.calibration import certified_monte_carlo_epsilon
from userdp.accounting.ledger_format import ledger_seed
from userdp.accounting.mechanisms import BallsInBinsMechanism

__all__ = ["MonteCarloEpsilon", "monte_carlo_epsilon"]


@dataclass(frozen=True)
class MonteCarloEpsilon:
    """The ε of a balls-in-bins phase: ``epsilon`` certified by EVR (``math.inf`` when the check
    failed: nothing is certified) and ``estimate``, the Monte Carlo point estimate (NOT a
    guarantee); ``seed`` (decimal) and the sample counts make it reproducible."""

    epsilon: float
    estimate: float
    seed: str
    estimate_samples: int
    verify_samples: int
    calibration_target: float

    @property
    def certified(self) -> bool:
        return math.isfinite(self.epsilon)

    def to_dict(self) -> dict[str, Any]:
        return {
            "certified": self.certified,
            "epsilon_estimate": self.estimate,
            "seed": self.seed,
            "seed_source": "sha256 of the ledger's run id and the phase",
            "estimate_samples": self.estimate_samples,
            "verify_samples": self.verify_samples,
            "calibration_target_delta": self.calibration_target,
        }

    def caveat(self, delta: float) -> str:
        """What was computed, in the report's words."""
        if not self.certified:
            return (
                "The balls-in-bins Monte Carlo accountant could not certify ε: the "
                "Estimate-Verify-Release check failed on its fresh samples (about 1 % likely for "
                "a correct estimate), so this report states no ε (∞). The point estimate "
                f"ε ≈ {self.estimate:.4g} is NOT a guarantee. The run's noise multiplier was "
                "certified for the config's ε when it was calibrated."
            )
        return (
            "ε comes from the balls-in-bins Monte Carlo accountant, certified by "
            "Estimate-Verify-Release: it is the smallest ε whose δ estimated on "
            f"{self.estimate_samples:,} samples is at most {self.calibration_target:.3g} (below "
            f"δ = {delta:.3g} by a confidence margin), and it passed a test on "
            f"{self.verify_samples:,} fresh samples that a value whose true δ exceeds δ passes "
            "with probability at most δ. The samples are seeded from the ledger, so every "
            "report of this ledger states the same ε. The Monte Carlo point estimate, "
            f"ε ≈ {self.estimate:.4g}, is shown for comparison only: it is not a guarantee."
        )


def monte_carlo_epsilon(
    mechanism: BallsInBinsMechanism, steps: int, delta: float, run_id: str
) -> MonteCarloEpsilon:
    """The certified ε and the point estimate of ``steps`` steps of ``mechanism``, both on
    samples seeded by :func:`ledger_seed` (the certified value is cached on disk)."""
    seed = ledger_seed(run_id, mechanism, steps)
    certified = certified_monte_carlo_epsilon(mechanism, steps, delta, seed=seed)
    estimate = api.epsilon(mechanism, steps, delta, seed=seed)
    epochs = api.balls_in_bins_epochs(mechanism, steps)
    pair = balls_in_bins.dominating_pair(
        mechanism.bins,
        epochs,
        bin_semantics=mechanism.bin_semantics,
        correlation=mechanism.correlation,
    )
    estimate_draws, verify_draws = balls_in_bins.certified_draws(delta, pair.compositions)
    return MonteCarloEpsilon(
        epsilon=math.inf if certified is None else float(certified),
        estimate=float(estimate),
        seed=str(seed),
        estimate_samples=estimate_draws,
        verify_samples=verify_draws,
        calibration_target=balls_in_bins.calibration_target(
            delta, estimate_draws // pair.compositions
        ),
    )
