"""Routes: source -> component -> ... -> target paths and their exact shares (spec §6)."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor, nn
from tqdm.auto import tqdm

from tl_connwalk.attribution import targets
from tl_connwalk.attribution.connection import evaluate
from tl_connwalk.attribution.frozen import FrozenNetwork, config
from tl_connwalk.errors import ConnWalkError


@dataclasses.dataclass(frozen=True)
class Route:
    """One route from a source token to the target through the frozen network ``F``.

    ``F`` is linear in the embeddings once its gains are frozen, so the contribution of a
    source ``c_s`` expands exactly into a sum over routes: the embedding ``e_s`` read by a
    first component, whose output is read by a later component, and so on, the last output
    read by the target along the frozen gradient. Summed over every route of ``s`` (the
    empty one included: the embedding read directly by the target), the contributions are
    ``c_s``.

    Attributes:
        batch: the sequence.
        source: the source position ``s``.
        components: the components passed, in the order of the forward pass, named as
            `Attribution.component_names` names them (``"L3H2"``, ``"L5MLP"``); ``()`` is the
            direct path of the embedding.
        contribution: the route's exact share of the target.
    """

    batch: int
    source: int
    components: tuple[str, ...]
    contribution: float

    def __str__(self) -> str:
        path = " -> ".join((f"pos {self.source}", *self.components, "target"))
        return f"{path}: {self.contribution:+.4g}"


@dataclasses.dataclass(frozen=True)
class RouteTable:
    """Every route up to a length, with its contribution per source (spec §6).

    Attributes:
        routes: the components of each route, in forward order (``()``: the direct path).
        values: ``[batch, route, source]`` each route's contribution from each source.
        remainder: ``[batch, source]`` what the longer routes carry: ``values.sum(1) +
            remainder`` is the attribution's ``scores``.
    """

    routes: list[tuple[str, ...]]
    values: Float[Tensor, "batch route source"]
    remainder: Float[Tensor, "batch source"]


@dataclasses.dataclass(frozen=True)
class _Group:
    """The heads of one layer, or its MLP: components that read one residual tensor."""

    layer: int
    kind: Literal["heads", "mlp"]
    order: int  # forward order: heads of layer l at 2l, its MLP at 2l + 1

    def precedes(self, later: int, parallel: bool) -> bool:
        """Whether this group's output is read by a group of forward order ``later``."""
        return self.order < later and not (parallel and later // 2 == self.layer)


#: order of the target: every group precedes it
_TARGET = 1 << 62


def _refuse_post_norm(model: nn.Module) -> None:
    encoder = getattr(config(model), "attention_dir", "causal") == "bidirectional"
    if hasattr(model, "mlm_head") or encoder:
        raise ConnWalkError(
            "routes need a residual stream the components add into; in a post-norm encoder "
            "(BERT) every layer's norm rescales the whole stream, so a route has no share of "
            "its own. Use scores and edges(layer)."
        )


def route_table(
    frozen: FrozenNetwork, target: targets.Target, max_length: int, progress: bool = True
) -> RouteTable:
    """Every route of at most ``max_length`` components and its exact contribution.

    ``F`` frozen is affine: its residual stream after the last block is ``prod_c (I + M_c)``
    applied to the embeddings plus constants, ``M_c`` the linear part of component ``c``
    (a head, or an MLP; biases are constants). Expanding the product, ``c_s`` is the sum over
    routes ``c_1 < ... < c_k`` of ``u . M_{c_k} ... M_{c_1} x_s`` with ``u`` the target's
    gradient at the final residual and ``x_s`` position ``s``'s part of the first residual.
    The routes are enumerated backward from ``u`` (covectors pulled back through each
    component by autograd, the heads separated by their frozen patterns); the remainder is
    ``sum_{|r| = max_length}`` of the full pull-back of route ``r``'s covector through the
    network below its first component, minus its direct part.
    """
    model = frozen.model
    _refuse_post_norm(model)
    cfg = config(model)
    n_layers = int(cfg.n_layers)
    parallel = bool(getattr(cfg, "parallel_attn_mlp", False))
    has_mlp = not getattr(cfg, "attn_only", False)
    batch, n_pos = frozen.tokens.shape
    leaves = {
        name: value.detach().clone().requires_grad_(True)
        for name, value in frozen.embeddings.items()
    }
    seen: dict[str, Tensor] = {}
    taps: dict[str, Callable[[Tensor], None]] = {}
    for layer in range(n_layers):
        hooks = [f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_v"]
        hooks += [f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.hook_attn_out"]
        if has_mlp:
            hooks += [_mlp_input(layer, parallel), f"blocks.{layer}.hook_mlp_out"]
        projected = f"blocks.{layer}.attn.o.hook_out"  # a Bridge's output projection
        hooks += [projected] if projected in model.hook_dict else []  # type: ignore[operator]
        taps |= {name: functools.partial(seen.__setitem__, name) for name in hooks}
    first = "blocks.0.hook_resid_pre"
    zero_run: dict[str, Tensor] = {}
    with torch.no_grad():
        zero = {name: torch.zeros_like(value) for name, value in frozen.embeddings.items()}
        evaluate(frozen, target, zero, {first: functools.partial(zero_run.__setitem__, first)})
    with torch.enable_grad():
        y, _, final = evaluate(frozen, target, leaves, taps)
        (u,) = torch.autograd.grad(y.sum(), final, retain_graph=True)
        seen["final"] = final
        x0 = (seen[first] - zero_run[first]).detach()  # the embeddings' part of the residual

        def direct(covectors: Tensor) -> Tensor:
            """``E(w)[s] = w_s . x0_s``: a covector on the first residual, per source."""
            return torch.einsum("...bnd,bnd->...bn", covectors, x0)

        groups = [
            _Group(layer, kind, 2 * layer + (kind == "mlp"))
            for layer in range(n_layers)
            for kind in (("heads", "mlp") if has_mlp else ("heads",))
        ]
        back = _Pullbacks(frozen, seen, parallel, x0)
        names: list[tuple[str, ...]] = [()]
        values = [direct(u.detach())[None]]  # [route, batch, source]
        level_routes: list[tuple[str, ...]] = [()]
        level_orders, level_w = [_TARGET], u.detach()[None]
        accumulated: dict[str, Tensor] = {"final": u.detach()} if max_length == 0 else {}
        for length in range(1, max_length + 1):
            last = length == max_length
            next_routes: list[tuple[str, ...]] = []
            next_orders: list[int] = []
            next_w: list[Tensor] = []
            steps = [
                (group, [i for i, o in enumerate(level_orders) if group.precedes(o, parallel)])
                for group in groups
            ]
            total = sum(len(chosen) for _, chosen in steps)
            for group, chosen in tqdm(
                steps,
                desc=f"routes of length {length}",
                disable=not progress or total * n_pos < LONG,
                leave=False,
            ):
                if not chosen:
                    continue
                width = back.n_heads if group.kind == "heads" else 1
                chunk = max(1, n_pos // (batch * (1 if last else width)))
                for start in range(0, len(chosen), chunk):
                    picked = chosen[start : start + chunk]
                    w = level_w[picked]
                    suffixes = [level_routes[i] for i in picked]
                    labels = back.labels(group)
                    if last:
                        part = back.direct_share(group, w)  # [m, component, batch, source]
                    else:
                        pulled = back.full(group, w)  # [m, component, batch, pos, d_model]
                        part = direct(pulled)
                        next_w.append(pulled.flatten(0, 1))
                        next_routes += [(c, *r) for r in suffixes for c in labels]
                        next_orders += [group.order] * (len(picked) * len(labels))
                    names += [(c, *r) for r in suffixes for c in labels]
                    values.append(part.flatten(0, 1))
                if last:
                    key = back.input_name(group)
                    summed = back.summed(group, level_w[chosen].sum(0))
                    accumulated[key] = accumulated.get(key, 0) + summed
            if not last:
                level_routes, level_orders = next_routes, next_orders
                level_w = torch.cat(next_w) if next_w else level_w[:0]
        table = torch.cat(values).transpose(0, 1).detach()  # [batch, route, source]
        keys = list(accumulated)
        grads = (
            torch.autograd.grad(
                [seen[key] for key in keys],
                list(leaves.values()),
                grad_outputs=[accumulated[key] for key in keys],
                allow_unused=True,
            )
            if keys
            else (None,) * len(leaves)
        )
    full = sum(
        ((grad * leaf).sum(-1) for grad, leaf in zip(grads, leaves.values(), strict=True)
         if grad is not None),
        torch.zeros(batch, n_pos, dtype=table.dtype, device=table.device),
    )  # fmt: skip
    lengths = torch.tensor([len(r) for r in names], device=table.device)
    remainder = full.detach() - table[:, lengths == max_length].sum(1)
    return RouteTable(names, table, remainder)


#: route extensions times positions above which a progress bar is shown
LONG = 1 << 16


def _mlp_input(layer: int, parallel: bool) -> str:
    return f"blocks.{layer}.hook_resid_pre" if parallel else f"blocks.{layer}.hook_resid_mid"


class _Pullbacks:
    """Covectors on a component's output pulled back to its input residual (``M_c^T w``).

    Heads: autograd from ``hook_attn_out`` to ``attn.hook_z`` (``W_O`` and any norm after the
    attention), the frozen pattern transposed per head, then autograd from ``attn.hook_v`` to
    the residual (the value map and ``ln1``). MLPs: autograd from ``hook_mlp_out`` to the
    residual it reads.
    """

    def __init__(
        self,
        frozen: FrozenNetwork,
        seen: dict[str, Tensor],
        parallel: bool,
        x0: Float[Tensor, "batch pos d_model"],
    ) -> None:
        self.frozen, self.seen, self.parallel, self.x0 = frozen, seen, parallel, x0
        self.batch, self.n_pos = frozen.tokens.shape
        self.n_heads = int(frozen.frozen["blocks.0.attn.hook_pattern"].shape[1])
        self._parts: dict[tuple[int, str], Tensor] = {}
        self._linked: dict[tuple[str, str], bool] = {}

    def labels(self, group: _Group) -> list[str]:
        if group.kind == "mlp":
            return [f"L{group.layer}MLP"]
        return [f"L{group.layer}H{h}" for h in range(self.n_heads)]

    def input_name(self, group: _Group) -> str:
        if group.kind == "mlp":
            return _mlp_input(group.layer, self.parallel)
        return f"blocks.{group.layer}.hook_resid_pre"

    def _grad(self, output: str, input: str, covectors: Tensor, batched: bool) -> Tensor:
        (grad,) = torch.autograd.grad(
            self.seen[output],
            self.seen[input],
            grad_outputs=covectors,
            retain_graph=True,
            is_grads_batched=batched,
        )
        return grad

    def _value_grads(self, layer: int, w: Float[Tensor, "m batch pos d_model"]) -> Tensor:
        """``[m, batch, key, head, d_head]``: ``A^h^T`` of the covector on head ``h``'s ``z``."""
        out = f"blocks.{layer}.hook_attn_out"
        if self._in_graph(out, f"blocks.{layer}.attn.hook_z"):
            gz = self._grad(out, f"blocks.{layer}.attn.hook_z", w, True)
        else:  # a Bridge whose hook_z is a reshaped copy: W_O^T by hand after any norm
            projected = f"blocks.{layer}.attn.o.hook_out"
            if self._in_graph(out, projected):
                w = self._grad(out, projected, w, True)
            block: Any = self.frozen.model.blocks[layer]  # type: ignore[index]
            W_O = block.attn.W_O.detach()
            gz = torch.einsum("mbqd,hed->mbqhe", w, W_O.to(w))
        gz = gz.reshape(len(w), self.batch, self.n_pos, self.n_heads, -1)
        pattern = self.frozen.frozen[f"blocks.{layer}.attn.hook_pattern"].to(gz)
        return torch.einsum("bhqk,mbqhe->mbkhe", pattern, gz)

    def _in_graph(self, output: str, input: str) -> bool:
        """Whether ``output`` is computed from the tensor tapped at ``input`` itself."""
        key = (output, input)
        if key not in self._linked:
            linked = False
            if input in self.seen:
                (grad,) = torch.autograd.grad(
                    self.seen[output].sum(), self.seen[input], retain_graph=True, allow_unused=True
                )
                linked = grad is not None
            self._linked[key] = linked
        return self._linked[key]

    def _repeat(self, layer: int) -> int:
        """Query heads per key-value head (grouped-query attention)."""
        v = self.seen[f"blocks.{layer}.attn.hook_v"]
        d_head = self.seen[f"blocks.{layer}.attn.hook_z"][0, 0].numel() // self.n_heads
        return self.n_heads // (v[0, 0].numel() // d_head)

    def _to_values(self, layer: int, gv: Tensor) -> Tensor:
        """Per-query-head value covectors ``[..., batch, key, head, d_head]`` summed into the
        key-value heads and shaped as ``attn.hook_v``."""
        repeat = self._repeat(layer)
        shape = gv.shape
        gv = gv.reshape(*shape[:-2], shape[-2] // repeat, repeat, shape[-1]).sum(-2)
        v = self.seen[f"blocks.{layer}.attn.hook_v"]
        return gv.reshape(*shape[:-4], *v.shape)

    def _linear_part(self, group: _Group) -> Tensor:
        """``J x0``: what the component's input map makes of the embeddings alone, bias-free
        (the value vectors per query head, or the MLP's output), by a double backward."""
        key = (group.layer, group.kind)
        if key not in self._parts:
            layer = group.layer
            if group.kind == "mlp":
                output = self.seen[f"blocks.{layer}.hook_mlp_out"]
            else:
                output = self.seen[f"blocks.{layer}.attn.hook_v"]
            probe = torch.zeros_like(output, requires_grad=True)
            (pulled,) = torch.autograd.grad(
                output, self.seen[self.input_name(group)], probe, create_graph=True
            )
            (part,) = torch.autograd.grad(pulled, probe, self.x0)
            if group.kind == "heads":
                repeat = self._repeat(layer)
                part = part.reshape(self.batch, self.n_pos, self.n_heads // repeat, -1)
                part = part.repeat_interleave(repeat, 2)
            self._parts[key] = part.detach()
        return self._parts[key]

    def direct_share(
        self, group: _Group, w: Float[Tensor, "m batch pos d_model"]
    ) -> Float[Tensor, "m component batch source"]:
        """``E(M_c^T w)[s] = (M_c^T w)_s . x0_s`` for each component of ``group``."""
        if group.kind == "mlp":
            return torch.einsum("mbnd,bnd->mbn", w, self._linear_part(group))[:, None]
        gv = self._value_grads(group.layer, w)
        return torch.einsum("mbkhe,bkhe->mhbk", gv, self._linear_part(group))

    def full(
        self, group: _Group, w: Float[Tensor, "m batch pos d_model"]
    ) -> Float[Tensor, "m component batch pos d_model"]:
        """``M_c^T w`` for each component of ``group``, on the residual it reads."""
        if group.kind == "mlp":
            out = f"blocks.{group.layer}.hook_mlp_out"
            return self._grad(out, self.input_name(group), w, True)[:, None]
        gv = self._value_grads(group.layer, w)  # [m, b, k, h, e]
        eye = torch.eye(self.n_heads, dtype=gv.dtype, device=gv.device)
        per_head = torch.einsum("mbkhe,hg->mgbkhe", gv, eye)  # head g's part alone
        covectors = self._to_values(group.layer, per_head).flatten(0, 1)
        v = f"blocks.{group.layer}.attn.hook_v"
        pulled = self._grad(v, self.input_name(group), covectors, True)
        return pulled.reshape(len(w), self.n_heads, *pulled.shape[1:])

    def summed(
        self, group: _Group, w: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos d_model"]:
        """``sum_c M_c^T w`` over the components of ``group`` (one unbatched pull-back)."""
        if group.kind == "mlp":
            out = f"blocks.{group.layer}.hook_mlp_out"
            return self._grad(out, self.input_name(group), w, False)
        gv = self._value_grads(group.layer, w[None])[0]
        v = f"blocks.{group.layer}.attn.hook_v"
        return self._grad(v, self.input_name(group), self._to_values(group.layer, gv), False)
