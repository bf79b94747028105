"""Ledger: durability, hash chain, truncation, step order, budget, lock, and re-accounting."""

import dp_accounting
import pytest
from userdp.accounting import compose_epsilon
from userdp.accounting import ledger as ledger_module
from userdp.accounting.ledger import (
    BudgetExceededError,
    Ledger,
    LedgerCorruptError,
    LedgerLockedError,
    LedgerTruncatedError,
    StepOrderError,
    read_ledger,
)
from userdp.accounting.mechanisms import UlsMechanism

ULS = UlsMechanism(noise_multiplier=1.0, sampling_prob=0.01)


def _write(path, steps=3, mechanism=ULS):
    with Ledger.create(path) as led:
        for step in range(1, steps + 1):
            led.append(step, mechanism)


def test_round_trip(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _write(path, steps=3)
    with Ledger.open(path) as led:
        assert led.last_step == 3 and led.steps == 3
        assert led.phases() == [(ULS, 3)]
        assert all(r["mechanism"] == ULS.to_dict() for r in led.records)
        led.append(4, ULS)
    header, records = read_ledger(path)
    assert header["schema_version"] == 1 and [r["step"] for r in records] == [1, 2, 3, 4]


def test_every_write_is_fsynced(tmp_path, monkeypatch):
    calls = []
    real = ledger_module.os.fsync
    monkeypatch.setattr(ledger_module.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    path = tmp_path / "ledger.jsonl"
    led = Ledger.create(path)
    assert len(calls) == 2  # header file + directory
    led.append(1, ULS)
    led.append(2, ULS)
    assert len(calls) == 4
    led.close()


@pytest.mark.parametrize("line_index", [0, 1, 2, 3])
def test_tampering_any_line_is_detected(tmp_path, line_index):
    path = tmp_path / "ledger.jsonl"
    _write(path, steps=3)
    lines = path.read_text().splitlines(keepends=True)
    lines[line_index] = lines[line_index].replace(
        '"noise_multiplier":1.0', '"noise_multiplier":2.0'
    )
    if line_index == 0:
        lines[0] = lines[0].replace('"budget_delta":null', '"budget_delta":0.5')
    path.write_text("".join(lines))
    with pytest.raises(LedgerCorruptError, match=f"line {line_index + 1}"):
        Ledger.open(path)


def test_deleted_line_breaks_chain(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _write(path, steps=3)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2] + lines[3:]))
    with pytest.raises(LedgerCorruptError, match="line 3.*chain"):
        Ledger.open(path)


def test_truncated_last_line_is_reported_not_dropped(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _write(path, steps=2)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"type":"step","step":3,"mech')
    with pytest.raises(
        LedgerTruncatedError, match="line 4 is incomplete.*userdp ledger repair RUN_DIR"
    ):
        Ledger.open(path)
    assert path.read_bytes().endswith(b'"mech')  # untouched
    with pytest.raises(LedgerTruncatedError):
        read_ledger(path)
    with Ledger.open(path, repair_truncated_tail=True) as led:
        assert led.last_step == 2
        led.append(3, ULS)
    assert read_ledger(path)[1][-1]["step"] == 3


def test_complete_but_invalid_last_line_is_corruption(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _write(path, steps=1)
    path.write_bytes(path.read_bytes() + b"garbage\n")
    with pytest.raises(LedgerCorruptError, match="line 3"):
        Ledger.open(path, repair_truncated_tail=True)


@pytest.mark.parametrize("bad_step", [3, 2, 0])
def test_non_increasing_step_refused(tmp_path, bad_step):
    path = tmp_path / "ledger.jsonl"
    _write(path, steps=3)
    before = path.read_bytes()
    with Ledger.open(path) as led, pytest.raises(StepOrderError, match="after the last"):
        led.append(bad_step, ULS)
    assert path.read_bytes() == before


def test_budget_refused_before_append(tmp_path):
    path = tmp_path / "ledger.jsonl"
    mech = UlsMechanism(noise_multiplier=0.8, sampling_prob=0.1)
    eps_10 = compose_epsilon([(mech, 10)], 1e-5)
    eps_11 = compose_epsilon([(mech, 11)], 1e-5)
    budget = (eps_10 + eps_11) / 2
    with Ledger.create(path, budget_epsilon=budget, delta=1e-5) as led:
        for step in range(1, 11):
            led.append(step, mech)
        before = path.read_bytes()
        with pytest.raises(BudgetExceededError, match="over the budget") as info:
            led.append(11, mech)
        assert f"{eps_11:.6g}" in str(info.value) and f"{eps_10:.6g}" in str(info.value)
        assert path.read_bytes() == before and led.last_step == 10
        with pytest.raises(BudgetExceededError):
            led.check_budget(mech)


def test_budget_cannot_change_on_reopen(tmp_path):
    path = tmp_path / "ledger.jsonl"
    Ledger.create(path, budget_epsilon=1.0, delta=1e-5).close()
    with pytest.raises(ValueError, match="cannot change"):
        Ledger.open(path, budget_epsilon=2.0, delta=1e-5)
    Ledger.open(path, budget_epsilon=1.0, delta=1e-5).close()


def test_spent_matches_dp_accounting_poisson_gaussian(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _write(path, steps=50, mechanism=UlsMechanism(noise_multiplier=1.1, sampling_prob=0.02))
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, 50))
    expected = accountant.get_epsilon(1e-5)
    with Ledger.open(path) as led:
        assert led.spent(1e-5) == pytest.approx(expected, rel=1e-3)


def test_two_phases_compose(tmp_path):
    path = tmp_path / "ledger.jsonl"
    a = UlsMechanism(noise_multiplier=1.0, sampling_prob=0.02)
    b = UlsMechanism(noise_multiplier=2.0, sampling_prob=0.02)
    with Ledger.create(path) as led:
        for step in range(1, 21):
            led.append(step, a if step <= 10 else b)
        assert led.phases() == [(a, 10), (b, 10)]
        spent = led.spent(1e-5)
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    for sigma in (1.0, 2.0):
        event = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(sigma))
        accountant.compose(dp_accounting.SelfComposedDpEvent(event, 10))
    assert spent == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)
    assert compose_epsilon([(a, 10)], 1e-5) < spent


def test_lock_prevents_second_writer(tmp_path):
    path = tmp_path / "ledger.jsonl"
    first = Ledger.create(path)
    with pytest.raises(LedgerLockedError, match="another writer"):
        Ledger.open(path)
    first.close()
    Ledger.open(path).close()


def test_create_refuses_existing(tmp_path):
    path = tmp_path / "ledger.jsonl"
    Ledger.create(path).close()
    with pytest.raises(FileExistsError):
        Ledger.create(path)


def test_budget_certificates_make_the_check_logarithmic_and_refuse_at_the_same_step(
    tmp_path, monkeypatch
):
    from userdp.accounting import max_steps

    mech = UlsMechanism(noise_multiplier=1.5, sampling_prob=0.02)
    budget, delta = 1.0, 1e-5
    last_ok = max_steps(mech, budget, delta, use_cache=False)
    assert 100 < last_ok < 500  # 268
    calls = []
    real = ledger_module.compose_epsilon
    monkeypatch.setattr(
        ledger_module, "compose_epsilon", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    with Ledger.create(tmp_path / "ledger.jsonl", budget_epsilon=budget, delta=delta) as led:
        for step in range(1, last_ok + 1):
            bound = led.check_budget(mech)
            assert bound <= budget
            if step % 37 == 1:  # the certified bound is an upper bound on the exact ε
                assert real([(mech, step)], delta) <= bound
            led.append(step, mech)
        assert len(calls) < 4 * last_ok.bit_length() + 4  # O(log T) accountant calls, not T
        with pytest.raises(BudgetExceededError, match="over the budget"):
            led.append(last_ok + 1, mech)  # the exact check still refuses the first bad step
        assert led.last_step == last_ok


def test_budget_certificate_is_per_phase(tmp_path):
    loud, quiet = UlsMechanism(1.0, 0.05), UlsMechanism(0.6, 0.05)
    delta = 1e-5
    budget = compose_epsilon([(loud, 30), (quiet, 3)], delta) * 1.001
    with Ledger.create(tmp_path / "ledger.jsonl", budget_epsilon=budget, delta=delta) as led:
        for step in range(1, 31):
            led.append(step, loud)  # certifies counts of `loud` far beyond 30
        for step in range(31, 34):
            led.append(step, quiet)  # a new phase: its own (exact-then-certified) checks
        with pytest.raises(BudgetExceededError):
            led.append(34, quiet)
        assert led.spent(delta) <= budget


def test_the_append_reuses_the_check_made_on_the_same_ledger_state(tmp_path, monkeypatch):
    """The step checks its budget before any work and its append checks again on the unchanged
    ledger: the whole-run accountant (balls-in-bins, no certificates) runs once per step."""
    from userdp.accounting.mechanisms import BallsInBinsMechanism

    mech = BallsInBinsMechanism(2.0, 4, 2, "fixed")
    calls = []
    real = ledger_module.compose_epsilon
    monkeypatch.setattr(
        ledger_module, "compose_epsilon", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    with Ledger.create(tmp_path / "ledger.jsonl", budget_epsilon=100.0, delta=1e-5) as led:
        for step in range(3):
            assert 0 < led.check_budget(mech) <= 100.0
            led.append(step, mech)
        assert len(calls) == 3  # one exact accounting per step, not two
        with pytest.raises(StepOrderError):
            led.append(2, mech)
    with Ledger.create(tmp_path / "tight.jsonl", budget_epsilon=1e-3, delta=1e-5) as led:
        with pytest.raises(BudgetExceededError):
            led.check_budget(mech)
        with pytest.raises(BudgetExceededError):
            led.append(0, mech)  # a refused check is never remembered as passed


def test_balls_in_bins_epsilon_is_the_certified_bound_of_the_query(tmp_path):
    """The ledger's own ε of a balls-in-bins phase (its budget check, ``spent``) is the certified
    bound of the query (mechanism, epochs, δ): asking again gives the same answer (a refused step
    cannot pass later), ``epsilon_after`` asks what the report will once the step is charged, and
    it is never the Monte Carlo point estimate."""
    from userdp.accounting.balls_in_bins_certified import certified_epsilon
    from userdp.accounting.mechanisms import BallsInBinsMechanism

    mech = BallsInBinsMechanism(noise_multiplier=2.0, bins=2, epochs=3, bin_semantics="fixed")
    with Ledger.create(tmp_path / "ledger.jsonl", budget_epsilon=1e3, delta=1e-3) as ledger:
        for step in range(3):
            ledger.append(step, mech)
        stated = certified_epsilon(mech, 2, 1e-3).epsilon
        assert ledger.spent(1e-3) == ledger.spent(1e-3) == stated
        after = ledger.epsilon_after(mech, 1e-3)
        assert after == certified_epsilon(mech, 2, 1e-3).epsilon  # step 4 is still epoch 2
        ledger.append(3, mech)
        assert ledger.spent(1e-3) == after
        assert ledger.epsilon_after(mech, 1e-3) > after  # epoch 3
