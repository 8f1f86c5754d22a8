# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 1. Quick start: attention is a connection walk
#
# Every attention layer moves messages along a walk matrix `W` (the heads' patterns averaged)
# and carries each message across its edge `j -> i` with a linear map `T_ij` (the heads' OV
# maps mixed by the gates `g^h_ij`). This notebook attaches `tl_connwalk` to a real model,
# checks that `P X + c` reproduces the attention output on every layer (spec §1, claim 1 of
# spec §5), and looks at one layer's walk, its gates and one edge's transport.
#
# Runs on 2 CPU cores in about a minute with the defaults; set `MODEL` to any zoo name or any
# name `HookedTransformer.from_pretrained` accepts (on a GPU: `DEVICE = "cuda"`).

# %% tags=["parameters"]
MODEL = "smollm2-135m"
DEVICE = "cpu"
BACKEND = "hooked"  # "bridge": TransformerBridge, the only backend on TransformerLens 4.x
N_TOKENS = 128
LAYER = 10

# %%
import matplotlib.pyplot as plt
import torch

import tl_connwalk
from tl_connwalk import zoo

torch.set_grad_enabled(False)
model = zoo.load(MODEL, backend=BACKEND, device=DEVICE)
tl_connwalk.attach(model)
tokens = model.to_tokens(zoo.default_text())[:, :N_TOKENS]
logits, cache = model.run_with_cache(tokens)
n_layers = model.cfg.n_layers
LAYER = LAYER % n_layers
print(
    model.cfg.model_name,
    f"{n_layers} layers, {model.cfg.n_heads} heads, d_model={model.cfg.d_model}",
)

# %% [markdown]
# ## The identity, on every layer
#
# `walk.apply()` is `(P X)_i = sum_j W_ij x_j T_ij` on the field the layer read and
# `walk.bias()` the constant `c_i`; their sum must be the attention output up to float32
# round-off. We print the largest error relative to the output's scale.

# %%
errors = []
for layer in range(n_layers):
    walk = cache.connection_walk(layer)
    # the attention module's own output: hook_attn_out, or the Bridge's output projection
    name = "attn.o.hook_out" if BACKEND == "bridge" else "hook_attn_out"
    out = cache[f"blocks.{layer}.{name}"]
    errors.append(((walk.apply() + walk.bias() - out).abs().max() / out.abs().max()).item())
print(f"max relative error over {n_layers} layers: {max(errors):.2e}")
print("identity holds (< 1e-5):", max(errors) < 1e-5)

# %% [markdown]
# ## One layer's walk
#
# A decoder's walk is lower-triangular (causal): row `i` is where query `i` collects
# messages from. Decoders often send much of a row's mass to key 0, the *attention sink*;
# the printed mean says how much this layer does. The colour scale is logarithmic.

# %%
walk = cache.connection_walk(LAYER)
print(walk)
W = walk.walk[0]
fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
im = axes[0].imshow(W.clamp_min(1e-4).log10(), cmap="viridis", vmin=-4, vmax=0)
axes[0].set(title=f"walk W, layer {LAYER}", xlabel="key position j", ylabel="query position i")
fig.colorbar(im, ax=axes[0], label="log10 W_ij")
sink = W[1:, 0]
print(
    f"mean mass on key 0 over queries i >= 1: {sink.mean():.3f} "
    f"(uniform causal attention: {(1 / torch.arange(2, W.shape[0] + 1).float()).mean():.3f})"
)
axes[1].hist(sink, bins=30, color="C0")
axes[1].axvline(
    (1 / torch.arange(2, W.shape[0] + 1).float()).mean(),
    color="k",
    ls="--",
    label="uniform causal attention (mean of 1/(i+1))",
)
axes[1].set(
    title="mass on the sink, key 0",
    xlabel="W_i0 (fraction of row i)",
    ylabel="number of queries i ≥ 1",
)
axes[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The gates: which head carries which edge
#
# `g^h_ij = A^h_ij / sum_h' A^h'_ij` splits every edge among the heads (they sum to 1). The
# figure shows, for the last query, the gates of its keys; the printed lines compare the gates
# of its three heaviest edges with uniform gates (`1/H`, the single-head reduction).

# %%
g = walk.gates[0, :, -1, :]  # [head, key]
fig, ax = plt.subplots(figsize=(11, 3.5))
im = ax.imshow(g, aspect="auto", cmap="magma", vmin=0, vmax=1)
ax.set(
    title=f"gates g^h_ij of the last query (i = {W.shape[0] - 1}), layer {LAYER}",
    xlabel="key position j",
    ylabel="head h",
)
fig.colorbar(im, ax=ax, label="gate (fraction of the edge)")
fig.tight_layout()
plt.show()
top_keys = W[-1].topk(3).indices.tolist()
for j in top_keys:
    print(
        f"edge {j} -> {W.shape[0] - 1}: W = {W[-1, j]:.3f}, gates = "
        + " ".join(f"{v:.2f}" for v in walk.gates[0, :, -1, j].tolist())
        + f"  (uniform {1 / walk.n_heads:.2f})"
    )

# %% [markdown]
# ## One edge's effective transport
#
# `walk.effective_transport(i, j)` is a `FactoredMatrix` `T_ij = H sum_h g^h_ij T^h` of inner
# width `H d_head`; it is never materialised for all edges. Its singular values tell how it
# turns and scales a message: a *scaled isometry* would have all of its top `r` singular
# values equal. We draw them next to those of each head's OV map `T^h` (rank `d_head`). The
# edge map has rank at most `H d_head`, and fewer in grouped-query models, where heads share
# value projections (`n_key_value_heads d_head`): past that rank the values are round-off.

# %%
i, j = W.shape[0] - 1, top_keys[0]
T_ij = walk.effective_transport(i, j)
sigma_edge = T_ij.S[0]
sigma_heads = walk.head_transports.S  # [head, d_model] (zeros past d_head)
fig, ax = plt.subplots(figsize=(7, 4))
for h in range(sigma_heads.shape[0]):
    ax.plot(
        sigma_heads[h, : model.cfg.d_head], color="0.7", lw=1, label="heads T^h" if h == 0 else None
    )
ax.plot(sigma_edge, color="C3", lw=2, label=f"edge T_ij, {j} -> {i}")
ax.set(
    yscale="log",
    xlabel="singular value index k",
    ylabel="singular value sigma_k (log scale)",
    title=f"singular values, layer {LAYER}",
)
ax.legend()
fig.tight_layout()
plt.show()
print("T_ij:", T_ij)
rank = int((sigma_edge > sigma_edge[0] * 1e-5).sum())
print(
    f"numerical rank of T_ij: {rank}; top-{rank} sigma max/min = {sigma_edge[0] / sigma_edge[rank - 1]:.1f}"
)

# %% [markdown]
# ## Hook points
#
# After `attach`, `blocks.{l}.attn.hook_conn_messages` holds every head's message
# `m^h_j = (x_j W_V^h + b_V^h) W_O^h`. Zeroing head 0's messages is the same as zeroing that
# head's `hook_z` (the usual TransformerLens head ablation) whenever `b_V` is zero, which
# `fold_value_biases` arranges.


# %%
def zero_messages(m, hook):
    m[:, :, 0] = 0.0
    return m


def zero_z(z, hook):
    z[:, :, 0] = 0.0
    return z


loss_clean = model(tokens, return_type="loss").item()
loss_msg = model.run_with_hooks(
    tokens,
    return_type="loss",
    fwd_hooks=[(f"blocks.{LAYER}.attn.hook_conn_messages", zero_messages)],
).item()
loss_z = model.run_with_hooks(
    tokens, return_type="loss", fwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", zero_z)]
).item()
print(
    f"loss clean {loss_clean:.4f}, head 0 off via messages {loss_msg:.4f}, via hook_z {loss_z:.4f}"
)
