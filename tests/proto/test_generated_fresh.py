"""The committed generated modules must equal a fresh regeneration from the .proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _regenerate_module():
    spec = importlib.util.spec_from_file_location("_regen", REPO / "proto" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    regen = _regenerate_module()
    written = regen.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(regen.generated_names())
    stale = [p.name for p in written if (REPO / "proto" / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"generated code is stale: {stale}; run .venv/bin/python proto/regenerate.py"


def test_staleness_check_detects_an_edit(tmp_path: Path) -> None:
    """The comparison above is not vacuous: a changed .proto yields different bytes."""
    regen = _regenerate_module()
    original = regen.PROTO_DIR
    edited = tmp_path / "src"
    edited.mkdir()
    text = (original / "userdp_v1.proto").read_text()
    (edited / "userdp_v1.proto").write_text(
        text.replace("message Drain {", "message Drain {\n  string extra_field = 9;")
    )
    regen.PROTO_DIR = edited
    try:
        written = regen.generate(tmp_path / "out")
    finally:
        regen.PROTO_DIR = original
    pb2 = next(p for p in written if p.name == "userdp_v1_pb2.py")
    assert pb2.read_bytes() != (REPO / "proto" / "userdp_v1_pb2.py").read_bytes()
