"""The docstring examples of ``tl_connwalk`` run as doctests, offline, on a small random model.

Names every example may use: ``torch``, ``tl_connwalk``, ``model`` (a random 2-layer GPT-2
``TransformerBridge``, d_model 32, 4 heads, attached for the example and detached after it),
``tokens`` (``[2, 8]``), ``cache`` (its ``run_with_cache``) and ``walk`` (layer 0's
``ConnectionWalk``).
"""

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tl_connwalk
from tl_connwalk.toy import random_bridge

PACKAGE = Path(__file__).parent / "tl_connwalk"


@functools.cache
def _example_model() -> Any:
    return random_bridge("gpt2")


@pytest.fixture(autouse=True)
def _doctest_objects(request: pytest.FixtureRequest) -> Iterator[None]:
    if PACKAGE not in Path(str(request.node.path)).parents:
        yield  # a test under tests/: nothing to set up
        return
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
    )
    yield
    tl_connwalk.detach(model)
