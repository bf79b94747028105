"""A user-level DP strategy plugin: DP-FedSGD whose server learning rate warms up linearly.

Named in a config as ``[strategy] name = "warmup_uls:WarmupUls"`` (this file next to the config).
The sampler says who contributes (users, each with probability q) and is checkpointed by the base
class; ``mechanism()`` is what the ledger records for every step; the warm-up is post-processing
of the noisy release, so it costs no privacy and the mechanism is the plain ULS one.
"""

from userdp.accounting.mechanisms import UlsMechanism
from userdp.strategies import PoissonSampler, Sgd, Strategy


class WarmupUls(Strategy):
    def __init__(
        self,
        *,
        noise_multiplier,  # σ: userdp passes it, calibrated to privacy.epsilon
        clip_norm,  # C, from [strategy] clip_norm
        sampling_prob,  # q, from [strategy] sampling_prob
        learning_rate,  # from [strategy.params]
        warmup_steps=10,  # from [strategy.params]
        seed=None,  # [strategy] sampler_seed; None = a secret seed from os.urandom
    ):
        super().__init__(
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            sampler=PoissonSampler(sampling_prob, seed),
            optimizer=Sgd(learning_rate),
        )
        self.peak_lr = learning_rate
        self.warmup_steps = warmup_steps

    def mechanism(self):
        return UlsMechanism(self.noise_multiplier, self.sampler.sampling_prob)

    def server_update(self, params, release):
        warm = min(1.0, (release.step + 1) / self.warmup_steps)
        self.optimizer.learning_rate = self.peak_lr * warm
        super().server_update(params, release)
