"""Patched head transports, as maps on the messages a head already sends (spec §1-3).

Pure functions on tensors. Head ``h`` sends ``m^h_j = v^h_j W_O^h`` with the value
``v^h_j = x_j W_V^h + b_V^h``; its transport is ``T^h = W_V^h W_O^h = U S V^T``, with ``U``, ``V``
(``d_model x r``) orthonormal and ``S = diag(sigma_1..r)``, ``r = d_head`` unless some
``sigma_k`` vanish (then only the non-zero ones are kept: the patch is exact on the range the head
actually has). The scale is ``s = mean sigma`` over those ``r`` values, as in the isometry defect.

A message only knows ``x_j`` through ``x_j U`` (the head reads nothing else), so every patch here
is a ``d_model x d_model`` map ``R^h`` applied to the messages, ``m'^h_j = m^h_j R^h``; this is the
same as replacing the output weights by ``W_O'^h = W_O^h R^h`` with ``W_V^h`` and ``b_V^h`` kept,
so the bias rides through the patched read-out exactly like the rest of the value:

    isometric   R = s V S^-1 V^T    W_V W_O' = s U V^T   (nearest scaled partial isometry)
    scalar      R = s V S^-1 U^T    W_V W_O' = s U U^T   (s times the projection onto span U)

``span U`` is the column space of ``T^h`` (= that of ``W_V^h``: the directions the head reads),
so the scalar patch writes each read component back unturned. The projection onto the image
``span V`` instead would need components of ``x_j`` the head never reads, which no message holds.

``R`` is kept factored, ``R = read @ write`` with ``read`` ``[head, d_model, rank]`` and ``write``
``[head, rank, d_model]`` (rank ``<= d_head``), so nothing ``d_model x d_model`` is ever formed.
"""

import torch
from einops import einsum
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core.isometry import working_dtype
from tl_connwalk.errors import ConnWalkError

#: Singular values at or below ``RANK_RTOL * sigma_max`` (per head) count as zero.
RANK_RTOL = 1e-6


def head_transport_svd(
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    rtol: float = RANK_RTOL,
) -> tuple[
    Float[Tensor, "head d_model rank"],
    Float[Tensor, "head rank"],
    Float[Tensor, "head d_model rank"],
]:
    """The thin SVD ``T^h = U diag(sigma) V^T`` of every head transport, in float32 or wider.

    From the QR factors of ``W_V^h`` and ``W_O^h^T`` (no ``d_model x d_model`` SVD);
    ``rank = min(d_model, d_head)``, descending. Singular values ``<= rtol * sigma_max`` and
    their vectors are set to exactly 0, so that the kept part is the head's honest range.

    >>> U, sigma, V = head_transport_svd(torch.randn(3, 16, 4), torch.randn(3, 4, 16))
    >>> U.shape, sigma.shape
    (torch.Size([3, 16, 4]), torch.Size([3, 4]))
    """
    if W_V.shape[0] != W_O.shape[0] or W_V.shape[1:] != W_O.shape[:0:-1]:
        raise ConnWalkError(
            f"W_V {tuple(W_V.shape)} and W_O {tuple(W_O.shape)} do not compose: need "
            "W_V [head, d_model, d_head] and W_O [head, d_head, d_model]."
        )
    dtype = working_dtype(W_V, W_O)
    Q_V, R_V = torch.linalg.qr(W_V.to(dtype))
    Q_O, R_O = torch.linalg.qr(W_O.to(device=W_V.device, dtype=dtype).transpose(-1, -2))
    core = einsum(R_V, R_O, "head r d_head, head q d_head -> head r q")
    u, sigma, wh = torch.linalg.svd(core)
    kept = (sigma > rtol * sigma[:, :1]).to(dtype)
    U = einsum(Q_V, u, "head d_model r, head r rank -> head d_model rank") * kept[:, None]
    V = einsum(Q_O, wh, "head d_model q, head rank q -> head d_model rank") * kept[:, None]
    return U, sigma * kept, V


def transport_scale(sigma: Float[Tensor, "head rank"]) -> Float[Tensor, " head"]:
    """The scale ``s = mean sigma`` over each head's non-zero singular values (0 for a zero head).

    >>> transport_scale(torch.tensor([[3.0, 1.0, 0.0]]))
    tensor([2.])
    """
    count = (sigma > 0).sum(-1)
    return sigma.sum(-1) / count.clamp(min=1).to(sigma.dtype)


def _inverse_scaled(sigma: Tensor) -> Tensor:
    """``s / sigma_k`` on the kept values, 0 on the dropped ones."""
    safe = torch.where(sigma > 0, sigma, torch.ones_like(sigma))
    ratio = transport_scale(sigma)[:, None] / safe
    return torch.where(sigma > 0, ratio, torch.zeros_like(sigma))


def isometric_message_map(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> tuple[Float[Tensor, "head d_model rank"], Float[Tensor, "head rank d_model"]]:
    """Factors ``(read, write)`` of ``R^h = s V S^-1 V^T``: ``W_V^h W_O^h R^h = s U V^T``.

    ``U V^T`` is the polar factor of ``T^h`` on its range and ``s`` the mean singular value, so
    the patched transport is the nearest scaled partial isometry (its isometry defect is 0).

    >>> read, write = isometric_message_map(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> read.shape, write.shape
    (torch.Size([2, 8, 4]), torch.Size([2, 4, 8]))
    """
    _, sigma, V = head_transport_svd(W_V, W_O)
    read = V * _inverse_scaled(sigma)[:, None]
    return read, V.transpose(-1, -2)


def scalar_message_map(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> tuple[Float[Tensor, "head d_model rank"], Float[Tensor, "head rank d_model"]]:
    """Factors ``(read, write)`` of ``R^h = s V S^-1 U^T``: ``W_V^h W_O^h R^h = s U U^T``.

    ``s`` times the orthogonal projection onto the column space of ``T^h`` (the directions the
    head reads): a transport that scales but never turns.

    >>> read, write = scalar_message_map(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> (read @ write).shape
    torch.Size([2, 8, 8])
    """
    U, sigma, V = head_transport_svd(W_V, W_O)
    read = V * _inverse_scaled(sigma)[:, None]
    return read, U.transpose(-1, -2)


def apply_message_map(
    messages: Float[Tensor, "batch key head d_model"],
    read: Float[Tensor, "head d_model rank"],
    write: Float[Tensor, "head rank d_model"],
) -> Float[Tensor, "batch key head d_model"]:
    """``m'^h_j = m^h_j read^h write^h`` for every head, computed in the maps' dtype.

    The result has the dtype of ``messages``.

    >>> m = torch.randn(1, 3, 2, 8)
    >>> apply_message_map(m, torch.eye(8).expand(2, 8, 8), torch.eye(8).expand(2, 8, 8)).shape
    torch.Size([1, 3, 2, 8])
    """
    coords = einsum(
        messages.to(read.dtype),
        read,
        "batch key head d_model, head d_model rank -> batch key head rank",
    )
    patched = einsum(
        coords, write, "batch key head rank, head rank d_model -> batch key head d_model"
    )
    return patched.to(messages.dtype)


def patched_output_weights(
    W_O: Float[Tensor, "head d_head d_model"],
    read: Float[Tensor, "head d_model rank"],
    write: Float[Tensor, "head rank d_model"],
) -> Float[Tensor, "head d_head d_model"]:
    """The equivalent output weights ``W_O'^h = W_O^h R^h`` of a message map (float32 or wider).

    With ``W_V^h`` and ``b_V^h`` unchanged, a head with these output weights sends exactly the
    patched messages; ``(W_V, W_O')`` is what the isometry measurements take.

    >>> patched_output_weights(torch.randn(2, 4, 8), *isometric_message_map(
    ...     torch.randn(2, 8, 4), torch.randn(2, 4, 8))).shape
    torch.Size([2, 4, 8])
    """
    through = einsum(
        W_O.to(read.dtype), read, "head d_head d_model, head d_model rank -> head d_head rank"
    )
    return einsum(through, write, "head d_head rank, head rank d_model -> head d_head d_model")
