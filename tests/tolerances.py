"""Tolerances derived from the dtype and the size of the sums, in one place.

Every comparison in the suite takes its tolerance from here; none is a number picked by hand.

- `rtol(dtype, terms)`: a value computed in ``dtype`` through sums of at most ``terms`` terms
  (a matrix product of inner size ``d`` is ``d`` terms; a chain of sums adds their lengths)
  is off by rounding of about ``sqrt(terms)`` ulps (the errors add like a random walk), so
  ``rtol = SAFETY * sqrt(terms) * eps(dtype)``. Half precision (bfloat16, float16) is stored
  in the half dtype but summed in float32, so its error is a few roundings of each stored
  result, whatever the sums' length: ``rtol = HALF_ROUNDINGS * eps(dtype)``.
- `cancelling_atol(dtype, terms)`: a quantity that is the square root of a difference that
  cancels (a defect near 0 evaluated as ``sqrt(1 - x)`` with ``x ~ 1``, a distance evaluated as
  ``sqrt(||a||^2 + ||b||^2 - 2 a.b)``) keeps only half the digits: an error ``r`` in ``x``
  is ``sqrt(r)`` in the result. So its absolute tolerance (on values of size ~1) is
  ``sqrt(rtol(dtype, terms))``: 6e-8 in float64, 1.4e-3 in float32 (``TERMS`` terms).
- `atol(dtype, terms, scale)`: ``rtol * scale``, the absolute tolerance on values of size
  ``scale`` (``scale = 1``: defects, residuals and other values in [0, 1]).

``eps`` is ``torch.finfo(dtype).eps`` (2.2e-16 in float64, 1.2e-7 in float32). Comparisons are
relative to the size of the reference (`assert_close`): ``atol = rtol * max|expected|``.
"""

import math

import torch

#: Ulps per ``sqrt(terms)``: covers the tail of the rounding errors' distribution and the few
#: products chained in each compared value (the suite's largest error is 0.36 of one such
#: ulp, with one BLAS thread).
SAFETY = 2
#: Roundings to the half dtype that a value computed from half precision inputs goes through.
HALF_ROUNDINGS = 3
#: The longest chain of sums in the suite's random configurations (`tests.architectures`:
#: ``d_model`` 24, ``d_mlp`` 32, 16 positions, 4 heads): the default of `assert_close`.
TERMS = 64
HALF = (torch.bfloat16, torch.float16)


def rtol(dtype: torch.dtype, terms: int = TERMS) -> float:
    """Relative tolerance of a value computed in ``dtype`` through sums of ``terms`` terms:
    ``SAFETY sqrt(terms) eps``; half precision ``HALF_ROUNDINGS eps``."""
    eps = torch.finfo(dtype).eps
    if dtype in HALF:
        return HALF_ROUNDINGS * eps
    return SAFETY * math.sqrt(max(terms, 1)) * eps


def atol(dtype: torch.dtype, terms: int = TERMS, scale: float = 1.0) -> float:
    """Absolute tolerance on values of size ``scale``: ``rtol(dtype, terms) * scale``."""
    return rtol(dtype, terms) * scale


def cancelling_atol(dtype: torch.dtype, terms: int = TERMS, scale: float = 1.0) -> float:
    """Absolute tolerance on the square root of a cancelling difference (``sqrt(1 - x)``,
    ``x ~ 1``): ``sqrt(rtol(dtype, terms)) * scale``, half the digits."""
    return math.sqrt(rtol(dtype, terms)) * scale


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    terms: int = TERMS,
) -> None:
    """``|actual - expected| <= r (max|expected| + |expected|)`` elementwise,
    ``r = rtol(dtype or expected.dtype, terms)``."""
    r = rtol(dtype or expected.dtype, terms)
    expected = expected.to(actual)
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=r, atol=r * max(scale, 1e-30))
