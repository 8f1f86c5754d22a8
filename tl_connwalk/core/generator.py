"""The generator ``L = I - P`` of a connection walk as an operator (spec §1).

Known by its action on fields, like scipy's ``LinearOperator``; dense only on request. Row
vectors throughout: a field ``X`` is ``[batch, pos, d_model]`` and its flattening ``vec(X)``
runs over ``(pos, d_model)`` in row-major order, so the dense operator ``G`` satisfies
``vec(X) @ G == vec(L X)``.
"""

import torch
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core.checks import check_field_shape
from tl_connwalk.core.walk import check_operator, propagate
from tl_connwalk.errors import ConnWalkError

#: Dense generators above this many entries are refused (8 GiB in float32).
MAX_DENSE_ENTRIES = 2**31


class ConnectionGenerator:
    """``L = I - P`` with ``(P X)_i = sum_h sum_j A^h_ij x_j W_V^h W_O^h``.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> L = ConnectionGenerator(A, torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> L.matvec(torch.randn(1, 3, 8)).shape, L.to_dense().shape
    (torch.Size([1, 3, 8]), torch.Size([1, 24, 24]))
    """

    def __init__(
        self,
        pattern: Float[Tensor, "batch head query key"],
        W_V: Float[Tensor, "head d_model d_head"],
        W_O: Float[Tensor, "head d_head d_model"],
    ) -> None:
        check_operator("pattern", pattern, W_V, W_O)
        self.pattern = pattern
        self.W_V = W_V
        self.W_O = W_O

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(batch, pos * d_model, pos * d_model)``: one square operator per batch element."""
        batch, _, n_pos, _ = self.pattern.shape
        size = n_pos * self.W_V.shape[1]
        return (batch, size, size)

    def matvec(
        self, field: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos d_model"]:
        """``L X = X - P X``."""
        check_field_shape(field, (self.pattern.shape[0], self.pattern.shape[-1], self.W_V.shape[1]))
        return field - propagate(self.pattern, field, self.W_V, self.W_O)

    __call__ = matvec

    def to_dense(self) -> Float[Tensor, "batch flat_in flat_out"]:
        """The matrix ``G`` with ``vec(X) @ G = vec(L X)``.

        ``G[(j, f), (i, e)] = delta_(j, f), (i, e) - W_ij T_ij[f, e]``.

        Costs ``batch (n d_model)^2`` numbers: meant for small problems and tests.
        """
        batch, size, _ = self.shape
        if batch * size * size > MAX_DENSE_ENTRIES:
            raise ConnWalkError(
                f"to_dense() would build {batch} x {size} x {size} numbers "
                "(batch x (pos*d_model)^2); "
                "use matvec() on fields, or slice the batch and positions first."
            )
        transports = einsum(
            self.W_V, self.W_O, "head d_model d_head, head d_head out -> head d_model out"
        )
        blocks = einsum(
            self.pattern,
            transports,
            "batch head query key, head d_in d_out -> batch key d_in query d_out",
        )
        dense_p = rearrange(blocks, "batch key d_in query d_out -> batch (key d_in) (query d_out)")
        identity = torch.eye(size, dtype=dense_p.dtype, device=dense_p.device)
        return identity - dense_p

    def __repr__(self) -> str:
        batch, size, _ = self.shape
        return (
            f"ConnectionGenerator(L = I - P, batch={batch}, size={size}x{size}, dense on request)"
        )
