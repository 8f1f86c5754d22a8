"""Random test problems shared by the math-core tests (float64 unless asked otherwise).

One generator per call, drawn in a fixed order (scores, field, W_V, W_O, b_V, b_O, mu), so a
seed names one problem whatever parts a test uses.
"""

import dataclasses

import torch
from torch import Tensor

from tl_connwalk.core.walk import gates as split_gates
from tl_connwalk.core.walk import walk_matrix

F64 = torch.float64


@dataclasses.dataclass(frozen=True)
class Problem:
    """Per-head patterns, the field they read, head weights, biases and a positive measure."""

    pattern: Tensor  # [batch, head, query, key]
    field: Tensor  # [batch, key, d_model]
    W_V: Tensor  # [head, d_model, d_head]
    W_O: Tensor  # [head, d_head, d_model]
    b_V: Tensor  # [head, d_head]
    b_O: Tensor  # [d_model]
    mu: Tensor  # [batch, pos], > 0

    @property
    def walk(self) -> Tensor:
        return walk_matrix(self.pattern)

    @property
    def gates(self) -> Tensor:
        return split_gates(self.pattern)


def random_problem(
    batch: int = 2,
    heads: int = 3,
    pos: int = 5,
    d_model: int = 12,
    d_head: int = 3,
    *,
    seed: int = 0,
    causal: bool = False,
    temperature: float = 2.0,
    dtype: torch.dtype = F64,
) -> Problem:
    """Softmax patterns of Gaussian scores (times ``temperature``), Gaussian weights and field."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    scores = temperature * randn(batch, heads, pos, pos)
    if causal:
        scores = scores.masked_fill(torch.ones(pos, pos).triu(1).bool(), float("-inf"))
    parts = [
        scores.softmax(-1),
        randn(batch, pos, d_model),
        randn(heads, d_model, d_head),
        randn(heads, d_head, d_model),
        randn(heads, d_head),
        randn(d_model),
        torch.rand(batch, pos, generator=gen, dtype=F64) + 0.1,
    ]
    return Problem(*(part.to(dtype) for part in parts))


def symmetric_problem(
    batch: int = 2,
    heads: int = 3,
    pos: int = 5,
    d_model: int = 6,
    d_head: int = 2,
    *,
    seed: int = 0,
) -> Problem:
    """A reversible walk with paired transports ``T_ji = T_ij^T`` (float64).

    ``W = S / rowsum(S)`` for a symmetric positive ``S`` (reversible w.r.t. ``mu = rowsum(S)``,
    returned as ``mu``), gates symmetric in ``(i, j)`` and symmetric head maps
    (``W_O^h = W_V^h^T``), so ``T_ij = H sum_h g^h_ij T^h`` is symmetric and equals ``T_ji``.
    """
    gen = torch.Generator().manual_seed(seed)
    raw = torch.rand(batch, pos, pos, generator=gen, dtype=F64) + 0.05
    sym = raw + raw.mT
    mu = sym.sum(-1)
    walk = sym / mu[..., None]
    scores = torch.randn(batch, heads, pos, pos, generator=gen, dtype=F64)
    gates = (scores + scores.mT).softmax(1)
    pattern = heads * walk[:, None] * gates
    W_V = torch.randn(heads, d_model, d_head, generator=gen, dtype=F64)
    field = torch.randn(batch, pos, d_model, generator=gen, dtype=F64)
    return Problem(
        pattern=pattern,
        field=field,
        W_V=W_V,
        W_O=W_V.mT.contiguous(),
        b_V=torch.zeros(heads, d_head, dtype=F64),
        b_O=torch.zeros(d_model, dtype=F64),
        mu=mu,
    )
