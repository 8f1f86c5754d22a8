"""Tiny randomly initialised HookedTransformer architectures covering what tl_connwalk supports.

Weights are redrawn with a larger spread than TransformerLens's init so that patterns are far
from uniform and biases are non-zero: a wrong gate, bias or field then shows in the identity.
"""

import warnings

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

BASE = dict(n_layers=2, d_model=24, d_head=4, n_heads=4, n_ctx=16, d_vocab=40, d_mlp=32, seed=0)

#: name -> (config overrides, weight processing applied after init or None)
ARCHITECTURES: dict[str, tuple[dict, dict | None]] = {
    "gpt2_ln": (dict(act_fn="gelu_new", normalization_type="LN"), None),
    "gpt2_processed": (
        dict(act_fn="gelu_new", normalization_type="LN"),
        dict(
            fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True
        ),
    ),
    "llama_gqa_rotary": (
        dict(
            act_fn="silu",
            normalization_type="RMS",
            positional_embedding_type="rotary",
            rotary_dim=4,
            gated_mlp=True,
            n_key_value_heads=2,
        ),
        None,
    ),
    "llama_gqa_folded": (
        dict(
            act_fn="silu",
            normalization_type="RMS",
            positional_embedding_type="rotary",
            rotary_dim=4,
            gated_mlp=True,
            n_key_value_heads=2,
        ),
        dict(
            fold_ln=True, center_writing_weights=False, center_unembed=False, fold_value_biases=True
        ),
    ),
    "shortformer": (
        dict(act_fn="relu", normalization_type="LN", positional_embedding_type="shortformer"),
        None,
    ),
    "parallel_rotary": (
        dict(
            act_fn="gelu",
            normalization_type="LN",
            positional_embedding_type="rotary",
            rotary_dim=4,
            parallel_attn_mlp=True,
        ),
        None,
    ),
    "attn_only_no_norm": (dict(attn_only=True, normalization_type=None), None),
    "ln_post_gemma_like": (
        dict(
            act_fn="gelu",
            normalization_type="RMS",
            positional_embedding_type="rotary",
            rotary_dim=4,
            use_normalization_before_and_after=True,
        ),
        None,
    ),
}


def build(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> HookedTransformer:
    """A tiny random model of architecture ``name`` (see ARCHITECTURES)."""
    overrides, processing = ARCHITECTURES[name]
    cfg = HookedTransformerConfig(**{**BASE, **overrides, "seed": seed})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = HookedTransformer(cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if name_.endswith((".w", "ln_final.w")) and "ln" in name_:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    if processing is not None:
        model.load_and_process_state_dict(model.state_dict(), **processing)
    return model if dtype == torch.float32 else model.to(dtype)


def tokens(batch: int = 2, pos: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, BASE["d_vocab"], (batch, pos), generator=torch.Generator().manual_seed(seed)
    )
