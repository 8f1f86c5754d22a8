"""Weight helpers shared by the adapters: grouped-query expansion and processing inference."""

import torch
from torch import Tensor

from tl_connwalk.core.checks import abs_maxes
from tl_connwalk.core.value_heads import expand_value_heads, grouped_value_heads


def expand_kv_heads(weight: Tensor, n_heads: int) -> Tensor:
    """Repeat key-value heads along axis 0 so query head ``h`` gets KV head ``h // (H / H_kv)``."""
    n_kv_heads = weight.shape[0]
    if n_kv_heads == n_heads:
        return weight
    return expand_value_heads(weight, grouped_value_heads(n_heads, n_kv_heads))


def inferred_processing(W_O: Tensor, b_V: Tensor | None) -> dict[str, bool]:
    """``center_writing_weights`` and ``fold_value_biases`` as the weights show them (spec §2).

    TransformerLens records neither: ``W_O`` centred means every output row of every head has
    mean zero over ``d_model`` (to float rounding); value biases folded means ``b_V`` is zero or
    absent.
    """
    peaks = abs_maxes([W_O, W_O.mean(-1), *([] if b_V is None else [b_V])])  # one transfer
    scale = max(peaks[0], torch.finfo(W_O.dtype).tiny)
    return {
        "center_writing_weights": peaks[1] <= 1e-6 * scale,
        "fold_value_biases": b_V is None or peaks[2] == 0.0,
    }
