"""`tl_connwalk.views.page`: one self-contained page, its data safe inside its script."""

import json
import sys
import types

import pytest

from tests.views.pages import Page
from tl_connwalk import ConnWalkError
from tl_connwalk.views.numbers import DIGITS, as_lists, rounded
from tl_connwalk.views.page import POLICY, View, embedded_json

HOSTILE = [
    "</script><img src=x onerror=alert(1)>",
    "</SCRIPT ><script>alert(2)</script>",
    "<!--<script>",
    "\"'&amp;&lt;",
    "line\u2028break\u2029",
    "]]></style><style>*{background:url(https://example.com/x)}",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_embedded_json_cannot_end_its_element_and_reads_back_the_same(text):
    data = {"tokens": [text], "nested": {text: [1.5]}}
    written = embedded_json(data)
    assert not any(char in written for char in "<>&\u2028\u2029")
    assert json.loads(written) == data


def test_numbers_keep_digits_significant_digits_and_null_for_non_finite():
    import torch

    values = torch.tensor([[1 / 3, -2e-9, 12345678.0], [float("nan"), float("inf"), 0.0]])
    listed = as_lists(values)
    assert listed[1] == [None, None, 0.0]
    for got, want in zip(listed[0], values[0].double().tolist(), strict=True):
        assert got == float(f"{want:.{DIGITS}g}")
        assert abs(got - want) <= 0.5 * 10 ** (1 - DIGITS) * abs(want)
    assert rounded(float("-inf")) is None


def view(tokens: list[str]) -> View:
    return View("walk", "</title><script>alert(3)</script>", {"kind": "walk", "tokens": tokens})


def test_the_document_loads_nothing_and_forbids_loading():
    page = Page(view(HOSTILE).html())
    assert page.external() == []
    assert [a.get("content") for a in page.named("meta") if a.get("http-equiv")] == [POLICY]
    assert len(page.scripts) == 2  # the data and the code, nothing a token opened
    assert page.named("img") == []
    assert not any(name.startswith("on") for _, attrs in page.tags for name in attrs)
    assert page.data()["tokens"] == HOSTILE


def test_the_title_is_escaped():
    text = view([]).html()
    assert "<title>&lt;/title&gt;&lt;script&gt;alert(3)&lt;/script&gt;</title>" in text


def test_fragments_have_their_own_ids():
    first, second = Page(view([]).fragment()), Page(view([]).fragment())
    ids = [attrs["id"] for page in (first, second) for attrs in page.named("div")[:1]]
    assert len(set(ids)) == 2
    assert all(
        f'getElementById("{i}")' in page.scripts[-1][1]
        for i, page in zip(ids, (first, second), strict=True)
    )


def test_save_writes_the_document(tmp_path):
    path = view(["a"]).save(tmp_path / "view.html")
    assert Page(path.read_text(encoding="utf-8")).data() == {"kind": "walk", "tokens": ["a"]}
    with pytest.raises(ConnWalkError, match="is a directory"):
        view(["a"]).save(tmp_path)


def test_show_displays_the_fragment_as_html(monkeypatch):
    shown = []
    display = types.ModuleType("IPython.display")
    display.HTML = lambda text: ("HTML", text)  # type: ignore[attr-defined]
    display.display = shown.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", types.ModuleType("IPython"))
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    view(["a"]).show()
    [(kind, text)] = shown
    assert kind == "HTML" and text.startswith('<div class="cwv"')
    assert Page(text).data()["tokens"] == ["a"]


def test_show_without_ipython_says_to_write_a_file(monkeypatch):
    monkeypatch.setitem(sys.modules, "IPython", None)
    monkeypatch.setitem(sys.modules, "IPython.display", None)
    with pytest.raises(ConnWalkError, match=r"to_html\(path\)"):
        view(["a"]).show()
