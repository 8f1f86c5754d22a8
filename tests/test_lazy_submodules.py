"""`tl_connwalk.zoo`, `.ablations` and `.toy`: package attributes, imported on first use."""

import importlib
import json
import subprocess
import sys

import pytest

import tl_connwalk

LAZY = ("ablations", "toy", "zoo")


def test_import_does_not_import_the_lazy_submodules():
    code = (
        "import json, sys, tl_connwalk; "
        f"print(json.dumps([m for m in {LAZY!r} if 'tl_connwalk.' + m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_first_access_imports_the_submodule_once():
    code = (
        "import json, sys, tl_connwalk; before = 'tl_connwalk.zoo' in sys.modules; "
        "zoo = tl_connwalk.zoo; "
        "print(json.dumps([before, zoo is sys.modules['tl_connwalk.zoo'], callable(zoo.load)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True, True]


@pytest.mark.parametrize("name", LAZY)
def test_attribute_is_the_submodule(name):
    assert getattr(tl_connwalk, name) is importlib.import_module(f"tl_connwalk.{name}")
    assert name in dir(tl_connwalk)


def test_unknown_attribute_still_raises():
    with pytest.raises(AttributeError, match="no attribute 'zoom'"):
        tl_connwalk.zoom  # noqa: B018
