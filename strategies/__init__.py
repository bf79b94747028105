"""Strategies: the DP mechanism as one object (unit, sampler, clipping, noise, event)."""
