"""Old import paths of the fast modules that moved into ``tl_connwalk.core._fast`` still work
for one release, with a `DeprecationWarning` on import."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tl_connwalk

MOVED = ("quartic", "draws", "head_grams")


def import_afresh(name: str):
    sys.modules.pop(f"tl_connwalk.core.{name}", None)
    return importlib.import_module(f"tl_connwalk.core.{name}")


@pytest.mark.parametrize("name", MOVED)
def test_the_old_path_warns_and_reads_the_new_module(name):
    with pytest.warns(DeprecationWarning, match=f"tl_connwalk.core._fast.{name}"):
        old = import_afresh(name)
    new = importlib.import_module(f"tl_connwalk.core._fast.{name}")
    public = [attr for attr in vars(new) if not attr.startswith("_")]
    assert public and all(getattr(old, attr) is getattr(new, attr) for attr in public)
    assert set(public) <= set(dir(old))


def test_the_package_imports_no_old_path():
    """Every module of the package imports without touching a deprecated path."""
    code = (
        "import pkgutil, importlib, sys, tl_connwalk\n"
        f"old = {{f'tl_connwalk.core.{{name}}' for name in {MOVED!r}}}\n"
        "old |= {'tl_connwalk.residual', 'tl_connwalk.bridge_hooks'}\n"
        "for info in pkgutil.walk_packages(tl_connwalk.__path__, 'tl_connwalk.'):\n"
        "    if info.name not in old and not info.name.endswith('__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "print(sorted(old & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True, text=True, check=False, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_setting_a_constant_through_the_old_path_sets_it_where_it_is_read():
    """What the docs showed: ``head_grams.CACHE_BYTES`` bounds the store, ``cache_clear``
    empties it."""
    with pytest.warns(DeprecationWarning):
        old = import_afresh("head_grams")
    new = importlib.import_module("tl_connwalk.core._fast.head_grams")
    gen = torch.Generator().manual_seed(0)
    W_V, W_O = torch.randn(3, 8, 2, generator=gen), torch.randn(3, 2, 8, generator=gen)
    bound = new.CACHE_BYTES
    tl_connwalk.clear_caches()
    try:
        old.CACHE_BYTES = 0  # nothing fits: nothing is kept
        assert new.CACHE_BYTES == 0
        old.head_grams(W_V, W_O)
        assert tl_connwalk.caches()["core.head_grams"].currsize == 0
    finally:
        old.CACHE_BYTES = bound
    assert bound == new.CACHE_BYTES
    old.head_grams(W_V, W_O)
    assert old.cache_info().currsize == 1
    old.cache_clear()
    assert tl_connwalk.caches()["core.head_grams"].currsize == 0
