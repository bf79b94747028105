"""Privacy accounting for user-level DP: mechanism descriptions, accountants, calibration, ledger.

Entry points::

    from userdp.accounting import ElsMechanism, epsilon, calibrate_noise_multiplier
    eps = epsilon(ElsMechanism(noise_multiplier=1.0, sampling_prob=0.01, group_size=16),
                  steps=2000, delta=1e-6)

This package never imports torch. The names below are loaded on first use, so importing one
light module (e.g. ``userdp.accounting.mechanisms``) does not load dp_accounting and scipy.
"""

import importlib

# public name -> the module of this package that defines it
_EXPORTS = {
    "ACCOUNTANT_VERSION": "api",
    "DEFAULT_VALUE_DISCRETIZATION_INTERVAL": "api",
    "AccountantUnavailableError": "api",
    "NotComposableError": "api",
    "compose_delta": "api",
    "compose_epsilon": "api",
    "delta": "api",
    "epsilon": "api",
    "privacy_loss_distribution": "api",
    "CalibrationError": "calibration",
    "calibrate_noise_multiplier": "calibration",
    "max_steps": "calibration",
    "BallsInBinsMechanism": "mechanisms",
    "CorrelationSpec": "correlation_spec",
    "ElsMechanism": "mechanisms",
    "GroupPrivacyMechanism": "mechanisms",
    "InvalidMechanismError": "errors",
    "Mechanism": "mechanisms",
    "NoDpEventError": "mechanisms",
    "RandomizedClippingMechanism": "mechanisms",
    "UlsMechanism": "mechanisms",
    "dp_event": "mechanisms",
    "mechanism_from_dict": "mechanisms",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
