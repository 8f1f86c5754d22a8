"""``load`` on local Hugging Face directories (tiny random models, offline) and its errors."""

import inspect
import re

import pytest
import torch
import transformer_lens
import transformers

import tl_connwalk
from tests.architectures import HAS_HOOKED, hooked_only
from tests.tolerances import assert_close
from tests.zoo.helpers import attention_outputs, identity_errors, identity_rtol, save_tiny
from tests.zoo.test_convert import tiny_bert_wheel
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.zoo import load
from tl_connwalk.zoo.convert import converted_dir

TOKENS = torch.tensor([[63, 5, 17, 3, 40, 22, 8, 31, 2, 11]])


def test_bridge_backend_refuses_configuration_options():
    with pytest.raises(ConnWalkError, match=r"backend='bridge' takes only weight processing"):
        load("smollm2-135m", backend="bridge", n_ctx=64)


@pytest.mark.parametrize("raw", [False, True], ids=["compat", "raw"])
def test_bridge_backend_on_a_local_directory(tmp_path, raw):
    """A local Hugging Face directory booted as a TransformerBridge (TransformerLens 3.x and
    4.x); the processing options decide compatibility mode."""
    save_tiny("llama", tmp_path)
    path = tmp_path
    options = dict.fromkeys(
        ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases"), False
    )
    model = load(str(path), backend="bridge", **(options if raw else {}))
    assert model.compatibility_mode is not raw
    _, cache = model.run_with_cache(TOKENS)
    for layer in range(model.cfg.n_layers):
        walk = tl_connwalk.connection_walk(cache, layer)
        assert_close(walk.apply() + walk.bias(), cache[f"blocks.{layer}.attn.o.hook_out"])


def test_bad_backend_and_options_are_named():
    with pytest.raises(ConnWalkError, match="backend must be"):
        inspect.unwrap(load)("smollm2-135m", "jax")  # what users run: no runtime type checker
    with pytest.raises(ConnWalkError, match=r"unknown load options \['fold_layernorm'\]"):
        load("smollm2-135m", fold_layernorm=True)


def test_unknown_name_is_a_clear_error(tmp_path):
    with pytest.raises(ConnWalkError, match="neither a zoo model"):
        load("surely-not-a-model-name")
    with pytest.raises(ConnWalkError, match="neither a zoo model"):
        load(str(tmp_path))  # a directory without config.json


@hooked_only
@pytest.mark.parametrize(
    ("name", "hf_class"),
    [("gpt2", "AutoModelForCausalLM"), ("bert-base-cased", "BertForPreTraining")],
)
def test_an_unreachable_hub_is_a_clear_error(monkeypatch, name, hf_class):
    """A TransformerLens model name whose files cannot be fetched (transformers raises
    OSError) says so and names what loads without the hub."""

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    monkeypatch.setattr(getattr(transformers, hf_class), "from_pretrained", unreachable)
    with pytest.raises(ConnWalkError, match=r"from the Hugging Face hub.*connect.*zoo model"):
        load(name)


def test_no_pickled_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConnWalkError, match="never unpickles"):
        load(str(tmp_path))


def test_transformer_lens_4_has_no_hooked_backend(monkeypatch, tmp_path):
    save_tiny("gpt2", tmp_path / "tiny")
    if HAS_HOOKED:  # on 4.x the name is already gone
        monkeypatch.delattr(transformer_lens, "HookedTransformer")
    with pytest.raises(ConnWalkError, match=r"needs TransformerLens 2.16\+ or 3.x"):
        load(str(tmp_path / "tiny"))
    monkeypatch.setenv("TL_CONNWALK_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConnWalkError, match=r"needs TransformerLens 2.16\+ or 3.x"):
        load("smollm2-135m")
    assert not (tmp_path / "cache").exists()  # refused before downloading anything


@hooked_only
def test_encoder_options_are_refused_before_downloading(monkeypatch, tmp_path):
    monkeypatch.setenv("TL_CONNWALK_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConnWalkError, match="HookedEncoder takes no load options"):
        load("minilm-l6", fold_ln=False)
    assert not (tmp_path / "cache").exists()


@hooked_only
@pytest.mark.parametrize("fold_ln", [True, False])
def test_local_grouped_query_decoder(tmp_path, fold_ln):
    """A tiny Llama-architecture directory: TransformerLens logits match transformers'."""
    hf_model = save_tiny("llama", tmp_path / "tiny")
    model = load(str(tmp_path / "tiny"), fold_ln=fold_ln)
    assert isinstance(model, transformer_lens.HookedTransformer)
    assert model.cfg.n_key_value_heads == 2
    assert model.cfg.normalization_type == ("RMSPre" if fold_ln else "RMS")
    with torch.no_grad():
        logits = model(TOKENS)
        expected = hf_model(TOKENS).logits
    # center_unembed shifts each position's logits by a constant: compare log-probabilities
    assert_close(logits.log_softmax(-1), expected.log_softmax(-1), dtype=torch.bfloat16)
    cache, outputs = attention_outputs(model, TOKENS)
    assert max(identity_errors(model, cache, outputs)) < identity_rtol(model, cache)


@hooked_only
def test_unconfigurable_architecture_is_a_clear_error(tmp_path):
    """TransformerLens 3.9 configures Gemma 3 only by official name (the zoo passes one)."""
    save_tiny("gemma3", tmp_path / "tiny")
    with pytest.raises(ConnWalkError, match="cannot configure a HookedTransformer"):
        load(str(tmp_path / "tiny"))


@hooked_only
def test_paths_that_trigger_name_guessing(monkeypatch, tmp_path):
    """TransformerLens 3.x reads "llama" in a path as an architecture; relative paths avoid it."""
    folder = tmp_path / "tiny-llama"
    save_tiny("llama", folder)
    with pytest.raises(ConnWalkError, match="TL_CONNWALK_CACHE"):
        load(str(folder))
    monkeypatch.chdir(folder)
    assert load(str(folder)).cfg.n_layers == 2


@hooked_only
def test_encoder_from_a_bert_model_wheel(tmp_path):
    """The MiniLM route offline: a bare BertModel becomes a HookedEncoder with its hidden states."""
    spec, bert = tiny_bert_wheel(tmp_path)
    folder = converted_dir(spec, tmp_path / "cache")
    model = load(str(folder))
    assert isinstance(model, transformer_lens.HookedEncoder)
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
        expected = bert(TOKENS).last_hidden_state
    assert_close(cache["blocks.1.hook_normalized_resid_post"], expected)
    cache, outputs = attention_outputs(model, TOKENS)
    assert max(identity_errors(model, cache, outputs)) < identity_rtol(model, cache)
    walk = tl_connwalk.connection_walk(cache, 0)
    assert_close(walk.walk.sum(-1), torch.ones(1, TOKENS.shape[1]))
    with pytest.raises(ConnWalkError, match="HookedEncoder takes no load options"):
        load(str(folder), fold_ln=True)


@hooked_only
@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="transformers 4 (beside TransformerLens 2.x) draws no loading bar to hide",
)
def test_progress_false_hides_conversion_and_loading_bars(tmp_path, monkeypatch, capfd):
    """A zoo model's first load (conversion from its wheel, then loading) draws bars by
    default and none with progress=False; the bars' setting is restored afterwards."""
    from transformers.utils import logging as hf_logging

    from tl_connwalk.zoo import loading, registry

    spec, _ = tiny_bert_wheel(tmp_path)
    monkeypatch.setattr(registry, "MODELS", {spec.name: spec})
    monkeypatch.setattr(loading, "MODELS", {spec.name: spec})
    monkeypatch.setenv("TL_CONNWALK_CACHE", str(tmp_path / "cache"))
    bar = re.compile(r"\d+%\|")
    capfd.readouterr()
    load(spec.name, progress=False)  # converts, then loads
    err = capfd.readouterr().err
    assert not bar.search(err), err
    assert hf_logging.is_progress_bar_enabled()
    converted = converted_dir(spec, tmp_path / "cache")
    for path in converted.iterdir():  # convert again, with bars this time
        path.unlink()
    load(spec.name)
    assert bar.search(capfd.readouterr().err)
