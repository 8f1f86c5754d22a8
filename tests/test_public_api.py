"""The public surface, the layering of the house, and that runtime shape checks are on."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tl_connwalk
from tl_connwalk.core import walk as core

CORE = Path(tl_connwalk.__file__).parent / "core"


def test_every_exported_name_imports():
    for name in tl_connwalk.__all__:
        assert getattr(tl_connwalk, name) is not None, name


def run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_imports_only_core(path):
    """The math core knows no model class: it imports the core, the errors and libraries only."""
    ours = {name for name in imported_modules(path) if name.startswith("tl_connwalk")}
    assert ours <= {"tl_connwalk.errors"} | {n for n in ours if n.startswith("tl_connwalk.core")}


def test_import_patches_nothing():
    assert (
        run_python(
            "from transformer_lens import ActivationCache; import tl_connwalk; "
            "print(hasattr(ActivationCache, 'connection_walk'))"
        )
        == "False"
    )


def test_runtime_shape_checks_are_on_under_test():
    pattern = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    with pytest.raises(Exception, match="d_head|head"):
        core.propagate(pattern, torch.randn(1, 3, 8), torch.randn(2, 8, 4), torch.randn(3, 4, 8))
