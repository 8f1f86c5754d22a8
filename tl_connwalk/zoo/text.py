"""The default English text for reports and tests, shipped as package data.

``data/default_text.txt`` holds public-domain prose, written out for the project: the first two
chapters of Jane Austen's *Pride and Prejudice* (1813), the Declaration of Independence (1776,
with some of its list of grievances left out) and the Gettysburg Address (1863). About 2,900
words: 3,000-4,000 tokens for the zoo's tokenizers.
"""

from importlib import resources


def default_text() -> str:
    """The default English text (public domain; about 3,500 tokens), as one string.

    >>> default_text().startswith("It is a truth universally acknowledged")
    True
    """
    return resources.files("tl_connwalk.zoo").joinpath("data/default_text.txt").read_text("utf-8")
