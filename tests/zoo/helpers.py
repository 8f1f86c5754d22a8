"""Shared by the zoo tests: fake wheels, tiny local Hugging Face models, identity checks."""

import hashlib
import zipfile
from pathlib import Path

import torch
import transformers
from torch import nn

import tl_connwalk
from tests.tolerances import rtol
from tl_connwalk.toy import _hf_model, _tokenizer
from tl_connwalk.zoo.registry import ModelSpec, Wheel


def make_wheel(folder: Path, filename: str, members: dict[str, bytes]) -> tuple[Path, str]:
    """A zip named ``filename`` in ``folder`` holding ``members``; returns (path, sha256)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def fake_wheel(sha256: str = "0" * 64, members: tuple[str, ...] = ("pkg/data.bin",)) -> Wheel:
    return Wheel(
        package="fake-pkg",
        version="1.0",
        filename="fake_pkg-1.0-py3-none-any.whl",
        sha256=sha256,
        members=members,
    )


def fake_spec(wheels: tuple[Wheel, ...], **overrides) -> ModelSpec:
    fields = dict(
        name="fake",
        description="a fake model",
        architecture="BertForMaskedLM",
        model_class="HookedEncoder",
        source_format="bert-safetensors",
        wheels=wheels,
        source_sha256=None,
        d_vocab=64,
    )
    return ModelSpec(**(fields | overrides))


def save_tiny(arch: str, folder: Path, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random Hugging Face model of ``arch`` (toy architectures) saved with a tokenizer."""
    torch.manual_seed(seed)
    model = _hf_model(arch, n_layers=2, d_model=32, n_heads=4).eval()  # type: ignore[arg-type]
    model.save_pretrained(folder)
    _tokenizer(str(folder))
    return model


def attention_outputs(
    model: nn.Module, tokens: torch.Tensor | str
) -> tuple[tl_connwalk.ConnectionWalk, dict[int, torch.Tensor]]:
    """Run ``model`` with a cache, capturing each attention module's own output.

    That output is what ``apply() + bias()`` reproduces; in Gemma it sits before ``ln1_post``,
    which TransformerLens puts inside ``hook_attn_out``.
    """
    outputs: dict[int, torch.Tensor] = {}
    handles = [
        block.attn.register_forward_hook(
            lambda mod, args, out, layer=layer: outputs.__setitem__(layer, out)
        )
        for layer, block in enumerate(model.blocks)
    ]
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return cache, outputs


def identity_errors(model: nn.Module, cache, outputs: dict[int, torch.Tensor]) -> list[float]:
    """Per layer, ``max|apply() + bias() - attention output| / max|attention output|``."""
    errors = []
    for layer in range(model.cfg.n_layers):
        walk = tl_connwalk.connection_walk(cache, layer)
        expected = outputs[layer]
        rebuilt = walk.apply() + walk.bias()
        errors.append(((rebuilt - expected).abs().max() / expected.abs().max()).item())
    return errors


def identity_rtol(model: nn.Module, cache) -> float:
    """The float32 tolerance of `identity_errors`: each output entry is a chain of sums over
    ``d_model`` (the values), ``d_head`` (the output map) and the heads times the keys (the
    walk), so ``rtol(float32, d_model + H (d_head + n_keys))``."""
    n_keys = cache["blocks.0.attn.hook_pattern"].shape[-1]
    cfg = model.cfg
    return rtol(torch.float32, cfg.d_model + cfg.n_heads * (cfg.d_head + n_keys))


def state_digest(model: nn.Module) -> str:
    """sha256 of every parameter and buffer (name and bytes), the hook names and the config."""
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    digest.update(repr(sorted(getattr(model, "hook_dict", {}))).encode())
    digest.update(repr(getattr(model, "cfg", None)).encode())
    return digest.hexdigest()
