"""The head Gram tensors of the closed forms (spec §3): ``K2[a,b] = tr(T^a^T T^b)`` and
``K4[a,b,c,e] = tr(T^b^T T^a T^c^T T^e)`` from ``d_head``-sized factor products, never a
``d_model x d_model`` map, and ``K4`` folded onto unordered head pairs."""

import torch
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core._fast import chunks
from tl_connwalk.core._fast.quartic import head_pairs
from tl_connwalk.core.checks import cast_heads


def _products(left: Tensor, right: Tensor) -> Tensor:
    """``[left[a] @ right[b] for b]`` stacked, ``[H, ., .]``, one small matmul at a time.

    A single einsum over the head axis would first copy a ``d_model x H d_head`` factor into
    matmul layout (as large as ``W_V`` itself); these ``d_head``-sized products never do.
    """
    return torch.stack([left @ right[b] for b in range(right.shape[0])])


def head_norms_sq(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, " head"]:
    """``||T^h||_F^2 = tr(GV[h,h] GO[h,h])``, the diagonal of `head_gram` alone."""
    return einsum(W_V.mT @ W_V, W_O @ W_O.mT, "head p q, head q p -> head")


def head_factor_grams(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> tuple[Float[Tensor, "head head d_head d_head"], Float[Tensor, "head head d_head d_head"]]:
    """``GV[a,b] = W_V^a^T W_V^b`` and ``GO[a,b] = W_O^a W_O^b^T``, both ``[H, H, d_h, d_h]``.

    A row ``a`` at a time, each one matrix product with the concatenated factor (``d_h x
    d_model`` by ``d_model x H d_h``), for ``b >= a`` only (``GV[b,a] = GV[a,b]^T``): one
    ``W_V``-sized layout copy, no full ``H d_h``-square temporary beside the two results.

    >>> [g.shape for g in head_factor_grams(torch.randn(3, 8, 2), torch.randn(3, 2, 8))]
    [torch.Size([3, 3, 2, 2]), torch.Size([3, 3, 2, 2])]
    """
    W_V, W_O = cast_heads(W_V, W_O)
    n_heads, _, d_head = W_V.shape
    values = rearrange(W_V, "head d_model d_head -> d_model (head d_head)")
    gram_v = W_V.new_empty(n_heads, n_heads, d_head, d_head)
    for a in range(n_heads):
        upper = W_V[a].mT @ values[:, a * d_head :]
        gram_v[a, a:] = rearrange(upper, "p (b q) -> b p q", b=n_heads - a)
        gram_v[a + 1 :, a] = gram_v[a, a + 1 :].mT
    del values  # before GO: the copy and both Grams are never held at once
    outputs = rearrange(W_O, "head d_head d_model -> (head d_head) d_model")  # a view
    gram_o = torch.empty_like(gram_v)
    for a in range(n_heads):
        upper = W_O[a] @ outputs[a * d_head :].mT
        gram_o[a, a:] = rearrange(upper, "p (b q) -> b p q", b=n_heads - a)
        gram_o[a + 1 :, a] = gram_o[a, a + 1 :].mT
    return gram_v, gram_o


def head_gram(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "head head"]:
    """``K2[a,b] = tr(T^a^T T^b) = <T^a, T^b>_F`` (spec §3), from ``d_head x d_head`` products.

    ``tr(W_O^a^T W_V^a^T W_V^b W_O^b) = tr(GV[a,b] GO[b,a])``; the diagonal is ``||T^h||_F^2``.
    One row ``a`` at a time: working memory ``O(H d_head^2)``, never the ``H^2 d_head^2`` Grams.

    >>> head_gram(torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([2, 2])
    """
    W_V, W_O = cast_heads(W_V, W_O)
    rows = []
    for a in range(W_V.shape[0]):
        gram_v = _products(W_V[a].mT, W_V)  # GV[a, b]: [b, p, q]
        gram_o = _products(W_O[a], W_O.mT).mT  # GO[b, a] = GO[a, b]^T: [b, q, p]
        rows.append(einsum(gram_v, gram_o, "b p q, b q p -> b"))
    return torch.stack(rows)


def head_mixed_gram(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "head head"]:
    """``KM[a,b] = tr(T^a T^b) = <T^a^T, T^b>_F``, the Gram that pairs a map with a transpose.

    ``tr(W_V^a W_O^a W_V^b W_O^b) = tr(C[a,b] C[b,a])`` with ``C[a,b] = W_O^a W_V^b``
    (``d_head x d_head``). Used by the pairing residual (spec §3). A row ``a`` at a time (each
    ``C`` computed twice): working memory ``O(H d_head^2)``, not the ``H^2 d_head^2`` of ``C``.

    >>> head_mixed_gram(torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([2, 2])
    """
    W_V, W_O = cast_heads(W_V, W_O)
    rows = []
    for a in range(W_V.shape[0]):
        cross_row = _products(W_O[a], W_V)  # C[a, b]: [b, p, q]
        cross_col = torch.stack([W_O[b] @ W_V[a] for b in range(W_O.shape[0])])  # C[b, a]
        rows.append(einsum(cross_row, cross_col, "b p q, b q p -> b"))
    return torch.stack(rows)


def gram_matrices(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> tuple[Float[Tensor, "head head"], Float[Tensor, "head head head head"]]:
    """The head Grams ``K2[a,b] = tr(T^a^T T^b)`` and ``K4[a,b,c,e] = tr(T^b^T T^a T^c^T T^e)``.

    With ``GV[a,b] = W_V^a^T W_V^b`` and ``GO[a,b] = W_O^a W_O^b^T`` (``d_head x d_head``,
    a row of blocks per matrix product)::

        K2[a,b]     = tr(GV[a,b] GO[b,a])
        K4[a,b,c,e] = tr(GV[b,a] GO[a,c] GV[c,e] GO[e,b])

    ``K4`` is built through the ``H^3`` products ``X[b,a,c] = GV[b,a] GO[a,c]`` (``a >= b``
    only, since ``K4[a,b,c,e] = K4[b,a,e,c]``) and ``Y[b,c,e] = GV[c,e] GO[e,b]``, one ``b``
    and a block of ``c`` at a time (batched
    ``d_head x d_head`` matmuls, blocks of at most ``CHUNK_ENTRIES / 4`` numbers): working
    memory the two Grams (``2 H^2 d_head^2`` numbers) plus one block (never ``H^4 d^2``), time
    ``O(H^3 d_head^3 + H^4 d_head^2)``. ``K4`` itself has ``H^4`` entries (1M for ``H = 32``).

    >>> K2, K4 = gram_matrices(torch.randn(3, 8, 2), torch.randn(3, 2, 8))
    >>> K2.shape, K4.shape
    (torch.Size([3, 3]), torch.Size([3, 3, 3, 3]))
    """
    W_V, W_O = cast_heads(W_V, W_O)
    return grams_of_factor_grams(*head_factor_grams(W_V, W_O))


def grams_of_factor_grams(
    gram_v: Float[Tensor, "head head d_head d_head"],
    gram_o: Float[Tensor, "head head d_head d_head"],
) -> tuple[Float[Tensor, "head head"], Float[Tensor, "head head head head"]]:
    """`gram_matrices` from ``GV[a,b] = W_V^a^T W_V^b`` and ``GO[a,b] = W_O^a W_O^b^T``
    (`head_factor_grams`), for callers that keep ``GO`` as well.

    >>> W_V, W_O = torch.randn(3, 8, 2), torch.randn(3, 2, 8)
    >>> K2, K4 = grams_of_factor_grams(*head_factor_grams(W_V, W_O))
    >>> torch.allclose(K4, gram_matrices(W_V, W_O)[1])
    True
    """
    n_heads, _, d_head, _ = gram_v.shape
    K2 = einsum(gram_v, gram_o, "a b p q, a b p q -> a b")  # GO[b,a] = GO[a,b]^T
    K4 = gram_v.new_empty(n_heads, n_heads, n_heads, n_heads)
    step = max(1, chunks.chunk_entries(gram_v.device) // (8 * n_heads * d_head * d_head))
    for b in range(n_heads):
        for start in range(0, n_heads, step):
            cs = slice(start, start + step)
            # only a >= b: the rest is K4[a,b,c,e] = K4[b,a,e,c] (<P_ac, P_be> with P = T T^T)
            X = gram_v[b][b:, None] @ gram_o[b:, cs]  # [a, c, p, s] = GV[b,a] GO[a,c]
            Y_t = gram_o[b][:, None] @ gram_v[:, cs]  # [e, c, p, s] = (GV[c,e] GO[e,b])^T
            X = rearrange(X, "a c p s -> c a (p s)")
            Y_t = rearrange(Y_t, "e c p s -> c (p s) e")
            K4[b:, b, cs, :] = rearrange(X @ Y_t, "c a e -> a c e")
    below = torch.ones(n_heads, n_heads, dtype=torch.bool, device=K4.device).triu(1)  # a < b
    return K2, torch.where(below[:, :, None, None], K4.permute(1, 0, 3, 2), K4)


def fold_pairs(K4: Float[Tensor, "head head head head"]) -> Float[Tensor, "pair pair"]:
    """``K4`` folded onto unordered head pairs: ``S^T K4 S`` over `head_pairs` (``a <= c``).

    ``K4`` is the Gram matrix of the pair maps ``T^a T^c^T`` (symmetric in ``(a c) <-> (b e)``)
    and ``g^a g^c`` is symmetric in ``a, c``: folding each unordered pair into one coordinate
    cuts the per-edge work of ``sum g^a g^b g^c g^e K4[a,b,c,e]`` from ``H^4`` to ``~H^4 / 4``:
    ``sum sigma^4(T_ij) = H^4 u^T F u`` with ``u_{ac} = g^a g^c`` (evaluated through its
    ``~H^4 / 24`` distinct monomials, `tl_connwalk.core._fast.quartic`).

    >>> fold_pairs(torch.ones(2, 2, 2, 2))
    tensor([[1., 2., 1.],
            [2., 4., 2.],
            [1., 2., 1.]])
    """
    n_heads = K4.shape[0]
    first, second = head_pairs(n_heads, K4.device)
    fold = torch.zeros(n_heads, n_heads, first.numel(), dtype=K4.dtype, device=K4.device)
    pair = torch.arange(first.numel(), device=K4.device)
    fold[first, second, pair] = 1.0
    fold[second, first, pair] = 1.0
    fold = rearrange(fold, "a c pair -> (a c) pair")
    return fold.T @ rearrange(K4, "a b c e -> (a c) (b e)") @ fold
