"""Modules that moved keep their old import path for one release, with a DeprecationWarning."""

import importlib
import sys

import pytest

MOVED = {
    "tl_connwalk.residual": "tl_connwalk.walk.residual",
    "tl_connwalk.bridge_hooks": "tl_connwalk.hooks.bridge",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_gives_the_moved_module(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_old_names_still_resolve(monkeypatch):
    monkeypatch.delitem(sys.modules, "tl_connwalk.residual", raising=False)
    with pytest.warns(DeprecationWarning):
        from tl_connwalk.residual import LaplacianResidual, laplacian_residual
    from tl_connwalk.walk import LaplacianResidual as moved

    assert LaplacianResidual is moved
    assert callable(laplacian_residual)
