"""The documentation site covers the public API: every exported name has a docstring and an entry.

Fast and static: reads the ``::: path`` directives of ``docs/**/*.md`` (mkdocstrings) and the
package's source, without importing mkdocs. ``make docs`` then builds the site strictly.
"""

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import tl_connwalk

DOCS = Path(__file__).resolve().parents[1] / "docs"
DIRECTIVE = re.compile(r"^:::\s+(\S+)\s*$", re.MULTILINE)


def directives() -> list[tuple[str, str]]:
    """``(page, path)`` for every mkdocstrings directive in the docs."""
    return [
        (str(page.relative_to(DOCS)), match.group(1))
        for page in sorted(DOCS.rglob("*.md"))
        for match in DIRECTIVE.finditer(page.read_text())
    ]


def resolve(path: str) -> Any:
    """The object a directive documents. Like griffe, a submodule wins over a package member
    of the same name, so the longest importable module prefix is taken first."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(path)


def is_submodule(module: ModuleType, name: str) -> bool:
    return hasattr(module, "__path__") and importlib.util.find_spec(f"{module.__name__}.{name}")


def rendered(obj: Any) -> list[Any]:
    """What a directive renders, as mkdocstrings does: the object, and for a module the names
    in its ``__all__`` (or, without one, its own public members). A name that a submodule
    shadows is rendered as that submodule, so it does not count."""
    if not isinstance(obj, ModuleType):
        return [obj]
    if hasattr(obj, "__all__"):
        names = [name for name in obj.__all__ if not is_submodule(obj, name)]
    else:
        names = [
            name
            for name, member in vars(obj).items()
            if not name.startswith("_") and getattr(member, "__module__", None) == obj.__name__
        ]
    return [obj, *(getattr(obj, name) for name in names)]


def documented() -> list[Any]:
    return [item for _, path in directives() for item in rendered(resolve(path))]


def source_docstring(obj: Any) -> str | None:
    """The docstring written in the source (as griffe reads it), not one Python made up
    (dataclasses invent a signature docstring) or inherited."""
    module = sys.modules[obj.__module__]
    tree = ast.parse(inspect.getsource(module))
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if isinstance(node, definitions) and node.name == obj.__qualname__:
            return ast.get_docstring(node)
    raise LookupError(f"{obj.__qualname__} is not defined at the top of {module.__name__}")


def test_docs_have_api_pages():
    assert directives(), f"no '::: tl_connwalk...' directive under {DOCS}"


@pytest.mark.parametrize("page, path", directives(), ids=lambda x: str(x))
def test_every_directive_resolves(page, path):
    """A renamed or removed object fails here, naming the page, before mkdocs does."""
    assert path.startswith("tl_connwalk"), (page, path)
    try:
        resolve(path)
    except (ModuleNotFoundError, AttributeError) as error:
        pytest.fail(f"docs/{page}: '::: {path}' does not resolve ({error})")


@pytest.mark.parametrize("name", tl_connwalk.__all__)
def test_public_name_has_a_docstring(name):
    docstring = source_docstring(getattr(tl_connwalk, name))
    assert docstring and docstring.strip(), f"tl_connwalk.{name} has no docstring"


@pytest.mark.parametrize("name", tl_connwalk.__all__)
def test_public_name_is_in_the_api_reference(name):
    obj = getattr(tl_connwalk, name)
    assert any(obj is item for item in documented()), (
        f"tl_connwalk.{name} appears on no API page (a submodule of the same name hides it "
        f"from '::: tl_connwalk'?): add '::: {obj.__module__}.{obj.__qualname__}' to "
        "docs/api/index.md"
    )
