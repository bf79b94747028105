"""A run that would train on no token is refused before step 1, and a step that trained on no
token stops the run: the budget is never spent on nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from userdp.cli import main
from userdp.config import ConfigError, load_config, parse_config
from userdp.run.components import NoTargetTokensError, prepare_run
from userdp.run.launch import run


def write_shards(folder: Path, texts_of_user) -> Path:
    """A real shard folder (byte tokenizer, 2 shards) of 20 users written by `userdp shard`."""
    rows = [{"uid": f"u{u}", "text": t} for u in range(20) for t in texts_of_user(u)]
    source = folder / "input.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    shards = folder / "shards"
    argv = ["shard", str(source), "--user-column", "uid", "--text-column", "text"]
    assert main([*argv, "--num-shards", "2", "--out", str(shards)]) == 0
    return shards


def run_config(shards: Path, out: Path, **data) -> dict:
    return {
        "data": {"shards": str(shards), "seq_len": 16, "eval_fraction": 0.0, **data},
        "model": {"preset": "gpt2-tiny"},
        "strategy": {"steps": 5, "sampling_prob": 0.5, "group_size": 1, "engine": "loop"},
        "privacy": {"noise_multiplier": 1.0},
        "output": {"dir": str(out), "plots": False, "sample_count": 0},
    }


def test_shards_whose_examples_are_single_tokens_are_refused_at_config_check(tmp_path, capsys):
    shards = write_shards(tmp_path, lambda u: ["a", "b"])
    path = tmp_path / "run.toml"
    path.write_text(f"[data]\nshards = '{shards}'\n")
    capsys.readouterr()
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no example has 2 or more tokens (40 examples, 40 tokens)" in err
    assert err.count("\n") == 1
    with pytest.raises(NoTargetTokensError, match="no training user .* has an example of 2"):
        prepare_run(parse_config(run_config(shards, tmp_path / "run")))  # config check skipped


def test_a_step_that_trained_on_no_token_stops_the_run(tmp_path, capsys):
    """Every user has a one-token example and a longer one; ``selection = "shortest"`` with one
    example per user gives every unit the one-token example: the first step trains on no token,
    and the run stops there instead of spending the other four steps' budget."""
    shards = write_shards(tmp_path, lambda u: ["a", f"hello there {u}"])
    config = parse_config(run_config(shards, tmp_path / "run", selection="shortest"))
    with pytest.raises(NoTargetTokensError) as info:
        run(config, mode="in-process", quiet=True)
    message = str(info.value)
    assert "trained on no token, so the run stops" in message and "\n" not in message
    assert "shard longer examples" in message
    ledger = (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, ledger) if r["type"] == "step"]
    assert len(steps) == 1  # the one step that showed it, not the run's five
    # the same data with each user's longest example trains
    config = parse_config(run_config(shards, tmp_path / "run2", selection="longest"))
    assert run(config, mode="in-process", quiet=True).steps_done == 5


def test_config_file_paths_are_inside_the_config_folder(tmp_path, monkeypatch, capsys):
    """A relative path in a config file means a path in the file's folder, whatever the current
    directory; `config check` says what each one resolved to."""
    project = tmp_path / "project"
    project.mkdir()
    write_shards(project, lambda u: ["hello", "there"])
    path = project / "run.toml"
    path.write_text("[data]\nshards = 'shards'\n[output]\ndir = 'runs/x'\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"relative paths are inside the config's folder, {project}:" in out
    assert f"data.shards = 'shards' -> {project / 'shards'}" in out
    assert f"output.dir = 'runs/x' -> {project / 'runs' / 'x'}" in out
    config = load_config(path)
    assert config.data.shards == str(project / "shards")
    assert config.output.dir == str(project / "runs" / "x")
    (project / "run.toml").write_text("[data]\nshards = 'missing'\n")
    with pytest.raises(ConfigError, match=f"data.shards = '{project / 'missing'}' is not a"):
        load_config(path)


def test_config_check_refuses_workers_the_shards_or_machine_cannot_keep_busy(tmp_path, capsys):
    import os

    shards = write_shards(tmp_path, lambda u: ["hello", "there"])
    path = tmp_path / "run.toml"
    cores = os.cpu_count() or 1
    cases = [
        (f"[data]\nshards = '{shards}'\n[workers]\ncount = 3\n", "workers.count = 3 is more than"),
        ("[workers]\ncount = 1000\n", "the demo corpus's 4 shards x workers.replicas = 1"),
        ("[workers]\ncount = 9\nreplicas = 2\n", "set workers.count <= 8"),
        (f"[workers]\nranks = {cores + 1}\n", f"this machine has {cores}: set workers.ranks"),
        ("[workers]\ntoken_budget = 1\n", "workers.token_budget = 1 is less than one example"),
    ]
    for body, expected in cases:
        path.write_text(body)
        capsys.readouterr()
        assert main(["config", "check", str(path)]) == 2, body
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err
    path.write_text(f"[data]\nshards = '{shards}'\n[workers]\ncount = 4\nreplicas = 2\n")
    assert main(["config", "check", str(path)]) == 0
