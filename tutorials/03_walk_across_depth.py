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
# # 3. The walk across depth
#
# Claim 2 of the paper (spec §5): effective attention graphs converge to *stable geometric
# operators* in deeper layers, i.e. the walk `W^l` changes less and less from one layer to the
# next. We measure
#
# - the **layer drift** `(1/n) sum_i TV(W^l_i., W^{l+1}_i.)` (mean total-variation distance of
#   the rows of consecutive walks; 0 = the walk did not change, 1 = disjoint support), with and
#   without the attention sink;
# - its **baseline**: the same distance between every pair of layers, not only neighbours; if
#   neighbouring walks are no closer than arbitrary pairs, there is no settling to speak of;
# - the **sink mass**, the fraction of each row sent to key 0;
# - the **singular values of the walk**, layer by layer.
#
# Defaults run on 2 CPU cores in about a minute.

# %% tags=["parameters"]
MODEL = "smollm2-135m"
DEVICE = "cpu"
BACKEND = "hooked"  # "bridge": TransformerBridge, the only backend on TransformerLens 4.x
N_TOKENS = 256

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

import tl_connwalk
from tl_connwalk import zoo
from tl_connwalk.core import markov

torch.set_grad_enabled(False)
model = zoo.load(MODEL, backend=BACKEND, device=DEVICE)
tl_connwalk.attach(model)
tokens = model.to_tokens(zoo.default_text())[:, :N_TOKENS]
_, cache = model.run_with_cache(tokens)
n_layers = model.cfg.n_layers
walks = [cache.connection_walk(layer).walk for layer in range(n_layers)]
print(MODEL, BACKEND, f"{n_layers} layers, {tokens.shape[-1]} tokens")

# %% [markdown]
# ## Distance between the walks of every pair of layers
#
# The matrix below holds the mean row TV distance between the walks of layers `a` and `b`. The
# layer drift is its first off-diagonal. Blocks of small distance are groups of layers that
# run (nearly) the same walk.


# %%
def distances(exclude_sink):
    D = np.zeros((n_layers, n_layers))
    for a in range(n_layers):
        for b in range(a + 1, n_layers):
            D[a, b] = D[b, a] = (
                markov.layer_drift(walks[a], walks[b], exclude_sink=exclude_sink).mean().item()
            )
    return D


D = {sink: distances(sink) for sink in (False, True)}
fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
for ax, sink in zip(axes, (False, True), strict=True):
    im = ax.imshow(D[sink], cmap="viridis", vmin=0, vmax=1)
    ax.set(
        title="mean row TV distance" + (", sink excluded" if sink else ""),
        xlabel="layer b",
        ylabel="layer a",
    )
    fig.colorbar(im, ax=ax, label="TV (0 = same walk, 1 = disjoint)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Layer drift against depth
#
# Drift between neighbours (solid) against the baseline: the mean ± std of the distance from
# layer `l` to every layer at least 2 away (band). The library's `tl_connwalk.layer_drift`
# computes the solid curves directly.

# %%
drift = {
    sink: tl_connwalk.layer_drift(cache, exclude_sink=sink).mean(0).cpu().numpy()
    for sink in (False, True)
}
fig, ax = plt.subplots(figsize=(8, 4.2))
x = np.arange(n_layers - 1)
for k, sink in enumerate((False, True)):
    far = [D[sink][a][np.abs(np.arange(n_layers) - a) >= 2] for a in range(n_layers - 1)]
    mean, std = np.array([f.mean() for f in far]), np.array([f.std() for f in far])
    ax.fill_between(
        x,
        mean - std,
        mean + std,
        color=f"C{k}",
        alpha=0.15,
        label="baseline: layers ≥ 2 apart, mean ± std" + (" (sink excl.)" if sink else ""),
    )
    ax.plot(
        x,
        drift[sink],
        f"C{k}-o",
        ms=3,
        label="drift l -> l+1" + (", sink excluded" if sink else ""),
    )
ax.set(
    xlabel="layer l (transition l -> l+1)",
    ylabel="mean row TV distance (0-1)",
    title=f"layer drift, {MODEL}",
    ylim=(0, 1),
)
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The verdict, computed
#
# Claim 2 predicts that drift *falls* with depth. We fit a line to drift against the relative
# depth `l / (n_layers - 1)` and compare the mean drift of the last third of the transitions
# with that of the first third.


# %%
def settle(d):
    x = np.arange(len(d)) / max(len(d) - 1, 1)
    slope = np.polyfit(x, d, 1)[0]
    third = max(len(d) // 3, 1)
    return slope, d[:third].mean(), d[-third:].mean()


verdicts = {}
for sink in (False, True):
    slope, first, last = settle(drift[sink])
    falls = slope < 0 and last < first
    verdicts[sink] = falls
    print(
        f"{'sink excluded' if sink else 'plain walk   '}: slope {slope:+.3f} per unit depth, "
        f"first third {first:.3f}, last third {last:.3f} -> "
        + (
            "drift falls with depth (claim 2 supported)"
            if falls
            else "drift does not fall with depth (claim 2 not supported)"
        )
    )
if verdicts[False] != verdicts[True]:
    print("The two versions disagree: whether the walk settles depends on the attention sink.")

# %% [markdown]
# ## The attention sink across depth
#
# Fraction of each row's mass on key 0, averaged over queries `i >= 1`, against uniform causal
# attention (`1/(i+1)` on average). A rising sink mass can make the plain drift look small
# simply because every layer sends most rows to the same key; the sink-excluded drift above
# is the check.

# %%
sink_mass = np.array([w[:, 1:, 0].mean().item() for w in walks])
uniform = (1 / torch.arange(2, tokens.shape[-1] + 1).float()).mean().item()
fig, ax = plt.subplots(figsize=(7, 3.8))
ax.plot(range(n_layers), sink_mass, "-o", ms=3, label="model")
ax.axhline(uniform, color="k", ls="--", label="uniform causal attention")
ax.set(
    xlabel="layer",
    ylabel="mean W_i0 (fraction of row mass)",
    title="mass on the sink (key 0)",
    ylim=(0, 1),
)
ax.legend()
fig.tight_layout()
plt.show()
print(
    f"sink mass: first layer {sink_mass[0]:.3f}, max {sink_mass.max():.3f} at layer {sink_mass.argmax()}, "
    f"last layer {sink_mass[-1]:.3f}"
)

# %% [markdown]
# ## Spectra of the walk
#
# A causal walk is lower-triangular, so its eigenvalues are just its diagonal `W_ii` (how much
# each token listens to itself) and say little about the operator. Its singular values do: a
# walk that averages broadly has one large singular value and a fast decay; a walk that mostly
# copies from a few keys (self, previous token) keeps many values near 1. The grey line is
# uniform causal attention.

# %%
cmap = plt.get_cmap("viridis")
fig, ax = plt.subplots(figsize=(7.5, 4.2))
for layer in range(n_layers):
    s = torch.linalg.svdvals(walks[layer][0].double()).cpu()
    ax.plot(s, color=cmap(layer / max(n_layers - 1, 1)), lw=1)
n = tokens.shape[-1]
U = torch.tril(torch.ones(n, n, dtype=torch.float64))
U = U / U.sum(-1, keepdim=True)
ax.plot(torch.linalg.svdvals(U), color="0.5", lw=2, ls="--", label="uniform causal walk")
sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, n_layers - 1))
fig.colorbar(sm, ax=ax, label="layer")
ax.axhline(1, color="k", lw=0.8, ls=":", label="sigma = 1 (a permutation keeps all at 1)")
ax.set(
    yscale="log",
    ylim=(1e-4, None),  # the last few values of a near-singular walk drop to rounding level
    xlabel="index k (largest first)",
    ylabel="singular value sigma_k of W (log scale)",
    title=f"singular values of the walk by layer, {MODEL}, {n} tokens",
)
ax.legend()
fig.tight_layout()
plt.show()
