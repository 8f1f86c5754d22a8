"""attach/detach: idempotent, reversible, and changing nothing the user did not ask for."""

import hashlib

import pytest
import torch
from transformer_lens import ActivationCache

import tl_connwalk
from tests.architectures import attention_output, tokens
from tests.tolerances import assert_close
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
