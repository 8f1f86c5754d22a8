"""Bad input to every public callable raises `ConnWalkError`, never another exception.

`ROWS` is a table of bad calls, each with what is wrong in it, over the whole public API: the
package's namespace (``tl_connwalk.__all__``), `tl_connwalk.ablations`, `tl_connwalk.zoo`,
`tl_connwalk.toy`, the methods of the exported classes and the cache methods `attach` adds.
`test_every_public_callable_has_bad_input_rows` fails for a public callable with no row and
no place in `TAKES_NO_ARGUMENTS` or `RECORDS`. Each row runs on a small random model of each
class the installed TransformerLens has (``HookedTransformer`` on 2.x and 3.x,
``TransformerBridge`` on 3.x and 4.x), with jaxtyping's runtime checks off: users run without
them, so the errors here are the ones users see. A call Python itself refuses (more positional
arguments than the function takes) raises Python's ``TypeError`` as for any function; options
passed on through ``**options`` are named by tl_connwalk.
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jaxtyping
import pytest
import torch
from torch import nn
from transformer_lens import ActivationCache

import tl_connwalk
import tl_connwalk.ablations as ablations
import tl_connwalk.toy as toy
import tl_connwalk.zoo as zoo
from tests.architectures import HAS_HOOKED, build
from tl_connwalk import ConnWalkError
from tl_connwalk.adapters.versions import HAS_BRIDGE
from tl_connwalk.plugin import CACHE_METHODS

KINDS = [kind for kind, has in (("hooked", HAS_HOOKED), ("bridge", HAS_BRIDGE)) if has]
N_LAYERS, N_HEADS, N_POS = 2, 4, 6


@dataclasses.dataclass
class World:
    """A small attached model of one class and what the rows call methods on."""

    model: Any
    tokens: torch.Tensor

    @functools.cached_property
    def cache(self) -> ActivationCache:
        return self.model.run_with_cache(self.tokens)[1]

    @functools.cached_property
    def walk(self) -> tl_connwalk.ConnectionWalk:
        return tl_connwalk.connection_walk(self.cache, 0)

    @functools.cached_property
    def attribution(self) -> tl_connwalk.Attribution:
        return tl_connwalk.attribute(self.model, self.tokens)

    @functools.cached_property
    def estimate(self) -> tl_connwalk.Attribution:
        return tl_connwalk.attribute(self.model, self.tokens, method="knockout_estimate")

    @functools.cached_property
    def knockout(self) -> tl_connwalk.Attribution:
        return tl_connwalk.attribute(self.model, self.tokens, method="knockout")

    @property
    def generator(self) -> tl_connwalk.ConnectionGenerator:
        return self.walk.generator()

    @property
    def transports(self) -> tl_connwalk.EffectiveTransport:
        return self.walk.effective_transport()

    @property
    def pattern(self) -> torch.Tensor:
        return self.walk.patterns

    @property
    def field(self) -> torch.Tensor:
        return self.walk.field


@functools.cache
def _model(kind: str) -> Any:
    if kind == "hooked":
        return build("gpt2_ln")
    return toy.random_bridge("gpt2", n_layers=N_LAYERS, d_model=24, n_heads=N_HEADS)


@pytest.fixture(scope="module", params=KINDS)
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    model = _model(request.param)
    tl_connwalk.attach(model)
    tokens = torch.randint(0, 40, (2, N_POS), generator=torch.Generator().manual_seed(0))
    yield World(model, tokens)
    tl_connwalk.detach(model)


@pytest.fixture
def as_users_run() -> Iterator[None]:
    """jaxtyping's and beartype's checks off, as outside this test suite."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", before)


@dataclasses.dataclass(frozen=True)
class Row:
    """A bad call of the public callable ``api``; ``bad`` says what is wrong with it."""

    api: str
    bad: str
    call: Callable[[World], object]

    @property
    def id(self) -> str:
        return f"{self.api}: {self.bad}"


def rows(api: str, **cases: Callable[[World], object]) -> list[Row]:
    return [Row(api, bad.replace("_", " "), call) for bad, call in cases.items()]


def unattached_cache_method(w: World) -> object:
    """``cache.connection_walk(0)`` on a cache of a model that was never attached."""
    tl_connwalk.detach(w.model)
    try:
        assert not hasattr(ActivationCache, "connection_walk"), "another model is attached"
        return w.model.run_with_cache(w.tokens)[1].connection_walk(0)
    finally:
        tl_connwalk.attach(w.model)


@functools.cache
def unattached_model() -> Any:
    """A model of the first class in `KINDS`, never attached."""
    return build("gpt2_ln") if HAS_HOOKED else toy.random_bridge("gpt2")


def ones_mask(w: World, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    return torch.ones(shape or tuple(w.tokens.shape), dtype=torch.long)


def a_linear() -> nn.Module:
    return nn.Linear(2, 2)


#: bad layers of a model with `N_LAYERS` layers, for the arguments taking one layer index
BAD_LAYERS: dict[str, object] = {
    "layer_too_large": N_LAYERS,
    "layer_too_negative": -N_LAYERS - 1,
    "layer_a_float": 1.0,
    "layer_a_bool": True,
    "layer_a_string": "0",
    "layer_None": None,
}

#: bad head selections (sequences of head indices) of a layer with `N_HEADS` heads
BAD_HEADS: dict[str, object] = {
    "head_too_large": [N_HEADS],
    "head_too_negative": [-N_HEADS - 1],
    "heads_repeated": [0, 0],
    "head_a_float": [0.0, 1],
    "head_a_bool": [True, 2],
    "heads_a_string": "01",
    "heads_empty": [],
}


def per_layer(api: str, call: Callable[[World, object], object]) -> list[Row]:
    return [
        Row(api, bad.replace("_", " "), functools.partial(_with, call, layer))
        for bad, layer in BAD_LAYERS.items()
    ]


def per_heads(api: str, call: Callable[[World, object], object]) -> list[Row]:
    return [
        Row(api, bad.replace("_", " "), functools.partial(_with, call, heads))
        for bad, heads in BAD_HEADS.items()
    ]


def _with(call: Callable[[World, object], object], value: object, w: World) -> object:
    return call(w, value)


CACHE_FUNCTION_CASES = {
    "cache_None": lambda f, w: f(None, 0),
    "cache_a_dict": lambda f, w: f(dict(w.cache.cache_dict), 0),
    "cache_a_tensor": lambda f, w: f(w.tokens, 0),
    "model_a_string": lambda f, w: f(w.cache, 0, "gpt2"),
    "model_not_a_transformer": lambda f, w: f(w.cache, 0, a_linear()),
    "cache_without_model": lambda f, w: f(ActivationCache(w.cache.cache_dict, None), 0),
}


def cache_function_rows(api: str, function: Callable[..., object]) -> list[Row]:
    found = [
        Row(api, bad.replace("_", " "), functools.partial(_cache_case, case, function))
        for bad, case in CACHE_FUNCTION_CASES.items()
    ]
    return found + per_layer(api, lambda w, layer: function(w.cache, layer))


def _cache_case(case: Callable[..., object], function: Callable[..., object], w: World) -> object:
    return case(function, w)


def transport_rows(name: str) -> list[Row]:
    """The rows of the transport patch ``tl_connwalk.ablations.<name>(model, layer, head)``."""
    factory = getattr(ablations, name)
    return [
        *rows(
            f"tl_connwalk.ablations.{name}",
            model_None=lambda w: factory(None, 0),
            model_a_string=lambda w: factory("gpt2", 0),
            model_not_a_transformer=lambda w: factory(a_linear(), 0),
            model_not_attached=lambda w: factory(unattached_model(), 0),
            head_too_large=lambda w: factory(w.model, 0, N_HEADS),
            head_too_negative=lambda w: factory(w.model, 0, -N_HEADS - 1),
            head_a_float=lambda w: factory(w.model, 0, 1.0),
            head_a_bool=lambda w: factory(w.model, 0, True),
            head_a_string=lambda w: factory(w.model, 0, "0"),
            heads_holding_a_float=lambda w: factory(w.model, 0, [0, 1.0]),
        ),
        *per_layer(f"tl_connwalk.ablations.{name}", lambda w, layer: factory(w.model, layer)),
    ]


#: rows that fail where the input is checked in tl_connwalk/attribution/api.py and frozen.py
#: rows that fail where a page is written, tl_connwalk/views (View.save, token_labels, walk_data)

ROWS: list[Row] = [
    # --- tl_connwalk ---------------------------------------------------------------------
    *rows(
        "tl_connwalk.attach",
        model_None=lambda w: tl_connwalk.attach(None),
        a_string=lambda w: tl_connwalk.attach("gpt2"),
        not_a_transformer=lambda w: tl_connwalk.attach(a_linear()),
        a_cache=lambda w: tl_connwalk.attach(w.cache),
    ),
    *rows(
        "tl_connwalk.detach",
        model_None=lambda w: tl_connwalk.detach(None),
        a_string=lambda w: tl_connwalk.detach("gpt2"),
        not_a_transformer=lambda w: tl_connwalk.detach(a_linear()),
    ),
    *rows(
        "tl_connwalk.is_attached",
        model_None=lambda w: tl_connwalk.is_attached(None),
        a_string=lambda w: tl_connwalk.is_attached("gpt2"),
    ),
    *cache_function_rows("tl_connwalk.connection_walk", tl_connwalk.connection_walk),
    *rows(
        "tl_connwalk.connection_walk",
        attention_mask_wrong_shape=lambda w: tl_connwalk.connection_walk(
            w.cache, 0, attention_mask=ones_mask(w, (2, N_POS + 1))
        ),
        attention_mask_a_list=lambda w: tl_connwalk.connection_walk(
            w.cache, 0, attention_mask=[[1] * N_POS] * 2
        ),
        attention_mask_of_floats=lambda w: tl_connwalk.connection_walk(
            w.cache, 0, attention_mask=torch.full(tuple(w.tokens.shape), 0.5)
        ),
        attention_mask_all_padding=lambda w: tl_connwalk.connection_walk(
            w.cache, 0, attention_mask=torch.zeros(tuple(w.tokens.shape), dtype=torch.long)
        ),
    ),
    *cache_function_rows("tl_connwalk.walk_matrix", tl_connwalk.walk_matrix),
    *per_heads(
        "tl_connwalk.walk_matrix", lambda w, h: tl_connwalk.walk_matrix(w.cache, 0, heads=h)
    ),
    *cache_function_rows("tl_connwalk.laplacian_residual", tl_connwalk.laplacian_residual),
    *rows(
        "tl_connwalk.laplacian_residual",
        unknown_option=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, sink=True),
        mu_unknown=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, mu="stationery"),
        mu_wrong_shape=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, mu=torch.ones(3)),
        alpha_a_string=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, alpha="0.5"),
        alpha_above_one=lambda w: tl_connwalk.laplacian_residual(
            w.cache, 0, mu="teleport", alpha=1.5
        ),
        baseline_draws_one=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, baseline_draws=1),
        baseline_draws_a_float=lambda w: tl_connwalk.laplacian_residual(
            w.cache, 0, baseline_draws=4.0
        ),
        baseline_draws_a_string=lambda w: tl_connwalk.laplacian_residual(
            w.cache, 0, baseline_draws="8"
        ),
        seed_a_string=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, seed="0"),
        seed_a_float=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, seed=0.5),
        exact_a_string=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, exact="yes"),
        exclude_sink_None=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, exclude_sink=None),
        max_edges_zero=lambda w: tl_connwalk.laplacian_residual(
            w.cache, 0, exact=True, max_edges=0
        ),
        mass_share_above_one=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, mass_share=1.5),
        mass_share_a_string=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, mass_share="1"),
        query_chunk_zero=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, query_chunk=0),
        edges_a_string=lambda w: tl_connwalk.laplacian_residual(w.cache, 0, edges="causal"),
        edges_wrong_shape=lambda w: tl_connwalk.laplacian_residual(
            w.cache, 0, edges=torch.ones(2, 3, 3, dtype=torch.bool)
        ),
        edges_of_floats=lambda w: tl_connwalk.laplacian_residual(
            w.cache, 0, edges=torch.ones(2, N_POS, N_POS)
        ),
        edges_a_function_of_one_argument=lambda w: tl_connwalk.laplacian_residual(
            w.cache, 0, edges=lambda q: q > 0
        ),
        edges_a_function_returning_no_mask=lambda w: tl_connwalk.laplacian_residual(
            w.cache, 0, edges=lambda q, k: 1.0
        ),
    ),
    *per_heads(
        "tl_connwalk.laplacian_residual",
        lambda w, h: tl_connwalk.laplacian_residual(w.cache, 0, heads=h),
    ),
    *rows(
        "tl_connwalk.required_hooks",
        model_None=lambda w: tl_connwalk.required_hooks(None),
        model_not_a_transformer=lambda w: tl_connwalk.required_hooks(a_linear()),
        layers_a_string=lambda w: tl_connwalk.required_hooks(w.model, "01"),
        layers_a_float=lambda w: tl_connwalk.required_hooks(w.model, 1.0),
        layers_holding_None=lambda w: tl_connwalk.required_hooks(w.model, [None]),
    ),
    *per_layer(
        "tl_connwalk.required_hooks", lambda w, layer: tl_connwalk.required_hooks(w.model, [layer])
    ),
    *rows(
        "tl_connwalk.layer_drift",
        cache_None=lambda w: tl_connwalk.layer_drift(None),
        cache_a_tensor=lambda w: tl_connwalk.layer_drift(w.tokens),
        exclude_sink_a_string=lambda w: tl_connwalk.layer_drift(w.cache, exclude_sink="yes"),
        attention_mask_wrong_shape=lambda w: tl_connwalk.layer_drift(
            w.cache, attention_mask=ones_mask(w, (3, N_POS))
        ),
        edges_wrong_shape=lambda w: tl_connwalk.layer_drift(
            w.cache, edges=torch.ones(1, 2, 2, dtype=torch.bool)
        ),
        edges_a_number=lambda w: tl_connwalk.layer_drift(w.cache, edges=1),
    ),
    *per_heads("tl_connwalk.layer_drift", lambda w, h: tl_connwalk.layer_drift(w.cache, heads=h)),
    *rows(
        "tl_connwalk.geometry_table",
        cache_None=lambda w: tl_connwalk.geometry_table(None, progress=False),
        cache_a_dict=lambda w: tl_connwalk.geometry_table({}, progress=False),
        layers_an_int=lambda w: tl_connwalk.geometry_table(w.cache, 0.5, progress=False),
        layers_a_string=lambda w: tl_connwalk.geometry_table(w.cache, "01", progress=False),
        baseline_draws_one=lambda w: tl_connwalk.geometry_table(
            w.cache, [0], baseline_draws=1, progress=False
        ),
        baseline_draws_a_string=lambda w: tl_connwalk.geometry_table(
            w.cache, [0], baseline_draws="8", progress=False
        ),
        seed_a_string=lambda w: tl_connwalk.geometry_table(w.cache, [0], seed="0", progress=False),
        exclude_sink_a_string=lambda w: tl_connwalk.geometry_table(
            w.cache, [0], exclude_sink="yes", progress=False
        ),
        progress_a_string=lambda w: tl_connwalk.geometry_table(w.cache, [0], progress="no"),
        residuals_a_list=lambda w: tl_connwalk.geometry_table(
            w.cache, [0], residuals=[None], progress=False
        ),
        residuals_holding_a_string=lambda w: tl_connwalk.geometry_table(
            w.cache, [0], residuals={0: "residual"}, progress=False
        ),
        attention_mask_wrong_shape=lambda w: tl_connwalk.geometry_table(
            w.cache, [0], attention_mask=ones_mask(w, (2, 2)), progress=False
        ),
        edges_a_string=lambda w: tl_connwalk.geometry_table(
            w.cache, [0], edges="causal", progress=False
        ),
    ),
    *per_layer(
        "tl_connwalk.geometry_table",
        lambda w, layer: tl_connwalk.geometry_table(w.cache, [layer], progress=False),
    ),
    *per_heads(
        "tl_connwalk.geometry_table",
        lambda w, h: tl_connwalk.geometry_table(w.cache, [0], heads=h, progress=False),
    ),
    *rows(
        "tl_connwalk.analyze",
        model_None=lambda w: tl_connwalk.analyze(None, w.tokens, progress=False),
        model_not_a_transformer=lambda w: tl_connwalk.analyze(a_linear(), w.tokens),
        data_None=lambda w: tl_connwalk.analyze(w.model, None, progress=False),
        data_a_number=lambda w: tl_connwalk.analyze(w.model, 5, progress=False),
        data_empty=lambda w: tl_connwalk.analyze(w.model, [], progress=False),
        data_a_list_of_ints=lambda w: tl_connwalk.analyze(w.model, [1, 2, 3], progress=False),
        data_float_tokens=lambda w: tl_connwalk.analyze(w.model, w.tokens.float(), progress=False),
        data_tokens_outside_vocabulary=lambda w: tl_connwalk.analyze(
            w.model, w.tokens + 1000, progress=False
        ),
        data_one_token=lambda w: tl_connwalk.analyze(w.model, w.tokens[:, :1], progress=False),
        batch_size_zero=lambda w: tl_connwalk.analyze(w.model, w.tokens, batch_size=0),
        batch_size_a_float=lambda w: tl_connwalk.analyze(w.model, w.tokens, batch_size=2.0),
        seq_len_one=lambda w: tl_connwalk.analyze(w.model, ["t1 t2"], seq_len=1),
        max_batches_zero=lambda w: tl_connwalk.analyze(w.model, w.tokens, max_batches=0),
        max_batches_a_bool=lambda w: tl_connwalk.analyze(w.model, w.tokens, max_batches=True),
        layers_a_string=lambda w: tl_connwalk.analyze(w.model, w.tokens, layers="0"),
        baseline_draws_one=lambda w: tl_connwalk.analyze(
            w.model, w.tokens, layers=[0], baseline_draws=1, progress=False
        ),
        seed_a_string=lambda w: tl_connwalk.analyze(
            w.model, w.tokens, layers=[0], seed="0", progress=False
        ),
        exclude_sink_a_string=lambda w: tl_connwalk.analyze(
            w.model, w.tokens, layers=[0], exclude_sink="yes", progress=False
        ),
        progress_a_string=lambda w: tl_connwalk.analyze(
            w.model, w.tokens, layers=[0], progress="no"
        ),
        distributed_a_string=lambda w: tl_connwalk.analyze(
            w.model, w.tokens, layers=[0], distributed="no", progress=False
        ),
        attention_mask_wrong_shape=lambda w: tl_connwalk.analyze(
            w.model, w.tokens, attention_mask=ones_mask(w, (2, 2)), progress=False
        ),
        attention_mask_with_texts=lambda w: tl_connwalk.analyze(
            w.model, ["t1 t2 t3"], attention_mask=ones_mask(w), progress=False
        ),
    ),
    *per_layer(
        "tl_connwalk.analyze",
        lambda w, layer: tl_connwalk.analyze(w.model, w.tokens, layers=[layer], progress=False),
    ),
    *rows(
        "tl_connwalk.attribute",
        model_None=lambda w: tl_connwalk.attribute(None, w.tokens),
        input_None=lambda w: tl_connwalk.attribute(w.model, None),
        input_float_tokens=lambda w: tl_connwalk.attribute(w.model, w.tokens.float()),
        input_empty_list=lambda w: tl_connwalk.attribute(w.model, []),
        method_unknown=lambda w: tl_connwalk.attribute(w.model, w.tokens, method="shap"),
        position_too_large=lambda w: tl_connwalk.attribute(w.model, w.tokens, position=N_POS),
        position_a_float=lambda w: tl_connwalk.attribute(w.model, w.tokens, position=1.0),
        position_a_string=lambda w: tl_connwalk.attribute(w.model, w.tokens, position="-1"),
        target_token_outside_vocabulary=lambda w: tl_connwalk.attribute(
            w.model, w.tokens, target=1000
        ),
        target_a_string=lambda w: tl_connwalk.attribute(w.model, w.tokens, target="cat"),
        target_unknown_hook=lambda w: tl_connwalk.attribute(
            w.model, w.tokens, target=("blocks.9.mlp.hook_post", 0)
        ),
        target_direction_wrong_size=lambda w: tl_connwalk.attribute(
            w.model, w.tokens, target=torch.ones(3)
        ),
        attention_mask_wrong_shape=lambda w: tl_connwalk.attribute(
            w.model, w.tokens, attention_mask=ones_mask(w, (2, 2))
        ),
    ),
    *rows(
        "tl_connwalk.attribute",
        input_tokens_outside_vocabulary=lambda w: tl_connwalk.attribute(w.model, w.tokens + 1000),
        input_negative_tokens=lambda w: tl_connwalk.attribute(w.model, -w.tokens - 1),
    ),
    # --- the exported classes --------------------------------------------------------------
    *rows(
        "ConnectionWalk.from_pattern",
        pattern_a_list=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern.tolist(), w.field, w.walk.W_V, w.walk.W_O
        ),
        field_None=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern, None, w.walk.W_V, w.walk.W_O
        ),
        pattern_three_axes=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern[0], w.field, w.walk.W_V, w.walk.W_O
        ),
        W_V_wrong_d_model=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern, w.field, w.walk.W_V[:, :-1], w.walk.W_O
        ),
        b_O_a_number=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern, w.field, w.walk.W_V, w.walk.W_O, b_O=0.0
        ),
        b_V_wrong_shape=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern, w.field, w.walk.W_V, w.walk.W_O, b_V=torch.zeros(3)
        ),
        kv_heads_out_of_range=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern, w.field, w.walk.W_V, w.walk.W_O, kv_heads=[0, 1, 2, 9]
        ),
        kv_heads_a_string=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern, w.field, w.walk.W_V, w.walk.W_O, kv_heads="0011"
        ),
        layer_a_string=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern, w.field, w.walk.W_V, w.walk.W_O, layer="0"
        ),
        processing_a_list=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern, w.field, w.walk.W_V, w.walk.W_O, processing=["fold_ln"]
        ),
        attention_mask_wrong_shape=lambda w: tl_connwalk.ConnectionWalk.from_pattern(
            w.pattern, w.field, w.walk.W_V, w.walk.W_O, attention_mask=ones_mask(w, (2, 2))
        ),
    ),
    *rows(
        "ConnectionWalk.with_padding",
        attention_mask_wrong_shape=lambda w: w.walk.with_padding(ones_mask(w, (1, N_POS))),
        attention_mask_a_list=lambda w: w.walk.with_padding([[1] * N_POS] * 2),
        attention_mask_no_real_token=lambda w: w.walk.with_padding(ones_mask(w) * 0),
    ),
    *rows(
        "ConnectionWalk.with_paddings",
        walks_None=lambda w: tl_connwalk.ConnectionWalk.with_paddings(None),
        walks_holding_a_tensor=lambda w: tl_connwalk.ConnectionWalk.with_paddings([w.tokens]),
        walks_of_other_batches=lambda w: tl_connwalk.ConnectionWalk.with_paddings(
            [w.walk, tl_connwalk.connection_walk(w.cache.apply_slice_to_batch_dim(0), 0)]
        ),
        attention_mask_wrong_shape=lambda w: tl_connwalk.ConnectionWalk.with_paddings(
            [w.walk], ones_mask(w, (2, 2))
        ),
    ),
    *per_heads("ConnectionWalk.of_heads", lambda w, h: w.walk.of_heads(h)),
    *rows("ConnectionWalk.of_heads", heads_an_int_too_large=lambda w: w.walk.of_heads(N_HEADS)),
    *rows(
        "ConnectionWalk.effective_transport",
        query_too_large=lambda w: w.walk.effective_transport(N_POS, 0),
        key_too_negative=lambda w: w.walk.effective_transport(0, -N_POS - 1),
        query_a_float=lambda w: w.walk.effective_transport(1.0, 0),
        key_a_string=lambda w: w.walk.effective_transport(1, "0"),
        query_a_bool=lambda w: w.walk.effective_transport(True, 0),
        key_missing=lambda w: w.walk.effective_transport(1),
        no_edge=lambda w: w.walk.effective_transport(0, 1),
    ),
    *rows(
        "ConnectionWalk.apply",
        field_wrong_d_model=lambda w: w.walk.apply(w.field[..., :-1]),
        field_wrong_positions=lambda w: w.walk.apply(w.field[:, :-1]),
        field_a_list=lambda w: w.walk.apply(w.field.tolist()),
        field_two_axes=lambda w: w.walk.apply(w.field[0]),
    ),
    *rows(
        "ConnectionWalk.laplacian_residual",
        unknown_option=lambda w: w.walk.laplacian_residual(sink=True),
        mu_unknown=lambda w: w.walk.laplacian_residual(mu="stationery"),
        baseline_draws_one=lambda w: w.walk.laplacian_residual(baseline_draws=1),
        baseline_draws_a_string=lambda w: w.walk.laplacian_residual(baseline_draws="8"),
        seed_a_string=lambda w: w.walk.laplacian_residual(seed="0"),
        mass_share_zero=lambda w: w.walk.laplacian_residual(mass_share=0.0),
        max_edges_a_string=lambda w: w.walk.laplacian_residual(exact=True, max_edges="all"),
    ),
    *per_heads(
        "ConnectionWalk.laplacian_residual", lambda w, h: w.walk.laplacian_residual(heads=h)
    ),
    *rows(
        "ConnectionWalk.laplacian_residuals",
        walks_None=lambda w: tl_connwalk.ConnectionWalk.laplacian_residuals(None),
        walks_holding_None=lambda w: tl_connwalk.ConnectionWalk.laplacian_residuals([None]),
        walks_a_walk=lambda w: tl_connwalk.ConnectionWalk.laplacian_residuals(w.walk),
        unknown_option=lambda w: tl_connwalk.ConnectionWalk.laplacian_residuals(
            [w.walk], sink=True
        ),
        baseline_draws_a_string=lambda w: tl_connwalk.ConnectionWalk.laplacian_residuals(
            [w.walk], baseline_draws="8"
        ),
    ),
    *rows(
        "ConnectionWalk.isometry_defects",
        kind_unknown=lambda w: w.walk.isometry_defects("spectral"),
        kind_None=lambda w: w.walk.isometry_defects(None),
        edges_wrong_shape=lambda w: w.walk.isometry_defects(edges=torch.ones(1, 1, 1).bool()),
        edges_a_string=lambda w: w.walk.isometry_defects(edges="causal"),
    ),
    *per_heads("ConnectionWalk.isometry_defects", lambda w, h: w.walk.isometry_defects(heads=h)),
    *rows(
        "ConnectionWalk.show",
        str_tokens_too_few=lambda w: w.walk.show(str_tokens=["a"]),
        str_tokens_a_string=lambda w: w.walk.show(str_tokens="abc"),
        edge_contributions_wrong_shape=lambda w: w.walk.show(edge_contributions=torch.ones(2)),
    ),
    *rows(
        "ConnectionWalk.to_html",
        path_a_folder=lambda w: w.walk.to_html(Path.cwd()),
        str_tokens_too_few=lambda w: w.walk.to_html("walk.html", str_tokens=["a"]),
        head_contributions_wrong_shape=lambda w: w.walk.to_html(
            "walk.html", head_contributions=torch.ones(2, 2)
        ),
    ),
    *rows(
        "ConnectionWalk.to_html",
        path_None=lambda w: w.walk.to_html(None),
        path_a_number=lambda w: w.walk.to_html(5),
        path_in_a_missing_folder=lambda w: w.walk.to_html("/no/such/folder/walk.html"),
        str_tokens_holding_numbers=lambda w: w.walk.to_html(
            "walk.html", str_tokens=list(range(N_POS))
        ),
        edge_contributions_a_list=lambda w: w.walk.to_html("walk.html", edge_contributions=[[0.0]]),
    ),
    *rows(
        "ConnectionGenerator",
        pattern_None=lambda w: tl_connwalk.ConnectionGenerator(None, w.walk.W_V, w.walk.W_O),
        pattern_three_axes=lambda w: tl_connwalk.ConnectionGenerator(
            w.pattern[0], w.walk.W_V, w.walk.W_O
        ),
        W_V_W_O_do_not_compose=lambda w: tl_connwalk.ConnectionGenerator(
            w.pattern, w.walk.W_V[:, :, :-1], w.walk.W_O
        ),
        heads_differ=lambda w: tl_connwalk.ConnectionGenerator(
            w.pattern[:, :-1], w.walk.W_V, w.walk.W_O
        ),
    ),
    *rows(
        "ConnectionGenerator.matvec",
        field_wrong_d_model=lambda w: w.generator.matvec(w.field[..., :-1]),
        field_wrong_positions=lambda w: w.generator.matvec(w.field[:, :-1]),
        field_None=lambda w: w.generator.matvec(None),
        field_a_list=lambda w: w.generator.matvec(w.field.tolist()),
    ),
    *rows(
        "EffectiveTransport",
        gates_None=lambda w: tl_connwalk.EffectiveTransport(None, w.walk.W_V, w.walk.W_O),
        W_V_W_O_do_not_compose=lambda w: tl_connwalk.EffectiveTransport(
            w.walk.gates, w.walk.W_V, w.walk.W_O[:, :-1]
        ),
        edges_wrong_shape=lambda w: tl_connwalk.EffectiveTransport(
            w.walk.gates, w.walk.W_V, w.walk.W_O, edges=torch.ones(2, 2, 2).bool()
        ),
    ),
    *rows(
        "EffectiveTransport.__getitem__",
        one_index=lambda w: w.transports[1],
        query_too_large=lambda w: w.transports[N_POS, 0],
        key_a_float=lambda w: w.transports[1, 0.0],
        key_a_slice=lambda w: w.transports[1, :],
        three_indices=lambda w: w.transports[1, 0, 0],
        no_edge=lambda w: w.transports[0, 1],
    ),
    *rows(
        "Attribution.edges",
        not_a_connection_attribution=lambda w: w.knockout.edges(0),
    ),
    *per_layer("Attribution.edges", lambda w, layer: w.attribution.edges(layer)),
    *rows(
        "Attribution.routes",
        k_negative=lambda w: w.attribution.routes(-1),
        k_a_float=lambda w: w.attribution.routes(2.0),
        batch_too_large=lambda w: w.attribution.routes(batch=2),
        batch_a_string=lambda w: w.attribution.routes(batch="0"),
        max_length_negative=lambda w: w.attribution.routes(max_length=-1),
        max_length_a_float=lambda w: w.attribution.routes(max_length=1.5),
        not_a_connection_attribution=lambda w: w.knockout.routes(),
    ),
    *rows(
        "Attribution.to_dataframe",
        model_without_tokenizer=lambda w: w.attribution.to_dataframe(model=object()),
    ),
    *rows(
        "Attribution.verify",
        not_a_knockout_estimate=lambda w: w.attribution.verify(2),
        k_negative=lambda w: w.estimate.verify(-1),
        k_a_string=lambda w: w.estimate.verify("2"),
    ),
    *rows(
        "Attribution.route_remainder",
        max_length_negative=lambda w: w.attribution.route_remainder(-1),
        max_length_a_string=lambda w: w.attribution.route_remainder("2"),
    ),
    *rows(
        "Attribution.show",
        str_tokens_too_few=lambda w: w.attribution.show(str_tokens=["a"]),
        routes_negative=lambda w: w.attribution.show(routes=-1),
        top_edges_a_string=lambda w: w.attribution.show(top_edges="8"),
        model_a_string=lambda w: w.attribution.show(model="gpt2"),
    ),
    *rows(
        "Attribution.to_html",
        path_a_folder=lambda w: w.attribution.to_html(Path.cwd()),
        str_tokens_too_few=lambda w: w.attribution.to_html("a.html", str_tokens=["a"]),
        routes_a_string=lambda w: w.attribution.to_html("a.html", routes="all"),
        top_edges_negative=lambda w: w.attribution.to_html("a.html", top_edges=-1),
    ),
    *rows(
        "Attribution.to_html",
        path_None=lambda w: w.attribution.to_html(None),
        path_in_a_missing_folder=lambda w: w.attribution.to_html("/no/such/folder/a.html"),
    ),
    *rows(
        "ActivationCache.connection_walk",
        of_a_model_never_attached=unattached_cache_method,
        layer_too_large=lambda w: w.cache.connection_walk(N_LAYERS),
        layer_a_float=lambda w: w.cache.connection_walk(0.0),
    ),
    *rows(
        "ActivationCache.walk_matrix",
        layer_too_large=lambda w: w.cache.walk_matrix(N_LAYERS),
        heads_too_large=lambda w: w.cache.walk_matrix(0, heads=[N_HEADS]),
    ),
    *rows(
        "ActivationCache.laplacian_residual",
        layer_too_negative=lambda w: w.cache.laplacian_residual(-N_LAYERS - 1),
        unknown_option=lambda w: w.cache.laplacian_residual(0, sink=True),
    ),
    *rows(
        "ActivationCache.layer_drift",
        heads_repeated=lambda w: w.cache.layer_drift(heads=[1, 1]),
    ),
    *rows(
        "ActivationCache.geometry_table",
        layer_too_large=lambda w: w.cache.geometry_table([N_LAYERS], progress=False),
        baseline_draws_one=lambda w: w.cache.geometry_table(baseline_draws=1, progress=False),
    ),
    # --- tl_connwalk.ablations -------------------------------------------------------------
    *[
        row
        for name in ("zero_transport", "mean_transport", "isometric_transport", "scalar_transport")
        for row in transport_rows(name)
    ],
    *rows(
        "tl_connwalk.ablations.mean_transport",
        per_sequence_a_string=lambda w: ablations.mean_transport(w.model, 0, per_sequence="yes"),
    ),
    *rows(
        "tl_connwalk.ablations.uniform_gates",
        model_None=lambda w: ablations.uniform_gates(None, 0),
        one_head=lambda w: ablations.uniform_gates(w.model, 0, heads=[1]),
        head_too_large=lambda w: ablations.uniform_gates(w.model, 0, heads=[0, N_HEADS]),
        heads_a_string=lambda w: ablations.uniform_gates(w.model, 0, heads="01"),
    ),
    *per_layer(
        "tl_connwalk.ablations.uniform_gates",
        lambda w, layer: ablations.uniform_gates(w.model, layer),
    ),
    *rows(
        "tl_connwalk.ablations.message_patch",
        model_None=lambda w: ablations.message_patch(None, 0, lambda m: m),
        fn_None=lambda w: ablations.message_patch(w.model, 0, None),
        fn_a_tensor=lambda w: ablations.message_patch(w.model, 0, w.tokens),
        layer_a_float=lambda w: ablations.message_patch(w.model, 0.0, lambda m: m),
        layer_too_large=lambda w: ablations.message_patch(w.model, N_LAYERS, lambda m: m),
        layer_a_bool=lambda w: ablations.message_patch(w.model, True, lambda m: m),
    ),
    *rows(
        "tl_connwalk.ablations.next_token_loss",
        logits_None=lambda w: ablations.next_token_loss(None, w.tokens),
        targets_a_list=lambda w: ablations.next_token_loss(torch.zeros(2, N_POS, 40), [[0]]),
        targets_of_floats=lambda w: ablations.next_token_loss(
            torch.zeros(2, N_POS, 40), w.tokens.float()
        ),
        targets_wrong_shape=lambda w: ablations.next_token_loss(
            torch.zeros(2, N_POS, 40), w.tokens[:, :2]
        ),
        targets_outside_vocabulary=lambda w: ablations.next_token_loss(
            torch.zeros(2, N_POS, 40), w.tokens + 40
        ),
    ),
    *rows(
        "tl_connwalk.ablations.ablation_sweep",
        model_None=lambda w: ablations.ablation_sweep(None, w.tokens, progress=False),
        model_not_a_transformer=lambda w: ablations.ablation_sweep(
            a_linear(), w.tokens, progress=False
        ),
        tokens_None=lambda w: ablations.ablation_sweep(w.model, None, progress=False),
        tokens_of_floats=lambda w: ablations.ablation_sweep(
            w.model, w.tokens.float(), progress=False
        ),
        tokens_three_axes=lambda w: ablations.ablation_sweep(
            w.model, w.tokens[None], progress=False
        ),
        tokens_outside_vocabulary=lambda w: ablations.ablation_sweep(
            w.model, w.tokens + 1000, layers=[0], heads=["all"], progress=False
        ),
        tokens_negative=lambda w: ablations.ablation_sweep(
            w.model, -w.tokens - 1, layers=[0], heads=["all"], progress=False
        ),
        texts_of_different_lengths=lambda w: ablations.ablation_sweep(
            w.model, ["t1 t2 t3", "t4"], layers=[0], heads=["all"], progress=False
        ),
        ablation_unknown=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, ablations=["random"], progress=False
        ),
        ablations_a_string=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, ablations="zero", progress=False
        ),
        ablations_None=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, ablations=None, progress=False
        ),
        layers_a_string=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, layers="0", progress=False
        ),
        heads_a_string=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, heads="all", progress=False
        ),
        head_choice_unknown=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, heads=["none"], progress=False
        ),
        head_too_large=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, heads=[N_HEADS], progress=False
        ),
        progress_a_string=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, layers=[0], heads=["all"], progress="no"
        ),
        metric_not_callable=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, metric="loss", progress=False
        ),
        metric_returning_a_vector=lambda w: ablations.ablation_sweep(
            w.model,
            w.tokens,
            layers=[0],
            heads=["all"],
            metric=lambda x: x[:, 0, 0],
            progress=False,
        ),
        metric_returning_a_string=lambda w: ablations.ablation_sweep(
            w.model,
            w.tokens,
            layers=[0],
            heads=["all"],
            metric=lambda x: "low",
            progress=False,
        ),
        positions_too_large=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, positions=N_POS, progress=False
        ),
        positions_a_float=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, positions=1.0, progress=False
        ),
        positions_a_string=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, positions="-1", progress=False
        ),
        positions_the_last_with_the_loss=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, positions=-1, progress=False
        ),
        positions_none_selected=lambda w: ablations.ablation_sweep(
            w.model, w.tokens, positions=slice(3, 3), progress=False
        ),
    ),
    *per_layer(
        "tl_connwalk.ablations.ablation_sweep",
        lambda w, layer: ablations.ablation_sweep(
            w.model, w.tokens, layers=[layer], progress=False
        ),
    ),
    # --- tl_connwalk.zoo: names and options are checked before anything is downloaded -------
    *rows(
        "tl_connwalk.zoo.load",
        name_None=lambda w: zoo.load(None),
        name_a_number=lambda w: zoo.load(5),
        name_unknown=lambda w: zoo.load("no-such-model", backend="bridge"),
        backend_unknown=lambda w: zoo.load("smollm2-135m", backend="hugging face"),
        dtype_a_string=lambda w: zoo.load("smollm2-135m", dtype="float32"),
        dtype_an_integer_type=lambda w: zoo.load("smollm2-135m", dtype=torch.int64),
        device_unknown=lambda w: zoo.load("smollm2-135m", device="gpu:0"),
        device_a_float=lambda w: zoo.load("smollm2-135m", device=0.5),
        progress_a_string=lambda w: zoo.load("smollm2-135m", progress="no"),
        unknown_processing_option=lambda w: zoo.load("smollm2-135m", fold_layernorm=True),
        processing_option_a_string=lambda w: zoo.load("smollm2-135m", fold_ln="yes"),
    ),
    *rows(
        "tl_connwalk.zoo.hf_dir",
        name_None=lambda w: zoo.hf_dir(None),
        name_a_number=lambda w: zoo.hf_dir(5),
        name_unknown=lambda w: zoo.hf_dir("no-such-model"),
        progress_a_string=lambda w: zoo.hf_dir("smollm2-135m", progress="no"),
    ),
    *rows(
        "tl_connwalk.zoo.cache_info",
        root_a_number=lambda w: zoo.cache_info(5),
        root_a_file=lambda w: zoo.cache_info(Path(__file__)),
    ),
    *rows(
        "tl_connwalk.zoo.clear_cache",
        name_a_number=lambda w: zoo.clear_cache(5, root=Path("/no/such/cache")),
        name_unknown=lambda w: zoo.clear_cache("no-such-model", root=Path("/no/such/cache")),
        root_a_number=lambda w: zoo.clear_cache("smollm2-135m", root=5),
        root_a_file=lambda w: zoo.clear_cache("smollm2-135m", root=Path(__file__)),
    ),
    # --- tl_connwalk.toy -----------------------------------------------------------------
    *rows(
        "tl_connwalk.toy.random_bridge",
        arch_unknown=lambda w: toy.random_bridge("gpt3"),
        arch_None=lambda w: toy.random_bridge(None),
        n_layers_zero=lambda w: toy.random_bridge(n_layers=0),
        n_layers_a_float=lambda w: toy.random_bridge(n_layers=2.0),
        d_model_not_a_multiple_of_n_heads=lambda w: toy.random_bridge(d_model=30, n_heads=4),
        d_model_negative=lambda w: toy.random_bridge(d_model=-32),
        n_heads_a_string=lambda w: toy.random_bridge(n_heads="4"),
        seed_a_string=lambda w: toy.random_bridge(seed="0"),
        scale_negative=lambda w: toy.random_bridge(scale=-1.0),
        scale_a_string=lambda w: toy.random_bridge(scale="0.2"),
        compatibility_mode_a_string=lambda w: toy.random_bridge(compatibility_mode="yes"),
        n_ctx_zero=lambda w: toy.random_bridge(n_ctx=0),
        device_unknown=lambda w: toy.random_bridge(device="gpu:0"),
    ),
]

#: public callables that take no argument (nothing to get wrong)
TAKES_NO_ARGUMENTS = {
    "tl_connwalk.caches",
    "tl_connwalk.clear_caches",
    "tl_connwalk.zoo.available",
    "tl_connwalk.zoo.cache_dir",
    "tl_connwalk.zoo.default_text",
    "ConnectionWalk.edges",
    "ConnectionWalk.bias",
    "ConnectionWalk.edge_contributions",
    "ConnectionWalk.generator",
    "ConnectionGenerator.to_dense",
    "LaplacianResidual.to_dict",
    "Attribution.by_component",
    "Attribution.component_names",
}

#: classes whose constructor is no entry point: records the package builds and returns
RECORDS = {
    "ConnWalkError": "the exception type itself",
    "ConnectionWalk": "built by connection_walk and ConnectionWalk.from_pattern",
    "LaplacianResidual": "built by laplacian_residual",
    "Attribution": "built by attribute",
    "CacheInfo": "built by zoo.cache_info and zoo.clear_cache",
    "ModelSpec": "the zoo's registry entries (zoo.MODELS)",
}


def _class_methods(cls: type) -> list[str]:
    """The public methods ``cls`` defines itself (not inherited, no properties)."""
    names = []
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__getitem__":
            continue
        if isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
            names.append(f"{cls.__name__}.{name}")
    return names


def public_callables() -> set[str]:
    """Every public callable of the package's public modules and exported classes."""
    found = set()
    modules = {"tl_connwalk": tl_connwalk, "tl_connwalk.zoo": zoo}
    for prefix, module in modules.items():
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value):
                if name not in RECORDS:
                    found.add(name)
                found.update(_class_methods(value))
            elif callable(value):
                found.add(f"{prefix}.{name}")
    for module in (ablations, toy):
        for name, value in vars(module).items():
            defined_here = inspect.isfunction(value) and value.__module__ == module.__name__
            if defined_here and not name.startswith("_"):
                found.add(f"{module.__name__}.{name}")
    found.update(f"ActivationCache.{name}" for name in CACHE_METHODS)
    return found


def test_every_public_callable_has_bad_input_rows():
    assert {
        "tl_connwalk.attach",
        "tl_connwalk.ablations.ablation_sweep",
        "tl_connwalk.zoo.load",
        "tl_connwalk.toy.random_bridge",
        "ConnectionWalk.of_heads",
        "EffectiveTransport.__getitem__",
        "ActivationCache.connection_walk",
    } <= public_callables()
    covered = {row.api for row in ROWS} | TAKES_NO_ARGUMENTS
    missing = public_callables() - covered
    assert not missing, f"public callables without a bad-input row: {sorted(missing)}"
    assert not covered - public_callables(), "rows of callables that are not public"


def _params() -> list[Any]:
    return [pytest.param(row, id=row.id) for row in ROWS]


@pytest.mark.parametrize("row", _params())
def test_bad_input_raises_conn_walk_error(
    row: Row, world: World, as_users_run, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # where the rows' html pages would go
    try:
        row.call(world)
    except ConnWalkError as error:
        assert str(error).strip(), "an empty message"
    except Exception as error:  # the point: no other exception type
        pytest.fail(f"{type(error).__name__} instead of ConnWalkError: {error}")
    else:
        pytest.fail("no error")
