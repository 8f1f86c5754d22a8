"""Reading a view's HTML back with the standard library's parser: its elements, its scripts,
its embedded data, and every reference it makes to something outside itself."""

import json
import re
from html.parser import HTMLParser
from typing import Any

from tl_connwalk.views.numbers import DIGITS

#: the relative error of a number kept to DIGITS significant digits
RTOL = 0.5 * 10 ** (1 - DIGITS)

#: attributes that make a browser load (or go to) an address
LOADING = ("src", "href", "xlink:href", "action", "formaction", "srcset", "poster", "data")


class Page(HTMLParser):
    """Every start tag with its attributes, and the text inside each script and style."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.styles: list[str] = []
        self._open: tuple[str, dict[str, str | None]] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag in ("script", "style"):
            self._open = (tag, dict(attrs))
            self._text: list[str] = []

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._open is not None and tag == self._open[0]:
            text = "".join(self._text)
            if tag == "script":
                self.scripts.append((self._open[1], text))
            else:
                self.styles.append(text)
            self._open = None

    def named(self, tag: str) -> list[dict[str, str | None]]:
        return [attrs for name, attrs in self.tags if name == tag]

    def data(self) -> dict[str, Any]:
        """The one ``<script type="application/json">``'s data."""
        blocks = [text for attrs, text in self.scripts if attrs.get("type") == "application/json"]
        assert len(blocks) == 1, f"{len(blocks)} data blocks"
        return json.loads(blocks[0])

    def external(self) -> list[str]:
        """Every address the page would load or go to: attributes, CSS url() and @import."""
        found = []
        for tag, attrs in self.tags:
            for name, value in attrs.items():
                if name in LOADING and value is not None and not value.startswith("data:"):
                    found.append(f"<{tag} {name}={value!r}>")
                if name == "style" and value and re.search(r"url\(|@import", value):
                    found.append(f"<{tag} style={value!r}>")
            if tag == "link" or (tag == "meta" and attrs.get("http-equiv") == "refresh"):
                found.append(f"<{tag} {attrs}>")
        for style in self.styles:
            found += re.findall(r"url\([^)]*\)|@import[^;]*", style)
        for attrs, text in self.scripts:
            if attrs.get("type") != "application/json":
                found += re.findall(r"\b(?:fetch|XMLHttpRequest|WebSocket|import)\s*\(", text)
                found += re.findall(r"https?://(?!www\.w3\.org/2000/svg\")\S+", text)
        return found
