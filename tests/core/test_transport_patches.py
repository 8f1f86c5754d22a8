"""Patched head transports (core/transport_patches.py) against dense float64 SVDs.

References form ``T^h = W_V^h W_O^h`` densely and call ``torch.linalg.svd``; the patched maps
must agree to float64 rounding times each head's condition number (relative to the largest
entry), and the patched heads' isometry defect must vanish.
"""

import pytest
import torch
from einops import einsum
from jaxtyping import TypeCheckError

from tests.tolerances import atol, rtol
from tl_connwalk.core.isometry import head_transport_defects
from tl_connwalk.core.transport_patches import (
    apply_message_map,
    head_transport_svd,
    isometric_message_map,
    patched_output_weights,
    scalar_message_map,
    transport_scale,
)
from tl_connwalk.core.walk import head_messages
from tl_connwalk.errors import ConnWalkError

F64 = torch.float64


def heads(n_heads=3, d_model=12, d_head=4, seed=0, drop_rank=False):
    gen = torch.Generator().manual_seed(seed)
    W_V = torch.randn(n_heads, d_model, d_head, generator=gen, dtype=F64)
    W_O = torch.randn(n_heads, d_head, d_model, generator=gen, dtype=F64)
    if drop_rank:  # head 0 loses one direction: rank d_head - 1
        W_O[0, -1] = 0.0
    return W_V, W_O


def dense_targets(W_V, W_O):
    """``(s U V^T, s U U^T)`` per head from a dense SVD over the non-zero singular values."""
    isometric, scalar = [], []
    for T in W_V @ W_O:
        U, sigma, Vh = torch.linalg.svd(T)
        rank = int((sigma > rtol(F64, T.shape[-1]) * sigma[0]).sum())  # non-zero to rounding
        U, sigma, Vh = U[:, :rank], sigma[:rank], Vh[:rank]
        s = sigma.mean()
        isometric.append(s * U @ Vh)
        scalar.append(s * U @ U.T)
    return torch.stack(isometric), torch.stack(scalar)


def close(actual, expected, W_V, W_O):
    """Equal to float64 rounding, relative to the largest entry: an SVD's error grows like
    ``d_model`` ulps (``rtol`` of ``d_model^2`` terms), times the largest condition number
    ``sigma_1 / sigma_r`` of the heads over their non-zero values (the patch divides by them)."""
    sigma = torch.linalg.svdvals(W_V @ W_O)
    nonzero = sigma > rtol(F64, sigma.shape[-1]) * sigma[:, :1]
    cond = (sigma[:, :1] / torch.where(nonzero, sigma, torch.inf).amin(-1, keepdim=True)).max()
    tol = atol(F64, W_V.shape[1] ** 2, scale=cond.item() * expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol)


@pytest.mark.parametrize("drop_rank", [False, True])
def test_patched_transports_match_dense_svd(drop_rank):
    W_V, W_O = heads(drop_rank=drop_rank)
    isometric, scalar = dense_targets(W_V, W_O)
    for make, target in ((isometric_message_map, isometric), (scalar_message_map, scalar)):
        W_O_patched = patched_output_weights(W_O, *make(W_V, W_O))
        close(W_V @ W_O_patched, target, W_V, W_O)


def test_patched_heads_are_scaled_isometries():
    W_V, W_O = heads()
    assert head_transport_defects(W_V, W_O).min() > 0.05
    for make in (isometric_message_map, scalar_message_map):
        W_O_patched = patched_output_weights(W_O, *make(W_V, W_O))
        torch.testing.assert_close(
            head_transport_defects(W_V, W_O_patched),
            torch.zeros(3, dtype=F64),
            atol=atol(F64, W_V.shape[1] ** 2),  # centred: an SVD's rounding, not its root
            rtol=0,
        )


def test_scale_is_mean_singular_value():
    W_V, W_O = heads()
    _, sigma, _ = head_transport_svd(W_V, W_O)
    reference = torch.linalg.svdvals(W_V @ W_O)[:, :4].mean(-1)
    close(transport_scale(sigma), reference, W_V, W_O)
    assert transport_scale(torch.zeros(1, 3, dtype=F64)).item() == 0.0


def test_messages_patch_equals_patched_output_weights():
    """``m R`` is what a head with ``W_O' = W_O R`` sends, bias ``b_V`` included."""
    W_V, W_O = heads()
    gen = torch.Generator().manual_seed(3)
    field = torch.randn(2, 5, 12, generator=gen, dtype=F64)
    b_V = torch.randn(3, 4, generator=gen, dtype=F64)
    read, write = isometric_message_map(W_V, W_O)
    patched = apply_message_map(head_messages(field, W_V, b_V, W_O), read, write)
    close(
        patched, head_messages(field, W_V, b_V, patched_output_weights(W_O, read, write)), W_V, W_O
    )
    isometric, _ = dense_targets(W_V, W_O)
    bias_part = head_messages(torch.zeros_like(field), W_V, b_V, W_O)
    linear = einsum(field, isometric, "batch key d_model, head d_model e -> batch key head e")
    close(patched - apply_message_map(bias_part, read, write), linear, W_V, W_O)


def test_float32_weights_are_computed_in_float32():
    W_V, W_O = heads()
    read, write = scalar_message_map(W_V.float(), W_O.float())
    assert read.dtype == write.dtype == torch.float32


def test_mismatched_heads_are_refused():
    W_V, W_O = heads()
    # under test the jaxtyping shape check fires first; without it, our own check does
    with pytest.raises((ConnWalkError, TypeCheckError)):
        head_transport_svd(W_V, W_O[:2])
