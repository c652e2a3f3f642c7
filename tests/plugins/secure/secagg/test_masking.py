"""SecAgg's field and masks: a masked update is uniform and unrelated to the plaintext, and
every field width sums exactly and travels as its integer type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedweave.plugins.secure.secagg import MASKED

from .rounds import assert_mean_within_quantization, masked_round, unmask


def test_a_masked_update_is_uniform_and_uncorrelated_with_the_plaintext() -> None:
    plugin, fed, plain, masked = masked_round(4, bits=32)
    field = plugin.field
    values = field.from_wire(masked[0].tensors[MASKED]).astype(np.float64) / 2**32
    x = torch.cat([t.reshape(-1) for t in plain[0].tensors.values() if t.is_floating_point()]).numpy()
    counts = np.histogram(values, bins=16, range=(0, 1))[0]
    expected = len(values) / 16
    chi2 = ((counts - expected) ** 2 / expected).sum()
    # The masks come from keys drawn from the OS, so this is a statistical test: thresholds at
    # p = 1e-6 (chi-square, 15 degrees of freedom) and 5 sigma keep a false alarm out of any CI run.
    assert chi2 < 56.5
    assert abs(np.corrcoef(values, x)[0, 1]) < 5 / np.sqrt(len(x))
    # the same update masked in another round looks unrelated to the first masking
    _, _, _, again = masked_round(4, rnd=2, bits=32)
    other = field.from_wire(again[0].tensors[MASKED]).astype(np.float64) / 2**32
    assert abs(np.corrcoef(values, other)[0, 1]) < 5 / np.sqrt(len(x))


@pytest.mark.parametrize(("bits", "dtype", "max_examples"), [(24, torch.int32, 256), (32, torch.int32, 2**16), (33, torch.int64, 256), (40, torch.int64, 2**16)])
def test_other_field_sizes_sum_exactly_and_travel_as_their_width(bits: int, dtype: torch.dtype, max_examples: int) -> None:
    plugin, fed, plain, masked = masked_round(4, bits=bits, max_examples=max_examples)
    for m in masked:
        assert m.tensors[MASKED].dtype == dtype and m.tensors[MASKED].numel() == 32 * 20 + 32 + 4 * 32 + 4
        values = plugin.field.from_wire(m.tensors[MASKED])
        assert int(values.max()) < 2**bits  # reduced into the field
    assert_mean_within_quantization(unmask(plugin, fed, masked), plain, plugin)
