"""A griffe extension that renders tl_connwalk's docstrings as Markdown (used by mkdocs.yml).

The package's docstrings carry reStructuredText habits that Markdown renders badly: doctests
outside a Google ``Examples:`` section (bare, or under ``Example:``, which griffe reads as an
admonition) where ``>>>`` reads as a triple block quote, Sphinx roles such as
``:func:`attach``` (shown literally), ``::`` before literal blocks, and several names on one
line of an ``Attributes:`` or ``Args:`` section (``W_V, W_O: ...``, which griffe reads as one
name and a type). This rewrites
them at build time only; the source files are untouched, and the owners can drop each rule
once the docstrings no longer need it.
"""

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes|Parameters|Examples):\s*$")
_DOCTEST_FLAG = re.compile(r"\s*#\s*doctest:.*$")
_NAMES = re.compile(r"^(\s+)(\w+(?:,\s*\w+)+):\s+(.*)$")


def _role(match: re.Match[str]) -> str:
    return f"`{match.group(1)}`"


def _markdown(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    section, section_indent = "", -1  # the Google section we are in, and its header's indent
    i = 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        if line.strip():
            if indent <= section_indent:
                section, section_indent = "", -1
            header = _SECTION.match(line)
            if header:
                section, section_indent = header.group(2), len(header.group(1))
        # griffe parses doctests under "Examples:" itself; elsewhere they need a fence
        if section != "Examples" and line.lstrip().startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(_DOCTEST_FLAG.sub("", lines[i]))
                i += 1
            pad = " " * indent
            out += [f"{pad}```pycon", *block, f"{pad}```"]
            continue
        names = _NAMES.match(line) if section not in ("", "Examples") else None
        if names:
            pad, description = names.group(1), names.group(3)
            out += [f"{pad}{name.strip()}: {description}" for name in names.group(2).split(",")]
            i += 1
            continue
        if not line.lstrip().startswith((">>>", "...")):
            line = _ROLE.sub(_role, line)
            if line.rstrip().endswith("::") and not line.rstrip().endswith(":::"):
                line = line.rstrip()[:-1]
        out.append(line)
        i += 1
    return "\n".join(out)


class MarkdownDocstrings(griffe.Extension):
    """Rewrite every docstring of the loaded package once the package is complete."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.docstring is not None:
                obj.docstring.value = _markdown(obj.docstring.value)
            stack += [member for member in obj.members.values() if not member.is_alias]
