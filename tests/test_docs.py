"""The documentation site covers the public API: every exported name has a docstring and an entry.

Fast and static: reads the ``::: path`` directives of ``docs/**/*.md`` (mkdocstrings) and the
package's source, without importing mkdocs. ``make docs`` then builds the site strictly.
"""

import ast
import base64
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


# --- the site builds offline: tutorials, benchmarks and MathJax come from the repository ---

ROOT = DOCS.parent


def docs_module(name: str) -> ModuleType:
    """A helper script of docs/ (not a package), imported from its file."""
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mkdocs_config() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    config: dict[str, Any] = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return config


def test_mkdocs_config_loads_nothing_from_other_hosts():
    config = mkdocs_config()
    assert config["theme"].get("font") is False, "theme fonts would come from Google Fonts"
    for entry in [*config.get("extra_javascript", []), *config.get("extra_css", [])]:
        url = entry if isinstance(entry, str) else entry["path"]
        assert "//" not in url, f"mkdocs.yml loads {url} from another host"


def test_external_resources_finds_remote_scripts_and_links_only():
    hooks = docs_module("hooks")
    html = (
        '<script src="https://cdn.example/a.js"></script><script src="../b.js"></script>'
        "<link rel=stylesheet href=//fonts.example/c.css><link href='d.css' rel=stylesheet>"
        '<a href="https://github.com/x">a link is fine</a><script>var s = "http://x";</script>'
    )
    assert hooks.external_resources(html) == ["https://cdn.example/a.js", "//fonts.example/c.css"]


def test_built_site_loads_nothing_from_other_hosts():
    """Checks `site/` when `make docs` has built it (the build's own hook checks it too)."""
    site = ROOT / "site"
    if not (site / "index.html").is_file():
        pytest.skip("no built site: run `make docs`")
    hooks = docs_module("hooks")
    for page in site.rglob("*.html"):
        assert not hooks.external_resources(page.read_text(encoding="utf-8")), page
    assert (site / hooks.VENDOR / "MathJax.js").is_file()
    assert (site / hooks.VENDOR / "LICENSE").is_file()


def test_performance_page_includes_the_benchmark_commands():
    page = (DOCS / "performance.md").read_text()
    assert '--8<-- "benchmarks/README.md:run"' in page
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert "--8<-- [start:run]" in readme and "--8<-- [end:run]" in readme
    extensions = mkdocs_config()["markdown_extensions"]
    assert any(isinstance(e, dict) and "pymdownx.snippets" in e for e in extensions)


def test_spec_page_keeps_the_section_numbers_the_code_cites():
    """Docstrings and errors cite "spec §N": the page keeps sections §0 to §7, and is in the nav."""
    assert "spec.md" in str(mkdocs_config()["nav"])
    headings = re.findall(r"^## §(\d+)\.", (DOCS / "spec.md").read_text(), re.MULTILINE)
    assert headings == [str(n) for n in range(8)]
    cited = set()
    for path in (ROOT / "tl_connwalk").rglob("*.py"):
        cited |= set(re.findall(r"spec §(\d+)", path.read_text(encoding="utf-8")))
    assert cited <= set(headings), f"code cites spec sections the page lacks: {cited}"


def test_every_tutorial_has_a_page_in_the_nav():
    nav = str(mkdocs_config()["nav"])
    for notebook in sorted((ROOT / "tutorials").glob("[0-9]*.ipynb")):
        assert f"tutorials/{notebook.stem}.md" in nav, f"{notebook.name} is not in mkdocs.yml"


def test_render_tutorial_writes_code_text_and_figures(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    build = docs_module("build_tutorials")
    png = b"\x89PNG\r\n\x1a\n fake"
    figure = nbformat.v4.new_output(
        "display_data", data={"image/png": base64.b64encode(png).decode(), "text/plain": "F"}
    )
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# Title\n\nProse."),
            nbformat.v4.new_code_cell(
                "print('hi')\nplt.show()",
                outputs=[
                    nbformat.v4.new_output("stream", name="stdout", text="hi\n"),
                    nbformat.v4.new_output("stream", name="stderr", text="progress 50%\n"),
                    figure,
                ],
            ),
            nbformat.v4.new_code_cell(
                "x", outputs=[nbformat.v4.new_output("execute_result", data={"text/plain": "1"})]
            ),
        ]
    )
    page = build.render(notebook, "09_demo", tmp_path)
    assert page.index("# Title") < page.index("```python\nprint('hi')") < page.index("```\nhi\n```")
    assert "![Figure 1 of 09_demo](09_demo_1.png)" in page
    assert (tmp_path / "09_demo_1.png").read_bytes() == png
    assert "```\n1\n```" in page
    assert "progress" not in page
    notebook.cells[1].outputs.append(
        nbformat.v4.new_output("error", ename="ValueError", evalue="bad", traceback=[])
    )
    with pytest.raises(RuntimeError, match="09_demo: ValueError: bad"):
        build.render(notebook, "09_demo", tmp_path)


def test_render_tutorial_frames_views_and_inlines_other_html(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    build = docs_module("build_tutorials")
    from tl_connwalk.views.page import View

    view = View("walk", "a walk", {"sequences": []}).fragment()
    table = "<table><tr><td>1</td></tr></table>"
    outputs = [
        nbformat.v4.new_output("display_data", data={"text/html": html, "text/plain": "x"})
        for html in (view, table)
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=outputs)])
    page = build.render(notebook, "09_demo", tmp_path)
    assert '<iframe src="09_demo_view_1.html"' in page
    assert view in (tmp_path / "09_demo_view_1.html").read_text()
    assert table in page
    assert not (tmp_path / "09_demo_view_2.html").exists()


def test_build_hook_copies_mathjax_and_rejects_remote_scripts(tmp_path):
    if importlib.util.find_spec("jupyter_server_mathjax") is None:
        pytest.skip("jupyter-server-mathjax is installed by `make docs`")
    hooks = docs_module("hooks")
    (tmp_path / "index.html").write_text('<script src="mathjax.js"></script>')
    hooks.on_post_build({"site_dir": str(tmp_path)})
    assert (tmp_path / hooks.VENDOR / "MathJax.js").is_file()
    (tmp_path / "page.html").write_text('<script src="https://cdn.example/m.js"></script>')
    with pytest.raises(RuntimeError, match=r"page\.html.*https://cdn\.example/m\.js"):
        hooks.on_post_build({"site_dir": str(tmp_path)})
