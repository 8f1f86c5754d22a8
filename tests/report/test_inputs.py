"""What a report reads: text files, dataset folders, toy tokens."""

import pytest

from tl_connwalk.errors import ConnWalkError
from tl_connwalk.report.inputs import read_text, toy_names
from tl_connwalk.zoo import default_text


def test_default_text():
    text, source = read_text(None, None)
    assert text == default_text()
    assert source["source"] == "default"


def test_text_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("Hello there.", encoding="utf-8")
    assert read_text(path, None) == ("Hello there.", {"source": "file", "path": str(path)})


def test_dataset_folder_joins_sorted_txt_files(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "c.md").write_text("ignored", encoding="utf-8")
    text, source = read_text(None, tmp_path)
    assert text == "first\n\nsecond"
    assert source["files"] == ["a.txt", "b.txt"]


def test_missing_inputs(tmp_path):
    with pytest.raises(ConnWalkError, match="no such file"):
        read_text(tmp_path / "none.txt", None)
    with pytest.raises(ConnWalkError, match=r"\*\.txt"):
        read_text(None, tmp_path)
    with pytest.raises(ConnWalkError, match="not both"):
        read_text(tmp_path, tmp_path)


def test_toy_names():
    assert toy_names() == ["toy-gpt2", "toy-llama", "toy-gemma3", "toy-bert"]
