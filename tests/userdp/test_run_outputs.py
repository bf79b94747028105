"""Run outputs that need no run: plots from a metrics file."""

from __future__ import annotations

import json
import warnings

from userdp.run.report import render_plots


def _write_metrics(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_plots_of_a_run_interrupted_before_its_first_step_warn_about_nothing(tmp_path) -> None:
    _write_metrics(tmp_path / "metrics.jsonl", [{"kind": "eval", "step": 0, "eval_loss": 5.5}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = render_plots(tmp_path)
    assert [p.name for p in written] == ["loss.png", "epsilon.png", "clip_fraction.png"]
    assert not [str(w.message) for w in caught if "legend" in str(w.message)]


def test_plots_put_step_rows_and_eval_rows_on_steps_done(tmp_path, monkeypatch) -> None:
    """A step row's "step" is its 0-based index, an eval row's the steps done before it: the
    held-out loss after 2 steps and the train loss of the second step share x = 2."""
    import matplotlib.axes

    plotted: list[tuple[list, list]] = []
    original = matplotlib.axes.Axes.plot

    def plot(self, *args, **kwargs):
        plotted.append((list(args[0]), list(args[1])))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    rows = [
        {"kind": "eval", "step": 0, "eval_loss": 5.0},
        {"kind": "step", "step": 0, "loss": 4.0, "epsilon": 1.0, "clip_fraction": 1.0},
        {"kind": "step", "step": 1, "loss": 3.0, "epsilon": 1.5, "clip_fraction": 0.5},
        {"kind": "eval", "step": 2, "eval_loss": 3.5},
    ]
    _write_metrics(tmp_path / "metrics.jsonl", rows)
    render_plots(tmp_path)
    train, held_out, epsilon, clipped = plotted
    assert train == ([1, 2], [4.0, 3.0]) and held_out == ([0, 2], [5.0, 3.5])
    assert epsilon[0] == [1, 2] and clipped[0] == [1, 2]
