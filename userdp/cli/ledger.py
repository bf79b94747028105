"""``userdp ledger verify RUN_DIR`` and ``userdp ledger repair RUN_DIR``.

``verify`` reads the run's ``ledger.jsonl``: every line parses, every hash matches, the chain
is unbroken, steps increase, every step the release journal (``checkpoints/released.jsonl``)
shows released is charged, each release's commitment (``release_sha256``) is the draw the ledger
charged, or, for a replayed step, differs from the draw its crash discarded, and
``privacy_report.json`` and the exported ``model/``, when
present, match this ledger: the same step count and last record, and the ε each states equals
the ledger's certified ε at its δ. ``repair`` repairs only a partial last line
(:mod:`userdp.accounting.ledger_repair`): dropped when a crash mid-write left it, its charge
restored when the release journal shows its step released; never a complete record. It says what
it did. Problems are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def ledger_path(target: str) -> Path:
    path = Path(target)
    path = path / "ledger.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"{target} is not a run folder with ledger.jsonl (nor a ledger file)")
    return path


def _released(run_dir: Path) -> list[int]:
    from userdp.server.release_journal import UNREADABLE_RELEASE, read_release_journal

    # an unreadable (torn) journal line reads as "released" for resume; it names no step here
    return [s for s in read_release_journal(run_dir / "checkpoints") if s < UNREADABLE_RELEASE]


def _verify(args: argparse.Namespace) -> int:
    from userdp.accounting.ledger_format import (
        ReportStaleError,
        check_report_current,
        ledger_state,
        read_ledger,
    )
    from userdp.server.release_journal import commitment_problem, read_release_records

    path = ledger_path(args.run_dir)
    header, records = read_ledger(path)
    steps = [r["step"] for r in records]
    missing = sorted(set(_released(path.parent)) - set(steps))
    if missing:
        raise ValueError(
            f"{path}: the release journal shows step(s) {missing[:5]} released but the ledger "
            "does not charge them"
        )
    journal = read_release_records(path.parent / "checkpoints")
    problem = commitment_problem(records, journal)
    if problem:
        raise ValueError(f"{path}: {problem}")
    report = path.parent / "privacy_report.json"
    stale, report_state = None, "missing"
    if report.is_file():
        try:
            check_report_current(report, path)
            report_state = "current"
        except ReportStaleError as exc:
            stale, report_state = str(exc), "stale"
    state = ledger_state(records, header)
    model = path.parent / "model" / "userdp_release.json"
    model_state = "missing"
    if model.is_file():
        release = json.loads(model.read_text())
        exported = release["ledger"]
        model_state = "current" if exported == state else "stale"
        if model_state == "stale":
            stale = stale or (
                f"{model.parent} was exported after {exported['steps']} step(s) but the ledger "
                f"holds {len(records)}: resume the run (the same command) to export the current "
                "model"
            )
    for file in (report, model):
        if file.is_file() and records:
            stale = stale or _stated_epsilon_differs(file, records)
    print(
        json.dumps(
            {
                "ledger": str(path),
                "run_id": header["run_id"],
                "steps": len(records),
                "last_step": steps[-1] if steps else None,
                "last_hash": state["last_hash"],
                "budget_epsilon": header["budget_epsilon"],
                "replayed": [line["step"] for line in journal if line.get("replayed")],
                "report": report_state,
                "model": model_state,
            }
        )
    )
    if stale:
        raise ValueError(stale)
    return 0


def _stated_epsilon_differs(file: Path, records: list) -> str | None:
    """Why ``file`` (the report or the model's release record) states another ε than the
    ledger's certified ε at the file's δ, or None. Both are the same deterministic computation
    (:func:`userdp.accounting.api.compose_epsilon`), so they must agree to rounding."""
    from userdp.accounting.api import compose_epsilon
    from userdp.accounting.ledger_format import group_phases

    stated = json.loads(file.read_text())
    epsilon, delta = stated.get("epsilon"), stated.get("delta")
    if epsilon is None or delta is None:
        return f"{file} states no ε or δ; re-export it (resume the run, or `userdp report`)"
    if stated.get("ledger", {}).get("steps", len(records)) != len(records):
        return None  # stale, reported above
    certified = compose_epsilon(group_phases(records), float(delta))
    if abs(float(epsilon) - certified) > 1e-9 * max(1.0, certified):
        return (
            f"{file} states ε = {float(epsilon):.6g} at δ = {float(delta):.3g}, but the ledger's "
            f"certified ε there is {certified:.6g}: the file does not state the ledger's guarantee"
        )
    return None


def _repair(args: argparse.Namespace) -> int:
    from userdp.accounting.ledger_repair import repair_ledger

    path = ledger_path(args.run_dir)
    done = repair_ledger(path, _released(path.parent))
    if done is None:
        print(f"{path}: nothing to repair (every line is complete)")
    elif done["action"] == "dropped":
        print(
            f"{path}: dropped the partial line {done['line']} ({done['bytes']} bytes, "
            f"never fsync'd, so never released): {done['text']!r}"
        )
    else:
        how = (
            "restored it exactly from what survives"
            if done["action"] == "restored"
            else "charged it again with the mechanism the cut line names"
        )
        print(
            f"{path}: line {done['line']} was cut short after step {done['step']} was released "
            f"(the release journal lists it); {how}. Run the same command to resume"
        )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ledger", help="verify or repair a run's privacy ledger")
    sub = parser.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)
    verify = sub.add_parser(
        "verify",
        help="check the hash chain, step order, release journal, and that RUN_DIR's report and "
        "model state the ledger's steps and certified ε",
    )
    verify.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (or a ledger file)")
    verify.set_defaults(handler=_verify)
    repair = sub.add_parser(
        "repair",
        help="repair a partial last line: drop it if its step was never released, restore its "
        "charge if the release journal shows it released (never touches a complete record)",
    )
    repair.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (or a ledger file)")
    repair.set_defaults(handler=_repair)
