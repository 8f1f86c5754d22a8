"""The default English text ships as package data."""

from pathlib import Path

import pytest

import tl_connwalk.zoo
from tl_connwalk.zoo import default_text

ROOT = Path(__file__).parents[2]


def test_default_text_is_a_few_thousand_words_of_english():
    text = default_text()
    assert text.startswith("It is a truth universally acknowledged")
    assert "government of the people, by the people, for the people" in text
    assert 2500 < len(text.split()) < 6000
    assert text.isascii() and "\t" not in text


def test_it_is_declared_as_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["tl_connwalk.zoo"]
    package = Path(tl_connwalk.zoo.__file__).parent
    assert any((package / "data" / "default_text.txt") in package.glob(p) for p in patterns)
