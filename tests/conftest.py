import pytest
import torch

from tests.architectures import ARCHITECTURES, HAS_HOOKED, default_model

torch.set_num_threads(1)


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request: pytest.FixtureRequest) -> str:
    """A HookedTransformer architecture name (skipped where TransformerLens has none)."""
    if not HAS_HOOKED:
        pytest.skip("TransformerLens 4.x has no HookedTransformer")
    return request.param


@pytest.fixture
def gpt2():
    """A GPT-2-style model of whichever class this TransformerLens offers."""
    return default_model()
