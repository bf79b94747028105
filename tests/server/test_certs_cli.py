"""`userdp certs dev-ca`: files, key permissions, chain and names."""

from __future__ import annotations

import stat

from cryptography import x509

from userdp.cli import main


def test_dev_ca_writes_verifiable_certificates(tmp_path, capsys):
    out = tmp_path / "tls"
    assert main(["certs", "dev-ca", "--out", str(out), "--names", "coordinator,worker-0"]) == 0
    assert "wrote 6 files" in capsys.readouterr().out
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((out / "worker-0.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    cn = cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
    assert cn == "worker-0"
    for key in ("ca.key", "worker-0.key", "coordinator.key"):
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o600


def test_dev_ca_rejects_bad_names(tmp_path, capsys):
    assert main(["certs", "dev-ca", "--out", str(tmp_path), "--names", "ok,bad name"]) == 2
    assert "--names" in capsys.readouterr().err
