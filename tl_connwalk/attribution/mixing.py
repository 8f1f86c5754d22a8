"""Per-layer token-mixing matrices of the layer-wise baselines, and their rollout (spec §6).

Each baseline summarises a layer ``l`` by a row-stochastic matrix ``C_l`` ``[batch, query, key]``
(row ``i``: how much of query ``i``'s output comes from each token ``j``, the residual path
included) and attributes by the rollout ``R = C_{L-1} ... C_0`` read at the target's row:

- attention norm (Kobayashi et al. 2020, with the residual of Kobayashi et al. 2021):
  ``N_ij = ||sum_h A^h_ij f^h(x_j) + [i = j] r_i||``, ``f^h(x) = (x W_V^h + b_V^h) W_O^h``,
  ``r_i`` the residual stream entering the layer;
- ALTI (Ferrando et al. 2022): the transformed vectors ``T_i(x_j)`` of the attention sublayer
  (``sum_h A^h_ij x_j W_V^h W_O^h + [i = j] r_i``, normalisation linearised, biases left out),
  ``y_i = sum_j T_i(x_j)``, ``c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1)``;
- value zeroing (Mohebbi et al. 2023): the cosine distances of `cosine_distance`.

Rows are normalised by `normalised_rows`.
"""

import torch
from einops import einsum
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core.edge_norms import QUERY_BLOCK_ELEMENTS, message_norms


def normalised_rows(
    scores: Float[Tensor, "*batch query key"],
) -> Float[Tensor, "*batch query key"]:
    """Each row divided by its sum; a row of zeros (nothing measured) becomes the identity's row.

    >>> normalised_rows(torch.tensor([[[3.0, 1.0], [0.0, 0.0]]]))
    tensor([[[0.7500, 0.2500],
             [0.0000, 1.0000]]])
    """
    total = scores.sum(-1, keepdim=True)
    eye = torch.eye(scores.shape[-1], dtype=scores.dtype, device=scores.device)
    return torch.where(total > 0, scores / total.where(total > 0, 1.0), eye)


def rolled_out(layers: Float[Tensor, "layer batch query key"]) -> Float[Tensor, "batch query key"]:
    """``R = C_{L-1} ... C_1 C_0``, the last layer on the left.

    >>> C = torch.tensor([[1.0, 0.0], [0.5, 0.5]])[None, None].expand(2, 1, 2, 2)
    >>> rolled_out(C)[0]
    tensor([[1.0000, 0.0000],
            [0.7500, 0.2500]])
    """
    result = layers[0]
    for layer in layers[1:]:
        result = layer @ result
    return result


def _on_diagonal(
    pattern: Float[Tensor, "batch head query key"],
    messages: Float[Tensor, "batch key head d_model"],
    residual: Float[Tensor, "batch query d_model"],
) -> Float[Tensor, "batch query d_model"]:
    """``sum_h A^h_ii m^h_i + r_i``: the message of each token to itself plus its residual."""
    self_weight = pattern.diagonal(dim1=-2, dim2=-1)  # [batch, head, query]
    return einsum(
        self_weight, messages, "batch head query, batch query head d -> batch query d"
    ) + (residual)


def attention_norm_layer(
    pattern: Float[Tensor, "batch head query key"],
    messages: Float[Tensor, "batch key head d_model"],
    residual: Float[Tensor, "batch query d_model"],
) -> Float[Tensor, "batch query key"]:
    """``N_ij = ||sum_h A^h_ij m^h_j + [i = j] r_i||``, rows not yet normalised.

    >>> A = torch.tensor([[1.0, 0.0], [0.5, 0.5]])[None, None]
    >>> m = torch.tensor([[[[0.0, 1.0]], [[1.0, 0.0]]]])  # [batch, key, head, d_model]
    >>> attention_norm_layer(A, m, torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]))
    tensor([[[1.4142, 0.0000],
             [0.5000, 1.1180]]])
    """
    norms = message_norms(pattern, messages)
    diagonal = _on_diagonal(pattern, messages, residual).norm(dim=-1)
    return norms.diagonal_scatter(diagonal, dim1=-2, dim2=-1)


def alti_contributions(
    transformed: Float[Tensor, "batch query key d_model"],
) -> Float[Tensor, "batch query key"]:
    """ALTI's ``c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1)``, ``y_i = sum_j T_i(x_j)``.

    >>> alti_contributions(torch.tensor([[[[3.0, 0.0], [0.0, 1.0]]]]))
    tensor([[[3., 1.]]])
    """
    resultant = transformed.sum(2, keepdim=True)
    distance = (resultant - transformed).abs().sum(-1)
    return (resultant.abs().sum(-1) - distance).clamp(min=0)


def alti_layer(
    pattern: Float[Tensor, "batch head query key"],
    messages: Float[Tensor, "batch key head d_model"],
    residual: Float[Tensor, "batch query d_model"],
    post_norm: tuple[Float[Tensor, " d_model"], Float[Tensor, "batch query 1"]] | None = None,
) -> Float[Tensor, "batch query key"]:
    """ALTI's contributions of one attention sublayer, rows not yet normalised.

    ``T_i(x_j) = sum_h A^h_ij m^h_j + [i = j] r_i`` with ``m`` the bias-free messages; a
    LayerNorm after the sublayer (``post_norm = (weight w, scale s)``, BERT) is linearised:
    ``T_i(x_j) -> w (T_i(x_j) - mean T_i(x_j)) / s_i``. Formed a block of queries at a time.
    """
    batch, _, n_query, n_key = pattern.shape
    block = max(1, QUERY_BLOCK_ELEMENTS // max(1, batch * n_key * messages.shape[-1]))
    diagonal = _on_diagonal(pattern, messages, residual)
    rows = []
    for start in range(0, n_query, block):
        stop = min(start + block, n_query)
        transformed = einsum(
            pattern[:, :, start:stop],
            messages,
            "batch head query key, batch key head d -> batch query key d",
        )
        queries = torch.arange(start, stop, device=pattern.device)
        transformed[:, queries - start, queries] = diagonal[:, start:stop]
        if post_norm is not None:
            weight, scale = post_norm
            centred = transformed - transformed.mean(-1, keepdim=True)
            transformed = weight * centred / scale[:, start:stop, None]
        rows.append(alti_contributions(transformed))
    return torch.cat(rows, 1)


def cosine_distance(
    changed: Float[Tensor, "... d_model"], clean: Float[Tensor, "... d_model"]
) -> Float[Tensor, "..."]:
    """``1 - cos(changed, clean)`` (0 where either vector is zero).

    >>> cosine_distance(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))
    tensor(0.2929)
    """
    norms = changed.norm(dim=-1) * clean.norm(dim=-1)
    dot = (changed * clean).sum(-1)
    return torch.where(norms > 0, 1 - dot / norms.where(norms > 0, 1.0), 0.0)
