"""Attribution on the zoo's real models: complete, and equal to the frozen network by hooks.

Slow: each model loads from the zoo's cache (the first run downloads and converts it).
"""

import pytest
import torch

import tl_connwalk
from tests.architectures import hooked_only
from tests.attribution import reference
from tests.attribution.test_connection import FROZEN_TERMS
from tests.tolerances import rtol
from tl_connwalk.zoo import default_text, load

pytestmark = [pytest.mark.slow, hooked_only]


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "minilm-l6"])
def test_zoo_model_complete_and_equal_to_the_frozen_network(name):
    model = load(name)
    tokens = model.to_tokens(default_text())
    tokens = (tokens[0] if isinstance(tokens, tuple) else tokens)[:, :24]
    result = tl_connwalk.attribute(model, tokens, position=12)
    size = (result.scores.abs().sum(-1) + result.bias.abs()).max().item()
    atol = rtol(result.scores.dtype, FROZEN_TERMS) * size * 10  # float32, 6-30 real layers
    torch.testing.assert_close(
        result.scores.sum(-1) + result.bias, result.target_value, rtol=0, atol=atol
    )
    with torch.no_grad():
        token = model(tokens)[:, 12].argmax(-1)  # the default target: the top token
    expected = reference.source_contributions(model, tokens, token, position=12)
    torch.testing.assert_close(result.scores, expected, rtol=0, atol=atol)
