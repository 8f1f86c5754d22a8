"""Every measurement of the spec by its definition: a plain reference beside the fast code.

Read it beside the [specification](../spec.md): each function is one formula of spec §1-§4,
written the slow and obvious way, dense, in float64, one edge and one head at a time (every
``d_model x d_model`` transport formed, every defect from an SVD). Nothing here is fast and
nothing here is shared with the fast code: the test suite holds every fast measurement to
these definitions. Use it to check a number, or to read what a measurement means; use the
package's own functions on real models.

Shapes follow the rest of the core: a pattern is ``[batch, head, query, key]``, a walk
``[batch, query, key]``, a field ``[batch, key, d_model]``, ``W_V`` ``[head, d_model, d_head]``
(grouped-query heads expanded: query head ``h`` reads ``W_V[h] = W_V^{kv(h)}``), ``W_O``
``[head, d_head, d_model]``. Row vectors: a message from key ``j`` to query ``i`` is
``x_j @ T_ij``. Every result is float64.

The walk-weighted summaries take ``keep`` (``[batch, query, key]`` bool, the edges kept) and
``exclude_sink`` (drop key 0) as the spec's "restricted" form: rows renormalised over the kept
edges, and the mean over the rows that keep any mass.
"""

from collections.abc import Callable, Sequence

import torch
from einops import einsum
from torch import Tensor

F64 = torch.float64


def _f64(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.detach().to(device="cpu", dtype=F64) for t in tensors)


# spec §1: the connection walk -------------------------------------------------------------


def walk(pattern: Tensor) -> Tensor:
    """``W_ij = (1/H) sum_h A^h_ij`` (spec §1.2), ``[batch, query, key]``."""
    (A,) = _f64(pattern)
    return A.sum(1) / A.shape[1]


def gates(pattern: Tensor) -> Tensor:
    """``g^h_ij = A^h_ij / sum_h' A^h'_ij``, uniform ``1/H`` where that sum is 0 (spec §1.2)."""
    (A,) = _f64(pattern)
    batch, n_heads, n_query, n_key = A.shape
    g = torch.empty_like(A)
    for b in range(batch):
        for i in range(n_query):
            for j in range(n_key):
                total = A[b, :, i, j].sum()
                g[b, :, i, j] = A[b, :, i, j] / total if total > 0 else 1.0 / n_heads
    return g


def head_transports(W_V: Tensor, W_O: Tensor) -> Tensor:
    """``T^h = W_V^h W_O^h`` (spec §1.1), dense ``[head, d_model, d_model]``."""
    V, Wo = _f64(W_V, W_O)
    return torch.stack([V[h] @ Wo[h] for h in range(V.shape[0])])


def effective_transports(gates: Tensor, W_V: Tensor, W_O: Tensor) -> Tensor:
    """``T_ij = H sum_h g^h_ij T^h`` on every pair (spec §1.2), ``[batch, query, key, d, d]``."""
    (g,) = _f64(gates)
    return g.shape[1] * einsum(g, head_transports(W_V, W_O), "b h i j, h d e -> b i j d e")


def apply(pattern: Tensor, field: Tensor, W_V: Tensor, W_O: Tensor) -> Tensor:
    """``(P X)_i = sum_j W_ij x_j T_ij`` (spec §1), edge by edge."""
    W, (X,) = walk(pattern), _f64(field)
    T = effective_transports(gates(pattern), W_V, W_O)
    batch, n_query, n_key = W.shape
    out = torch.zeros(batch, n_query, X.shape[-1], dtype=F64)
    for b in range(batch):
        for i in range(n_query):
            for j in range(n_key):
                out[b, i] += W[b, i, j] * (X[b, j] @ T[b, i, j])
    return out


def bias(pattern: Tensor, b_V: Tensor, W_O: Tensor, b_O: Tensor) -> Tensor:
    """``c_i = sum_h (sum_j A^h_ij) b_V^h W_O^h + b_O`` (spec §1.2)."""
    A, bV, Wo, bO = _f64(pattern, b_V, W_O, b_O)
    mass = A.sum(-1)  # [batch, head, query]
    return sum(mass[:, h, :, None] * (bV[h] @ Wo[h]) for h in range(A.shape[1])) + bO


def messages(field: Tensor, W_V: Tensor, b_V: Tensor, W_O: Tensor) -> Tensor:
    """Each head's message ``m^h_j = (x_j W_V^h + b_V^h) W_O^h``, ``[batch, key, head, d]``:
    the attention output is ``sum_h sum_j A^h_ij m^h_j + b_O`` (spec §1.2)."""
    X, V, bV, Wo = _f64(field, W_V, b_V, W_O)
    return torch.stack([(X @ V[h] + bV[h]) @ Wo[h] for h in range(V.shape[0])], dim=2)


def generator(pattern: Tensor, W_V: Tensor, W_O: Tensor) -> Tensor:
    """``L = I - P`` as a matrix ``G`` with ``vec(X) @ G = vec(L X)`` (spec §1), the blocks
    ``G[(j, .), (i, .)] = delta_ij I - W_ij T_ij``: ``[batch, n d_model, n d_model]``."""
    W, T = walk(pattern), effective_transports(gates(pattern), W_V, W_O)
    batch, n, _ = W.shape
    d = T.shape[-1]
    G = torch.zeros(batch, n * d, n * d, dtype=F64)
    for b in range(batch):
        for i in range(n):
            for j in range(n):
                G[b, j * d : (j + 1) * d, i * d : (i + 1) * d] = -W[b, i, j] * T[b, i, j]
    return G + torch.eye(n * d, dtype=F64)


# spec §2-3: the walk as a Markov chain ------------------------------------------------------


def stochasticity(walk: Tensor) -> Tensor:
    """``max_i |sum_j W_ij - 1|`` (spec §3, C1), ``[batch]``."""
    (W,) = _f64(walk)
    return (W.sum(-1) - 1).abs().amax(-1)


def is_irreducible(walk: Tensor) -> Tensor:
    """Whether every position reaches every other along edges ``W_ij > 0``: ``(I + E)^n > 0``."""
    (W,) = _f64(walk)
    n = W.shape[-1]
    reach = torch.linalg.matrix_power(torch.eye(n, dtype=F64) + (W > 0).to(F64), n)
    return (reach > 0).flatten(1).all(-1)


def stationary(walk: Tensor, teleport: float | None = None) -> Tensor:
    """``mu^T P = mu^T``, ``sum mu = 1`` of the rows normalised to sum 1 (rows without mass
    jump uniformly), as the eigenvector of eigenvalue 1; with ``teleport = alpha``, of
    ``alpha P + (1 - alpha) 11^T / n`` (spec §3, "the measure mu")."""
    (W,) = _f64(walk)
    n = W.shape[-1]
    mass = W.sum(-1, keepdim=True)
    P = torch.where(mass > 0, W / mass.clamp_min(1e-300), 1.0 / n)
    if teleport is not None:
        P = teleport * P + (1 - teleport) / n
    values, vectors = torch.linalg.eig(P.mT)
    one = (values - 1).abs().argmin(-1)
    mu = torch.stack([vectors[b, :, k].real for b, k in enumerate(one.tolist())])
    return mu / mu.sum(-1, keepdim=True)


def measure(walk: Tensor, kind: str = "stationary", alpha: float = 0.85) -> Tensor:
    """The spec's ``mu``: ``"stationary"`` where the walk is irreducible, else uniform ``1/n``;
    ``"uniform"``; or ``"teleport"`` (the teleporting walk's stationary distribution)."""
    (W,) = _f64(walk)
    uniform = torch.full(W.shape[:2], 1.0 / W.shape[-1], dtype=F64)
    if kind == "teleport":
        return stationary(W, teleport=alpha)
    if kind == "uniform":
        return uniform
    return torch.where(is_irreducible(W)[:, None], stationary(W), uniform)


def reversibility(walk: Tensor, mu: Tensor) -> Tensor:
    """``||M - M^T||_F / ||M + M^T||_F``, ``M = diag(mu) W`` (spec §3, C2); 0 where ``M = 0``."""
    W, m = _f64(walk, mu)
    M = m[:, :, None] * W
    diff, total = torch.linalg.matrix_norm(M - M.mT), torch.linalg.matrix_norm(M + M.mT)
    return torch.where(total > 0, diff / total.clamp_min(1e-300), 0.0)


def _kept(walk: Tensor, keep: Tensor | None, exclude_sink: bool) -> Tensor:
    kept = torch.ones(walk.shape, dtype=torch.bool) if keep is None else keep.cpu().clone()
    if exclude_sink:
        kept[:, :, 0] = False
    return kept


def summary_weights(
    walk: Tensor, keep: Tensor | None = None, exclude_sink: bool = False
) -> tuple[Tensor, Tensor]:
    """The weights of a walk-weighted summary ``(1/n) sum_ij w_ij v_ij`` and ``n`` (spec §3).

    Plain (nothing dropped): ``w = W`` and ``n`` the rows with mass. Restricted (``keep`` or
    ``exclude_sink``): each row renormalised over its kept edges, ``n`` the rows left with mass.
    """
    (W,) = _f64(walk)
    if keep is None and not exclude_sink:
        return W, (W.sum(-1) > 0).sum(-1).to(F64)
    w = torch.where(_kept(W, keep, exclude_sink), W, 0.0)
    mass = w.sum(-1, keepdim=True)
    w = torch.where(mass > 0, w / mass.clamp_min(1e-300), 0.0)
    return w, (mass[..., 0] > 0).sum(-1).to(F64)


def walk_weighted_mean(
    walk: Tensor, values: Tensor, keep: Tensor | None = None, exclude_sink: bool = False
) -> Tensor:
    """``(1/n) sum_ij W_ij v_ij`` (spec §3, "walk-weighted summaries"); 0 with no row."""
    w, n = summary_weights(walk, keep, exclude_sink)
    (v,) = _f64(values)
    total = torch.where(w > 0, w * v, 0.0).flatten(1).sum(-1)
    return torch.where(n > 0, total / n.clamp_min(1.0), 0.0)


def weighted_cv(weights: Tensor, values: Tensor) -> Tensor:
    """``sqrt(sum p (v - m)^2) / m``, ``p = w / sum w``, ``m = sum p v``, along the last axis;
    0 where ``m = 0``."""
    w, v = _f64(weights, values)
    v = torch.where(w > 0, v, 0.0)
    p = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
    m = (p * v).sum(-1)
    spread = (p * (v - m[..., None]) ** 2).sum(-1).sqrt()
    return torch.where(m > 0, spread / m.clamp_min(1e-300), 0.0)


def walk_weighted_cv(
    walk: Tensor, values: Tensor, keep: Tensor | None = None, exclude_sink: bool = False
) -> Tensor:
    """The walk-weighted coefficient of variation of per-edge values (spec §3)."""
    w, _ = summary_weights(walk, keep, exclude_sink)
    return weighted_cv(w.flatten(1), values.flatten(1))


def layer_drift(walk_a: Tensor, walk_b: Tensor, exclude_sink: bool = False) -> Tensor:
    """``(1/n) sum_i TV(W^a_i., W^b_i.)``, ``TV`` half the L1 distance (spec §3).

    Plain: over the rows with mass in either walk. ``exclude_sink``: key 0 dropped, both rows
    renormalised, over the rows with mass left in both.
    """
    a, b = _f64(walk_a, walk_b)
    if exclude_sink:
        a, b = a[:, :, 1:], b[:, :, 1:]
        ma, mb = a.sum(-1, keepdim=True), b.sum(-1, keepdim=True)
        rows = ((ma > 0) & (mb > 0))[..., 0]
        a, b = a / ma.clamp_min(1e-300), b / mb.clamp_min(1e-300)
    else:
        rows = (a.sum(-1) > 0) | (b.sum(-1) > 0)
    tv = torch.where(rows, 0.5 * (a - b).abs().sum(-1), 0.0)
    n = rows.sum(-1).to(F64)
    return torch.where(n > 0, tv.sum(-1) / n.clamp_min(1.0), 0.0)


# spec §3: isometry defects -------------------------------------------------------------------


def _spread(values: Tensor) -> Tensor:
    """``sqrt(sum (v - mean v)^2 / sum v^2)`` along the last axis; 0 for all zeros."""
    spread = ((values - values.mean(-1, keepdim=True)) ** 2).sum(-1)
    size = (values**2).sum(-1)
    return torch.where(size > 0, (spread / size.clamp_min(1e-300)).sqrt(), 0.0)


def isometry_defect(T: Tensor, rank: int) -> Tensor:
    """``delta = sqrt(1 - (sum sigma)^2 / (r sum sigma^2))`` over the top ``r`` singular values
    of each map ``T`` ``[..., d, d']`` (spec §3), as the relative distance it is:
    ``sqrt(sum (sigma - s)^2 / sum sigma^2)``, ``s`` their mean. The zero map gives 0."""
    return _spread(torch.linalg.svdvals(_f64(T)[0])[..., :rank])


def gram_defect(T: Tensor, rank: int) -> Tensor:
    """``eps = sqrt(1 - (sum sigma^2)^2 / (r sum sigma^4))``, top ``r`` values (spec §3), as
    ``sqrt(sum (sigma^2 - mean sigma^2)^2 / sum sigma^4)``."""
    return _spread(torch.linalg.svdvals(_f64(T)[0])[..., :rank] ** 2)


def transport_rank(W_V: Tensor, kv_heads: Sequence[int] | None = None) -> int:
    """``r = min(d_model, H_kv d_head)``, ``H_kv`` the distinct value heads (spec §3)."""
    n_heads, d_model, d_head = W_V.shape
    distinct = n_heads if kv_heads is None else len(set(kv_heads))
    return min(d_model, distinct * d_head)


def head_defects(W_V: Tensor, W_O: Tensor) -> Tensor:
    """The head transport defects ``delta(T^h)``, ``r = min(d_model, d_head)`` (spec §3)."""
    return isometry_defect(head_transports(W_V, W_O), min(W_V.shape[1:]))


def edge_defects(gates: Tensor, W_V: Tensor, W_O: Tensor, rank: int, kind: str = "gram") -> Tensor:
    """``eps(T_ij)`` (``kind="gram"``) or ``delta(T_ij)`` (``"frobenius"``) on every pair."""
    defect = gram_defect if kind == "gram" else isometry_defect
    return defect(effective_transports(gates, W_V, W_O), rank)


def effective_defect(
    walk: Tensor,
    gates: Tensor,
    W_V: Tensor,
    W_O: Tensor,
    kv_heads: Sequence[int] | None = None,
    keep: Tensor | None = None,
    exclude_sink: bool = False,
) -> Tensor:
    """``(1/n) sum_ij W_ij eps(T_ij)``, ``r = min(d, H_kv d_h)`` (spec §3)."""
    eps = edge_defects(gates, W_V, W_O, transport_rank(W_V, kv_heads))
    return walk_weighted_mean(walk, eps, keep, exclude_sink)


def common_scale(
    walk: Tensor,
    gates: Tensor,
    W_V: Tensor,
    W_O: Tensor,
    kv_heads: Sequence[int] | None = None,
    keep: Tensor | None = None,
    exclude_sink: bool = False,
) -> Tensor:
    """``s = (1/n) sum_ij W_ij ||T_ij||_F / sqrt(r)`` (spec §3)."""
    T = effective_transports(gates, W_V, W_O)
    scale = torch.linalg.matrix_norm(T) / transport_rank(W_V, kv_heads) ** 0.5
    return walk_weighted_mean(walk, scale, keep, exclude_sink)


def heaviest_edges(walk: Tensor, mass_share: float) -> Tensor:
    """Per row, the heaviest edges (stable order) while the mass before them is below
    ``mass_share`` of the row's mass (spec §3, ``mass_share``)."""
    (W,) = _f64(walk)
    keep = torch.zeros(W.shape, dtype=torch.bool)
    for b in range(W.shape[0]):
        for i in range(W.shape[1]):
            before, row_mass = 0.0, float(W[b, i].sum())
            for j in sorted(range(W.shape[2]), key=lambda k: -float(W[b, i, k])):
                if W[b, i, j] > 0 and (mass_share >= 1 or before < mass_share * row_mass):
                    keep[b, i, j] = True
                before += float(W[b, i, j])
    return keep


def edge_pairing(gates: Tensor, W_V: Tensor, W_O: Tensor) -> Tensor:
    """``||T_ji - T_ij^T||_F / ||T_ij||_F`` on every pair (by ``||T_ji||_F`` where
    ``T_ij = 0``; 0 where both are) (spec §3)."""
    T = effective_transports(gates, W_V, W_O)
    batch, n = T.shape[:2]
    residual = torch.zeros(batch, n, n, dtype=F64)
    for b in range(batch):
        for i in range(n):
            for j in range(n):
                gap = torch.linalg.matrix_norm(T[b, j, i] - T[b, i, j].T)
                norm = torch.linalg.matrix_norm(T[b, i, j])
                norm = norm if norm > 0 else torch.linalg.matrix_norm(T[b, j, i])
                residual[b, i, j] = gap / norm if norm > 0 else 0.0
    return residual


def pairing(
    walk: Tensor,
    gates: Tensor,
    W_V: Tensor,
    W_O: Tensor,
    keep: Tensor | None = None,
    exclude_sink: bool = False,
) -> tuple[Tensor, Tensor]:
    """The pairing residual (spec §3): `edge_pairing` walk-weighted over the edges present
    both ways (diagonal included; rows renormalised over them), and whether any off-diagonal
    pair is present both ways (False: a causal walk, whose residual is then 0)."""
    (W,) = _f64(walk)
    both = (W > 0) & (W > 0).mT
    if keep is not None:
        both = both & keep.cpu()
    applicable = (both & ~torch.eye(W.shape[-1], dtype=torch.bool)).flatten(1).any(-1)
    mean = walk_weighted_mean(W, edge_pairing(gates, W_V, W_O), both, exclude_sink)
    return torch.where(applicable, mean, 0.0), applicable


def message_ratios(field: Tensor, gates: Tensor, W_V: Tensor, W_O: Tensor) -> Tensor:
    """``rho_ij = ||x_j T_ij|| / ||x_j||`` on every pair, 0 where ``x_j = 0`` (spec §3)."""
    (X,) = _f64(field)
    T = effective_transports(gates, W_V, W_O)
    norms = torch.linalg.vector_norm(X, dim=-1)  # [batch, key]
    messages = torch.linalg.vector_norm(einsum(X, T, "b j d, b i j d e -> b i j e"), dim=-1)
    return torch.where(norms[:, None, :] > 0, messages / norms[:, None, :].clamp_min(1e-300), 0.0)


def _senders(field: Tensor, shape: torch.Size, keep: Tensor | None) -> Tensor | None:
    """The kept edges whose key sends a message (``x_j != 0``), None when that is all."""
    sends = (torch.linalg.vector_norm(_f64(field)[0], dim=-1) > 0)[:, None, :].expand(shape)
    if keep is None and bool(sends.all()):
        return None
    return sends if keep is None else keep.cpu() & sends


def field_defect(
    field: Tensor,
    walk: Tensor,
    gates: Tensor,
    W_V: Tensor,
    W_O: Tensor,
    keep: Tensor | None = None,
    exclude_sink: bool = False,
) -> Tensor:
    """The field isometry defect (spec §3): walk-weighted CV of `message_ratios` over the
    edges whose key sends a message (``x_j != 0``; rows renormalised over them)."""
    rho = message_ratios(field, gates, W_V, W_O)
    return walk_weighted_cv(walk, rho, _senders(field, walk.shape, keep), exclude_sink)


def head_field_defects(
    field: Tensor,
    walk: Tensor,
    gates: Tensor,
    W_V: Tensor,
    W_O: Tensor,
    keep: Tensor | None = None,
    exclude_sink: bool = False,
) -> Tensor:
    """Per head, the field defect of ``(A^h, T^h)``, ``A^h = H W g^h`` (spec §3): the CV of
    ``||x_j T^h|| / ||x_j||`` weighted by head ``h``'s own walk, ``[batch, head]``."""
    W, g, X = _f64(walk, gates, field)
    T = head_transports(W_V, W_O)
    norms = torch.linalg.vector_norm(X, dim=-1)
    keep = _senders(field, W.shape, keep)
    out = torch.zeros(W.shape[0], g.shape[1], dtype=F64)
    for h in range(g.shape[1]):
        A = g.shape[1] * W * g[:, h]
        rho = torch.linalg.vector_norm(X @ T[h], dim=-1) / norms.clamp_min(1e-300)
        w, _ = summary_weights(A, keep, exclude_sink)
        out[:, h] = weighted_cv(w.flatten(1), rho[:, None, :].expand(W.shape).flatten(1))
    return out


# spec §4: the nearest random-walk connection operator ----------------------------------------


def reversibilised_walk(walk: Tensor, mu: Tensor) -> Tensor:
    """``W*_ij = M_ij / sum_k M_ik``, ``M_ij = (mu_i W_ij + mu_j W_ji) / 2``; rows of ``M``
    without mass stay 0 (spec §4)."""
    W, m = _f64(walk, mu)
    M = (m[:, :, None] * W + (m[:, :, None] * W).mT) / 2
    mass = M.sum(-1, keepdim=True)
    return torch.where(mass > 0, M / mass.clamp_min(1e-300), 0.0)


def polar(B: Tensor) -> Tensor:
    """The orthogonal polar factor ``U V^T`` of ``B = U S V^T``."""
    U, _, Vh = torch.linalg.svd(_f64(B)[0])
    return U @ Vh


def nearest_operator_distance(
    walk: Tensor, gates: Tensor, W_V: Tensor, W_O: Tensor, mu: Tensor, scale: Tensor
) -> Tensor:
    """``||P - P*||_F / ||P||_F`` (spec §4), ``P*`` of ``W*`` and ``s polar((T_ij + T_ji^T)/2)``,
    summed over every pair; ``0/0 = 0``."""
    W, s = _f64(walk, torch.as_tensor(scale))
    W_star = reversibilised_walk(W, mu)
    T = effective_transports(gates, W_V, W_O)
    s = s.expand(W.shape[0])
    diff, norm = torch.zeros(W.shape[0], dtype=F64), torch.zeros(W.shape[0], dtype=F64)
    for b, i, j in torch.ones(W.shape, dtype=torch.bool).nonzero().tolist():
        O_star = polar((T[b, i, j] + T[b, j, i].T) / 2)
        gap = W[b, i, j] * T[b, i, j] - W_star[b, i, j] * s[b] * O_star
        diff[b] += (gap**2).sum()
        norm[b] += W[b, i, j] ** 2 * (T[b, i, j] ** 2).sum()
    return torch.where(norm > 0, (diff / norm.clamp_min(1e-300)).sqrt(), 0.0)


# spec §3: random baselines ---------------------------------------------------------------------


def random_factors(
    W_V: Tensor, W_O: Tensor, generator: torch.Generator, kv_heads: Sequence[int] | None = None
) -> tuple[Tensor, Tensor]:
    """One random draw (spec §3, "random baselines"): Gaussian ``R_V`` (one per value head,
    shared as the model shares ``W_V``) then ``R_O``, drawn in that order from ``generator`` in
    the weights' dtype, and head ``h`` rescaled to ``s_h = ||T^h||_F / ||R_V^h R_O^h||_F`` (0
    for a zero draw), put on ``R_O^h``: the factors of ``T^h_rand = s_h R_V^h R_O^h``."""
    n_heads, d_model, d_head = W_V.shape
    n_value = n_heads if kv_heads is None else max(kv_heads) + 1
    drawn = torch.randn(n_value, d_model, d_head, dtype=W_V.dtype, generator=generator)
    R_O = torch.randn(W_O.shape, dtype=W_V.dtype, generator=generator)
    R_V = drawn[list(range(n_heads) if kv_heads is None else kv_heads)]
    R_V, R_O = _f64(R_V, R_O)
    target = torch.linalg.matrix_norm(head_transports(W_V, W_O))
    norm = torch.linalg.matrix_norm(head_transports(R_V, R_O))
    s = torch.where(norm > 0, target / norm.clamp_min(1e-300), 0.0)
    return R_V, s[:, None, None] * R_O


def random_draws(
    measure: Callable[[Tensor, Tensor], Tensor],
    W_V: Tensor,
    W_O: Tensor,
    n_draws: int,
    seed: int = 0,
    kv_heads: Sequence[int] | None = None,
) -> Tensor:
    """``measure(W_V', W_O')`` on ``n_draws`` successive `random_factors` of one generator
    seeded with ``seed``, stacked ``[draw, ...]``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack(
        [measure(*random_factors(W_V, W_O, generator, kv_heads)) for _ in range(n_draws)]
    )


def random_baseline(
    measure: Callable[[Tensor, Tensor], Tensor],
    W_V: Tensor,
    W_O: Tensor,
    n_draws: int,
    seed: int = 0,
    kv_heads: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """The random baseline (spec §3): the mean and the (sample) standard deviation of
    `random_draws`."""
    draws = random_draws(measure, W_V, W_O, n_draws, seed, kv_heads)
    return draws.mean(0), draws.std(0)
