"""The missing-certificate hint of read_tls_files names each role once."""

import pytest
from userdp.proto.channels import read_tls_files


def test_the_coordinators_own_hint_does_not_repeat_its_name(tmp_path):
    with pytest.raises(ValueError) as info:
        read_tls_files(tmp_path, "coordinator")
    assert "--names coordinator`" in str(info.value)
    with pytest.raises(ValueError) as info:
        read_tls_files(tmp_path, "worker-3")
    assert "--names coordinator,worker-3`" in str(info.value)
