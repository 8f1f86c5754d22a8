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
``std = sqrt(M2 / n)`` (the weighted population standard deviation). NaN cells stay NaN.
"""

import dataclasses

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

        Values of weight 0 must be finite (they are multiplied by 0). A cell without weight
        has count, mean and ``M2`` 0, and merging it changes nothing. Keeps the inputs' dtype.

        >>> Moments.of_weighted(torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 1.0]])).m2
        tensor([2.])
        """
        weights = weights.expand_as(values)
        count = weights.sum(-1)
        mean = (weights * values).sum(-1) / torch.where(count > 0, count, 1.0)
        m2 = (weights * (values - mean[..., None]) ** 2).sum(-1)
        return cls(count=count, mean=mean, m2=m2)

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
