"""attach/detach: idempotent, reversible, and changing nothing the user did not ask for."""

import copy
import hashlib
import io
import pickle

import pytest
import torch
from transformer_lens import ActivationCache

import tl_connwalk
from tests.architectures import (
    HAS_HOOKED,
    attention_output,
    bridge_tokens,
    build,
    hooked_encoder,
    hooked_only,
    tokens,
)
from tests.tolerances import assert_close
from tl_connwalk.hooks import hook_name
from tl_connwalk.toy import random_bridge


def state_digest(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    digest.update(repr(sorted(model.hook_dict)).encode())
    digest.update(repr(model.cfg).encode())
    return digest.hexdigest()


@pytest.fixture
def attached(gpt2):
    tl_connwalk.attach(gpt2)
    yield gpt2
    tl_connwalk.detach(gpt2)


def test_import_changes_nothing():
    assert not hasattr(ActivationCache, "connection_walk")


def test_a_cache_method_before_attach_says_to_attach(gpt2):
    """An AttributeError as before (hasattr and getattr with a default work), and a
    ConnWalkError saying what to do; other names fail exactly as without tl_connwalk."""
    _, cache = gpt2.run_with_cache(tokens())
    assert not hasattr(cache, "connection_walk")
    assert getattr(cache, "walk_matrix", None) is None
    with pytest.raises(
        tl_connwalk.ConnWalkError, match=r"call tl_connwalk\.attach\(model\) first"
    ) as caught:
        cache.connection_walk(0)
    assert isinstance(caught.value, AttributeError)
    with pytest.raises(
        AttributeError, match="^'ActivationCache' object has no attribute 'no_such_name'$"
    ) as other:
        _ = cache.no_such_name
    assert not isinstance(other.value, tl_connwalk.ConnWalkError)
    tl_connwalk.attach(gpt2)
    try:
        assert cache.connection_walk(0).layer == 0  # the same cache, once attached
    finally:
        tl_connwalk.detach(gpt2)


def test_cache_method_and_free_function_agree(attached):
    _, cache = attached.run_with_cache(tokens())
    assert_close(cache.connection_walk(1).apply(), tl_connwalk.connection_walk(cache, 1).apply())
    assert_close(
        cache.apply_slice_to_batch_dim(0).connection_walk(1).apply(),
        cache.connection_walk(1).apply()[:1],
    )
    assert "walk.apply() + walk.bias()" in ActivationCache.connection_walk.__doc__


def test_attach_detach_are_idempotent_and_leave_no_trace(gpt2):
    toks = tokens()
    digest, logits = state_digest(gpt2), gpt2(toks)
    assert tl_connwalk.attach(tl_connwalk.attach(gpt2)) is gpt2
    assert tl_connwalk.is_attached(gpt2)
    assert torch.equal(gpt2(toks), logits)
    tl_connwalk.detach(gpt2)
    tl_connwalk.detach(gpt2)
    assert not tl_connwalk.is_attached(gpt2)
    assert not hasattr(ActivationCache, "connection_walk")
    assert state_digest(gpt2) == digest
    assert torch.equal(gpt2(toks), logits)


def test_methods_stay_while_another_model_is_attached(gpt2):
    other = random_bridge("llama")
    tl_connwalk.attach(gpt2)
    tl_connwalk.attach(other)
    tl_connwalk.detach(gpt2)
    _, cache = other.run_with_cache(tokens())
    assert cache.connection_walk(0).layer == 0
    tl_connwalk.detach(other)
    assert not hasattr(ActivationCache, "connection_walk")


def test_refuses_to_overwrite_a_foreign_attribute(gpt2, monkeypatch):
    monkeypatch.setattr(ActivationCache, "connection_walk", lambda self: None, raising=False)
    with pytest.raises(
        tl_connwalk.ConnWalkError, match="ActivationCache.connection_walk already exists"
    ):
        tl_connwalk.attach(gpt2)
    assert not tl_connwalk.is_attached(gpt2)


def test_attach_refuses_unsupported_models():
    with pytest.raises(
        tl_connwalk.ConnWalkError, match="does not support torch.nn.modules.linear.Linear"
    ):
        tl_connwalk.attach(torch.nn.Linear(2, 2))


def test_attach_adds_the_conn_hook_points_and_detach_removes_them(gpt2):
    """On either class of the default model (HookedTransformer on 3.x, the Bridge on 4.x)."""
    tl_connwalk.attach(gpt2)
    try:
        name = "blocks.1.attn.hook_conn_walk"
        assert name in gpt2.hook_dict
        _, cache = gpt2.run_with_cache(
            tokens(), names_filter=[name, *tl_connwalk.required_hooks(gpt2, 1)]
        )
        assert_close(cache[name], cache.connection_walk(1).walk)
    finally:
        tl_connwalk.detach(gpt2)
    assert not any("hook_conn" in name for name in gpt2.hook_dict)


class _UserError(Exception):
    pass


def _raise(tensor, hook):
    raise _UserError(hook.name)


@pytest.mark.parametrize("point", ["hook_conn_walk", "hook_conn_gates", "hook_conn_messages"])
def test_a_raising_user_hook_leaves_no_hook_and_no_stale_state(gpt2, point):
    """A user's hook that raises mid-forward: every hook is removed and the next pass is exact.

    Both ways of adding hooks (``run_with_hooks`` and the ``model.hooks`` context), on
    whichever model class this TransformerLens offers.
    """
    toks = tokens()
    plain = gpt2(toks)
    tl_connwalk.attach(gpt2)
    try:
        name = f"blocks.1.attn.{point}"
        with pytest.raises(_UserError):
            gpt2.run_with_hooks(toks, fwd_hooks=[(name, _raise)])
        with pytest.raises(_UserError), gpt2.hooks(fwd_hooks=[(name, _raise)]):
            gpt2(toks)
        leftover = [n for n, hp in gpt2.hook_dict.items() if hp.fwd_hooks or hp.bwd_hooks]
        assert leftover == []
        assert torch.equal(gpt2(toks), plain)
        _, cache = gpt2.run_with_cache(toks)
        walk = cache.connection_walk(1)
        assert_close(cache["blocks.1.attn.hook_conn_walk"], walk.walk)
        assert_close(walk.apply() + walk.bias(), attention_output(gpt2, cache, 1))
    finally:
        tl_connwalk.detach(gpt2)
    assert torch.equal(gpt2(toks), plain)


# --- every model class: inference mode, copies, the cache budget ---------------------------


#: model builders (name -> (builder, tokens)) for the model classes this TransformerLens has
MODELS = {
    "bridge_llama": (lambda: random_bridge("llama"), lambda: bridge_tokens()),
    "bridge_gpt2_compat": (
        lambda: random_bridge("gpt2", compatibility_mode=True),
        lambda: bridge_tokens(),
    ),
}
if HAS_HOOKED:
    MODELS["hooked_llama"] = (lambda: build("llama_gqa_rotary"), lambda: tokens())
    MODELS["hooked_encoder"] = (hooked_encoder, lambda: tokens())


def _every_point(model) -> list[str]:
    """Every conn point, and the hooks the walks are built from (a filter naming them all)."""
    conn = [name for name in model.hook_dict if "hook_conn" in name]
    return conn + tl_connwalk.required_hooks(model)


def _zero_head_1(tensor, hook):
    return tensor.index_fill(2, torch.tensor([1]), 0.0)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    "cached", [None, "hook_conn_walk", "hook_conn_messages", "every point"], ids=str
)
def test_inference_mode_gives_the_no_grad_results(name, cached):
    """``torch.inference_mode()`` caches and edits exactly what ``torch.no_grad()`` does."""
    build_model, make_tokens = MODELS[name]
    model, toks = tl_connwalk.attach(build_model()), make_tokens()
    if cached is None:
        options = {}
    elif cached == "every point":
        options = {"names_filter": _every_point(model)}
    else:
        options = {"names_filter": lambda hook: hook.endswith(cached)}
    edit = [("blocks.1.attn.hook_conn_messages", _zero_head_1)]
    runs = {}
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            logits, cache = model.run_with_cache(toks, **options)
            edited = model.run_with_hooks(toks, fwd_hooks=edit)
        runs[context.__name__] = logits, cache, edited
    (logits, cache, edited), (i_logits, i_cache, i_edited) = runs.values()
    assert torch.equal(i_logits, logits) and torch.equal(i_edited, edited)
    assert not torch.equal(edited, logits)
    assert sorted(i_cache.keys()) == sorted(cache.keys())
    assert all(torch.equal(i_cache[key], cache[key]) for key in cache.cache_dict)
    if cached is None or cached == "every point":
        walk, i_walk = cache.connection_walk(1), i_cache.connection_walk(1)
        assert torch.equal(i_walk.apply(), walk.apply())
        assert torch.equal(
            i_walk.laplacian_residual().reversibility, walk.laplacian_residual().reversibility
        )
    tl_connwalk.detach(model)


def _cached_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.values())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unfiltered_cache_within_ten_percent_and_points_still_reachable(name):
    """An unfiltered cache grows by the walk alone (at most 10%); gates and messages are cached
    when asked for, and hooks on them still patch the forward pass."""
    build_model, make_tokens = MODELS[name]
    model, toks = build_model(), make_tokens()
    _, plain = model.run_with_cache(toks)
    tl_connwalk.attach(model)
    try:
        order = list(model.hook_dict)
        _, cache = model.run_with_cache(toks)
        assert list(model.hook_dict) == order  # the registry is left as it was
        assert _cached_bytes(cache) <= 1.10 * _cached_bytes(plain)
        conn = sorted(key for key in cache.cache_dict if "hook_conn" in key)
        assert conn == [f"blocks.{layer}.attn.hook_conn_walk" for layer in (0, 1)]
        assert all(torch.equal(cache[key], plain[key]) for key in plain.cache_dict)
        messages = "blocks.1.attn.hook_conn_messages"
        _, named = model.run_with_cache(toks, names_filter=[messages])
        _, every = model.run_with_cache(toks, names_filter=_every_point(model))
        assert torch.equal(named[messages], every[messages])
        assert {"blocks.1.attn.hook_conn_gates", messages} <= set(every.keys())
        with torch.no_grad():
            assert not torch.equal(
                model.run_with_hooks(toks, fwd_hooks=[(messages, _zero_head_1)]), model(toks)
            )
    finally:
        tl_connwalk.detach(model)
    assert "run_with_cache" not in vars(model)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_deep_copy_is_attached_and_outlives_the_original(name):
    build_model, make_tokens = MODELS[name]
    model, toks = tl_connwalk.attach(build_model()), make_tokens()
    twin = copy.deepcopy(model)
    assert tl_connwalk.is_attached(twin)
    tl_connwalk.detach(model)
    assert not tl_connwalk.is_attached(model) and tl_connwalk.is_attached(twin)
    _, cache = twin.run_with_cache(toks, names_filter=_every_point(twin))
    assert cache.model is twin
    assert_close(cache.connection_walk(1).walk, cache["blocks.1.attn.hook_conn_walk"])
    with torch.no_grad():
        assert torch.equal(twin(toks), model(toks))
    tl_connwalk.detach(twin)
    assert not hasattr(ActivationCache, "connection_walk")


@hooked_only
@pytest.mark.parametrize("name", ["hooked_llama", "hooked_encoder"])
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickled_model_loads_attached(name, how):
    """Bridges do not pickle (TransformerLens's own hooks are local functions)."""
    build_model, make_tokens = MODELS[name]
    model, toks = tl_connwalk.attach(build_model()), make_tokens()
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    tl_connwalk.detach(model)
    assert tl_connwalk.is_attached(loaded)
    _, cache = loaded.run_with_cache(toks)
    assert_close(cache.connection_walk(1).walk, cache["blocks.1.attn.hook_conn_walk"])
    with torch.no_grad():
        ours = loaded.run_with_hooks(toks, fwd_hooks=[(hook_name(1, "messages"), _zero_head_1)])
        theirs = loaded.run_with_hooks(toks, fwd_hooks=[("blocks.1.attn.hook_z", _zero_head_1)])
    assert_close(ours, theirs)
    tl_connwalk.detach(loaded)
    assert not hasattr(ActivationCache, "connection_walk")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dtype_and_device_moves_after_attach(name):
    build_model, make_tokens = MODELS[name]
    model, toks = tl_connwalk.attach(build_model()), make_tokens()
    reference = build_model().to(torch.float64)
    model = model.to("cpu").to(torch.float64)
    assert tl_connwalk.is_attached(model)
    with torch.no_grad():
        assert torch.equal(model(toks), reference(toks))
    _, cache = model.run_with_cache(toks, names_filter=_every_point(model))
    conn = [value for key, value in cache.items() if "hook_conn" in key]
    assert conn and all(value.dtype == torch.float64 for value in conn)
    if name.startswith("bridge"):
        model.half()
    else:  # HookedTransformer's half() leaves cfg.dtype, which its own forward then mismatches
        model.to(torch.float16)
    _, cache = model.run_with_cache(toks, names_filter=_every_point(model))
    assert cache["blocks.1.attn.hook_conn_messages"].dtype == torch.float16
    tl_connwalk.detach(model)
