"""The dp_accounting adapter: the version check that guards every read of the library's
internals, and the reads themselves on a PLD the library builds."""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from userdp.accounting import dp_accounting_adapter as adapter


def test_the_installed_version_is_supported() -> None:
    adapter.check_version()


@pytest.mark.parametrize("version", ["0.7.0", "0.4.9", "1.0", "0.10.1", "dev"])
def test_an_unknown_version_fails_with_one_line_naming_it_and_the_range(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(adapter, "installed_version", lambda: version)
    with pytest.raises(adapter.UnsupportedDpAccountingVersionError) as info:
        adapter.check_version()
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert f"dp-accounting {version} " in message
    assert "dp-accounting>=0.5,<0.7" in message


def test_reads_give_the_pmfs_and_arrays_the_library_composes() -> None:
    pld = pld_lib.from_gaussian_mechanism(1.0, value_discretization_interval=1e-3)
    assert len(adapter.distinct_pmfs(pld)) == 1  # symmetric: ADD is REMOVE
    remove, add = adapter.directions(pld)
    assert remove is add
    arrays = adapter.dense_arrays(remove)
    assert arrays is not None and arrays.discretization == 1e-3
    assert np.isclose(arrays.probs.sum() + arrays.infinity_mass, 1.0)
    loss = (arrays.lower_loss + np.arange(arrays.probs.size)) * arrays.discretization
    assert np.isclose(float(arrays.probs @ loss), 0.5, atol=1e-3)  # E[loss] = Δ²/(2σ²)
    asymmetric = pld_lib.from_gaussian_mechanism(
        1.0, value_discretization_interval=1e-3, sampling_prob=0.1
    )
    assert len(adapter.distinct_pmfs(asymmetric)) == 2
