"""README.md works as written: its Python runs, its links point at files that exist."""

import re
from pathlib import Path

import pytest

from tests.architectures import hooked_only

README = Path(__file__).parents[1] / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
# [text](target): relative targets only (no scheme, no anchor-only links)
LINK = re.compile(r"\]\((?![a-z]+://|#)([^)#\s]+)")


def python_blocks() -> list[str]:
    return PYTHON_BLOCK.findall(README.read_text(encoding="utf-8"))


def test_readme_has_python_blocks():
    assert len(python_blocks()) >= 2


def test_readme_links_exist():
    targets = LINK.findall(README.read_text(encoding="utf-8"))
    assert targets, "the README links into the docs"
    missing = [t for t in targets if not (README.parent / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


@pytest.mark.slow
@hooked_only  # the example loads the default zoo model as a HookedTransformer (TL 3.x)
def test_readme_python_runs_in_order():
    """Every ```python block, in order, in one namespace, as a reader would paste them."""
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for number, block in enumerate(python_blocks(), start=1):
        code = compile(block, f"README.md python block {number}", "exec")
        exec(code, namespace)
