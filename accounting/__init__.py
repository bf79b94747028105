"""Privacy accounting for user-level DP: DpEvent builders, accountants, calibration, ledger.

This package never imports torch.
"""
