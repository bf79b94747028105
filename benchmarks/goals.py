"""The goals table of ``benchmarks/run_all.py``: which figure of which benchmark's JSON has a goal,
the goal, and whether the measured value meets it.

A goal is judged only at the size it is stated for (``met`` is None at other sizes, e.g. in quick
mode); a figure whose benchmark did not finish is left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def _row(rows: list[dict], name: str, setting_has: str = "") -> dict | None:
    for row in rows:
        if row.get("name") == name and setting_has in str(row.get("setting", "")):
            return row
    return None


# worker.py: the engines' step time as a multiple of a non-private step on the same tokens, CPU
# goals (docs/worker.md), judged at GPT-2 small, seq 128, full fine-tuning, fp32
WORKER_GOALS = {"user": 1.15, "example": 1.2}


def _opacus_anchor(rows: list[dict], row: dict) -> str:
    """The Opacus anchor beside an engine row of benchmarks/worker.py: "; Opacus hooks X×, ghost
    Y× in the same run" from the anchor rows of the same case ("" when it has none)."""
    same = [
        r
        for r in rows
        if r["mode"].startswith("opacus-")
        and all(r.get(k) == row.get(k) for k in ("case", "preset", "lora_rank", "seq_len"))
    ]
    if not same:
        return ""
    if all(r.get("time_ratio") is None for r in same):
        return f"; Opacus not run: {same[0].get('note', 'no timing')}"
    timed, not_run = [], []
    for r in same:
        label = r["mode"].removeprefix("opacus-")
        if r.get("time_ratio") is None:
            not_run.append(f"{label} not run ({r.get('note', 'no timing')})")
            continue
        agrees = (r.get("agreement") or {}).get("ok")
        timed.append(
            f"{label} {r['time_ratio']:.2f}×" + (" (disagrees)" if agrees is False else "")
        )
    return f"; Opacus {', '.join(timed)} in the same run" + "".join(f", {n}" for n in not_run)


def goals(outcomes: Mapping[str, Any]) -> list[dict[str, Any]]:
    """(area, figure, measured, goal, met) for the figures that have goals, from ``outcomes``:
    benchmark name -> its ``run_all.Outcome`` (a result counts only when its status is "ok")."""
    out: list[dict[str, Any]] = []

    def add(area: str, figure: str, measured: str, goal: str, met: bool | None) -> None:
        out.append({"area": area, "figure": figure, "measured": measured, "goal": goal, "met": met})

    def result(name: str) -> Any:
        outcome = outcomes.get(name)
        return outcome.result if outcome is not None and outcome.status == "ok" else None

    acc = result("accounting")
    if acc:
        rows = acc["rows"]
        els = _row(rows, "els_epsilon")
        if els:
            add(
                "accounting",
                f"ELS ε fast vs dp_accounting ({els['setting']})",
                f"{els['seconds']:.2f} s vs {els['reference_seconds']:.1f} s = "
                f"{els['speedup']:.1f}× wall ({els['cpu_speedup']:.1f}× CPU), "
                f"rel. diff {els['rel_diff']:.1e}",
                "≥ 20×, ≤ 1e-3 rel. (vdi 1e-4)",
                (els["speedup"] >= 20 and abs(els["rel_diff"]) <= 1e-3)
                if "vdi=0.0001" in els["setting"]
                else None,
            )
        cal = _row(rows, "els_calibration", "p=0.01 ")
        if cal:
            add(
                "accounting",
                f"ELS calibration ({cal['setting']})",
                f"{cal['seconds']:.2f} s (σ = {cal['value']:.6g}, ε(σ) = {cal['epsilon_at_value']:.6g})",
                "≤ 30 s on 2 CPU cores",
                cal["seconds"] <= 30,
            )
    bib = result("balls_in_bins")
    if bib:
        anchors = {
            "balls_in_bins_delta_per-epoch": (
                _row(bib["rows"], "balls_in_bins_delta_per-epoch_block_sum"),
                "block-sum anchor",
            ),
            "balls_in_bins_delta_fixed+blt": (
                _row(bib["rows"], "balls_in_bins_delta_fixed+blt_dense"),
                "dense-product anchor",
            ),
        }
        anchor_rows = [a for a, _ in anchors.values() if a]
        for row in bib["rows"]:
            if row["name"].startswith("balls_in_bins_delta") and row not in anchor_rows:
                measured = f"{row['seconds']} s wall, {row['cpu_seconds']} s CPU"
                goal, met = "≤ 1 s on CPU (2^20 samples, b=128, E=16)", row["seconds"] <= 1.0
                anchor, label = anchors.get(row["name"], (None, ""))
                if anchor and "delta" in row:
                    z = abs(row["delta"] - anchor["delta"]) / math.hypot(
                        row["stderr"], anchor["stderr"]
                    )
                    measured += (
                        f"; δ̂ {row['delta']:.3e}±{row['stderr']:.1e} vs {label} "
                        f"{anchor['delta']:.3e}±{anchor['stderr']:.1e} ({anchor['seconds']} s): "
                        f"{z:.2f} standard errors apart"
                    )
                    goal += ", same δ̂ as the anchor within 5.33 standard errors"
                    met = met and z <= 5.33
                add(
                    "accounting",
                    f"balls-in-bins δ̂ ({row['setting']})",
                    measured,
                    goal,
                    met if "m=1048576" in row["setting"] else None,
                )
        opt = _row(bib["rows"], "optimize_blt_amplified")
        if opt:
            add(
                "accounting",
                f"BLT optimized under balls-in-bins amplification ({opt['setting']})",
                f"{opt['seconds']} s wall; {opt['value']}",
                "≤ 30 s for n = 1000 on 2 CPU cores",
                opt["seconds"] <= 30 if "n=1000" in opt["setting"] else None,
            )
    data = result("data")
    if data:
        add(
            "data",
            f"userdp shard, {data['rows']:,} rows synthetic Parquet ({data['input_mb']} MB in, "
            f"{data['output_mb']} MB of shards out)",
            f"{data['rows_per_s']:,} rows/s ({data.get('rows_per_cpu_s', '?'):,} per CPU s), "
            f"peak RSS {data['peak_rss_mb']} MB (largest user {data['largest_user_mb']} MB)",
            "bounded memory at 1M rows: peak RSS below the output size",
            data["peak_rss_mb"] < data["output_mb"] if data["rows"] >= 1_000_000 else None,
        )
    worker = result("worker")
    if worker:
        rows = worker["rows"]
        for row in rows:
            goal_ratio = WORKER_GOALS.get(row.get("unit", ""))
            engine_step = row["mode"] in ("vectorized", "randomized") and "step" in row["case"]
            if not engine_step or goal_ratio is None or row.get("time_ratio") is None:
                continue
            lora = f"LoRA r={row['lora_rank']}" if row.get("lora_rank") else "full"
            shape = f"{row['users']}×{row['group_size']}×{row['seq_len']}"
            at_size = (
                row["preset"] == "gpt2-small"
                and row["seq_len"] == 128
                and not row.get("lora_rank")
                and row.get("device", "cpu") == "cpu"
                and row.get("dtype", "fp32") == "fp32"
            )
            add(
                "worker",
                f"{row['mode']} {row['unit']}-level step, {row['preset']} {lora} {shape}",
                f"{row['time_ratio']:.2f}× non-private ({row['seconds']:.2f} s)"
                + _opacus_anchor(rows, row),
                f"≤ {goal_ratio}× non-private on CPU (GPT-2 small, seq 128)",
                row["time_ratio"] <= goal_ratio if at_size else None,
            )
    coord = result("coordinator")
    if coord:
        if "round" in coord:
            r = coord["round"]
            add(
                "coordinator",
                f"round overhead, {r['cohort_mean']:.0f} users of {r['population']:,}",
                f"{r['round_ms_median']:.1f} ms median ({r['round_ms_max']:.1f} max)",
                "≤ 50 ms (10k of 1M)",
                r["round_ms_median"] <= 50 if r["population"] >= 1_000_000 else None,
            )
        if "transfer" in coord:
            t = coord["transfer"]
            add(
                "coordinator",
                f"update transfer, {t['params']:,} fp32 params, 1 stream",
                _rate(t)
                + (
                    f" (loopback socket anchor {t['socket_anchor']['gb_per_s']:.2f} GB/s)"
                    if "socket_anchor" in t
                    else ""
                ),
                "median ≥ 1 GB/s (100M params)",
                _median_rate(t) >= 1.0 if t["params"] >= 100_000_000 else None,
            )
            partial = t.get("partial_sum")
            if partial:
                add(
                    "coordinator",
                    f"partial-sum transfer, {partial['params']:,} fp32, worker → step loop",
                    f"{_rate(partial)} (same socket anchor)",
                    "median ≥ 1 GB/s (100M params)",
                    _median_rate(partial) >= 1.0 if partial["params"] >= 100_000_000 else None,
                )
    plane = result("data_plane")
    if plane:
        _data_plane_goals(plane, add)
    scale = result("scale")
    if scale:
        s = scale["scale"]
        full_size = s["population"] >= 1_000_000 and s["steps"] >= 100
        add(
            "scale",
            f"scale simulation, {s['steps']} steps, {s['cohort_mean']:.0f} of {s['population']:,} users",
            f"{s['round_ms_median']:.1f} ms/step median (p95 {s['round_ms_p95']:.1f})",
            "≤ 50 ms/step",
            s["round_ms_median"] <= 50 if full_size else None,
        )
        add(
            "scale",
            "scale simulation, coordinator peak RSS",
            f"{s['peak_rss_mb']:.0f} MB",
            "≤ 2 GB",
            s["peak_rss_mb"] <= 2000 if full_size else None,
        )
    strat = result("strategies")
    if strat:
        blt = _row(strat["rows"], "blt_optimize")
        if blt:
            rel = abs(blt["value"] - 10.692) / 10.692
            add(
                "strategies",
                "BLT optimization loss, n=1000, 3 buffers",
                f"{blt['value']:.5f} (rel. {rel:.1e} vs 10.692), {blt['seconds']:.2f} s",
                "within 1e-4 rel. of 10.692",
                rel <= 1e-4,
            )
    noise = result("noise")
    if noise:
        for row in noise["rows"]:
            if row["goal_ratio"] is None:
                continue
            add(
                "noise",
                f"{row['case']} noise, {noise['params']:,} params",
                f"{row['seconds']:.3f} s = {row['ratio']}× {row['ratio_to']}",
                f"≤ {row['goal_ratio']}× the fast path (at 100M params)",
                row["goal_met"] if noise["params"] == 100_000_000 else None,
            )
    e2e = result("end_to_end")
    if e2e:
        for row in e2e.get("rows", []):
            if row["run"] == "non-private" and not row.get("error"):
                continue
            kind = "uls" if row["run"].startswith("uls") else "els"
            target = 0.85 if kind == "uls" else 0.70
            ratio = row.get("vs_non_private")
            figure = f"{row['model']} seq {row['seq_len']} {row['run']}"
            if ratio is None:  # this row or its baseline failed (e.g. out of memory)
                add("GPU", figure, row.get("error") or "no baseline", f"≥ {target:.0%}", False)
                continue
            add(
                "GPU",
                figure,
                f"{row['tokens_per_s']:.0f} tokens/s = {ratio:.0%} of non-private",
                f"≥ {target:.0%}",
                ratio >= target,
            )
        for row in e2e.get("randomized_clipping", []):
            add(
                "GPU",
                f"{row['model']} seq {row['seq_len']} {row['run']}",
                row.get("error") or f"{row['seconds']} s/step, peak {row['peak_mem_gb']} GB",
                "randomized vs exact clipping: time and peak memory",
                None,
            )
    return out


def _median_rate(transfer: Mapping[str, Any]) -> float:
    """The median rate of a transfer figure (the best one where the run recorded no median)."""
    return transfer.get("gb_per_s_median", transfer["gb_per_s"])


def _rate(transfer: Mapping[str, Any]) -> str:
    return f"{_median_rate(transfer):.2f} GB/s median, {transfer['gb_per_s']:.2f} best"


def _data_plane_goals(record: Mapping[str, Any], add: Any) -> None:
    """benchmarks/data_plane.py: the collective plane's coordinator bytes against W, and its
    gather at W = 4 against torch.distributed's all_reduce of the same tensor (judged at 100M)."""
    rows = [r for r in record["rows"] if r["plane"] == "collective" and "error" not in r]
    anchors = {a["workers"]: a["all_reduce_s_median"] for a in record["anchors"]}
    at_size = record["params"] >= 100_000_000
    if len(rows) >= 2:
        moved = [
            r["coordinator_sent_mb_per_step"] + r["coordinator_received_mb_per_step"] for r in rows
        ]
        model = rows[0]["model_mb"]
        add(
            "data plane",
            f"collective: coordinator MB per step, W = {', '.join(str(r['workers']) for r in rows)}",
            ", ".join(f"{m:.0f}" for m in moved) + f" (model {model:.0f} MB)",
            "independent of W within one model size",
            (max(moved) - min(moved) <= model) if at_size else None,
        )
    four = next((r for r in rows if r["workers"] == 4), None)
    if four and anchors.get(4):
        ratio = four["reduce_s_median"] / anchors[4]
        add(
            "data plane",
            "collective aggregation at W = 4 vs torch.distributed all_reduce of the same bytes",
            f"{four['reduce_s_median']:.2f} s vs {anchors[4]:.2f} s ({ratio:.2f}×)",
            "≤ 2× the all_reduce (100M params)",
            ratio <= 2.0 if at_size else None,
        )
