"""The slow tier: the whole public API once on every zoo model, leaving the model untouched.

For each model of `tl_connwalk.zoo.available` (loaded from the converted cache), as a
``HookedTransformer``/``HookedEncoder`` where TransformerLens has them and as a
``TransformerBridge`` on every version: attach,
``run_with_cache`` with ``required_hooks``, the walks of the first and last layer and their
identity against the attention module's own output, effective transports against the cached
patterns, ``laplacian_residual``, ``isometry_defects``, ``layer_drift``, ``geometry_table``,
``analyze`` on two short texts, a transport ablation through the conn hook points, detach; then
parameters, buffers, hook names, config and logits must be bit-identical to before, and no
measurement may have changed the cache.
"""

import hashlib
import math

import pytest
import torch
from einops import einsum

import tl_connwalk
from tests.architectures import HAS_HOOKED
from tests.tolerances import assert_close
from tests.zoo.helpers import state_digest
from tl_connwalk.ablations import zero_transport
from tl_connwalk.adapters.versions import is_bridge
from tl_connwalk.zoo import available, default_text, load

pytestmark = pytest.mark.slow
BACKENDS = ["hooked", "bridge"] if HAS_HOOKED else ["bridge"]
N_TOKENS = 24
SHORT_TEXTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the gate.",
    "In the morning the market opened early, and traders argued about the price of grain.",
]


@pytest.fixture(
    scope="module",
    params=[(name, backend) for name in sorted(available()) for backend in BACKENDS],
    ids="-".join,
)
def model(request: pytest.FixtureRequest):
    name, backend = request.param
    return load(name, backend=backend)


def short_tokens(model) -> torch.Tensor:
    """The first ``N_TOKENS`` tokens of the default text, as the model tokenizes it."""
    tokens = model.to_tokens(default_text()[:2000])
    if isinstance(tokens, tuple):  # HookedEncoder: (tokens, token_type_ids, attention_mask)
        tokens = tokens[0]
    return tokens[:, :N_TOKENS]


def cache_digest(cache) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(cache.cache_dict.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def hook_counts(model) -> dict[str, tuple[int, int]]:
    """How many forward and backward hooks each hook point carries."""
    return {
        name: (len(point._forward_hooks), len(point._backward_hooks))
        for name, point in model.hook_dict.items()
    }


def is_causal(model) -> bool:
    """Decoder or encoder, read off a forward pass (the Bridge's BERT config says "causal")."""
    _, cache = model.run_with_cache(short_tokens(model), names_filter="blocks.0.attn.hook_pattern")
    return bool((cache["blocks.0.attn.hook_pattern"].triu(1) == 0).all())


def finite_numbers(record: object) -> list[float]:
    """Every float in a nested ``to_dict()`` record."""
    if isinstance(record, dict):
        return [x for value in record.values() for x in finite_numbers(value)]
    if isinstance(record, list):
        return [x for value in record for x in finite_numbers(value)]
    return [record] if isinstance(record, float) else []


def test_public_api_leaves_the_model_as_it_was(model):
    tokens = short_tokens(model)
    causal = is_causal(model)
    n_layers, last = model.cfg.n_layers, model.cfg.n_layers - 1
    with torch.no_grad():
        logits_before = model(tokens)
    digest_before = state_digest(model)
    hooks_before = hook_counts(model)

    tl_connwalk.attach(model)
    assert tl_connwalk.is_attached(model)

    # the attention modules' own outputs (before any ln1_post), captured without keeping hooks;
    # on the Bridge that is the output projection attn.o (attn itself includes ln1_post)
    outputs: dict[int, torch.Tensor] = {}
    handles = [
        (
            model.blocks[layer].attn.o if is_bridge(model) else model.blocks[layer].attn
        ).register_forward_hook(lambda mod, args, out, layer=layer: outputs.__setitem__(layer, out))
        for layer in (0, last)
    ]
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=tl_connwalk.required_hooks(model))
    finally:
        for handle in handles:
            handle.remove()
    cache_before = cache_digest(cache)

    for layer in (0, last):
        walk = cache.connection_walk(layer)
        assert walk.layer == layer
        # spec §1.2: apply() + bias() is the attention output
        assert_close(walk.apply() + walk.bias(), outputs[layer])
        # W_ij T_ij = sum_h A^h_ij W_V^h W_O^h on one edge, against the cached pattern
        query, key = tokens.shape[1] - 1, 1
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][:, :, query, key].to(torch.float64)
        heads = einsum(
            walk.W_V.double(),
            walk.W_O.double(),
            "head d_model d_head, head d_head out -> head d_model out",
        )
        expected = einsum(pattern, heads, "batch head, head d_model out -> batch d_model out")
        edge = walk.effective_transport(query, key).AB.double()
        assert_close(walk.walk[:, query, key, None, None].double() * edge, expected, torch.float32)
        assert walk.effective_transport().shape == (1, N_TOKENS, N_TOKENS, *edge.shape[-2:])

        residual = cache.laplacian_residual(layer, baseline_draws=2)
        record = residual.to_dict()
        assert all(math.isfinite(x) for x in finite_numbers(record))
        assert (record["pairing"] is None) == causal
        defects = walk.isometry_defects()
        assert defects.shape == (1, N_TOKENS, N_TOKENS)
        assert torch.isfinite(defects).all() and 0 <= defects.min() <= defects.max() <= 1

    drift = cache.layer_drift()
    assert drift.shape == (1, n_layers - 1)
    assert torch.isfinite(drift).all() and 0 <= drift.min() <= drift.max() <= 1

    table = cache.geometry_table(baseline_draws=2, progress=False)
    assert len(table) == n_layers * (model.cfg.n_heads + 1)
    layer_rows = table[table["head"] == "all"].set_index("layer")
    numbers = layer_rows.select_dtypes("number")
    # NaN only where documented: pairing of causal walks, drift after the last layer
    allowed_nan = {"pairing"} if causal else set()
    assert numbers.drop(columns=[*allowed_nan, "drift_to_next"]).notna().all().all()
    assert numbers["drift_to_next"].drop(index=last).notna().all()
    assert math.isnan(numbers.loc[last, "drift_to_next"])
    assert_close(
        torch.tensor(numbers.loc[last, "transport_defect"]),
        residual.transport_defect.mean(),
    )
    assert cache_digest(cache) == cache_before  # no measurement changed the cache
    del cache

    corpus = tl_connwalk.analyze(
        model, SHORT_TEXTS, seq_len=12, batch_size=2, layers=[0, -1], baseline_draws=2,
        progress=False,
    )  # fmt: skip
    assert set(corpus["layer"]) == {0, last}
    assert (corpus["n_sequences"] >= 2).all()
    corpus_layers = corpus[corpus["head"] == "all"]
    assert corpus_layers[["transport_defect", "field_defect", "head_defect"]].notna().all().all()

    # a transport ablation through the conn hook points equals TransformerLens zero-ablation
    # (not on a BERT Bridge, whose points are read-only)
    if "blocks.0.attn.hook_conn_messages" in model.hook_dict and (causal or not is_bridge(model)):
        with torch.no_grad():
            ablated = model.run_with_hooks(tokens, fwd_hooks=zero_transport(model, last, head=0))

            def zero_head(z, hook):
                z[:, :, 0] = 0.0
                return z

            reference = model.run_with_hooks(
                tokens, fwd_hooks=[(f"blocks.{last}.attn.hook_z", zero_head)]
            )
        assert_close(ablated, reference)
        assert not torch.equal(ablated, logits_before)
    # no hook left on any point (TransformerLens 4's BERT Bridge keeps some of its own)
    assert {name: n for name, n in hook_counts(model).items() if "hook_conn" not in name} == (
        hooks_before
    )
    assert not any(n != (0, 0) for name, n in hook_counts(model).items() if "hook_conn" in name)

    tl_connwalk.detach(model)
    assert not tl_connwalk.is_attached(model)
    assert not any("hook_conn" in name for name in model.hook_dict)
    assert state_digest(model) == digest_before
    with torch.no_grad():
        assert torch.equal(model(tokens), logits_before)
