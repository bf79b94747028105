"""Privacy accounting for user-level DP: mechanism descriptions, accountants, calibration, ledger.

Entry points::

    from userdp.accounting import ElsMechanism, epsilon, calibrate_noise_multiplier
    eps = epsilon(ElsMechanism(noise_multiplier=1.0, sampling_prob=0.01, group_size=16),
                  steps=2000, delta=1e-6)

This package never imports torch.
"""

from userdp.accounting.api import (
    ACCOUNTANT_VERSION,
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    AccountantUnavailableError,
    NotComposableError,
    compose_delta,
    compose_epsilon,
    delta,
    epsilon,
    privacy_loss_distribution,
)
from userdp.accounting.calibration import (
    CalibrationError,
    calibrate_noise_multiplier,
    max_steps,
)
from userdp.accounting.mechanisms import (
    BallsInBinsMechanism,
    CorrelationSpec,
    ElsMechanism,
    GroupPrivacyMechanism,
    InvalidMechanismError,
    Mechanism,
    NoDpEventError,
    RandomizedClippingMechanism,
    UlsMechanism,
    dp_event,
    mechanism_from_dict,
)

__all__ = [
    "ACCOUNTANT_VERSION",
    "DEFAULT_VALUE_DISCRETIZATION_INTERVAL",
    "AccountantUnavailableError",
    "BallsInBinsMechanism",
    "CalibrationError",
    "CorrelationSpec",
    "ElsMechanism",
    "GroupPrivacyMechanism",
    "InvalidMechanismError",
    "Mechanism",
    "NoDpEventError",
    "NotComposableError",
    "RandomizedClippingMechanism",
    "UlsMechanism",
    "calibrate_noise_multiplier",
    "compose_delta",
    "compose_epsilon",
    "delta",
    "dp_event",
    "epsilon",
    "max_steps",
    "mechanism_from_dict",
    "privacy_loss_distribution",
]
