"""The TOML schema: defaults validate, every bad value is named with its allowed range."""

from __future__ import annotations

from pathlib import Path

import pytest

from userdp.cli import main
from userdp.config import Config, ConfigError, load_config, parse_config


def test_defaults_are_valid() -> None:
    config = parse_config({})
    assert config == Config()
    assert config.privacy.delta is None  # resolved to 1/(10·N) once N is known


def test_full_sections_parse(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        "[data]\nseq_len = 64\n[model]\npreset = 'gpt2-tiny'\n"
        "[strategy]\nname = 'els'\nsampling_prob = 0.01\ngroup_size = 4\nclip_norm = 0.5\n"
        "[privacy]\nepsilon = 2.0\ndelta = 1e-6\n[coordinator]\nport = 50051\n"
        "[workers]\ncount = 3\n[output]\ndir = 'out'\n"
    )
    config = load_config(path)
    assert config.strategy.name == "els"
    assert config.privacy.delta == 1e-6
    assert config.workers.count == 3


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[privacy]\ndelta = 1.5\n", "privacy.delta must be in (0, 1), got 1.5"),
        ("[privacy]\ndelta = 0.0\n", "privacy.delta must be in (0, 1), got 0"),
        ("[privacy]\nepsilon = -1\n", "privacy.epsilon must be in (0, inf), got -1"),
        ("[privacy]\nepsilon = nan\n", "privacy.epsilon must be in (0, inf), got nan"),
        ("[strategy]\nsampling_prob = 0\n", "strategy.sampling_prob must be in (0, 1], got 0"),
        ("[strategy]\nsampling_prob = 1.2\n", "strategy.sampling_prob must be in (0, 1], got 1.2"),
        ("[strategy]\nclip_norm = -0.1\n", "strategy.clip_norm must be in (0, inf), got -0.1"),
        ("[strategy]\ngroup_size = 0\n", "strategy.group_size must be an integer >= 1, got 0"),
        ("[workers]\ncount = 0\n", "workers.count must be an integer >= 1, got 0"),
        ('[strategy]\nsteps = "80"\n', "strategy.steps must be an integer, not a string"),
        ("[strategy]\nsteps = 80.0\n", "strategy.steps must be an integer, got 80.0"),
        ('[privacy]\nepsilon = "8"\n', "privacy.epsilon must be a number, not a string"),
        (
            "[strategy]\nclipnorm = 1.0\n",
            "strategy.clipnorm: unknown key (did you mean 'clip_norm'?",
        ),
        ("[strategy]\nxyzzy = 1.0\n", "strategy.xyzzy: unknown key (check the spelling"),
        (
            "[strategy]\nexpected_batch_size = 10.0\n",
            "strategy.expected_batch_size is set, but strategy.name = 'uls'",
        ),
        ("[data]\nseq_len = 100000000\n", "data.seq_len = 100,000,000 is more than 8192"),
        ("[nonsense]\nx = 1\n", "nonsense: unknown key"),
        ("[strategy]\nname = 'magic'\n", "strategy.name must be a built-in strategy"),
        ("[strategy]\nsampling = 'shuffle'\n", "privacy.allow_unaccounted_sampling = true"),
    ],
)
def test_bad_values_are_named(tmp_path, toml: str, expected: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_shuffle_allowed_only_when_acknowledged() -> None:
    config = parse_config(
        {"strategy": {"sampling": "shuffle"}, "privacy": {"allow_unaccounted_sampling": True}}
    )
    assert config.strategy.sampling == "shuffle"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "config file not found"),
        ("[privacy\nepsilon = 1", "is not valid TOML"),
        ("[privacy]\nbogus = 1\n", "privacy.bogus: unknown key"),
        ("[privacy]\nepsilon = 0\n", "privacy.epsilon must be in (0, inf), got 0"),
        ("[privacy]\ndelta = 2\n", "privacy.delta must be in (0, 1), got 2"),
        ("[strategy]\nsampling_prob = 3\n", "strategy.sampling_prob must be in (0, 1], got 3"),
        ("[strategy]\nclip_norm = -1\n", "strategy.clip_norm must be in (0, inf), got -1"),
        ("[model]\npath = 'gpt2'\n", "/gpt2' is not a folder"),
        ("[model]\npath = 'gpt2'\n", "a hub name such as 'gpt2' cannot be used"),
        ("[model]\nzero_stage = 4\n", "model.zero_stage must be 0, 1, 2 or 3, got 4"),
        ("[model]\nlora_dropout = 0.05\n", "model.lora_dropout = 0.05: only 0 is supported"),
        ("[model]\ndeepspeed_config = 'no.json'\n", "/no.json' is not a file"),
        ("[strategy]\nengine = 'randomized'\n", "strategy.engine = 'randomized' estimates norms"),
        ("[strategy]\nname = 'els'\nbands = 4\n", "strategy.bands is set, but"),
    ],
)
def test_config_check_cli_exit_code_and_one_line(tmp_path, capsys, content, expected) -> None:
    path = tmp_path / "run.toml"
    if content is not None:
        path.write_text(content)
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert err.count("\n") == 1


def test_config_check_accepts_valid_file(tmp_path, capsys) -> None:
    path = tmp_path / "ok.toml"
    path.write_text("[privacy]\nepsilon = 4.0\n")
    assert main(["config", "check", str(path)]) == 0
    assert "ok" in capsys.readouterr().out


def test_model_folder_and_deepspeed_file_are_checked(tmp_path, capsys) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    path = tmp_path / "run.toml"
    path.write_text(f"[model]\npath = '{folder}'\n")
    assert main(["config", "check", str(path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    (folder / "config.json").write_text("{}")
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}')
    path.write_text(f"[model]\npath = '{folder}'\ndeepspeed_config = '{ds}'\n")
    assert main(["config", "check", str(path)]) == 2
    assert "offload_param.device = 'nvme'" in capsys.readouterr().err
    ds.write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}')
    assert main(["config", "check", str(path)]) == 0
    ds.write_text('{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}')
    assert main(["config", "check", str(path)]) == 0


@pytest.mark.parametrize("value", ['"yes"', "1", '"true"', "0", '"false"'])
@pytest.mark.parametrize(
    "section, key",
    [
        ("output", "plots"),
        ("privacy", "allow_unaccounted_sampling"),
        ("workers", "tensor_core_matmul"),
    ],
)
def test_booleans_are_strict(tmp_path, section, key, value) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{section}.{key} must be true or false"), message
    assert "\n" not in message
    path.write_text(f"[{section}]\n{key} = true\n")
    assert getattr(getattr(load_config(path), section), key) is True


def test_more_replicas_than_workers_is_an_error_naming_both_keys() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"workers": {"count": 2, "replicas": 3}})
    message = str(info.value)
    assert "workers.replicas = 3 > workers.count = 2" in message and "\n" not in message
    assert parse_config({"workers": {"count": 3, "replicas": 3}}).workers.replicas == 3


def test_shard_folder_and_tls_folder_are_checked(tmp_path, capsys) -> None:
    path = tmp_path / "run.toml"
    shards, certs = tmp_path / "shards", tmp_path / "certs"
    for config, expected in [
        (f"[data]\nshards = '{shards}'\n", f"data.shards = '{shards}' is not a folder"),
        (f"[coordinator]\ntls_dir = '{certs}'\n", f"coordinator.tls_dir = '{certs}' is not a"),
    ]:
        path.write_text(config)
        assert main(["config", "check", str(path)]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err
    shards.mkdir()
    certs.mkdir()
    path.write_text(f"[data]\nshards = '{shards}'\n[coordinator]\ntls_dir = '{certs}'\n")
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"data.shards = '{shards}' has no manifest.json" in err and err.count("\n") == 1
    assert "tls_dir" not in err
    (shards / "manifest.json").write_text("{}")
    assert main(["config", "check", str(path)]) == 2
    assert "manifest.json: 'format' must be 'userdp-shards'" in capsys.readouterr().err
    _write_shards(tmp_path / "input.jsonl", shards)
    assert main(["config", "check", str(path)]) == 0


def _write_shards(source: Path, out: Path) -> None:
    """A real shard folder (byte tokenizer, 30 users) written by `userdp shard`."""
    import json
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    rows = [{"uid": f"u{i % 30}", "text": f"example {i} " + "w" * (i % 17)} for i in range(90)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    args = ["shard", str(source), "--user-column", "uid", "--text-column", "text"]
    assert main([*args, "--out", str(out)]) == 0


def test_config_check_finds_a_missing_or_truncated_shard_and_a_model_that_does_not_fit(
    tmp_path, capsys
) -> None:
    """What `simulate` would refuse after its workers started is refused by `config check`: a
    shard or index file the manifest lists is gone or has another size, the model's vocabulary
    is smaller than the shards' tokenizer, data.seq_len is above the model's positions."""
    import json

    shards = tmp_path / "shards"
    _write_shards(tmp_path / "input.jsonl", shards)
    capsys.readouterr()
    manifest = json.loads((shards / "manifest.json").read_text())
    entry = manifest["shards"][0]
    path = tmp_path / "run.toml"
    path.write_text(f"[data]\nshards = '{shards}'\n")

    def check() -> str:
        assert main(["config", "check", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        return err

    shard_file = shards / entry["file"]
    data = shard_file.read_bytes()
    shard_file.write_bytes(data[:-10])
    assert f"{shard_file} has {len(data) - 10:,} bytes, the manifest says {len(data):,}" in check()
    shard_file.unlink()
    assert f"{shard_file} is missing (listed in the manifest)" in check()
    shard_file.write_bytes(data)
    (shards / entry["index_file"]).unlink()
    assert "missing (listed in the manifest)" in check()
    _write_shards(tmp_path / "input.jsonl", shards)
    capsys.readouterr()

    vocab = manifest["tokenizer"]["vocab_size"]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": vocab - 1, "n_positions": 64}))
    path.write_text(f"[data]\nshards = '{shards}'\nseq_len = 128\n[model]\npath = '{model}'\n")
    err = check()
    assert f"has vocab_size {vocab - 1} but the shards' tokenizer has {vocab} ids" in err
    assert "data.seq_len = 128 is more than the 64 positions of the model" in err
    (model / "config.json").write_text(json.dumps({"vocab_size": vocab, "n_positions": 128}))
    assert main(["config", "check", str(path)]) == 0


def test_config_check_imports_no_model_library_nor_tracker(tmp_path) -> None:
    """`config check` stays fast: the model, engine and tracking libraries are not imported (the
    tracking backends are looked up with importlib.util.find_spec). A plugin strategy is the
    exception: checking it imports it."""
    import subprocess
    import sys

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text('{"zero_optimization": {"stage": 2}}')
    path = tmp_path / "run.toml"
    path.write_text(
        f"[data]\nshards = '{shards}'\n[model]\npath = '{model}'\n"
        f"deepspeed_config = '{deepspeed}'\n[coordinator]\ntls_dir = '{tmp_path}'\n"
        "[output]\nreport_to = ['tensorboard', 'mlflow', 'wandb']\n"
    )
    heavy = ("torch", "transformers", "deepspeed", "tensorboard", "mlflow", "wandb", "scipy")
    code = (
        "import sys\n"
        "from userdp.cli import main\n"
        f"code = main(['config', 'check', {str(path)!r}])\n"
        f"print(code, ','.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    status, imported = (result.stdout.strip().splitlines()[-1].split(" ") + [""])[:2]
    assert imported == "", f"config check imported {imported}"
    # the trackers may not be installed here: only a missing one makes the check fail
    assert status in ("0", "2"), result.stdout
