"""The frozen network ``F`` of an attribution: the model with its nonlinear gains fixed (spec §6).

Freezing happens at the clean run, through TransformerLens hook points, so the same code serves
every model class whose hook names follow TransformerLens (``HookedTransformer``,
``HookedEncoder``, ``TransformerBridge``):

- every attention pattern ``blocks.{l}.attn.hook_pattern`` is replaced by its clean value;
- every normalisation scale ``*.hook_scale`` (the denominator of LayerNorm/RMSNorm) likewise;
  centring, the weight and the bias stay, they are affine;
- an MLP activation ``act(z)`` (``mlp.hook_post``) becomes ``(act(z*)/z*) z`` for the clean
  pre-activation ``z*`` (``mlp.hook_pre``; the gain is 0 where ``z* = 0``); in a gated MLP the
  gate ``mlp.hook_pre`` is pinned to its clean value, so ``act(gate*)`` multiplies the live
  linear branch and ``b_in`` is added after, as the model does.

``F`` is then affine in the input embeddings (``hook_embed``, ``hook_pos_embed``, and in BERT
encoders ``embed.hook_embed``, ``embed.hook_pos_embed``, ``embed.hook_token_type_embed``, or
a Bridge's ``token_type_embed.hook_out``) and,
fed the clean embeddings, reproduces the clean run. A target read inside the network
(``stop_at``, a hook point) stops both the clean run and ``F`` at that hook: later layers
neither run nor freeze.
"""

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tl_connwalk.adapters.hooked_transformer import is_encoder
from tl_connwalk.adapters.versions import is_bridge
from tl_connwalk.errors import ConnWalkError

#: the hook points whose outputs are the input embeddings, wherever a model class has them
EMBEDDING_HOOKS = (
    "hook_embed",
    "hook_pos_embed",
    "embed.hook_embed",
    "embed.hook_pos_embed",
    "embed.hook_token_type_embed",
    "token_type_embed.hook_out",  # a BERT TransformerBridge's token-type embedding
)

#: activation modules outside any hook point (a BERT MLM head's dense -> act -> LayerNorm)
HEAD_ACTIVATIONS = (
    "mlm_head.act_fn",
    # a BERT TransformerBridge runs the Hugging Face head: dense (mlm_head) -> act -> ln_final
    "original_model.cls.predictions.transform.transform_act_fn",
)

HookFn = Callable[..., Tensor | None]


class _Stop(Exception):
    """Raised by the hook a forward pass stops at (the target's hook)."""


def _stop(activation: Tensor, hook: Any) -> None:
    raise _Stop


def run_until(
    model: nn.Module,
    tokens: Tensor,
    hooks: list[tuple[str, HookFn]],
    stop_at: str | None,
    **kwargs: Any,
) -> Tensor | None:
    """``model.run_with_hooks`` (``kwargs``: its padding mask, a key-value cache); stopped
    after the hooks of ``stop_at`` ran (then ``None``). On a ``HookedTransformer`` or
    ``HookedEncoder`` the hooks are added and removed on their own points (`_hooks_on`)."""
    stop = [] if stop_at is None else [(stop_at, _stop)]
    hooked: Any = model
    try:
        if is_bridge(model):
            logits: Tensor = hooked.run_with_hooks(tokens, fwd_hooks=[*hooks, *stop], **kwargs)
        else:
            with _hooks_on(model, [*hooks, *stop], _RUN_LEVEL):
                logits = model(tokens, **kwargs)
    except _Stop:
        return None
    except ValueError as error:  # a Bridge refuses a hook point its config leaves off
        if stop_at is None or stop_at not in str(error):
            raise
        raise ConnWalkError(f"the hook point {stop_at!r} does not fire: {error}") from error
    return logits


def _head_activations(model: nn.Module) -> dict[str, nn.Module]:
    found = {}
    for path in HEAD_ACTIVATIONS:
        module: Any = model
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, nn.Module):
            found[path] = module
    return found


@contextmanager
def _module_hooks(hooks: Mapping[nn.Module, Callable[..., Any]]) -> Iterator[None]:
    handles = [module.register_forward_hook(hook) for module, hook in hooks.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _has_hooks(model: nn.Module) -> bool:
    """Whether any hook point of ``model`` has a forward or backward hook on it now."""
    hook_dict: Mapping[str, Any] = getattr(model, "hook_dict", {})
    return any(
        getattr(point, "fwd_hooks", None) or getattr(point, "bwd_hooks", None)
        for point in hook_dict.values()
    )


def _is_frozen_in_place(name: str) -> bool:
    return name.endswith(("attn.hook_pattern", "hook_scale"))


def _unsupported(names: list[str]) -> None:
    """A ConnWalkError for nonlinearities the frozen network cannot hold as gains."""
    found = [name for name in names if name.endswith("mlp.hook_mid") or "hook_expert" in name]
    if found:
        raise ConnWalkError(
            f"{found[0]}: this model's MLP (SoLU with its inner LayerNorm, or a mixture of "
            "experts) has no per-neuron gain for attribution to freeze (spec §6); choose a "
            "model with plain or gated MLPs."
        )


@dataclasses.dataclass(frozen=True)
class FrozenNetwork:
    """A model with every nonlinear gain fixed at a clean run (spec §6).

    Attributes:
        model: the TransformerLens model.
        tokens: ``[batch, pos]`` the clean run's tokens.
        frozen: hook name -> clean value to put back (patterns, scales, gated MLPs' gates).
        gains: ``mlp.hook_post`` name -> ``(mlp.hook_pre name, act(z*)/z*)``.
        head_gains: activation module path (`HEAD_ACTIVATIONS`) -> ``act(z*)/z*``.
        embeddings: embedding hook name -> clean value ``[batch, pos, d_model]``.
        logits: the clean run's logits ``[batch, pos, d_vocab]`` (``None`` with ``stop_at``).
        final_resid: the clean residual after the last block ``[batch, pos, d_model]``, or
            with ``stop_at`` the clean activation at that hook ``[batch, pos, ...]``.
        stop_at: the hook point where the clean run and ``F`` stop (a target inside the
            network), or ``None``: they run to the logits.
        attention_mask: ``[batch, pos]`` 1 on real tokens, 0 on padding, as the model ran with
            it (``None``: no padding).
        pattern_after_z: the model shows ``hook_pattern`` after computing ``hook_z`` (a BERT
            ``TransformerBridge``): ``F`` then makes ``z^h_i = sum_j A^h_ij v^h_j`` itself from
            the frozen pattern and the live values.
    """

    model: nn.Module
    tokens: Int[Tensor, "batch pos"]
    frozen: Mapping[str, Tensor]
    gains: Mapping[str, tuple[str, Tensor]]
    head_gains: Mapping[str, Tensor]
    embeddings: Mapping[str, Tensor]
    logits: Tensor | None
    final_resid: Tensor
    stop_at: str | None = None
    attention_mask: Tensor | None = None
    pattern_after_z: bool = False

    @classmethod
    def from_clean_run(
        cls,
        model: nn.Module,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        stop_at: str | None = None,
    ) -> "FrozenNetwork":
        """Run ``model`` on ``tokens`` (and its ``attention_mask``) once with a cache and freeze
        it there (up to the hook point ``stop_at``, if given: only what runs before it is
        frozen)."""
        hook_dict: Mapping[str, Any] = model.hook_dict  # type: ignore[assignment]
        names = list(hook_dict)
        _unsupported(names)
        gated = {name.removesuffix("_linear") for name in names if name.endswith("hook_pre_linear")}
        wanted = {
            name
            for name in names
            if _is_frozen_in_place(name)
            or name.endswith(("mlp.hook_pre", "mlp.hook_post"))
            or name in EMBEDDING_HOOKS
        }
        wanted.add("blocks.0.attn.hook_z")  # to tell when the pattern hook fires (below)
        final = stop_at or final_resid_hook(model)
        heads = _head_activations(model)
        seen: dict[str, tuple[Tensor, Tensor]] = {}
        taps = {
            module: lambda module, args, out, path=path: seen.__setitem__(path, (args[0], out))
            for path, module in heads.items()
        }
        cache: dict[str, Tensor] = {}  # in the order the hooks fire
        saves: list[tuple[str, HookFn]] = [
            (name, lambda x, hook, name=name: cache.__setitem__(name, x))
            for name in [*wanted, final]
        ]
        with torch.no_grad(), _module_hooks(taps):
            logits = run_until(model, tokens, saves, stop_at, **mask_kwargs(model, attention_mask))
        if final not in cache:
            raise ConnWalkError(
                f"the hook point {final!r} does not fire in {type(model).__name__}'s forward "
                "pass (some hook points only run when a config option enables them)."
            )
        head_gains = {path: _gain(*seen[path]) for path in seen}
        frozen = {name: cache[name] for name in cache if _is_frozen_in_place(name)}
        frozen |= {name: cache[name] for name in gated if name in cache}
        gains = {}
        for name in cache:
            pre = name.removesuffix("post") + "pre"
            if name.endswith("mlp.hook_post") and pre not in gated and pre in cache:
                z, post = cache[pre], cache[name]
                gains[name] = (pre, _gain(z, post))
        embeddings = {name: cache[name] for name in EMBEDDING_HOOKS if name in cache}
        if not embeddings:
            raise ConnWalkError(
                f"{type(model).__name__} fired none of the embedding hooks {EMBEDDING_HOOKS}; "
                "attribution splits the output over them (spec §6)."
            )
        order = list(cache)
        first_pattern, first_z = "blocks.0.attn.hook_pattern", "blocks.0.attn.hook_z"
        # a BERT TransformerBridge runs Hugging Face's attention and shows the pattern after
        # the fact: an edited pattern changes nothing, so z is recomputed from it instead
        late = (
            first_pattern in order
            and first_z in order
            and order.index(first_pattern) > order.index(first_z)
        )
        return cls(
            model,
            tokens,
            frozen,
            gains,
            head_gains,
            embeddings,
            logits,
            cache[final],
            stop_at=stop_at,
            attention_mask=attention_mask,
            pattern_after_z=late,
        )

    def repeated(self, copies: int) -> "FrozenNetwork":
        """This network with each sequence ``copies`` times over, to run ``F`` on several inputs
        in one pass: copy ``c`` of sequence ``b`` is row ``c * batch + b`` (as `Tensor.repeat`
        tiles); the clean logits are left out (``None``)."""

        def tile(value: Tensor) -> Tensor:
            return value.repeat(copies, *[1] * (value.dim() - 1))

        mask = self.attention_mask
        return dataclasses.replace(
            self,
            tokens=tile(self.tokens),
            frozen={name: tile(value) for name, value in self.frozen.items()},
            gains={name: (pre, tile(value)) for name, (pre, value) in self.gains.items()},
            head_gains={path: tile(value) for path, value in self.head_gains.items()},
            embeddings={name: tile(value) for name, value in self.embeddings.items()},
            logits=None,
            final_resid=tile(self.final_resid),
            attention_mask=None if mask is None else tile(mask),
        )

    def hooks(
        self,
        embeddings: Mapping[str, Tensor],
        taps: Mapping[str, Callable[[Tensor], None]],
        overrides: Mapping[str, Tensor] | None = None,
    ) -> list[tuple[str, HookFn]]:
        """The forward hooks that make ``model`` compute ``F`` of ``embeddings``.

        ``taps``: hook name -> a function that is shown the live activation (to read it).
        ``overrides``: frozen values to use instead (the same values as leaves of a graph).
        """
        hooks: list[tuple[str, HookFn]] = []
        live: dict[str, Tensor] = {}

        def constant(value: Tensor) -> HookFn:
            return lambda activation, hook: value.to(activation.dtype)

        def remember(pre: str) -> HookFn:
            # keyed by the name asked for: a Bridge reports its aliases' canonical names
            return lambda activation, hook: live.__setitem__(pre, activation)

        def gain(pre: str, value: Tensor) -> HookFn:
            return lambda activation, hook: value * live.pop(pre)

        for name, value in {**self.frozen, **(overrides or {}), **embeddings}.items():
            hooks.append((name, constant(value)))
        for name, (pre, value) in self.gains.items():
            hooks += [(pre, remember(pre)), (name, gain(pre, value))]
        if self.pattern_after_z:
            patterns = {**self.frozen, **(overrides or {})}

            def mixed(layer: int) -> HookFn:
                def hook(z: Tensor, hook: Any) -> Tensor:
                    v = live.pop(f"blocks.{layer}.attn.hook_v")
                    pattern = patterns[f"blocks.{layer}.attn.hook_pattern"].to(v)
                    v = v.reshape(*v.shape[:2], pattern.shape[1], -1)
                    return torch.einsum("bhqk,bkhe->bqhe", pattern, v).reshape(z.shape)

                return hook

            for layer in range(int(config(self.model).n_layers)):
                v_name = f"blocks.{layer}.attn.hook_v"
                hooks += [(v_name, remember(v_name)), (f"blocks.{layer}.attn.hook_z", mixed(layer))]
        for name, tap in taps.items():
            hooks.append((name, lambda activation, hook, tap=tap: tap(activation)))
        return hooks

    @contextmanager
    def recomputing_blocks(
        self, embeddings: Mapping[str, Tensor], overrides: Mapping[str, Tensor] | None = None
    ) -> Iterator[None]:
        """Inside, a forward pass of ``F`` (`run` with these ``embeddings`` and ``overrides``)
        through ``model.blocks`` keeps only each block's inputs for a backward pass, which
        recomputes one block at a time with ``F``'s hooks (activation checkpointing,
        `torch.utils.checkpoint`): a graph through ``F`` then holds the activations of one
        block, not of every layer. Each block's ``forward`` is restored on exit, even on error;
        the backward pass may come after. ``HookedTransformer`` and ``HookedEncoder`` only:
        a ``TransformerBridge`` (its blocks wrap Hugging Face's), an ``F`` that stops
        inside the network (``stop_at``) and a model with hooks of its own on any hook point
        (a recomputation would run them again) keep the whole graph."""
        if self.stop_at is not None:
            yield
            return
        with recomputing_blocks(self.model, lambda: self.hooks(embeddings, {}, overrides)):
            yield

    @contextmanager
    def unembedding_input(self) -> Iterator[list[Tensor]]:
        """Collects what the unembedding reads (the normalised final residual) in a list and
        stops the forward pass there: a target reads its logits from that input at its own
        position (`targets.read`), so the logits of every position are never made."""
        seen: list[Tensor] = []

        def stop(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            seen.append(args[0])
            raise _Stop

        unembed: nn.Module = self.model.unembed  # type: ignore[assignment]
        handle = unembed.register_forward_pre_hook(stop)
        try:
            yield seen
        finally:
            handle.remove()

    def run(
        self,
        embeddings: Mapping[str, Tensor],
        taps: Mapping[str, Callable[[Tensor], None]],
        overrides: Mapping[str, Tensor] | None = None,
    ) -> Tensor | None:
        """``F`` at ``embeddings`` (hook name -> ``[batch, pos, d_model]``); the logits, or
        ``None`` where ``F`` stops at ``stop_at``."""
        hooks = self.hooks(embeddings, taps, overrides)
        heads = _head_activations(self.model)
        frozen_heads = {
            heads[path]: lambda module, args, out, gain=gain: gain * args[0]
            for path, gain in self.head_gains.items()
        }
        with warnings.catch_warnings(), _module_hooks(frozen_heads):
            # a Bridge's native-norm path warns that an edited hook_scale changes its rounding
            warnings.filterwarnings("ignore", message=".*edited hook_scale")
            return run_until(
                self.model,
                self.tokens,
                hooks,
                self.stop_at,
                **mask_kwargs(self.model, self.attention_mask),
            )

    def run_model(self, hooks: list[tuple[str, HookFn]], repeat: int = 1) -> Tensor:
        """The model's logits on its tokens (each sequence ``repeat`` times, with the padding
        mask), with ``hooks``."""
        mask = None if self.attention_mask is None else self.attention_mask.repeat(repeat, 1)
        logits: Tensor = self.model.run_with_hooks(  # type: ignore[operator]
            self.tokens.repeat(repeat, 1), fwd_hooks=hooks, **mask_kwargs(self.model, mask)
        )
        return logits


@contextmanager
def recomputing_blocks(
    model: nn.Module, hooks: Callable[[], list[tuple[str, HookFn]]]
) -> Iterator[None]:
    """Inside, a forward pass through ``model.blocks`` keeps only each block's inputs for a
    backward pass, which recomputes one block at a time with ``hooks()`` on the model and its
    weights constant (activation checkpointing, `torch.utils.checkpoint`): a graph through the
    model then holds the activations of one block, not of every layer. Each block's
    ``forward`` is restored on exit, even on error; the backward pass may come after.
    ``HookedTransformer`` and ``HookedEncoder`` only: a ``TransformerBridge`` (its blocks wrap
    Hugging Face's) and a model with hooks of its own on any hook point (a recomputation would
    run them again) keep the whole graph."""
    if is_bridge(model) or _has_hooks(model):
        yield
        return
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]

    def contexts(
        index: int, block: nn.Module
    ) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        return constant_weights(block), _block_hooks(model, index, block, hooks())

    wrapped: list[nn.Module] = []
    try:
        for index, block in enumerate(blocks):
            if "forward" not in vars(block):  # a forward set on the block itself stays
                block.forward = functools.partial(
                    checkpoint,
                    block.forward,
                    use_reentrant=False,
                    context_fn=functools.partial(contexts, index, block),
                )
                wrapped.append(block)
        yield
    finally:
        for block in wrapped:
            del block.forward


#: the context levels of the hooks `_hooks_on` adds, for a pass (`run_until`) and for a
#: block's recomputation: none of TransformerLens's own (0 and up), so that removing them
#: removes no other hook
_RUN_LEVEL, _RECOMPUTE_LEVEL = -1, -2


@contextmanager
def _hooks_on(
    model: nn.Module, hooks: list[tuple[str, HookFn]], level: int, within: str = ""
) -> Iterator[None]:
    """Those of ``hooks`` whose hook point's name starts with ``within`` inside, added on
    their points and removed there alone on exit, even on error (``model.hooks`` and
    ``run_with_hooks`` walk every hook point of the model on exit)."""
    hook_dict: Mapping[str, Any] = model.hook_dict  # type: ignore[assignment]
    points = []
    try:
        for name, hook in hooks:
            if name.startswith(within):
                point = hook_dict[name]
                point.add_hook(hook, dir="fwd", level=level)
                points.append(point)
        yield
    finally:
        for point in points:
            point.remove_hooks("fwd", level=level)


@contextmanager
def _block_hooks(
    model: nn.Module, index: int, block: nn.Module, hooks: list[tuple[str, HookFn]]
) -> Iterator[None]:
    """Those of ``hooks`` on the hook points of ``block`` (``blocks.{index}.``) inside
    (`_hooks_on`), the block's weights constant (`constant_weights`)."""
    with constant_weights(block), _hooks_on(model, hooks, _RECOMPUTE_LEVEL, f"blocks.{index}."):
        yield


@contextmanager
def constant_weights(model: nn.Module) -> Iterator[None]:
    """The model's parameters as constants of autograd inside the block (``requires_grad``
    off, restored after, even on error): a graph built through the model then keeps only
    what gradients with respect to activations need, no activations for weight gradients."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in trained:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in trained:
            parameter.requires_grad_(True)


def mask_kwargs(model: nn.Module, attention_mask: Tensor | None) -> dict[str, Tensor]:
    """The keyword that hands a padding mask to ``model``'s forward (none without a mask)."""
    if attention_mask is None:
        return {}
    if is_encoder(model):
        return {"one_zero_attention_mask": attention_mask}
    return {"attention_mask": attention_mask}


def _gain(z: Tensor, activation: Tensor) -> Tensor:
    """``act(z)/z``, 0 where ``z = 0`` (any gain reproduces ``act(0) = 0`` there)."""
    return torch.where(z == 0, torch.zeros_like(z), activation / z)


def config(model: nn.Module) -> Any:
    """The model's TransformerLens config (``cfg``)."""
    return model.cfg


def pattern_hooks(model: nn.Module) -> list[str]:
    """The pattern hooks of every layer, first to last."""
    return [f"blocks.{layer}.attn.hook_pattern" for layer in range(int(config(model).n_layers))]


def final_resid_hook(model: nn.Module) -> str:
    """The hook holding the residual stream after the last block, before the final norm."""
    return f"blocks.{int(config(model).n_layers) - 1}.hook_resid_post"
