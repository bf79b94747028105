"""Experiment tracking (TensorBoard, MLflow, W&B offline) after a real run, the missing-extra
error, the exported tokenizers (userdp's byte tokenizer and trained BPE as PreTrainedTokenizerFast
with the shards' ids), and the model folder of a run loading with transformers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from userdp.clients.tokenization import ByteTokenizer

from userdp.config import ConfigError, parse_config
from userdp.run.export import byte_tokenizer_fast
from userdp.run.launch import run

TEXTS = ["hello world", "naïve café ☕", "tabs\tand\nnewlines", "", "<pad> is text here"]


def _config(tmp_path: Path, **output):
    return parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 32, "eval_fraction": 0.1},
            "model": {"preset": "llama-tiny"},
            "strategy": {
                "steps": 3,
                "sampling_prob": 0.25,
                "group_size": 2,
                "engine": "vectorized",
            },
            "privacy": {"epsilon": 20.0},
            "output": {"dir": str(tmp_path / "run"), "seed": 0, **output},
        }
    )


def test_trackers_receive_the_metrics_and_the_report(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = _config(tmp_path, report_to=["tensorboard", "mlflow", "wandb"])
    result = run(config, mode="in-process", quiet=True)
    out = result.run_dir
    assert result.steps_done == 3

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/epsilon", "train/clip_fraction", "eval/eval_loss"} <= set(tags)
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in metrics if r["kind"] == "step"]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)
    assert "privacy/epsilon" in tags

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    client = mlflow.tracking.MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("userdp").experiment_id])
    assert [m.step for m in client.get_metric_history(found.info.run_id, "train/loss")] == [0, 1, 2]
    assert found.data.params["strategy.steps"] == "3"
    report_path = client.download_artifacts(found.info.run_id, "privacy_report.json", str(tmp_path))
    report = json.loads(Path(report_path).read_text())
    assert report["epsilon"] == pytest.approx(result.epsilon)

    offline = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0


def test_a_backend_without_its_package_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    """`config check` and the run's start name the extra; the worker and coordinator, which do
    not track, load the same config without it."""
    from userdp.cli import main
    from userdp.config import load_config
    from userdp.run.tracking import Trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    path = tmp_path / "run.toml"
    path.write_text('[output]\nreport_to = ["tensorboard", "mlflow"]\n')
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        "output.report_to: 'mlflow' needs the mlflow package: pip install 'userdp[tracking]'" in err
    )
    assert load_config(path).output.report_to == ["tensorboard", "mlflow"]
    with pytest.raises(ValueError, match=r"'mlflow' needs the mlflow package"):
        Trackers(["mlflow"], tmp_path, {})
    with pytest.raises(ConfigError, match="report_to"):
        parse_config({"output": {"report_to": ["comet"]}})


def test_the_byte_tokenizer_exports_with_the_same_ids() -> None:
    ours = ByteTokenizer()
    fast = byte_tokenizer_fast()
    assert len(fast) == ours.info.vocab_size == 259
    assert (fast.pad_token_id, fast.eos_token_id) == (ours.info.pad_id, ours.info.eos_id)
    expected = ours.encode_arrow(pa.array(TEXTS))
    for text, ids in zip(TEXTS, expected, strict=True):
        want = np.asarray(ids.values).tolist()
        assert fast(text, add_special_tokens=False)["input_ids"] == want, text
        assert fast.decode(want) == text


def test_a_trained_bpe_exports_as_a_fast_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer
    from userdp.clients.shard_format import read_manifest
    from userdp.clients.tokenization import load_tokenizer

    from userdp import cli
    from userdp.run.export import hf_tokenizer

    rows = [{"user": f"u{i % 7}", "text": f"{t} number {i}"} for i, t in enumerate(TEXTS * 8)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shards = tmp_path / "shards"
    argv = ["shard", str(source), "--user-column", "user", "--text-column", "text"]
    argv += ["--out", str(shards), "--tokenizer", "bpe:300", "--num-shards", "1"]
    assert cli.main(argv) == 0
    info = read_manifest(shards).tokenizer
    hf_tokenizer(info, shards).save_pretrained(tmp_path / "exported")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert (loaded.pad_token_id, loaded.eos_token_id) == (info.pad_id, info.eos_id)
    ours = load_tokenizer(shards)
    for text, ids in zip(TEXTS, ours.encode_arrow(pa.array(TEXTS)), strict=True):
        want = np.asarray(ids.values).tolist()
        assert loaded(text, add_special_tokens=False)["input_ids"] == want, text


def test_a_tokenizer_trained_on_the_users_text_is_a_report_caveat(tmp_path: Path) -> None:
    from userdp.accounting.ledger import Ledger
    from userdp.accounting.mechanisms import UlsMechanism

    from userdp import cli
    from userdp.run.report import TRAINED_TOKENIZER_CAVEAT, render_report

    rows = [{"user": f"u{i % 7}", "text": f"{t} number {i}"} for i, t in enumerate(TEXTS * 8)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reports = {}
    for spec in ("bpe:300", "byte"):
        shards = tmp_path / spec.replace(":", "-")
        argv = ["shard", str(source), "--user-column", "user", "--text-column", "text"]
        assert cli.main([*argv, "--out", str(shards), "--tokenizer", spec]) == 0
        run_dir = tmp_path / f"run-{spec.replace(':', '-')}"
        run_dir.mkdir()
        with Ledger.create(run_dir / "ledger.jsonl") as ledger:
            ledger.append(0, UlsMechanism(1.0, 0.1))
        config = parse_config({"data": {"shards": str(shards)}})
        reports[spec] = render_report(run_dir, config, 1e-5)
    assert TRAINED_TOKENIZER_CAVEAT in reports["bpe:300"]["caveats"]
    assert TRAINED_TOKENIZER_CAVEAT not in reports["byte"]["caveats"]
