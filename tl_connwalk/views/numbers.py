"""Tensors as JSON numbers for a view: nested lists, rounded to `DIGITS` significant digits.

A view embeds its numbers in the page; rounding keeps the file small and loses nothing a
colour or a tooltip shows. Values that are not finite become ``null``.
"""

import math
from typing import Any

from torch import Tensor

#: significant digits every number keeps in a view's page (relative error below ``5e-6``)
DIGITS = 6


def rounded(value: float) -> float | None:
    """``value`` to `DIGITS` significant digits; ``None`` (JSON ``null``) if not finite.

    >>> rounded(3.14159265), rounded(float("nan"))
    (3.14159, None)
    """
    if not math.isfinite(value):
        return None
    return float(f"{value:.{DIGITS}g}")


def as_lists(values: Tensor) -> Any:
    """A tensor as nested lists of `rounded` floats (a 0-d tensor as one float).

    >>> as_lists(torch.tensor([[1.0, 2.0 / 3.0]]))
    [[1.0, 0.666667]]
    """
    listed = values.detach().to("cpu").double().tolist()
    return _round(listed)


def _round(listed: Any) -> Any:
    if isinstance(listed, list):
        return [_round(item) for item in listed]
    return rounded(listed)
