"""The ledger under storage faults: a failed append leaves the file as it was and refuses more
appends until reopened; a torn line is repaired by ``userdp ledger repair`` (never a complete
record); ``userdp ledger verify`` checks the chain, the release journal and the report."""

from __future__ import annotations

import errno
import json

import pytest
from userdp.accounting import ledger as ledger_module
from userdp.accounting.ledger import (
    Ledger,
    LedgerCorruptError,
    LedgerTruncatedError,
    LedgerWriteError,
    read_ledger,
    repair_ledger,
)
from userdp.accounting.ledger_format import ReportStaleError, check_report_current
from userdp.accounting.mechanisms import UlsMechanism
from userdp.accounting.report import build_report, write_report

from userdp.cli import main
from userdp.config import parse_config
from userdp.run.outputs import config_toml, write_release_state

ULS = UlsMechanism(noise_multiplier=2.0, sampling_prob=0.05)


def _run_dir(tmp_path, steps=3):
    """A run folder: a ledger of ``steps`` steps and the config.toml ``userdp report`` reads."""
    with Ledger.create(tmp_path / "ledger.jsonl", budget_epsilon=50.0, delta=1e-5) as led:
        for step in range(steps):
            led.append(step, ULS)
    config = parse_config({"privacy": {"delta": 1e-5, "noise_multiplier": 2.0}})
    (tmp_path / "config.toml").write_text(config_toml(config))
    return tmp_path


def _disk_full_after(monkeypatch, nbytes):
    """os.write in the ledger writes ``nbytes`` of the record, then fails like a full disk."""
    real = ledger_module.os.write

    def write(fd, data):
        if nbytes <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, bytes(data[:nbytes]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ledger_module.os, "write", write)


def _cli(args, capsys) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out.strip(), captured.err.strip()


def test_a_failed_append_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    run = _run_dir(tmp_path)
    path = run / "ledger.jsonl"
    before = path.read_bytes()
    led = Ledger.open(path)
    _disk_full_after(monkeypatch, 40)  # a partial record reaches the file, then ENOSPC
    with pytest.raises(LedgerWriteError, match="No space left on device.*as it was before"):
        led.append(3, ULS)
    monkeypatch.undo()  # space is freed
    assert path.read_bytes() == before
    with pytest.raises(LedgerWriteError, match="an earlier append failed.*reopen"):
        led.append(3, ULS)  # the same object never retries into a torn file
    assert path.read_bytes() == before and led.steps == 3
    led.close()
    with Ledger.open(path) as again:
        again.append(3, ULS)
    assert [r["step"] for r in read_ledger(path)[1]] == [0, 1, 2, 3]


def test_a_torn_line_is_refused_then_repaired_by_the_cli(tmp_path, monkeypatch, capsys):
    run = _run_dir(tmp_path)
    path = run / "ledger.jsonl"
    before = path.read_bytes()
    led = Ledger.open(path)
    _disk_full_after(monkeypatch, 25)
    monkeypatch.setattr(
        ledger_module.os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(OSError(errno.EIO, "x"))
    )
    with pytest.raises(LedgerWriteError, match="userdp ledger repair RUN_DIR"):
        led.append(3, ULS)  # the undo failed too: a process killed mid-write looks like this
    monkeypatch.undo()
    led.close()
    assert path.read_bytes() != before and not path.read_bytes().endswith(b"\n")
    with pytest.raises(LedgerTruncatedError, match="userdp ledger repair RUN_DIR"):
        Ledger.open(path)
    code, _, err = _cli(["ledger", "verify", str(run)], capsys)
    assert code == 2 and "userdp ledger repair" in err and len(err.splitlines()) == 1
    code, _, err = _cli(["report", str(run)], capsys)  # no traceback: one line, exit 2
    assert code == 2 and "incomplete" in err and len(err.splitlines()) == 1
    code, out, _ = _cli(["ledger", "repair", str(run)], capsys)
    assert code == 0 and "dropped the partial line 5 (25 bytes" in out
    assert path.read_bytes() == before
    code, out, _ = _cli(["ledger", "verify", str(run)], capsys)
    assert code == 0 and json.loads(out)["steps"] == 3
    code, out, _ = _cli(["ledger", "repair", str(run)], capsys)
    assert code == 0 and "nothing to repair" in out


def test_repair_never_drops_a_complete_record(tmp_path, capsys):
    run = _run_dir(tmp_path)
    path = run / "ledger.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"step":1', b'"step":7')  # a complete record, edited
    damaged = b"\n".join(lines)
    path.write_bytes(damaged)
    with pytest.raises(LedgerCorruptError, match="line 3"):
        repair_ledger(path)
    code, _, err = _cli(["ledger", "repair", str(run)], capsys)
    assert code == 2 and "line 3" in err and path.read_bytes() == damaged


def test_repair_refuses_when_a_released_step_is_not_charged(tmp_path, capsys):
    run = _run_dir(tmp_path, steps=2)
    path = run / "ledger.jsonl"
    path.write_bytes(path.read_bytes() + b'{"type":"step","step":2')
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "released.jsonl").write_text(
        "".join(json.dumps({"step": s, "model_version": s + 1}) + "\n" for s in range(3))
    )
    torn = path.read_bytes()
    code, _, err = _cli(["ledger", "repair", str(run)], capsys)
    assert code == 2 and "release journal shows step(s) [2] released" in err
    assert path.read_bytes() == torn


def test_a_report_is_bound_to_the_ledger_it_was_computed_from(tmp_path, capsys):
    run = _run_dir(tmp_path)
    report = build_report(run / "ledger.jsonl", 1e-5, unit="user", sampling="poisson")
    assert report.ledger["steps"] == 3
    json_path, md_path = write_report(report, run)
    assert report.ledger["last_hash"][:16] in md_path.read_text()
    check_report_current(json_path, run / "ledger.jsonl")
    (run / "model").mkdir()
    write_release_state(run / "model", run / "ledger.jsonl", report.epsilon, 1e-5)
    code, out, _ = _cli(["ledger", "verify", str(run)], capsys)
    assert code == 0 and json.loads(out)["report"] == json.loads(out)["model"] == "current"
    with Ledger.open(run / "ledger.jsonl") as led:  # a crash after one more released step
        led.append(3, ULS)
    with pytest.raises(ReportStaleError, match="covers 3 step.*now holds 4.*userdp report"):
        check_report_current(json_path, run / "ledger.jsonl")
    code, out, err = _cli(["ledger", "verify", str(run)], capsys)
    assert code == 2 and json.loads(out)["report"] == "stale" and "userdp report" in err
    assert json.loads(out)["model"] == "stale"
    (run / "privacy_report.json").unlink()
    code, out, err = _cli(["ledger", "verify", str(run)], capsys)
    assert code == 2 and "exported after 3 step(s)" in err and "resume the run" in err


def test_ledger_verify_and_repair_start_without_the_accountants_or_torch(tmp_path) -> None:
    """`userdp ledger verify` reads files only: it imports neither torch nor the accountants'
    libraries (dp_accounting, scipy), which cost seconds of start-up on a busy machine."""
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    with Ledger.create(run / "ledger.jsonl", budget_epsilon=10.0, delta=1e-5) as ledger:
        ledger.append(0, UlsMechanism(noise_multiplier=2.0, sampling_prob=0.1))
    heavy = ("torch", "dp_accounting", "scipy")
    code = (
        "import sys\n"
        "from userdp.cli import main\n"
        f"codes = [main(['ledger', 'verify', {str(run)!r}]), main(['ledger', 'repair', {str(run)!r}])]\n"
        f"print(codes, ','.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[0, 0] ", result.stdout


def _journal(run, steps) -> None:
    (run / "checkpoints").mkdir(exist_ok=True)
    (run / "checkpoints" / "released.jsonl").write_text(
        "".join(json.dumps({"step": s, "model_version": s + 1}) + "\n" for s in range(steps))
    )


@pytest.mark.parametrize(
    "cut, action",
    [(4, "restored"), (60, "recharged"), (300, None)],
    ids=["type-cut", "time-cut", "mechanism-cut"],
)
def test_a_released_steps_cut_record_gets_its_charge_back(tmp_path, capsys, cut, action):
    """The file cut short after its last step was released (the journal lists it): the message
    no longer says the step was never released; `ledger repair` restores the record exactly
    (only `type` lost), charges the step again with the mechanism the line still names (its
    time lost), or, with the mechanism lost too, refuses naming the backup; nothing else."""
    run = _run_dir(tmp_path)
    path = run / "ledger.jsonl"
    _journal(run, 3)
    whole = path.read_bytes()
    last = read_ledger(path)[1][-1]
    path.write_bytes(whole[: -cut - 1])  # the newline and `cut` bytes before it
    with pytest.raises(LedgerTruncatedError) as truncated:
        Ledger.open(path)
    assert "so never released" not in str(truncated.value)  # what the journal contradicts
    assert "restores its charge if it was" in str(truncated.value)
    code, out, err = _cli(["ledger", "repair", str(run)], capsys)
    if action is None:
        assert code == 2 and "step(s) [2] released" in err and "from a backup" in err
        assert path.read_bytes() == whole[: -cut - 1]
        return
    assert code == 0 and "was cut short after step 2 was released" in out, out
    records = read_ledger(path)[1]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["mechanism"] == last["mechanism"]
    if action == "restored":
        assert path.read_bytes() == whole and "restored it exactly" in out
    else:
        assert records[-1]["recharged"] is True and "charged it again" in out
        assert records[-1]["prev_hash"] == records[-2]["hash"]
    code, out, _ = _cli(["ledger", "verify", str(run)], capsys)
    assert code == 0 and json.loads(out)["steps"] == 3
    with Ledger.open(path) as resumed:  # the run continues after it
        resumed.append(3, ULS)


COMMITS = [f"{n:064x}" for n in (11, 12, 13, 99)]


@pytest.mark.parametrize(
    "journal, problem",
    [
        ([{}, {}, {}], None),  # lines written before the field: nothing to compare
        ([{"c": 0}, {"c": 1}, {"c": 2}], None),
        ([{"c": 0}, {"c": 1}, {"c": 3, "replayed": True}], None),  # fresh draw on the replay
        (
            [{"c": 0}, {"c": 1}, {"c": 2, "replayed": True}],
            "step 2 was replayed with the release its crash discarded",
        ),
        ([{"c": 0}, {"c": 3}, {"c": 2}], "step 1's release (release journal) is not the draw"),
    ],
    ids=["old-format", "as-charged", "replay-fresh", "replay-reused", "release-not-charged"],
)
def test_verify_checks_the_release_commitments(tmp_path, capsys, journal, problem):
    """`ledger verify` compares each release's commitment with the ledger's: a step released once
    must release the draw the ledger charged; a replayed step must not release the draw its
    crash discarded (the one the ledger charged before the crash)."""
    with Ledger.create(tmp_path / "ledger.jsonl", budget_epsilon=50.0, delta=1e-5) as led:
        for step in range(3):
            led.append(step, ULS, release_sha256=COMMITS[step])
    lines = []
    for step, line in enumerate(journal):
        entry = {"step": step, "model_version": step + 1}
        if "c" in line:
            entry["release_sha256"] = COMMITS[line["c"]]
        lines.append({**entry, **({"replayed": True} if line.get("replayed") else {})})
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "released.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
    )
    code, out, err = _cli(["ledger", "verify", str(tmp_path)], capsys)
    if problem is None:
        replayed = [s for s, line in enumerate(journal) if line.get("replayed")]
        assert code == 0 and json.loads(out)["replayed"] == replayed, err
    else:
        assert code == 2 and problem in err and len(err.splitlines()) == 1, err


def test_a_malformed_release_commitment_is_refused(tmp_path):
    with Ledger.create(tmp_path / "ledger.jsonl", budget_epsilon=50.0, delta=1e-5) as led:
        with pytest.raises(ValueError, match="not a hex SHA-256"):
            led.append(0, ULS, release_sha256="deadbeef")
        record = led.append(0, ULS, release_sha256=COMMITS[0])
    assert read_ledger(tmp_path / "ledger.jsonl")[1] == [record]
