"""The docstring examples of ``tl_connwalk`` run as doctests, offline, on a small random model.

Names every example may use: ``torch``, ``tl_connwalk``, ``model`` (a random 2-layer GPT-2
``TransformerBridge``, d_model 32, 4 heads, attached for the example and detached after it),
``tokens`` (``[2, 8]``), ``cache`` (its ``run_with_cache``), ``walk`` (layer 0's
``ConnectionWalk``) and, on TransformerLens 3.x, ``hooked_model`` (a random 2-layer GPT-2
``HookedTransformer``, for the examples of its own hook points in
``hooks/hooked_transformer.py``, which are skipped on 4.x).
"""

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tl_connwalk
from tl_connwalk.adapters.versions import BridgeUnavailableError
from tl_connwalk.toy import random_bridge

PACKAGE = Path(__file__).parent / "tl_connwalk"
HOOKED_POINTS = PACKAGE / "hooks" / "hooked_transformer.py"


@functools.cache
def _example_model() -> Any:
    return random_bridge("gpt2")


@functools.cache
def _example_hooked_model() -> Any:
    """A random 2-layer GPT-2-style ``HookedTransformer`` (TransformerLens 3.x), or None."""
    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig
    except ImportError:  # TransformerLens 4.x removed them
        return None
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=32, n_heads=4, d_head=8, n_ctx=16, d_vocab=64, act_fn="gelu_new",
        normalization_type="LN", seed=0,
    )  # fmt: skip
    return HookedTransformer(cfg).eval()


@pytest.fixture(autouse=True)
def _doctest_objects(request: pytest.FixtureRequest) -> Iterator[None]:
    if PACKAGE not in Path(str(request.node.path)).parents:
        yield  # a test under tests/: nothing to set up
        return
    hooked_model = _example_hooked_model()
    if hooked_model is None and Path(str(request.node.path)) == HOOKED_POINTS:
        pytest.skip("the HookedTransformer hook points: TransformerLens 4.x has no such model")
    model = tl_connwalk.attach(_example_model())
    tokens = torch.randint(0, 63, (2, 8), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(tokens)
    request.getfixturevalue("doctest_namespace").update(
        torch=torch,
        tl_connwalk=tl_connwalk,
        model=model,
        tokens=tokens,
        cache=cache,
        walk=cache.connection_walk(0),
        hooked_model=hooked_model,
    )
    yield
    tl_connwalk.detach(model)
    if hooked_model is not None:
        tl_connwalk.detach(hooked_model)  # whatever an example attached or installed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """What needs a TransformerBridge is skipped where TransformerLens has none (2.x)."""
    try:
        return (yield)
    except BridgeUnavailableError as error:
        pytest.skip(str(error))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """As `pytest_runtest_setup`, for a Bridge built inside the test."""
    try:
        return (yield)
    except BridgeUnavailableError as error:
        pytest.skip(str(error))
