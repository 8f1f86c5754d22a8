import pytest
import torch

from tests.architectures import ARCHITECTURES, build

torch.set_num_threads(1)


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def gpt2():
    return build("gpt2_ln")
