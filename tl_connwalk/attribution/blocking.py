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

`edge_effects` computes every ``k_ij`` at once without forming ``dz``; where ``A_ij`` may be
close to 1 (the heaviest key of a row: a sink) ``m_ij`` comes from sums over the other keys, so
``1 - A_ij`` is never computed by cancellation there. `blocked_change` and
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

    Off each row's heaviest key ``A_ij <= 1/2``, so ``k_ij = - A_ij / (1 - A_ij) (g_i . z_i -
    g_i . v_j)`` loses nothing to ``1 - A_ij``; on the heaviest key (a sink's ``A_ij`` may be
    within a few ulps of 1) ``m_ij`` is made from the sums over the row's other keys, never
    from ``1 - A_ij`` by subtraction.

    Cost: one ``[query, d_head] x [d_head, key]`` product per head (``g_i . v_j``) and about a
    dozen elementwise passes over the pattern; memory a few patterns.
    """
    gv = torch.einsum("bqhd,bkhd->bhqk", grad_z, values.to(grad_z))
    A = pattern.to(gv)
    # four [batch, head, query, key] buffers in all, worked in place
    sent = A * gv
    z = sent.sum(-1, keepdim=True)  # g_i . z_i
    effect = torch.sub(gv, z).mul_(A)
    spare = torch.rsub(A, 1).clamp_min_(torch.finfo(A.dtype).tiny)
    effect.div_(spare)
    heaviest = A.argmax(-1, keepdim=True)
    others = spare.copy_(A).scatter_(-1, heaviest, 0).sum(-1, keepdim=True)
    rest = sent.scatter_(-1, heaviest, 0).sum(-1, keepdim=True)
    present = others > 0
    m = rest / torch.where(present, others, 1)
    top = torch.where(present, -A.gather(-1, heaviest) * (m - gv.gather(-1, heaviest)), 0)
    effect.scatter_(-1, heaviest, top)
    own = torch.eye(*A.shape[-2:], dtype=torch.bool, device=A.device)
    return effect.masked_fill_(own, 0)
