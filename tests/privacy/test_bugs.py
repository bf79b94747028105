"""Bug-catching tests for user-level DP, with a mutation check (the bug classes of "Finding Private
Bugs: Debugging Implementations of Differentially Private Stochastic Gradient Descent", taken to
user-level DP and to userdp's coordinator, sampler and ledger).

Two tests per row of :data:`CASES`:

* ``test_check_passes_on_the_real_code``: every check passes on userdp as it is;
* ``test_mutation_is_caught``: with ONE classic bug injected into the real code path (a fixture of
  ``mutations.py``), the same check raises AssertionError whose message names the failed property.

So each test below can fail, and is shown to fail for the bug it exists to catch. The table is the
contract: :data:`REQUIRED_BUGS` lists the bugs that must be caught, and
``test_every_required_bug_is_caught`` fails when one of them has no row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest

from . import checks_budget as budget
from . import checks_calibration as calibration
from . import checks_clipping as clipping
from . import checks_collective as collective
from . import checks_coordinator as coordinator
from . import checks_gather as gather
from . import checks_hf as hf
from . import checks_model_noise as model_noise
from . import checks_noise as noise
from . import checks_pld as pld
from . import checks_randomized as randomized
from . import checks_renyi as renyi
from . import checks_run_epsilon as run_epsilon
from . import checks_sampling as sampling
from . import checks_tensor_cores as tensor_cores
from . import checks_user_filter as user_filter


def _no_tmp(check: Callable[[], None]) -> Callable[[object], None]:
    return lambda tmp_path: check()


CHECKS: dict[str, Callable[[object], None]] = {
    **{
        f"engine_{engine}_{name}": _no_tmp(partial(check, engine))
        for engine in ("loop", "vectorized")
        for name, check in (
            ("bounds_each_unit", clipping.check_engine_bounds_each_unit_by_clip_norm),
            ("clips_before_summing", clipping.check_engine_clips_each_unit_before_summing),
            ("clips_user_mean", clipping.check_engine_clips_user_mean_not_examples),
            ("clips_at_the_clip_norm", clipping.check_engine_clips_at_the_clip_norm_exactly),
        )
    },
    "noise_magnitude_uls": _no_tmp(partial(noise.check_noise_magnitude, "uls")),
    "noise_magnitude_els": _no_tmp(partial(noise.check_noise_magnitude, "els")),
    "noise_magnitude_blt": _no_tmp(partial(noise.check_noise_magnitude, "blt")),
    "noise_adaptive_clipping": _no_tmp(noise.check_adaptive_clipping_noise),
    "noise_every_tensor_lora": _no_tmp(
        partial(model_noise.check_noise_on_every_trainable_tensor, 4)
    ),
    "noise_every_tensor_full": _no_tmp(
        partial(model_noise.check_noise_on_every_trainable_tensor, 0)
    ),
    "noise_secure_on_grid": _no_tmp(noise.check_production_noise_is_secure_and_on_grid),
    "noise_generator_reported": _no_tmp(noise.check_report_names_the_noise_generator),
    "noise_fresh_across_steps": _no_tmp(noise.check_noise_fresh_across_steps),
    "noise_fresh_on_retry": _no_tmp(noise.check_noise_fresh_on_retry),
    "noise_fresh_after_resume": _no_tmp(noise.check_noise_fresh_after_resume),
    "exactly_once_gather": _no_tmp(gather.check_exactly_once_under_retries),
    "unclipped_partial_rejected": _no_tmp(gather.check_unclipped_partial_is_rejected),
    "unclipped_partial_rejected_rc": _no_tmp(
        gather.check_unclipped_partial_is_rejected_under_randomized_clipping
    ),
    "coordinator_noise_magnitude": coordinator.check_coordinator_noise_magnitude,
    "coordinator_exactly_once": coordinator.check_coordinator_counts_each_unit_once,
    "coordinator_resume_fresh_noise": coordinator.check_coordinator_resume_draws_fresh_noise,
    "coordinator_uls_resume_no_rerelease": coordinator.check_coordinator_uls_resume_never_rereleases,
    **{
        f"{name}_collective": partial(check, collective=True)
        for name, check in (
            ("coordinator_noise_magnitude", coordinator.check_coordinator_noise_magnitude),
            ("coordinator_exactly_once", coordinator.check_coordinator_counts_each_unit_once),
            (
                "coordinator_resume_fresh_noise",
                coordinator.check_coordinator_resume_draws_fresh_noise,
            ),
            (
                "coordinator_uls_resume_no_rerelease",
                coordinator.check_coordinator_uls_resume_never_rereleases,
            ),
        )
    },
    "collective_member_unclipped": collective.check_collective_refuses_a_member_that_does_not_clip,
    "coordinator_replay_commitment": coordinator.check_coordinator_replay_commits_a_fresh_release,
    "uls_sampler_matches_accountant": _no_tmp(sampling.check_uls_sampler_matches_accountant),
    "els_sampler_matches_accountant": _no_tmp(sampling.check_els_sampler_matches_accountant),
    "els_ranked_sampler_matches_accountant": _no_tmp(
        partial(sampling.check_els_sampler_matches_accountant, "longest")
    ),
    "ledger_epsilon_matches_run": sampling.check_ledger_epsilon_matches_steps_run,
    "unaccounted_sampling_flagged": _no_tmp(sampling.check_unaccounted_sampling_is_flagged),
    "config_calibration_matches_run": sampling.check_config_calibration_matches_run,
    "sampler_seed_secret": sampling.check_sampler_seed_is_secret_unless_given,
    "report_epsilon_uls": partial(sampling.check_report_epsilon_matches_dp_accounting, "uls"),
    "report_epsilon_els": partial(sampling.check_report_epsilon_matches_dp_accounting, "els"),
    "report_epsilon_blt": sampling.check_blt_report_epsilon_matches_quadrature,
    "report_epsilon_per_epoch": sampling.check_per_epoch_report_epsilon_composes_every_epoch,
    "banded_poisson_epsilon": _no_tmp(sampling.check_banded_poisson_epsilon_matches_the_mechanism),
    "user_filter_noise_magnitude": _no_tmp(user_filter.check_user_filter_noise_magnitude),
    "user_filter_above_threshold_halting": _no_tmp(
        user_filter.check_above_threshold_halting_probability
    ),
    "user_filter_ledger_epsilon": _no_tmp(user_filter.check_user_filter_ledger_epsilon),
    "rc_accountant_tail_probes_hutchinson": _no_tmp(
        partial(randomized.check_accountant_gets_the_engines_tail_probes, "hutchinson")
    ),
    "rc_accountant_tail_probes_hutchpp": _no_tmp(
        partial(randomized.check_accountant_gets_the_engines_tail_probes, "hutch++")
    ),
    "budget_before_work_inprocess": budget.check_inprocess_budget_stops_before_sampling,
    "budget_before_work_coordinator": budget.check_coordinator_budget_stops_before_tasks,
    "engine_tensor_core_margin": _no_tmp(
        tensor_cores.check_tensor_core_margin_covers_accumulation_error
    ),
    "engine_clip_factor_rounding": _no_tmp(
        tensor_cores.check_clip_factor_rounding_is_on_the_safe_side
    ),
    "engine_split_book_keeping_product": _no_tmp(
        tensor_cores.check_split_book_keeping_product_within_its_bound
    ),
    "fast_pld_repair_raises_delta": _no_tmp(pld.check_fast_pld_repair_raises_delta),
    "renyi_bound_covers_the_pair": _no_tmp(renyi.check_renyi_bound_covers_the_pair),
    **{
        f"calibrated_noise_{name.split(':')[-1].lower()}": partial(
            calibration.check_calibrated_noise_follows_the_ledger, name
        )
        for name in calibration.STRATEGIES
    },
    "calibrated_noise_user_wise_filter": (
        calibration.check_calibrated_user_filter_noise_follows_the_ledger
    ),
    "calibration_delta_is_the_reports": calibration.check_calibration_delta_is_the_reports,
    "run_states_one_certified_epsilon": run_epsilon.check_run_states_one_certified_epsilon,
    "trainer_sampling": hf.check_trainer_samples_poisson_cohorts_at_the_ledgers_q,
    "trainer_noise_magnitude": hf.check_trainer_update_carries_the_calibrated_noise,
    "trainer_ledger_before_optimizer": hf.check_trainer_charges_each_step_before_its_optimizer_step,
}


@dataclass(frozen=True)
class Case:
    bug: str
    check: str
    mutation: str
    message: str
    """Regex the check's AssertionError must match (the property it reports as broken)."""


NOISE_STD = r"noise std is"
NO_NOISE = r"noise std is \S+ but the mechanism requires \S+ \(ratio 0\.0000;"
REUSED = r"IDENTICAL|correlated"
TWICE = r"counted twice"


def _cases(bug: str, mutation: str, message: str, *checks: str) -> list[Case]:
    return [Case(bug, check, mutation, message) for check in checks]


CASES: list[Case] = [
    # --- per-unit clipping in the worker engine (R1, R2, R5) -----------------------------------
    *_cases(
        "missing clipping",
        "mutation_engine_does_not_clip",
        r"missing clipping",
        "engine_loop_bounds_each_unit",
        "engine_vectorized_bounds_each_unit",
    ),
    *_cases(
        "clipping after averaging (batch-level)",
        "mutation_engine_clips_after_summing",
        r"clipping after summing/averaging",
        "engine_loop_clips_before_summing",
        "engine_vectorized_clips_before_summing",
    ),
    *_cases(
        "ULS clipping per example instead of per user",
        "mutation_engine_clips_per_example",
        r"clipped per example instead of once per user",
        "engine_loop_clips_user_mean",
        "engine_vectorized_clips_user_mean",
    ),
    *_cases(
        "ULS clipping per example instead of per user",
        "mutation_engine_averages_clipped_examples",
        r"clipped per example instead of once per user",
        "engine_loop_clips_user_mean",
    ),
    # --- noise magnitude: exact χ² test of the released update's std (R4, R8) ------------------
    *_cases(
        "noise not scaled by C",
        "mutation_noise_not_scaled_by_clip",
        NOISE_STD,
        "noise_magnitude_uls",
        "noise_magnitude_blt",
        "coordinator_noise_magnitude",
        "coordinator_noise_magnitude_collective",
    ),
    *_cases(
        "noise added more than once",
        "mutation_noise_added_twice",
        NOISE_STD,
        "noise_magnitude_uls",
        "coordinator_noise_magnitude",
        "coordinator_noise_magnitude_collective",
    ),
    *_cases(
        "noise std σ² instead of σ",
        "mutation_noise_std_sigma_squared",
        NOISE_STD,
        "noise_magnitude_uls",
        "noise_magnitude_els",
    ),
    *_cases(
        "noise std off by √B",
        "mutation_noise_std_times_sqrt_cohort",
        NOISE_STD,
        "noise_magnitude_uls",
        "noise_magnitude_els",
        "coordinator_noise_magnitude",
    ),
    *_cases(
        "noise std off by 1/B",
        "mutation_noise_std_over_cohort",
        NOISE_STD,
        "noise_magnitude_uls",
        "noise_magnitude_blt",
    ),
    *_cases(
        "noise normalized by realized instead of expected cohort",
        "mutation_normalize_by_realized_cohort",
        NOISE_STD,
        "noise_magnitude_uls",
        "noise_magnitude_els",
        "coordinator_noise_magnitude",
        "coordinator_noise_magnitude_collective",
    ),
    *_cases(
        "missing noise",
        "mutation_no_noise",
        NO_NOISE,
        "noise_magnitude_uls",
        "coordinator_noise_magnitude",
        "coordinator_noise_magnitude_collective",
    ),
    *_cases(
        "correlated (BLT) noise drawn iid",
        "mutation_blt_noise_not_correlated",
        NOISE_STD,
        "noise_magnitude_blt",
    ),
    *_cases(
        "adaptive clipping: sum noise not σ_Δ",
        "mutation_adaptive_sum_noise_uses_z",
        r"adaptive clipping sum.*noise std is",
        "noise_adaptive_clipping",
    ),
    *_cases(
        "adaptive clipping: count released without noise",
        "mutation_adaptive_count_without_noise",
        r"adaptive clipping count.*" + NO_NOISE.removeprefix("noise std is "),
        "noise_adaptive_clipping",
    ),
    # --- noise on every trainable tensor --------------------------------------------------------
    *_cases(
        "noise missing on some parameters",
        "mutation_noise_skips_zero_sum_tensors",
        NO_NOISE,
        "noise_every_tensor_lora",
    ),
    *_cases(
        "noise missing on some parameters",
        "mutation_noise_only_on_matrices",
        NO_NOISE,
        "noise_every_tensor_full",
        "coordinator_noise_magnitude",
    ),
    # --- secure noise ---------------------------------------------------------------------------
    *_cases(
        "noise released in raw floating point",
        "mutation_noise_off_grid",
        r"off the grid",
        "noise_secure_on_grid",
    ),
    *_cases(
        "noise released in raw floating point",
        "mutation_noisy_scalar_off_grid",
        r"noisy count .* is off the grid",
        "noise_secure_on_grid",
    ),
    *_cases(
        "noise released in raw floating point",
        "mutation_fast_noise_by_default",
        r"off the grid",
        "noise_secure_on_grid",
    ),
    *_cases(
        "report misstates the noise generator",
        "mutation_facts_claim_secure_noise",
        r"the report must name the noise it got",
        "noise_generator_reported",
    ),
    # --- fresh noise ----------------------------------------------------------------------------
    *_cases(
        "noise reused across steps",
        "mutation_noise_generator_reseeded_identically",
        REUSED,
        "noise_fresh_across_steps",
        "noise_fresh_on_retry",
    ),
    *_cases(
        "noise reused on retry",
        "mutation_noise_seeded_by_step",
        REUSED,
        "noise_fresh_on_retry",
    ),
    *_cases(
        "noise reused after resume",
        "mutation_noise_seeded_by_step",
        REUSED,
        "noise_fresh_after_resume",
        "coordinator_resume_fresh_noise",
        "coordinator_resume_fresh_noise_collective",
    ),
    *_cases(
        "noise reused after resume",
        "mutation_replay_reuses_discarded_noise",
        REUSED,
        "coordinator_replay_commitment",
        "coordinator_resume_fresh_noise",
    ),
    *_cases(
        "noise reused after resume",
        "mutation_noise_seeded_by_step",
        REUSED,
        "coordinator_replay_commitment",
    ),
    *_cases(
        "noise reused after resume",
        "mutation_noise_seed_from_config",
        REUSED,
        "noise_fresh_after_resume",
        "coordinator_resume_fresh_noise",
    ),
    *_cases(
        "released step replayed after resume",
        "mutation_resume_replays_released_step",
        r"released twice after resume",
        "coordinator_uls_resume_no_rerelease",
        "coordinator_uls_resume_no_rerelease_collective",
    ),
    # --- exactly once, clipping enforced at the coordinator ------------------------------------
    *_cases(
        "unit counted twice on retry",
        "mutation_duplicate_discard_disabled",
        TWICE,
        "exactly_once_gather",
        "coordinator_exactly_once",
    ),
    *_cases(
        "unit counted twice on retry",
        "mutation_reduce_takes_every_held_sum",
        TWICE,
        "coordinator_exactly_once_collective",
    ),
    *_cases(
        "unit counted twice on retry",
        "mutation_closed_task_results_accepted",
        TWICE,
        "exactly_once_gather",
    ),
    *_cases(
        "missing clipping",
        "mutation_unclipped_partial_accepted",
        r"a worker that does not clip",
        "unclipped_partial_rejected",
    ),
    *_cases(
        "missing clipping",
        "mutation_collective_checks_only_the_total",
        r"a worker that does not clip hid in the others' slack",
        "collective_member_unclipped",
    ),
    *_cases(
        "missing clipping",
        "mutation_estimated_norms_unchecked",
        r"must still refuse a worker that does not clip",
        "unclipped_partial_rejected_rc",
    ),
    # --- sampling vs accounting -----------------------------------------------------------------
    *_cases(
        "sampler inclusion probability ≠ accountant q",
        "mutation_sampler_q_differs",
        r"the accountant \(ledger mechanism\) is told q",
        "uls_sampler_matches_accountant",
    ),
    *_cases(
        "sampler inclusion probability ≠ accountant q",
        "mutation_mechanism_reports_wrong_q",
        r"the accountant \(ledger mechanism\) is told q",
        "uls_sampler_matches_accountant",
    ),
    *_cases(
        "sampler not fresh every step",
        "mutation_sampler_frozen_cohort",
        r"not iid Binomial",
        "uls_sampler_matches_accountant",
    ),
    *_cases(
        "fixed-size sampling accounted as Poisson",
        "mutation_sampler_fixed_size",
        r"are not Binomial",
        "uls_sampler_matches_accountant",
    ),
    *_cases(
        "fixed-size sampling accounted as Poisson",
        "mutation_shuffle_claims_poisson_accounting",
        r"claims the Poisson accountant matches it; expected False",
        "unaccounted_sampling_flagged",
    ),
    *_cases(
        "ELS user contributes more than G examples",
        "mutation_els_dsub_redrawn_each_step",
        r"distinct examples",
        "els_sampler_matches_accountant",
        "els_ranked_sampler_matches_accountant",
    ),
    *_cases(
        "ELS user contributes more than G examples",
        "mutation_els_ranked_dsub_takes_every_record",
        r"distinct examples",
        "els_ranked_sampler_matches_accountant",
    ),
    *_cases(
        "ELS accounted at example level",
        "mutation_els_accounted_as_example_level",
        r"distinct examples",
        "els_sampler_matches_accountant",
    ),
    *_cases(
        "accountant given wrong steps",
        "mutation_accountant_drops_a_step",
        r"dp_accounting's PLD accountant gives",
        "ledger_epsilon_matches_run",
    ),
    *_cases(
        "accountant given wrong steps",
        "mutation_ledger_skips_first_step",
        r"every release must be charged exactly once",
        "ledger_epsilon_matches_run",
    ),
    *_cases(
        "accountant given wrong steps",
        "mutation_accountant_drops_a_step",
        r"the report says ε",
        "report_epsilon_uls",
        "report_epsilon_els",
        "report_epsilon_blt",
        "report_epsilon_per_epoch",
    ),
    *_cases(
        "accountant given wrong steps",
        "mutation_per_epoch_composes_one_epoch_fewer",
        r"did not compose every epoch",
        "report_epsilon_per_epoch",
    ),
    *_cases(
        "accountant given wrong noise correlation",
        "mutation_banded_poisson_ignores_column_norm",
        r"wrong noise correlation or rounds",
        "banded_poisson_epsilon",
    ),
    *_cases(
        "accountant given wrong noise correlation",
        "mutation_blt_mechanism_without_correlation",
        r"the report says ε",
        "report_epsilon_blt",
    ),
    *_cases(
        "ELS accounted at example level",
        "mutation_els_accounted_as_example_level",
        r"the report says ε",
        "report_epsilon_els",
    ),
    *_cases(
        "accountant given wrong q",
        "mutation_mechanism_reports_wrong_q",
        r"but the run used",
        "ledger_epsilon_matches_run",
    ),
    *_cases(
        "accountant given wrong q",
        "mutation_mechanism_reports_wrong_q",
        r"the accountant is given the wrong q",
        "config_calibration_matches_run",
    ),
    *_cases(
        "sampler seed derived from the public output.seed",
        "mutation_sampler_seeded_by_output_seed",
        r"must be seeded secretly",
        "sampler_seed_secret",
    ),
    *_cases(
        "accountant given wrong steps",
        "mutation_calibration_for_fewer_steps",
        r"calibration was given the wrong steps or q",
        "config_calibration_matches_run",
    ),
    # --- user-wise DP-SGD with filter (Asi & Liu) ------------------------------------------------
    *_cases(
        "user-wise filter: noise std missing √(8 log(e^ε T/δ))",
        "mutation_user_filter_noise_without_log_factor",
        r"filtered mean: noise std is",
        "user_filter_noise_magnitude",
    ),
    *_cases(
        "AboveThreshold noise too small for its ε",
        "mutation_above_threshold_noise_halved",
        r"AboveThreshold halted .* its noise is too small or too large",
        "user_filter_above_threshold_halting",
    ),
    *_cases(
        "AboveThreshold noise too small for its ε",
        "mutation_concentration_sensitivity_over_n",
        r"AboveThreshold halted .* its noise is too small or too large",
        "user_filter_above_threshold_halting",
    ),
    *_cases(
        "accountant omits AboveThreshold's ε",
        "mutation_user_filter_accountant_drops_above_threshold",
        r"AboveThreshold's ε/2",
        "user_filter_ledger_epsilon",
    ),
    # --- randomized clipping, the budget check, the tensor-core margin --------------------------
    *_cases(
        "accountant given more probes than the norm estimate's tail",
        "mutation_hutchpp_total_probes_to_accountant",
        r"the accountant \(ledger mechanism\) is told k = 12 probes, but the engine's norm "
        r"estimate has 6 tail probes",
        "rc_accountant_tail_probes_hutchpp",
    ),
    *_cases(
        "accountant given more probes than the norm estimate's tail",
        "mutation_task_halves_probes",
        r"the accountant \(ledger mechanism\) is told k = 6 probes, but the engine's norm "
        r"estimate has 3 tail probes",
        "rc_accountant_tail_probes_hutchinson",
        "rc_accountant_tail_probes_hutchpp",
    ),
    *_cases(
        "budget checked only after the step's work",
        "mutation_budget_checked_only_at_append",
        r"the budget must be checked before the step's cohort is sampled",
        "budget_before_work_inprocess",
        "budget_before_work_coordinator",
    ),
    *_cases(
        "report states an uncertified Monte Carlo estimate as its ε",
        "mutation_report_states_point_estimate",
        r"the report states an uncertified estimate",
        "report_epsilon_blt",
    ),
    *_cases(
        "report states an uncertified Monte Carlo estimate as its ε",
        "mutation_report_states_point_estimate",
        r"the run states an uncertified estimate",
        "run_states_one_certified_epsilon",
    ),
    *_cases(
        "a run states an ε other than its ledger's certified ε",
        "mutation_run_states_point_estimate",
        r"the run states an uncertified estimate or a second ε",
        "run_states_one_certified_epsilon",
    ),
    *_cases(
        "tensor-core norms clipped without their rounding bound",
        "mutation_tensor_core_margin_dropped",
        r"the engine.s rounding bound does not cover the model",
        "engine_tensor_core_margin",
    ),
    # --- calibration reaches the noise and the δ ---------------------------------------------
    *_cases(
        "noise does not follow calibration",
        "mutation_adaptive_sigma_delta_fixed_at_construction",
        r"noise that does not follow calibration",
        "calibrated_noise_adaptive-clipping",
    ),
    *_cases(
        "noise does not follow calibration",
        "mutation_noise_std_fixed_at_construction",
        r"noise that does not follow calibration",
        "calibrated_noise_uls",
        "calibrated_noise_els",
        "calibrated_noise_group-privacy",
        "calibrated_noise_dp-fedavg",
        "calibrated_noise_randomized-clipping",
        "calibrated_noise_blt-dp-ftrl",
        "calibrated_noise_warmupuls",
    ),
    *_cases(
        "noise does not follow calibration",
        "mutation_user_filter_sigma_fixed_at_construction",
        r"noise that does not follow calibration",
        "calibrated_noise_user_wise_filter",
    ),
    *_cases(
        "calibration at a δ other than the run's",
        "mutation_calibration_at_default_delta",
        r"σ was calibrated at a δ other than the one the report states",
        "calibration_delta_is_the_reports",
    ),
    # --- slack in the clip, rounding margins, the split product -------------------------------
    *_cases(
        "slack in the clip",
        "mutation_clip_factor_slack",
        r"slack in the clip",
        "engine_loop_clips_at_the_clip_norm",
        "engine_vectorized_clips_at_the_clip_norm",
    ),
    *_cases(
        "rounding margin in the wrong direction",
        "mutation_clip_factor_rounding_flipped",
        r"rounding margin is applied in the wrong direction",
        "engine_clip_factor_rounding",
    ),
    *_cases(
        "rounding margin in the wrong direction",
        "mutation_pld_repair_lowers_delta",
        r"repair of δ\(ε\) lowers δ",
        "fast_pld_repair_raises_delta",
    ),
    *_cases(
        "accountant bound below the true divergence",
        "mutation_renyi_add_as_remove",
        r"the Rényi program's moment is below the exact sum over tuples: \d bins, sign 1",
        "renyi_bound_covers_the_pair",
    ),
    *_cases(
        "accountant bound below the true divergence",
        "mutation_renyi_spread_not_charged",
        r"the Rényi program's moment is below the exact sum over tuples: \d bins, sign -?1, "
        r"spread (?!0,)[0-9.]+",
        "renyi_bound_covers_the_pair",
    ),
    *_cases(
        "accountant bound below the true divergence",
        "mutation_renyi_wrap_not_charged",
        r"the Rényi program's moment is below the exact sum over tuples: .* cyclic True",
        "renyi_bound_covers_the_pair",
    ),
    *_cases(
        "accountant bound below the true divergence",
        "mutation_renyi_geometric_add_drops_norm_term",
        r"the Rényi bound is below the pair's true add divergence",
        "renyi_bound_covers_the_pair",
    ),
    *_cases(
        "accountant bound below the true divergence",
        "mutation_renyi_drops_far_entries",
        r"the Rényi program's moment is below the exact sum",
        "renyi_bound_covers_the_pair",
    ),
    *_cases(
        "tensor-core book-keeping split product incomplete",
        "mutation_split_product_drops_remainder",
        r"split product of R·c is incomplete",
        "engine_split_book_keeping_product",
    ),
    # --- the Hugging Face Trainer path (userdp.hf) ---------------------------------------------
    *_cases(
        "sampler inclusion probability ≠ accountant q",
        "mutation_sampler_q_differs",
        r"UserDPTrainer: .*the accountant \(ledger mechanism\) is told q",
        "trainer_sampling",
    ),
    *_cases(
        "sampler not fresh every step",
        "mutation_sampler_frozen_cohort",
        r"UserDPTrainer: .*not iid Binomial",
        "trainer_sampling",
    ),
    *_cases(
        "fixed-size sampling accounted as Poisson",
        "mutation_sampler_fixed_size",
        r"UserDPTrainer: .*are not Binomial",
        "trainer_sampling",
    ),
    *_cases(
        "noise not scaled by C",
        "mutation_noise_not_scaled_by_clip",
        NOISE_STD,
        "trainer_noise_magnitude",
    ),
    *_cases("missing noise", "mutation_no_noise", NO_NOISE, "trainer_noise_magnitude"),
    *_cases(
        "noise normalized by realized instead of expected cohort",
        "mutation_normalize_by_realized_cohort",
        NOISE_STD,
        "trainer_noise_magnitude",
    ),
    *_cases(
        "step applied before the ledger charges it",
        "mutation_ledger_skips_first_step",
        r"ledger before release: when the Trainer's optimizer applied step 0",
        "trainer_ledger_before_optimizer",
    ),
]

REQUIRED_BUGS = frozenset(
    {
        "accountant bound below the true divergence",
        "missing clipping",
        "clipping after averaging (batch-level)",
        "ULS clipping per example instead of per user",
        "noise not scaled by C",
        "noise normalized by realized instead of expected cohort",
        "noise std off by √B",
        "noise std off by 1/B",
        "noise std σ² instead of σ",
        "noise added more than once",
        "noise missing on some parameters",
        "noise reused across steps",
        "noise reused on retry",
        "noise reused after resume",
        "unit counted twice on retry",
        "sampler inclusion probability ≠ accountant q",
        "accountant given wrong steps",
        "accountant given wrong q",
        "adaptive clipping: sum noise not σ_Δ",
        "adaptive clipping: count released without noise",
        "released step replayed after resume",
        "sampler seed derived from the public output.seed",
        "noise released in raw floating point",
        "report misstates the noise generator",
        "accountant given wrong noise correlation",
        "user-wise filter: noise std missing √(8 log(e^ε T/δ))",
        "AboveThreshold noise too small for its ε",
        "accountant omits AboveThreshold's ε",
        "accountant given more probes than the norm estimate's tail",
        "budget checked only after the step's work",
        "tensor-core norms clipped without their rounding bound",
        "report states an uncertified Monte Carlo estimate as its ε",
        "noise does not follow calibration",
        "a run states an ε other than its ledger's certified ε",
        "calibration at a δ other than the run's",
        "slack in the clip",
        "rounding margin in the wrong direction",
        "tensor-core book-keeping split product incomplete",
        "step applied before the ledger charges it",
    }
)


def _case_id(case: Case) -> str:
    return f"{case.check}-{case.mutation.removeprefix('mutation_')}"


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_check_passes_on_the_real_code(name, tmp_path):
    CHECKS[name](tmp_path)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_mutation_is_caught(case, request, tmp_path, monkeypatch):
    # a mutated accountant must never write its answers into the shared on-disk cache
    monkeypatch.setenv("USERDP_CACHE_DIR", str(tmp_path / "mutated-cache"))
    request.getfixturevalue(case.mutation)  # inject the bug (monkeypatch, undone afterwards)
    with pytest.raises(AssertionError, match=case.message):
        CHECKS[case.check](tmp_path)


def test_every_required_bug_is_caught():
    covered = {case.bug for case in CASES}
    missing = sorted(REQUIRED_BUGS - covered)
    assert not missing, f"no check with a mutation test for: {missing}"
    unused = sorted(set(CHECKS) - {case.check for case in CASES})
    assert not unused, f"checks without a mutation proving they can fail: {unused}"
