"""Small randomly initialised models, built offline, for demos, tests and tutorials.

Model hubs are not needed: a Hugging Face model is drawn from its config, saved with a
word-level tokenizer to a temporary folder, and booted into a TransformerLens
``TransformerBridge`` (the model class of TransformerLens 3.x and 4.x). Weights are redrawn
with a larger spread than the Hugging Face init (standard deviation ``scale``) so that patterns
are far from uniform and biases are non-zero.

>>> bridge = random_bridge("llama", n_layers=2)
>>> bridge.cfg.n_key_value_heads
2
"""

import contextlib
import io
import tempfile
import warnings
from typing import Any, Literal, cast, get_args

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from tl_connwalk.adapters.versions import TransformerBridge, require_bridge
from tl_connwalk.core.checks import check_device, check_flag, is_count
from tl_connwalk.errors import ConnWalkError

Architecture = Literal["gpt2", "llama", "gemma3", "bert"]
VOCAB = 64


def _tokenizer(folder: str) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {name: "<unk>" for name in ("unk", "bos", "eos", "pad", "cls", "sep", "mask")}
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, **{f"{name}_token": tok for name, tok in special.items()}
    ).save_pretrained(folder)


def _hf_model(
    arch: Architecture, n_layers: int, d_model: int, n_heads: int, n_ctx: int = 64
) -> transformers.PreTrainedModel:
    size: dict[str, Any] = dict(
        num_hidden_layers=n_layers, hidden_size=d_model, num_attention_heads=n_heads,
        intermediate_size=2 * d_model, max_position_embeddings=n_ctx, vocab_size=VOCAB,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1,
    )  # fmt: skip
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=n_layers, n_embd=d_model, n_head=n_heads, **size)
        return transformers.GPT2LMHeadModel(config)
    if arch == "llama":
        llama = transformers.LlamaConfig(num_key_value_heads=max(1, n_heads // 2), **size)
        return transformers.LlamaForCausalLM(llama)
    if arch == "gemma3":
        gemma = transformers.Gemma3TextConfig(
            num_key_value_heads=1, head_dim=d_model // n_heads, sliding_window=4, **size
        )
        return transformers.Gemma3ForCausalLM(gemma)
    return transformers.BertForMaskedLM(transformers.BertConfig(**size))


def _check_arguments(
    arch: object,
    n_layers: object,
    d_model: object,
    n_heads: object,
    n_ctx: object,
    seed: object,
    scale: object,
    device: object,
) -> None:
    """A ConnWalkError for a `random_bridge` argument that cannot make a model."""
    if arch not in get_args(Architecture):
        raise ConnWalkError(
            f"unknown toy architecture {arch!r}; choose one of {get_args(Architecture)}."
        )
    sizes = {"n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, "n_ctx": n_ctx}
    for name, size in sizes.items():
        if not is_count(size):
            raise ConnWalkError(f"{name} must be a positive int, got {size!r}.")
    if cast(int, d_model) % cast(int, n_heads):
        raise ConnWalkError(
            f"d_model={d_model} must be a multiple of n_heads={n_heads} (d_head = d_model / "
            "n_heads)."
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConnWalkError(f"seed must be an int, got {seed!r}.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0:
        raise ConnWalkError(
            f"scale (the weights' standard deviation) must be a number >= 0, got {scale!r}."
        )
    check_device(device)


def random_bridge(
    arch: Architecture = "gpt2",
    *,
    n_layers: int = 2,
    d_model: int = 32,
    n_heads: int = 4,
    seed: int = 0,
    scale: float = 0.2,
    compatibility_mode: bool = False,
    n_ctx: int = 64,
    device: str | torch.device = "cpu",
) -> TransformerBridge:
    """A random ``TransformerBridge`` of architecture ``arch`` (vocabulary of 64 tokens).

    ``gpt2``: LayerNorm, learned positions, biases. ``llama``: RMSNorm, rotary, grouped-query
    (``n_heads // 2`` KV heads), no biases. ``gemma3``: one KV head, QK-norm, ``ln1_post``,
    sliding window of 4 on some layers. ``bert``: bidirectional post-norm encoder. ``n_ctx``:
    the longest sequence (learned positions). ``device``: where the model is put (the CPU
    unless asked: TransformerLens alone would pick a GPU where there is one). Weights are drawn
    on the CPU, so a seed gives the same model on every device.
    """
    bridge_class = require_bridge("tl_connwalk.toy.random_bridge")
    _check_arguments(arch, n_layers, d_model, n_heads, n_ctx, seed, scale, device)
    check_flag(compatibility_mode, "compatibility_mode")
    torch.manual_seed(seed)
    model = _hf_model(arch, n_layers, d_model, n_heads, n_ctx)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2 or name.endswith("bias"):
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    # the progress bars of saving and loading a toy model are noise: keep them off stderr
    with (
        tempfile.TemporaryDirectory(prefix="tl_connwalk_toy_") as folder,
        contextlib.redirect_stderr(io.StringIO()),
    ):
        model.save_pretrained(folder)
        _tokenizer(folder)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bridge = bridge_class.boot_transformers(
                folder,
                tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
                model_class=type(model),
                device=device,
            )
            if compatibility_mode:
                bridge.enable_compatibility_mode()
    return bridge
