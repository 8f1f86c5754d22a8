"""Tiny randomly initialised architectures covering what tl_connwalk supports.

``ARCHITECTURES`` are HookedTransformer configs (TransformerLens 3.x only); ``BRIDGES`` are
TransformerBridge models built offline by :mod:`tl_connwalk.toy` (3.x and 4.x). Weights are
redrawn with a larger spread than the default init so that patterns are far from uniform and
biases are non-zero: a wrong gate, bias or field then shows in the identity.
"""

import functools
import warnings
from typing import Any

import pytest
import torch
from transformer_lens import ActivationCache

from tl_connwalk.adapters.versions import HAS_BRIDGE
from tl_connwalk.toy import random_bridge

try:
    from transformer_lens import HookedTransformer, HookedTransformerConfig
except ImportError:  # TransformerLens 4.x removed them
    HookedTransformer = HookedTransformerConfig = None  # type: ignore[assignment,misc]

HAS_HOOKED = HookedTransformer is not None
hooked_only = pytest.mark.skipif(
    not HAS_HOOKED, reason="TransformerLens 4.x has no HookedTransformer"
)

bridge_only = pytest.mark.skipif(
    not HAS_BRIDGE, reason="TransformerLens 2.x has no TransformerBridge"
)

#: (toy architecture, compatibility mode) pairs for TransformerBridge tests
BRIDGES = [
    (arch, compat) for arch in ("gpt2", "llama", "gemma3", "bert") for compat in (False, True)
]

#: the decoder Bridges: every pair of BRIDGES but BERT, whose conn points are read-only
BRIDGE_DECODERS = [(arch, compat) for arch, compat in BRIDGES if arch != "bert"]


@functools.cache
def cached_bridge(arch: str, compat: bool) -> Any:
    """``random_bridge(arch, compatibility_mode=compat)``, built once per session."""
    return random_bridge(arch, compatibility_mode=compat)


def bridge_tokens(batch: int = 2, pos: int = 7) -> torch.Tensor:
    """Tokens for the toy Bridges (vocabulary of 64, the last one their pad/bos)."""
    return torch.randint(0, 63, (batch, pos), generator=torch.Generator().manual_seed(5))


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


def build(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config: Any) -> Any:
    """A tiny random model of architecture ``name`` (see ARCHITECTURES), on the CPU;
    ``config``: further config fields (e.g. ``n_layers=1``)."""
    overrides, processing = ARCHITECTURES[name]
    cfg = HookedTransformerConfig(**{**BASE, **overrides, **config, "seed": seed, "device": "cpu"})
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
    if processing is not None and not HAS_BRIDGE:
        # TransformerLens 2.x swaps LN for LNPre in process_weights_, not in the state-dict call
        model.process_weights_(**{k: v for k, v in processing.items() if k != "fold_value_biases"})
        model.setup()  # the swapped norms' hook points
    elif processing is not None:
        model.load_and_process_state_dict(model.state_dict(), **processing)
    return model if dtype == torch.float32 else model.to(dtype)


def hooked_encoder(seed: int = 0) -> Any:
    """A tiny random ``HookedEncoder`` (BERT-style: bidirectional, post-norm), in eval mode."""
    from transformer_lens import HookedEncoder

    cfg = HookedTransformerConfig(
        n_layers=2, d_model=24, n_heads=4, d_head=6, d_mlp=32, n_ctx=16, d_vocab=40,
        act_fn="gelu", attention_dir="bidirectional", normalization_type="LN",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = HookedEncoder(cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def tokens(batch: int = 2, pos: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, BASE["d_vocab"], (batch, pos), generator=torch.Generator().manual_seed(seed)
    )


def attention_output(model: Any, cache: ActivationCache, layer: int) -> torch.Tensor:
    """The attention module's own output as TransformerLens caches it (no ln1_post models)."""
    if HAS_HOOKED and isinstance(model, HookedTransformer):
        return cache[f"blocks.{layer}.hook_attn_out"]
    return cache[f"blocks.{layer}.attn.o.hook_out"]


def default_model() -> Any:
    """GPT-2-style: a HookedTransformer where TransformerLens has one, else a Bridge."""
    return build("gpt2_ln") if HAS_HOOKED else random_bridge("gpt2", d_model=24)
