"""Blocking one edge of a head's walk, in closed form (spec §7). Tensors in, tensors out.

Blocking key ``j`` for query ``i`` in a head (its pre-softmax score set to ``-inf``) deletes
node ``j`` from row ``i`` of the head's walk and spreads its weight over the other keys in
proportion, exactly:

    A'_ij = 0,   A'_ik = A_ik / (1 - A_ij)  (k != j),
    dz_i = z'_i - z_i = A_ij / (1 - A_ij) (z_i - v_j),

with ``z_i = sum_k A_ik v_k`` the head's output at ``i`` before ``W_O`` (``hook_z``) and
``v_j`` the value of key ``j``. Read along a covector ``g_i`` (the gradient of a target at
``z_i``), the first-order effect of the block, with knockout's sign ``y - y_blocked``, is

    k_ij = - g_i . dz_i = - A_ij (m_ij - g_i . v_j),   m_ij = sum_{k != j} A'_ik g_i . v_k,

``m_ij`` the mean of ``g_i . v`` over the row's other keys, renormalised. A query's own key is
never blocked (knockout keeps every position's own residual stream): ``k_ii = 0``.

`edge_effects` computes every ``k_ij`` at once without forming ``dz``: ``m_ij`` from sums that
exclude ``j`` (left and right cumulative sums), so that ``1 - A_ij`` is never computed by
cancellation where ``A_ij`` is close to 1 (a sink). `blocked_change` and
`edge_effects_reference` are the plain definitions beside it.
"""

import einops
import torch
from jaxtyping import Float
from torch import Tensor


def blocked_change(
    pattern: Float[Tensor, "batch head query key"],
    values: Float[Tensor, "batch key head d_head"],
) -> Float[Tensor, "batch head query key d_head"]:
    """``dz[b, h, i, j]``: how the head's output at ``i`` moves when key ``j`` is blocked.

    The plain definition: the row renormalised without ``j``, its message recomputed, minus the
    clean message; ``z'_i - z_i = A_ij / (1 - A_ij) (z_i - v_j)``. A row with no other key
    (``A_ij = 1``, or ``j = i``) moves by 0. ``[batch, head, query, key, d_head]``: for tests and
    small inputs.

    >>> A = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]])
    >>> v = torch.tensor([[[[2.0]], [[6.0]]]])  # [batch, key, head, d_head]
    >>> blocked_change(A, v)[0, 0, 1, :, 0]  # row 1 sends 0.25 * 2 + 0.75 * 6 = 5; without key 0, 6
    tensor([1., 0.])
    """
    n_query, n_key = pattern.shape[-2:]
    keep = 1 - torch.eye(n_key, dtype=pattern.dtype, device=pattern.device)  # [blocked, key]
    rows = pattern[..., None, :] * keep  # [batch, head, query, blocked, key]
    total = rows.sum(-1, keepdim=True)
    renormalised = torch.where(total > 0, rows / total.clamp_min(torch.finfo(rows.dtype).tiny), 0)
    v = einops.rearrange(values, "batch key head d -> batch head key d")
    blocked = renormalised @ v[:, :, None]  # [batch, head, query, blocked, d]
    clean = pattern @ v  # [batch, head, query, d]
    change = torch.where(total > 0, blocked - clean[..., None, :], 0)
    own = torch.eye(n_query, n_key, dtype=torch.bool, device=pattern.device)
    return change.masked_fill(own[..., None], 0)


def edge_effects_reference(
    pattern: Float[Tensor, "batch head query key"],
    grad_z: Float[Tensor, "batch query head d_head"],
    values: Float[Tensor, "batch key head d_head"],
) -> Float[Tensor, "batch head query key"]:
    """``k_ij = - g_i . dz_ij`` from `blocked_change`, in float64: the reference of
    `edge_effects`."""
    change = blocked_change(pattern.double(), values.double())
    g = einops.rearrange(grad_z.double(), "batch query head d -> batch head query 1 d")
    return -(change * g).sum(-1).to(pattern.dtype)


def _exclusive_sums(x: Float[Tensor, "... key"]) -> Float[Tensor, "... key"]:
    """``sum_{k != j} x_k`` for every ``j``, as the sum left of ``j`` plus the sum right of it
    (never a total minus ``x_j``, which loses what is left of a dominant ``x_j``)."""
    zero = torch.zeros_like(x[..., :1])
    left = torch.cat([zero, x[..., :-1].cumsum(-1)], -1)
    right = torch.cat([x[..., 1:].flip(-1).cumsum(-1).flip(-1), zero], -1)
    return left + right


def edge_effects(
    pattern: Float[Tensor, "batch head query key"],
    grad_z: Float[Tensor, "batch query head d_head"],
    values: Float[Tensor, "batch key head d_head"],
) -> Float[Tensor, "batch head query key"]:
    """``k_ij = - A_ij (m_ij - g_i . v_j)``: the first-order effect on a target of blocking each
    edge ``j -> i`` of each head (spec §7), with knockout's sign (``y - y_blocked``).

    ``grad_z``: the target's gradient at the head outputs ``hook_z`` (``g_i``); ``values``: the
    values as ``hook_v`` holds them, one per query head (grouped-query heads expanded). The
    query's own key gives 0 (it is never blocked), and so does a key whose row holds nothing
    else in the dtype (``sum_{k != j} A_ik = 0``: no other key to renormalise onto).

    Cost: one ``[query, d_head] x [d_head, key]`` product per head (``g_i . v_j``) and a few
    elementwise passes over the pattern; memory a few patterns.
    """
    gv = torch.einsum("bqhd,bkhd->bhqk", grad_z, values.to(grad_z))
    A = pattern.to(gv)
    others = _exclusive_sums(A)
    sent = _exclusive_sums(A * gv)
    present = others > 0
    m = sent / torch.where(present, others, 1)
    effect = torch.where(present, -A * (m - gv), 0)
    own = torch.eye(*A.shape[-2:], dtype=torch.bool, device=A.device)
    return effect.masked_fill(own, 0)
