"""Privacy report: ε from the ledger, the sampling→assumptions table, atomic JSON/Markdown."""

import json

import pytest
from userdp.accounting import compose_epsilon
from userdp.accounting.ledger import Ledger
from userdp.accounting.mechanisms import GroupPrivacyMechanism, UlsMechanism
from userdp.accounting.report import (
    NON_PRIVATE_HYPERPARAMETERS_CAVEAT,
    SAMPLING_SCHEMES,
    assumptions,
    build_report,
    write_report,
)

ULS = UlsMechanism(noise_multiplier=1.0, sampling_prob=0.02)
ISSUE_8_FIELDS = {
    "epsilon", "delta", "mechanism", "unit", "sampling", "noise_multiplier", "steps",
    "expected_cohort_size", "clip_norm", "accounting_matches_sampling", "caveats",
}  # fmt: skip


@pytest.fixture
def ledger_path(tmp_path):
    path = tmp_path / "ledger.jsonl"
    with Ledger.create(path, budget_epsilon=10.0, delta=1e-5) as led:
        for step in range(1, 21):
            led.append(step, ULS)
    return path


# (sampling, unit) -> (adjacency, matches, words that must appear in the caveats)
TABLE = [
    ("poisson", "user", "add/remove one user", True, []),
    ("poisson", "example", "add/remove one example", True, []),
    ("shuffle", "user", "add/remove one user", False, ["does NOT hold", "Poisson"]),
    ("padding", "user", "zero-out one user", True, ["zero-out", "add/remove"]),
    ("balls-in-bins-fixed", "user", "add/remove one user", True, ["fixed for the whole run"]),
    ("balls-in-bins-epoch", "user", "add/remove one user", True, ["redrawn every epoch"]),
    ("cyclic-poisson", "user", "add/remove one user", True, ["fewer diagonals than"]),
]


@pytest.mark.parametrize(("sampling", "unit", "adjacency", "matches", "words"), TABLE)
def test_assumption_table(sampling, unit, adjacency, matches, words):
    got_adjacency, got_matches, caveats = assumptions(unit, sampling, ["uls"])
    assert (got_adjacency, got_matches) == (adjacency, matches)
    text = " ".join(caveats)
    assert all(w in text for w in words)
    assert NON_PRIVATE_HYPERPARAMETERS_CAVEAT in caveats


def test_table_covers_every_scheme():
    assert {row[0] for row in TABLE} == set(SAMPLING_SCHEMES)


def test_mechanism_caveats():
    _, _, caveats = assumptions("user", "poisson", ["group-privacy"])
    assert any("comparison only" in c for c in caveats)
    _, _, caveats = assumptions("user", "poisson", ["balls-in-bins"])
    assert any("Monte Carlo" in c for c in caveats)


def test_bad_inputs():
    with pytest.raises(ValueError, match="sampling='random'"):
        assumptions("user", "random", ["uls"])
    with pytest.raises(ValueError, match="unit='group'"):
        assumptions("group", "poisson", ["uls"])


def test_report_from_ledger(ledger_path, tmp_path):
    report = build_report(
        ledger_path, 1e-5, unit="user", sampling="poisson", clip_norm=1.0,
        expected_cohort_size=20.0, curve_points=4,
    )  # fmt: skip
    assert report.epsilon == pytest.approx(compose_epsilon([(ULS, 20)], 1e-5))
    assert report.steps == 20 and report.noise_multiplier == 1.0
    assert report.mechanism == ULS.to_dict() and report.budget_epsilon == 10.0
    assert [s for s, _ in report.epsilon_curve] == [5, 10, 15, 20]
    assert report.epsilon_curve[-1][1] == report.epsilon
    eps = [e for _, e in report.epsilon_curve]
    assert eps == sorted(eps)
    for steps, point in report.epsilon_curve[:-1]:  # coarser grid: an upper bound, close to ε
        fine = compose_epsilon([(ULS, steps)], 1e-5)
        assert fine <= point <= fine * 1.02
    json_path, md_path = write_report(report, tmp_path / "run")
    loaded = json.loads(json_path.read_text())
    assert ISSUE_8_FIELDS <= set(loaded)
    assert loaded["epsilon"] == report.epsilon and loaded["accounting_matches_sampling"] is True
    assert "ε = " in md_path.read_text()
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]


def test_shuffle_report_flags_it(ledger_path):
    report = build_report(ledger_path, 1e-5, unit="user", sampling="shuffle")
    assert report.accounting_matches_sampling is False
    md = report.to_markdown()
    assert "DOES NOT HOLD" in md.splitlines()[2]
    assert md.index("## Caveats") < md.index("## Parameters")


def test_group_privacy_report(tmp_path):
    path = tmp_path / "ledger.jsonl"
    mech = GroupPrivacyMechanism(noise_multiplier=2.0, sampling_prob=0.01, group_size=2)
    with Ledger.create(path) as led:
        for step in range(1, 4):
            led.append(step, mech)
    report = build_report(path, 1e-5, unit="user", sampling="poisson")
    assert any("comparison only" in c for c in report.caveats)
    # with the strategy's own caveats, as a run's report adds them: the comparison said once
    from userdp.strategies.builtins import GroupPrivacyComparison

    strategy = GroupPrivacyComparison(
        noise_multiplier=2.0, clip_norm=1.0, sampling_prob=0.01, group_size=2
    )
    report = build_report(
        path,
        1e-5,
        unit="user",
        sampling="poisson",
        extra_caveats=strategy.facts().caveats,
    )
    assert (
        sum("group-privacy" in c.lower() or "group privacy" in c.lower() for c in report.caveats)
        == 1
    )


def test_empty_ledger_refused(tmp_path):
    path = tmp_path / "ledger.jsonl"
    Ledger.create(path).close()
    with pytest.raises(ValueError, match="no released steps"):
        build_report(path, 1e-5, unit="user", sampling="poisson")


def test_balls_in_bins_semantics_must_match_sampling(tmp_path):
    from userdp.accounting.mechanisms import BallsInBinsMechanism

    path = tmp_path / "ledger.jsonl"
    mech = BallsInBinsMechanism(noise_multiplier=2.0, bins=4, epochs=1, bin_semantics="fixed")
    with Ledger.create(path) as led:
        led.append(1, mech)
    for sampling in ("poisson", "balls-in-bins-epoch"):
        with pytest.raises(ValueError, match="bin_semantics='fixed'"):
            build_report(path, 1e-5, unit="user", sampling=sampling)


def test_delta_is_shown_next_to_one_over_n_with_a_warning_when_large(ledger_path):
    """With 174 training users, the papers' δ = 1/N^1.1 ≈ 0.0034 ≈ 1/291 is not small next to 1/N."""
    n = 174
    delta = 1.0 / n**1.1
    report = build_report(ledger_path, delta, unit="user", sampling="poisson", training_users=n)
    (warning,) = [c for c in report.caveats if "1/(10·N)" in c]
    assert "N = 174 training users" in warning and "≈ 1/291" in warning
    markdown = report.to_markdown()
    assert "N = 174 training users (1/N = 0.00575; 1/(10·N) = 0.000575)" in markdown
    assert report.to_dict()["training_users"] == n
    small = build_report(ledger_path, 1e-6, unit="user", sampling="poisson", training_users=n)
    assert not [c for c in small.caveats if "1/(10·N)" in c]
    assert not [
        c
        for c in build_report(ledger_path, delta, unit="user", sampling="poisson").caveats
        if "1/(10·N)" in c
    ]


@pytest.mark.parametrize(
    ("secure", "row"),
    [
        (True, "| noise generator | secure: AES-256-CTR keystream"),
        (False, "| noise generator | fast floating-point (numpy PCG64 / torch), not protected"),
        (None, "| noise generator | not stated by the strategy |"),
    ],
)
def test_report_names_the_noise_generator(ledger_path, secure, row):
    report = build_report(ledger_path, 1e-6, unit="user", sampling="poisson", secure_noise=secure)
    assert row in report.to_markdown()
    assert report.to_dict()["secure_noise"] is secure


def test_clipping_summary_says_what_clip_fractions_mean() -> None:
    from userdp.run.report import clipping_summary

    every = clipping_summary([{"clip_fraction": 1.0}] * 3, 0.5)
    assert every.startswith(
        "Over 3 steps, 100% of the sampled units had an update norm above C = 0.5"
    )
    assert "Every unit was clipped in every step" in every
    none = clipping_summary([{"clip_fraction": 0.0}, {"clip_fraction": None}], 2.0)
    assert "No unit was clipped" in none and "Over 1 steps" in none
    mixed = clipping_summary([{"clip_fraction": 0.25}, {"clip_fraction": 0.75}], 1.0)
    assert "50% of the sampled units" in mixed and "(per step: 25% to 75%)" in mixed
    assert "Every unit" not in mixed and "No unit" not in mixed
    assert clipping_summary([], 1.0) is None


def test_the_step_records_decide_which_noise_the_report_names(tmp_path):
    """A run that switched to fast noise part-way (e.g. resumed with privacy.secure_noise =
    false) is reported as not secure whatever the last strategy says, with the step count."""
    path = tmp_path / "ledger.jsonl"
    with Ledger.create(path, budget_epsilon=10.0, delta=1e-5) as led:
        for step, mode in enumerate(("secure", "secure", "fast", "test"), start=1):
            led.append(step, ULS, noise=mode)
    from userdp.accounting.facts import FAST_NOISE_CAVEAT as stated_fast

    report = build_report(
        path,
        1e-6,
        unit="user",
        sampling="poisson",
        secure_noise=True,
        extra_caveats=(stated_fast,),
    )
    assert report.secure_noise is False
    assert any(
        c.startswith("1 of 4 released steps drew fast floating-point") for c in report.caveats
    )
    assert any(
        c.startswith("1 of 4 released steps drew noise from a fixed test seed")
        for c in report.caveats
    )
    assert stated_fast not in report.caveats  # replaced by the per-step count
    with pytest.raises(ValueError, match="noise='loud' is not allowed"):
        with Ledger.open(path) as led:
            led.append(9, ULS, noise="loud")


def test_records_without_a_noise_field_leave_the_strategys_statement(ledger_path):
    for stated in (True, False, None):
        report = build_report(
            ledger_path, 1e-6, unit="user", sampling="poisson", secure_noise=stated
        )
        assert report.secure_noise is stated


def test_all_secure_records_give_a_secure_report_with_no_noise_caveat(tmp_path):
    path = tmp_path / "ledger.jsonl"
    with Ledger.create(path, budget_epsilon=10.0, delta=1e-5) as led:
        for step in range(1, 4):
            led.append(step, ULS, noise="secure")
    report = build_report(path, 1e-6, unit="user", sampling="poisson", secure_noise=None)
    assert report.secure_noise is True
    assert not [c for c in report.caveats if "released steps drew" in c]


def test_user_wise_filter_is_reported_under_replace_one_adjacency():
    adjacency, matches, caveats = assumptions("user", "poisson", ["user-wise-filter"])
    assert adjacency == "replace one user (N public)" and matches
    assert any("adding or removing a user" in c for c in caveats)
    assert assumptions("user", "poisson", ["uls"])[0] == "add/remove one user"


BANDED = {"name": "banded", "params": {"coefs": [1.0, 0.5]}}


def _balls_in_bins_ledger(path, run_id=None, correlation=None):
    from userdp.accounting.mechanisms import BallsInBinsMechanism

    mech = BallsInBinsMechanism(
        noise_multiplier=2.0, bins=2, epochs=3, bin_semantics="fixed", correlation=correlation
    )
    with Ledger.create(path, run_id=run_id) as led:
        for step in range(5):
            led.append(step, mech)
    return mech


def test_balls_in_bins_report_states_the_certified_epsilon_reproducibly(tmp_path, monkeypatch):
    """The report's ε is the smallest certified bound of the query, the same on every report of
    the ledger and of any ledger of the same mechanism and steps (it is a function of the query:
    recomputed from a cold cache it is identical), it names the method that gave it and lists
    the others, and its ε curve is certified bounds too (monotone)."""
    from userdp.accounting import balls_in_bins
    from userdp.accounting.balls_in_bins_certified import certified_epsilon, query_seed

    monkeypatch.setenv("USERDP_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "ledger.jsonl"
    mech = _balls_in_bins_ledger(path, correlation=BANDED)
    delta = 1e-3
    first = build_report(path, delta, unit="user", sampling="balls-in-bins-fixed", curve_points=3)
    monkeypatch.setenv("USERDP_CACHE_DIR", str(tmp_path / "cold-cache"))  # recomputed, not read
    second = build_report(path, delta, unit="user", sampling="balls-in-bins-fixed", curve_points=3)
    assert first.epsilon == second.epsilon and first.epsilon_curve == second.epsilon_curve
    certified = certified_epsilon(mech, 3, delta)
    assert first.certification == certified.to_dict() and first.epsilon == certified.epsilon
    assert certified.method == "Monte Carlo EVR" and certified.seed == str(
        query_seed(mech, 3, 1e-3)
    )
    assert first.epsilon == balls_in_bins.certified_epsilon(
        2.0, 2, 3, delta, bin_semantics="fixed", correlation=BANDED, seed=int(certified.seed)
    )
    assert first.epsilon < certified.candidates["no amplification"]
    curve = [e for _, e in first.epsilon_curve]
    assert curve == sorted(curve) and curve[-1] == first.epsilon
    markdown = first.to_markdown()
    assert "## Balls-in-bins accountant (certified upper bounds on ε)" in markdown
    assert f"| Monte Carlo EVR | {first.epsilon:.4g} | stated |" in markdown
    (caveat,) = [c for c in first.caveats if "smallest certified upper bound" in c]
    assert "No Monte Carlo point estimate is stated as ε" in caveat
    other = tmp_path / "other.jsonl"
    _balls_in_bins_ledger(other, correlation=BANDED)
    third = build_report(other, delta, unit="user", sampling="balls-in-bins-fixed")
    assert third.epsilon == first.epsilon


def test_balls_in_bins_report_without_a_passing_check_states_the_other_bounds(
    tmp_path, monkeypatch
):
    """When the Monte Carlo fresh-sample check fails, the report states the smallest of the
    other certified bounds and says why Monte Carlo gave none; it never falls back to the point
    estimate or retries with new samples."""
    from userdp.accounting import balls_in_bins

    calls = []

    def failed_check(*args, seed, **kwargs):
        calls.append(seed)
        raise balls_in_bins.VerificationFailedError("the check failed")

    monkeypatch.setenv("USERDP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(balls_in_bins, "certified_epsilon", failed_check)
    path = tmp_path / "ledger.jsonl"
    _balls_in_bins_ledger(path, correlation=BANDED)
    report = build_report(path, 1e-3, unit="user", sampling="balls-in-bins-fixed")
    c = report.certification
    assert len(calls) == 1 and c["candidates"]["Monte Carlo EVR"] is None
    assert c["method"] == "no amplification" and report.epsilon == c["candidates"][c["method"]]
    assert "the fresh-sample check failed" in c["skipped"]["Monte Carlo EVR"]
    assert "| Monte Carlo EVR | n/a | the fresh-sample check failed" in report.to_markdown()
