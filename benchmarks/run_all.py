"""Run every benchmark, write ``benchmarks/results/<machine>.json`` and ``<machine>.md``.

Each benchmark script runs as its own child process (so one crash or one peak RSS does not
affect the others), prints JSON and a markdown table; this collects both, the child's wall time,
exit status and peak RSS (``os.wait4``), the machine's load average before and after (the numbers
of a shared machine are noisy: the report says how loaded it was), and a summary of the figures
that have goals, grouped by area.

    .venv/bin/python benchmarks/run_all.py                    # quick mode (minutes)
    .venv/bin/python benchmarks/run_all.py --full             # the goals' sizes
    .venv/bin/python benchmarks/run_all.py --only scale coordinator --machine my-box
    .venv/bin/python benchmarks/run_all.py --gpu              # also the GPU end-to-end rows

Benchmarks: accounting, balls_in_bins, data, worker (benchmarks/worker.py, when present),
cli_start and aux_commands (the command line: start-up; report, ledger verify, plan, a per-epoch
ε query),
coordinator (round overhead + update transfer), data_plane (the coordinator's bytes and time per
step on the gRPC and collective data planes against the number of workers), scale (the 1M-user scale simulation of
benchmarks/coordinator.py --scale), strategies, end_to_end (GPU; with --gpu or when CUDA is
visible; without a GPU it is skipped and the report says the GPU figures are missing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goals import goals  # benchmarks/goals.py: this script's folder is on sys.path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    gpu: bool = False
    """Needs a CUDA device (skipped, with a note, without one)."""
    timeout_s: int = 1800
    args_from_help: Callable[[str, bool, bool], tuple[str, ...]] | None = None
    """For scripts owned elsewhere: arguments from (``--help`` text, full mode, GPU present)."""


def _worker_args(help_text: str, full: bool, gpu: bool) -> tuple[str, ...]:
    """benchmarks/worker.py (the worker engines vs non-private, with the Opacus anchor): in full
    mode its defaults (GPT-2 small) with bf16 on a GPU, and on a CPU the engine goals' shape,
    GPT-2 small with 4 users × 4 examples × 128 tokens (the default 64 users take hours on a
    small CPU); otherwise its --quick (a tiny model)."""
    args: tuple[str, ...] = ()
    if full and gpu:
        if "--device" in help_text:
            args += ("--device", "cuda")
        if "--dtype" in help_text:
            args += ("--dtype", "bf16")
    elif full and "--preset" in help_text:
        args += ("--preset", "gpt2-small", "--users", "4", "--group-size", "4", "--skip-long")
    elif "--quick" in help_text:
        args += ("--quick",)
    return args


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("accounting", "accounting.py", ("--quick",), ()),
    Benchmark("balls_in_bins", "balls_in_bins.py", ("--quick",), ()),
    Benchmark("data", "data.py", ("--rows", "100000", "--users", "2000"), ()),
    Benchmark("worker", "worker.py", (), (), args_from_help=_worker_args),
    Benchmark(
        "coordinator",
        "coordinator.py",
        ("--population", "100000", "--cohort", "1000", "--params", "10000000"),
        (),
    ),
    # Two worker processes stand in for remote workers (more only compete for this machine's CPU).
    Benchmark(
        "scale",
        "coordinator.py",
        ("--scale", "--steps", "20", "--workers", "2"),
        ("--scale", "--workers", "2"),
    ),
    Benchmark(
        "data_plane", "data_plane.py", ("--params", "10000000", "--workers", "1", "2", "4"), ()
    ),
    Benchmark("strategies", "strategies.py", ("--quick",), ()),
    Benchmark("cli_start", "cli_start.py", ("--repeats", "3"), ()),
    Benchmark("aux_commands", "aux_commands.py", ("--repeats", "1"), ()),
    Benchmark("noise", "noise.py", ("--params", "10000000"), ()),
    Benchmark("end_to_end", "end_to_end.py", ("--quick",), (), gpu=True, timeout_s=3600),
)
NAMES = tuple(b.name for b in BENCHMARKS)


# --------------------------------------------------------------------------------------------
# the machine


def cuda_device() -> str | None:
    """Name of the first visible CUDA device, or None (asked in a child: no torch import here)."""
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def default_machine_name(gpu: str | None) -> str:
    host = re.sub(r"[^a-z0-9]+", "-", socket.gethostname().lower()).strip("-")[:24] or "host"
    if gpu:
        slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
        return f"gpu-{slug}-{host}"
    return f"cpu-{os.cpu_count()}c-{host}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1e6, 1)
    except OSError:
        pass
    return None


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
        )
    except OSError:
        return ""
    return out.stdout.strip()


def machine_info(name: str, gpu: str | None) -> dict[str, Any]:
    return {
        "machine": name,
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gb": _memory_gb(),
        "gpu": gpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


# --------------------------------------------------------------------------------------------
# running one benchmark


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed | skipped | timeout
    command: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_mb: float | None = None
    load_before: tuple[float, float, float] | None = None
    load_after: tuple[float, float, float] | None = None
    result: Any = None
    markdown: str = ""
    note: str = ""
    stderr_tail: str = ""


def split_output(stdout: str) -> tuple[Any, str]:
    """(the first JSON value printed at the start of a line, the text after it)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"^[\[{]", stdout, flags=re.MULTILINE):
        try:
            value, end = decoder.raw_decode(stdout, match.start())
        except json.JSONDecodeError:
            continue
        return value, stdout[end:].strip()
    return None, stdout.strip()


def run_benchmark(bench: Benchmark, full: bool, env: dict[str, str], gpu: bool = False) -> Outcome:
    script = HERE / bench.script
    if not script.exists():
        return Outcome(bench.name, "skipped", note=f"benchmarks/{bench.script} is not present")
    args = bench.full if full else bench.quick
    if bench.args_from_help is not None:
        help_text = subprocess.run(
            [sys.executable, str(script), "--help"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        ).stdout
        args = bench.args_from_help(help_text, full, gpu)
    command = [sys.executable, str(script), *args]
    outcome = Outcome(
        bench.name, "ok", command=[Path(c).name if c == sys.executable else c for c in command]
    )
    outcome.load_before = os.getloadavg()
    started = time.perf_counter()
    with (
        open(os.devnull, "rb") as stdin,
        _temp_file() as out_file,
        _temp_file() as err_file,
    ):
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdin=stdin, stdout=out_file, stderr=err_file
        )
        status, rusage = _wait(proc, bench.timeout_s)
        outcome.seconds = round(time.perf_counter() - started, 2)
        out_file.seek(0)
        err_file.seek(0)
        stdout = out_file.read().decode("utf-8", "replace")
        stderr = err_file.read().decode("utf-8", "replace")
    outcome.load_after = os.getloadavg()
    if rusage is not None:
        outcome.peak_rss_mb = round(rusage.ru_maxrss * 1024 / 1e6, 1)
    outcome.result, outcome.markdown = split_output(stdout)
    outcome.stderr_tail = "\n".join(stderr.strip().splitlines()[-15:])
    if status == "timeout":
        outcome.status, outcome.note = "timeout", f"killed after {bench.timeout_s} s"
    elif status != 0:
        outcome.status, outcome.note = "failed", f"exit status {status}"
    elif outcome.result is None:
        outcome.status, outcome.note = "failed", "printed no JSON"
    return outcome


def _temp_file():
    return tempfile.TemporaryFile()


def _wait(proc: subprocess.Popen, timeout_s: int) -> tuple[int | str, Any]:
    """Wait for ``proc`` (kill it after ``timeout_s``); (exit status or "timeout", rusage)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, rusage
        if time.monotonic() > deadline:
            proc.kill()
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            return "timeout", rusage
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------
# output


def _load(values: tuple[float, float, float] | None) -> str:
    return "" if values is None else " / ".join(f"{v:.2f}" for v in values)


def markdown_report(report: dict[str, Any], outcomes: list[Outcome]) -> str:
    m = report["machine"]
    lines = [
        f"# userdp benchmarks — {m['machine']}",
        "",
        f"- date: {report['date']}, mode: **{report['mode']}**, commit {m['git_commit'][:10]}"
        f"{' (uncommitted changes)' if m['git_dirty'] else ''}",
        f"- CPU: {m['cpu_model']}, {m['cpus']} cores, {m['memory_gb']} GB; GPU: {m['gpu'] or 'none'}",
        f"- load average (1/5/15 min) at start {_load(report['load_start'])}, "
        f"at end {_load(report['load_end'])}"
        + (
            " — the machine was shared and loaded: timings are noisy"
            if max(report["load_start"][0], report["load_end"][0]) > 0.5 * (m["cpus"] or 1)
            else ""
        ),
        "",
        "## Goals",
        "",
        "| area | figure | measured | goal | met |",
        "|---|---|---|---|---|",
    ]
    for g in report["goals"]:
        met = {True: "yes", False: "**no**", None: "n/a (not the goal's size)"}[g["met"]]
        lines.append(f"| {g['area']} | {g['figure']} | {g['measured']} | {g['goal']} | {met} |")
    if not report["machine"]["gpu"]:
        lines += [
            "",
            "**GPU figures are missing** here: no CUDA device on this machine (GPU runs have "
            "their own files in benchmarks/results/).",
        ]
    lines += [
        "",
        "## Runs",
        "",
        "| benchmark | status | wall s | peak RSS MB | load before → after | note |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.name} | {o.status} | {o.seconds} | {o.peak_rss_mb or ''} | "
            f"{_load(o.load_before)} → {_load(o.load_after)} | {o.note} |"
        )
    for o in outcomes:
        if o.status == "skipped":
            continue
        lines += ["", f"## {o.name}", "", f"`{' '.join(o.command)}`", ""]
        if o.markdown:
            lines.append(o.markdown)
        if o.status != "ok" and o.stderr_tail:
            lines += ["", "```", o.stderr_tail, "```"]
    return "\n".join(lines) + "\n"


def rerender(json_path: Path) -> int:
    """Recompute the goals and rewrite ``<machine>.md`` next to an earlier results JSON."""
    report = json.loads(json_path.read_text())
    fields = set(Outcome.__dataclass_fields__)
    outcomes = [
        Outcome(name=name, **{k: v for k, v in data.items() if k in fields})
        for name, data in report["benchmarks"].items()
    ]
    report["goals"] = goals({o.name: o for o in outcomes})
    json_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    md_path = json_path.with_suffix(".md")
    md_path.write_text(markdown_report(report, outcomes))
    print(f"rewrote {json_path} and {md_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the goals' sizes (long)")
    parser.add_argument("--machine", default=None, help="results file name (default: detected)")
    parser.add_argument("--only", nargs="+", choices=NAMES, default=None)
    parser.add_argument("--skip", nargs="+", choices=NAMES, default=())
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", action="store_true", help="require a GPU and run the GPU rows")
    gpu.add_argument("--no-gpu", action="store_true", help="skip the GPU rows even with a GPU")
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    parser.add_argument(
        "--rerender",
        metavar="JSON",
        default=None,
        help="rewrite the goals and the markdown of an earlier results JSON (runs nothing)",
    )
    args = parser.parse_args(argv)
    if args.rerender:
        return rerender(Path(args.rerender))

    device = None if args.no_gpu else cuda_device()
    if args.gpu and device is None:
        print("run_all.py: --gpu given but no CUDA device is visible", file=sys.stderr)
        return 2
    name = args.machine or default_machine_name(device)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    selected = [
        b
        for b in BENCHMARKS
        if (args.only is None or b.name in args.only) and b.name not in args.skip
    ]
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "full" if args.full else "quick",
        "machine": machine_info(name, device),
        "load_start": os.getloadavg(),
    }
    outcomes: list[Outcome] = []
    for bench in selected:
        if bench.gpu and device is None:
            outcome = Outcome(bench.name, "skipped", note="no CUDA device: GPU figures missing")
        else:
            print(f"run_all.py: {bench.name} ...", file=sys.stderr, flush=True)
            outcome = run_benchmark(bench, args.full, env, gpu=device is not None)
        print(
            f"run_all.py: {bench.name}: {outcome.status} {outcome.seconds} s {outcome.note}",
            file=sys.stderr,
            flush=True,
        )
        outcomes.append(outcome)
    report["load_end"] = os.getloadavg()
    by_name = {o.name: o for o in outcomes}
    report["goals"] = goals(by_name)
    report["benchmarks"] = {
        o.name: {k: v for k, v in o.__dict__.items() if k != "name"} for o in outcomes
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    md_path.write_text(markdown_report(report, outcomes))
    print(f"wrote {json_path} and {md_path}")
    failed = [o.name for o in outcomes if o.status in ("failed", "timeout")]
    if failed:
        print(f"run_all.py: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
