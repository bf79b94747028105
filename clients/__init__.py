"""The worker: shard store, model engine, per-unit clipped gradients."""
