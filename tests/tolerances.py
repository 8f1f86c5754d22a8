"""Dtype-aware tolerances, in one place.

Identities are checked relative to the size of the reference: ``atol = rtol * max|expected|``.
float32: 2e-6 relative (a few ulps after ~d_model-long sums); float64: 1e-12;
half precision caches are computed in float32 from rounded inputs: 2e-2.
"""

import torch

RTOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None
) -> None:
    """``|actual - expected| <= rtol * (max|expected| + |expected|)`` elementwise, rtol by dtype."""
    rtol = RTOL[dtype or expected.dtype]
    expected = expected.to(actual)
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-30))
