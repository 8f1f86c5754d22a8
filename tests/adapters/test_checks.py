"""The checks the adapters run on cached patterns: non-finite entries found, finite ones let be."""

import pytest
import torch

from tl_connwalk.adapters.checks import check_pattern
from tl_connwalk.errors import ConnWalkError


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_entry_is_named_by_its_head(bad):
    pattern = torch.softmax(torch.randn(2, 3, 4, 4), -1)
    pattern[1, 2, 3, 0] = bad
    with pytest.raises(ConnWalkError, match=r"layer 5: p holds NaN or Inf in heads \[2\]"):
        check_pattern(pattern, "p", 5, n_heads=3)


def test_finite_entries_whose_sum_overflows_pass():
    """The check first sums the pattern; an overflowing sum of finite numbers is no error."""
    pattern = torch.full((1, 2, 3, 3), 3e38)
    assert not torch.isfinite(pattern.sum())
    check_pattern(pattern, "p", 0, n_heads=2)
