"""MkDocs hooks: copy MathJax into the built site, so formulas render offline, and fail the
build if any page still loads a script or stylesheet from another host.

MathJax 2.7.9 (Apache-2.0, its LICENSE travels with it) comes from the PyPI package
`jupyter-server-mathjax`, which ships it as static files; `make docs` installs that package
with `--no-deps` (the Jupyter server it extends is not needed to copy files). The package is
located without importing it, since importing it would need that server.
"""

import importlib.util
import re
import shutil
from pathlib import Path
from typing import Any

VENDOR = Path("vendor") / "mathjax"  # relative to site_dir; mkdocs.yml's extra_javascript
# <script src=...> and <link href=...> (stylesheets, fonts, preloads) that leave the site
REMOTE = re.compile(
    r"""<(?:script|link)\b[^>]*?\b(?:src|href)\s*=\s*["']?((?:[a-z]+:)?//[^"'\s>]+)""",
    re.IGNORECASE,
)


def external_resources(html: str) -> list[str]:
    """The URLs of scripts and `<link>` resources in `html` that are not served by the site."""
    return REMOTE.findall(html)


def mathjax_static() -> Path:
    spec = importlib.util.find_spec("jupyter_server_mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "MathJax for the offline site comes from the PyPI package jupyter-server-mathjax: "
            "install it with `pip install --no-deps -c requirements/dev-constraints.txt "
            "jupyter-server-mathjax` (`make docs` does)"
        )
    static = Path(next(iter(spec.submodule_search_locations))) / "static"
    if not (static / "MathJax.js").is_file():
        raise RuntimeError(f"{static} has no MathJax.js: reinstall jupyter-server-mathjax")
    return static


def on_pre_build(config: Any) -> None:
    mathjax_static()  # fail before rendering anything if MathJax is missing


def on_post_build(config: Any) -> None:
    target = Path(config["site_dir"]) / VENDOR
    shutil.rmtree(target, ignore_errors=True)
    # the translations of MathJax's menus are left out; English is built in
    shutil.copytree(mathjax_static(), target, ignore=shutil.ignore_patterns("localization"))
    site = Path(config["site_dir"])
    remote = {
        str(page.relative_to(site)): urls
        for page in sorted(site.rglob("*.html"))
        if (urls := external_resources(page.read_text(encoding="utf-8")))
    }
    if remote:
        raise RuntimeError(
            f"pages load resources from other hosts, so the site would not work offline: "
            f"{remote}; serve them from docs/ (see docs/hooks.py) or drop them from mkdocs.yml"
        )
