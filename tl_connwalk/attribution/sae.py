"""An SAELens SAE's feature as a target: its pre-activation, read at the SAE's hook (spec §6).

SAELens computes a feature's pre-activation (``hook_sae_acts_pre``) from the activation ``x``
at its hook point as ``(x - b_dec) W_enc[:, i] + b_enc[i]`` (``b_dec`` subtracted only with
``cfg.apply_b_dec_to_input``; a ``hook_z`` SAE flattens the heads first), an affine read
``u . x + c`` with ``u = W_enc[:, i]`` and ``c = b_enc[i] - b_dec . W_enc[:, i]``. SAEs whose
encoder is not that (gated, matching pursuit, temporal) or that normalise their input at run
time (``normalize_activations`` ``"layer_norm"`` or ``"constant_norm_rescale"``: a division by
the input's norm) have no affine pre-activation and are refused. Nothing here imports SAELens:
the SAE is read through its attributes, as SAELens 5.x and 6.x name them.
"""

import dataclasses
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from tl_connwalk.errors import ConnWalkError

#: SAELens architectures whose pre-activation is ``sae_in @ W_enc + b_enc``
AFFINE_ENCODERS = (
    "standard",
    "jumprelu",
    "topk",
    "abstopk",
    "batchtopk",
    "matryoshka_batchtopk",
    "transcoder",
    "skip_transcoder",
    "jumprelu_transcoder",
    "jumprelu_skip_transcoder",
)

#: input normalisations SAELens applies at run time that divide by the input's norm
NONLINEAR_NORMALISATIONS = ("layer_norm", "constant_norm_rescale")


@dataclasses.dataclass(frozen=True)
class EncoderRead:
    """Feature ``i``'s pre-activation as ``direction . x + offset`` at ``hook``."""

    hook: str
    direction: Float[Tensor, " d_in"]
    offset: Float[Tensor, ""]
    label: str


def _architecture(cfg: Any) -> str:
    """``cfg.architecture()`` (SAELens 6.x, a class method) or ``cfg.architecture`` (5.x)."""
    architecture = getattr(cfg, "architecture", None)
    return str(architecture() if callable(architecture) else architecture)


def _hook_name(cfg: Any) -> str | None:
    """``cfg.metadata.hook_name`` (SAELens 6.x) or ``cfg.hook_name`` (5.x)."""
    metadata = getattr(cfg, "metadata", None)
    name = getattr(metadata, "hook_name", None) or getattr(cfg, "hook_name", None)
    return None if name is None else str(name)


def encoder(sae: nn.Module, feature: int) -> EncoderRead:
    """Feature ``feature`` of the SAELens ``sae`` as an affine read at its hook point."""
    cfg = getattr(sae, "cfg", None)
    W_enc = getattr(sae, "W_enc", None)
    if cfg is None or not isinstance(W_enc, Tensor):
        raise ConnWalkError(
            f"a module target is an SAELens SAE with a feature index, (sae, feature); "
            f"{type(sae).__name__} has no cfg and W_enc."
        )
    architecture = _architecture(cfg)
    b_enc = getattr(sae, "b_enc", None)
    if architecture not in AFFINE_ENCODERS or not isinstance(b_enc, Tensor):
        raise ConnWalkError(
            f"this SAE's architecture ({architecture!r}) has no pre-activation of the form "
            f"(x - b_dec) W_enc + b_enc; supported: {', '.join(AFFINE_ENCODERS)}."
        )
    normalisation = getattr(cfg, "normalize_activations", "none")
    if normalisation in NONLINEAR_NORMALISATIONS:
        raise ConnWalkError(
            f"this SAE normalises its input at run time (normalize_activations="
            f"{normalisation!r}), dividing by the input's norm: its features are not affine in "
            "the activation, and attribution needs them affine (spec §6)."
        )
    hook = _hook_name(cfg)
    if hook is None:
        raise ConnWalkError(
            "this SAE does not name the hook point it reads (cfg.metadata.hook_name); set it."
        )
    d_sae = W_enc.shape[-1]
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < d_sae:
        raise ConnWalkError(f"the SAE feature must be an int in 0..{d_sae - 1}, got {feature!r}.")
    with torch.no_grad():
        u = W_enc[:, feature].detach().clone()
        offset = b_enc[feature].detach().clone()
        b_dec = getattr(sae, "b_dec", None)
        if getattr(cfg, "apply_b_dec_to_input", False) and isinstance(b_dec, Tensor):
            offset = offset - (b_dec.detach() * u).sum()
    return EncoderRead(hook, u, offset, f"{type(sae).__name__}[{feature}] at {hook}")
