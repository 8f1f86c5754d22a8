import pytest
import torch
from einops import rearrange

from tests.core.test_walk import random_problem
from tests.tolerances import assert_close
from tl_connwalk.core import generator as generator_module
from tl_connwalk.core import walk as core
from tl_connwalk.core.generator import ConnectionGenerator
from tl_connwalk.errors import ConnWalkError


def test_dense_generator_matches_matvec():
    pattern, field, W_V, W_O, *_ = random_problem()
    L = ConnectionGenerator(pattern, W_V, W_O)
    dense = L.to_dense()
    assert dense.shape == L.shape == (2, 35, 35)
    flat = rearrange(field, "b n d -> b 1 (n d)")
    via_dense = rearrange(flat @ dense, "b 1 (n d) -> b n d", n=5)
    assert_close(via_dense, L.matvec(field))
    assert_close(L(field), field - core.propagate(pattern, field, W_V, W_O))


def test_zero_walk_generator_is_identity():
    pattern, _, W_V, W_O, *_ = random_problem()
    L = ConnectionGenerator(torch.zeros_like(pattern), W_V, W_O)
    assert_close(L.to_dense(), torch.eye(35, dtype=torch.float64).expand(2, 35, 35))


def test_dense_refuses_huge(monkeypatch):
    pattern, _, W_V, W_O, *_ = random_problem()
    monkeypatch.setattr(generator_module, "MAX_DENSE_ENTRIES", 100)
    with pytest.raises(ConnWalkError, match="to_dense\\(\\) would build 2 x 35 x 35"):
        ConnectionGenerator(pattern, W_V, W_O).to_dense()
