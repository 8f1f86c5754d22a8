import inspect

import pytest

from tests.architectures import bridge_only
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.toy import random_bridge


@bridge_only
def test_unknown_architecture_is_refused():
    with pytest.raises(
        ConnWalkError, match=r"unknown toy architecture 'mamba'; choose one of \('gpt2'"
    ):
        inspect.unwrap(random_bridge)("mamba")  # what users run: no runtime type checker


def test_toy_models_are_reproducible_and_quiet(capfd):
    first, second = random_bridge("llama", seed=3), random_bridge("llama", seed=3)
    assert capfd.readouterr().err == ""
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert a.equal(b), name
