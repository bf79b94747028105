"""Strategy state goes through the coordinator's checkpoint format (JSON + safetensors, no pickle)
and resumes the same sampling, optimizer and correlated-noise stream, with fresh noise."""

from __future__ import annotations

import numpy as np
import torch
from userdp.server.checkpoint import load_latest, save_checkpoint
from userdp.strategies import Adam, UserLevelSampling
from userdp.strategies.adaptive_clipping import AdaptiveClipping
from userdp.strategies.dpftrl import BltDpFtrl
from userdp.strategies.unit_stats import UnitStats

USERS = tuple(f"u{i}" for i in range(200))


def _drive(strategy, steps, params):
    for t in range(steps):
        cohort = strategy.sample_cohort(t, USERS)
        summed = {k: torch.ones_like(v) for k, v in params.items()}
        release = strategy.privatize(t, summed, UnitStats(count=len(cohort)), cohort)
        strategy.server_update(params, release)


def _round_trip(tmp_path, state):
    save_checkpoint(tmp_path, step=3, model_version=3, ledger_entries=3, state={"strategy": state})
    return load_latest(tmp_path).state["strategy"]


def test_uls_adam_state_survives_checkpoint(tmp_path):
    def make():
        return UserLevelSampling(
            noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1, optimizer=Adam(0.01)
        )

    a = make()
    _drive(a, 3, {"w": torch.zeros(4, 2)})
    b = make()
    b.load_state_dict(_round_trip(tmp_path, a.state_dict()))
    assert b.sample_cohort(9, USERS).unit_ids == a.sample_cohort(9, USERS).unit_ids
    assert b.optimizer.steps == 3
    np.testing.assert_allclose(
        np.asarray(b.optimizer.slots["w"]["m"]), a.optimizer.slots["w"]["m"].numpy(), rtol=1e-6
    )


def test_blt_and_adaptive_state_survive_checkpoint(tmp_path):
    blt = BltDpFtrl(noise_multiplier=1.0, clip_norm=1.0, bins=4, epochs=3)
    params = {"w": torch.zeros(5)}
    _drive(blt, 3, params)
    restored = BltDpFtrl(noise_multiplier=1.0, clip_norm=1.0, bins=4, epochs=3, blt=blt.blt)
    restored.load_state_dict(_round_trip(tmp_path / "a", blt.state_dict()))
    assert restored.noise.next_step == 3 and len(restored.noise.buffers["w"]) == blt.blt.buffers
    restored.add_noise(3, {"w": torch.zeros(5)})  # continues the stream at step 3

    adaptive = AdaptiveClipping(
        clip_norm=0.5, count_stddev=3.0, noise_multiplier=1.0, sampling_prob=0.2
    )
    _drive(adaptive, 2, {"w": torch.zeros(3)})
    again = AdaptiveClipping(
        clip_norm=0.5, count_stddev=3.0, noise_multiplier=1.0, sampling_prob=0.2
    )
    again.load_state_dict(_round_trip(tmp_path / "b", adaptive.state_dict()))
    assert again.clip_norm == adaptive.clip_norm and len(again.history) == 2
