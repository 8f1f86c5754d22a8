"""The model table: complete, consistent, and safe from TransformerLens's name guessing."""

import re

import pytest

from tl_connwalk.errors import ConnWalkError
from tl_connwalk.zoo import MODELS, available
from tl_connwalk.zoo.registry import get_spec

SHA256 = re.compile(r"[0-9a-f]{64}")


def test_the_issue_models_are_there():
    assert {"smollm2-135m", "minilm-l6", "gemma3-270m"} <= set(MODELS)
    assert set(available()) == set(MODELS)
    assert all(text for text in available().values())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_entry_is_well_formed(name):
    spec = MODELS[name]
    assert spec.name == name
    assert spec.wheels
    for wheel in spec.wheels:
        assert SHA256.fullmatch(wheel.sha256), wheel
        # PyPI's wheel name: the project name normalised, then the version
        stem = re.sub(r"[-_.]+", "_", wheel.package).lower()
        assert wheel.filename == f"{stem}-{wheel.version}-py3-none-any.whl"
        assert wheel.requirement == f"{wheel.package}=={wheel.version}"
        assert wheel.members and all(not m.startswith("/") for m in wheel.members)
    if spec.source_format == "gguf":
        assert spec.source_sha256 and SHA256.fullmatch(spec.source_sha256)
        assert spec.model_class == "HookedTransformer"
    else:
        assert any(m.endswith("model.safetensors") for w in spec.wheels for m in w.members)
    assert spec.d_vocab > 1000


def test_cache_keys_are_unique_and_neutral():
    """TransformerLens 3.x reads "llama"/"gemma"/"bert" in a local path as an architecture."""
    keys = [spec.key for spec in MODELS.values()]
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert re.fullmatch(r"m-[0-9a-f]{16}", key)


def test_no_member_is_a_pickle():
    for spec in MODELS.values():
        for wheel in spec.wheels:
            for member in wheel.members:
                assert not member.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt")), member


def test_unknown_name_lists_the_zoo():
    with pytest.raises(ConnWalkError, match="smollm2-135m"):
        get_spec("gpt-5")
