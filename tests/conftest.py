import pytest
import torch

import tl_connwalk
from tests.architectures import ARCHITECTURES, HAS_HOOKED, cached_bridge, default_model

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


@pytest.fixture
def bridge(request: pytest.FixtureRequest):
    """A toy Bridge (``request.param = (arch, compat)``), attached for the test, then detached."""
    model = cached_bridge(*request.param)
    tl_connwalk.attach(model)
    yield model
    tl_connwalk.detach(model)
