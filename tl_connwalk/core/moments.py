"""Running weighted means and spreads that merge exactly (Chan, Golub and LeVeque 1979).

A summary of weighted observations ``x_b`` with weights ``w_b`` is the triple

- ``count n = sum_b w_b``,
- ``mean m = (1/n) sum_b w_b x_b``,
- ``M2 = sum_b w_b (x_b - m)^2``,

kept per cell of a tensor. Two summaries of disjoint data merge into the summary of their
union without seeing the data again (Chan's parallel algorithm):

``n = n_a + n_b``, ``delta = m_b - m_a``, ``m = m_a + delta n_b / n``,
``M2 = M2_a + M2_b + delta^2 n_a n_b / n``.

So a corpus can be summarised batch by batch, on several processes, and merged in any
grouping: the result equals the one-pass summary up to float rounding. The spread is
``std = sqrt(M2 / n)`` (the weighted population standard deviation) and ``cv = std / |m|``.
NaN cells stay NaN.

``M2`` is always a sum of squared deviations from the mean, never ``sum w x^2 - n m^2``: that
difference of two nearly equal numbers leaves rounding noise of about ``sqrt(eps) |m|`` in
``std`` (1.5e-8 relative in float64) where the data do not vary at all. Here data that do not
vary give ``M2 = 0`` exactly (`of_weighted`).
"""

import dataclasses
from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Moments:
    """``count`` (total weight), ``mean`` and ``M2`` of weighted observations, per cell.

    ``mean`` and ``m2`` share one shape ``[*cell]``; ``count`` is one number for every cell,
    or a tensor of counts per cell (`of_weighted`; a cell without weight has count 0).
    """

    count: float | Float[Tensor, "*cell"]
    mean: Float[Tensor, "*cell"]
    m2: Float[Tensor, "*cell"]

    @classmethod
    def of(cls, values: Float[Tensor, "*cell"], weight: float | int) -> "Moments":
        """One observation ``values`` of weight ``weight`` (> 0): ``M2 = 0``; float64."""
        mean = values.to(torch.float64)
        return cls(count=float(weight), mean=mean, m2=torch.zeros_like(mean))

    @classmethod
    def of_weighted(
        cls, values: Float[Tensor, "*cell obs"], weights: Float[Tensor, "*#cell obs"]
    ) -> "Moments":
        """The observations along the last axis with weights ``>= 0`` (broadcast), counts per cell.

        Two passes, both centred on an observation ``c`` of the cell (its heaviest)::

            m = c + sum_b w_b (x_b - c) / n,    M2 = sum_b w_b (x_b - m)^2

        so equal observations give their value as ``m`` and ``M2 = 0`` exactly (a plain
        ``sum w x / n`` rounds to a neighbour of the value and leaves ``M2 ~ (eps m)^2``).
        Values of weight 0 must be finite (they are multiplied by 0). A cell without weight
        has count, mean and ``M2`` 0, and merging it changes nothing. Keeps the inputs' dtype.

        >>> Moments.of_weighted(torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 1.0]])).m2
        tensor([2.])
        >>> Moments.of_weighted(torch.full((1, 3), 0.1), torch.ones(1, 3)).m2
        tensor([0.])
        """
        weights = weights.expand_as(values)
        count = weights.sum(-1)
        centre = values.gather(-1, weights.argmax(-1, keepdim=True))
        shift = (weights * (values - centre)).sum(-1) / torch.where(count > 0, count, 1.0)
        mean = torch.where(count > 0, centre[..., 0] + shift, 0.0)
        m2 = (weights * (values - mean[..., None]).square()).sum(-1)
        return cls(count=count, mean=mean, m2=m2)

    @classmethod
    def of_edges(
        cls,
        values: Float[Tensor, "*family batch query key"],
        walk: Float[Tensor, "batch query key"],
    ) -> "Moments":
        """`of_weighted` over the edges ``(query, key)``: the walk-weighted moments of per-edge
        values, per batch element (and family), the one home of every walk-weighted spread.

        >>> Moments.of_edges(torch.ones(2, 1, 3, 3), torch.full((1, 3, 3), 1 / 3)).cv
        tensor([[0.], [0.]])
        """
        return cls.of_weighted(values.flatten(-2), walk.flatten(-2))

    @classmethod
    def merged(cls, parts: "Sequence[Moments]") -> "Moments":
        """The summary of every part's data at once (parts with tensor counts of one shape):
        what merging them one by one gives, in a fixed number of operations. Centred on the
        heaviest part's mean ``c``::

            n = sum_k n_k,   m = c + sum_k n_k (m_k - c) / n,
            M2 = sum_k M2_k + sum_k n_k (m_k - m)^2

        so parts of one equal value give it as ``m`` and ``M2 = 0`` exactly.

        >>> halves = [Moments.of_weighted(torch.tensor([[v]]), torch.ones(1, 1)) for v in (1., 3.)]
        >>> Moments.merged(halves).m2
        tensor([2.])
        """
        count, mean, m2 = (
            torch.stack([torch.as_tensor(getattr(part, name)) for part in parts])
            for name in ("count", "mean", "m2")
        )
        total = count.sum(0)
        centre = mean.gather(0, count.argmax(0, keepdim=True))[0]
        shift = (count * (mean - centre)).sum(0) / torch.where(total > 0, total, 1.0)
        merged = torch.where(total > 0, centre + shift, 0.0)
        spread = (count * (mean - merged).square()).sum(0)
        return cls(count=total, mean=merged, m2=m2.sum(0) + spread)

    def merge(self, other: "Moments") -> "Moments":
        """The summary of both summaries' data (Chan's parallel update, see the module)."""
        count = self.count + other.count
        share: float | Tensor
        if isinstance(count, Tensor):  # per-cell counts: a cell empty on both sides stays so
            share = torch.where(count > 0, other.count / torch.where(count > 0, count, 1.0), 0.0)
        else:
            share = other.count / count
        delta = other.mean - self.mean
        mean = self.mean + delta * share
        m2 = self.m2 + other.m2 + delta**2 * (self.count * share)
        return Moments(count=count, mean=mean, m2=m2)

    @property
    def std(self) -> Float[Tensor, "*cell"]:
        """``sqrt(M2 / count)``, the weighted population standard deviation (0 without weight)."""
        count = self.count
        if isinstance(count, Tensor):
            count = torch.where(count > 0, count, 1.0)  # an empty cell has M2 = 0
        return (self.m2 / count).clamp_min(0.0).sqrt()

    @property
    def cv(self) -> Float[Tensor, "*cell"]:
        """The coefficient of variation ``std / |mean|``; 0 where the mean is 0 (``0/0``: no
        weight, or every value 0).

        >>> Moments.of_weighted(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2)).cv
        tensor([0.5000])
        """
        mean = self.mean.abs()  # NaN != 0: a NaN cell stays NaN
        return torch.where(mean != 0, self.std / torch.where(mean != 0, mean, 1.0), 0.0)
