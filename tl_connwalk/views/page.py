"""`View`: one self-contained HTML view, for a notebook (`View.show`) or a file (`View.save`).

The page carries everything it needs: the stylesheet and the script inline (from ``static/``),
the numbers as JSON in a ``<script type="application/json">`` element, nothing loaded from
anywhere (the saved file forbids it with a Content-Security-Policy). The script reads every
string of the data as text, never as markup, and the JSON is written so that no string in it
can close its element (`embedded_json`).
"""

import dataclasses
import functools
import html
import json
import uuid
from pathlib import Path
from typing import Any, Literal

from tl_connwalk.errors import ConnWalkError

STATIC = Path(__file__).parent / "static"

#: what the saved page may load: nothing but its own inline style and script, and data: images
POLICY = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"

Kind = Literal["attribution", "walk"]


@functools.cache
def _asset(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def embedded_json(data: Any) -> str:
    """``data`` as JSON that is safe inside a ``<script>`` element.

    ``<``, ``>`` and ``&`` are written as ``\\u003c``, ``\\u003e``, ``\\u0026`` (they occur
    only inside JSON strings, where the escapes read back the same), so no string can end the
    element or open a comment; U+2028 and U+2029 are escaped for older JavaScript parsers.

    >>> embedded_json({"token": "</script>"})
    '{"token":"\\\\u003c/script\\\\u003e"}'
    """
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escape in (
        ("&", "\\u0026"),
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escape)
    return text


@dataclasses.dataclass(frozen=True)
class View:
    """An interactive view: its kind (which script draws it), title and data.

    Attributes:
        kind: ``"attribution"`` or ``"walk"``.
        title: the saved page's title.
        data: the numbers and labels the page draws, JSON-ready (see
            `tl_connwalk.attribution.view.attribution_data` and
            `tl_connwalk.views.walk.walk_data`).
    """

    kind: Kind
    title: str
    data: dict[str, Any]

    def fragment(self) -> str:
        """The view as one ``<div>``, for a notebook cell or any page (styles scoped to it).

        >>> View("walk", "a walk", {"sequences": []}).fragment().startswith('<div class="cwv"')
        True
        """
        root = f"cwv-{uuid.uuid4().hex[:16]}"
        script = _asset("common.js") + "\n" + _asset(f"{self.kind}.js")
        data = embedded_json(self.data)
        render = "renderAttribution" if self.kind == "attribution" else "renderWalk"
        return (
            f'<div class="cwv" id="{root}" data-kind="{self.kind}">\n'
            f"<style>{_asset('view.css')}</style>\n"
            f'<script type="application/json" class="cwv-data">{data}</script>\n'
            '<div class="cwv-body"><noscript>This view needs JavaScript.</noscript></div>\n'
            f"<script>(function () {{\n{script}\n"
            f'run(document.getElementById("{root}"), {render});\n}})();</script>\n'
            "</div>"
        )

    def html(self) -> str:
        """The view as a whole HTML document that loads nothing from anywhere."""
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{POLICY}">\n'
            f"<title>{html.escape(self.title)}</title>\n"
            "<style>body { margin: 16px 24px; background: #fff; }</style>\n"
            f"</head><body>\n{self.fragment()}\n</body></html>\n"
        )

    def save(self, path: str | Path) -> Path:
        """Write `html` to ``path`` (UTF-8) and return the path; open it in any browser."""
        if not isinstance(path, str | Path):
            raise ConnWalkError(
                f"path must be a file name (a str or pathlib.Path) such as view.html, got "
                f"{type(path).__name__}."
            )
        path = Path(path)
        if path.is_dir():
            raise ConnWalkError(f"{path} is a directory; pass a file name such as view.html.")
        if not path.parent.is_dir():
            raise ConnWalkError(
                f"the folder {path.parent} does not exist; create it first or write elsewhere."
            )
        path.write_text(self.html(), encoding="utf-8")
        return path

    def show(self) -> None:
        """Display the view in a Jupyter notebook (IPython's HTML display, no widget server)."""
        try:
            from IPython.display import HTML, display
        except ImportError as error:
            raise ConnWalkError(
                "show() displays the view in a Jupyter notebook and needs IPython; outside one, "
                "write a file with to_html(path) and open it in a browser."
            ) from error
        display(HTML(self.fragment()))

    def _repr_html_(self) -> str:
        return self.fragment()
